"""Task `gsm8k`: grade-school math word problems (Cobbe et al., 2021, https://arxiv.org/abs/2110.14168).

Gold answers are the number after `####` in the dataset's `answer` field; model output is scored by
`tracer.tasks.answers` (boxed, last "answer is", last number; numeric equality).
"""

from __future__ import annotations

from tracer.tasks.answers import FreeFormMathTask
from tracer.tasks.base import Sample, register_task
from tracer.tasks.records import DataFileError, load_records

# The prompt DeepSeek recommends for its R1 distills on math.
REASONING_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@register_task
class GSM8KTask(FreeFormMathTask):
    name = "gsm8k"
    source = "openai/gsm8k"
    split = "test"
    use_chat_template = True
    fields = ("question", "answer")

    def load(self, n_samples: int, data_file: str | None = None, seed: int = 0) -> list[Sample]:
        # File order, no shuffle: sample i is the same problem for every run and every source.
        records = load_records(data_file, self.source, "main", self.split, self.fields, n_samples)
        samples = []
        for index, record in enumerate(records):
            gold = gold_answer(record["answer"])
            if gold is None:
                raise DataFileError(f"gsm8k record {index} has no '#### N' in its answer field; fix the data file")
            samples.append(Sample(f"gsm8k/test/{index}", record["question"] + REASONING_SUFFIX, gold))
        return samples


def gold_answer(answer_field: str) -> str | None:
    """`... #### 70,000` -> `70000`."""
    if "####" not in answer_field:
        return None
    return answer_field.rsplit("####", 1)[1].strip().replace(",", "") or None
