"""Prompt lengths for routing, with the model's own tokenizer and chat template (the engine re-tokenizes
and has the last word; a mismatch there only shifts the routing decision, never what is served)."""

from __future__ import annotations

from typing import Any


class PromptCounter:
    def __init__(self, model_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def completion(self, prompt: str | list) -> int:
        """Longest prompt of a completion request (a string, strings, token ids, or lists of ids). A text
        the tokenizer cannot encode (a character-level vocabulary without it) is a ValueError, i.e. a 400."""
        if isinstance(prompt, str):
            try:
                return len(self.tokenizer.encode(prompt))
            except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception ("Missing [UNK] ...")
                if isinstance(exc, (ValueError, TypeError)):
                    raise
                raise ValueError(str(exc)) from exc
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        return max(self.completion(p) for p in prompt)

    def chat(self, messages: list[dict[str, Any]]) -> int:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return len(ids)
