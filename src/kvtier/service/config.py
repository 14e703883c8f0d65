"""The service configuration (YAML, validated by pydantic): engine deployments, tiers, tenants, routing.

One engine deployment hosts one compressed vLLM engine per replica; several tiers may share it (the
budget travels with each request as `vllm_xargs`), or a tier may have an engine of its own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvtier.engine.config import ELASTIC, FULL, EngineEvictionConfig, EvictionSettings, EvictionSpec
from kvtier.models.reasoner import SHIPPED

from .server_config import ServerConfig
from .tenant_config import RateLimitConfig, TenantConfig

__all__ = ["ConfigError", "EngineConfig", "PressureConfig", "RateLimitConfig", "RoutingConfig", "ServerConfig",
           "ServiceConfig", "TenantConfig", "TierConfig", "load_config", "parse_config", "parse_bytes"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"
TINY_MODEL = "tiny"  # engines.<name>.model: build/use the deterministic tiny Qwen3 (kvtier.models.tiny)
# engines.<name>.model: a shipped reasoner checkpoint's name (kvtier.models.reasoner.SHIPPED)
REASONER_MODELS = tuple(SHIPPED)


class ConfigError(ValueError):
    """A service configuration that cannot be served; the message names the field."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PressureConfig(_Model):
    """When an engine counts as under KV pressure (either threshold reached)."""

    kv_usage: float = Field(default=0.9, gt=0, le=1)   # share of the engine's KV pool in use
    queue_depth: int = Field(default=8, ge=0)          # requests waiting in the engine's scheduler


class EngineConfig(_Model):
    """One engine deployment: a model, its vLLM arguments, kvtier defaults and Serve options."""

    model: str = TINY_MODEL                         # local path, HF id, "tiny" or a shipped reasoner; in a
    # config file, "." or "./..." / "../..." is relative to the file (a model directory carrying its service.yaml)
    model_id: str | None = None                     # public name in /v1/models (default: the engine name)
    accelerator: Literal["cpu", "gpu"] = "cpu"
    accelerator_type: str | None = None             # e.g. "H100" (GPU only)
    max_model_len: int = Field(gt=0)
    kv_cache_bytes: int | None = Field(default=None, gt=0)  # None: vLLM's default sizing
    # vLLM's prefix caching (its default): with eviction a compressed request shares only the whole blocks of
    # its protected prompt (engine/scheduler_side.prefix_cache_caps)
    enable_prefix_caching: bool = True
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    eviction: EngineEvictionConfig = Field(default_factory=EngineEvictionConfig)
    # Ray Serve options: num_replicas or autoscaling_config, ray_actor_options (e.g. resources to pin
    # engines to nodes), max_ongoing_requests, health_check_period_s ...
    deployment: dict[str, Any] = Field(default_factory=lambda: {"num_replicas": 1})
    pressure: PressureConfig = Field(default_factory=PressureConfig)
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    # How long vLLM's engine core and workers busy-wait on their shared-memory queues after each message
    # before sleeping on the queue's socket (None: vLLM's 1 s). The engine core spins while a worker
    # computes, a whole core; 0 frees it but every step then waits on socket wake-ups: on the 2-core CPU
    # box that cost more than it freed (idle TPOT 1.8x, docs/serving.md), so the default is vLLM's.
    shm_spin_s: float | None = Field(default=None, ge=0)

    @field_validator("kv_cache_bytes", mode="before")
    @classmethod
    def _bytes(cls, v):
        return parse_bytes(v) if isinstance(v, str) else v

    @field_validator("engine_kwargs")
    @classmethod
    def _no_managed_keys(cls, v):
        managed = {"model", "max_model_len", "additional_config", "enable_prefix_caching", "kv_cache_memory_bytes"}
        if bad := sorted(managed & set(v)):
            raise ValueError(f"set {bad} through the engine's own fields (model, max_model_len, eviction, "
                             "kv_cache_bytes, enable_prefix_caching)")
        return v


