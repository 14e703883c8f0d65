"""The rollout server's admission gate, and the calls that close and open it: sleep / wake-up around training
and abort / resume around partial rollouts and weight syncs (verl's vLLM server contract).

Sleep first drains the server (as verl's vLLM server does through vLLM's sleep, whose default mode aborts
what runs): new requests park until the wake-up, requests still running are aborted (they return
stop_reason "aborted", which verl's partial-rollout client resubmits); then `AsyncLLM.sleep` where vLLM
sleep mode is available (CUDA/ROCm/XPU). On CPU vLLM has no sleep mode: the engine keeps its memory (logged
once), the drain and the parking still happen. kvtier's engine rebuilds its device tables at every wake-up
(`kvtier.engine.patches`, Worker.wake_up)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger("kvtier.rollout")

_GATE_BARRIER_TIMEOUT_S = 60.0


class AdmissionMixin:
    """`KVTierServer`'s gate, sleep/wake and abort/resume methods. Needs `self.engine` (the AsyncLLM),
    `self.free_cache_engine`, `self.rollout_mode` and `self._sleep_supported`; `_init_admission()` in
    `__init__`, and `self._resume_event` set (an open `asyncio.Event`) once the engine runs."""

    def _init_admission(self) -> None:
        # a request is admitted only while neither abort_all_requests (until resume_generation) nor sleep
        # (until wake_up) holds the gate
        self._submission_paused = False
        self._asleep = False
        self._rejecting = False
        self._admitting = 0
        self._resume_event: asyncio.Event | None = None
        self._sleep_note_logged = False

    async def _park_until_admitted(self) -> bool:
        """Wait while the gate is closed; True: rejected (abort_all_requests with reject_request)."""
        while self._submission_paused or self._asleep:
            if self._submission_paused and self._rejecting:
                return True
            await self._resume_event.wait()
        self._admitting += 1
        return False

    def _update_gate(self) -> None:
        if self._resume_event is None:
            return
        if self._submission_paused or self._asleep:
            self._resume_event.clear()
        else:
            self._resume_event.set()

    # -- sleep / wake / caches --------------------------------------------------------------------
    def _sleep_available(self) -> bool:
        if not self._sleep_supported and not self._sleep_note_logged:
            logger.info("kvtier rollout: sleep/wake are no-ops (vLLM sleep mode unavailable on this platform or "
                        "enable_sleep_mode=False); the engine keeps its weights and KV pool")
            self._sleep_note_logged = True
        return self._sleep_supported

    def _sleeps(self) -> bool:
        """Whether sleep/wake_up act: verl's rule (free_cache_engine, not standalone)."""
        return self.free_cache_engine and self.rollout_mode != "standalone"

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if not self._sleeps():
            return
        if self._sleep_available():
            await self.engine.wake_up(tags=tags or ["kv_cache", "weights"])
            await self.engine.reset_prefix_cache()
            if await self.engine.is_sleeping():
                return            # partly awake (verl wakes "weights", syncs them, then "kv_cache")
        elif tags is not None and "kv_cache" not in tags:
            return
        if self._asleep:
            await self.engine.resume_generation()
            self._asleep = False
            self._update_gate()

    async def sleep(self) -> None:
        """Drain, then sleep: new requests park until `wake_up`, running ones are aborted (stop_reason
        "aborted"), then vLLM sleeps where it can. Nothing runs while the trainer holds the memory."""
        if not self._sleeps():
            return
        await self._drain()
        if self._sleep_available():
            # hybrid: the trainer re-sends every weight after waking, so level 2 drops them; colocated keeps them
            await self.engine.sleep(level=2 if self.rollout_mode == "hybrid" else 1)

    async def _drain(self) -> int:
        """Close the gate for the sleep, let admissions already past it land, abort what still runs."""
        self._asleep = True
        running = await self._close_gate_and_abort(clear_cache=True)
        if running:
            logger.warning("kvtier rollout: %d request(s) still running at sleep; aborted them", len(running))
        return len(running)

    async def _close_gate_and_abort(self, clear_cache: bool) -> list[str]:
        """Apply the gate's new state, let admissions already past it land (bounded), then abort every
        request the engine still runs; returns their ids."""
        self._update_gate()
        deadline = time.monotonic() + _GATE_BARRIER_TIMEOUT_S
        while self._admitting > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        request_ids = list(self.engine.output_processor.request_states.keys())
        await self.engine.pause_generation(mode="abort", clear_cache=clear_cache)
        return request_ids

    async def clear_kv_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        if not self.free_cache_engine or self.rollout_mode != "hybrid" or not self._sleep_available():
            return
        await self.engine.sleep(level=2)
        await self.engine.wake_up(tags=["weights"])

    async def resume_kv_cache(self) -> None:
        if not self.free_cache_engine or self.rollout_mode != "hybrid" or not self._sleep_available():
            return
        await self.engine.wake_up(tags=["kv_cache"])
        await self.engine.reset_prefix_cache()

    def num_unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    async def wait_for_requests_to_drain(self) -> None:
        await self.engine.wait_for_requests_to_drain()

    # -- abort / resume (partial rollouts, weight sync) -------------------------------------------
    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        self._submission_paused = True
        self._rejecting = reject_request
        request_ids = await self._close_gate_and_abort(clear_cache=reset_prefix_cache)
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_engine_generation(self) -> None:
        await self.engine.resume_generation()

    async def open_submission_gate(self) -> None:
        self._rejecting = False
        self._submission_paused = False
        self._update_gate()

    async def resume_generation(self) -> None:
        await self.resume_engine_generation()
        await self.open_submission_gate()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Abort one request by the id verl gave it (vLLM maps it to its internal ids)."""
        if request_id not in self.engine.output_processor.external_req_ids:
            return {"aborted": False, "error": f"Request {request_id} not found"}
        await self.engine.abort(request_id)
        return {"aborted": True, "request_id": request_id}
