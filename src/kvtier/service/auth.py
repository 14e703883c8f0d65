"""API keys -> tenants -> allowed tiers, and the operator (admin) scope. `server.auth: open`: open mode (every
tier, every scope, no check), never otherwise.

Keys from `api_keys_file` (a mounted Kubernetes Secret's file) are re-read when the file changes, checked at
most every `reload_s` on the request path (a `stat` per file): a rotation takes effect within the kubelet's
Secret sync plus `reload_s`, with no restart. A file that disappears or empties on a reload leaves its tenant
without keys (fail closed: that is how a key is revoked) and logs an error; at start-up it is a ConfigError.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

from .config import ConfigError, ServiceConfig, tenant_keys

OPEN_TENANT = "open"
RELOAD_S = 5.0
logger = logging.getLogger("kvtier.service")


class AuthError(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Tenant:
    name: str
    tiers: frozenset[str]
    admin: bool = False     # may read /v1/kvtier/stats and the engines' health detail


def _stamp(path: str) -> tuple | None:
    """What changes when a file is rewritten or its Secret's symlink is swapped; None: it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class Authenticator:
    """`tenant(authorization)` -> the caller's Tenant, or AuthError. Reads every tenant's keys at construction
    (ConfigError when one's variable or file holds none: the replica does not start)."""

    def __init__(self, cfg: ServiceConfig, reload_s: float = RELOAD_S, clock: Callable[[], float] = time.monotonic):
        self.open_mode = cfg.open_mode
        self._cfg, self._reload_s, self._clock = cfg, reload_s, clock
        self._open = Tenant(OPEN_TENANT, frozenset(t.name for t in cfg.tiers), admin=True)
        self._tenants = {
            name: Tenant(name, frozenset(t.name for t in cfg.tiers
                                         if (tc.tiers == "*" or t.name in tc.tiers)
                                         and (t.tenants == "*" or name in t.tenants)), admin=tc.admin)
            for name, tc in cfg.tenants.items()}
        self._files = {name: tc.api_keys_file for name, tc in cfg.tenants.items() if tc.api_keys_file}
        self._stamps = {name: _stamp(path) for name, path in self._files.items()}
        self._by_tenant = cfg.api_keys()   # ConfigError when a tenant's variable or file holds no key: no start
        self._checked_at = clock()
        self._index()

    def _index(self) -> None:
        self._keys = [(key.encode(), self._tenants[name]) for name, keys in self._by_tenant.items() for key in keys]

    def reload(self, force: bool = False) -> list[str]:
        """Re-read the key files that changed since the last look (all with `force`); the tenants reloaded."""
        now = self._clock()
        if not self._files or (not force and now - self._checked_at < self._reload_s):
            return []
        self._checked_at = now
        changed = [n for n, p in self._files.items() if force or _stamp(p) != self._stamps[n]]
        for name in changed:
            self._stamps[name] = _stamp(self._files[name])
            try:
                self._by_tenant[name] = tenant_keys(name, self._cfg.tenants[name])
                logger.info("kvtier: reloaded the API keys of tenant %r (%d)", name, len(self._by_tenant[name]))
            except ConfigError as exc:
                self._by_tenant[name] = list(self._cfg.tenants[name].api_keys)
                logger.error("kvtier: %s; the tenant's file keys are revoked until it holds keys again", exc)
        if changed:
            self._index()
        return changed

    def tenant(self, authorization: str | None) -> Tenant:
        """The caller's tenant from an `Authorization: Bearer <key>` header."""
        if self.open_mode:
            return self._open
        self.reload()
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
