"""From verl's rollout config to the compressed engine: eviction settings and vLLM engine arguments.

Where the knobs live in a verl config (`actor_rollout_ref.rollout`):

```yaml
name: kvtier
custom:
  kvtier:                      # engine-wide eviction default (kvtier.engine.config.EvictionSpec fields)
    policy: random
    budget: 2048               # K per KV head; null = full attention (no eviction)
    buffer: 64                 # r: newest tokens never evicted, round cadence
    protect_prompt: null       # policy default (random: true)
    sinks: null
    seed: null
    params: {}
    admission: reserve         # reserve | vllm (see EngineEvictionConfig)
    audit_log: null            # JSONL of keep-sets per eviction round (debugging, tests)
    query_window: 8
    kv_cache_bytes: null       # KV pool size in bytes (CPU; on GPU gpu_memory_utilization applies)
    server_num_cpus: null      # Ray CPUs reserved by each server actor (default: 1 on CPU clusters, 0 on GPU)
    protect: all               # how much of a request's prompt is protected when its policy protects the
                               # prompt: all (the paper's rule) | first_turn (multi-turn: the first turn;
                               # resumed partial rollout: the original prompt) | N (the first N tokens)
    val_budget: full           # validation generations: full (full attention) | K | train (same as training)
    full_share: 0.0            # share of each GRPO group's training samples generated at full attention
                               # (the first round(full_share * n) of each group; an anchor, as eviction
                               # training mixes full-attention samples; needs KVTierAgentLoopManager)
    learner: dense             # dense | replay: the actor's log-probs under each sample's own eviction
                               # (kvtier.rollout.learner_replay; needs model.model_type=kvtier_replay)
engine_kwargs:
  kvtier: {}                   # extra vLLM engine arguments, like engine_kwargs.vllm for verl's vLLM backend
```

Per request, a `kvtier_*` key in verl's sampling params (`kvtier_budget`, `kvtier_policy`,
`kvtier_buffer`, `kvtier_protect_prefix`, ...) overrides the default for that request only (see
`split_request_params`).

`protect: first_turn` is resolved by the server per trajectory: verl's tool agent loop and its fully-async
client resubmit the growing context (history + new turn, or prompt + partial output) for one trajectory,
but each call reaches the server under a fresh request id unless `full_determinism` is set; kvtier's
agent-loop client (`sample_counters.CountingClientMixin`) therefore sends the trajectory's id as
`kvtier_session`, the server remembers the first prompt of each session and protects only that prefix of
a later prompt that starts with it. `val_budget` needs
`rollout.agent.agent_loop_manager_class: kvtier.rollout.trainer_hooks.KVTierAgentLoopManager` (verl marks
validation in its agent-loop workers only; see `trainer_hooks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvtier.engine.config import REQUEST_KEYS, EngineEvictionConfig, EvictionConfigError, EvictionSpec

logger = logging.getLogger("kvtier.rollout")

ENGINE_KWARGS_KEY = "kvtier"
WORKER_EXTENSION = "kvtier.rollout.worker_ext.KVTierWorkerExtension"
_SPEC_FIELDS = set(EvictionSpec.model_fields)
_ENGINE_FIELDS = {"enabled", "admission", "audit_log", "query_window"}
_ROLLOUT_FIELDS = {"kv_cache_bytes", "server_num_cpus", "protect", "val_budget", "learner", "full_share"}
LEARNERS = ("dense", "replay")
PROTECT_MODES = ("all", "first_turn")


def _parse_protect(value) -> str | int:
    if value is None:
        return "all"
    if isinstance(value, bool):
        raise EvictionConfigError(f"actor_rollout_ref.rollout.custom.kvtier.protect: expected all, first_turn or a "
                                  f"token count, got {value!r}")
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in PROTECT_MODES:
        return value.strip().lower()
    raise EvictionConfigError(f"actor_rollout_ref.rollout.custom.kvtier.protect: expected all, first_turn or a "
                              f"token count, got {value!r}")


def _parse_val_budget(value) -> str | int:
    if value is None:
        return "full"
    if isinstance(value, str) and value.strip().lower() in ("full", "none", "train"):
        v = value.strip().lower()
        return "full" if v == "none" else v
    if isinstance(value, (int, str)) and not isinstance(value, bool) and str(value).strip().isdigit() \
            and int(value) > 0:
        return int(value)
    raise EvictionConfigError(f"actor_rollout_ref.rollout.custom.kvtier.val_budget: expected full, train or a "
                              f"budget K > 0, got {value!r}")


def parse_full_share(value) -> float:
    """`custom.kvtier.full_share` as a float in [0, 1) (EvictionConfigError naming the field otherwise)."""
    try:
        share = 0.0 if value is None else float(value)
    except (TypeError, ValueError):
        share = -1.0
    if isinstance(value, bool) or not 0.0 <= share < 1.0:
        raise EvictionConfigError(f"actor_rollout_ref.rollout.custom.kvtier.full_share: expected a share in [0, 1), "
                                  f"got {value!r}")
    return share


@dataclass(frozen=True)
class KVTierRolloutSettings:
    eviction: EngineEvictionConfig
    kv_cache_bytes: int | None = None
    server_num_cpus: float | None = None
    protect: str | int = "all"          # all | first_turn | N
    val_budget: str | int = "full"      # full | train | K
    learner: str = "dense"              # dense | replay (kvtier.rollout.learner_replay)
    full_share: float = 0.0             # of each group's training samples, the share at full attention

    def full_attention_samples(self, n: int) -> int:
        """How many of a group of `n` training samples run at full attention (the first ones); raises,
        naming the field, when a non-zero share rounds to none or to the whole group."""
        if self.full_share == 0.0 or not self.eviction.enabled or self.eviction.default.budget is None:
            return 0                    # nothing evicted by default: every sample is at full attention already
        m = round(self.full_share * n)
        if not 0 < m < n:
            raise EvictionConfigError(f"actor_rollout_ref.rollout.custom.kvtier.full_share={self.full_share} with "
                                      f"rollout.n={n} puts {m} of each group's {n} samples at full attention: choose "
                                      "a share that leaves at least one of each kind")
        return m

    def validation_request_args(self) -> dict:
        """kvtier_* sampling params for a validation generation ({} = the training default)."""
        if self.val_budget == "train" or not self.eviction.enabled:
            return {}
        return {"kvtier_budget": "full" if self.val_budget == "full" else int(self.val_budget)}

    @classmethod
    def from_custom(cls, custom: Any) -> "KVTierRolloutSettings":
        """Parse `rollout.custom.kvtier` (a dict, DictConfig or None)."""
        raw = _plain((custom or {}).get("kvtier") if custom is not None else None) or {}
        unknown = set(raw) - _SPEC_FIELDS - _ENGINE_FIELDS - _ROLLOUT_FIELDS
        if unknown:
            raise EvictionConfigError(
                f"actor_rollout_ref.rollout.custom.kvtier: unknown key(s) {sorted(unknown)}; accepted: "
                f"{sorted(_SPEC_FIELDS | _ENGINE_FIELDS | _ROLLOUT_FIELDS)}")
        spec = {k: v for k, v in raw.items() if k in _SPEC_FIELDS}
        engine = {k: v for k, v in raw.items() if k in _ENGINE_FIELDS and v is not None}
        try:
            eviction = EngineEvictionConfig.model_validate({**engine, "default": spec})
        except Exception as exc:  # pydantic ValidationError -> one readable line
            raise EvictionConfigError(f"actor_rollout_ref.rollout.custom.kvtier: {exc}") from None
        kv = raw.get("kv_cache_bytes")
        ncpu = raw.get("server_num_cpus")
        return cls(eviction=eviction, kv_cache_bytes=int(kv) if kv is not None else None,
                   server_num_cpus=float(ncpu) if ncpu is not None else None,
                   protect=_parse_protect(raw.get("protect")), val_budget=_parse_val_budget(raw.get("val_budget")),
                   learner=_parse_learner(raw.get("learner")), full_share=parse_full_share(raw.get("full_share")))

    @classmethod
    def from_rollout_config(cls, config) -> "KVTierRolloutSettings":
        return cls.from_custom(_get(config, "custom"))


def _parse_learner(value) -> str:
    learner = "dense" if value is None else str(value)
    if learner not in LEARNERS:
        raise EvictionConfigError(f"actor_rollout_ref.rollout.custom.kvtier.learner: expected one of {LEARNERS}, "
                                  f"got {value!r}")
    return learner


def _get(obj, key, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    getter = getattr(obj, "get", None)
    if getter is not None:
        try:
            return getter(key, default)
        except Exception:
            pass
    return getattr(obj, key, default)


def _plain(obj):
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return dict(obj) if obj is not None and not isinstance(obj, dict) and hasattr(obj, "items") else obj


def engine_args_from_rollout(config, model_config, settings: KVTierRolloutSettings, *, seed: int,
                             sleep_supported: bool) -> dict[str, Any]:
    """vLLM `AsyncEngineArgs` keyword arguments (model path included) for one server."""
    from kvtier.engine.api import engine_kwargs

    args: dict[str, Any] = {
        "model": model_config.local_path,
        "tokenizer": getattr(model_config, "local_tokenizer_path", None) or model_config.local_path,
        "dtype": config.dtype,
        "load_format": config.load_format,
        "trust_remote_code": bool(getattr(model_config, "trust_remote_code", False)),
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enforce_eager": config.enforce_eager,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "disable_log_stats": config.disable_log_stats,
        # verl's own switch (on by default): with eviction only protected prompt blocks are shared, which is
        # what GRPO's n samples of one prompt reuse (engine/scheduler_side.prefix_cache_caps)
        "enable_prefix_caching": bool(config.enable_prefix_caching),
        "tensor_parallel_size": config.tensor_model_parallel_size,
        "seed": seed,
        "logprobs_mode": config.logprobs_mode,
        "scheduling_policy": config.scheduling_policy,
        "enable_sleep_mode": bool(config.enable_sleep_mode and sleep_supported),
        "worker_extension_cls": WORKER_EXTENSION,
        # one device: run the worker inside the engine-core process (no extra worker process to spawn)
        "distributed_executor_backend": "uni" if config.tensor_model_parallel_size == 1 else "mp",
    }
    if config.enable_sleep_mode and not sleep_supported:
        logger.info("kvtier rollout: vLLM sleep mode is not available on this platform (CPU); sleep/wake are no-ops")
    extra = _plain(_get(_get(config, "engine_kwargs", {}) or {}, ENGINE_KWARGS_KEY, {})) or {}
    args.update({k: v for k, v in extra.items() if v is not None})
    args = {k: v for k, v in args.items() if v is not None}
    return engine_kwargs(eviction=settings.eviction, kv_cache_bytes=settings.kv_cache_bytes, **args)


def split_request_params(sampling_params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Move `kvtier_*` keys out of verl's sampling-params dict into vLLM `extra_args`.

    Returns (sampling params without kvtier keys, extra_args)."""
    sp = dict(sampling_params)
    extra = dict(sp.pop("extra_args", None) or {})
    for key in [k for k in sp if k.startswith("kvtier_")]:
        extra[key] = sp.pop(key)
    unknown = [k for k in extra if k.startswith("kvtier_") and k not in REQUEST_KEYS]
    if unknown:
        raise EvictionConfigError(f"unknown kvtier request parameter(s) {unknown}; accepted: {sorted(REQUEST_KEYS)}")
    if "kvtier_budget" in extra and extra["kvtier_budget"] is None:
        extra["kvtier_budget"] = "full"   # explicit None = full attention (None values are dropped downstream)
    return sp, extra


