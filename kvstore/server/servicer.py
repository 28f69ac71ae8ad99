"""The plumbing of the gRPC servicer of ``kvstore.v1.KvStore`` (``kvstore.server.service``).

Every RPC goes through ``_serve``: refuse while draining (UNAVAILABLE), authenticate the caller,
take one of its tenant's in-flight places, time the call, and send a ``KvStoreError`` as its
status (``kvstore.server.handlers.abort``, the one place errors become gRPC statuses). Any other
exception is a bug: gRPC logs it and answers UNKNOWN. A request can only reach its own tenant's
namespace or a shared scope granted to it (``kvstore.server.auth``); lease and reservation ids
are owned by the tenant that got them.

The calls are in ``control_calls`` (what a tenant or operator asks of the store as a whole,
audited where it removes anything) and ``service`` (the data calls), each class built on the
one before; the generated ``KvStoreServicer`` is the base (a method renamed in the proto fails
the type check there: ``@override``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvstore.errors import InvalidArgument, KvStoreError, ResourceExhausted, Unavailable
from kvstore.keys import Fingerprint
from kvstore.remote.layout import fits_layout
from kvstore.server.audit import AuditLog
from kvstore.server.auth import Authenticator, Caller
from kvstore.server.dataplane import DataPlane
from kvstore.server.fairness import SERVED_AT_ONCE_PER_TENANT, TenantShares
from kvstore.server.handlers import abort, register
from kvstore.server.metrics import Metrics
from kvstore.server.models import ModelRegistry
from kvstore.server.shredding import Shredder
from kvstore.server.stats import Connections, TokenCounts
from kvstore.store import Scope, TieredStore
from proto import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing_extensions import override as override
else:

    def override(method: Callable[..., Any]) -> Callable[..., Any]:  # typing.override is 3.12+
        return method


log = logging.getLogger("kvstore.server.service")

R = TypeVar("R")


class Servicer(pb_grpc.KvStoreServicer):
    """What every call shares: the store, the caller's authentication and places, the audit
    log, the models registered and the figures; see the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        auth: Authenticator,
        metrics: Metrics | None = None,
        models: ModelRegistry | None = None,
        max_requests_per_tenant: int = 8,
        stream_timeout_s: float = 60.0,
        audit: AuditLog | None = None,
        shredder: Shredder | None = None,
    ) -> None:
        self.store = store
        self.audit = audit  # invalidations, deletions, demotions, shreds: who, what, how many
        self.shredder = shredder or Shredder(store, audit)
        self.auth = auth
        self.metrics = metrics
        self.draining = threading.Event()
        self.data_port = 0  # set by the server when it runs a raw data port
        self.data_socket = ""  # likewise for its Unix-socket twin
        self.addresses: list[str] = []  # set by the server once it listens (for Stats)
        self.connections: Connections | None = None  # set by the server once it listens (for Stats)
        self._started = time.monotonic()
        self._models = models or ModelRegistry()
        self._tokens = TokenCounts()
        self._in_flight_lock = threading.Lock()
        self._max_in_flight = max_requests_per_tenant
        self._stream_timeout_s = stream_timeout_s
        self._in_flight: Counter[str] = Counter()  # per tenant
        # Of those in flight, the ones a worker runs at once (the data ports take the same places)
        self.shares = TenantShares(SERVED_AT_ONCE_PER_TENANT)
        self.plane = DataPlane(store, self.check_sizes, self.record_hits)  # both transports' bytes

    # ----------------------------------------------------------------- plumbing

    def _serve(
        self, method: str, context: grpc.ServicerContext, body: Callable[[Caller], R], slot: bool = True
    ) -> R:
        start = time.perf_counter()
        try:
            if self.draining.is_set():
                raise Unavailable("the server is draining; retry on another replica or after restart")
            caller = self.auth.caller(context.invocation_metadata(), context.peer())
            with self._slot(caller.tenant) if slot else contextlib.nullcontext():
                return body(caller)
        except KvStoreError as exc:
            abort(context, exc)
        finally:
            if self.metrics is not None and method:
                self.metrics.request_seconds.labels(method).observe(time.perf_counter() - start)

    @contextlib.contextmanager
    def _slot(self, tenant: str) -> Iterator[None]:
        """One of the tenant's ``max_requests_per_tenant`` in-flight places: the workers are
        shared, so one tenant's stalled calls must not take them all; then one of its places in
        ``shares`` (asleep until then), so that its calls in flight want the GIL no more than
        SERVED_AT_ONCE_PER_TENANT at a time."""
        with self._in_flight_lock:
            if self._in_flight[tenant] >= self._max_in_flight:
                raise ResourceExhausted(
                    f"tenant {tenant} has {self._max_in_flight} requests in flight already "
                    "(server.max_requests_per_tenant); retry when one is done"
                )
            self._in_flight[tenant] += 1
        try:
            with self.shares.place(tenant, self._stream_timeout_s):
                yield
        finally:
            with self._in_flight_lock:
                self._in_flight[tenant] -= 1

    def _audited(
        self,
        caller: Caller,
        action: str,
        namespace: str | None,
        fingerprint: bytes | None = None,
        keys: Sequence[bytes] = (),
    ) -> contextlib.AbstractContextManager[Callable[[int], None]]:
        """The audit log's record of an admin action around its body: written before the action
        takes effect, or the action refused (``AuditNotWritten``; ``kvstore.server.audit``)."""
        if self.audit is None:
            return contextlib.nullcontext(_ignore)
        return self.audit.action(
            caller.tenant, action, namespace=namespace, fingerprint=fingerprint, keys=keys
        )

    def _watchdog(self, context: grpc.ServicerContext) -> threading.Timer:
        """Cuts a stream still open after ``stream_timeout_s``: a stalled peer frees its worker."""
        timer = threading.Timer(self._stream_timeout_s, context.cancel)
        timer.daemon = True
        timer.start()
        return timer

    def _scope(self, caller: Caller, fingerprint: bytes, scope: str) -> Scope:
        return Scope(self.auth.namespace(caller, scope), Fingerprint(fingerprint))

    def check_sizes(self, fingerprint: bytes, sizes: Iterable[int]) -> None:
        identity = self._models.get(fingerprint)
        if identity is None:
            return
        expected = identity.block_bytes
        for size in sizes:
            if not fits_layout(size, expected):  # bare, or framed by a sidecar (its remote copies)
                raise InvalidArgument(
                    f"block of {size} B does not match the layout registered for fingerprint "
                    f"{fingerprint.hex()[:16]}: {expected} B per block"
                )

    def _tokens_per_block(self, fingerprint: bytes) -> int:
        identity = self._models.get(fingerprint)
        return identity.tokens_per_block if identity else 0

    def record_hits(self, caller: Caller, fingerprint: bytes, asked: int, tiers: Sequence[str]) -> None:
        tpb = self._tokens_per_block(fingerprint)
        if tpb:
            self._tokens.add(caller.tenant, asked * tpb, len(tiers) * tpb)
        if self.metrics is not None:
            self.metrics.record_lookup(caller.tenant, len(tiers), asked - len(tiers), tiers, tpb)

    @staticmethod
    def _unclaimed(context: grpc.ServicerContext, call: str, undo: Callable[[], None]) -> None:
        """A caller whose deadline passed (or who hung up) while the store worked never learns
        its lease id and can release nothing: release the pins now, not at their TTL (the data
        port's ``dataport_ops._caller_left`` does the same)."""
        if context.is_active():
            return
        with contextlib.suppress(KvStoreError):  # it expired meanwhile: nothing left to free
            undo()
        log.info("%s: the caller left before its answer (its deadline passed); pins released", call)

    def add_to(self, server: grpc.Server) -> None:
        """Register every RPC on ``server`` (``kvstore.server.handlers``)."""
        register(self, server)


def _ignore(outcome: int) -> None:
    """The outcome of an admin action when the audit log is off."""
