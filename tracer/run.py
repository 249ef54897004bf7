"""`run_trace(config)`: decode a task's samples with a tiered KV cache and write a trace v1 run (resumable).

The Python API behind `thoughtkv trace`; demo/crosscheck/sweep code calls it without a subprocess.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from thoughtkv_base import UserError, check_seed
from traces.policy import PolicySpec


class BadTraceConfig(UserError):
    pass


MAX_NEW_TOKENS = 2**20  # tokens per sample: past the context of every model here (R1 distills: 131,072)


_POLICY_DEFAULTS = PolicySpec()


@dataclass
class TraceConfig:
    model: str
    task: str
    out: str
    n_samples: int = 1
    data_file: str | None = None
    # The placement settings: PolicySpec's fields with PolicySpec's defaults (traces/policy.py is their one home;
    # `spec` below builds and validates the spec from them). The cache geometry, the decode limit and the recall
    # setting left at None come from the model's trace_defaults.json, else the tool's defaults
    # (tracer.model_defaults.resolve, in __post_init__; `from_model` records which).
    policy: str = _POLICY_DEFAULTS.policy
    hbm_budget: str | float = _POLICY_DEFAULTS.hbm_budget
    evict_ratio: float = _POLICY_DEFAULTS.evict_ratio
    block_size: int | None = None
    scorer: str = _POLICY_DEFAULTS.scorer
    recall_k: int | None = None
    recall_budget: str | float | None = None
    recall_rule: str = _POLICY_DEFAULTS.recall_rule  # the tracer runs traces.policy.TRACER_RECALL_RULES
    batch_size: int = 1  # samples decoded per step (continuous refill; per-sample results as at batch 1)
    max_new_tokens: int | None = None
    prefill_chunk_tokens: int | None = 2048  # a longer prompt is prefilled in chunks of this many tokens
    sink_tokens: int | None = None
    window_tokens: int | None = None
    promote: bool = _POLICY_DEFAULTS.promote
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    access: bool = True
    # Issue 9 (tracer/quant.py, tracer/scorers/):
    ddr_dtype: str = _POLICY_DEFAULTS.ddr_dtype  # hierarchy: DDR stores offloaded blocks as same | int8 | int4
    recall_buffer_blocks: int = _POLICY_DEFAULTS.recall_buffer_blocks  # hierarchy: per-layer LRU of recalled blocks
    also_score: str | None = None  # "A,B": scorers computed alongside, recorded in tokens.importance_by_scorer
    grad_window: int = 1  # gradient scorer: next-token losses of the last N positions
    grad_interval: int = 1  # gradient scorer: one backward pass every N decode steps
    threads: int | None = None  # torch intra-op threads; None: tracer.preflight.resolve_threads's default
    command: list[str] | None = None  # the `thoughtkv trace` argv, when the CLI made this config (repair command)
    allow_past_context: bool = False  # trace a prompt longer than the model's context anyway (timing only)
    from_model: dict | None = None  # settings taken from the model's trace_defaults.json (run.json records them)
    # A full-cache run of the same model and task: grade this run by fidelity to it (tracer/fidelity.py).
    fidelity_reference: str | None = None

    def __post_init__(self) -> None:
        from tracer.model_defaults import KEYS, resolve

        values, from_model = resolve(self.model, {key: getattr(self, key) for key in KEYS}, self.policy)
        for key, value in values.items():
            setattr(self, key, value)
        self.from_model = {**(self.from_model or {}), **from_model}

    @property
    def spec(self):
        """The placement settings as the one policy contract (traces/policy.py validates them on construction)."""
        from traces.policy import PolicySpec

        return PolicySpec(
            policy=self.policy, hbm_budget=self.hbm_budget, evict_ratio=self.evict_ratio, block_size=self.block_size,
            sink_tokens=self.sink_tokens, window_tokens=self.window_tokens, recall_k=self.recall_k,
            recall_budget=self.recall_budget, recall_rule=self.recall_rule, scorer=self.scorer,
            promote=self.promote, ddr_dtype=self.ddr_dtype, recall_buffer_blocks=self.recall_buffer_blocks,
        ).effective()

    def validate(self) -> None:
        """Every check that needs no model; raises a one-line UserError."""
        from tracer.scorers import SCORERS
        from tracer.tasks import get_task
        from traces.policy import TRACER_RECALL_RULES

        spec = self.spec
        if spec.recall_rule not in TRACER_RECALL_RULES:
            raise BadTraceConfig(
                f"--recall-rule {spec.recall_rule} is simulator-only; the tracer recalls by {' or '.join(TRACER_RECALL_RULES)}"
            )
        if self.scorer not in SCORERS:
            raise BadTraceConfig(f"unknown scorer {self.scorer!r}; use one of {', '.join(SCORERS)}")
        get_task(self.task)
        from tracer.packaged import PACKAGED_MODELS

        if self.model in PACKAGED_MODELS:  # not installed: say so before any data is read
            from tracer.preflight import check_model_spec

            check_model_spec(self.model)
        self._validate_extras()
        from tracer.preflight import resolve_device, resolve_threads

        resolve_threads(resolve_device(self.device), self.threads)
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise BadTraceConfig(f"--prefill-chunk-tokens must be at least 1 (got {self.prefill_chunk_tokens})")
        for name in ("n_samples", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise BadTraceConfig(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        # A generated task (chains) has no count of its own: 10**13 samples looped in the loader forever.
        from traces.layout import MAX_SAMPLES

        if self.n_samples > MAX_SAMPLES:
            raise BadTraceConfig(f"--n-samples {self.n_samples:,} is more than {MAX_SAMPLES:,}; trace fewer (a rerun "
                                 "with more resumes the run)")
        if self.max_new_tokens > MAX_NEW_TOKENS:  # 10**12 looped in the KV sizing (one pass per length) for ever
            raise BadTraceConfig(f"--max-new-tokens {self.max_new_tokens:,} is more than {MAX_NEW_TOKENS:,}, past any "
                                 "model's context; use fewer")
        check_seed(self.seed)  # the one rule for seeds (thoughtkv_base)
        if self.fidelity_reference is not None:
            if not (Path(self.fidelity_reference) / "run.json").is_file():
                raise BadTraceConfig(f"--fidelity-reference {self.fidelity_reference}: not a trace run (no run.json); "
                                     "trace the full cache first (--policy full) and pass its --out")
            if self.scorer == "oracle" and self.policy != "full":
                raise BadTraceConfig("--fidelity-reference cannot be combined with --scorer oracle (its teacher pass "
                                     "follows the greedy chain, not the forced one); use another scorer")
        if self.data_file is not None and Path(self.data_file).is_dir():
            raise BadTraceConfig(f"--data-file {self.data_file}: is a directory; pass the task's JSONL file")
        if self.data_file is not None and not Path(self.data_file).is_file():
            raise BadTraceConfig(f"--data-file {self.data_file}: no such file")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise BadTraceConfig(f"--out {out}: exists and is not a directory; choose another path")
        parent = next((p for p in [out, *out.parents] if p.exists()), None)
        if parent is None or not parent.is_dir():
            raise BadTraceConfig(f"--out {out}: no existing parent directory")

    def _validate_extras(self) -> None:
        from tracer.scorers import parse_also_score

        extras = parse_also_score(self.also_score)
        if extras and self.scorer == "oracle" and self.policy != "full":
            raise BadTraceConfig("--also-score cannot be combined with --scorer oracle; run them separately")
        if self.grad_window > 1 and self.policy != "full" and "gradient" in (self.scorer, *extras):
            raise BadTraceConfig("--grad-window > 1 needs the full policy (layers keep different entries otherwise); use 1")
        for name in ("grad_window", "grad_interval"):
            if getattr(self, name) < 1:
                raise BadTraceConfig(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")


def protected_excess_note(spec, lengths) -> dict | None:
    """Where the sink + recent window alone exceed the HBM budget (traces.policy.protected_excess) at any of
    these logical lengths: the worst one (the highest effective HBM fraction) with its warning line, else None."""
    from traces.policy import protected_excess, protected_tokens

    worst = None
    for length in sorted(set(lengths)):
        line = protected_excess(spec, length)
        if line is not None:
            fraction = protected_tokens(spec, length) / length
            if worst is None or fraction > worst["effective_hbm_fraction"]:
                worst = {"logical_len": length, "effective_hbm_fraction": fraction, "warning": line}
    return worst


# The tiered layer's page pool is allocated at the peak below as the decode loop admits a sample (tracer/cache/pool.py
# `reserve_length`; past it, e.g. a promotion beyond its room, it grows by an eighth) and the DDR pool doubles
# (tracer/transfer.py `PinnedBlockStore.reserve`), so a sample holds at most twice what it needs.
GROWTH_SLACK = 2


def kv_buffer_bytes(spec, kv_bytes_per_token: int, batch_size: int, max_prompt: int, max_new_tokens: int,
                    n_kv_heads: int = 1) -> dict:
    """Worst-case KV buffer bytes of a run: `hbm` (device: the resident entries at their peak, the whole prompt
    at prefill, plus the recall staging slots: per KV head under a per-head rule; plus a recall buffer's region,
    which holds its blocks in HBM on a GPU) and `ddr` (host, hierarchy), for `batch_size` samples at once."""
    from traces.policy import max_recall_blocks, n_blocks, peak_hbm_tokens

    bs, max_len = spec.block_size, max_prompt + max_new_tokens
    resident, staging = peak_hbm_tokens(spec, max_prompt, max_len), max_recall_blocks(spec, max_len, n_kv_heads) * bs
    buffer = spec.recall_buffer_blocks * bs if spec.uses_ddr else 0
    per_sample_hbm = GROWTH_SLACK * (resident + staging + buffer) * kv_bytes_per_token
    per_sample_ddr = GROWTH_SLACK * n_blocks(spec, max_len) * bs * kv_bytes_per_token if spec.uses_ddr else 0
    return {"hbm": batch_size * per_sample_hbm, "ddr": batch_size * per_sample_ddr,
            "hbm_per_sample": per_sample_hbm, "max_len": max_len}


def prompt_token_counts(loaded, task, samples) -> list[int]:
    """Each sample's prompt length in tokens; the tokenizer's own "longer than the maximum" notice is held back
    (check_context says it, in one line, with the fix)."""
    import transformers

    from tracer.decode import encode_prompt

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return [len(encode_prompt(loaded.tokenizer, s.prompt, task.use_chat_template)) for s in samples]
    finally:
        transformers.logging.set_verbosity(verbosity)


def check_context(config: TraceConfig, loaded, prompt_lengths: list[int], sample_ids: list[str]) -> None:
    """Refuse a prompt longer than the model's context (unless --allow-past-context): every token of it would
    sit at positions the model was never trained on, and the decode would take minutes for nothing. Warn when a
    sample may only decode past the context."""
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    longest = max(prompt_lengths, default=0)
    if not context:
        return
    if longest > context and not config.allow_past_context:
        over = [sid for sid, n in zip(sample_ids, prompt_lengths) if n > context]
        raise BadTraceConfig(
            f"{len(over)} prompt(s) are longer than {config.model}'s context of {context:,} tokens (the longest "
            f"{longest:,} tokens, sample {over[0]}); shorten them or use fewer samples, a model with a longer context, "
            "or --allow-past-context to trace them anyway (timings only)")
    if longest + config.max_new_tokens > context:
        print(f"warning: --max-new-tokens {config.max_new_tokens:,} with the longest prompt ({longest:,} tokens) "
              f"may pass {config.model}'s context of {context:,} tokens; positions beyond it were never trained",
              file=sys.stderr)


def recall_rounding_note(spec, spans: list[tuple[int, int]], upper_bound: bool = True) -> dict | None:
    """Where a recall budget rounds down to zero blocks (traces.policy.recall_blocks: whole blocks, never more
    than the budget) for most of the decode steps of samples spanning (prompt tokens, decode steps) each: the
    first length with a block, the share of steps recalling nothing and one warning line; else None. Before a
    run the spans end at --max-new-tokens (`upper_bound`: a sample that stops early recalls nothing even longer);
    after it, at the tokens each sample generated."""
    from traces.policy import recall_blocks

    if not spec.uses_ddr or spec.recall_budget is None or not spans or not sum(n for _, n in spans):
        return None
    longest = max(p + n for p, n in spans)
    low, high = 1, longest + 1  # recall_blocks is non-decreasing in the length: the first length with a block
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if recall_blocks(spec, middle) == 0 else (low, middle)
    first_with_recall = low
    share = sum(max(0, min(first_with_recall, p + n + 1) - (p + 1)) for p, n in spans) / sum(n for _, n in spans)
    if share < 0.5:
        return None
    budget = f"{spec.recall_budget:g}" if spec.recall_budget <= 1 else f"{int(spec.recall_budget)} tokens"
    below = (f"below a context of {first_with_recall:,} tokens" if first_with_recall <= longest
             else "at every length this run reaches")
    steps = "of the decode steps up to --max-new-tokens" if upper_bound else "of this run's decode steps"
    return {"first_length_with_recall": first_with_recall, "zero_recall_step_share": share,
            "warning": f"--recall-budget {budget} is less than one {spec.block_size}-token block {below}: {share:.0%} "
                       f"{steps} recall nothing; raise --recall-budget or lower --block-size"}


def check_kv_fits(config: TraceConfig, loaded, prompt_lengths: list[int]) -> dict:
    """Refuse up front, in one line, a run whose KV buffers cannot fit next to the loaded model."""
    from tracer.preflight import available_bytes

    device = str(loaded.model.device)
    need = kv_buffer_bytes(config.spec, loaded.manifest["kv_bytes_per_token"], config.batch_size,
                           max(prompt_lengths, default=1), config.max_new_tokens, loaded.manifest["n_kv_heads"])
    # Storage comes in whole blocks: at least one per sample (--block-size 10**9 asked for terabytes).
    one_block = config.batch_size * GROWTH_SLACK * config.spec.block_size * loaded.manifest["kv_bytes_per_token"]
    need = {**need, "hbm": max(need["hbm"], one_block)}
    free = available_bytes(device)
    if "GPU memory" in free:  # HBM buffers on the GPU, the DDR tier in (pinned) host RAM
        checks = [("GPU memory", need["hbm"]), ("host RAM", need["ddr"])]
    else:  # a CPU run holds both tiers in host RAM
        checks = [("host RAM", need["hbm"] + need["ddr"])]
    for where, needed in checks:
        if needed > free[where]:
            raise BadTraceConfig(
                f"--batch-size {config.batch_size}: the KV buffers need ~{needed / 2**30:.1f} GiB of {where} "
                f"({need['hbm_per_sample'] / 2**20:.0f} MiB per sample in HBM up to {need['max_len']} tokens, "
                f"x{GROWTH_SLACK} growth slack{', + the DDR tier' if need['ddr'] else ''}) but "
                f"{free[where] / 2**30:.1f} GiB is free; use a smaller --batch-size or --block-size, --dtype bfloat16, a smaller "
                "--hbm-budget or --max-new-tokens"
            )
    return need


def hardware_manifest(device) -> dict:
    import torch
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    from traces.host import host_facts

    return {
        "device": f"{device.type}: {name}",
        "host_facts": host_facts(),  # which machine the timings are from (traces/host.py)
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }


def make_settings(config: TraceConfig, scorer=None, track_importance: bool = True):
    from tracer.cache import TierSettings
    from tracer.scorers import build_scorer, parse_also_score, with_also_score

    if scorer is None:
        options = {"seed": config.seed, "grad_window": config.grad_window, "grad_interval": config.grad_interval}
        primary = build_scorer(config.scorer, **options)
        # Under the full policy nothing is placed, so only the --also-score extras need scoring.
        extras = parse_also_score(config.also_score)
        scorer = with_also_score(None if config.policy == "full" and extras else primary, extras, **options)
    return TierSettings(spec=config.spec, scorer=scorer, track_importance=track_importance)


class TraceLockedError(UserError):
    pass


@contextmanager
def out_lock(out: Path):
    """Hold an exclusive lock on the run directory while tracing into it, so that a second `thoughtkv trace` on
    the same --out exits 2 at once instead of decoding every sample beside the first. The lock is flock on the
    directory itself (a lock file would make a fresh --out a non-empty directory that is not a trace run); the
    kernel drops it when the process ends, however it ends. Directories made here and left empty (a refusal
    before run.json is written) are removed again."""
    import fcntl
    import os

    created = [p for p in [out, *out.parents] if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    handle = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TraceLockedError(f"--out {out}: another `thoughtkv trace` is writing this run now; wait for it to "
                                   "finish (rerun then to resume or extend it) or choose another --out") from None
        yield
    finally:
        os.close(handle)  # releases the lock
        for directory in created:  # innermost first
            try:
                directory.rmdir()  # only if still empty
            except OSError:
                break


def run_trace(config: TraceConfig, progress: bool = True, loaded=None) -> Path:
    """Trace `config.n_samples` samples into `config.out`; samples already committed there are skipped."""
    from tracer.models import load_model
    from tracer.preflight import apply_threads, resolve_device, resolve_threads
    from tracer.tasks import get_task

    config.validate()
    threads = resolve_threads(resolve_device(config.device), config.threads)
    apply_threads(threads)
    task = get_task(config.task)
    samples = task.load(config.n_samples, config.data_file, config.seed)
    if len(samples) < config.n_samples:
        print(f"note: task {task.name} has {len(samples):,} problems; tracing those {len(samples):,}, "
              f"not --n-samples {config.n_samples:,}", file=sys.stderr)
    with out_lock(Path(config.out)):  # a second trace on this --out refuses here, before loading anything
        loaded = loaded or load_model(config.model, config.device, config.dtype, seed=config.seed)
        return _trace_locked(config, task, samples, loaded, threads, progress)


def _trace_locked(config: TraceConfig, task, samples, loaded, threads: int, progress: bool) -> Path:
    """run_trace's work, with the run directory locked: the preflight checks that need the model, then the decode."""
    from tqdm.auto import tqdm

    from tracer.decode import frozen_heap
    from tracer.model_defaults import describe
    from tracer.tasks import prompt_manifest
    from traces import TraceWriter, WriteBehind, make_manifest
    from traces.host import load_average, usable_cpus

    spec = config.spec
    tracer_extra = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("out",)}
    # The shortest and longest lengths a sample can have: the sink and window are a larger share at the first.
    prompt_lengths = prompt_token_counts(loaded, task, samples)
    check_context(config, loaded, prompt_lengths, [s.sample_id for s in samples])
    excess = protected_excess_note(spec, [*prompt_lengths, *(n + config.max_new_tokens for n in prompt_lengths)])
    if excess is not None:
        print(f"warning: {excess['warning']}", file=sys.stderr)
        tracer_extra["protected_excess"] = excess
    no_recall = recall_rounding_note(spec, [(p, config.max_new_tokens) for p in prompt_lengths])
    if no_recall is not None:
        print(f"warning: {no_recall['warning']}", file=sys.stderr)
        tracer_extra["recall_rounds_to_zero"] = no_recall
    tracer_extra["kv_buffer_bytes"] = check_kv_fits(config, loaded, prompt_lengths)
    references = None
    if config.fidelity_reference is not None:
        from tracer.fidelity import load_references

        references = load_references(config.fidelity_reference, loaded.manifest, task.name, config.max_new_tokens,
                                     [s.sample_id for s in samples])
    if spec.uses_ddr:  # which rule recalled, and whether its copies are decided before their layer runs (every
        # copy of a rule that reads nothing of the layer's current query can be prefetched: bytes_h2d, all of it)
        from tracer.cache.recall_rules import RECALL_RULES

        tracer_extra["recall"] = {"rule": spec.recall_rule, "prefetchable": not RECALL_RULES[spec.recall_rule].uses_query}
    note = describe(config.from_model, config.model)  # after the refusals: those stay one line
    if note is not None:
        print(note, file=sys.stderr)
    from tracer.decode import step_clock

    # How it measured and moved (a dict: notes, not options, so `traces validate`'s repair command skips them):
    # measured_step_us's clock (thread_cpu on a 1-thread CPU, as calibrate times; else wall), and the transfer
    # mechanism in simulator/mechanisms.py's names (one copy per block group, per layer, step and direction).
    tracer_extra["measurement"] = {"step_clock": step_clock(loaded.model.device)[0], "transfer": "dma-per-block"}
    prompt_record, prompt_warning = prompt_manifest(task, loaded.tokenizer)
    if prompt_warning is not None:
        print(f"warning: {prompt_warning}", file=sys.stderr)
    manifest = make_manifest(
        kind="traced",
        model=loaded.manifest,
        task={"name": task.name, "source": config.data_file or task.source, "split": task.split,
              "sample_ids": [s.sample_id for s in samples], "prompt": prompt_record},
        policy=spec.to_manifest(),
        hardware=hardware_manifest(loaded.model.device),
        seed=config.seed,
        access=config.access,
        extra={"tracer": tracer_extra},
    )
    writer = TraceWriter(config.out, manifest, resume=True)
    todo = [s for s in samples if s.sample_id not in writer.done_sample_ids()]
    if len(todo) < len(samples) and progress:
        print(f"resuming {config.out}: {len(samples) - len(todo)} of {len(samples)} samples already done")
    # Threads and load at start and end of each invocation: timings mean little without them.
    writer.begin_session({"threads": threads, "cpus": usable_cpus(), "load_avg_1m_start": load_average(),
                          "samples_already_done": len(samples) - len(todo)})
    bar = tqdm(samples, desc=f"trace {config.policy}", unit="sample", disable=not progress,
               initial=len(samples) - len(todo), total=len(samples))
    # Each sample commits as it finishes (resume-safe); its tables are built here, between decode steps, and on a
    # GPU written, compressed and fsynced on a thread while the next steps decode (traces.WriteBehind).
    behind = WriteBehind(writer, background=loaded.model.device.type == "cuda")
    with frozen_heap(), behind:  # (frozen: the collector's full passes skip the model's objects)
        for row, steps, tokens, access in trace_samples(loaded, task, todo, config, progress=progress,
                                                        references=references):
            behind.submit(row, steps, tokens, access)
            bar.update(1)
            bar.set_postfix(tokens=row["generated_tokens"], stop=row["stop_reason"])
    bar.close()
    writer.end_session({"load_avg_1m_end": load_average(), "samples_traced": len(todo)})
    return Path(config.out)


