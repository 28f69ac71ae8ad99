"""Who is calling, and which namespace a request may touch. Enforced here, never trusted from
the request: a tenant is named by its bearer token (gRPC metadata ``authorization: Bearer T``)
or, on the Unix socket (mode 0600, so only the host's own user reaches it), by the configured
default tenant.

Namespaces: a tenant's blocks live in ``t/<tenant>``; a shared scope's in ``s/<scope>``, reachable
only by the tenants the configuration grants it to. The two can never collide, so identical
prompts from two tenants never share a block unless both use a scope granted to both.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.errors import FailedPrecondition, PermissionDenied, Unauthenticated
from kvstore.secret_files import read_owner_only
from kvstore.server.config import ServerSettings


@dataclass(frozen=True)
class Caller:
    tenant: str
    admin: bool

    @property
    def namespace(self) -> str:
        return tenant_namespace(self.tenant)


def tenant_namespace(tenant: str) -> str:
    return f"t/{tenant}"


def scope_namespace(scope: str) -> str:
    return f"s/{scope}"


def read_tokens_file(path: str, setting: str = "server.tokens_file") -> dict[str, str]:
    """``TOKEN=TENANT`` per line (``#`` comments, blank lines); refused unless only its owner
    can read it: a token file others can read is a leaked token. ``setting`` names the file in
    errors (``kvstore route --keys-file`` reads its API keys here too)."""
    text = read_owner_only(path, setting)
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        token, sep, tenant = line.partition("=")
        if not sep or not token.strip() or not tenant.strip():
            raise FailedPrecondition(f"{setting} {path}, line {number}: expected TOKEN=TENANT")
        tokens[token.strip()] = tenant.strip()
    return tokens


class Authenticator:
    def __init__(self, settings: ServerSettings) -> None:
        self._tokens = dict(settings.tokens)
        if settings.tokens_file:
            self._tokens.update(read_tokens_file(settings.tokens_file))
        self._unix_tenant = settings.unix_tenant
        self._admins = frozenset(settings.admins)
        self._scopes = {
            scope: frozenset(t.strip() for t in tenants.split(",") if t.strip())
            for scope, tenants in settings.shared_scopes.items()
        }

    def caller(self, metadata: Iterable[tuple[str, str | bytes]], peer: str) -> Caller:
        """The tenant behind a request; raises Unauthenticated."""
        token = None
        for name, value in metadata:
            if name == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, rest = text.partition(" ")
                if scheme.lower() != "bearer" or not rest:
                    raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
                token = rest.strip()
        if token is not None:
            tenant = self._tenant_of(token)
            if tenant is None:
                raise Unauthenticated("unknown bearer token")
            return Caller(tenant, tenant in self._admins)
        if peer.startswith("unix:"):
            return Caller(self._unix_tenant, self._unix_tenant in self._admins)
        raise Unauthenticated(
            "a bearer token is required over TCP (metadata 'authorization: Bearer <token>')"
        )

    def _tenant_of(self, token: str) -> str | None:
        # Constant-time comparison: a token's validity must not leak through timing.
        found = None
        for known, tenant in self._tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        return found

    def namespace(self, caller: Caller, scope: str) -> str:
        """The namespace a request of ``caller`` naming ``scope`` ("" for its own) works in."""
        if not scope:
            return caller.namespace
        if caller.tenant not in self._scopes.get(scope, frozenset()):
            raise PermissionDenied(f"tenant {caller.tenant!r} is not granted the shared scope {scope!r}")
        return scope_namespace(scope)
