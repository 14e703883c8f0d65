"""Waiting for a model's files before loading it (issue #61 item 2): the documented order on Kubernetes
applies the service before the download Job has filled the model volume.

A replica that fails its start because the files are missing is counted by Serve, which marks the
deployment failed after min(20, 3 x replicas) failed starts; a replica that waits inside its start is not.
So engine replicas (before vLLM starts) and router replicas (before loading the tokenizer) wait, bounded by
`server.model_wait_s`, for `server.model_ready_file` to exist in the model directory, logging every
`log_every_s` and reporting the time waited (the gauge `ray_kvtier_model_wait_seconds`). Only local paths
wait: a hub id is downloaded by Ray Serve LLM, "tiny" is built in place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger("kvtier.service")


class ModelFilesMissing(RuntimeError):
    """The model's files did not appear within the wait."""


def is_local_path(model: str) -> bool:
    return os.path.isabs(model) or model.startswith(("./", "../"))


async def wait_for_model(model: str, ready_file: str, timeout_s: float, who: str,
                         report: Callable[[float], None] | None = None, poll_s: float = 2.0,
                         log_every_s: float = 30.0) -> float:
    """Return the seconds waited until `<model>/<ready_file>` exists (0 at once, or for a non-local model or
    `timeout_s` 0). Raises ModelFilesMissing after `timeout_s`. `report(waited)` is called on every look
    and once with 0 when the files are there."""
    if timeout_s <= 0 or not is_local_path(model):
        return 0.0
    marker = Path(model) / ready_file
    start = time.monotonic()
    logged = None
    while not marker.exists():
        waited = time.monotonic() - start
        if report is not None:
            report(waited)
        if waited >= timeout_s:
            raise ModelFilesMissing(f"{who}: {marker} did not appear within server.model_wait_s={timeout_s:g} s; "
                                    "fill the model volume (docs/deploy.md, the download Job) and the replica restarts")
        if logged is None or waited - logged >= log_every_s:
            logger.warning("%s: waiting for the model files: %s is missing (waited %.0f s of %g s)",
                           who, marker, waited, timeout_s)
            logged = waited
        await asyncio.sleep(min(poll_s, max(0.01, timeout_s - waited)))
    waited = time.monotonic() - start
    if report is not None:
        report(0.0)
    if waited > 0.5:
        logger.warning("%s: the model files are there after %.0f s: %s", who, waited, marker)
    return waited
