"""The `server:` section of a service configuration (pydantic): listening, ingress, CPU priority, auth mode,
and where the router replicas go and how long replicas wait for model files. Re-exported by config.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ServerConfig(BaseModel):
    """`server:` of a service config: where and how the service listens, starts and waits."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    app_name: str = "kvtier"
    ray_address: str | None = None                  # None: start a local Ray; "auto" or host:port: join
    num_cpus: int | None = None                     # local Ray only
    # Ray's Prometheus metrics export port on a local Ray (None: Ray picks one; `kvtier serve --prometheus`
    # uses 8080 unless set). On a joined cluster the cluster's own setting applies.
    metrics_export_port: int | None = Field(default=None, ge=1, le=65535)
    # Serve HTTP proxies: HeadOnly (one port on the head node) or EveryNode (a proxy per node).
    proxy_location: Literal["HeadOnly", "EveryNode"] = "HeadOnly"
    load_poll_s: float = Field(default=1.0, gt=0)   # how often the router reads engine load
    request_timeout_s: float = Field(default=600, gt=0)
    router_replicas: int = Field(default=1, ge=1)
    # Streams: the first chunk goes out at once, later ones are coalesced and sent at most every
    # stream_interval_ms (each send is one Ray object per hop: engine -> router -> proxy). 0: every chunk.
    stream_interval_ms: float = Field(default=200, ge=0, le=5000)
    # On a Ray kvtier serve starts: Ray's and Serve's processes at this nice value, vLLM's engine processes
    # at 0, so the engine core's scheduler gets its core first (service/cpu_priority.py). None: Ray's own.
    serving_nice: int | None = Field(default=19, ge=1, le=19)
    # The router replica's own nice value under serving_nice (None: 0 when it serves HTTP itself, i.e. with
    # direct ingress, else serving_nice's; 0: left at the engine's priority). Measured in docs/serving.md.
    router_nice: int | None = Field(default=None, ge=0, le=19)
    # How HTTP reaches the router. "proxy": Serve's HTTP proxy forwards to the router deployment (one more
    # Ray hop each way). "direct": Ray Serve's direct ingress in its throughput-optimized mode, the router
    # replica itself listens on `port` (Serve's proxy moves to a free port); a local Ray with one router
    # replica only. "auto" (the default): direct where it can be (a local Ray, one router replica), else
    # proxy. Measured on this CPU in float32, three runs each (docs/serving.md, sixth pass): direct met
    # issue #27's targets together in 2 runs of 3, the proxy in 1 (its idle TTFT and burst missed).
    ingress: Literal["auto", "proxy", "direct"] = "auto"
    # "keys": only callers with a tenant's API key, and no start without one configured (fail closed).
    # "open": every caller gets every tier without a key; an explicit choice for local demos, never inferred.
    auth: Literal["keys", "open"] = "keys"

    # Ray resources the router replicas require (e.g. {kvtier_router: 1}): places them on the nodes that offer
    # it, those that mount the API keys and the model files the tokenizer is read from (KubeRay: the router
    # worker group, docs/deploy.md). None: anywhere (a 0-CPU actor).
    router_resources: dict[str, float] | None = None
    # Before loading a model from a local path, engine and router replicas wait up to this long for its files
    # (`model_ready_file` in the model directory) instead of failing their start, which Serve counts against
    # the deployment (weights.py). 0: no wait.
    model_wait_s: float = Field(default=0, ge=0)
    # The file whose presence says a model directory is complete (relative to it); the download Job writes it
    # last. Default config.json (what every loader reads first).
    model_ready_file: str = "config.json"

    @model_validator(mode="after")
    def _direct_ingress_is_local(self):
        if self.ingress == "direct" and not self._direct_possible():
            raise ValueError("server.ingress 'direct' needs a local Ray (ray_address unset) and router_replicas 1: "
                             "the router replica listens on the port itself")
        return self

    def _direct_possible(self) -> bool:
        return self.ray_address is None and self.router_replicas == 1

    @property
    def direct_ingress(self) -> bool:
        """Whether the router replica serves HTTP itself (`ingress`, with "auto" resolved)."""
        return self.ingress == "direct" or (self.ingress == "auto" and self._direct_possible())

    @property
    def router_nice_value(self) -> int | None:
        """The router's nice value under serving_nice (`router_nice`, with None resolved)."""
        if self.serving_nice is None:
            return None
        if self.router_nice is not None:
            return self.router_nice
        return 0 if self.direct_ingress else self.serving_nice
