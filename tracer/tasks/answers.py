"""Final-answer extraction and equality for math word problems (GSM8K, MATH-500).

Extraction order (first that matches wins): the GSM8K `#### N` marker, the last `\\boxed{...}`, the text after
the *last* "answer is", then the last number in the text. Equality is numeric when both sides parse as numbers
(`1,000` == `1000.0`, `\\frac{1}{2}` == `0.5`), otherwise on a normalised LaTeX string.
"""

from __future__ import annotations

import re
from fractions import Fraction

from tracer.tasks.base import Task

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer is\s*:?\s*", re.IGNORECASE)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_SIMPLE_FRAC = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")  # \frac12


def extract_final_answer(text: str) -> str | None:
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return _clean(after.splitlines()[0]) if after else None
    boxed = last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        tail = text[matches[-1].end() :].strip()
        candidate = _answer_is_tail(tail)
        if candidate:
            return _clean(candidate)
    numbers = _NUMBER.findall(text)
    return _clean(numbers[-1]) if numbers else None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0:
        # `\boxed 5` (no braces) also occurs in model output
        rest = text[start:].split(None, 1)
        return rest[1].split()[0].rstrip(".$") if len(rest) == 2 and rest[1].split() else None
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : i]
    return None  # unbalanced: generation was cut off inside the box


def _answer_is_tail(tail: str) -> str | None:
    """The answer right after "answer is": a leading number, else the text up to the end of the sentence."""
    tail = tail.lstrip("$\\( ")
    number = _NUMBER.match(tail)
    if number:
        return number.group(0)
    sentence = re.split(r"\.\s|\.$|\n", tail, maxsplit=1)[0]
    return sentence.strip(" $") or None


def _clean(answer: str) -> str | None:
    answer = answer.strip().strip("$").strip()
    answer = answer.rstrip(".").strip()
    return answer or None


def normalize(answer: str) -> str:
    """A canonical string for non-numeric comparison: no spaces, no \\left/\\right, no $ or text units."""
    s = answer.strip()
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$", "^\\circ", "^{\\circ}"):
        s = s.replace(token, "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def to_number(answer: str) -> Fraction | None:
    """The value of a plain number, a/b, \\frac{a}{b} or a percentage; None for anything else."""
    s = normalize(answer).replace(",", "").rstrip("%")
    if s.startswith("\\$"):
        s = s[2:]
    match = _FRAC.match(s) or _SIMPLE_FRAC.match(s)
    if match:
        sign, numerator, denominator = match.groups()
        s = f"{sign}{numerator}/{denominator}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(predicted: str | None, gold: str | None) -> bool:
    if predicted is None or gold is None:
        return False
    a, b = to_number(predicted), to_number(gold)
    if a is not None and b is not None:
        return abs(a - b) <= Fraction(1, 10**6) * max(1, abs(b))
    return normalize(predicted) == normalize(gold)


class FreeFormMathTask(Task):
    """A task whose model writes free-form math: the answer is extracted and compared numerically."""

    def extract_answer(self, text: str) -> str | None:
        return extract_final_answer(text)

    def is_correct(self, predicted: str | None, gold: str | None) -> bool | None:
        if gold is None:
            return None
        return answers_equal(predicted, gold)
