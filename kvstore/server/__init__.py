"""The kvstore server: everything ``kvstore serve`` runs, and nothing a client imports.

    serve.py       the process: listeners, health, reflection, metrics, the drain on SIGTERM
    servicer.py    the gRPC servicer's plumbing: draining, authentication, per-tenant places
    control_calls.py  its control calls (Register, Delete, Invalidate, Demote, Shred, Stats)
    service.py     its data calls: the servicer of ``kvstore.v1.KvStore``
    handlers.py    the one place a ``KvStoreError`` becomes a gRPC status; handler registration
    dataplane.py   batching, leases, reservations and size checks under both transports
    dataport.py    the raw data port (TCP and its Unix twin): connections, hellos, limits
    dataport_ops.py  its operations, each request served over the data plane
    answering.py   the data port's loop: its connections between requests, the small ones answered
    workers.py     the data port's pool that serves the rest, tenants in turn
    fairness.py    request threads shared per tenant first
    auth.py        tenants from tokens, their scopes and limits;  audit.py  the audit log
    shredding.py   a tenant's key and copies dropped: on Shred, or when its key file goes
    models.py      the model registry;  stats.py  what Stats answers
    metrics.py     Prometheus;  metrics_store.py  the store's figures;  metrics_http.py  its port
    events.py      the store's KV cache events, published over ZMQ
    config.py      settings parsed once into frozen dataclasses (settings_reference.py: the docs)
    builder.py     tiers built in order into a TieredStore;  datadir.py  the data folder

Tests and benchmarks start a server in process with ``start_server(load_settings(...))``.
"""

from kvstore.server.serve import RunningServer, serve, start_server

__all__ = ["RunningServer", "serve", "start_server"]
