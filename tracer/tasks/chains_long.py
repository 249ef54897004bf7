"""Task `chains_long`: the `chains` reasoning trace stretched so that a KV budget binds.

Same generator, words and vocabulary as `chains` (the bundled word-level tokenizer encodes it unchanged); three
knobs differ:

- **all ten filler thoughts after every step** (`fillers_per_step=10`), in cyclic order from the step's result
  digit: ~43 low-information words between two steps, as in a real chain of thought, and still deterministic
  (the cycle ends just before it would repeat the first phrase, so greedy decoding can reproduce it);
- **8 steps and 8-12 variables**, so a definition in the prompt is looked up by the last steps ~400-500
  tokens after it was written (a quarter of all look-ups reach >= 256 tokens back);
- its own held-out stream (`chains_long/test/<i>`), disjoint from `chains/test`.

Lengths on the 500 held-out problems (prompt + chain of thought, `python -m tracer.tasks.chains_long`):
see `length_stats` and tracer/assets/micro_long/README.md.
"""

from __future__ import annotations

import random
import statistics
import sys

from thoughtkv_base import UserError
from tracer.tasks.base import register_task
from tracer.tasks.chains import (
    OLD_LOOKUP,
    PREV_LOOKUP,
    VAR_LOOKUP,
    ChainsConfig,
    ChainsTask,
    Problem,
    binding,
    generate_problem,
)

LONG_CONFIG = ChainsConfig(min_variables=8, max_variables=12, min_steps=8, max_steps=8, fillers_per_step=10)
HELDOUT_PREFIX = "chains_long/test"
LOOKUP_ROLES = (VAR_LOOKUP, PREV_LOOKUP, OLD_LOOKUP)


def heldout_long_problem(index: int, config: ChainsConfig = LONG_CONFIG) -> Problem:
    """Held-out problem `index` of the long variant: its own string seed (training never draws from it)."""
    return generate_problem(random.Random(f"{HELDOUT_PREFIX}/{index}"), config)


def sequence_length(problem: Problem) -> int:
    """Tokens of prompt + chain of thought, as the model sees them: <bos>, one token per word, <eos>."""
    return 1 + len(problem.prompt_words) + len(problem.answer_words) + 1


def lookup_distances(problem: Problem) -> list[int]:
    """For every value look-up in the chain of thought (a variable's or a result's digit), how many tokens back
    the binding word it copies from (`b=4`, `r3=7`) sits. Positions count <bos> as 0."""
    sequence = ["<bos>", *problem.prompt_words, *problem.answer_words]
    offset = 1 + len(problem.prompt_words)
    last_binding: dict[str, int] = {}
    for position, word in enumerate(sequence[:offset]):
        last_binding[word] = position
    distances = []
    for j, (word, role) in enumerate(zip(problem.answer_words, problem.answer_roles)):
        position = offset + j
        if role in LOOKUP_ROLES:
            source = last_binding.get(binding(problem.answer_words[j - 1], int(word)))
            if source is None:  # cannot happen for a generated problem: every operand is bound before use
                raise UserError(f"chains_long: look-up of {problem.answer_words[j - 1]} has no binding before it")
            distances.append(position - source)
        last_binding[word] = position
    return distances


def length_stats(n_problems: int = 500, config: ChainsConfig = LONG_CONFIG) -> dict[str, float]:
    """Median / p90 sequence length and median / max look-up distance over the first `n_problems` held-out
    problems (p90: the nearest-rank 90th percentile)."""
    problems = [heldout_long_problem(i, config) for i in range(n_problems)]
    lengths = sorted(sequence_length(p) for p in problems)
    distances = sorted(d for p in problems for d in lookup_distances(p))
    return {
        "n_problems": n_problems,
        "median_length": statistics.median(lengths),
        "p90_length": lengths[max(0, -(-9 * n_problems // 10) - 1)],
        "min_length": lengths[0],
        "max_length": lengths[-1],
        "median_lookup_distance": statistics.median(distances),
        "max_lookup_distance": distances[-1],
        "share_lookups_ge_256": round(sum(d >= 256 for d in distances) / len(distances), 4),
    }


@register_task
class ChainsLongTask(ChainsTask):
    name = "chains_long"
    source = "generator:tracer.tasks.chains_long (seeded, held-out split chains_long/test)"

    def __init__(self, config: ChainsConfig = LONG_CONFIG) -> None:
        super().__init__(config)

    def load(self, n_samples: int, data_file: str | None = None, seed: int = 0) -> list:
        if data_file is not None:
            raise UserError("task chains_long is generated, not read: drop --data-file")
        from tracer.tasks.base import Sample

        samples = []
        for index in range(n_samples):
            problem = heldout_long_problem(index, self.config)
            meta = {"answer": problem.answer, "n_answer_words": len(problem.answer_words)}
            samples.append(Sample(f"{HELDOUT_PREFIX}/{index}", problem.prompt, problem.gold, meta))
        return samples


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    for key, value in length_stats(n).items():
        print(f"{key}: {value}")
