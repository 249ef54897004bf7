"""Task `gsm8k`: grade-school math word problems (Cobbe et al., 2021, https://arxiv.org/abs/2110.14168).

Fields of `openai/gsm8k` (config `main`, split `test`, 1,319 problems) and of a `--data-file` JSONL:
`question` (the problem) and `answer` (a worked solution ending in `#### N`; the gold is N, separators
removed). Graded with math-verify (tracer/tasks/grading.py).
"""

from __future__ import annotations

from tracer.tasks.base import Sample, register_task
from tracer.tasks.grading import gold_number
from tracer.tasks.math_task import MathTask
from tracer.tasks.records import DataFileError, load_records


@register_task
class GSM8KTask(MathTask):
    name = "gsm8k"
    source = "openai/gsm8k"
    split = "test"
    gold_kind = "number"
    fields = ("question", "answer")

    def load(self, n_samples: int, data_file: str | None = None, seed: int = 0) -> list[Sample]:
        # File order, no shuffle: sample i is the same problem for every run and every source.
        records = load_records(data_file, self.source, "main", self.split, self.fields, n_samples)
        samples = []
        for index, record in enumerate(records):
            gold = gold_number(record["answer"])
            if gold is None:
                raise DataFileError(f"gsm8k record {index} has no '#### N' in its answer field; fix the data file")
            # The worked solution rides along: tracer/fidelity.py teacher-forces a policy on it.
            samples.append(Sample(f"gsm8k/test/{index}", record["question"] + self.instruction, gold,
                                  meta={"solution": record["answer"]}))
        return samples
