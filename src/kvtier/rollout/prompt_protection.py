"""`rollout.custom.kvtier.protect` (all | first_turn | N): the prompt prefix a compressed request protects
(`kvtier_protect_prefix`), so multi-turn contexts and resumed partial rollouts longer than K run compressed."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from .settings import KVTierRolloutSettings


class FirstPrompts:
    """`protect: first_turn`: the first prompt seen under each trajectory (keyed by the `kvtier_session` that
    kvtier's agent-loop client sends, else by the request id) (its length and a digest), so a
    later prompt under the same id that starts with it (verl's tool agent loop resends history + the new
    turn; its fully-async client resubmits prompt + partial output) protects only that prefix.

    With verl's full_determinism the ids are `det-<priority>` and repeat across steps, so a few first
    prompts are kept per id and the longest one that prefixes the new prompt wins. Bounded: least
    recently used ids are forgotten first (a forgotten trajectory's next turn protects its whole prompt,
    the paper's rule, and may be rejected if that exceeds K)."""

    def __init__(self, capacity: int = 1 << 16, per_id: int = 8) -> None:
        self.capacity, self.per_id = capacity, per_id
        self._ids: "OrderedDict[str, list[tuple[int, bytes]]]" = OrderedDict()

    @staticmethod
    def _digest(tokens: np.ndarray) -> bytes:
        return hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()

    def prefix_len(self, request_id: str, prompt_ids: list[int]) -> int:
        """How many leading tokens of this prompt belong to its trajectory's first prompt (all of them for
        a first prompt)."""
        tokens = np.asarray(prompt_ids, dtype=np.int64)
        entries = self._ids.get(request_id)
        if entries is not None:
            self._ids.move_to_end(request_id)
            for n, digest in sorted(entries, reverse=True):
                if n <= len(tokens) and self._digest(tokens[:n]) == digest:
                    return n
        entries = self._ids.setdefault(request_id, [])
        entries.append((len(tokens), self._digest(tokens)))
        del entries[: -self.per_id]
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return len(tokens)


def protect_prefix(settings: KVTierRolloutSettings, first_prompts: FirstPrompts, session: str,
                   prompt_ids: list[int], extra_args: dict) -> int | None:
    """`kvtier_protect_prefix` for this request under `rollout.custom.kvtier.protect`, or None (the
    policy's own rule: the whole prompt). Only for compressed requests whose policy protects the prompt
    and that did not say themselves (kvtier_protect_prefix / kvtier_protect_prompt). Under first_turn every
    prompt is recorded in `first_prompts`, whatever this request's answer."""
    mode = settings.protect
    if mode == "all" or not settings.eviction.enabled:
        return None
    first = first_prompts.prefix_len(session, prompt_ids) if mode == "first_turn" else None
    if "kvtier_protect_prefix" in extra_args or "kvtier_protect_prompt" in extra_args:
        return None
    from kvtier.engine.config import EvictionConfigError, resolve_request_spec
    from kvtier.policies import PolicyError

    try:
        spec = resolve_request_spec(settings.eviction.default, extra_args)
        if not spec.compressed or not spec.make_policy().protect_prompt:
            return None
    except (EvictionConfigError, PolicyError):
        return None   # the engine's validation rejects the request with the reason (HTTP 400)
    if isinstance(mode, int):
        return mode
    return first if first < len(prompt_ids) else None
