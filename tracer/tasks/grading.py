"""Grading free-form math answers as the field grades them: Hugging Face `math-verify`, as open-r1 and lighteval.

Torch-free (the tracer and `thoughtkv traces regrade` both import it). For one generation and one gold answer:

1. **Answer region**: the text after the *last* `</think>` when there is one (reasoning models think first,
   then answer), else the whole text. `answered_after_think` records which.
2. **Gold**: parsed by math-verify; GSM8K golds are the number after `####` (`gold_number`), MATH/AIME golds
   are the dataset's answer string, parsed as `$\\boxed{gold}$`.
3. **Prediction**: parsed by math-verify with lighteval's math configuration (a `\\boxed{}` first, then
   `answer is ...` anchors, then the last LaTeX or plain expression), verified against the gold with
   `math_verify.verify` (numeric within 1e-6, symbolic, sets, intervals, percent, units).

The thin project layer (`normalize_region`, `final_boxes`) adds only what math-verify lacks, each with a test
in tests/test_grading.py:

* the Unicode minus sign (U+2212; also U+FE63, U+FF0D) outside LaTeX: math-verify does not read `−3` in plain
  text;
* thin-space thousands separators (`70\\,000`, `70\\!000`, `70\\ 000`): latex2sympy reads them as `70*000`;
* a number written in text mode with its unit (`\\text{18 dollars}`): math-verify keeps it as a string;
* several `\\boxed{}` in the answer region: math-verify joins boxes up to 70 characters apart when a comma,
  "and" or "or" lies between them (so `\\boxed{12}, rechecking ... \\boxed{14}` becomes the set {12, 14});
  here only the last box counts, together with the boxes directly before it that nothing but separators
  divides from it (`\\boxed{2} and \\boxed{3}` stays a two-part answer);
* a time bound per sample that also holds off the main thread (below).

**Time bound.** math-verify bounds its parse and compare steps with `signal.alarm`, which only works on the
main thread (elsewhere it raises ValueError). On the main thread we use it, with the remaining share of the
sample's `timeout_s` as each step's limit (whole seconds, at least 1). Off the main thread (a worker thread of
a server or a sweep), grading runs in a child process that is killed at the deadline. A timed-out sample is
graded incorrect with `predicted` null; its `grader` column says `... (timed out after 5 s)`.
"""

from __future__ import annotations

import math
import re
import signal
import threading
import time
from dataclasses import dataclass
from functools import cache

from thoughtkv_base import UserError

GRADER_NAME = "math-verify"
DEFAULT_TIMEOUT_S = 5.0  # one sample's whole grading (gold parse, answer parse, compare)

THINK_END = "</think>"
# Minus signs that models (and copy-pasted LaTeX) write instead of the ASCII hyphen-minus: the minus sign, the
# small and the fullwidth hyphen-minus. Dashes are left alone (`3–5` is a range, not 3 - 5).
_MINUS_LOOKALIKES = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
# A LaTeX thin/negative/normal space between digit groups: `70\,000` -> `70000` (only before exactly 3 digits).
_SPACED_THOUSANDS = re.compile(r"(?<=\d)\\[,!; ](?=\d{3}(?!\d))")
# A number written inside text mode with its unit, `\text{18 dollars}`: math-verify reads it as a string.
_NUMBER_IN_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{\s*(\\?\$?-?\d[\d,]*(?:\.\d+)?)\s*([^{}]*)\}")
_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
# What may lie between two boxes of one multi-part answer: spaces, $, punctuation, "and"/"or".
_BOX_SEPARATOR = re.compile(r"^[\s$.,;]*(?:(?:and|or)[\s$.,;]*)?$", re.IGNORECASE)


@dataclass(frozen=True)
class Grade:
    predicted: str | None  # the extracted answer as written (null: none found)
    correct: bool | None  # None when there is no gold to grade against
    answered_after_think: bool  # the answer region was the text after the last </think>
    grader: str  # "math-verify 0.9.0"
    timed_out: bool = False


