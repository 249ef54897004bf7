"""Grading with math-verify (tracer/tasks/grading.py): a corpus of answers written as reasoning models write
them, GSM8K's gold strings, the project's thin layer, the time bound on and off the main thread."""

from __future__ import annotations

import json
import threading
import time
from decimal import Decimal
from pathlib import Path

import pytest

from tracer.tasks import get_task
from tracer.tasks.grading import answer_region, final_boxes, gold_number, grade, grader_id, parse_gold

CORPUS_FILE = Path(__file__).parent / "data" / "grading_corpus.jsonl"
CORPUS = [json.loads(line) for line in CORPUS_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
GSM8K_FILE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
GOLD_KIND = {"gsm8k": "number", "math": "latex"}
# A prediction sympy cannot finish evaluating (a power tower); math-verify without a timeout never returns.
HANGS = "\\boxed{9^{9^{9^{9}}}}"


def test_the_corpus_covers_what_the_issue_lists():
    assert len(CORPUS) >= 60 and len({c["id"] for c in CORPUS}) == len(CORPUS)
    styles = {c["style"] for c in CORPUS}
    assert styles == {"gsm8k", "math"} and min(sum(c["style"] == s for c in CORPUS) for s in styles) >= 30
    texts = [c["text"] for c in CORPUS]
    assert sum("</think>" in t for t in texts) >= 40 and sum("</think>" not in t for t in texts) >= 5
    assert sum(t.count("\\boxed") >= 2 for t in texts) >= 4  # several candidates
    for needle in ("\\$", "\\%", "\\text{", "\\frac", "\u2212", "70,000", "{,}", "\\,"):
        assert any(needle in t for t in texts), needle
    assert sum(not c["correct"] for c in CORPUS) >= 20  # wrong and missing answers, not only right ones


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_corpus_verdict(case):
    graded = grade(case["text"], case["gold"], GOLD_KIND[case["style"]])
    assert graded.correct is case["correct"], (case["note"], graded)
    assert graded.answered_after_think is case["after_think"]
    assert graded.grader == grader_id() and graded.grader.startswith("math-verify ")
    assert not graded.timed_out


# --- the thin layer: each rule is needed (bare math-verify gets these wrong) and does what it says ---------


def _bare_math_verify(text: str, gold: str, gold_kind: str) -> bool:
    """math-verify alone, with the same extraction configuration."""
    from math_verify import parse, verify

    from tracer.tasks.grading import _configs, gold_text

    return verify(parse(gold_text(gold, gold_kind), _configs()[gold_kind]), parse(text, _configs()["prediction"]))


@pytest.mark.parametrize(("case_id", "rule"), [
    ("gsm8k-08", "thin-space thousands"), ("gsm8k-13", "unicode minus"), ("gsm8k-04", "number in \\text"),
    ("gsm8k-39", "last box"), ("gsm8k-21", "after </think>"), ("gsm8k-22", "after </think>"),
    ("gsm8k-26", "after </think>"),
])
def test_each_project_rule_fixes_a_case_bare_math_verify_gets_wrong(case_id, rule):
    case = next(c for c in CORPUS if c["id"] == case_id)
    kind = GOLD_KIND[case["style"]]
    # The answer-region rule is checked against math-verify on the whole text, the others on the region.
    bare_input = case["text"] if rule == "after </think>" else answer_region(case["text"])[0]
    assert _bare_math_verify(bare_input, case["gold"], kind) is not case["correct"]
    assert grade(case["text"], case["gold"], kind).correct is case["correct"]


def test_answer_region_is_after_the_last_think_end():
    assert answer_region("a</think>b</think> c") == (" c", True)
    assert answer_region("no tags 5") == ("no tags 5", False)


def test_final_boxes_keeps_a_multi_part_answer_and_drops_superseded_boxes():
    assert final_boxes("\\boxed{2} and \\boxed{3}.") == "\\boxed{2} and \\boxed{3}"
    assert final_boxes("\\boxed{12}\n\nWait, recheck, so \\boxed{14}") == "\\boxed{14}"
    assert final_boxes("\\boxed{\\frac{1}{2}}") == "\\boxed{\\frac{1}{2}}"
    assert final_boxes("so \\boxed{\\frac{1}{") is None  # cut off inside the box
    assert final_boxes("no box") is None


def test_a_gold_of_none_only_extracts():
    graded = grade("<think>x</think> \\boxed{\\frac{14}{3}}", None, "latex")
    assert graded.predicted == "\\frac{14}{3}" and graded.correct is None and graded.answered_after_think
    assert get_task("math500").extract_answer("so \\boxed{7}") == "7"
    assert get_task("gsm8k").is_correct("1,000", "1000") is True and get_task("gsm8k").is_correct(None, "1") is False


# --- GSM8K gold strings ------------------------------------------------------------------------------------


@pytest.mark.skipif(not GSM8K_FILE.is_file(), reason="../shared/data/gsm8k/test.jsonl not present")
def test_all_gsm8k_gold_strings_parse_to_the_number_after_the_marker():
    import sympy

    records = [json.loads(line) for line in GSM8K_FILE.read_text().splitlines() if line.strip()]
    assert len(records) == 1319
    for index, record in enumerate(records):
        after_marker = record["answer"].rsplit("####", 1)[1].strip()
        reference = Decimal(after_marker.replace(",", ""))  # independent of math-verify
        gold = gold_number(record["answer"])
        parsed = parse_gold(gold, "number")
        assert parsed, (index, after_marker)
        assert sympy.nsimplify(parsed[0]) == sympy.Rational(str(reference)), (index, after_marker, parsed)
        # The marker's number as a model would box it (separators kept) is right; the gold plus one is not.
        assert grade(f"</think> The answer is \\boxed{{{after_marker}}}.", gold, "number").correct is True, index
        if index % 50 == 0:
            assert grade(f"\\boxed{{{reference + 1}}}", gold, "number").correct is False, index


# --- the time bound ----------------------------------------------------------------------------------------


def test_math_verify_alone_refuses_to_run_off_the_main_thread():
    """Why the project layer exists: math-verify's signal timeouts raise in a worker thread."""
    from math_verify import parse

    errors = []

    def work():
        try:
            parse("\\boxed{3}", parsing_timeout=5, raise_on_error=True)
        except ValueError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors and "thread" in errors[0]


def _in_thread(function, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", function(*args)))
    thread.start()
    thread.join(120)
    return out["value"]


def test_grading_off_the_main_thread_matches_the_main_thread():
    cases = CORPUS[::7]
    off_main = _in_thread(lambda: [grade(c["text"], c["gold"], GOLD_KIND[c["style"]]) for c in cases])
    on_main = [grade(c["text"], c["gold"], GOLD_KIND[c["style"]]) for c in cases]
    assert off_main == on_main
    assert [g.correct for g in off_main] == [c["correct"] for c in cases]


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_a_hanging_comparison_is_cut_at_the_deadline_and_grading_goes_on(where):
    def run():
        started = time.perf_counter()
        slow = grade(HANGS, "3", "number", timeout_s=1)
        elapsed = time.perf_counter() - started
        return slow, elapsed, grade("\\boxed{3}", "3", "number", timeout_s=1)

    slow, elapsed_s, after = run() if where == "main thread" else _in_thread(run)
    assert slow.timed_out and slow.correct is False and slow.predicted is None
    assert slow.grader == f"{grader_id()} (timed out after 1 s)"  # what the samples table records
    assert elapsed_s < 4.0  # 1 s bound (+ rounding to whole seconds on the main thread, + kill)
    assert after.correct is True and not after.timed_out


def test_grading_in_a_spawned_worker_process_is_bounded_too():
    """Sweeps and the demo trace in spawned worker processes: there grading runs on the worker's main thread,
    so math-verify's signal timeouts apply."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(grade, "\\boxed{3}", "3", "number", 1).result(timeout=120).correct is True  # warm
        started = time.perf_counter()
        slow = pool.submit(grade, HANGS, "3", "number", 1).result(timeout=120)
        elapsed_s = time.perf_counter() - started
    assert slow.timed_out and slow.correct is False and elapsed_s < 4.0
