"""The compaction benchmark's cell: the paged caches, slot maps and request state of `n` requests due a
round at budget K, and the untimed moves between timed steps (restore the pristine cache, re-arm the
buffer as `positions_at` does, keep the settled map after a step).

Every due request holds old_len = K + 2r entries per (layer, KV head) in blocks drawn at random from a
pool sized for exactly these requests; a steady-state slot map (prompt in the first slots, older
generated positions in a per-head random order, the r-entry buffer last and chronological). The timed
steps themselves are `batched_step` (kvtier's) and `floor_step` (the full gather); the check after a
step is `exactness.check_step`: they take a cell, the cell knows none of them (no import circle).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtier.benchmarks.compaction.layouts import CompactionShapes, LayoutWriter, cache_shape, pool_size
from kvtier.policies import EvictionSchedule
from kvtier.policies.keyed_random import seed_key


class Cell:
    """The paged caches, slot maps and request state of `requests` requests due a round at budget K."""

    def __init__(self, writer: LayoutWriter, budget: int, requests: int, s: CompactionShapes, *,
                 device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 pristine: str | None = None) -> None:
        self.writer, self.s = writer, s
        self.budget, self.n, self.device, self.dtype, self.seed = budget, requests, device, dtype, seed
        self.sched = EvictionSchedule(budget=budget, buffer=s.buffer)
        self.old_len = budget + 2 * s.buffer
        self.settled = self.sched.settled_len
        self.n_cand = self.sched.num_candidates(self.old_len)
        self.blocks_per_req = -(-self.old_len // s.block_size)
        self.num_blocks = pool_size(requests * self.blocks_per_req, writer.name, s)   # exact unless ambiguous
        # pristine content: a clone (fast restore; twice the memory) or regenerated per layer from a seed
        self.pristine_mode = pristine or ("regenerate" if device.type == "cuda" else "clone")
        shape = cache_shape(writer.name, self.num_blocks, s)
        self.caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(s.layers)]
        self.paged, self.rows = writer.probe(self.caches[0], self.num_blocks, s)
        for li in range(s.layers):
            self._fill(li, self.caches[li])
        self.clones = [c.clone() for c in self.caches] if self.pristine_mode == "clone" else None
        self.row_views = [self.rows.view(self.paged.flat(c)) for c in self.caches]
        g = torch.Generator(device="cpu").manual_seed(seed)
        perm = torch.randperm(self.num_blocks, generator=g)
        self.blocks = [perm[i * self.blocks_per_req:(i + 1) * self.blocks_per_req].to(device) for i in range(requests)]
        self.heads = torch.arange(s.kv_heads, device=device)   # global KV heads (one rank)
        self.keys = [seed_key(seed * 100_003 + i) for i in range(requests)]
        self.generators = []
        for i in range(requests):
            gen = torch.Generator(device=device)
            gen.manual_seed(self.keys[i] * 65521)
            self.generators.append(gen)
        qg = torch.Generator(device=device).manual_seed(seed + 1)
        self.queries = [torch.randn(s.layers, s.query_heads, s.query_window, s.head_dim, generator=qg, device=device,
                                    dtype=torch.float32).to(dtype) for _ in range(requests)]
        self._initial_positions()

    def _fill(self, li: int, out: Tensor) -> Tensor:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + li)
        return out.normal_(generator=gen)

    def pristine(self, li: int, scratch: Tensor | None = None) -> Tensor:
        """Layer li's cache as it was before any step (scratch: a same-shaped buffer for regeneration)."""
        if self.clones is not None:
            return self.clones[li]
        return self._fill(li, scratch if scratch is not None else torch.empty_like(self.caches[0]))

    def _initial_positions(self) -> None:
        """Steady state after earlier rounds: prompt in slots [0, P), older generated positions in a
        random order per head in [P, K + r), newest r appended as the step arrives."""
        s, L, H = self.s, self.s.layers, self.s.kv_heads
        P, n_old = s.prompt_len, self.settled - s.prompt_len
        g = torch.Generator(device=self.device).manual_seed(self.seed + 2)
        self.state = []
        for _ in range(self.n):
            perm = torch.rand(L * H, n_old, generator=g, device=self.device).argsort(dim=1)
            jitter = torch.randint(0, 3, (L * H, n_old), generator=g, device=self.device)
            held = P + 3 * perm + jitter                       # distinct, scattered over 3x the span
            prompt = torch.arange(P, device=self.device).expand(L * H, P)
            self.state.append(torch.cat([prompt, held], dim=1).view(L, H, self.settled).contiguous())
        self.query_position = P + 3 * n_old + self.s.buffer   # newest position once the buffer is full
        self.round = 1

    def restore(self) -> None:
        """Back to the pristine cache and slot maps (untimed)."""
        for li, c in enumerate(self.caches):
            if self.clones is not None:
                c.copy_(self.clones[li])
            else:
                self._fill(li, c)
        self._initial_positions()

    def rearm(self) -> list[Tensor]:
        """The slot maps at old_len entries (engine: WorkerRequest.positions_at): settled + r new slots."""
        L, H, r = self.s.layers, self.s.kv_heads, self.s.buffer
        out = []
        for st in self.state:
            pos = torch.empty(L, H, self.old_len, dtype=torch.long, device=self.device)
            pos[:, :, : self.settled] = st
            pos[:, :, self.settled :] = torch.arange(self.query_position - r + 1, self.query_position + 1, device=self.device)
            out.append(pos)
        return out

    def advance(self, pos: list[Tensor]) -> None:
        self.state = [p[:, :, : self.settled].contiguous() for p in pos]
        self.query_position += self.s.buffer
        self.round += 1
