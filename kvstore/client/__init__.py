"""The kvstore client (``connect``, ``Client``; see ``client.py`` for the calls and their rules).

client.py        the Client: control calls over the generated stub, the gRPC Get/Put streams,
                 the same-host arena calls, deadlines
connections.py   its per-thread connections to the raw data port
dataport.py      one data-port connection (the protocol is ``kvstore.wire``)
pool.py          the per-thread receive pool ``get`` returns views of, reused once dropped
translate.py     the one place lower-layer failures become ``kvstore.errors`` classes
results.py       what the calls return
"""

from kvstore.client.client import Client, connect
from kvstore.client.results import Lookup, PendingWrite, ResolvedBlocks

__all__ = ["Client", "Lookup", "PendingWrite", "ResolvedBlocks", "connect"]
