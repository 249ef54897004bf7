"""What a task is: samples with a prompt and a gold answer, and how to score a generation.

Like kvpress presses: one small class per task, a registry, one parametrised test over the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from thoughtkv_base import UserError, __version__
from tracer.tasks.grading import Grade, answer_region


@dataclass(frozen=True)
class Sample:
    sample_id: str  # stable across runs, e.g. "gsm8k/test/12"; the resume key
    prompt: str  # the user turn (the chat template, if any, is applied by the decoder)
    gold: str | None  # canonical answer string; None when unknown
    meta: dict = field(default_factory=dict)


class Task:
    """Base class: subclasses set the class attributes and implement `load`, and either `extract_answer`
    (+ `is_correct`, exact match by default) or `grade` (the math tasks: tracer.tasks.math_task)."""

    name: str = ""
    source: str = ""  # dataset id or generator, recorded in run.json
    split: str = ""
    use_chat_template: bool = True  # R1 distills only "think" inside their chat template

    def load(self, n_samples: int, data_file: str | None = None, seed: int = 0) -> list[Sample]:
        raise NotImplementedError

    def extract_answer(self, text: str) -> str | None:
        raise NotImplementedError

    def is_correct(self, predicted: str | None, gold: str | None) -> bool | None:
        """None when there is nothing to score against."""
        if gold is None:
            return None
        return predicted is not None and predicted.strip() == gold.strip()

    def grade(self, text: str, gold: str | None) -> Grade:
        """Score one generation: what `samples` records in predicted, correct, grader, answered_after_think."""
        region, after_think = answer_region(text)
        predicted = self.extract_answer(region)
        return Grade(predicted, self.is_correct(predicted, gold), after_think,
                     f"thoughtkv {__version__} {self.name} exact-match")


def prompt_manifest(task: Task, tokenizer) -> tuple[dict, str | None]:
    """run.json's record of how prompts were built (the instruction appended, chat template applied or not),
    and a one-line warning when the task wants a chat template the tokenizer lacks. The condition is the one
    tracer.decode.encode_prompt applies."""
    import hashlib

    template = getattr(tokenizer, "chat_template", None)
    applied = bool(task.use_chat_template and template)
    record = {
        "instruction": getattr(task, "instruction", None),
        "chat_template_applied": applied,
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest() if applied else None,
    }
    warning = None
    if task.use_chat_template and not template:
        warning = (f"the tokenizer has no chat template: task {task.name}'s prompts are fed raw, without the chat "
                   "turns (and <think>) a reasoning model was tuned on; use the model's own tokenizer to compare")
    return record, warning


def grading_columns(task: Task, text: str, gold: str | None, scored: bool = True) -> dict:
    """The `samples` columns a grade fills (all null when the run is not scored, e.g. random weights)."""
    if not scored:
        return {"predicted": None, "correct": None, "grader": None, "answered_after_think": None}
    graded = task.grade(text, gold)
    return {"predicted": graded.predicted, "correct": graded.correct, "grader": graded.grader,
            "answered_after_think": graded.answered_after_think}


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


def get_task(name: str) -> Task:
    try:
        return TASKS[name]()
    except KeyError:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None
