"""The `rayllm` arm of `kvtier bench serve`: Ray Serve LLM's own OpenAI app (`build_openai_app`) with plain
vLLM engine settings, on a local Ray started as `kvtier serve` starts its own (so the two Ray arms differ
only in the app). Runs until SIGTERM, then shuts Serve and Ray down.

    python -m kvtier.benchmarks.serve_rayllm --model PATH --model-id ID --port P --metrics-port M \
        --engine-kwargs '{"max_num_seqs": 16, ...}'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--engine-kwargs", type=json.loads, required=True)
    args = ap.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from kvtier.service.app import ENGINE_ENV, LOCAL_RAY_ENV

    stop = threading.Event()
    # logical CPUs for the ingress replica (1 CPU) next to the engine's placement group (2 CPUs on CPU):
    # on a 2-core machine Ray's default would leave the ingress unscheduled forever
    ray.init(address="local", num_cpus=(os.cpu_count() or 2) + 2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             _metrics_export_port=args.metrics_port)
    for sig in (signal.SIGTERM, signal.SIGINT):   # after ray.init: Ray installs its own SIGTERM handler
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        config = LLMConfig(
            model_loading_config={"model_id": args.model_id, "model_source": args.model},
            engine_kwargs=args.engine_kwargs,
            accelerator_config={"kind": "cpu"},
            deployment_config={"logging_config": {"enable_access_log": False}},
            callback_config={"callback_class": "kvtier.service.engine_server.LocalModelCallback"},
            runtime_env={"env_vars": {**ENGINE_ENV, **LOCAL_RAY_ENV, "VLLM_PLUGINS": ""}},   # stock vLLM
        )
        serve.run(build_openai_app({"llm_configs": [config]}), name="rayllm", route_prefix="/", blocking=False)
        print("rayllm: READY", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
