"""The kvstore server: everything ``kvstore serve`` runs, and nothing a client imports.

    serve.py       the process: listeners, health, reflection, metrics, the drain on SIGTERM
    service.py     the gRPC servicer of ``kvstore.v1.KvStore``
    dataplane.py   batching, leases, reservations and size checks under both transports
    dataport.py    the raw data port (TCP and its Unix twin) over the data plane
    auth.py        tenants from tokens, their scopes and limits;  audit.py  the audit log
    shredding.py   a tenant's key and copies dropped: on Shred, or when its key file goes
    models.py      the model registry;  metrics.py  Prometheus
    config.py      settings parsed once into frozen dataclasses
    builder.py     tiers built in order into a TieredStore;  datadir.py  the data folder

Tests and benchmarks start a server in process with ``start_server(load_settings(...))``.
"""

from kvstore.server.serve import RunningServer, serve, start_server

__all__ = ["RunningServer", "serve", "start_server"]
