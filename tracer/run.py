"""`run_trace(config)`: decode a task's samples with a tiered KV cache and write a trace v1 run (resumable).

The Python API behind `thoughtkv trace`; demo/crosscheck/sweep code calls it without a subprocess.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from thoughtkv_base import UserError
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
    # `spec` below builds and validates the spec from them).
    policy: str = _POLICY_DEFAULTS.policy
    hbm_budget: str | float = _POLICY_DEFAULTS.hbm_budget
    evict_ratio: float = _POLICY_DEFAULTS.evict_ratio
    block_size: int = _POLICY_DEFAULTS.block_size
    scorer: str = _POLICY_DEFAULTS.scorer
    recall_k: int = _POLICY_DEFAULTS.recall_k
    recall_budget: str | float | None = _POLICY_DEFAULTS.recall_budget
    recall_rule: str = _POLICY_DEFAULTS.recall_rule  # the tracer runs traces.policy.TRACER_RECALL_RULES
    batch_size: int = 1  # samples decoded per step (continuous refill; per-sample results as at batch 1)
    max_new_tokens: int = 256
    prefill_chunk_tokens: int | None = 2048  # a longer prompt is prefilled in chunks of this many tokens
    sink_tokens: int = _POLICY_DEFAULTS.sink_tokens
    window_tokens: int = _POLICY_DEFAULTS.window_tokens
    promote: bool = _POLICY_DEFAULTS.promote
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    access: bool = True
    # Issue 9 (tracer/quant.py, tracer/scorers/):
    ddr_dtype: str = _POLICY_DEFAULTS.ddr_dtype  # hierarchy: DDR stores offloaded blocks as same | int8 | int4
    also_score: str | None = None  # "A,B": scorers computed alongside, recorded in tokens.importance_by_scorer
    grad_window: int = 1  # gradient scorer: next-token losses of the last N positions
    grad_interval: int = 1  # gradient scorer: one backward pass every N decode steps
    threads: int | None = None  # torch intra-op threads; None: tracer.preflight.resolve_threads's default
    command: list[str] | None = None  # the `thoughtkv trace` argv, when the CLI made this config (repair command)

    @property
    def spec(self):
        """The placement settings as the one policy contract (traces/policy.py validates them on construction)."""
        from traces.policy import PolicySpec

        return PolicySpec(
            policy=self.policy, hbm_budget=self.hbm_budget, evict_ratio=self.evict_ratio, block_size=self.block_size,
            sink_tokens=self.sink_tokens, window_tokens=self.window_tokens, recall_k=self.recall_k,
            recall_budget=self.recall_budget, recall_rule=self.recall_rule, scorer=self.scorer,
            promote=self.promote, ddr_dtype=self.ddr_dtype,
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
    at prefill, plus the recall staging slots: per KV head under quest-per-head) and `ddr` (host, hierarchy),
    for `batch_size` samples at once."""
    from traces.policy import max_recall_blocks, n_blocks, peak_hbm_tokens

    bs, max_len = spec.block_size, max_prompt + max_new_tokens
    resident, staging = peak_hbm_tokens(spec, max_prompt, max_len), max_recall_blocks(spec, max_len, n_kv_heads) * bs
    per_sample_hbm = GROWTH_SLACK * (resident + staging) * kv_bytes_per_token
    per_sample_ddr = GROWTH_SLACK * n_blocks(spec, max_len) * bs * kv_bytes_per_token if spec.uses_ddr else 0
    return {"hbm": batch_size * per_sample_hbm, "ddr": batch_size * per_sample_ddr,
            "hbm_per_sample": per_sample_hbm, "max_len": max_len}


def check_context(config: TraceConfig, loaded, longest_prompt: int) -> None:
    """Warn when a sample may decode past the model's context (positions it was never trained on)."""
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    if context and longest_prompt + config.max_new_tokens > context:
        print(f"warning: --max-new-tokens {config.max_new_tokens:,} with the longest prompt ({longest_prompt:,} tokens) "
              f"may pass {config.model}'s context of {context:,} tokens; positions beyond it were never trained",
              file=sys.stderr)


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


