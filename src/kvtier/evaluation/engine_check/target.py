"""What `kvtier engine check` builds: a model and the vLLM arguments of the engine that will serve.

From a service config (kvtier's own YAML, or a Ray Serve config whose application runs
`kvtier.service.app:build_app`, such as the KubeRay overlays' serve-config.yaml) each engine deployment's
arguments are taken as `kvtier serve` resolves them (service.app.vllm_engine_kwargs). With the shipped tiny
model (the default) only the settings that size the model's own use change: max_model_len, the KV pool and
max_num_seqs; everything that chooses a code path (device, dtype, CUDA graphs, tensor parallelism, prefix
caching, async scheduling, admission) is the configuration's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger("kvtier.engine_check")

TINY_MAX_MODEL_LEN = 2048
TINY_KV_CACHE_BYTES = 32 << 20         # 16k tokens of the tiny model (2 KiB per token in bf16)
TINY_MAX_NUM_SEQS = 16
BUILD_APP = "kvtier.service.app:build_app"


@dataclass
class CheckTarget:
    label: str                             # "engine <name> of <config>" or "model <dir>"
    model: str                             # a local model directory
    engine_kwargs: dict[str, Any]          # vLLM arguments, additional_config.kvtier included
    tiny: bool                             # the shipped tiny model (the check sizes its own use)
    engine: str | None = None              # the engine deployment of a service config


def service_args(path: Path) -> dict[str, Any]:
    """The kvtier service config in `path`: the file itself, or the args of the Serve application that runs
    kvtier's app builder (a RayService serveConfigV2)."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if isinstance(data, dict) and "applications" in data:
        apps = [a for a in data["applications"] if a.get("import_path") == BUILD_APP]
        if not apps:
            raise ValueError(f"{path}: no Serve application with import_path {BUILD_APP}")
        return apps[0].get("args") or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def from_service_config(path: Path, engine: str | None = None, model: str | None = None) -> list[CheckTarget]:
    """One target per engine deployment of the config (or only `engine`), on `model` (None: the tiny model)."""
    from kvtier.service.app import vllm_engine_kwargs
    from kvtier.service.config import parse_config
    from kvtier.service.sizing import resolved_engine_kwargs

    cfg = parse_config(service_args(path), str(path))
    names = list(cfg.engines) if engine is None else [engine]
    if engine is not None and engine not in cfg.engines:
        raise ValueError(f"--engine {engine!r}: the config's engines are {sorted(cfg.engines)}")
    out = []
    for name in names:
        eng = cfg.engines[name]
        if model is None:   # the tiny model: the check sizes max_num_seqs itself
            resolved = {k: v for k, v in eng.engine_kwargs.items() if k != "max_num_seqs"}
        else:
            resolved = resolved_engine_kwargs(cfg, name, model)[0]
        out.append(_target(f"engine {name} of {path}", model, vllm_engine_kwargs(eng, resolved), name))
    return out


def from_model(model: str | None, engine_kwargs_json: str | None) -> CheckTarget:
    """`--model DIR --engine-kwargs JSON` (either may be left out: the tiny model, kvtier's defaults)."""
    from kvtier.engine.api import engine_kwargs

    try:
        given = json.loads(engine_kwargs_json) if engine_kwargs_json else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"--engine-kwargs is not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise ValueError("--engine-kwargs must be a JSON object of vLLM engine arguments")
    extra = dict(given.pop("additional_config", None) or {})
    eviction = extra.pop("kvtier", None)
    kwargs = engine_kwargs(eviction=eviction, **given,
                           **({"additional_config": extra} if extra else {}))
    return _target(f"model {model}" if model else "the tiny model", model, kwargs)


def _target(label: str, model: str | None, kwargs: dict[str, Any], engine: str | None = None) -> CheckTarget:
    kwargs = dict(kwargs)
    if model is not None:
        if kwargs.get("max_num_seqs") == "auto":
            kwargs.pop("max_num_seqs")
        return CheckTarget(label, model, kwargs, tiny=False, engine=engine)
    from kvtier.models.tiny import ensure_tiny_model

    kwargs.update(max_model_len=TINY_MAX_MODEL_LEN, kv_cache_memory_bytes=TINY_KV_CACHE_BYTES,
                  max_num_seqs=TINY_MAX_NUM_SEQS)
    kwargs.pop("gpu_memory_utilization", None)
    return CheckTarget(label + " on the tiny model", str(ensure_tiny_model()), kwargs, tiny=True, engine=engine)
