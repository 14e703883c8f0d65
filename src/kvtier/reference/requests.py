"""What goes into the reference engine (`Request`), what comes out (`Output`), and one sequence's state
while it decodes (`SequenceState`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.engine.config import EvictionSpec
from kvtier.policies import EvictionPolicy


@dataclass
class Request:
    """One sequence to decode. `spec` is the vLLM engine's request spec (budget=None: full attention);
    its `policy` may also be a policy instance here (probes pin unregistered policies)."""

    prompt_ids: list[int]
    spec: EvictionSpec = field(default_factory=EvictionSpec)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None                # sampling seed
    forced: list[int] | None = None        # scripted tokens fed through the decode path before sampling
    stop_ids: tuple[int, ...] = ()
    req_id: str = ""


@dataclass
class Output:
    req_id: str
    prompt_len: int
    token_ids: list[int]
    logprobs: list[float]                  # log-prob of each emitted (or forced) token
    argmax: list[int]                      # greedy choice at each step (what greedy decoding would emit)
    finish_reason: str                     # "stop" | "length"
    rounds: int
    records: list[dict]                    # audit records of this sequence (when keep_records)


@dataclass
class SequenceState:
    """One row of a `DecodeBatch`. `ReferenceEngine.generate` creates these; a benchmark that fills the
    cache itself creates them directly (set `decoded` to the tokens already behind the prompt)."""

    req: Request
    spec: EvictionSpec
    policy: EvictionPolicy | None          # spec.make_policy(); None for full attention
    prompt_len: int
    evict_gen: torch.Generator             # eviction draws of order-free policies
    sample_gen: torch.Generator | None     # sampling (temperature > 0)
    evict_key: int = 0                     # the engine's counter-based key for `random` (keyed_random.seed_key)
    pending: int = -1                      # next token to feed (sampled or forced, not yet cached)
    decoded: int = 0                       # tokens fed through the decode path (cached)
    rounds: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    argmax: list[int] = field(default_factory=list)
    finished: str | None = None
    records: list[dict] = field(default_factory=list)
    policy_state: dict = field(default_factory=dict)   # the policy's own state across rounds (ctx.extras["state"])

    def output(self) -> Output:
        return Output(self.req.req_id, self.prompt_len, self.tokens, self.logprobs, self.argmax, self.finished,
                      self.rounds, self.records)
