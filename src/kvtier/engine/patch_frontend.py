"""kvtier's patches on vLLM's frontend (the caller's process: `EngineArgs`, the V1 `InputProcessor`), listed
with why in patches.py `PATCHES`.

Each function takes vLLM's original and returns its replacement, which calls the original. Assumes, of vLLM
0.31: `EngineArgs.create_engine_config` raises ValueError with vLLM's Model Runner V2 advice
(support.V2_ADVICE) for settings that need it; `InputProcessor.process_inputs(request_id, prompt, params,
...)` returns the EngineCoreRequest (with prompt_token_ids) and raises VLLMValidationError with that advice
for request parameters that need V2 (e.g. prompt_logprob_token_ids), and carries the request's public
SamplingParams (which kvtier may switch to skip_reading_prefix_cache); `OutputProcessor.process_outputs(
engine_core_outputs, ...)` with `request_states` by internal request id.
"""

from __future__ import annotations

import functools


def create_engine_config(orig):
    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        from .support import V2_ADVICE, UnsupportedEngineConfig, check_supported, v2_refusal

        try:
            config = orig(self, *args, **kwargs)
        except ValueError as exc:          # vLLM's "needs Model Runner V2" advice, which kvtier would refuse
            if V2_ADVICE not in str(exc) or "kvtier" not in (getattr(self, "additional_config", None) or {}):
                raise
            raise UnsupportedEngineConfig(v2_refusal(str(exc))) from exc
        check_supported(config)
        return config
    return create_engine_config


def process_inputs(orig):
    @functools.wraps(orig)
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        from vllm.exceptions import VLLMValidationError

        from .config import EngineEvictionConfig
        from .support import V2_ADVICE, KVTierRequestError, v2_refusal, validate_engine_request

        try:
            request = orig(self, request_id, prompt, params, *args, **kwargs)
        except VLLMValidationError as exc:   # e.g. prompt_logprob_token_ids: vLLM advises Model Runner V2
            if V2_ADVICE not in str(exc) or EngineEvictionConfig.from_vllm(self.vllm_config) is None:
                raise
            raise KVTierRequestError(v2_refusal(str(exc)), parameter=getattr(exc, "parameter", None)) from exc

        validate_engine_request(self.vllm_config, request)
        from .scheduler_side import skip_prefix_cache_reads

        skip_prefix_cache_reads(self.vllm_config, request)
        return request
    return process_inputs


def process_outputs(orig):
    @functools.wraps(orig)
    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        from .final_budget import take_from_outputs

        take_from_outputs(self.request_states, engine_core_outputs)
        return orig(self, engine_core_outputs, *args, **kwargs)
    return process_outputs