def _max_tokens(config, engine_max_model_len: int, prompt_len: int, sp: dict[str, Any]) -> int:
    """The request's max_tokens (popped from `sp`: max_tokens, else max_new_tokens, else what the rollout's
    prompt and response lengths leave), never past the model's context."""
    max_model_len = config.max_model_len or engine_max_model_len
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"Prompt length ({prompt_len}) leaves no room to generate within the model's maximum "
                         f"context length ({max_model_len})")
    if "max_tokens" in sp:
        max_tokens = sp.pop("max_tokens")
    elif "max_new_tokens" in sp:
        max_tokens = sp.pop("max_new_tokens")
    else:
        max_tokens = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
    return max(1, min(int(max_tokens), room))


def vllm_sampling_params(config, replica_rank: int, engine_max_model_len: int, prompt_len: int,
                         sampling_params: dict[str, Any]):
    """verl's sampling-params dict -> vLLM SamplingParams, with verl's vLLM server's defaults (`config`: the
    rollout config); kvtier_* keys go to extra_args (`split_request_params`)."""
    from vllm import SamplingParams

    sp, extra = split_request_params(sampling_params)
    max_tokens = _max_tokens(config, engine_max_model_len, prompt_len, sp)
    sp["logprobs"] = 0 if sp.pop("logprobs", False) else None
    sp.setdefault("repetition_penalty", config.repetition_penalty)
    sp.setdefault("ignore_eos", config.ignore_eos)
    if config.full_determinism:
        sp.setdefault("seed", replica_rank + config.seed)
    return SamplingParams(max_tokens=max_tokens, extra_args=extra or None, **sp)
