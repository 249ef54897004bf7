"""Fidelity to the full cache: how far a policy moves a model's output from what the full cache gives.

A model whose task accuracy is at the floor (SmolLM2-135M on GSM8K) cannot grade a KV policy by accuracy; its
own full-cache output can, as the KV-compression literature grades by perplexity (StreamingLLM, H2O) or by
agreement with the full-cache output (R-KV). `thoughtkv trace --fidelity-reference RUN` decodes each sample
three ways beside the usual free-running trace, all with the policy under test, and records per sample:

1. **Teacher-forced on the reference chain** (the full cache's greedy continuation, read from RUN, a full-cache
   run of the same model, task and samples): at every step, KL(full || policy) of the next-token distribution,
   whether the policy's top-1 token is the reference's, and the reference token's NLL under the policy and under
   the full cache. The full cache's distributions come from one dense causal forward over prompt + chain (no
   cache: every position attends everything before it), so they are the full cache's up to float rounding.
2. **Free-running** (the trace itself): the first step at which the policy's greedy token leaves the reference
   (None: it never does within the shorter of the two), and whether its final answer string (the grader's
   extraction) equals the full cache's.
3. **Teacher-forced on the task's human-written solution** (GSM8K's worked answer, its `<<...>>` calculator
   annotations removed, then the end-of-turn token): the NLL of a chain of thought nobody here wrote, under the
   policy and under the full cache.

A 135M model's greedy chains can fall into loops, which a policy reproduces trivially: `repeats_ngram` flags a
chain that repeats an 8-gram, `longest_repeat` records the longest span it repeats (a whole sentence repeated
verbatim is a degenerate loop; a repeated 8-gram is often a fluent phrase), and the tables are given for the
non-looping chains and the human-written ones too. What a run records: `samples` columns `fidelity_*` (traces/schema.py); summaries in analysis/fidelity.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from thoughtkv_base import UserError

LOOP_NGRAM = 8  # a chain that repeats an n-gram of this many tokens counts as looping
CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")  # GSM8K solutions' calculator calls: "<<48/2=24>>"


class FidelityReferenceError(UserError):
    """A --fidelity-reference that cannot serve as this run's reference (one line, the fix)."""


@dataclass(frozen=True)
class ReferenceChain:
    """One sample's full-cache greedy continuation, as the reference run recorded it."""

    sample_id: str
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    predicted: str | None  # the grader's answer extraction of the reference text

    @property
    def loops(self) -> bool:
        return repeats_ngram(self.generated_ids, LOOP_NGRAM)

    @property
    def longest_repeat(self) -> int:
        return longest_repeat(self.generated_ids)


def repeats_ngram(ids, n: int = LOOP_NGRAM) -> bool:
    """Whether some n consecutive tokens occur twice (overlapping allowed) in `ids`."""
    seen = set()
    for start in range(len(ids) - n + 1):
        gram = tuple(ids[start : start + n])
        if gram in seen:
            return True
        seen.add(gram)
    return False


def longest_repeat(ids) -> int:
    """The length of the longest token span that occurs twice in `ids` (overlapping allowed; 0: none). A fluent
    chain repeats short phrases ("the total cost of the donuts is"); a degenerate loop repeats whole sentences.
    Binary search on the length: a span of n repeating implies one of n - 1 does."""
    low, high = 0, max(0, len(ids) - 1)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if repeats_ngram(ids, middle) else (low, middle - 1)
    return low


def human_solution(sample) -> str | None:
    """The task's human-written solution for teacher forcing (GSM8K's `answer`, annotations removed), or None."""
    text = (sample.meta or {}).get("solution")
    return None if text is None else CALCULATOR_ANNOTATION.sub("", text).strip()


