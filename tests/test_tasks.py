"""Tasks: the registry contract, data files, the chains generator (grading: tests/test_grading.py)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from thoughtkv_base import UserError
from tracer.tasks import TASKS, get_task
from tracer.tasks.chains import (
    FILLERS,
    OPERATIONS,
    ChainsConfig,
    ChainsTask,
    generate_problem,
    heldout_problem,
)
from tracer.tasks.records import DataFileError, read_jsonl

GSM8K_FILE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K_FILE.is_file(), reason="../shared/data/gsm8k/test.jsonl not present")

# The first records of HuggingFaceH4/MATH-500 (problem and answer fields as published).
MATH500_RECORDS = [
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in "
     "the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
    {"problem": "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? Express your answer as "
     "a common fraction.", "answer": "\\frac{14}{3}", "subject": "Algebra", "level": 3,
     "unique_id": "test/algebra/2584.json"},
    {"problem": "How many positive whole-number divisors does 196 have?", "answer": "9",
     "subject": "Number Theory", "level": 3, "unique_id": "test/number_theory/572.json"},
]


@pytest.fixture
def math500_file(tmp_path: Path) -> str:
    path = tmp_path / "math500.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MATH500_RECORDS))
    return str(path)


def _data_file(name: str, math500_file: str) -> str | None:
    if name == "gsm8k":
        if not GSM8K_FILE.is_file():
            pytest.skip("GSM8K file not present")
        return str(GSM8K_FILE)
    if name.startswith("aime"):  # AIME-style records of our own (problem, integer answer): tests/test_aime.py
        path = Path(math500_file).with_name(f"{name}.jsonl")
        path.write_text("".join(json.dumps({"problem": f"Find {7 * i} + {i}.", "answer": str(8 * i)}) + "\n"
                                for i in range(1, 31)))
        return str(path)
    return math500_file if name == "math500" else None


def _reference_output(name: str, sample) -> str:
    """What a model that solves the sample would print, in the form each task expects."""
    if name in ("chains", "chains_long"):  # generated tasks: the chain of thought itself
        return sample.meta["answer"]
    return f"Let me reason.\n</think>\nSo the final answer is $\\boxed{{{sample.gold}}}$."


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_loads_stable_samples_and_scores_its_own_gold(name, math500_file):
    task = get_task(name)
    assert task.name == name and task.source and task.split
    data_file = _data_file(name, math500_file)
    samples = task.load(3, data_file=data_file)
    assert [s.sample_id for s in samples] == [f"{name}/{task.split}/{i}" for i in range(3)]
    assert [s.prompt for s in task.load(3, data_file=data_file)] == [s.prompt for s in samples]
    for sample in samples:
        assert sample.gold
        predicted = task.extract_answer(_reference_output(name, sample))
        assert task.is_correct(predicted, sample.gold) is True
        assert task.is_correct("no answer here", sample.gold) is False
        assert task.is_correct(predicted, None) is None


# --- answer extraction: math-verify, tests/test_grading.py (corpus, GSM8K golds) ------------------------


# --- data files ------------------------------------------------------------------------------------------


def test_bad_data_files_give_one_line_user_errors(tmp_path):
    with pytest.raises(DataFileError, match="not found"):
        get_task("gsm8k").load(2, data_file=str(tmp_path / "missing.jsonl"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(DataFileError, match=r"broken.jsonl:2"):
        read_jsonl(str(broken), ("question", "answer"), 5)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"problem": "p"}\n')
    with pytest.raises(DataFileError, match="missing field"):
        get_task("math500").load(1, data_file=str(wrong))
    with pytest.raises(UserError, match="drop --data-file"):
        get_task("chains").load(1, data_file=str(wrong))
    with pytest.raises(UserError, match="unknown task"):
        get_task("nope")


# --- chains ----------------------------------------------------------------------------------------------


def _solve_from_prompt(prompt: str) -> tuple[dict[str, int], str]:
    """Independent reference: parse the prompt text and run the program."""
    definitions, program = prompt.split(" Q: ")
    values = {}
    for pair in definitions.rstrip(" .").split(" , "):
        name, value = pair.split("=")
        values[name] = int(value)
    last = None
    for statement in program.removesuffix(" A:").rstrip(" ;").split(" ; "):
        fields = dict(word.split("=", 1) for word in statement.split())  # r2.x=f r2.op=- r2.y=r1
        result = next(iter(fields)).split(".")[0]
        left, op, right = fields[f"{result}.x"], fields[f"{result}.op"], fields[f"{result}.y"]
        a, b = values[left], values[right]
        values[result] = {"+": a + b, "-": a - b, "*": a * b}[op] % 10
        last = result
    return values, str(values[last])


def test_chains_gold_and_every_restated_value_are_correct():
    config = ChainsConfig()
    for index in range(300):
        problem = heldout_problem(index)
        values, gold = _solve_from_prompt(problem.prompt)
        assert problem.gold == gold
        assert problem.answer.endswith(f"answer = {gold}")
        # Every "name value ," restatement in the chain of thought quotes the true value.
        for name, value in re.findall(r"(\b[a-qs-u]|r\d+) (\d) ,", problem.answer):
            assert values[name] == int(value), (index, name)
        n_variables = problem.prompt.split(" Q: ")[0].count(" , ") + 1
        assert config.min_variables <= n_variables <= config.max_variables
        assert config.min_steps <= problem.prompt.count(" ; ") <= config.max_steps


def test_chains_generator_is_deterministic_and_the_split_is_fixed():
    assert generate_problem(random.Random(7)) == generate_problem(random.Random(7))
    assert generate_problem(random.Random(7)) != generate_problem(random.Random(8))
    task = ChainsTask()
    first, again = task.load(20), task.load(20, seed=123)  # the split does not move with the decode seed
    assert [(s.sample_id, s.prompt, s.gold) for s in first] == [(s.sample_id, s.prompt, s.gold) for s in again]
    assert len({s.prompt for s in first}) == 20
    golds = [heldout_problem(i).gold for i in range(500)]
    assert len(set(golds)) == 10  # all ten digits occur as answers


def test_chains_fillers_follow_the_result_digit_and_density_knob():
    for fillers_per_step in (0, 1, 3):
        problem = generate_problem(random.Random(3), ChainsConfig(fillers_per_step=fillers_per_step))
        results = [int(d) for d in re.findall(r"= (\d) ; r\d+=\d \.", problem.answer)]
        expected = " ".join(" ".join(FILLERS[(d + j) % 10] for j in range(fillers_per_step)) for d in results)
        found = " ".join(w for w, role in zip(problem.answer_words, problem.answer_roles) if role == "filler")
        assert found == " ".join(expected.split())
    assert set(OPERATIONS) == {"+", "-", "*"}


def test_chains_knobs_span_150_to_600_tokens():
    def lengths(config: ChainsConfig) -> list[int]:
        problems = [generate_problem(random.Random(i), config) for i in range(200)]
        return [len(p.prompt_words) + len(p.answer_words) + 2 for p in problems]  # + <bos>, <eos>

    short = lengths(ChainsConfig(6, 6, 4, 4, fillers_per_step=1))
    long = lengths(ChainsConfig(12, 12, 12, 12, fillers_per_step=5))
    assert 110 <= min(short) and max(short) <= 140
    assert 520 <= min(long) and max(long) <= 600


def test_chains_extraction_is_exact_match_on_the_last_answer_digit():
    task = ChainsTask()
    assert task.extract_answer("r1 3 . answer = 4 hmm answer = 7") == "7"
    assert task.extract_answer("r1 = a + b : a 1 , b 2 , 1 + 2 = 3 ; r1 3 . answer =") is None
    assert task.extract_answer("answer = 12") is None
    assert task.is_correct("7", "7") and not task.is_correct("1", "7")
