"""Free-form math tasks (gsm8k, math500, aime24, aime25): graded with math-verify (tracer/tasks/grading.py).

R1 distills are prompted as DeepSeek recommends for math: the problem, then `REASONING_SUFFIX`, inside the
model's chat template (applied by the decoder when the tokenizer has one; run.json records whether it was).
"""

from __future__ import annotations

from tracer.tasks.base import Task
from tracer.tasks.grading import DEFAULT_TIMEOUT_S, Grade, grade

# DeepSeek's recommended instruction for its R1 distills on math (DeepSeek-R1 model card, "Usage Recommendations").
REASONING_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


class MathTask(Task):
    """A task whose model writes free-form math; `gold_kind` says how the gold is parsed (grading.gold_text)."""

    gold_kind = "latex"  # "number" for GSM8K/AIME golds, "latex" for MATH answer strings
    instruction = REASONING_SUFFIX
    use_chat_template = True
    timeout_s = DEFAULT_TIMEOUT_S

    def grade(self, text: str, gold: str | None) -> Grade:
        return grade(text, gold, self.gold_kind, self.timeout_s)

    def extract_answer(self, text: str) -> str | None:
        return self.grade(text, None).predicted

    def is_correct(self, predicted: str | None, gold: str | None) -> bool | None:
        """An answer already extracted (e.g. `\\frac{14}{3}`), checked as if the model had boxed it."""
        if gold is None:
            return None
        return predicted is not None and bool(self.grade(f"\\boxed{{{predicted}}}", gold).correct)