def load_references(run_dir: str | Path, manifest_model: dict, task: str, max_new_tokens: int,
                    sample_ids: list[str]) -> dict[str, ReferenceChain]:
    """The reference chains of `sample_ids` from a full-cache run (checked: traced with the full policy, the
    same model weights and dtype, the same task and decode limit, every sample committed)."""
    from traces import open_run
    from traces.errors import TraceFormatError

    try:
        run = open_run(run_dir)
    except (TraceFormatError, OSError) as exc:
        raise FidelityReferenceError(f"--fidelity-reference {run_dir}: not a readable trace run ({exc})") from None
    manifest = run.manifest
    policy = (manifest.get("policy") or {}).get("name")
    if policy != "full":
        raise FidelityReferenceError(f"--fidelity-reference {run_dir}: traced with policy {policy!r}; the reference "
                                     "is a full-cache run (--policy full) of the same model and task")
    theirs, ours = manifest.get("model") or {}, manifest_model
    for key in ("id", "dtype", "n_params"):
        if theirs.get(key) != ours.get(key):
            raise FidelityReferenceError(f"--fidelity-reference {run_dir}: its model {key} is {theirs.get(key)!r}, "
                                         f"this run's {ours.get(key)!r}; trace the reference with the same --model/--dtype")
    if (manifest.get("task") or {}).get("name") != task:
        raise FidelityReferenceError(f"--fidelity-reference {run_dir}: task {(manifest.get('task') or {}).get('name')!r}, "
                                     f"not {task!r}")
    limit = ((manifest.get("tracer") or {}).get("max_new_tokens"))
    if limit != max_new_tokens:
        raise FidelityReferenceError(f"--fidelity-reference {run_dir}: decoded up to {limit} new tokens, this run "
                                     f"{max_new_tokens}; use the same --max-new-tokens")
    samples = run.samples()
    missing = [s for s in sample_ids if s not in set(samples["sample_id"])]
    if missing:
        raise FidelityReferenceError(f"--fidelity-reference {run_dir}: {len(missing)} of this run's samples are not "
                                     f"in it (first {missing[0]}); trace it with at least as many --n-samples")
    wanted = set(sample_ids)
    references = {}
    for row in samples.itertuples():
        if row.sample_id not in wanted:
            continue
        rows = run.tokens(row.sample_id).sort_values("position")
        ids = rows["token_id"].to_numpy()
        prompt = rows["is_prompt"].to_numpy()
        predicted = row.predicted if isinstance(row.predicted, str) else None  # (a null reads back as NaN)
        references[row.sample_id] = ReferenceChain(row.sample_id, tuple(int(i) for i in ids[prompt]),
                                                   tuple(int(i) for i in ids[~prompt]), predicted)
    return references


@torch.inference_mode()
def dense_log_probs(model, ids: list[int], start: int, cache: Path | None = None) -> torch.Tensor:
    """The full cache's next-token log-probabilities [len(ids) - start, vocab] (float32) for the tokens
    ids[start:], from one causal forward over `ids` without a cache (row j predicts ids[start + j]).

    With `cache` (a directory), the decoder's final hidden states at those positions are kept there, keyed on
    the weights' fingerprint and the ids (`hidden_key`): every policy graded against the same reference reads
    them back and applies only the LM head, instead of running the whole model over the chain again."""
    head = model.get_output_embeddings()
    path = None if cache is None else cache / f"{hidden_key(model, ids, start)}.safetensors"
    if path is not None and path.is_file():
        from safetensors.torch import load_file

        hidden = load_file(str(path))["hidden"].to(model.device)
    else:
        device = model.device
        out = model.get_decoder()(input_ids=torch.tensor([ids], device=device),
                                  position_ids=torch.arange(len(ids), device=device)[None], use_cache=False)
        hidden = out.last_hidden_state[0, start - 1 : len(ids) - 1].contiguous()
        if path is not None:
            _save_hidden(path, hidden)
    return torch.log_softmax(head(hidden).float(), dim=-1)


