"""What a task is: samples with a prompt and a gold answer, and how to score a generation.

Like kvpress presses: one small class per task, a registry, one parametrised test over the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from thoughtkv_base import UserError


@dataclass(frozen=True)
class Sample:
    sample_id: str  # stable across runs, e.g. "gsm8k/test/12"; the resume key
    prompt: str  # the user turn (the chat template, if any, is applied by the decoder)
    gold: str | None  # canonical answer string; None when unknown
    meta: dict = field(default_factory=dict)


class Task:
    """Base class: subclasses set the class attributes and implement `load` and `extract_answer`."""

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


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


def get_task(name: str) -> Task:
    try:
        return TASKS[name]()
    except KeyError:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None
