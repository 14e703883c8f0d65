"""Grading by the final \\boxed{} answer (paper §4.1).

The response's answer is the content of its **last** ``\\boxed{...}`` (or ``\\fbox{...}``, or the
brace-less ``\\boxed 5``), extracted with brace matching so nested groups (``\\frac{1}{\\sqrt{2}}``)
survive; a response without a complete box is wrong. The extracted answer is compared with the gold
answer by

1. a normalised string match (spacing, ``\\left``/``\\right``, ``\\dfrac``, ``\\text{}``, ``^\\circ``,
   ``\\%``, thousands separators, a ``x =`` prefix, a lettered choice ``(B)``), then
2. math-verify (``math-verify==0.9.0``, Hugging Face's grader; symbolic / numeric equivalence via
   latex2sympy2_extended) on ``\\boxed{gold}`` against ``\\boxed{answer}``.

If math-verify is not installed, step 2 is skipped (`grader_backend()` says which is in use).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from kvtier.tasks.boxed import extract_boxed_all, extract_final_boxed  # noqa: F401 - part of this API



_TEXT_CMDS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textit|mbox|operatorname)\s*\{([^{}]*)\}")


def normalize_answer(s: str) -> str:
    """A canonical string for exact comparison (not symbolic)."""
    s = s.strip()
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\:", "").replace("\\ ", "")
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
    s = s.replace("\\displaystyle", "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    for _ in range(3):
        s = _TEXT_CMDS.sub(r"\1", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
    s = s.replace("°", "")
    s = s.replace("\\%", "").replace("%", "").replace("$", "")
    s = re.sub(r"(\d)\{,\}(\d)", r"\1\2", s)
    s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    s = re.sub(r"^[A-Za-z]\w*=(?!=)", "", s)          # "x=5" -> "5"
    m = re.fullmatch(r"\(?([A-Ja-j])\)?", s)            # lettered choice "(B)" / "b"
    if m:
        s = m.group(1).upper()
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    return s


def grader_backend() -> str:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return "string"
    return "math-verify"


def _math_verify_equal(gold: str, answer: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    main = threading.current_thread() is threading.main_thread()  # math-verify's timeouts use SIGALRM
    timeout = 5 if main else None
    try:
        g = parse("\\boxed{" + gold + "}", parsing_timeout=timeout)
        a = parse("\\boxed{" + answer + "}", parsing_timeout=timeout)
        if not g or not a:
            return False
        return bool(verify(g, a, timeout_seconds=timeout))
    except Exception:
        return False


@dataclass
class Grade:
    correct: bool
    extracted: str | None
    method: str            # "no_box" | "string" | "math-verify" | "mismatch"


def grade(response: str, gold: str) -> Grade:
    """Is the response's final boxed answer equal to `gold`?"""
    ans = extract_final_boxed(response)
    if ans is None:
        return Grade(False, None, "no_box")
    gold = str(gold)
    inner = extract_final_boxed(gold)
    if inner is not None:                    # gold given as "\boxed{...}"
        gold = inner
    if normalize_answer(ans) == normalize_answer(gold):
        return Grade(True, ans, "string")
    if _math_verify_equal(gold, ans):
        return Grade(True, ans, "math-verify")
    return Grade(False, ans, "mismatch")