def trace_sample(loaded, task, sample, config: TraceConfig, progress: bool = False):
    """Decode one sample (an oracle run first does a full-cache pass); returns the four trace parts."""
    [parts] = list(trace_samples(loaded, task, [sample], dataclasses.replace(config, batch_size=1), progress))
    return parts


def trace_samples(loaded, task, samples, config: TraceConfig, progress: bool = False, references=None):
    """Decode `samples` `config.batch_size` at a time (tracer.decode.decode_batch); yields each sample's four
    trace parts as it finishes (completion order). With `references` (sample id -> tracer.fidelity.ReferenceChain)
    each sample is also decoded teacher-forced on its reference chain and on its human-written solution, in the
    same batch stream, and its row gets the fidelity columns once all three are done."""
    from tqdm.auto import tqdm

    from tracer.cache import TieredCache
    from tracer.decode import decode_batch, eos_token_ids, use_tiered_attention

    model = loaded.model
    use_tiered_attention(model)
    eos_ids = eos_token_ids(model, loaded.tokenizer)
    if references is None:
        jobs = (prepare_job(loaded, task, sample, config) for sample in samples)
    else:
        jobs = (job for sample in samples for job in fidelity_jobs(loaded, task, sample, config, references))
    first = TieredCache(model.config.num_hidden_layers, make_settings(config))
    # No more rows than jobs (fewer pools; and a step of every row places its layers together, tracer/cache/step.py)
    per_sample = 1 if references is None else 3
    batch_size = min(config.batch_size, per_sample * len(samples)) if hasattr(samples, "__len__") else config.batch_size
    waiting: dict[str, dict] = {}  # fidelity: a sample's finished jobs, by kind, until all are done
    with tqdm(desc="decode", unit="tok", leave=False, disable=not progress) as bar:
        for job, result in decode_batch(model, jobs, first, max(1, batch_size), config.max_new_tokens, eos_ids, bar,
                                        prefill_chunk_tokens=config.prefill_chunk_tokens):
            if references is None:
                yield sample_parts(loaded, task, job, result)
                continue
            kind, sample, expected = job.key
            done = waiting.setdefault(sample.sample_id, {})
            done[kind] = (job, sample_parts(loaded, task, job, result) if kind == "free" else None)
            if len(done) == expected:
                del waiting[sample.sample_id]
                yield fidelity_parts(references[sample.sample_id], done)


