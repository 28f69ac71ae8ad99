"""The ``mooncake`` remote tier: blocks in a Mooncake Store the user already runs.

A sidecar joins the store as a client that contributes no memory of its own (a global segment of
0 bytes): the blocks live in the segments of the store's storage nodes, placed and evicted by its
master. Calls are Mooncake's batch calls, one per ``get_many``/``put_many``/``contains``:
``get_batch``, ``put_batch``, ``batch_is_exist``, ``batch_remove``; ``delete_matching`` is one
``remove_by_regex`` over the escaped prefix. Values are ``tiers.remote.frame`` output, checked on
every read.

Keys are strings: ``key_prefix``, then the store's shared name of the tier key (the tenant
namespace in plain text, ``:``), then the rest of the key in hex, so a namespace's keys share a
prefix that invalidation can match. Mooncake has no access control: a tenant's sidecar asks only
for its own namespace, but anything that reaches the master can read every key (SECURITY.md).
Mooncake's client offers no per-key expiry (its ``ReplicateConfig`` has replicas, soft pins and
preferred segments; the master's lease TTL only keeps a block being read from eviction): a copy
past its tenant's retention is found by the read that meets it (its header's birth time,
``tiers.remote``), which deletes it and misses; until then it holds room and ``contains`` reports
it, so a lookup may name a block the restore then misses.

Failure (see ``tiers.remote``): Mooncake's client waits for a hung master or storage node
without a bound, so every call runs on a small pool of threads and is waited for ``timeout_s``;
past it the call reads as misses (writes dropped), is counted, and the store is skipped for the
backoff. A call still stuck holds its thread; when every thread is held, calls fail at once
instead of queueing behind them. A store that is down answers at once: ``batch_is_exist`` with
errors (counted, and the backoff starts), ``get_batch`` with empty values (misses). The client
is set up on first use, on the pool (by one thread; calls that come meanwhile wait for it), so
a sidecar starts while the store is down; Mooncake's setup holds the GIL while it retries (90 s
measured against a dead master, every thread of the sidecar stopped meanwhile), so it is called
only once the master accepts a connection and an HTTP metadata server answers within
``timeout_s``. A master that accepts connections but never
answers at that moment still stalls the sidecar for Mooncake's own retry period
(RELIABILITY.md).

Threads: every method may be called from any thread; Mooncake's client is called only from the
pool's threads.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from tiers.base import BytesLike, TierKey
from tiers.remote import Backoff, RemoteBlock, RemoteConfig, RemoteTier, RemoteUsage, frame, served

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_THREADS = 4
_LOCAL_BUFFER_BYTES = 64 << 20  # the client's staging buffer for transfers


class MooncakeTier(RemoteTier):
    name = "mooncake"

    def __init__(self, config: RemoteConfig, key_name: Callable[[bytes], bytes] | None = None) -> None:
        """``config.nodes``: the master alone; ``key_name``: a tier key (or a prefix of one) ->
        its name (default: the key in hex). What only this backend needs is checked here."""
        if len(config.nodes) != 1:
            raise ValueError(
                f"remote.backend = mooncake needs one remote.nodes: the master, got {config.nodes}"
            )
        if not config.metadata_server:
            raise ValueError("the mooncake tier needs remote.metadata_server (http://host:port/metadata)")
        if config.ttl_s > 0:
            raise ValueError("remote.ttl_s: Mooncake has no per-key expiry; its eviction is the retention")
        self.config = config
        self.master = config.nodes[0]
        self._key_name = key_name
        self._lock = threading.Lock()
        # one client setup at a time: two at once in one process (the first calls of a sidecar
        # arrive together) leave the calls on both waiting past timeout_s
        self._setup_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="kvstore-mooncake")
        self._busy = 0  # calls on the pool, finished or not
        self._store: Any = None  # MooncakeDistributedStore, set up on first use (on the pool)
        self._backoff = Backoff(config.backoff_s, config.max_backoff_s, config.timeout_s)
        self._counts = {"gets": 0, "hits": 0, "puts": 0, "failures": 0, "checksum_failures": 0, "expired": 0}
        self._closed = False

    # ----------------------------------------------------------------- the contract

    def contains(self, keys: Sequence[TierKey]) -> list[bool]:
        names = [self._key(k) for k in keys]
        codes = self._call(lambda store: list(store.batch_is_exist(names))) if names else []
        if codes is None:
            return [False] * len(keys)
        if any(c < 0 for c in codes):  # the store could not say: a master or node is gone
            self._failed(f"batch_is_exist answered {min(codes)}")
        return [c == 1 for c in codes]

    def get_many(
        self,
        keys: Sequence[TierKey],
        fingerprint: bytes,
        not_before_s: float = 0.0,
        born: list[float] | None = None,
    ) -> list[BytesLike | None]:
        self._count("gets", len(keys))
        names = [self._key(k) for k in keys]
        values = self._call(lambda store: list(store.get_batch(names))) if names else []
        # b"": not there
        return served(
            "mooncake", keys, values, fingerprint, not_before_s, born, self._count, self.delete_many
        )

    def put_many(self, blocks: Sequence[RemoteBlock]) -> int:
        now = time.time()
        blocks = [b for b in blocks if b.expires_s > now]  # past its retention already: not stored
        if not blocks:
            return 0
        names = [self._key(b.key) for b in blocks]
        values = [frame(b) for b in blocks]
        code = self._call(lambda store: int(store.put_batch(names, values)))
        if code is None:
            return 0
        if code != 0:  # refused (a full store, say): the whole batch is dropped
            log.info("mooncake tier: put_batch of %d blocks answered %d; dropped", len(blocks), code)
            self._count("failures", 1)
            return 0
        self._count("puts", len(blocks))
        return len(blocks)

    def delete_many(self, keys: Sequence[TierKey]) -> int:
        names = [self._key(k) for k in keys]
        # force: a block another sidecar is reading (its lease) goes too
        codes = self._call(lambda store: list(store.batch_remove(names, True))) if names else []
        return 0 if codes is None else sum(c == 0 for c in codes)

    def delete_matching(self, prefix: bytes, spare: bytes = b"") -> int:
        """One regex; with ``key_name`` (the builder's), the keys of fingerprint ``spare`` are
        kept by a look-ahead on the hex after ``<namespace>:``. Raw keys (no ``key_name``)
        cannot say where their fingerprint starts: there ``spare`` is not honoured."""
        pattern = "^" + re.escape(self._key(prefix))
        if spare and self._key_name is not None:
            kept = re.escape(self.config.key_prefix) + "[^:]*:" + spare.hex()
            pattern = "^(?!" + kept + ")" + pattern[1:]
        removed = self._call(lambda store: int(store.remove_by_regex(pattern, True)))
        return max(0, removed or 0)

    def usage(self) -> RemoteUsage:
        with self._lock:
            counts = dict(self._counts)
        return RemoteUsage(self.name, nodes=1, nodes_down=int(self._backoff.down()), **counts)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            # a hung store would hang close() too: it runs on the pool, not waited for
            self._pool.submit(store.close)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- plumbing

    def _key(self, raw: bytes) -> str:
        """``key_prefix``, then the plain part of the key's name (up to its first ``:``, which the
        namespace's percent-encoding keeps out of it), then the rest in hex; with no
        ``key_name``, the whole key in hex. Either way a prefix of a key names a prefix of its
        string."""
        if self._key_name is None:
            return self.config.key_prefix + bytes(raw).hex()
        plain, sep, rest = self._key_name(raw).partition(b":")
        if not sep:  # a name without a plain part
            return self.config.key_prefix + plain.hex()
        return self.config.key_prefix + plain.decode("ascii") + ":" + rest.hex()

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self._counts[name] += n

    def _call(self, fn: Callable[[Any], _T]) -> _T | None:
        """``fn(store)`` on the pool within ``timeout_s``; None when the store is in backoff,
        every thread is held by a stuck call, or this one fails or runs past the deadline."""
        if not self._backoff.ready():
            return None
        with self._lock:
            if self._closed:
                raise RuntimeError("the mooncake tier is closed")
            if self._busy >= _THREADS:
                held = True
            else:
                held = False
                self._busy += 1
        if held:
            self._failed("every client thread is held by a call the store has not answered")
            return None
        future: Future[_T] = self._pool.submit(self._run, fn)
        try:
            result = future.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            self._failed(f"no answer within {self.config.timeout_s:.1f} s")
            return None
        except (RuntimeError, OSError) as exc:  # the binding's failures: setup, a closed client
            self._failed(f"{type(exc).__name__}: {exc}")
            return None
        self._backoff.succeeded()
        return result

    def _run(self, fn: Callable[[Any], _T]) -> _T:
        try:
            return fn(self._connected())
        finally:
            with self._lock:
                self._busy -= 1

    def _connected(self) -> Any:
        """The store client, set up on first use (on a pool thread; the others wait for it)."""
        with self._lock:
            if self._store is not None:
                return self._store
        from mooncake.store import MooncakeDistributedStore  # the mooncake extra

        with self._setup_lock:
            with self._lock:
                if self._store is not None:  # set up by the thread this one waited for
                    return self._store
            c = self.config
            # setup holds the GIL while it retries a dead master (90 s measured): not blind
            _probe(c, self.master)
            store = MooncakeDistributedStore()
            code = store.setup(
                c.local_hostname,
                c.metadata_server,
                0,
                _LOCAL_BUFFER_BYTES,
                c.protocol,
                c.rdma_devices,
                self.master,
            )
            if code != 0:
                raise RuntimeError(f"the mooncake client's setup answered {code} (master {self.master})")
            with self._lock:
                if not self._closed:
                    self._store = store
                    return store
            store.close()  # the tier closed meanwhile
            raise RuntimeError("the mooncake tier is closed")

    def _failed(self, why: str) -> None:
        log.warning("mooncake tier: %s; backing off", why)
        self._count("failures", 1)
        self._backoff.failed()


def _probe(config: RemoteConfig, master: str) -> None:
    """Raise OSError unless the master accepts a connection and an HTTP metadata server answers,
    each within ``timeout_s``."""
    host, _, port = master.rpartition(":")
    socket.create_connection((host, int(port)), timeout=config.timeout_s).close()
    url = urllib.parse.urlsplit(config.metadata_server)
    if url.scheme not in ("http", "https"):
        return  # etcd, P2PHANDSHAKE, ...: Mooncake's own business
    try:
        with urllib.request.urlopen(config.metadata_server + "?key=kvstore-probe", timeout=config.timeout_s):
            pass
    except urllib.error.HTTPError:
        pass  # it answered: a missing key is a 404
