"""Task `chains`: a reasoning trace in miniature, generated from a seed (no download).

The prompt defines digit variables and a small program; the answer is a chain of thought that, for each step,
restates the step's statement and its operands' values (look-ups far back in the sequence), computes mod 10,
and adds a filler "thought" chosen by the step's result digit (deterministic, so greedy decoding can reproduce
it):

    prompt:  b=4 , e=2 , p=1 , o=8 . Q: r1.x=p r1.op=- r1.y=o ; r2.x=e r2.op=* r2.y=r1 ; A:
    answer:  r1.x=p r1.op=- r1.y=o : p 1 , o 8 , 1 - 8 = 3 ; r1=3 . let me think .
             r2.x=e r2.op=* r2.y=r1 : e 2 , r1 3 , 2 * 3 = 6 ; r2=6 . hmm , ok . answer = 6

Bindings (`b=4`, `r1=3`) and statement fields (`r2.x=e`) are single words, so every far-back look-up is one
content-addressed attention hop; tracer/micro/README.md explains why (the two-token syntax needs an induction
circuit, which the CPU-trained micro model did not form in time).

Everything is whole words separated by single spaces, for the bundled word-level tokenizer
(`tracer.micro.tokenizer`). Each generated word carries a role (what skill predicting it needs), so training
and tests can measure look-up accuracy separately from local copying.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from thoughtkv_base import UserError
from tracer.tasks.base import Sample, Task, register_task

VARIABLE_NAMES = tuple("abcdefghijklmnopqstu")  # 20 letters; "r" is kept for results r1, r2, ...
MAX_STEPS = 12
RESULT_NAMES = tuple(f"r{k}" for k in range(1, MAX_STEPS + 1))
OPERATIONS = {"+": lambda x, y: (x + y) % 10, "-": lambda x, y: (x - y) % 10, "*": lambda x, y: (x * y) % 10}
# Filler thought after a step, indexed by the step's result digit: low information, yet predictable.
FILLERS = (
    "hmm .",
    "wait , let me check .",
    "ok so far so good .",
    "let me think .",
    "right .",
    "so that works .",
    "hmm , ok .",
    "let me double check that .",
    "fine , moving on .",
    "alright , next .",
)
PROMPT_END, ANSWER_WORD = "A:", "answer"

# Roles of generated words (the chain of thought); prompt words have role PROMPT.
PROMPT, COPY, STEP_LOOKUP, VAR_LOOKUP, PREV_LOOKUP, OLD_LOOKUP, COMPUTE, FILLER, ANSWER = (
    "prompt", "copy", "step_lookup", "var_lookup", "prev_lookup", "old_lookup", "compute", "filler", "answer",
)
ROLES = (PROMPT, COPY, STEP_LOOKUP, VAR_LOOKUP, PREV_LOOKUP, OLD_LOOKUP, COMPUTE, FILLER, ANSWER)


def binding(name: str, value: int) -> str:
    """One word (one token) that binds a name to its digit, e.g. `b=4`: a later `b` can find its value with a
    single attention look-up on content, without first learning an induction circuit."""
    return f"{name}={value}"


def statement_words(result: str, left: str, op: str, right: str) -> list[str]:
    """`r2 = f - r1` as three words, each naming its step: `r2.x=f r2.op=- r2.y=r1`. A chain-of-thought step
    then finds its statement by content (the words starting `r2.`) instead of by position."""
    return [f"{result}.x={left}", f"{result}.op={op}", f"{result}.y={right}"]


def vocabulary() -> list[str]:
    """Every word the generator can emit (special tokens excluded), in a fixed order."""
    words = list("0123456789") + list(VARIABLE_NAMES) + list(RESULT_NAMES) + list(OPERATIONS)
    words += ["=", ",", ";", ".", ":", "Q:", PROMPT_END, ANSWER_WORD, "recall"]
    words += [binding(name, value) for name in VARIABLE_NAMES + RESULT_NAMES for value in range(10)]
    operands = VARIABLE_NAMES + RESULT_NAMES
    for result in RESULT_NAMES:
        words += [f"{result}.x={name}" for name in operands]
        words += [f"{result}.op={op}" for op in OPERATIONS]
        words += [f"{result}.y={name}" for name in operands]
    for word in " ".join(FILLERS).split():
        if word not in words:
            words.append(word)
    return words


@dataclass(frozen=True)
class ChainsConfig:
    """Generator knobs. The defaults are the distribution the bundled model is trained and tested on."""

    min_variables: int = 6
    max_variables: int = 12
    min_steps: int = 4
    max_steps: int = 8
    fillers_per_step: int = 1  # filler density: 0 = none; k = k phrases after every step
    old_result_share: float = 0.2  # share of steps (from step 3) whose result operand is older than the last

    def __post_init__(self) -> None:
        if not 1 <= self.min_variables <= self.max_variables <= len(VARIABLE_NAMES):
            raise UserError(f"chains: variables must satisfy 1 <= min <= max <= {len(VARIABLE_NAMES)}")
        if not 1 <= self.min_steps <= self.max_steps <= MAX_STEPS:
            raise UserError(f"chains: steps must satisfy 1 <= min <= max <= {MAX_STEPS}")
        if self.min_variables < 2 and self.min_steps >= 1:
            raise UserError("chains: step 1 needs two distinct variables; use min_variables >= 2")
        if self.fillers_per_step < 0 or not 0.0 <= self.old_result_share <= 1.0:
            raise UserError("chains: fillers_per_step must be >= 0 and old_result_share in [0, 1]")


@dataclass(frozen=True)
class Problem:
    prompt_words: list[str]  # without <bos>; the tokenizer adds it
    answer_words: list[str]  # the chain of thought, ending "answer = D" (the tokenizer's <eos> follows)
    answer_roles: list[str]  # one role per answer word
    gold: str  # the final digit

    @property
    def prompt(self) -> str:
        return " ".join(self.prompt_words)

    @property
    def answer(self) -> str:
        return " ".join(self.answer_words)


def generate_problem(rng: random.Random, config: ChainsConfig = ChainsConfig()) -> Problem:
    n_variables = rng.randint(config.min_variables, config.max_variables)
    n_steps = rng.randint(config.min_steps, config.max_steps)
    names = rng.sample(VARIABLE_NAMES, n_variables)
    values = {name: rng.randrange(10) for name in names}

    prompt = []
    for i, name in enumerate(names):
        prompt += [binding(name, values[name]), "," if i < n_variables - 1 else "."]
    prompt.append("Q:")

    # The program: step 1 combines two variables; later steps a variable and an earlier result.
    steps: list[tuple[str, str, str, str]] = []  # (result, left, op, right)
    for k in range(1, n_steps + 1):
        op = rng.choice(tuple(OPERATIONS))
        if k == 1:
            left, right = rng.sample(names, 2)
        else:
            older = k >= 3 and rng.random() < config.old_result_share
            result_operand = RESULT_NAMES[rng.randrange(k - 2) if older else k - 2]
            variable = rng.choice(names)
            left, right = (result_operand, variable) if rng.random() < 0.5 else (variable, result_operand)
        steps.append((RESULT_NAMES[k - 1], left, op, right))
        prompt += [*statement_words(RESULT_NAMES[k - 1], left, op, right), ";"]
    prompt.append(PROMPT_END)

    words: list[str] = []
    roles: list[str] = []

    def emit(word: str, role: str) -> None:
        words.append(word)
        roles.append(role)

    for k, (result, left, op, right) in enumerate(steps, start=1):
        for w in statement_words(result, left, op, right):
            emit(w, STEP_LOOKUP)
        emit(":", COPY)
        for operand in (left, right):
            emit(operand, COPY)
            if operand not in RESULT_NAMES:
                emit(str(values[operand]), VAR_LOOKUP)
            else:
                is_previous = operand == RESULT_NAMES[k - 2]
                emit(str(values[operand]), PREV_LOOKUP if is_previous else OLD_LOOKUP)
            emit(",", COPY)
        value = OPERATIONS[op](values[left], values[right])
        values[result] = value
        for w in (str(values[left]), op, str(values[right]), "="):
            emit(w, COPY)
        emit(str(value), COMPUTE)
        for w in (";", binding(result, value), "."):
            emit(w, COPY)
        for j in range(config.fillers_per_step):
            for w in FILLERS[(value + j) % 10].split():
                emit(w, FILLER)
    gold = str(values[steps[-1][0]])
    emit(ANSWER_WORD, COPY)
    emit("=", COPY)
    emit(gold, ANSWER)
    return Problem(prompt_words=prompt, answer_words=words, answer_roles=roles, gold=gold)


def generate_recall(rng: random.Random, min_items: int = 4, max_items: int = 16,
                    result_share: float = 0.0) -> Problem:
    """Side task for training only: define variables, then recall a list of them by name. With `result_share`
    > 0, that share of the defined names are result names (`r7=3`), so that every step index's name is learnt
    early, not only once long programs appear in the curriculum."""
    n_defined = rng.randint(max(2, min_items), max_items)
    n_results = sum(rng.random() < result_share for _ in range(n_defined))
    names = rng.sample(VARIABLE_NAMES, n_defined - n_results) + rng.sample(RESULT_NAMES[:8], min(n_results, 8))
    rng.shuffle(names)
    values = {name: rng.randrange(10) for name in names}
    queries = [rng.choice(names) for _ in range(rng.randint(min_items, max_items))]
    prompt = []
    for i, name in enumerate(names):
        prompt += [binding(name, values[name]), "," if i < len(names) - 1 else "."]
    prompt += ["Q:", "recall", *queries, PROMPT_END]
    words, roles = [], []
    for i, name in enumerate(queries):
        words += [name, str(values[name]), "," if i < len(queries) - 1 else "."]
        roles += [COPY, VAR_LOOKUP, COPY]
    return Problem(prompt_words=prompt, answer_words=words, answer_roles=roles, gold=str(values[queries[-1]]))


def generate_statement_recall(rng: random.Random, max_step: int = 8) -> Problem:
    """Side task for training only: a program of random statements (step indices 1..`max_step`, any order),
    then restate the statements of a list of step names. It trains the statement look-up of every step index
    (`r7` -> `r7.x=q r7.op=- r7.y=r3`) from the start, with the same words as `chains`."""
    indices = rng.sample(range(1, max_step + 1), rng.randint(2, max_step))
    operands = VARIABLE_NAMES + RESULT_NAMES[:max_step]
    prompt: list[str] = []
    statements = {}
    for k in indices:
        result = RESULT_NAMES[k - 1]
        left, right = rng.sample(operands, 2)
        statements[result] = statement_words(result, left, rng.choice(tuple(OPERATIONS)), right)
        prompt += [*statements[result], ";"]
    queries = [RESULT_NAMES[k - 1] for k in rng.choices(indices, k=rng.randint(2, 2 * len(indices)))]
    prompt += ["Q:", "recall", *queries, PROMPT_END]
    words, roles = [], []
    for i, name in enumerate(queries):
        words += [name, ":", *statements[name], "," if i < len(queries) - 1 else "."]
        roles += [COPY, COPY, STEP_LOOKUP, STEP_LOOKUP, STEP_LOOKUP, COPY]
    return Problem(prompt_words=prompt, answer_words=words, answer_roles=roles, gold="0")


def heldout_problem(index: int, config: ChainsConfig = ChainsConfig()) -> Problem:
    """Held-out problem `index`: its own string seed, a stream training never draws from (and training also
    rejects any problem whose prompt equals a test prompt)."""
    return generate_problem(random.Random(f"chains/test/{index}"), config)


@register_task
class ChainsTask(Task):
    name = "chains"
    source = "generator:tracer.tasks.chains (seeded, held-out split chains/test)"
    split = "test"
    use_chat_template = False  # the micro model has no chat template: the prompt is the raw program

    def __init__(self, config: ChainsConfig = ChainsConfig()) -> None:
        self.config = config

    def load(self, n_samples: int, data_file: str | None = None, seed: int = 0) -> list[Sample]:
        # The split is fixed like a dataset's test split (`seed` only drives the decoder's sampling).
        if data_file is not None:
            raise UserError("task chains is generated, not read: drop --data-file")
        samples = []
        for index in range(n_samples):
            problem = heldout_problem(index, self.config)
            meta = {"answer": problem.answer, "n_answer_words": len(problem.answer_words)}
            samples.append(Sample(f"chains/test/{index}", problem.prompt, problem.gold, meta))
        return samples

    def extract_answer(self, text: str) -> str | None:
        """The digit after the last `answer =` (exact match on the final digit)."""
        words = text.split()
        for i in range(len(words) - 2, -1, -1):
            if words[i] == ANSWER_WORD and i + 2 < len(words) and words[i + 1] == "=":
                digit = words[i + 2]
                return digit if digit.isdigit() and len(digit) == 1 else None
        return None
