"""A bounded store of derived death tensors, so one training step derives each sample's deaths once and its
reference, old-log-prob and update forwards share them.

A step runs its forwards as passes over the same samples (reference, old log-probs, each PPO epoch). The
store keeps a sample compactly: the index of the round that evicted each entry (uint8 when there are fewer
than 255 rounds, else uint16; 0: never), beside the rounds' death times, a quarter (or half) of the dense int32
tensor. It admits samples while they fit in `max_bytes` and evicts none within a step: passes over more
samples than fit would make an LRU miss every time, whereas keeping the first ones serves them in every pass.
A step ends when a sample the store has never seen arrives after some sample was served twice (the next
step's first forward, or its prefetch: `begin`); the store then starts over. Thread-safe: a pool of
derivation workers (`kvtier.rollout.replay_prefetch`) fills it while the forwards read it.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable, Iterable

import numpy as np
import torch
from torch import Tensor

from .record import NEVER

Item = tuple[np.ndarray, np.ndarray]


def index_dtype(rounds: int):
    """The round index's type for `rounds` rounds (0: never): uint8 below 255 rounds, else uint16."""
    if rounds >= 65535:
        raise ValueError(f"{rounds} rounds do not fit the store's uint16 round index")
    return np.uint8 if rounds < 255 else np.uint16


def encode(deaths: Tensor, death_times: list[int]) -> Item:
    """(round index per entry, [NEVER] + death_times as int32) of an int32 deaths tensor whose finite values
    are all in `death_times` (each < deaths.shape[-1]). `simulate.simulate_encoded` derives `random`'s deaths
    in this form directly."""
    n = deaths.shape[-1]
    dtype = index_dtype(len(death_times))
    lut = np.zeros(n + 1, dtype=dtype)                    # a death time -> its round's index; n (NEVER) -> 0
    lut[np.asarray(death_times, dtype=np.int64)] = np.arange(1, len(death_times) + 1, dtype=dtype)
    index = lut[np.minimum(deaths.numpy(), n)]
    return index, np.asarray([NEVER, *death_times], dtype=np.int32)


def decode(index: np.ndarray, table: np.ndarray) -> Tensor:
    """The int32 deaths tensor back from `encode`'s pair."""
    return torch.from_numpy(table[index])


def item_bytes(item: Item) -> int:
    return item[0].nbytes + item[1].nbytes


class DeathStore:
    """get(key, derive) -> derive()'s deaths in `encode`'s compact form (round index, death times)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._items: dict[Hashable, Item] = {}
        self._served: dict[Hashable, int] = {}            # this step's samples: how often each was asked for
        self._repeated = False
        self._lock = threading.Lock()
        self.bytes = 0
        self.derived = 0                                   # derivations admitted or served, over the store's life
        self.hits = 0
        self.step = 0                                      # starts over so far (a prefetcher's in-flight work is
                                                           # tagged with it, so none lands in the next step)

    def _start_over_if_new(self, key: Hashable) -> None:
        if key not in self._served and self._repeated:              # the next step's first sample
            self._items.clear()
            self._served.clear()
            self._repeated, self.bytes = False, 0
            self.step += 1

    def begin(self, keys: Iterable[Hashable]) -> int:
        """A forward's samples are known before it reads any (a prefetch): start the next step if they open
        one, and count them as this step's without serving them. Returns the step."""
        with self._lock:
            for key in keys:
                self._start_over_if_new(key)
                self._served.setdefault(key, 0)
            return self.step

    def peek(self, key: Hashable) -> Item | None:
        """The stored item, or None; counts nothing."""
        with self._lock:
            return self._items.get(key)

    def admit(self, key: Hashable, item: Item, step: int | None = None, fresh: bool = True) -> bool:
        """Keep `item` if it fits (and `step`, when given, is still the store's); True if it is stored.
        fresh: `item` is a new derivation (counted in `derived`)."""
        with self._lock:
            self.derived += fresh
            if step is not None and step != self.step:
                return False
            if key in self._items:
                return True
            size = item_bytes(item)
            if self.bytes + size > self.max_bytes:
                return False
            self._items[key] = item
            self.bytes += size
            return True

    def serve(self, key: Hashable, produce: Callable[[], Item], fresh: bool = True) -> Item:
        """The item for one forward's sample: stored, else produce() (already encoded), admitted if it fits.
        fresh: produce() derives (False: it hands over a derivation already counted, a prefetcher's)."""
        with self._lock:
            self._start_over_if_new(key)
            seen = self._served.get(key, 0)
            self._served[key] = seen + 1
            self._repeated |= seen > 0
            item = self._items.get(key)
            if item is not None:
                self.hits += 1
                return item
            step = self.step
        item = produce()
        self.admit(key, item, step, fresh)
        return item

    def get(self, key: Hashable, derive: Callable[[], tuple[Tensor, list[int]]]) -> Item:
        """derive() returns (deaths, the death time of each round, ascending); `decode` gives the deaths back."""
        return self.serve(key, lambda: encode(*derive()))
