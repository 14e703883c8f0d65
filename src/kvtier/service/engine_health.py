"""The engines' load and health as the router sees them, polled in the background.

Each poll asks every replica of an engine deployment for its load (`kvtier_load`, answered with the
replica's id) and keeps the aggregate (routing.aggregate_loads) that the routing rule reads. Serve picks
the replica of each call, so a poll sends one call per replica it expects; replicas that stop answering
are dropped. An engine none of whose replicas answers for a while is marked unhealthy: its `down` event
is set (requests waiting on it give up with a 503) and `/health` reports it, until it answers again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from .config import ServiceConfig
from .errors import is_dead
from .routing import EngineLoad, aggregate_loads, engine_load

MAX_LOAD_PROBES = 16   # load calls per engine deployment and poll
REPLICA_FIELDS = ("running", "waiting", "kv_usage", "free_blocks", "total_blocks", "in_flight", "age_s", "steps",
                  "node_id", "polled_at")


class EngineHealth:
    """Per engine: the routing load (`loads`), each replica's last answer (`replica_loads`), the state
    `/health` and `/v1/kvtier/stats` report (`state`), and an event set while it is not answering (`down`)."""

    def __init__(self, cfg: ServiceConfig, engines: dict[str, Any]):
        self.cfg, self.engines = cfg, engines
        self.loads: dict[str, EngineLoad] = {}
        self.replica_loads: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in engines}
        self.state: dict[str, dict[str, Any]] = {name: {"healthy": True, "last_ok": time.time()} for name in engines}
        self.down = {name: asyncio.Event() for name in engines}   # set while an engine is not answering
        # KV blocks of requests routed since the engine's last poll (their bound): the headroom rule reads
        # free blocks net of them, so a burst between two polls does not all see the same free pool
        self.debits: dict[str, int] = {}

    def start(self) -> asyncio.Task:
        """Poll every engine every `server.load_poll_s`, on the running loop."""
        return asyncio.get_running_loop().create_task(self.poll_forever())

    def expected_replicas(self, name: str) -> int | None:
        """The engine deployment's fixed replica count, or None when it autoscales."""
        dep = self.cfg.engines[name].deployment
        n = dep.get("num_replicas", 1)
        return None if dep.get("autoscaling_config") or not isinstance(n, int) else max(n, 1)

    async def poll_once(self, name: str) -> None:
        poll = self.cfg.server.load_poll_s
        state = self.state[name]
        replicas = self.replica_loads[name]
        expected = self.expected_replicas(name)
        probes = min(MAX_LOAD_PROBES, max(expected or len(replicas) + 1, len(replicas), 1))
        timeout = max(2.0, 2 * poll)
        results = await asyncio.gather(*(asyncio.wait_for(self.engines[name].kvtier_load.remote(), timeout=timeout)
                                         for _ in range(probes)), return_exceptions=True)
        now = time.time()
        answers = [r for r in results if isinstance(r, dict)]
        if not answers:  # any failure of every call means "not answering"
            exc = next(r for r in results if isinstance(r, BaseException))
            state["error"] = f"{type(exc).__name__}: {exc}"[:300]
            if is_dead(exc):
                replicas.clear()
            if not state.get("answered") and not is_dead(exc):
                return  # still starting: Serve queues requests until the replica is up
            state["healthy"] = now - state["last_ok"] < max(4.0, 4 * poll) and not is_dead(exc)
            if not state["healthy"]:
                replicas.clear()
                self.loads.pop(name, None)
                self.down[name].set()
            return
        for raw in answers:
            replicas[str(raw.get("replica", "?"))] = {**raw, "polled_at": now}
        for rid in [r for r, x in replicas.items() if now - x["polled_at"] > max(5.0, 5 * poll)]:
            del replicas[rid]   # gone, replaced or scaled down
        if expected is not None and len(replicas) > expected:   # a replaced replica: keep the newest answers
            for rid in sorted(replicas, key=lambda r: replicas[r]["polled_at"])[:len(replicas) - expected]:
                del replicas[rid]
        agg = aggregate_loads(replicas)
        nodes = {x.get("node_id") for x in replicas.values()}
        state.update(agg, healthy=not agg["errored"], last_ok=now, error=None, answered=True,
                     node_id=next(iter(nodes)) if len(nodes) == 1 else None,
                     replica_loads={r: {k: x.get(k) for k in REPLICA_FIELDS} for r, x in replicas.items()})
        self.down[name].clear()
        self.loads[name] = engine_load(agg)
        self.on_polled(name)

    # -- what the router has sent since the last poll (the headroom rule) ----------------------------------
    def on_polled(self, name: str) -> None:
        self.debits.pop(name, None)

    def debit(self, decision, cfg: ServiceConfig) -> None:
        """Count a routed request's KV bound against its engine's free blocks until the next poll."""
        load = self.loads.get(decision.engine)
        if load is None or load.block_size is None:
            return
        from .routing import RequestShape, blocks_needed

        req = RequestShape(decision.prompt_tokens, decision.max_tokens)
        need = blocks_needed(decision.tier, req, cfg.engines[decision.engine], load.block_size)
        self.debits[decision.engine] = self.debits.get(decision.engine, 0) + need

    def routing_loads(self) -> dict[str, EngineLoad]:
        """The polled loads with each engine's free blocks less what was routed to it since."""
        return {name: replace(load, free_blocks=load.free_blocks - self.debits.get(name, 0))
                if load.free_blocks is not None else load for name, load in self.loads.items()}

    async def poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll_once(n) for n in self.engines), return_exceptions=True)
            await asyncio.sleep(self.cfg.server.load_poll_s)