def hidden_key(model, ids: list[int], start: int) -> str:
    """sha256 over the model's weights fingerprint (`weights_fingerprint`), its dtype and the token ids."""
    import hashlib

    digest = hashlib.sha256(weights_fingerprint(model).encode())
    digest.update(np.asarray([start, *ids], dtype=np.int64).tobytes())
    return digest.hexdigest()[:32]


def weights_fingerprint(model) -> str:
    """A cheap content fingerprint of a model's weights: every parameter's name, shape, dtype and a strided
    sample of its values (the whole of the small ones), hashed; kept on the model once computed."""
    cached = getattr(model, "_thoughtkv_fingerprint", None)
    if cached is not None:
        return cached
    import hashlib

    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        flat = parameter.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy()
        digest.update(f"{name}{tuple(parameter.shape)}{parameter.dtype}".encode())
        digest.update(sample.tobytes())
    model._thoughtkv_fingerprint = digest.hexdigest()
    return model._thoughtkv_fingerprint


def _save_hidden(path: Path, hidden: torch.Tensor) -> None:
    from safetensors.torch import save_file

    from traces.layout import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda temp: save_file({"hidden": hidden.cpu()}, str(temp)))


@dataclass
class ForcedScore:
    """A teacher-forced job's per-step record against the full cache's log-probabilities `reference`
    [steps, vocab]: KL(full || policy) in nats, top-1 agreement with the forced token, and the forced token's
    NLL under the policy and under the full cache. Its `__call__` is a DecodeJob's `on_logits`."""

    forced_ids: list[int]
    reference: torch.Tensor
    kl: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    nll_full: list[float] = field(default_factory=list)

    def __call__(self, step: int, logits: torch.Tensor) -> None:
        policy = torch.log_softmax(logits.float(), dim=-1)
        full = self.reference[step].to(policy.device)
        token = self.forced_ids[step]
        # KL(full || policy) = sum_v p_full(v) (log p_full(v) - log p_policy(v)), p_full = 0 terms are 0.
        kl = torch.sum(full.exp() * (full - policy))
        values = torch.stack([kl, -policy[token], -full[token], (policy.argmax() == token).float()]).tolist()
        self.kl.append(max(0.0, values[0]))  # (a rounding below zero when the two agree)
        self.nll.append(values[1])
        self.nll_full.append(values[2])
        self.top1.append(bool(values[3]))


def first_divergence(generated: list[int], reference: tuple[int, ...]) -> int | None:
    """The first step at which the free-running chain's token differs from the reference's (None: none within
    the shorter of the two)."""
    for step, (a, b) in enumerate(zip(generated, reference)):
        if a != b:
            return step
    return None


def sample_columns(reference: ReferenceChain, generated: list[int], predicted: str | None,
                   on_chain: ForcedScore, on_human: ForcedScore | None) -> dict:
    """The `samples` columns a fidelity run writes for one sample (traces/schema.py, `fidelity_*`)."""
    def floats(values):
        return np.asarray(values, dtype=np.float32)

    human = on_human is not None
    return {
        "fidelity_reference_tokens": len(reference.generated_ids),
        "fidelity_reference_loops": reference.loops,
        "fidelity_reference_repeat": reference.longest_repeat,
        "fidelity_kl": floats(on_chain.kl), "fidelity_top1": np.asarray(on_chain.top1, dtype=bool),
        "fidelity_nll": floats(on_chain.nll), "fidelity_full_nll": floats(on_chain.nll_full),
        "fidelity_first_divergence": first_divergence(generated, reference.generated_ids),
        "fidelity_answer_match": (predicted or "") == (reference.predicted or ""),
        "fidelity_full_answered": reference.predicted is not None,
        "fidelity_human_kl": floats(on_human.kl) if human else None,
        "fidelity_human_top1": np.asarray(on_human.top1, dtype=bool) if human else None,
        "fidelity_human_nll": floats(on_human.nll) if human else None,
        "fidelity_human_full_nll": floats(on_human.nll_full) if human else None,
    }