def fidelity_jobs(loaded, task, sample, config: TraceConfig, references) -> list:
    """A sample's jobs under --fidelity-reference: its free-running trace (recorded as every run's), then the
    same policy teacher-forced on the reference chain and on the human-written solution (when the task has
    one), each scored against the full cache's log-probabilities from a dense forward (tracer/fidelity.py).
    Each job's key is (kind, sample, jobs of this sample)."""
    from tracer.decode import DecodeJob
    from tracer.fidelity import FidelityReferenceError, ForcedScore, dense_log_probs, human_solution

    free = prepare_job(loaded, task, sample, config)
    reference = references[sample.sample_id]
    if tuple(free.prompt_ids) != reference.prompt_ids:
        raise FidelityReferenceError(f"--fidelity-reference: sample {sample.sample_id}'s prompt tokens differ from "
                                     "the reference run's (another tokenizer, template or instruction); trace the "
                                     "reference again with this thoughtkv and model")
    forced = {"chain": list(reference.generated_ids)}
    solution = human_solution(sample)
    if solution:
        ids = list(loaded.tokenizer.encode(solution, add_special_tokens=False))[: config.max_new_tokens - 1]
        eos = getattr(loaded.tokenizer, "eos_token_id", None)
        forced["human"] = ids + ([eos] if eos is not None else [])
    jobs = [free]
    for ids in forced.values():
        score = ForcedScore(ids, dense_log_probs(loaded.model, free.prompt_ids + ids, len(free.prompt_ids),
                                                 fidelity_cache()))
        jobs.append(DecodeJob(None, free.prompt_ids, make_settings(config), None, forced_ids=ids, on_logits=score))
    expected = len(jobs)
    for job, kind in zip(jobs, ("free", *forced)):
        job.key = (kind, sample, expected)
    return jobs


