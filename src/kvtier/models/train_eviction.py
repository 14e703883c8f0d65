"""Training under the eviction a model is served with (``kvtier model train-reasoner --evict``).

``--evict random:128,256,512:32`` trains with the policy's evictions simulated per sample
(kvtier.deathtime.simulate_deaths: the engines' schedule and, for random, their keyed draw), replayed as
death-time attention in the training forward. Each sample independently gets full attention with
probability ``full_share`` and otherwise one of the budgets, uniformly; its eviction seed is a function of
(data seed, step, sample), so training stays deterministic. A policy that reads only the first layer's keys
(``random_line_reserve``, at its default parameters) is simulated from the keys of the weights being trained
(`kvtier.deathtime.first_layer_keys`: a no-grad partial forward at the step; eviction cannot change them), so
its records are computed at the step, not ahead in workers.

Why this mix: the served model answers in every tier (full and each K) of a deployment, so every step
trains all of them, and a share of full-attention samples keeps full attention's accuracy from drifting.
Which needle answers are trained under eviction: a key stated once is, under random eviction, gone from
most heads by the time it is asked for (the seed paper, §5.3); training the boxed key on such samples
would train guessing, which the needle evaluation must not see rewarded. So a needle's answer tokens get
loss weight 0 under eviction unless its records keep the whole key line (``k=NN`` and its newline) in every
(layer, KV head) row up to the last weighted query (the one predicting eos): then the key can be read, not
guessed, and the answer weighs as at full attention. Every row, not some: with the line kept in every head
the key-line probe retrieves 0.44-0.47 of long-8kv's needles, with fewer heads less (evict model: 0.41 at 6
of 8, 0.22 at 4; docs/reasoner.md), and a line-keeping policy keeps its lines in every row or in none, so
"some rows" would mostly admit random's chance survivals. Under random the whole line is held in every row
about never (0.16-0.34 of its tokens per row at the question, docs/reasoner.md), so random's fine-tunes
train as before in effect; under random_line_reserve a needle whose line was reserved is trained. Traces
are trained under eviction like every other trace.
"""

from __future__ import annotations

import random
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import torch

from kvtier.policies import EvictionSchedule, make_policy


@dataclass(frozen=True)
class EvictMix:
    """A parsed ``--evict POLICY:K[,K...][:r]`` and the share of full-attention samples."""

    policy: str
    budgets: tuple[int, ...]
    buffer: int = 32
    full_share: float = 0.25

    @classmethod
    def parse(cls, text: str, full_share: float = 0.25) -> "EvictMix | None":
        """'' -> None; 'random:128,256:32' -> EvictMix('random', (128, 256), 32)."""
        if not text:
            return None
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[1]:
            raise ValueError(f"--evict must be POLICY:K[,K...][:r], got {text!r}")
        from kvtier.deathtime import reads_first_layer_keys

        budgets = tuple(int(k) for k in parts[1].split(","))
        mix = cls(parts[0], budgets, int(parts[2]) if len(parts) == 3 else 32, float(full_share))
        pol = make_policy(mix.policy)
        if pol.needs and not reads_first_layer_keys(pol):
            raise ValueError(f"--evict: policy {mix.policy!r} reads the cache; only policies that read nothing "
                             "(random, random_shared, random_block, streaming, recency) or only the first layer's "
                             "keys (random_line_reserve) can be simulated in training")
        if not 0.0 <= mix.full_share <= 1.0 or any(k <= 0 for k in budgets):
            raise ValueError(f"--evict: budgets must be > 0 and the full share in [0, 1], got {text!r}, {full_share}")
        return mix

    def assign(self, seed: int, step: int, tag: str, count: int) -> list[tuple[int | None, int]]:
        """[(budget or None for full attention, eviction seed)] for `count` samples of one step."""
        rng = random.Random(f"{seed}/{step}/{tag}/evict")
        out = []
        for _ in range(count):
            full = rng.random() < self.full_share
            budget = rng.choice(self.budgets)
            out.append((None if full else budget, rng.getrandbits(63)))
        return out

    @property
    def reads_keys(self) -> bool:
        """The policy reads the first layer's keys: its records need the batch's keys under the current weights."""
        from kvtier.deathtime import reads_first_layer_keys

        return reads_first_layer_keys(make_policy(self.policy))

    def deaths(self, prompt_lens: list[int], lengths: list[int], width: int, plan: list[tuple[int | None, int]],
               num_layers: int, num_kv_heads: int, first_keys=None):
        """[B, layers, kv_heads, width] death times of a right-padded batch (full attention: NEVER).
        first_keys: [B, kv_heads, >= width, head_dim] the batch's first-layer keys (when `reads_keys`)."""
        from kvtier.deathtime import place_in_batch, simulate_deaths

        pol = make_policy(self.policy)
        recs = [None if k is None else
                simulate_deaths(pol, EvictionSchedule(k, self.buffer), p, n, num_layers=num_layers,
                                num_kv_heads=num_kv_heads, seed=s,
                                first_keys=None if first_keys is None else first_keys[i])
                for i, ((k, s), p, n) in enumerate(zip(plan, prompt_lens, lengths))]
        return place_in_batch(recs, width, num_layers=num_layers, num_kv_heads=num_kv_heads)

    def describe(self) -> str:
        return f"{self.policy}:{','.join(map(str, self.budgets))}:{self.buffer}"