class TierConfig(EvictionSettings):
    """A memory tier: a KV budget (or full attention) and a policy, served by one engine deployment.
    The eviction fields (policy, buffer, protect_prompt, sinks, params) are the request spec's own;
    `spec` is the request this tier sends."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    engine: str
    # K, "full", or "elastic": full attention while the engine has blocks, tightened to `floor` when it runs
    # out (engine/elastic.py)
    budget: int | Literal["full", "elastic"] = FULL
    floor: int | None = Field(default=None, gt=0)   # K_min of an elastic tier
    auto: bool = True                               # the router may pick it; False: explicit requests only
    tenants: list[str] | Literal["*"] = "*"         # who may use it (tenant names), "*" = everyone
    description: str = ""

    @field_validator("budget")
    @classmethod
    def _budget(cls, v):
        if isinstance(v, int) and v <= 0:
            raise ValueError("budget must be a positive number of KV entries per head, or 'full'")
        return v

    @model_validator(mode="after")
    def _elastic_floor(self):
        if self.elastic and self.floor is None:
            raise ValueError(f"tier {self.name!r}: budget 'elastic' needs `floor` (the smallest K a request may be "
                             "tightened to)")
        if not self.elastic and self.floor is not None:
            raise ValueError(f"tier {self.name!r}: `floor` applies only to budget 'elastic' (budget is {self.budget!r})")
        if self.elastic:
            from kvtier.policies.base import ATTENTION, QUERIES

            if reads := self.spec.make_policy().needs & {QUERIES, ATTENTION}:
                raise ValueError(f"tier {self.name!r}: policy {self.policy!r} reads {sorted(reads)} from the start of a "
                                 "request, which an elastic request (full attention until tightened) does not capture; "
                                 "elastic is tested with policies that read keys or nothing (random, random_reserve)")
            protected = self.spec.tightened().make_policy().protected_len(0)   # sinks / protect_prefix alone
            if protected > self.floor:
                raise ValueError(f"tier {self.name!r}: floor {self.floor} cannot hold the {protected} positions its "
                                 "policy always protects (sinks / protect_prefix)")
        return self

    @property
    def compressed(self) -> bool:
        """A fixed budget K (not full attention, not elastic)."""
        return isinstance(self.budget, int)

    @property
    def elastic(self) -> bool:
        return self.budget == ELASTIC

    @property
    def bound_budget(self) -> int | None:
        """The K that bounds a request's cache in this tier: the budget, an elastic tier's floor, None (full)."""
        return self.budget if self.compressed else self.floor

    @property
    def spec(self) -> EvictionSpec:
        """The request spec of this tier (budget 'full' -> None; 'elastic' -> None with the floor)."""
        settings = {k: getattr(self, k) for k in EvictionSettings.model_fields}
        return EvictionSpec(budget=self.budget if self.compressed else None, floor=self.floor, **settings)

    def extra_args(self) -> dict[str, Any]:
        """`vllm_xargs` for requests of this tier (OpenAI vllm_xargs carry str/int/float only)."""
        return self.spec.to_extra_args(xargs=True)


class RoutingConfig(_Model):
    # A compressed tier fits a prompt only if it leaves at least this share of K for the trace
    # (paper §4.2: code prompts use up to half of K=3072).
    min_trace_share: float = Field(default=0.5, ge=0, lt=1)
    # Under KV pressure: "fallback" to the next smaller-budget tier that fits (queue if none),
    # or "queue" (send to the chosen tier anyway and let the engine queue it).
    on_pressure: Literal["fallback", "queue"] = "fallback"
    # "headroom": the largest budget (full attention first) whose KV bound fits the engine's free blocks now,
    # else the elastic tier (its floor); "cheapest-fit": the smallest budget that leaves min_trace_share of
    # K for the trace (then `on_pressure`). service/routing.py has both rules.
    rule: Literal["headroom", "cheapest-fit"] = "headroom"
    tier_header: str = "x-kvtier-tier"
    reason_header: str = "x-kvtier-reason"


class ServiceConfig(_Model):
    engines: dict[str, EngineConfig]
    tiers: list[TierConfig]
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @model_validator(mode="after")
    def _cross_check(self):
        if not self.engines:
            raise ValueError("engines: at least one engine deployment is required")
        if not self.tiers:
            raise ValueError("tiers: at least one tier is required")
        names = [t.name for t in self.tiers]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"tiers: duplicate names {dup}")
        for t in self.tiers:
            if t.engine not in self.engines:
                raise ValueError(f"tier {t.name!r}: unknown engine {t.engine!r} (engines: {sorted(self.engines)})")
            if t.tenants != "*" and (bad := sorted(set(t.tenants) - set(self.tenants))):
                raise ValueError(f"tier {t.name!r}: unknown tenants {bad}")
            if t.compressed and t.budget >= self.engines[t.engine].max_model_len:
                raise ValueError(f"tier {t.name!r}: budget {t.budget} is not below the engine's max_model_len")
            if t.elastic and t.floor >= self.engines[t.engine].max_model_len:
                raise ValueError(f"tier {t.name!r}: floor {t.floor} is not below the engine's max_model_len "
                                 f"{self.engines[t.engine].max_model_len}")
        for name, tenant in self.tenants.items():
            if tenant.tiers != "*" and (bad := sorted(set(tenant.tiers) - set(names))):
                raise ValueError(f"tenant {name!r}: unknown tiers {bad}")
        seen: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            for key in tenant.api_keys:
                if key in seen:
                    raise ValueError(f"tenants {seen[key]!r} and {name!r} share an API key")
                seen[key] = name
        # Static only: api_keys_env is read where the keys are used (api_keys()), since configs are also
        # validated where the variables are absent (kvtier k8s serve-config, tests).
        if self.server.auth == "open" and self.tenants:
            raise ValueError(f"server.auth 'open' serves every caller every tier without a key, yet tenants "
                             f"{sorted(self.tenants)} are configured: remove them or set `server.auth: keys`")
        if self.server.auth == "keys" and not any(t.has_keys for t in self.tenants.values()):
            raise ValueError("server.auth 'keys' (the default) needs API keys: configure tenants with api_keys or "
                             "api_keys_env, or set `server.auth: open` to serve without authentication")
        return self

    # -- derived views ---------------------------------------------------------------------------
    def model_id(self, engine: str) -> str:
        return self.engines[engine].model_id or engine

    @property
    def model_ids(self) -> list[str]:
        return sorted({self.model_id(e) for e in self.engines})

    def tier(self, name: str) -> TierConfig | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def open_mode(self) -> bool:
        """`server.auth: open`: every caller is the anonymous tenant with every tier."""
        return self.server.auth == "open"

    def api_keys(self) -> dict[str, list[str]]:
        """Each tenant's API keys, its api_keys_env / api_keys_file read now: call it where the keys are used at
        start-up (kvtier serve, the router replica). A variable or file that is missing or holds no key is a
        ConfigError naming it: it would leave the tenant without keys, silently."""
        return {name: tenant_keys(name, t) for name, t in self.tenants.items()}


def split_keys(text: str) -> list[str]:
    """Keys separated by commas and/or newlines, blanks dropped."""
    return [k.strip() for k in text.replace("\n", ",").split(",") if k.strip()]


def tenant_keys(name: str, t: TenantConfig) -> list[str]:
    """One tenant's keys: inline, plus its variable's or its file's (ConfigError when that holds none)."""
    keys = list(t.api_keys)
    if t.api_keys_env:
        found = split_keys(os.environ.get(t.api_keys_env, ""))
        if not found:
            why = "is not set" if t.api_keys_env not in os.environ else "holds no key"
            raise ConfigError(f"tenant {name!r}: api_keys_env {t.api_keys_env} {why} in this environment "
                              "(expected the tenant's comma-separated API keys)")
        keys += found
    if t.api_keys_file:
        try:
            found = split_keys(Path(t.api_keys_file).read_text(encoding="utf-8"))
            why = "holds no key"
        except OSError as exc:
            found, why = [], f"cannot be read ({exc.strerror or exc})"
        if not found:
            raise ConfigError(f"tenant {name!r}: api_keys_file {t.api_keys_file} {why} "
                              "(expected the tenant's comma- or line-separated API keys)")
        keys += found
    return keys


