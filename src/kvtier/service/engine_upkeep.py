"""What an engine replica does beside serving requests (engine_server.KVTierLLMServer.start):

- before vLLM starts, wait (bounded by `server.model_wait_s`) for the model's files (weights.py), with the
  time waited as `ray_kvtier_model_wait_seconds`: a start that fails on missing files counts against Serve's
  failed-start budget, a wait does not;
- once it serves, every UPKEEP_S: kvtier's KV gauges (free/used blocks, running/waiting requests) from the
  engine's own load, so they stay fresh whether or not a router polls, and the replica's pod-readiness
  heartbeat (pod_ready.py: `serving`, or `errored` once its vLLM engine has failed).
Best effort: neither ever fails the replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .pod_ready import ERRORED, SERVING, Heartbeat, replica_identity
from .weights import wait_for_model

UPKEEP_S = 5.0
WAIT_S_KEY, READY_FILE_KEY = "kvtier_model_wait_s", "kvtier_model_ready_file"   # LLMConfig.experimental_configs
logger = logging.getLogger("kvtier.service")


async def wait_for_model_files(llm_config: Any) -> float:
    """Wait for the engine's model files as the service config says (app.llm_config puts the settings in
    `experimental_configs`); the seconds waited."""
    extra = llm_config.experimental_configs or {}
    source = llm_config.model_loading_config.model_source
    deployment = replica_identity()[0]
    if not isinstance(source, str) or not extra.get(WAIT_S_KEY):
        return 0.0
    from kvtier.observability.exporters import model_wait_reporter

    return await wait_for_model(source, extra.get(READY_FILE_KEY) or "config.json", float(extra[WAIT_S_KEY]),
                                f"engine replica of {deployment}", report=model_wait_reporter(deployment))


def tick(server: Any, heartbeat: Heartbeat) -> dict[str, Any] | None:
    """One upkeep step: the engine's load to the gauges, its state to the heartbeat; the load (None before
    the engine exists)."""
    engine = getattr(server, "engine", None)
    if engine is None or not hasattr(engine, "load"):
        return None
    load = engine.load()
    exporter = server._metrics_exporter()
    if exporter is not None:
        exporter.update_load(load)
    errored = bool(load.get("errored"))
    heartbeat.beat(ERRORED if errored else SERVING, "its vLLM engine has failed" if errored else "")
    return load


async def run(server: Any, every_s: float = UPKEEP_S) -> None:
    """`tick` every `every_s` until cancelled; removes the heartbeat when it stops."""
    heartbeat = Heartbeat(*replica_identity())
    try:
        while True:
            try:
                tick(server, heartbeat)
            except Exception as exc:  # noqa: BLE001 - upkeep never fails the replica
                logger.warning("kvtier replica upkeep failed: %s", exc)
            await asyncio.sleep(every_s)
    finally:
        heartbeat.clear()