def row_spans(labels) -> tuple[list[int], list[int]]:
    """(prompt lengths, sequence lengths) of a right-padded batch, read off its labels (-100 on the
    prompt and the padding)."""
    import torch

    on = labels != -100
    first = on.int().argmax(dim=1)
    last = labels.shape[1] - 1 - on.flip(1).int().argmax(dim=1)
    return first.tolist(), (last + 1).tolist()


def deaths_for(mix: EvictMix | None, plan, labels, model, ids=None):
    """The forward's kvtier_deaths kwarg for a batch (empty when training without eviction). ids: the batch's
    input ids, needed when the policy reads first-layer keys (`mix.reads_keys`): they are computed here from
    `model`'s current weights."""
    keys = None
    if mix is not None and mix.reads_keys and any(k is not None for k, _ in plan):
        if ids is None:
            raise ValueError(f"--evict {mix.policy}: its evictions read the first layer's keys; pass the batch's ids")
        from kvtier.deathtime import first_layer_keys

        keys = first_layer_keys(model, ids).cpu()
    return _deaths_kwarg(mix, plan, labels, model.config.num_hidden_layers, model.config.num_key_value_heads, keys)


def _deaths_kwarg(mix: EvictMix | None, plan, labels, num_layers: int, num_kv_heads: int, keys=None) -> dict:
    if mix is None or all(k is None for k, _ in plan):
        return {}
    prompt_lens, lengths = row_spans(labels)
    return {"kvtier_deaths": mix.deaths(prompt_lens, lengths, labels.shape[1], plan, num_layers, num_kv_heads, keys)}


