"""`kvtier eval trace-errors`: where a reasoner's teacher-forced mistakes are, on gold held-out traces.

Under full attention, the model's forward over bos + prompt + the gold trace + eos; every trace token whose
argmax is not the gold one is an error, named by the line it sits in:

* ``question``: the restated question (``?x`` / ``?k``), copied from the prompt across the whole trace;
* ``answer``: the boxed answer (``\\boxed{..}``): the last value (local) or the key (needle, read from the key line);
* ``key_line``: the needle's ``k=..`` line; ``start``: the trace's first line, restating the prompt's start;
* ``line``: any other computed line (its column: 0-2 the counter, 4-5 and 7-8 the two values).

With each error the probability of the gold token and of the predicted one: a retrieval at chance shows as
p ~0.5 on the question (two choices) and ~0.1 on a key digit. It is how the long recipe's retrieval phases
were chosen (reasoner_recipe._RETRIEVAL, docs/reasoner.md): a model whose computed lines are all right and whose
question and key are guesses needs retrieval, not arithmetic.
"""

from __future__ import annotations

from collections import Counter

FIELDS = ("question", "answer", "key_line", "start", "line")


def field_of(line: str, line_index: int) -> str:
    """The field a trace line is (`line` without its newline; `line_index` 0 is the trace's first line)."""
    if line.startswith("?"):
        return "question"
    if line.startswith("\\boxed{"):
        return "answer"
    if line.startswith("k="):
        return "key_line"
    return "start" if line_index == 0 else "line"


def trace_errors(model_dir: str, family: str = "chains", kinds: tuple[str, ...] = ("local", "needle"),
                 problems: int = 16, bf16: bool = False) -> dict:
    """{"per_kind": {kind: {"traces", "traces_wrong", "by_field"}}, "errors": [...]} for `problems` held-out
    problems of each kind of `family` (kvtier.tasks.chains), teacher forced under full attention."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtier.models.reasoner_data import encode_problem
    from kvtier.tasks import chains

    fam = chains.family(family)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    per_kind, errors = {}, []
    for kind in kinds:
        fields, wrong = Counter(), 0
        for i, p in enumerate(fam.eval_problems(problems, kind)):
            prompt, trace = encode_problem(tok, p)
            ids = torch.tensor([prompt + trace])
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()   # predicts each trace token
            probs = torch.softmax(logits, dim=-1)
            gold = torch.tensor(trace)
            pred = probs.argmax(-1)
            bad = (pred != gold).nonzero().flatten().tolist()
            wrong += bool(bad)
            for t in bad:
                before = tok.decode(trace[:t])
                line_index = before.count("\n")
                start = before.rfind("\n") + 1
                line = (before[start:] + tok.decode(trace[t:])).split("\n")[0]
                field = field_of(line, line_index)
                fields[field] += 1
                errors.append({"kind": kind, "problem": i, "field": field, "line": line, "column": len(before) - start,
                               "gold": tok.decode([trace[t]]), "predicted": tok.decode([int(pred[t])]),
                               "p_gold": round(float(probs[t, trace[t]]), 4),
                               "p_predicted": round(float(probs[t, pred[t]]), 4)})
        per_kind[kind] = {"traces": problems, "traces_wrong": wrong, "by_field": {f: fields[f] for f in FIELDS}}
    return {"model": model_dir, "family": fam.name, "precision": "bfloat16 autocast" if bf16 else "float32",
            "per_kind": per_kind, "errors": errors}