@cache
def grader_id() -> str:
    """Name and version of the grader, recorded with every graded sample."""
    from importlib.metadata import version

    return f"{GRADER_NAME} {version('math-verify')}"


def answer_region(text: str) -> tuple[str, bool]:
    """(the text after the last `</think>`, True) when there is one, else (the whole text, False)."""
    head, sep, tail = text.rpartition(THINK_END)
    return (tail, True) if sep else (text, False)


def normalize_region(text: str) -> str:
    """What math-verify lacks on the way in: Unicode minus signs, thin-space thousands separators, a number
    inside `\\text{}` with its unit."""
    text = _SPACED_THOUSANDS.sub("", text.translate(_MINUS_LOOKALIKES))
    return _NUMBER_IN_TEXT.sub(lambda m: m[1] + (f"\\text{{ {m[2].strip()}}}" if m[2].strip() else ""), text)


def final_boxes(text: str) -> str | None:
    """The span from the first to the last box of the final (possibly multi-part) boxed answer; None if the
    text has no complete `\\boxed{...}`. A box cut off before its closing brace is no answer."""
    boxes = []  # (start, end) of each complete box, in order
    for match in _BOX_START.finditer(text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0 and (not boxes or match.start() >= boxes[-1][1]):
            boxes.append((match.start(), i))
    if not boxes:
        return None
    first = len(boxes) - 1
    while first > 0 and _BOX_SEPARATOR.match(text[boxes[first - 1][1] : boxes[first][0]]):
        first -= 1
    return text[boxes[first][0] : boxes[-1][1]]


def gold_number(answer_field: str) -> str | None:
    """GSM8K's gold: `... #### 70,000` -> `70000` (the number after the last `####`, separators removed)."""
    if "####" not in answer_field:
        return None
    return answer_field.rsplit("####", 1)[1].strip().replace(",", "") or None


# --- math-verify calls ------------------------------------------------------------------------------------


@cache
def _configs():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # lighteval's MATH-500 / AIME / GSM8K metric: predictions as LaTeX (boxed first) or plain expressions.
    prediction = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return {
        "number": (ExprExtractionConfig(), LatexExtractionConfig()),  # GSM8K / AIME: a plain number
        "latex": (LatexExtractionConfig(boxed_match_priority=0),),  # MATH: parsed as $\boxed{gold}$
        "prediction": prediction,
    }


def gold_text(gold: str, gold_kind: str) -> str:
    if gold_kind not in ("number", "latex"):
        raise ValueError(f"gold_kind must be 'number' or 'latex', got {gold_kind!r}")
    return gold if gold_kind == "number" else f"$\\boxed{{{gold}}}$"


def parse_gold(gold: str, gold_kind: str, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list:
    """The gold as math-verify parses it ([sympy value, string as matched]; [] when it cannot be parsed)."""
    from math_verify import parse

    return parse(normalize_region(gold_text(gold, gold_kind)), _configs()[gold_kind],
                 parsing_timeout=_whole_seconds(timeout_s), raise_on_error=False)


def _whole_seconds(timeout_s: float | None) -> int | None:
    """math-verify's signal.alarm takes whole seconds; None disables its signal timeouts."""
    return None if timeout_s is None else max(1, math.ceil(timeout_s))


def _grade_here(text: str, gold: str | None, gold_kind: str, timeout_s: float | None) -> Grade:
    """Grade in this thread (gold None: extract only). With `timeout_s`, math-verify's signal timeouts are
    on: main thread only."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining() -> int | None:
        return None if deadline is None else _whole_seconds(max(0.0, deadline - time.monotonic()))

    region, after_think = answer_region(text)
    region = normalize_region(region)
    boxed = final_boxes(region)
    failed = None if gold is None else False
    try:
        predicted = parse(boxed if boxed is not None else region, _configs()["prediction"],
                          parsing_timeout=remaining(), raise_on_error=True)
        if gold is None:
            return Grade(_as_written(predicted), None, after_think, grader_id())
        gold_parsed = parse(normalize_region(gold_text(gold, gold_kind)), _configs()[gold_kind],
                            parsing_timeout=remaining(), raise_on_error=True)
        correct = bool(gold_parsed and predicted) and verify(gold_parsed, predicted, timeout_seconds=remaining(),
                                                              raise_on_error=True)
    except TimeoutException:
        return timed_out(gold, after_think, timeout_s)
    except Exception:  # noqa: BLE001 - sympy/antlr fail in many ways on odd text; all mean "no usable answer"
        return Grade(None, failed, after_think, grader_id())
    return Grade(_as_written(predicted), bool(correct), after_think, grader_id())


def timed_out(gold: str | None, after_think: bool, timeout_s: float | None) -> Grade:
    """A sample whose grading hit the time bound: incorrect, no answer; the grader column says why."""
    return Grade(None, None if gold is None else False, after_think,
                 f"{grader_id()} (timed out after {timeout_s or 0:g} s)", timed_out=True)


def _as_written(parsed: list) -> str | None:
    """The answer as the model wrote it: math-verify appends the matched string after the parsed value."""
    if not parsed:
        return None
    text = next((p for p in reversed(parsed) if isinstance(p, str)), None)
    return text.strip() if text is not None else str(parsed[0])


def grade(text: str, gold: str | None, gold_kind: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
    """Grade one generation against one gold answer (None: only extract the answer) in at most about
    `timeout_s` seconds, from any thread."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM"):
        return _grade_here(text, gold, gold_kind, timeout_s)
    return _WORKER.grade(text, gold, gold_kind, timeout_s)


# --- off the main thread: a child process with a hard deadline --------------------------------------------


class GraderUnavailableError(UserError):
    """The grading child process could not be started."""


def _serve_stdio() -> None:
    """Child process loop (started by _GradingWorker): one JSON request per stdin line, one JSON grade
    per stdout line. It runs on the child's main thread, so math-verify's own signal timeouts work here too
    (an inner bound under the parent's kill)."""
    import dataclasses
    import json
    import logging
    import sys

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _configs()  # imports math-verify before "ready", so start-up is not charged to a sample
    print("ready", flush=True)
    for line in sys.stdin:
        text, gold, gold_kind, timeout_s = json.loads(line)
        print(json.dumps(dataclasses.asdict(_grade_here(text, gold, gold_kind, timeout_s))), flush=True)


class _GradingWorker:
    """One child process shared by all threads (requests are serialised); killed at a deadline, restarted on
    the next request. A plain subprocess (not multiprocessing): it needs no `__main__` guard in the caller and
    inherits no torch/CUDA state."""

    STARTUP_S = 60.0  # a fresh child's interpreter start and imports (~1-2 s; more on a loaded machine)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process = None

    def grade(self, text: str, gold: str | None, gold_kind: str, timeout_s: float) -> Grade:
        import json

        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            failed = timed_out(gold, answer_region(text)[1], timeout_s)
            try:
                self._process.stdin.write(json.dumps([text, gold, gold_kind, timeout_s]) + "\n")
                self._process.stdin.flush()
                line = self._readline(timeout_s)
            except (OSError, ValueError):  # the child died (e.g. out of memory): no grade, a fresh child next time
                line = None
            if line:
                return Grade(**json.loads(line))
            self._stop()
            return failed

    def _readline(self, timeout_s: float) -> str | None:
        import select

        ready, _, _ = select.select([self._process.stdout], [], [], timeout_s)
        return self._process.stdout.readline() if ready else None

    def _start(self) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the `tracer` package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from tracer.tasks.grading import _serve_stdio; _serve_stdio()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1, env=env)
        if self._readline(self.STARTUP_S) != "ready\n":
            self._stop()
            raise GraderUnavailableError(
                f"the grading process did not start within {self.STARTUP_S:.0f} s; grade on the main thread "
                "or check that math-verify imports (`python -c 'import math_verify'`)")

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for stream in (self._process.stdin, self._process.stdout):
                stream.close()
        self._process = None


_WORKER = _GradingWorker()
