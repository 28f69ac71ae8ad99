"""The kvstore client (``connect``, ``Client``; see ``client.py`` for the calls and their rules).

client.py               the Client: a facade with deadlines, its data calls delegated to one transport
transport.py            the Transport seam the three below implement, chosen once per client
grpc_transport.py       gRPC: the control calls, and data calls without a data port
dataport_transport.py   the raw data port over TCP
samehost_transport.py   its Unix twin, blocks read and written in place in the arena
mapping.py              the server's arena mapped into this process (same host)
connections.py          per-thread connections to the raw data port
dataport.py             one data-port connection (the protocol is ``kvstore.wire``)
inplace.py              same-host reads and writes pipelined in chunks
pool.py                 the per-thread receive pool ``get`` returns views of, reused once dropped
translate.py            the one place lower-layer failures become ``kvstore.errors`` classes
results.py              what the calls return
"""

from kvstore.client.client import Client, connect
from kvstore.client.results import Lookup, PendingWrite, ResolvedBlocks

__all__ = ["Client", "Lookup", "PendingWrite", "ResolvedBlocks", "connect"]
