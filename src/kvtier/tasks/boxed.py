"""The answer of a response: the content of its last complete ``\\boxed{...}`` (or ``\\fbox{...}``, or the
brace-less ``\\boxed 5``), extracted with brace matching so nested groups survive; a truncated box is no
answer. Standard library only: the evaluation's grader (`kvtier.evaluation.grader`, which then compares
answers) and the RL reward (`kvtier.rollout.chains_task`) both read answers here."""

from __future__ import annotations

import re

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_boxed_all(text: str) -> list[str]:
    """Contents of every complete \\boxed{...} / \\fbox{...} / \\boxed X, in order of appearance."""
    out: list[str] = []
    for m in _BOX.finditer(text):
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                ch = text[j]
                if ch == "\\" and j + 1 < len(text) and text[j + 1] in "{}":
                    j += 2                      # \{ and \} are literal braces, not groups
                    continue
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        out.append(text[i + 1 : j].strip())
                        break
                j += 1
            # an unbalanced box (truncated generation) is not an answer
        elif i > m.end() and i < len(text):     # "\boxed 5": one token after whitespace
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                out.append(tok.group(0).rstrip(".,;"))
    return out


def extract_final_boxed(text: str) -> str | None:
    boxes = extract_boxed_all(text)
    return boxes[-1] if boxes else None
