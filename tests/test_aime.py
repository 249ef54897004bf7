"""Tasks aime24/aime25 from a local JSONL, and how prompts are recorded: the R1 instruction, the chat template
applied or not (run.json task.prompt), a one-line warning for a tokenizer without one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tracer.tasks import get_task, prompt_manifest
from tracer.tasks.math_task import REASONING_SUFFIX
from tracer.tasks.records import DataFileError

# AIME-style records of our own (not the competition's text): 30 problems, integer answers 0-999, some given
# as numbers and some as zero-padded strings, as the two Hub datasets store them.
RECORDS = [{"id": f"2024-I-{i}", "problem": f"Find the remainder when {37 * i + 5} is divided by 1000.",
            "answer": (37 * i + 5) % 1000 if i % 2 else f"{(37 * i + 5) % 1000:03d}", "year": 2024}
           for i in range(1, 31)]


@pytest.fixture
def aime_file(tmp_path: Path) -> str:
    path = tmp_path / "aime.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


@pytest.mark.parametrize(("name", "source"), [("aime24", "HuggingFaceH4/aime_2024"), ("aime25", "yentinglin/aime_2025")])
def test_aime_loads_30_problems_from_a_local_jsonl(name, source, aime_file):
    task = get_task(name)
    assert task.source == source and task.split == "train" and task.gold_kind == "number"
    samples = task.load(100, data_file=aime_file)  # asks for more than there are: the 30 of the file
    assert len(samples) == 30
    assert [s.sample_id for s in samples] == [f"{name}/train/{i}" for i in range(30)]
    for record, sample in zip(RECORDS, samples):
        assert sample.prompt == record["problem"] + REASONING_SUFFIX
        assert sample.gold == str(int(record["answer"]))  # "042" and 42 are both the gold "42"
        assert sample.meta == {"id": record["id"], "year": 2024}
    # The gold graded as an R1 distill writes it; zero-padded boxes are the same integer.
    first = samples[0]
    assert task.grade(f"<think>\n...\n</think>\n\n**Final Answer**\n\\[\\boxed{{{int(first.gold):03d}}}\\]",
                      first.gold).correct is True
    assert task.grade("<think>\nthe answer is 42\n</think>\n\nI could not finish.", first.gold).correct is False


def test_aime_refuses_a_non_integer_answer_and_missing_fields(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "p", "answer": "\\frac{1}{2}"}) + "\n")
    with pytest.raises(DataFileError, match="not an AIME integer"):
        get_task("aime24").load(1, data_file=str(bad))
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"question": "p", "answer": "1"}) + "\n")
    with pytest.raises(DataFileError, match="missing field"):
        get_task("aime25").load(1, data_file=str(missing))


class _Tokenizer:
    def __init__(self, chat_template):
        self.chat_template = chat_template


def test_prompt_record_names_the_instruction_and_whether_the_template_was_applied():
    template = "{% for m in messages %}<|User|>{{ m['content'] }}{% endfor %}<|Assistant|><think>\n"
    record, warning = prompt_manifest(get_task("aime24"), _Tokenizer(template))
    assert warning is None
    assert record == {"instruction": REASONING_SUFFIX, "chat_template_applied": True,
                      "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()}
    record, warning = prompt_manifest(get_task("math500"), _Tokenizer(None))
    assert record["chat_template_applied"] is False and record["chat_template_sha256"] is None
    assert warning is not None and "no chat template" in warning and "\n" not in warning
    # chains never asks for a template (the micro model has none): no warning.
    record, warning = prompt_manifest(get_task("chains"), _Tokenizer(None))
    assert warning is None and record["chat_template_applied"] is False and record["instruction"] is None


def test_a_traced_aime_run_records_prompt_and_grading_and_warns_once(aime_file, tmp_path, capsys):
    """End to end on the bundled micro model (a word-level tokenizer without a chat template)."""
    from tracer.run import TraceConfig, run_trace
    from traces import open_run

    out = tmp_path / "run"
    run_trace(TraceConfig(model="micro", task="aime24", out=str(out), n_samples=2, data_file=aime_file,
                          max_new_tokens=4), progress=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "chat template" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ")
    run = open_run(out)
    assert run.manifest["task"]["prompt"] == {"instruction": REASONING_SUFFIX, "chat_template_applied": False,
                                              "chat_template_sha256": None}
    samples = run.samples()
    assert (samples["grader"].str.startswith("math-verify ")).all()
    assert samples["answered_after_think"].eq(False).all()  # the micro model writes no </think>
    assert samples["correct"].notna().all() and samples["gold"].tolist() == ["42", "79"]
