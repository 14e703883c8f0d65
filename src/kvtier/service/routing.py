"""The tier routing rule (pure: no Ray, no vLLM, no I/O).

Given a request's shape (prompt tokens, max_tokens, model, an optional explicit tier), the tiers the
caller may use and the engines' current load, pick a tier and say why. `routing.rule: headroom` (the
default) is `headroom` below; `cheapest-fit` is steps 2-3:

0. Headroom (auto routing): the largest budget whose KV bound fits the engine's free blocks now (its
   polled free blocks less what the router has sent it since, `EngineLoad.free_blocks`), full attention
   first, then fixed compressed tiers by budget (each only for prompts it takes, step 2's trace share);
   reason `headroom`. Nothing fits (or the engine already queues): the elastic tier, which runs at full
   attention until the engine needs its blocks and then at its floor (reason `headroom-floor`); without
   one, the smallest fixed budget that takes the prompt, queued there (`headroom-queued`). Before the first
   load poll the free blocks are unknown: the bound is taken to fit. Elastic tiers are never picked by
   cheapest-fit, and are always available explicitly.

1. Explicit tier (body field `tier` or header `x-kvtier-tier`): used if it exists, serves the model and
   the caller may use it (else 404 / 403). Reason `explicit`. No pressure fallback: the caller insisted.
2. Otherwise, among the tiers the caller may use that serve the model and are `auto`:
   - a compressed tier with budget K *fits* when the prompt leaves at least `min_trace_share` of K for
     the trace (prompt <= (1 - share) * K); every tier needs prompt + max_tokens <= max_model_len;
   - let C be the cheapest (smallest K) fitting compressed tier. If prompt + max_tokens <= K_C + r_C the
     request can never trigger an eviction round there, so compression cannot pay: it goes to a full
     attention tier (reason `short`);
   - otherwise it goes to C (reason `cheapest-fit`, or `long-prompt` when smaller budgets were skipped
     because the prompt would crowd out the trace);
   - no compressed tier fits: full attention (reason `no-compressed-fit`) if allowed, else 400.
3. KV pressure (auto routing only): if the chosen tier's engine has KV usage or queue depth at its
   threshold and `on_pressure` is `fallback`, the trace-share preference is dropped: take the
   largest-budget compressed tier that still holds the prompt (prompt <= K, the engine's own limit),
   whose KV bound for this request (min(prompt + max_tokens, K + 2r)) is strictly smaller than the
   chosen tier's, and whose engine is not itself under pressure (the same engine is fine: a smaller
   budget relieves it); reason `pressure-fallback`. If there is none, or with `on_pressure: queue`, the
   tier is kept and its engine queues the request (reason `pressure-queued`).

Rejections carry an HTTP status and a stable reason code (also the metrics label).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import EngineConfig, PressureConfig, ServiceConfig, TierConfig

REASONS = ("explicit", "short", "cheapest-fit", "long-prompt", "no-compressed-fit", "pressure-fallback", "pressure-queued",
           "headroom", "headroom-floor", "headroom-queued")


class RouteError(Exception):
    def __init__(self, status: int, reason: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.reason, self.message, self.param = status, reason, message, param


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    max_tokens: int | None          # None: up to the model length (vLLM's default for chat)
    model: str | None = None
    tier: str | None = None         # explicit tier, if any


@dataclass(frozen=True)
class EngineLoad:
    kv_usage: float = 0.0           # 0..1 share of the KV pool in use (all replicas' pools together)
    waiting: float = 0              # requests queued in the scheduler (per replica, on average)
    running: int = 0
    free_blocks: int | None = None  # the most free KV blocks of one replica (what one request can use); None: unknown
    block_size: int | None = None

    def pressured(self, p: PressureConfig) -> bool:
        return self.kv_usage >= p.kv_usage or self.waiting >= max(p.queue_depth, 1)


def aggregate_loads(replicas: dict[str, dict]) -> dict:
    """One engine deployment's load from its replicas' `kvtier_load()` answers: requests and KV blocks
    summed over the replicas, `kv_usage` = used / total blocks over all their pools, and `waiting_per_replica`
    the mean queue (what the pressure rule compares with `queue_depth`, a per-engine threshold). Serve
    sends each request to one of the replicas, preferring the less loaded of two, so the pressure rule
    reads the deployment as a whole rather than whichever replica answered last.

    A replica whose vLLM engine reports `errored` serves nothing (Serve replaces it): its pool is left out
    and counted in `errored_replicas`. The deployment is `errored` only when every replica is: one failed
    replica of three leaves the engine serving on the other two."""
    everyone = list(replicas.values())
    errored = sum(1 for x in everyone if x.get("errored"))
    loads = [x for x in everyone if not x.get("errored")] or everyone
    total = sum(int(x.get("total_blocks", 0)) for x in loads)
    free = sum(int(x.get("free_blocks", 0)) for x in loads)
    waiting = sum(int(x.get("waiting", 0)) for x in loads)
    return {
        "replicas": len(loads), "running": sum(int(x.get("running", 0)) for x in loads), "waiting": waiting,
        "waiting_per_replica": waiting / len(loads) if loads else 0.0,
        "total_blocks": total, "free_blocks": free, "kv_usage": (total - free) / total if total else 0.0,
        "max_free_blocks": max((int(x.get("free_blocks", 0)) for x in loads), default=0),
        "in_flight": sum(int(x.get("in_flight") or 0) for x in loads),
        "preemptions": sum(int(x.get("preemptions") or 0) for x in loads),
        "block_size": loads[0].get("block_size") if loads else None,
        "errored": bool(everyone) and errored == len(everyone), "errored_replicas": errored,
    }


def engine_load(aggregate: dict) -> EngineLoad:
    return EngineLoad(kv_usage=aggregate["kv_usage"], waiting=aggregate["waiting_per_replica"],
                      running=aggregate["running"], free_blocks=aggregate.get("max_free_blocks"),
                      block_size=aggregate.get("block_size"))


@dataclass(frozen=True)
class Decision:
    tier: TierConfig
    reason: str
    detail: str
    model: str
    max_tokens: int | None
    prompt_tokens: int = 0

    @property
    def engine(self) -> str:
        return self.tier.engine


def _total(req: RequestShape, eng: EngineConfig) -> int:
    return eng.max_model_len if req.max_tokens is None else req.prompt_tokens + req.max_tokens


def kv_bound(tier: TierConfig, req: RequestShape, eng: EngineConfig) -> int:
    """KV entries per head this request can ever hold in the tier (cache <= max(prompt, K + 2r))."""
    total = _total(req, eng)
    if tier.bound_budget is None:
        return total
    return min(total, max(req.prompt_tokens, tier.bound_budget + 2 * tier.buffer))


def prompt_room(tier: TierConfig, share: float) -> int:
    """Longest prompt a compressed (or elastic: its floor) tier takes under the trace-share rule."""
    return int((1.0 - share) * tier.bound_budget)


def resolve_model(cfg: ServiceConfig, model: str | None) -> str:
    ids = cfg.model_ids
    if model is None or model == "":
        if len(ids) == 1:
            return ids[0]
        raise RouteError(400, "model-required", f"`model` is required; served models: {ids}", "model")
    if model not in ids:
        raise RouteError(404, "unknown-model", f"model {model!r} is not served here; served models: {ids}", "model")
    return model


def route(cfg: ServiceConfig, req: RequestShape, allowed: set[str] | frozenset[str],
          loads: dict[str, EngineLoad] | None = None) -> Decision:
    return replace(_route(cfg, req, allowed, loads or {}), prompt_tokens=req.prompt_tokens)


def _route(cfg: ServiceConfig, req: RequestShape, allowed: set[str] | frozenset[str],
           loads: dict[str, EngineLoad]) -> Decision:
    model = resolve_model(cfg, req.model)
    if req.prompt_tokens < 1:
        raise RouteError(400, "empty-prompt", "the prompt is empty", "prompt")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise RouteError(400, "bad-request", "max_tokens must be at least 1", "max_tokens")
    serving = [t for t in cfg.tiers if cfg.model_id(t.engine) == model]

    def length_error(t: TierConfig) -> RouteError | None:
        eng = cfg.engines[t.engine]
        if req.prompt_tokens >= eng.max_model_len:
            return RouteError(400, "prompt-too-long", f"the prompt has {req.prompt_tokens} tokens; model {model!r} "
                              f"takes at most {eng.max_model_len - 1}", "prompt")
        if req.max_tokens is not None and _total(req, eng) > eng.max_model_len:
            return RouteError(400, "context-too-long", f"prompt ({req.prompt_tokens} tokens) + max_tokens "
                              f"({req.max_tokens}) exceeds the model length {eng.max_model_len}", "max_tokens")
        return None

    # 1. explicit tier
    if req.tier is not None:
        tier = cfg.tier(req.tier)
        if tier is None or tier not in serving:
            names = [t.name for t in serving if t.name in allowed]
            raise RouteError(404, "unknown-tier", f"tier {req.tier!r} does not exist for model {model!r}; "
                             f"tiers you may use: {names}", "tier")
        if tier.name not in allowed:
            raise RouteError(403, "forbidden-tier", f"tier {req.tier!r} is not allowed for this API key; "
                             f"allowed: {sorted(allowed & {t.name for t in serving})}", "tier")
        if (err := length_error(tier)) is not None:
            raise err
        return Decision(tier, "explicit", f"tier {tier.name} requested", model, req.max_tokens)

    # 2. automatic
    usable = [t for t in serving if t.auto and t.name in allowed]
    if not usable:
        raise RouteError(403, "no-tier", f"this API key may use no automatic tier for model {model!r}", "model")
    errors = [length_error(t) for t in usable]
    if all(errors):
        raise errors[0]
    usable = [t for t, err in zip(usable, errors) if err is None]
    share = cfg.routing.min_trace_share
    compressed = sorted((t for t in usable if t.compressed), key=lambda t: t.budget)
    fitting = [t for t in compressed if req.prompt_tokens <= prompt_room(t, share)]
    full = [t for t in usable if not t.compressed and not t.elastic]
    if cfg.routing.rule == "headroom":
        elastic = [t for t in usable if t.elastic and req.prompt_tokens <= prompt_room(t, share)]
        return headroom(cfg, req, model, full + fitting[::-1], elastic, loads)
    total = lambda t: _total(req, cfg.engines[t.engine])  # noqa: E731

    if fitting:
        cheapest = fitting[0]
        if full and total(full[0]) <= cheapest.budget + cheapest.buffer:
            decision = Decision(full[0], "short", f"prompt+max_tokens={total(full[0])} <= K+r="
                                f"{cheapest.budget + cheapest.buffer} of {cheapest.name}: no eviction would run",
                                model, req.max_tokens)
        else:
            skipped = [t.name for t in compressed if t.budget < cheapest.budget]
            if skipped:
                decision = Decision(cheapest, "long-prompt", f"prompt={req.prompt_tokens} leaves under "
                                    f"{share:.0%} of K in {skipped}", model, req.max_tokens)
            else:
                decision = Decision(cheapest, "cheapest-fit", f"smallest budget K={cheapest.budget} that leaves "
                                    f"{share:.0%} of K for the trace", model, req.max_tokens)
    elif full:
        decision = Decision(full[0], "no-compressed-fit", f"prompt={req.prompt_tokens} too long for every "
                            f"compressed tier at min_trace_share={share}", model, req.max_tokens)
    else:
        rooms = {t.name: prompt_room(t, share) for t in compressed}
        raise RouteError(400, "prompt-too-long", f"the prompt has {req.prompt_tokens} tokens; the tiers you may "
                         f"use take at most {rooms} (each keeps {share:.0%} of its budget for the trace)", "prompt")

    # 3. KV pressure
    return _under_pressure(cfg, req, decision, compressed, loads)


def blocks_needed(tier: TierConfig, req: RequestShape, eng: EngineConfig, block_size: int) -> int:
    return -(-kv_bound(tier, req, eng) // block_size)


def headroom(cfg: ServiceConfig, req: RequestShape, model: str, largest_first: list[TierConfig],
             elastic: list[TierConfig], loads: dict[str, EngineLoad]) -> Decision:
    """Rule 0 (module docstring): `largest_first` = full-attention tiers, then fixed budgets, largest first,
    each taking the prompt; `elastic` = the elastic tiers that take it."""
    for t in largest_first:
        load = loads.get(t.engine)
        if load is None or load.free_blocks is None or load.block_size is None:
            return Decision(t, "headroom", f"engine {t.engine}'s free KV not known yet: {t.name}", model, req.max_tokens)
        need = blocks_needed(t, req, cfg.engines[t.engine], load.block_size)
        if load.waiting < 1 and need <= load.free_blocks:
            return Decision(t, "headroom", f"{t.name}'s KV bound ({need} blocks) fits the {load.free_blocks} free "
                            f"blocks of engine {t.engine}", model, req.max_tokens)
    why = "no tier's KV bound fits the engine's free blocks" if largest_first else "no tier takes the prompt"
    if elastic:
        t = elastic[0]
        return Decision(t, "headroom-floor", f"{why}: {t.name} (full attention while blocks last, then K={t.floor})",
                        model, req.max_tokens)
    fixed = [t for t in largest_first if t.compressed]
    if fixed or largest_first:
        t = (fixed or largest_first)[-1]
        return Decision(t, "headroom-queued", f"{why}: queued on {t.name}", model, req.max_tokens)
    raise RouteError(400, "prompt-too-long", f"the prompt has {req.prompt_tokens} tokens; no tier you may use takes "
                     f"it with {cfg.routing.min_trace_share:.0%} of its budget left for the trace", "prompt")


def _under_pressure(cfg: ServiceConfig, req: RequestShape, decision: Decision, compressed: list[TierConfig],
                    loads: dict[str, EngineLoad]) -> Decision:
    tier = decision.tier
    eng = cfg.engines[tier.engine]
    load = loads.get(tier.engine)
    if load is None or not load.pressured(eng.pressure):
        return decision
    why = f"engine {tier.engine} under KV pressure (usage={load.kv_usage:.2f}, waiting={load.waiting})"
    if cfg.routing.on_pressure == "fallback":
        bound = kv_bound(tier, req, eng)
        for t in sorted(compressed, key=lambda t: -t.budget):
            other = loads.get(t.engine)
            if req.prompt_tokens > t.budget or kv_bound(t, req, cfg.engines[t.engine]) >= bound:
                continue
            if t.engine != tier.engine and other is not None and other.pressured(cfg.engines[t.engine].pressure):
                continue
            return Decision(t, "pressure-fallback", f"{why}: {tier.name} -> {t.name}", decision.model, req.max_tokens)
    return Decision(tier, "pressure-queued", f"{why}: queued on {tier.name}", decision.model, req.max_tokens)
