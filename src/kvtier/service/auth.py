"""API keys -> tenants -> allowed tiers. `server.auth: open`: open mode (every tier, no check), never otherwise."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from .config import ServiceConfig

OPEN_TENANT = "open"


class AuthError(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Tenant:
    name: str
    tiers: frozenset[str]


class Authenticator:
    def __init__(self, cfg: ServiceConfig):
        self.open_mode = cfg.open_mode
        all_tiers = frozenset(t.name for t in cfg.tiers)
        self._open = Tenant(OPEN_TENANT, all_tiers)
        self._keys: list[tuple[bytes, Tenant]] = []
        keys = cfg.api_keys()   # ConfigError when a tenant's api_keys_env is unset or empty: no start
        for name, tc in cfg.tenants.items():
            allowed = frozenset(
                t.name for t in cfg.tiers
                if (tc.tiers == "*" or t.name in tc.tiers) and (t.tenants == "*" or name in t.tenants))
            tenant = Tenant(name, allowed)
            self._keys += [(key.encode(), tenant) for key in keys[name]]

    def tenant(self, authorization: str | None) -> Tenant:
        """The caller's tenant from an `Authorization: Bearer <key>` header."""
        if self.open_mode:
            return self._open
        if not authorization:
            raise AuthError("missing API key: send `Authorization: Bearer <key>`")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("malformed Authorization header: expected `Bearer <key>`")
        given = key.strip().encode()
        found = None
        for known, tenant in self._keys:  # compare against every key: no early exit timing signal
            if hmac.compare_digest(known, given):
                found = tenant
        if found is None:
            raise AuthError("invalid API key")
        return found
