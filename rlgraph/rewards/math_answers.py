"""Math answers: find the final answer in a completion and compare it with the reference.

    extract_answer("... so \\boxed{\\frac{1}{2}}")  -> "\\frac{1}{2}"
    answers_equal("0.5", "\\frac{1}{2}")             -> True
    math_reward(completions, answer=[...])          -> [1.0, 0.0, ...]

The final answer is, in order of preference: the last `\\boxed{...}` (or `\\fbox{...}`), the text
after the last `####` (GSM8K's convention), the last number in the text. Two answers are equal
when both read as exact rational numbers that are equal (`0.5`, `1/2`, `\\frac{1}{2}`, `50%` is
0.5 only with `percent=True`), or, failing that, when their normalised text is equal.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", "\\displaystyle")


def extract_answer(text: str) -> str | None:
    """The final answer of `text`, or None when it states none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        if tail and tail[0].strip():
            return tail[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip().rstrip(",") if numbers else None


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced; None if there is none (or it never closes)."""
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        depth, start = 1, match.end()
        for index in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                return text[start:index]
    return None


def normalize(answer: str) -> str:
    """Answer text without LaTeX noise, `\\text{}` wrappers, spaces, a trailing period, outer braces."""
    text = answer.strip()
    for noise in _NOISE:
        text = text.replace(noise, "")
    text = _TEXT.sub(r"\1", text)
    text = _FRAC.sub(r"(\1)/(\2)", text)
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\%", "%")
    text = re.sub(r"\s+", "", text).rstrip(".")
    while text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    return text.lower()


def to_number(answer: str, *, percent: bool = False) -> Fraction | None:
    """`answer` as an exact rational (`1,000`, `-2.5`, `3/4`, `(1)/(2)`, `x = 4`), or None."""
    text = normalize(answer)
    text = re.sub(r"^[a-z]\w*=", "", text)       # "x=4" -> "4"
    scale = Fraction(1)
    if text.endswith("%"):
        text, scale = text[:-1], Fraction(1, 100) if percent else Fraction(1)
    text = text.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text) else text
    match = re.fullmatch(r"\(?(-?[\d.]+)\)?(?:/\(?(-?[\d.]+)\)?)?", text)
    if match is None:
        return None
    try:
        value = Fraction(match[1])
        if match[2] is not None:
            value /= Fraction(match[2])
    except (ValueError, ZeroDivisionError):
        return None
    return value * scale


def answers_equal(predicted: str | None, reference: str, *, rel_tol: float = 0.0, percent: bool = False) -> bool:
    """True when `predicted` states the same answer as `reference` (numerically, else textually)."""
    if predicted is None:
        return False
    a, b = to_number(predicted, percent=percent), to_number(reference, percent=percent)
    if a is not None and b is not None:
        return a == b or (rel_tol > 0 and abs(a - b) <= rel_tol * max(abs(a), abs(b)))
    return normalize(predicted) == normalize(reference)


def reference_answer(answer: Any) -> str:
    """The answer field of a row: its final answer when it is a worked solution (`#### 72`, `\\boxed{}`)."""
    text = str(answer)
    if "####" in text or _BOXED.search(text):
        found = extract_answer(text)
        return found if found is not None else text
    return text


def math_reward(completions: Sequence[str], answer: Sequence[Any], *, rel_tol: float = 0.0, percent: bool = False,
                **_: Any) -> list[float]:
    """1.0 where the completion's final answer equals the row's `answer`, else 0.0.

    >>> math_reward(["so the answer is \\\\boxed{1/2}", "#### 3", "I think 7"], answer=["0.5", "4", "7"])
    [1.0, 0.0, 1.0]
    """
    if len(completions) != len(answer):
        raise ValueError(f"math: {len(completions)} completions but {len(answer)} answers; pass one answer per row")
    return [float(answers_equal(extract_answer(text), reference_answer(ref), rel_tol=rel_tol, percent=percent))
            for text, ref in zip(completions, answer)]
