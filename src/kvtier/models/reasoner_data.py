"""What a reasoner training step trains on (reasoner_train.py): every step's problems are a function of (seed,
step) alone, skipping the family's held-out evaluation problems; sequences are bos + prompt + trace + eos with the
loss on the trace and eos only, the boxed answer's tokens optionally weighted."""

from __future__ import annotations

import random

from kvtier.tasks import chains as rt

BOX_ID = 2   # the tokenizer's id of "\\boxed{" (reasoner.build_reasoner_tokenizer)


def longest_sequence(fam: rt.Family) -> int:
    """bos + prompt + the family's longest trace + eos, in the reasoner's tokens (one per character)."""
    return 1 + len(fam.eval_problems(1, "local")[0].prompt) + fam.max_trace_tokens + 1


# Short chains for a second phase: the first model's errors were in a trace's first line and at counters
# below 20; short chains have more of both per token.
SHORT_N = (12, 40)


def encode_problem(tok, problem) -> tuple[list[int], list[int]]:
    """(bos + prompt, gold trace + eos) token ids: the one sequence the reasoner trains and is read on."""
    prompt = tok(problem.prompt)["input_ids"]
    trace = tok(problem.trace, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return prompt, trace


def key_line_span(tok, problem) -> tuple[int, int] | None:
    """[start, end) of the key line's tokens (``k=NN`` and its newline) in `encode_problem`'s sequence; None
    when the trace has none (n <= key_at). The probe locates it the same way (evaluation/probes/key_line.py)."""
    trace = problem.trace
    k = trace.find("\nk=") + 1
    if k == 0:
        return None
    at = len(tok(problem.prompt)["input_ids"])
    count = lambda chars: len(tok(trace[:chars], add_special_tokens=False)["input_ids"])  # noqa: E731
    return at + count(k), at + count(trace.index("\n", k) + 1)


def make_batch(tok, problems, pad_id: int):
    """(input_ids [B, T], labels [B, T]) with labels -100 on the prompt and padding."""
    import torch

    rows, labs = [], []
    for p in problems:
        prompt, trace = encode_problem(tok, p)
        rows.append(prompt + trace)
        labs.append([-100] * len(prompt) + trace)
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labs)):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(l)] = torch.tensor(l)
    return ids, labels


def held_out_keys(count: int = 256, family: str = rt.DEFAULT_FAMILY) -> set:
    fam = rt.family(family)
    return {(p.kind, p.y0, p.x0, p.n) for k in rt.KINDS for p in fam.eval_problems(count, k)}


def step_problems(seed: int, step: int, batch: int, exclude: set, family: str = rt.DEFAULT_FAMILY,
                  stream: str = "") -> list:
    """`batch` problems of `family`, kinds alternating, none in `exclude`: a function of (seed, step, stream)."""
    fam = rt.family(family)
    rng = random.Random(f"{seed}/{step}{stream}")
    out = []
    while len(out) < batch:
        p = fam.sample_problem(rng, rt.KINDS[len(out) % 2])
        if (p.kind, p.y0, p.x0, p.n) not in exclude:
            out.append(p)
    return out


def token_weights(labels, answer_weight: float, no_answer: list[bool] | None = None):
    """[B, T-1] loss weight of each predicted token: 0 off the trace, answer_weight from `\\boxed{` on
    (0 for the rows `no_answer` marks)."""
    import torch

    tgt = labels[:, 1:]
    answer = torch.cumsum((tgt == BOX_ID).long(), dim=1) > 0
    w = (tgt != -100).float() * torch.where(answer, answer_weight, 1.0)
    if no_answer is not None and any(no_answer):
        w = w.masked_fill(answer & torch.tensor(no_answer).unsqueeze(1), 0.0)
    return w


def short_problems(seed: int, step: int, count: int, family: str = rt.DEFAULT_FAMILY) -> list:
    rng = random.Random(f"{seed}/{step}/short")
    return [rt.family(family).sample_problem(rng, "local", SHORT_N) for _ in range(count)]