def fidelity_cache() -> Path:
    """Where the full cache's hidden states along reference chains are kept between fidelity runs."""
    from tracer.packaged import cache_root

    return cache_root() / "fidelity"


def fidelity_parts(reference, done: dict):
    """A sample's four trace parts (its free-running ones) with the fidelity columns added to its row."""
    from tracer.fidelity import sample_columns

    free_job, (row, steps, tokens, access) = done["free"]
    human = done["human"][0].on_logits if "human" in done else None
    generated = list(tokens["token_id"][row["prompt_tokens"]:])
    row = {**row, **sample_columns(reference, [int(t) for t in generated], row["predicted"], done["chain"][0].on_logits,
                                   human)}
    return row, steps, tokens, access


def prepare_job(loaded, task, sample, config: TraceConfig):
    """The sample's prompt ids, its own settings (scorer state is per sample) and recorder; the oracle scorer's
    full-cache teacher pass runs here, before the sample is admitted."""
    from tracer.cache import TieredCache
    from tracer.decode import DecodeJob, encode_prompt, eos_token_ids, greedy_decode
    from tracer.recorder import Recorder

    model = loaded.model
    prompt_ids = encode_prompt(loaded.tokenizer, sample.prompt, task.use_chat_template)
    settings = make_settings(config)
    if config.scorer == "oracle" and config.policy != "full":
        teacher_config = dataclasses.replace(config, policy="full", ddr_dtype="same")
        teacher = TieredCache(model.config.num_hidden_layers, make_settings(teacher_config, scorer=settings.scorer))
        greedy_decode(model, prompt_ids, teacher, config.max_new_tokens, eos_token_ids(model, loaded.tokenizer))
        settings.scorer.future_importance = [layer.importance[: layer.logical_len].clone() for layer in teacher.layers]
    return DecodeJob(sample, prompt_ids, settings, Recorder(record_access=config.access))


