"""Task `math500`: the 500-problem MATH subset of "Let's Verify Step by Step" (Lightman et al., 2023,
https://arxiv.org/abs/2305.20050), as published in `HuggingFaceH4/MATH-500` (split `test`).

Fields (Hub and `--data-file` JSONL): `problem`, `answer` (the MATH answer string, e.g. `\\frac{14}{3}`);
`subject`, `level`, `unique_id` are kept in the sample's meta when present. Graded with math-verify.
"""

from __future__ import annotations

from tracer.tasks.base import Sample, register_task
from tracer.tasks.math_task import MathTask
from tracer.tasks.records import load_records


@register_task
class Math500Task(MathTask):
    name = "math500"
    source = "HuggingFaceH4/MATH-500"
    split = "test"
    gold_kind = "latex"
    fields = ("problem", "answer")

    def load(self, n_samples: int, data_file: str | None = None, seed: int = 0) -> list[Sample]:
        records = load_records(data_file, self.source, None, self.split, self.fields, n_samples)
        samples = []
        for index, record in enumerate(records):
            meta = {key: record[key] for key in ("subject", "level", "unique_id") if key in record}
            samples.append(Sample(f"math500/test/{index}", record["problem"] + self.instruction,
                                  str(record["answer"]).strip(), meta))
        return samples
