"""kvtier's patch on vLLM's shared-memory queues (vllm.distributed.device_communicators.shm_broadcast
`SpinCondition`, in every vLLM process), listed with why in patches.py `PATCHES`.

Unlike the other patches it does not depend on additional_config.kvtier: it is inert unless
KVTIER_SHM_SPIN_S is set (the service sets it for an engine's processes where EngineConfig.shm_spin_s is
set). Assumes, of vLLM 0.31: `SpinCondition(is_reader, context, notify_address, busy_loop_s=1)`, and that the
writer notifies the queue's socket after every enqueue, which vLLM's own idle path (after busy_loop_s)
already relies on.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("kvtier.engine")

SHM_SPIN_ENV = "KVTIER_SHM_SPIN_S"   # set by the service for its engines' processes (EngineConfig.shm_spin_s)
_SPIN_LOGGED = False


def spin_condition_init(orig):
    """vLLM's shared-memory queue readers (the engine core waiting for a worker's output, a worker waiting
    for the next step) spin on sched_yield() for `busy_loop_s` (1 s) after every message before sleeping on
    the queue's notify socket, which the writer pings after every write. With KVTIER_SHM_SPIN_S set, readers
    spin that long instead; 0 waits on the socket at once (one wake-up per message instead of a spinning
    core). Unset: vLLM's own value."""
    @functools.wraps(orig)
    def __init__(self, is_reader, context, notify_address, *args, **kwargs):
        import os

        value = os.environ.get(SHM_SPIN_ENV)
        if is_reader and value is not None and not args and "busy_loop_s" not in kwargs:
            kwargs["busy_loop_s"] = float(value)
            global _SPIN_LOGGED
            if not _SPIN_LOGGED:
                _SPIN_LOGGED = True
                logger.info("kvtier: vLLM's shared-memory queue readers busy-wait %s s after each message "
                            "(vLLM: 1 s), then sleep on the queue's socket (%s)", value, SHM_SPIN_ENV)
        orig(self, is_reader, context, notify_address, *args, **kwargs)
    return __init__
