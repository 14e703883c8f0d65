"""Task files and prompt templates.

A task file is JSONL, one problem a line: {"question": ..., "answer": ...} ("problem" is accepted for
"question"; an optional "id" names the problem, else its line number). The task name is the file stem.

Prompt templates per model family (what the released models are evaluated with; §4.1 uses each model's
released settings):

* ``qwen3``: the chat template, thinking on, user turn = question + "Please reason step by step, and
  put your final answer within \\boxed{}." (Qwen3's math prompt).
* ``phi4``: the chat template with Phi-4-reasoning's system prompt (abbreviated here: the released one
  is longer; pass ``system=`` to use it verbatim) and the same instruction.
* ``deepseek-r1``: chat template, no system prompt, the instruction inside the user turn.
* ``chatml``: the tokenizer's chat template with the instruction (any model that has one).
* ``plain``: no chat template: "Question: ...\\nAnswer: Let's think step by step." (base models).

``auto`` picks from the model's config (qwen3 → qwen3, phi3/phi → phi4, a tokenizer with a chat
template → chatml, else plain).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PHI4_SYSTEM = (
    "You are Phi, a language model trained by Microsoft to help users. Your role as an assistant involves "
    "thoroughly exploring questions through a systematic thinking process before providing the final precise "
    "and accurate solutions. Please structure your response into two main sections: Thought and Solution using "
    "the specified format: <think> {Thought section} </think> {Solution section}."
)
FAMILIES = ("auto", "qwen3", "phi4", "deepseek-r1", "chatml", "plain")


@dataclass
class Problem:
    task: str
    pid: str
    question: str
    answer: str


def load_tasks(path: str | Path, limit: int | None = None) -> list[Problem]:
    path = Path(path)
    out = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            rec = json.loads(line)
            q = rec.get("question", rec.get("problem"))
            if q is None or "answer" not in rec:
                raise ValueError(f"{path}:{i + 1}: a task line needs 'question' (or 'problem') and 'answer'")
            out.append(Problem(path.stem, str(rec.get("id", i)), str(q), str(rec["answer"])))
            if limit is not None and len(out) >= limit:
                break
    ids = [p.pid for p in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate problem ids")
    return out


def detect_family(model_dir: str | Path, tokenizer=None) -> str:
    cfg_path = Path(model_dir) / "config.json"
    mt = ""
    if cfg_path.exists():
        mt = json.loads(cfg_path.read_text()).get("model_type", "")
    if mt.startswith("qwen3"):
        return "qwen3"
    if mt in ("phi3", "phi"):
        return "phi4"
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return "chatml"
    return "plain"


def build_prompt(tokenizer, question: str, family: str, *, system: str | None = None) -> list[int]:
    """Token ids of the prompt for one question."""
    if family == "plain":
        text = f"Question: {question}\n{INSTRUCTION}\nAnswer: Let's think step by step."
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    user = f"{question}\n{INSTRUCTION}"
    messages = []
    if family == "phi4":
        messages.append({"role": "system", "content": system or PHI4_SYSTEM})
    elif system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user})
    kw = {"enable_thinking": True} if family == "qwen3" else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
