"""Eviction configuration: engine defaults (vLLM `additional_config["kvtier"]`) and per-request overrides
(`SamplingParams.extra_args`, flat `kvtier_*` keys so OpenAI `vllm_xargs` can carry them)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvtier.policies import EvictionPolicy, EvictionSchedule, PolicyError, make_policy
from kvtier.policies.base import ATTENTION, QUERIES

FULL = "full"  # the budget that means full attention (requests, tiers)
ELASTIC = "elastic"  # full attention until the engine runs out of blocks, then the request's floor

# Request keys accepted in SamplingParams.extra_args (and OpenAI `vllm_xargs`).
REQUEST_KEYS = {
    "kvtier_budget": "budget",
    "kvtier_policy": "policy",
    "kvtier_buffer": "buffer",
    "kvtier_protect_prompt": "protect_prompt",
    "kvtier_protect_prefix": "protect_prefix",
    "kvtier_sinks": "sinks",
    "kvtier_seed": "seed",
    "kvtier_params": "params",
    "kvtier_floor": "floor",
}


class EvictionConfigError(ValueError):
    """Bad eviction configuration; the message names the field."""


class EvictionSettings(BaseModel):
    """How to evict, less the budget: the fields a request spec (`EvictionSpec`) and a service tier
    (`kvtier.service.config.TierConfig`) share, declared once."""

    model_config = ConfigDict(extra="forbid")

    # A registered policy name (what requests and configs carry) or, in-process only, a policy instance
    # (the reference engine's probes run pinned policies that are not in the registry).
    policy: str | InstanceOf[EvictionPolicy] = "random"
    buffer: int = Field(default=64, gt=0)          # r: recent positions never evicted, rounds every r steps
    protect_prompt: bool | None = None
    sinks: int | None = Field(default=None, ge=0)
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("policy", mode="plain")
    @classmethod
    def _name_or_instance(cls, v):
        if isinstance(v, (str, EvictionPolicy)):
            return v
        raise PydanticCustomError("string_type", "Input should be a valid string")  # pydantic's own str error

    @property
    def policy_name(self) -> str:
        return self.policy if isinstance(self.policy, str) else getattr(self.policy, "name", type(self.policy).__name__)


class EvictionSpec(EvictionSettings):
    """What one request is served with, on the vLLM engine and on the reference engine alike.
    budget=None means full attention (no eviction)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget: int | None = Field(default=None, gt=0)
    # Protect only the first N prompt tokens (None: the policy's rule, i.e. the whole prompt when
    # protect_prompt is on). Multi-turn requests (resent history) and resumed partial rollouts set it to
    # the first turn / original prompt, so a context longer than K can still run compressed.
    protect_prefix: int | None = Field(default=None, ge=0)
    seed: int | None = None
    # Elastic (`kvtier_budget: elastic`): budget None and a floor K_min. The request runs at full attention;
    # when the engine would otherwise preempt (or could not admit the next request) for lack of blocks, the
    # scheduler tightens it once, to budget = floor (`tightened`), and it is a compressed request from
    # that round on (scheduler_side.SchedulerEviction.relieve). The floor stays on the tightened spec.
    floor: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _floor_is_elastic(self):
        if self.floor is not None and self.budget is not None and self.budget != self.floor:
            raise ValueError(f"floor {self.floor} applies to an elastic budget; budget {self.budget} is fixed")
        return self

    @field_validator("params", mode="before")
    @classmethod
    def _params_from_json(cls, v):
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kvtier_params must be a JSON object: {exc}") from None
        return v

    @property
    def compressed(self) -> bool:
        return self.budget is not None

    @property
    def elastic(self) -> bool:
        """An elastic request, tightened or not."""
        return self.floor is not None

    def tightened(self) -> "EvictionSpec":
        """This elastic spec at its floor (what a tightened request runs from then on)."""
        return self.model_copy(update={"budget": self.floor})

    def schedule(self) -> EvictionSchedule:
        return EvictionSchedule(budget=self.budget, buffer=self.buffer)

    def make_policy(self) -> EvictionPolicy:
        """The policy instance (shared between identical specs: policies hold no per-request state)."""
        if not isinstance(self.policy, str):
            return self.policy
        kw = self.policy_kwargs()
        try:
            key = json.dumps(kw, sort_keys=True)
        except TypeError:  # parameters that are not JSON (in-process callers' objects): built uncached
            return make_policy(self.policy, **kw)
        return _policy(self.policy, key)

    def policy_kwargs(self) -> dict[str, Any]:
        kw = dict(self.params)
        if self.protect_prompt is not None:
            kw["protect_prompt"] = self.protect_prompt
        if self.protect_prefix is not None:
            kw["protect_prefix"] = self.protect_prefix
        if self.sinks is not None:
            kw["sinks"] = self.sinks
        return kw

    def to_extra_args(self, *, xargs: bool = False) -> dict[str, Any]:
        """This spec as `SamplingParams.extra_args`: the whole request, never relying on the engine default.
        Full attention: {"kvtier_budget": "full"}. Compressed: budget, policy and buffer always, the optional
        fields when set. xargs=True: OpenAI `vllm_xargs` form (str/int/float only: protect_prompt as 0/1,
        params as a JSON string)."""
        if not self.compressed and not self.elastic:
            return {"kvtier_budget": FULL}
        if not isinstance(self.policy, str):
            raise PolicyError("a policy instance cannot be sent to the vLLM engine; use a registered name")
        return encode_request_args({
            "budget": self.budget if self.compressed and not self.elastic else ELASTIC, "floor": self.floor,
            "policy": self.policy, "buffer": self.buffer,
            "protect_prompt": self.protect_prompt, "protect_prefix": self.protect_prefix, "sinks": self.sinks,
            "seed": self.seed, "params": self.params or None}, xargs=xargs)

    def max_blocks(self, prompt_len: int, max_tokens: int, block_size: int) -> int:
        """Blocks this request can ever hold: the cache never exceeds max(prompt, K + 2r) entries (a prompt
        longer than K + 2r, possible with protect_prefix, is compacted to K + r at the first decode step,
        before that step's slot is allocated)."""
        total = prompt_len + max_tokens
        if self.compressed:     # an elastic request before tightening: full attention's
            total = min(total, max(prompt_len, self.budget + 2 * self.buffer))
        return -(-total // block_size)


def encode_request_args(fields: dict[str, Any], *, xargs: bool = False) -> dict[str, Any]:
    """Spec fields -> `kvtier_<field>` request keys; None values are left out (the engine default applies).
    No validation here: the engine validates what it receives (`resolve_request_spec`)."""
    out = {}
    for k, v in fields.items():
        if v is None:
            continue
        if xargs and isinstance(v, bool):
            v = int(v)
        elif xargs and isinstance(v, dict):
            v = json.dumps(v, sort_keys=True)
        out[f"kvtier_{k}"] = v
    return out


@lru_cache(maxsize=256)
def _policy(name: str, kwargs_json: str) -> EvictionPolicy:
    return make_policy(name, **json.loads(kwargs_json))


class EngineEvictionConfig(BaseModel):
    """`additional_config={"kvtier": {...}}` on the vLLM engine."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    default: EvictionSpec = Field(default_factory=EvictionSpec)
    # reserve: admit a compressed request only while every running request's bound fits the pool, so
    # compressed requests never cause a preemption. vllm: stock admission.
    admission: Literal["reserve", "vllm"] = "reserve"
    audit_log: str | None = None        # JSONL of keep-sets per round (off by default)
    query_window: int = Field(default=8, gt=0)  # recent queries kept per request/layer for query-reading policies

    @classmethod
    def from_vllm(cls, vllm_config) -> "EngineEvictionConfig | None":
        raw = (getattr(vllm_config, "additional_config", None) or {}).get("kvtier")
        if raw is None:
            return None
        try:
            cfg = cls.model_validate(raw)
        except ValidationError as exc:
            raise EvictionConfigError(f"additional_config.kvtier: {_fmt(exc)}") from None
        return cfg if cfg.enabled else None


def _fmt(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())


def resolve_request_spec(default: EvictionSpec, extra_args: dict[str, Any] | None) -> EvictionSpec:
    """Merge a request's `kvtier_*` extra_args over the engine default; unknown kvtier keys are errors."""
    extra_args = extra_args or {}
    unknown = [k for k in extra_args if k.startswith("kvtier_") and k not in REQUEST_KEYS]
    if unknown:
        raise EvictionConfigError(f"unknown request parameter(s) {unknown}; accepted: {sorted(REQUEST_KEYS)}")
    overrides = {REQUEST_KEYS[k]: v for k, v in extra_args.items() if k in REQUEST_KEYS}
    if not overrides:
        return default
    elastic = overrides.get("budget") == ELASTIC
    if elastic or overrides.get("budget") in (FULL, "none", 0) or ("budget" in overrides and overrides["budget"] is None):
        overrides["budget"] = None
    if "floor" in overrides and not elastic and not (default.elastic and "budget" not in overrides):
        raise EvictionConfigError("kvtier_floor applies only with kvtier_budget 'elastic'")
    merged = {**default.model_dump(), **overrides}
    if "budget" in overrides and not elastic:
        merged["floor"] = None              # a fixed budget (or full attention) replaces an elastic default
    elif elastic and merged.get("floor") is None:
        raise EvictionConfigError("kvtier_floor: required with kvtier_budget 'elastic' (the smallest budget K "
                                  "the request may be tightened to)")
    if "policy" in overrides and "params" not in overrides:
        merged["params"] = {}  # the default's params belong to the default's policy
    try:
        return EvictionSpec.model_validate(merged)
    except ValidationError as exc:
        raise EvictionConfigError("; ".join(
            f"kvtier_{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def validate_request(spec: EvictionSpec, prompt_len: int, **model_shape: int | None) -> None:
    """Reject what cannot be served: unknown policy or parameters, a prompt the budget cannot protect,
    a policy missing what only the request can supply (a policy's `check_serving`, e.g. triattention's
    calibration; `model_shape` = num_layers / num_kv_heads / head_dim when the caller knows them)."""
    if spec.elastic and not spec.compressed:
        policy = spec.make_policy()
        if reads := policy.needs & {QUERIES, ATTENTION}:
            raise EvictionConfigError(
                f"kvtier_policy {spec.policy_name!r} reads {sorted(reads)} from the start of a request, which an "
                "elastic request (full attention until tightened) does not capture; elastic is tested with "
                "policies that read keys or nothing (random, random_reserve, ...)")
        spec = spec.tightened()          # what it may become: the floor must hold the protected prompt
    if not spec.compressed:
        return
    try:
        policy = spec.make_policy()
        policy.check_budget(spec.budget, prompt_len)
        check = getattr(policy, "check_serving", None)
        if check is not None:
            check(**model_shape)
    except PolicyError as exc:
        raise EvictionConfigError(f"kvtier: {exc}") from None
