"""An engine plugin's link to the kvstore sidecar: where it is (address, token, TLS),
deadlines, one reconnect, a circuit breaker.

    link = SidecarLink(address, connect, identities, on_unreachable)
    hit = link.call("lookup", lookup_deadline_s(recompute_s), lambda kv: kv.lookup_tiers(...))
    link.release(lease_ids)
    link.close()

The engine must never wait on the sidecar longer than the sidecar could save it, so every call
has a deadline derived from what it saves (the helpers below) and ``call`` returns None — the
caller recomputes, or skips the save — instead of raising:

- breaker open: refused at once, no I/O;
- ``DeadlineExceeded``: not retried (a retry costs another full deadline); the breaker opens.
  The client is kept: its gRPC channel is sound, and the client has already dropped the data
  connection that timed out;
- ``Unavailable`` (a broken connection, nothing listening): the sidecar may have restarted, so
  the client is dropped and the call made once more on a new one, within the same deadline; a
  second failure opens the breaker;
- another ``KvStoreError``: the sidecar answered and refused (a full store, an expired lease):
  None, and the breaker closes (the sidecar is there).

Registering the identities (after every new client) goes first, inside the same deadline plus
``CONNECT_S``: a new client also pays for its channel, the ServerInfo and Attach calls and the
data port's hello. Every failure and every refused call is reported to ``on_unreachable`` with
the call's name.

Thread rules: none; each connector side (scheduler, worker) owns one link and uses it from its
own thread. Exceptions other than ``KvStoreError`` that ``fn`` raises pass through.

Where the sidecar is and how to reach it (``SidecarSettings``) is parsed here once, for both
engine plugins, from the keys their extra configs share, each with an environment default:

- ``address``: ``unix:///path`` (same host) or ``host:port``; default ``$KVSTORE_ADDRESS``;
- the bearer token: ``$KVSTORE_TOKEN``, or a file only its owner can read (``token_file``,
  default ``$KVSTORE_TOKEN_FILE``; a file group or others can read is refused, as ssh refuses
  such a key). A ``token`` key in the extra config still works, with a warning: the engines log
  their whole configuration at INFO, the token with it. The config's keys beat the environment;
  ``token`` and ``token_file`` together are an error;
- ``tls_ca_file``, ``tls_cert_file``, ``tls_key_file`` (TCP only; defaults ``$KVSTORE_TLS_CA``,
  ``$KVSTORE_TLS_CERT``, ``$KVSTORE_TLS_KEY``, as for the ``kvstore`` commands).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine_plugin.breaker import CircuitBreaker
from kvstore.address import Address, parse_address
from kvstore.client import Client, connect
from kvstore.errors import DeadlineExceeded, KvStoreError, NotFound, Unavailable
from kvstore.keys import ModelIdentity
from kvstore.secret_files import read_secret_file
from kvstore.tls import ClientTls

log = logging.getLogger(f"vllm.{__name__}")

_T = TypeVar("_T")

# A healthy sidecar answers a small call well within this even on a loaded 2-core CI host; below
# it, scheduling noise alone would open the breaker.
DEADLINE_FLOOR_S = 0.25
LOOKUP_CAP_S = 2.0  # a lookup is one round trip: longer than this, and the sidecar is not well
CONNECT_S = 1.0  # once per new client: channel, registration, ServerInfo, Attach, data-port hello
SAVE_SLOW_BYTES_PER_S = 100e6  # a save slower than this counts as hung


def lookup_deadline_s(recompute_s: float) -> float:
    """A lookup may cost at most what recomputing the request would (``recompute_s``: the
    predicted prefill of the tokens the engine does not hold), floored and capped."""
    return min(LOOKUP_CAP_S, max(DEADLINE_FLOOR_S, recompute_s))


def load_deadline_s(recompute_s: float) -> float:
    """A load that takes longer than recomputing its tokens has lost: give up then."""
    return max(DEADLINE_FLOOR_S, recompute_s)


def save_deadline_s(nbytes: int) -> float:
    return DEADLINE_FLOOR_S + nbytes / SAVE_SLOW_BYTES_PER_S


@dataclass(frozen=True)
class SidecarSettings:
    """The sidecar's address, token and TLS (the keys: the module docstring)."""

    address: Address
    token: str | None = field(default=None, repr=False)  # never in a log line or a traceback
    tls: ClientTls | None = None  # TCP addresses only

    @classmethod
    def parse(
        cls, extra: Mapping[str, Any], where: str, env: Mapping[str, str] = os.environ
    ) -> SidecarSettings:
        """``extra``: the engine's extra config; ``where``: its name, for errors and warnings."""
        text = str(extra.get("address") or env.get("KVSTORE_ADDRESS") or "")
        if not text:
            raise ValueError(f"{where} needs 'address' (unix:///path or host:port), or set $KVSTORE_ADDRESS")
        address = parse_address(text, f"{where} 'address'")
        tls = None
        if not address.same_host:
            ca, cert, key = (
                str(extra.get(name) or env.get(var) or "")
                for name, var in (
                    ("tls_ca_file", "KVSTORE_TLS_CA"),
                    ("tls_cert_file", "KVSTORE_TLS_CERT"),
                    ("tls_key_file", "KVSTORE_TLS_KEY"),
                )
            )
            tls = ClientTls(ca, cert, key) if ca or cert else None
        return cls(address, _token(extra, where, env), tls)

    def connect(self) -> Client:
        return connect(self.address, token=self.token, tls=self.tls)


