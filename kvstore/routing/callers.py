"""Who is calling the router, and what they may see.

``Callers(keys, ops_tenants, ops_loopback)``: ``keys`` maps an API key (``Authorization: Bearer
KEY``) to its tenant, compared in constant time. With keys, a request without a known key is
refused (``Refused``, the router's 401); with none, every caller is one anonymous tenant (``""``)
and the engines' own keys, if any, are the only check.

A request's cache salt is always the router's: ``tenant_salt(secret, tenant, asked)`` is an
HMAC-SHA256, keyed by the router's salt secret, of the tenant and the salt the caller asked for
(namespaced, so a tenant can still keep its own requests apart, and no caller can name another
tenant's salt: the tenant is length-prefixed into the message). The engines and their sidecars
key blocks by it, so two tenants' identical prompts never share a block, a hit, or a timing. It is
keyed so that a caller who reaches an engine directly cannot compute another tenant's salt from
its name and probe which of its prompts are cached. The same secret gives the same salts on
every router of a fleet and across restarts, so the engines' caches stay warm.

``/metrics`` and ``/health`` (the fleet's hit figures, replicas up and down) are for operators:
a key of one of ``ops_tenants``, or, with ``ops_loopback``, any request from a loopback address
(a probe on the router's own host; off by default, since a proxy on the same host makes every
caller look local).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping

ANONYMOUS = ""


class Refused(Exception):
    """The caller is not known (401); the message says why, for the caller."""


def tenant_salt(secret: bytes, tenant: str, asked: str = "") -> str:
    t, a = tenant.encode(), asked.encode()
    digest = hmac.new(secret, b"kvstore-route-salt\0" + len(t).to_bytes(8, "big") + t + a, hashlib.sha256)
    return "kvstore-" + digest.hexdigest()


class Callers:
    def __init__(
        self,
        keys: Mapping[str, str] | None = None,
        ops_tenants: frozenset[str] = frozenset(),
        ops_loopback: bool = False,
    ) -> None:
        self._keys = [(k.encode(), tenant) for k, tenant in (keys or {}).items()]
        self._ops_tenants = ops_tenants
        self._ops_loopback = ops_loopback

    @property
    def keyed(self) -> bool:
        return bool(self._keys)

    def _tenant_of_key(self, authorization: str | None) -> str | None:
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        given = key.strip().encode()
        found = None
        for known, tenant in self._keys:  # every key compared: validity must not leak by timing
            if hmac.compare_digest(known, given):
                found = tenant
        return found

    def tenant(self, authorization: str | None) -> str:
        """The tenant of a routed request's ``Authorization`` header; raises ``Refused``."""
        if not self._keys:
            return ANONYMOUS
        tenant = self._tenant_of_key(authorization)
        if tenant is None:
            raise Refused("a valid API key is required (Authorization: Bearer <key>)")
        return tenant

    def may_operate(self, authorization: str | None, peer: str | None) -> bool:
        """Whether a request may read ``/metrics`` and ``/health``."""
        tenant = self._tenant_of_key(authorization)
        if tenant is not None and tenant in self._ops_tenants:
            return True
        if self._ops_loopback and peer:
            try:
                return ipaddress.ip_address(peer).is_loopback
            except ValueError:
                return False
        return False
