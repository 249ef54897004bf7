"""Tasks `aime24` and `aime25`: the 30 problems (AIME I and II) of the 2024 and 2025 American Invitational
Mathematics Examinations; every answer is an integer from 0 to 999.

Sources are the Hub datasets lighteval and open-r1 evaluate R1 distills on: `HuggingFaceH4/aime_2024` and
`yentinglin/aime_2025`, both split `train` (their only split). Fields (Hub and `--data-file` JSONL): `problem`
(the statement) and `answer` (the integer, as a string or a number); `id`, `url`, `year` are kept in the
sample's meta when present. Graded with math-verify (the gold parsed as a number).

R1 distills need 8k-32k new tokens on AIME: run with `--max-new-tokens 32768`; `thoughtkv traces info` reports
the share of samples stopped by that limit and the accuracy over the finished ones.
"""

from __future__ import annotations

from tracer.tasks.base import Sample, register_task
from tracer.tasks.math_task import MathTask
from tracer.tasks.records import DataFileError, load_records

AIME_PROBLEMS = 30  # AIME I + AIME II


class AIMETask(MathTask):
    gold_kind = "number"
    split = "train"
    fields = ("problem", "answer")

    def load(self, n_samples: int, data_file: str | None = None, seed: int = 0) -> list[Sample]:
        records = load_records(data_file, self.source, None, self.split, self.fields, n_samples)
        samples = []
        for index, record in enumerate(records):
            gold = str(record["answer"]).strip()
            if not gold.isdigit():
                raise DataFileError(
                    f"{self.name} record {index}: answer {record['answer']!r} is not an AIME integer (0-999); "
                    "fix the data file")
            meta = {key: record[key] for key in ("id", "url", "year") if key in record}
            samples.append(Sample(f"{self.name}/{self.split}/{index}", record["problem"] + self.instruction,
                                  str(int(gold)), meta))
        return samples


@register_task
class AIME24Task(AIMETask):
    name = "aime24"
    source = "HuggingFaceH4/aime_2024"


@register_task
class AIME25Task(AIMETask):
    name = "aime25"
    source = "yentinglin/aime_2025"
