"""The transformers oracles of the compressed vLLM engine.

Two references, both on a Hugging Face model with a custom attention function:

* `ReferenceEngine` (generation): the paper's setting (§4.1, Appendix F: batched decoding in
  transformers, keys stored post-RoPE, per-KV-head physical eviction) with the vLLM engine's schedule.

  - one dense cache per layer, keys/values ``[B, H_kv, capacity, d]`` (`BatchKVCache`), filled by the
    attention function registered as ``ATTN_NAME`` (`register_attention`); the model runs with
    ``use_cache=False`` and the function appends each step's post-RoPE key/value and attends over the
    cache. RoPE positions are logical (``position_ids``), slots physical, exactly as in the engine;
  - requests carry the engine's own spec (`kvtier.engine.config.EvictionSpec`; budget=None is full
    attention; its policy may be an unregistered policy instance here). The trigger is the engine's
    (`round_due` = ``EvictionSchedule.due``); at a round every KV head of every layer keeps K candidates
    (everything outside the r newest), so a head never holds more than K + 2r; compaction is
    kvtier.policies' hole filling;
  - ``random`` draws its victims with the engine's counter-based keys (seed, round, layer, KV head), so
    with the same eviction seed both engines keep the same positions; other order-free read-nothing
    policies draw once per sequence for all layers and heads from a per-sequence generator;
  - batched decoding: all sequences advance one token per forward (`DecodeBatch`, rows =
    `SequenceState`), each with its own prompt length, spec and round cadence; identical prompts are
    prefilled once; forced (scripted) tokens go through the decode path; every round can be logged in
    the engine's audit format ({req_id, round, query_position, prompt_len, budget, buffer, policy,
    kept: [layers][kv_heads][K]}).

* `MaskedReplay` (scoring): one forward of prompt + generated tokens under kvtier.deathtime's attention,
  the death times rebuilt from audit records; equals attention over the compacted cache, so its
  log-probs must match the engine's (or the `ReferenceEngine`'s) up to numerical noise.

    eng = ReferenceEngine(model_dir)
    out = eng.generate([Request(ids, EvictionSpec(policy="random", budget=256, buffer=16, seed=0))])[0]
    lp = MaskedReplay(model_dir).logprobs(ids + out.token_ids, len(ids), out.records, buffer=16)
"""

from .attention import ATTN_NAME, CacheAttention, register_attention
from .batch import DecodeBatch
from .cache import BatchKVCache
from .engine import ReferenceEngine
from .replay import MaskedReplay
from .requests import Output, Request, SequenceState
from .rounds import round_due, round_schedule, select_evicted

__all__ = [
    "ATTN_NAME", "BatchKVCache", "CacheAttention", "DecodeBatch", "MaskedReplay", "Output", "ReferenceEngine",
    "Request", "SequenceState", "register_attention", "round_due", "round_schedule", "select_evicted",
]
