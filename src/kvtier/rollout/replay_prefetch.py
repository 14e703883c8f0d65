"""Deaths derived beside the learner: a bounded pool of workers derives a batch's samples into the store while
the forwards run, so a forward waits only for samples not yet ready.

When the replay engine's `forward_backward_batch` receives a batch (the reference's, the old log-probs', each
update's), `prefetch` queues every replayed sample of it, in batch order, for `workers` threads (or spawned
processes: `KVTIER_REPLAY_POOL=process`); each result goes into the step's `DeathStore`. The forward reads
through `serve`, the store's own contract: a stored sample is a hit; one a worker is deriving is waited for;
one not yet started is derived by the forward itself (it is needed now), so no sample is derived twice.

Host memory stays bounded: the store keeps at most its `max_bytes`; a result that does not fit is held only
until its forward takes it, and at most `window` such results plus `workers` derivations in progress exist
at any time (each derivation's scratch: ~0.1 GB at Qwen3-4B shapes and 32k tokens). Work queued for a step
that has ended is dropped (the store's step counter). `KVTIER_REPLAY_WORKERS` (default 2; 0: no prefetch,
each forward derives on its own thread as before) sets the pool's size.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from typing import Callable, Hashable

from .replay_batch import replay_store, replayed_samples

logger = logging.getLogger("kvtier.rollout")

WORKERS = int(os.environ.get("KVTIER_REPLAY_WORKERS", 2))
POOL = os.environ.get("KVTIER_REPLAY_POOL", "thread")


def make_pool(kind: str, workers: int) -> Executor:
    """A thread pool (numpy releases the GIL in the derivation's large array operations) or a pool of spawned
    processes (fork is unsafe once CUDA is initialised)."""
    if kind == "process":
        import multiprocessing

        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    if kind != "thread":
        raise ValueError(f"KVTIER_REPLAY_POOL={kind!r}: use thread or process")
    return ThreadPoolExecutor(workers, thread_name_prefix="kvtier-replay")


class Prefetcher:
    """Background derivation into `store` (a `DeathStore`); `serve(key, produce)` as `DeathStore.serve`."""

    def __init__(self, store, workers: int = 2, kind: str = "thread", window: int | None = None):
        self.store = store
        self.workers = max(1, int(workers))
        self.window = self.workers if window is None else int(window)
        self._pool = make_pool(kind, self.workers)
        # re-entrant: cancelling a future, or watching one already done, runs its callback (which locks) at once
        self._lock = threading.RLock()
        self._queued: OrderedDict[Hashable, tuple] = OrderedDict()    # key -> work: (function, *arguments)
        self._futures: dict[Hashable, Future] = {}                    # submitted, not yet taken or stored
        self._held: set[Hashable] = set()                             # done, not stored, not yet taken
        self._running = 0
        self._step = None
        self.prefetched = 0                                           # derivations done by the pool
        self.inline = 0                                               # derivations a forward did itself

    def prefetch(self, samples: list[tuple[Hashable, tuple]]) -> None:
        """Queue (key, work) pairs, in the order the forwards will want them; work is a picklable derivation
        function and its arguments (`replay_batch.replayed_samples`: `derive_encoded`, `derive_segment_encoded`)."""
        step = self.store.begin([k for k, _ in samples])
        with self._lock:
            if step != self._step:                    # a new step: what was queued for the last one is moot
                self._step = step
                self._queued.clear()
                futures, self._futures = list(self._futures.values()), {}
                for fut in futures:
                    fut.cancel()
                self._held.clear()
            for key, work in samples:
                if key not in self._futures and key not in self._queued and self.store.peek(key) is None:
                    self._queued[key] = work
            started = self._pump()
        self._watch(started)

    def _pump(self) -> list:
        """Submit queued work up to the bound (under the lock); what was submitted, for `_watch`."""
        started = []
        while self._queued and self._running + len(self._held) < self.workers + self.window:
            key, work = self._queued.popitem(last=False)
            fut = self._pool.submit(*work)
            self._futures[key] = fut
            self._running += 1
            started.append((key, self._step, fut))
        return started

    def _watch(self, started: list) -> None:
        # outside the lock: a future already done runs its callback here, and the callback takes the lock
        for key, step, fut in started:
            fut.add_done_callback(partial(self._done, key, step))

    def _done(self, key: Hashable, step, fut: Future) -> None:
        stored = False
        if not fut.cancelled() and fut.exception() is None:
            stored = self.store.admit(key, fut.result(), step)
        with self._lock:
            self._running -= 1
            if not fut.cancelled():
                self.prefetched += 1
            if self._futures.get(key) is fut:
                if stored or fut.cancelled() or fut.exception() is not None:
                    del self._futures[key]            # stored: the store serves it; failed: the forward retries
                else:
                    self._held.add(key)
            started = self._pump() if step == self._step else []
        self._watch(started)

    def serve(self, key: Hashable, produce: Callable):
        """The sample's compact deaths for a forward: from the store, from its worker (waiting), or produced
        here when no worker has started it."""
        started = []
        with self._lock:
            fut = self._futures.pop(key, None)
            self._queued.pop(key, None)
            if fut is not None and key in self._held:
                self._held.discard(key)
                started = self._pump()
            elif fut is not None and fut.cancel():    # submitted, not started: the forward needs it now
                fut = None
        self._watch(started)
        if fut is None:
            with self._lock:
                self.inline += self.store.peek(key) is None
            return self.store.serve(key, produce)
        return self.store.serve(key, fut.result, fresh=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_PREFETCHER: list[Prefetcher] = []


def prefetcher() -> Prefetcher | None:
    """This process's prefetcher over `replay_store()` (None when KVTIER_REPLAY_WORKERS=0)."""
    if WORKERS <= 0:
        return None
    if not _PREFETCHER:
        _PREFETCHER.append(Prefetcher(replay_store(), WORKERS, POOL))
    return _PREFETCHER[0]


def prefetch_batch(batch, num_layers: int, num_kv_heads: int, pool: Prefetcher | None = None) -> None:
    """Queue a forward's whole batch (before its micro-batches run); best effort: a failure is logged and the
    forwards derive on their own."""
    pool = prefetcher() if pool is None else pool
    if pool is None:
        return
    try:
        pool.prefetch(replayed_samples(batch, num_layers, num_kv_heads))
    except Exception as exc:  # noqa: BLE001
        logger.warning("kvtier learner replay: prefetch failed (%s); forwards derive their samples", exc)


def current_store():
    """What forwards read through: the prefetcher if there is one, else the store itself."""
    return prefetcher() or replay_store()