def sample_parts(loaded, task, job, result):
    """(samples row, steps, tokens, access) of one decoded sample."""
    from tracer.decode import tokens_table
    from tracer.tasks import grading_columns

    tokenizer, prompt_ids = loaded.tokenizer, job.prompt_ids
    sample = job.key[1] if isinstance(job.key, tuple) else job.key  # (a fidelity job's key: kind, sample, n)
    settings, recorder = job.settings, job.recorder
    n_layers = loaded.model.config.num_hidden_layers
    text = tokenizer.decode(result.generated_ids, skip_special_tokens=True)
    scored = not loaded.random_weights
    row = {
        "sample_id": sample.sample_id,
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": len(result.generated_ids),
        "stop_reason": result.stop_reason,
        "gold": sample.gold,
        **grading_columns(task, text, sample.gold, scored),  # predicted, correct, grader, answered_after_think
        "wall_s": result.wall_s,
        "nonfinite": result.stop_reason == "nonfinite",
        "generated_text": text,
    }
    tokens = tokens_table(result)
    if hasattr(settings.scorer, "importance_by_scorer"):  # --also-score (tracer/scorers/)
        tokens["importance_by_scorer"] = settings.scorer.importance_by_scorer(len(tokens["position"]), n_layers)
    return row, recorder.steps_table(), tokens, recorder.access_table()
