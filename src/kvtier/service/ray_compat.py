"""Every Ray access the service makes outside Ray's public API (ray 2.60), in one place, each with why.

Ray Serve LLM documents these as its extension points but exports no public path to them:
* ``CallbackBase``: the base of ``LLMConfig.callback_config``'s ``callback_class`` (engine_server.LocalModelCallback).
* ``VLLMEngine``: the engine ``LLMServer`` drives, subclassed through its ``_default_engine_cls``
  (engine_server.KVTierVLLMEngine starts vLLM's stat loggers and the load tracker there).
* ``sanitize_chat_request``: what Ray's OpenAI ingress does to a chat body before ``LLMServer.chat``; the
  service's router is its own ingress, so it applies the same step.
And from Ray core: ``session_dir``, the local node's session directory (launch.py looks there for leftovers).
What has a public path is imported from it (``ray.serve.llm.LLMServer``, ``ray.serve.llm.openai_api_models``).
A Ray upgrade that moves any of these fails here, at import, naming the symbol.
"""

from __future__ import annotations

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.serve.core.ingress.utils import _sanitize_chat_completion_request as sanitize_chat_request
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

__all__ = ["CallbackBase", "VLLMEngine", "sanitize_chat_request", "session_dir"]


def session_dir() -> str | None:
    """The connected Ray node's session directory (None when not connected or Ray's internals moved)."""
    try:
        from ray._private import worker

        node = worker._global_node
        return node.get_session_dir_path() if node is not None else None
    except Exception:  # noqa: BLE001 - only used to find leftovers
        return None
