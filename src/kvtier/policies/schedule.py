"""When an eviction round runs and how much it removes (paper §2 and Appendix F).

The r most recent positions (the buffer) are never candidates. Every r decode steps, once the cached
length exceeds K + r, every position outside the buffer is a candidate, the policy keeps K per KV head
and the cache returns to K + r entries, so it never holds more than K + 2r. A cache that reached K + 2r
off the cadence (a preempted request recomputed in full, a prompt longer than K + r) compacts at once:
the catch-up clause. This is the one trigger rule; the vLLM engine and the reference engine call `due`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import PolicyError


@dataclass(frozen=True)
class EvictionSchedule:
    budget: int
    buffer: int = 64

    def __post_init__(self) -> None:
        if self.budget <= 0:
            raise PolicyError(f"budget must be > 0, got {self.budget}")
        if self.buffer <= 0:
            raise PolicyError(f"buffer must be > 0, got {self.buffer}")

    @property
    def max_cached(self) -> int:
        """The most entries a head ever holds."""
        return self.budget + 2 * self.buffer

    @property
    def settled_len(self) -> int:
        """Entries per head right after a round."""
        return self.budget + self.buffer

    def due(self, cached_len: int, decode_steps: int, after_round: bool = False) -> bool:
        """True when a round runs now: `decode_steps` tokens generated (their KV cached) and
        `cached_len` entries per head; on the cadence (every r decode steps) or, off it, once the cache
        holds K + 2r entries (catch-up).

        `after_round`: a round already ran on this cache (since it was last built chronologically). Then
        the next one waits until the cache holds K + 2r again: hole filling moves a round's tail, buffer
        included, into evicted slots anywhere below K + r, so the never-evicted r buffer entries are the
        cache's last r slots only once r entries were appended since. On the steady cadence this is the
        same step; it differs after a catch-up round off the cadence (a recompute after preemption or
        sleep, a prompt longer than K + r), where the next multiple of r would come too soon."""
        if after_round:
            return cached_len >= self.max_cached
        if cached_len <= self.settled_len:
            return False
        on_cadence = decode_steps > 0 and decode_steps % self.buffer == 0
        return on_cadence or cached_len >= self.max_cached

    def num_candidates(self, cached_len: int) -> int:
        return cached_len - self.buffer

    def num_evicted(self, cached_len: int) -> int:
        return max(cached_len - self.settled_len, 0)

    def survival(self, protected: int) -> float:
        """Per-round survival of an unprotected candidate under `random`: (K-ℓp)/(K+r-ℓp)."""
        return (self.budget - protected) / (self.budget + self.buffer - protected)
