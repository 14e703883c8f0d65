"""`tenants.<name>` of a service configuration (pydantic): where a tenant's API keys come from, the tiers it
may use, whether it is an operator (`admin`), and its request rate limit. Re-exported by config.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RateLimitConfig(BaseModel):
    """A token bucket per tenant and router replica: `requests_per_s` sustained, `burst` at once. A request
    over it is answered 429 (`rate-limited`, with `retry-after`) before any tokenizing or routing."""

    model_config = ConfigDict(extra="forbid")

    requests_per_s: float = Field(gt=0)
    burst: int = Field(default=1, ge=1)


class TenantConfig(BaseModel):
    """API keys (bearer tokens) of one tenant and the tiers it may use.

    Keys come from at most one outside source besides the inline `api_keys`: `api_keys_env`, an environment
    variable read once at start-up, or `api_keys_file`, a file (comma- or line-separated keys, e.g. a key of
    a mounted Kubernetes Secret) that the router re-reads when it changes, so a rotation needs no restart."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[str] = Field(default_factory=list)
    api_keys_env: str | None = None                 # env var holding comma-separated keys (read at start-up)
    api_keys_file: str | None = None                # file holding the keys (re-read on change: keys.py)
    tiers: list[str] | Literal["*"] = "*"
    # an operator: may read /v1/kvtier/stats and each engine's health and last error (/health's detail)
    admin: bool = False
    rate_limit: RateLimitConfig | None = None       # None: unlimited

    @model_validator(mode="after")
    def _one_outside_source(self):
        if self.api_keys_env and self.api_keys_file:
            raise ValueError("a tenant's keys come from api_keys_env or api_keys_file, not both")
        return self

    @property
    def has_keys(self) -> bool:
        """Keys are configured (inline, or a source to read them from)."""
        return bool(self.api_keys or self.api_keys_env or self.api_keys_file)