def _token(extra: Mapping[str, Any], where: str, env: Mapping[str, str]) -> str | None:
    in_config, token_file = extra.get("token"), str(extra.get("token_file") or "")
    if in_config and token_file:
        raise ValueError(f"{where} names both 'token' and 'token_file': keep token_file")
    if in_config:
        log.warning(
            "%s carries the kvstore token, and the engine writes its configuration, token and "
            "all, to its log: give the token in $KVSTORE_TOKEN or in a file only you can read "
            "('token_file' or $KVSTORE_TOKEN_FILE) instead",
            where,
        )
        return str(in_config)
    if token_file:
        return read_secret_file(token_file, f"{where} 'token_file'")
    if env.get("KVSTORE_TOKEN"):
        return env["KVSTORE_TOKEN"]
    if env.get("KVSTORE_TOKEN_FILE"):
        return read_secret_file(env["KVSTORE_TOKEN_FILE"], "$KVSTORE_TOKEN_FILE")
    return None


def extra_number(
    extra: Mapping[str, Any], name: str, default: float, where: str, rule: str, fits: Callable[[float], bool]
) -> float:
    """``extra[name]`` (``default`` when absent) as a number that ``fits``; otherwise a
    ValueError saying it is ``rule`` ("a positive number"). ``where``: the extra config's name."""
    value = extra.get(name, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} {name!r} is {rule}, got {value!r}") from None
    if not fits(number):
        raise ValueError(f"{where} {name!r} is {rule}, got {number}")
    return number


class SidecarLink:
    def __init__(
        self,
        address: Address,
        connect: Callable[[], Client],
        identities: Sequence[ModelIdentity],
        on_unreachable: Callable[[str], None],
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.address = address
        self.breaker = breaker or CircuitBreaker()
        self._connect = connect
        self._identities = list(identities)
        self._on_unreachable = on_unreachable
        self._client: Client | None = None
        self._registered = False

    def call(self, what: str, timeout_s: float, fn: Callable[[Client], _T]) -> _T | None:
        """``fn(client)`` within ``timeout_s``; None when it cannot be had (see the module)."""
        if not self.breaker.allow():
            self._on_unreachable(what)
            log.debug("kvstore sidecar %s skipped: the breaker is open", what)
            return None
        end = time.monotonic() + timeout_s
        connect_allowed = False
        for attempt in (1, 2):
            if self._client is None:
                self._client, self._registered = self._connect(), False
            kv = self._client
            if not (self._registered or connect_allowed):
                end, connect_allowed = end + CONNECT_S, True
            try:
                with kv.deadline(end - time.monotonic()):
                    if not self._registered:
                        for identity in self._identities:
                            kv.register(identity)
                        self._registered = True
                    result = fn(kv)
            except DeadlineExceeded as exc:
                self._failed(what, exc)
                return None
            except Unavailable as exc:
                self._drop()
                if attempt == 1:
                    log.info("kvstore sidecar %s failed (%s); reconnecting once", what, exc)
                    continue
                self._failed(what, exc)
                return None
            except KvStoreError as exc:
                self._answered()
                log.warning("kvstore sidecar refused %s: %s", what, exc)
                return None
            self._answered()
            return result
        raise AssertionError("the loop returns")

    def release(self, lease_ids: Sequence[int]) -> None:
        """Release pins; an unknown or expired lease is no error (a restart forgot it, or it
        ran out). With no client, or the breaker open, the pins expire on their own."""
        if not lease_ids or self._client is None:
            return

        def release_all(kv: Client) -> None:
            for lease_id in lease_ids:
                try:
                    kv.release(lease_id, wait=False)  # no round trip on the data port
                except NotFound as exc:
                    log.debug("releasing lease %d: %s", lease_id, exc)

        self.call("release", DEADLINE_FLOOR_S, release_all)

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client, self._registered = None, False

    def _failed(self, what: str, exc: KvStoreError) -> None:
        was_closed = self.breaker.is_closed
        self.breaker.failed()
        self._on_unreachable(what)
        if was_closed:
            log.warning(
                "kvstore sidecar at %s: %s failed (%s); recomputing without it for %.1f s",
                self.address,
                what,
                exc,
                self.breaker.backoff_s,
            )
        else:
            log.info("kvstore sidecar still out (%s); next try in %.1f s", exc, self.breaker.backoff_s)

    def _answered(self) -> None:
        if not self.breaker.is_closed:
            log.info("kvstore sidecar at %s answers again", self.address)
        self.breaker.succeeded()