_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_bytes(v: str) -> int:
    """'64MiB' -> 67108864, '1G' -> 10**9, '4096' -> 4096."""
    m = _BYTES.match(v)
    if not m:
        raise ValueError(f"not a byte size: {v!r} (e.g. 64MiB, 2GiB, 1000000)")
    unit = (m.group(2) or "").upper().rstrip("B")
    return int(float(m.group(1)) * _UNITS[unit])


def _fmt(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())


def parse_config(data: dict[str, Any], source: str = "<config>") -> ServiceConfig:
    try:
        return ServiceConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_fmt(exc)}") from None


def with_config_relative_models(data: dict[str, Any], config_file: Path) -> dict[str, Any]:
    """`data` with each engine's `model` written as "." or "./..." / "../..." resolved against the directory of
    `config_file`; other values (absolute paths, HF ids such as Qwen/Qwen3-8B, shipped names) are kept."""
    engines = data.get("engines")
    if not isinstance(engines, dict):
        return data
    out = {**data, "engines": dict(engines)}
    for name, eng in engines.items():
        model = eng.get("model") if isinstance(eng, dict) else None
        if isinstance(model, str) and (model == "." or model.startswith(("./", "../"))):
            out["engines"][name] = {**eng, "model": str((Path(config_file).resolve().parent / model).resolve())}
    return out


def load_config(path: str | Path | None = None) -> ServiceConfig:
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return parse_config(with_config_relative_models(data, path), str(path))