def run_trace(config: TraceConfig, progress: bool = True, loaded=None) -> Path:
    """Trace `config.n_samples` samples into `config.out`; samples already committed there are skipped."""
    from tqdm.auto import tqdm

    from tracer.decode import encode_prompt, frozen_heap
    from tracer.models import load_model
    from tracer.preflight import apply_threads, resolve_device, resolve_threads
    from tracer.tasks import get_task, prompt_manifest
    from traces import TraceWriter, WriteBehind, make_manifest
    from traces.host import load_average, usable_cpus

    config.validate()
    threads = resolve_threads(resolve_device(config.device), config.threads)
    apply_threads(threads)
    task = get_task(config.task)
    samples = task.load(config.n_samples, config.data_file, config.seed)
    if len(samples) < config.n_samples:
        print(f"note: task {task.name} has {len(samples):,} problems; tracing those {len(samples):,}, "
              f"not --n-samples {config.n_samples:,}", file=sys.stderr)
    loaded = loaded or load_model(config.model, config.device, config.dtype, seed=config.seed)
    spec = config.spec
    tracer_extra = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("out",)}
    # The shortest and longest lengths a sample can have: the sink and window are a larger share at the first.
    prompt_lengths = [len(encode_prompt(loaded.tokenizer, s.prompt, task.use_chat_template)) for s in samples]
    check_context(config, loaded, max(prompt_lengths, default=0))
    excess = protected_excess_note(spec, [*prompt_lengths, *(n + config.max_new_tokens for n in prompt_lengths)])
    if excess is not None:
        print(f"warning: {excess['warning']}", file=sys.stderr)
        tracer_extra["protected_excess"] = excess
    tracer_extra["kv_buffer_bytes"] = check_kv_fits(config, loaded, prompt_lengths)
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
    # Threads and load at start and end of each invocation: timings mean little without them (issue 16).
    writer.begin_session({"threads": threads, "cpus": usable_cpus(), "load_avg_1m_start": load_average(),
                          "samples_already_done": len(samples) - len(todo)})
    bar = tqdm(samples, desc=f"trace {config.policy}", unit="sample", disable=not progress,
               initial=len(samples) - len(todo), total=len(samples))
    # Each sample commits as it finishes (resume-safe); its tables are built here, between decode steps, and on a
    # GPU written, compressed and fsynced on a thread while the next steps decode (traces.WriteBehind).
    behind = WriteBehind(writer, background=loaded.model.device.type == "cuda")
    with frozen_heap(), behind:  # (frozen: the collector's full passes skip the model's objects)
        for row, steps, tokens, access in trace_samples(loaded, task, todo, config, progress=progress):
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


def trace_samples(loaded, task, samples, config: TraceConfig, progress: bool = False):
    """Decode `samples` `config.batch_size` at a time (tracer.decode.decode_batch); yields each sample's four
    trace parts as it finishes (completion order)."""
    from tqdm.auto import tqdm

    from tracer.cache import TieredCache
    from tracer.decode import decode_batch, eos_token_ids, use_tiered_attention

    model = loaded.model
    use_tiered_attention(model)
    eos_ids = eos_token_ids(model, loaded.tokenizer)
    jobs = (prepare_job(loaded, task, sample, config) for sample in samples)
    first = TieredCache(model.config.num_hidden_layers, make_settings(config))
    # No more rows than samples (fewer pools; and a step of every row places its layers together, tracer/cache/step.py)
    batch_size = min(config.batch_size, len(samples)) if hasattr(samples, "__len__") else config.batch_size
    with tqdm(desc="decode", unit="tok", leave=False, disable=not progress) as bar:
        for job, result in decode_batch(model, jobs, first, max(1, batch_size), config.max_new_tokens, eos_ids, bar,
                                        prefill_chunk_tokens=config.prefill_chunk_tokens):
            yield sample_parts(loaded, task, job, result)


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

    tokenizer, sample, prompt_ids = loaded.tokenizer, job.key, job.prompt_ids
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
