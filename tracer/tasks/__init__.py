"""Task registry: importing this package registers every task module listed below."""

from tracer.tasks import aime, chains, chains_long, gsm8k, math500  # noqa: F401  (imported to register the tasks)
from tracer.tasks.base import TASKS, Sample, Task, get_task, grading_columns, prompt_manifest, register_task

__all__ = ["TASKS", "Sample", "Task", "get_task", "grading_columns", "prompt_manifest", "register_task"]