def _quiet_worker() -> None:
    """A DeathsAhead worker: one thread, and the parent's SIGTERM/SIGINT (a training's pause) left to the parent."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)


def _deaths_job(mix: EvictMix, plan, prompt_lens, lengths, width, num_layers, num_kv_heads):
    # a numpy array: pickled whole, where a tensor would travel through /dev/shm (small in some containers)
    return mix.deaths(prompt_lens, lengths, width, plan, num_layers, num_kv_heads).numpy()


class DeathsAhead:
    """deaths_for's result computed in `workers` processes, up to `ahead` steps before a step needs it.

    Simulating random eviction over a long trace costs ~0.1 s a sample on one CPU core (chains-long, 8 KV heads),
    about what a GPU takes for the whole step: done inline the accelerator would wait on it. The records are a
    function of (plan, lengths) alone, so the result is the same as deaths_for's. `inputs(step)` gives a step's
    [(plan, labels)] per group; the trainer's own data function, so nothing is computed twice differently.
    If the pool breaks (a worker killed, e.g. by a pause's SIGTERM sent to the process group before the worker
    could ignore it), the rest is computed inline, with one line to `log`: the same records, slower."""

    def __init__(self, mix: EvictMix, model_config, inputs, workers: int, ahead: int | None = None, log=print):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        if mix.reads_keys:
            raise ValueError(f"--workers: {mix.policy}'s evictions read the first layer's keys under the weights of "
                             "the step itself, so they cannot be simulated ahead; use --workers 0 (inline)")
        self.mix, self.inputs, self.log = mix, inputs, log
        self.broken = False
        self.shape = (model_config.num_hidden_layers, model_config.num_key_value_heads)
        self.ahead = ahead or 2 * workers
        # spawn: the parent may hold a CUDA context, which a forked child must not inherit
        self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_quiet_worker)
        self.futures: dict[tuple[int, int], object] = {}
        self.next_step = 0                             # the first step not yet submitted

    def _submit(self, step: int) -> None:
        if self.broken:
            return
        for g, (plan, labels) in enumerate(self.inputs(step)):
            if all(k is None for k, _ in plan):
                self.futures[(step, g)] = None
                continue
            prompt_lens, lengths = row_spans(labels)
            self.futures[(step, g)] = self.pool.submit(_deaths_job, self.mix, plan, prompt_lens, lengths,
                                                       labels.shape[1], *self.shape)

    def get(self, step: int, group: int, last_step: int) -> dict:
        """The forward's kvtier_deaths kwarg for `group` of `step` (steps up to last_step are prefetched)."""
        start = max(step, self.next_step)
        for s in range(start, min(step + self.ahead, last_step)):
            self._submit(s)
        self.next_step = max(start, min(step + self.ahead, last_step))
        fut = self.futures.pop((step, group), "inline")
        if fut is None:
            return {}
        if fut != "inline":
            try:
                return {"kvtier_deaths": torch.from_numpy(fut.result())}
            except BrokenProcessPool as exc:
                self.log(f"eviction workers stopped ({exc}); simulating the rest inline (same records, slower)")
                self.close()
        plan, labels = self.inputs(step)[group]
        return _deaths_kwarg(self.mix, plan, labels, *self.shape)

    def close(self) -> None:
        self.broken = True
        self.futures.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)


def key_line_kept(deaths, key_line: tuple[int, int], length: int) -> bool:
    """deaths [layers, kv_heads, >= length] of one row; key_line: its [start, end) token span; length: the
    row's tokens. True when every token of the key line is visible in every (layer, head) row to the last
    query whose prediction is weighted (length - 2, the one predicting eos), hence to every earlier one."""
    a, b = key_line
    return bool((deaths[:, :, a:b] > length - 2).all())


def unanswerable(problems, plan, deaths=None, key_lines=None, lengths=None) -> list[bool]:
    """Per row: a needle under eviction whose boxed answer gets no loss (the module docstring says why).
    Without `deaths`, every needle under eviction; with the batch's records [B, layers, kv_heads, T], those
    whose key line (key_lines[i]) is not whole in every row up to their last query (`key_line_kept`;
    lengths[i]: the row's tokens)."""
    out = []
    for i, (p, (k, _)) in enumerate(zip(problems, plan)):
        evicted_needle = p.kind == "needle" and k is not None
        out.append(evicted_needle and (deaths is None or not key_line_kept(deaths[i], key_lines[i], lengths[i])))
    return out


def answer_untrained(tok, problems, plan, labels, extra: dict) -> list[bool]:
    """`unanswerable` for a training group: its deaths from the forward's kwargs (`deaths_for`), its key
    lines from the problems (`reasoner_data.key_line_span`: training data, labels allowed), its lengths
    from the labels."""
    from .reasoner_data import key_line_span

    deaths = extra.get("kvtier_deaths")
    if deaths is None:
        return unanswerable(problems, plan)
    key_lines = [key_line_span(tok, p) if p.kind == "needle" and k is not None else None
                 for p, (k, _) in zip(problems, plan)]
    return unanswerable(problems, plan, deaths, key_lines, row_spans(labels)[1])
