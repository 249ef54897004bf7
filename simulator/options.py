"""How a run is simulated, as one frozen object: `SimOptions` (overlap, async offload, batch, engine, offload
tier, transfer mechanism), validated once on construction; on which model's shapes (`Projection`: --as-model,
--as-dtype, --context-scale, --recalls, shared by simulate, serve-sim and grids); and how it is served
(`ServingConfig`: arrivals, request lengths, batching, admission and preemption, SLOs, with a SimOptions and a
Projection embedded whole).
No heavy imports: `thoughtkv --help` builds flags from here.

    from simulator.options import SimOptions
    options = SimOptions(overlap="layer-prefetch", async_offload=False)
    simulate_run("runs/r1", "h200-sxm", options)          # also embedded whole in ServingConfig and sweep cells

Every command spells an option the same way because its flag is generated from the field
(`add_arguments`: `async_offload` -> `--async-offload` / `--no-async-offload`) and sweep grids use the field
name as their key; the default and the check live here only. The same two helpers generate the flags of any
other options dataclass built like this one (ServingConfig below): a field's `metadata["help"]` is its help
text, `metadata["choices"]` its allowed values, `metadata["type"]` the parser of its flag when the default
does not say (None).

Adding an option: one field here with its help (and a check in `__post_init__`); simulate, serve-sim,
crosscheck and grids then accept it. Fields with `metadata["key"] = False` (the engine: auto / des / fast
give the same numbers) are not result columns and not part of a result's identity (`KEY_FIELDS`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

from simulator.errors import OptionError
from thoughtkv_base import UserError, check_seed
from thoughtkv_base.options import add_flags, dataclass_flags

OVERLAP_MODES = ("none", "layer-prefetch")
# Far beyond any study here (a 7B hierarchy at 20 req/s for 600 s is 12,000 requests), far below a hang.
MAX_BATCH = 1 << 16
MAX_REQUESTS = 10_000_000
OVERHEAD_MODES = ("measured", "kernel-only", "hf-eager", "cuda-graphs")  # hwprofiles.overhead_modes (a test keeps them equal)
ENGINES = ("auto", "des", "fast")
# How KV blocks cross the host link: the names of simulator.mechanisms.MECHANISMS (not imported here, to keep
# `thoughtkv --help` light; tests/test_mechanisms.py keeps the two equal).
TRANSFERS = ("dma-per-block", "dma-batched", "sm-copy", "zero-copy", "cpu-attention")
RECALL_MODES = ("share", "count")  # --recalls under a --context-scale (simulator/project.py)
# The request-length models of simulator.lengths.LENGTH_MODELS (names only, for the same reason; a test keeps
# them equal).
LENGTH_MODELS = ("r1-7b/gsm8k", "r1-7b/math-500", "r1-7b/aime")
# The TTFT bound of serving's SLO (goodput, SLO attainment, capacity's sustainable rate): without one, an
# overloaded server whose admission caps the batch keeps its TBT while its queue grows without bound.
DEFAULT_TTFT_SLO_S = 10.0
ADMISSIONS = ("paged", "peak")  # serve-sim's KV admission (simulator/admission.py)
PREEMPTIONS = ("recompute", "swap")
# vLLM's default per-iteration token budget (EngineArgs.get_batch_defaults, OpenAI API server context): 8,192 on a
# GPU with >= 70 GiB that is not an A100 (H100, H200, GH200, MI300X, B200), else 2,048.
BATCHED_TOKENS_LARGE, BATCHED_TOKENS_SMALL, BATCHED_TOKENS_MEMORY_BYTES = 8192, 2048, 70 * 2**30


@dataclass(frozen=True)
class SimOptions:
    flag_group: ClassVar[str] = "projection"  # the --help section of its flags (thoughtkv_base.options.GROUPS)
    overlap: str = field(default="none", metadata={
        "help": "none: recall, then compute; layer-prefetch: the recall for layer l+1 runs during layer l "
                "(needs a recall rule known before the layer runs: traces.policy.PREFETCHABLE_RECALL_RULES, "
                "score, prev-layer, prev-step and their per-head forms)", "choices": OVERLAP_MODES})
    async_offload: bool = field(default=True, metadata={
        "help": "offloads overlap with later compute; --no-async-offload: the sequence waits for each offload"})
    batch: int = field(default=1, metadata={"help": "decode N copies of each sequence in lockstep (simulate only)"})
    engine: str = field(default="auto", metadata={
        "help": "auto: the closed-form fast path where it is exact, else the SimPy DES", "choices": ENGINES,
        "key": False})
    offload_tier: str = field(default="ddr", metadata={
        "help": "where offloaded KV lives: ddr (host memory) or a profile's extra tier (e.g. cxl-expander)",
        "metavar": "TIER"})
    transfer: str = field(default="dma-per-block", metadata={
        "help": "how KV blocks cross the link: dma-per-block (one copy per sequence and layer-step), dma-batched "
                "(one call per layer-step for the batch), sm-copy (a copy kernel on a few SMs), zero-copy (attention "
                "reads host memory), cpu-attention (the host attends the offloaded blocks); simulator/README.md",
        "choices": TRANSFERS})

    overhead_mode: str | None = field(default=None, metadata={
        "help": "framework overheads charged: measured (calibrated), kernel-only (none: kernels and copies only), "
                "hf-eager (a transformers eager loop: the host issues every op, a step costs max(host, GPU)), "
                "cuda-graphs (a captured step: one launch, the GPU at the bandwidth such engines reach); "
                "hwprofiles/overhead_modes.py, simulator/README.md", "type": str, "choices": OVERHEAD_MODES,
        "default_text": "the profile's own: measured for a calibrated profile, kernel-only for a datasheet one"})
    host_term: str | None = field(default=None, metadata={
        "help": "the host's cost per eager op (hf-eager, cuda-graphs): cited (from published measured runs, "
                "hwprofiles/overheads/hf-eager.yaml) or the name of a measured profile whose `thoughtkv calibrate` "
                "timed this host (e.g. measured-cpu); ignored by kernel-only and measured", "type": str,
        "metavar": "TERM", "default_text": "cited"})

    recall_buffer_blocks: int | None = field(default=None, metadata={
        "help": "replay the trace's recalls through a per-(sequence, layer) LRU of N recalled blocks kept in HBM: a "
                "block it holds costs no copy, and its HBM counts against capacity (0: no buffer, every recalled "
                "block copied; simulator/recall_buffer.py)", "type": int, "metavar": "N",
        "default_text": "as traced: the run's own --recall-buffer-blocks, or none"})

    def __post_init__(self) -> None:
        if self.recall_buffer_blocks is not None and (not _is_whole(self.recall_buffer_blocks)
                                                      or not 0 <= self.recall_buffer_blocks < 2**31):
            raise OptionError(f"recall_buffer_blocks must be a whole number >= 0 or unset, got "
                              f"{self.recall_buffer_blocks!r} (--recall-buffer-blocks)")
        if self.overhead_mode is not None and self.overhead_mode not in OVERHEAD_MODES:
            raise OptionError(f"overhead_mode {self.overhead_mode!r} is unknown; use one of {', '.join(OVERHEAD_MODES)}")
        if self.host_term is not None and (not isinstance(self.host_term, str) or not self.host_term.strip()):
            raise OptionError(f"host_term must be cited or a measured profile's name, got {self.host_term!r} "
                              "(--host-term)")
        _choice(self, "overlap")
        _choice(self, "engine")
        _choice(self, "transfer")
        if not isinstance(self.async_offload, bool):
            raise OptionError(f"async_offload must be true or false, got {self.async_offload!r} (--async-offload / "
                              "--no-async-offload)")
        if not _is_whole(self.batch) or self.batch < 1:
            raise OptionError(f"batch must be a positive integer, got {self.batch!r} (--batch: sequences "
                              "decoded in lockstep)")
        if self.batch > MAX_BATCH:  # the DES issues every copy of every sequence: this would not finish
            raise OptionError(f"batch {self.batch} is more than {MAX_BATCH:,} sequences in lockstep (--batch); "
                              "for capacity at scale read max_concurrency_* or use serve-sim")
        if not isinstance(self.offload_tier, str) or not self.offload_tier.strip():
            raise OptionError(f"offload_tier must be a tier name such as ddr, got {self.offload_tier!r} "
                              "(--offload-tier)")


@dataclass(frozen=True)
class Projection:
    """`--as-model ARCH [--as-dtype D] [--context-scale X] [--recalls share|count]`: a run's access pattern
    replayed on another architecture's shapes (simulator/project.py does the arithmetic). One home for simulate,
    serve-sim and sweep grids: their flags and grid keys are generated from these fields, checked here once.
    `Projection()` (no --as-model) is no projection: the run's own shapes."""
    flag_group: ClassVar[str] = "projection"  # the --help section of its flags (thoughtkv_base.options.GROUPS)

    as_model: str | None = field(default=None, metadata={
        "help": "replay the run's access pattern on another architecture of traces.architectures, e.g. qwen2-7b "
                "(results are 'projected'; simulator/README.md)", "type": str, "metavar": "ARCH",
        "default_text": "the run's own"})
    as_dtype: str = field(default="bfloat16", metadata={"help": "with --as-model: its weight and KV dtype",
                                                        "metavar": "DTYPE"})
    context_scale: float = field(default=1.0, metadata={
        "help": "with --as-model: scale every logical length (and the prompt) by this factor", "metavar": "X"})
    recalls: str = field(default="share", metadata={
        "help": "with --context-scale: recalled tokens keep their share of the context (share) or their traced "
                "count (count: a fixed recall_k)", "choices": RECALL_MODES})

    def __post_init__(self) -> None:
        from simulator.errors import ProjectionError

        if self.as_model is None:
            if self.as_dtype != "bfloat16" or self.context_scale != 1.0 or self.recalls != "share":
                raise ProjectionError("--as-dtype, --context-scale and --recalls go with --as-model ARCH; add it or "
                                      "drop them")
            return
        from traces.architectures import ARCHITECTURES, DTYPE_BYTES

        if self.as_model not in ARCHITECTURES:
            raise ProjectionError(f"--as-model {self.as_model!r} is not a known architecture; use one of "
                                  f"{', '.join(ARCHITECTURES)}")
        if self.as_dtype not in DTYPE_BYTES:
            raise ProjectionError(f"--as-dtype {self.as_dtype!r} is unknown; use one of {', '.join(DTYPE_BYTES)}")
        if self.recalls not in RECALL_MODES:
            raise ProjectionError(f"--recalls {self.recalls!r} is unknown; use one of {', '.join(RECALL_MODES)}")
        if not is_positive_number(self.context_scale):
            raise ProjectionError(f"--context-scale {self.context_scale!r} must be a number > 0 (1 keeps the "
                                  "traced lengths)")

    @property
    def active(self) -> bool:
        return self.as_model is not None

    @property
    def shape(self):
        """The cost model's shape of the target architecture (simulator.costs.ModelShape)."""
        from simulator.project import target_shape

        return target_shape(self.as_model, self.as_dtype)

    def apply(self, arrays, source, lengths: tuple[int, int] | None = None):
        """One sample's step arrays on the source shape -> the same access pattern on the target's
        (project.project_arrays; `lengths` = (prompt, output) tokens: the steps resampled to those lengths)."""
        from simulator.project import project_arrays

        return project_arrays(arrays, source, self.shape, self.context_scale, self.recalls, lengths=lengths)

    def label(self, source_label: str) -> str:
        scale = f", context x{self.context_scale:g}" if self.context_scale != 1 else ""
        if self.context_scale != 1 and self.recalls == "count":
            scale += ", recalls by count"
        return f"{source_label} [as {self.as_model} {self.as_dtype}{scale}]"


@dataclass(frozen=True)
class ServingConfig:
    """Everything a serving simulation is asked, validated once; `thoughtkv serve-sim`'s flags and the serve
    grid keys are generated from these fields (options.add_arguments), the simulator options embedded whole."""
    flag_group: ClassVar[str] = "serving"  # the --help section of its flags (thoughtkv_base.options.GROUPS)

    rate_per_s: float = field(default=1.0, metadata={"help": "Poisson arrivals per second (unused with --arrivals-csv)",
                                                     "metavar": "R"})
    duration_s: float = field(default=60.0, metadata={"help": "Poisson arrivals happen in [0, S); the run then "
                                                              "drains", "metavar": "S"})
    max_batch: int = field(default=64, metadata={"help": "most requests in one decode iteration", "metavar": "N"})
    tbt_slo_s: float = field(default=0.1, metadata={"help": "goodput: a request is good if its mean time between "
                                                            "tokens is at most this many seconds", "metavar": "S"})
    ttft_slo_s: float | None = field(default=DEFAULT_TTFT_SLO_S, metadata={
        "help": "goodput and SLO attainment: ... and its time to first token at most this many seconds (a queue "
                "bound: an overloaded server's TBT can stay low while its queue, and so TTFT, grows; capacity's "
                "sustainable rate needs it too)", "type": float, "metavar": "S"})
    seed: int = field(default=0, metadata={"help": "seed of the Poisson arrivals and of the sample each request "
                                                   "replays"})
    arrivals_csv: str | None = field(default=None, metadata={
        "help": "arrival trace instead of Poisson arrivals: a CSV with columns arrival_s,prompt_tokens,"
                "output_tokens (seconds), or the Azure LLM trace's TIMESTAMP,ContextTokens,GeneratedTokens; each "
                "request replays the traced sample nearest in length, resampled to the CSV's prompt and output "
                "tokens (as --lengths resamples; simulator/lengths.py)", "type": str, "metavar": "CSV"})
    lengths: str | None = field(default=None, metadata={
        "help": "draw each Poisson request's prompt and output tokens from a cited length model of R1-distill "
                "reasoning (simulator/lengths.py); each request replays a traced sample resampled to its length",
        "type": str, "choices": LENGTH_MODELS, "default_text": "the traced lengths"})
    batch_copies: bool = field(default=False, metadata={
        "help": "one copy per operation for the whole batch (a gather kernel, one overhead) instead of one per "
                "request"})
    admission: str = field(default="paged", metadata={
        "help": "paged: KV blocks are allocated as each request grows and, when an iteration's do not fit, the "
                "most recently admitted request is preempted (vLLM); peak: a request is admitted only when its "
                "peak KV fits and is never preempted", "choices": ADMISSIONS})
    preempt: str = field(default="recompute", metadata={
        "help": "with --admission paged, what a preempted request loses: recompute (its KV is dropped and "
                "prefilled again, prompt + generated tokens, when it resumes: vLLM's default) or swap (its blocks "
                "move to host DDR over the link and back when it resumes)", "choices": PREEMPTIONS})
    max_batched_tokens: int | None = field(default=None, metadata={
        "help": "tokens one iteration computes (vLLM's max_num_batched_tokens): each decode takes 1, prefills "
                "are chunked to what is left (decodes first, then prefill chunks); at least --max-batch",
        "type": int, "metavar": "N",
        "default_text": "vLLM's for the GPU: 8192 with >= 70 GiB of HBM and not an A100, else 2048 (raised to "
                        "--max-batch when below it)"})
    options: SimOptions = field(default_factory=SimOptions)  # overlap, async offload, offload tier, transfer
    projection: Projection = field(default_factory=Projection)  # --as-model, --as-dtype, --context-scale, --recalls

    def __post_init__(self) -> None:
        for name, what in (("rate_per_s", "requests per second"), ("duration_s", "seconds of arrivals"),
                           ("tbt_slo_s", "seconds between tokens; goodput would be 0")):
            if not is_positive_number(getattr(self, name)):
                raise OptionError(f"{name} must be a finite number > 0 ({what}), got {getattr(self, name)!r} "
                                  f"(--{name.replace('_', '-')})")
        if self.ttft_slo_s is not None and not is_positive_number(self.ttft_slo_s):
            raise OptionError(f"ttft_slo_s must be a finite number > 0 (seconds) or unset, got {self.ttft_slo_s!r} "
                              "(--ttft-slo-s)")
        expected = self.rate_per_s * self.duration_s
        if self.arrivals_csv is None and expected > MAX_REQUESTS:  # every request is simulated one by one
            raise OptionError(f"rate_per_s x duration_s = {expected:.3g} requests, more than {MAX_REQUESTS:,} "
                              "(--rate-per-s, --duration-s); shorten the window or lower the rate")
        value = self.max_batch
        # Below 2**32: C longs end there (10**40 raised OverflowError deep in numpy).
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value >= 2**32:
            raise OptionError(f"max_batch must be a whole number in [1, 2**32), got {value!r} (--max-batch)")
        try:
            check_seed(self.seed)  # the one rule for seeds (thoughtkv_base)
        except UserError as exc:
            raise OptionError(str(exc)) from None
        if not isinstance(self.batch_copies, bool):
            raise OptionError(f"batch_copies must be true or false, got {self.batch_copies!r} (--batch-copies)")
        _choice(self, "admission")
        _choice(self, "preempt")
        tokens = self.max_batched_tokens
        if tokens is not None:
            if not _is_whole(tokens) or tokens < 1 or tokens >= 2**32:
                raise OptionError(f"max_batched_tokens must be a whole number in [1, 2**32) or unset, got {tokens!r} "
                                  "(--max-batched-tokens)")
            if tokens < self.max_batch:
                raise OptionError(f"max_batched_tokens {tokens} is below max_batch {self.max_batch}: every running "
                                  "request decodes a token each iteration (vLLM refuses max_num_batched_tokens < "
                                  "max_num_seqs); raise --max-batched-tokens or lower --max-batch")
        if self.arrivals_csv is not None and (not isinstance(self.arrivals_csv, str) or not self.arrivals_csv):
            raise OptionError(f"arrivals_csv must be a file path, got {self.arrivals_csv!r} (--arrivals-csv)")
        if not isinstance(self.options, SimOptions):
            raise OptionError(f"options must be a SimOptions, got {type(self.options).__name__}")
        if not isinstance(self.projection, Projection):
            raise OptionError(f"projection must be a Projection, got {type(self.projection).__name__}")
        if self.lengths is not None:
            if self.lengths not in LENGTH_MODELS:
                raise OptionError(f"lengths {self.lengths!r} is unknown; use one of {', '.join(LENGTH_MODELS)} "
                                  "(--lengths)")
            if self.arrivals_csv is not None:
                raise OptionError("--lengths draws the lengths of Poisson requests; an --arrivals-csv gives its own: "
                                  "drop one of them")
            if self.projection.context_scale != 1:
                raise OptionError("--lengths sets every request's length; drop --context-scale (it scales the "
                                  "traced lengths)")
        if self.options.batch != 1:  # serving batches requests itself (max_batch)
            raise OptionError(f"batch {self.options.batch} is simulate's lockstep copies; serve-sim batches requests "
                              "itself: use max_batch (--max-batch)")


    def batched_tokens(self, hbm_capacity_bytes: float, gpu_name: str) -> int:
        """The iteration's token budget on a GPU: --max-batched-tokens, or vLLM's default for it (at least
        max_batch)."""
        if self.max_batched_tokens is not None:
            return self.max_batched_tokens
        large = hbm_capacity_bytes >= BATCHED_TOKENS_MEMORY_BYTES and "a100" not in gpu_name.lower()
        return max(BATCHED_TOKENS_LARGE if large else BATCHED_TOKENS_SMALL, self.max_batch)


# The options that tell two results apart (result columns and keys); the engine only says how they were computed.
KEY_FIELDS = tuple(f.name for f in fields(SimOptions) if f.metadata.get("key", True))


def _choice(options, name: str) -> None:
    value, allowed = getattr(options, name), field_metadata(type(options), name)["choices"]
    if value not in allowed:
        raise OptionError(f"{name} {value!r} is unknown; use one of {', '.join(allowed)}")


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_number(value) -> bool:
    """A finite real number > 0 (not a bool, not nan or inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def field_metadata(cls, name: str):
    return next(f.metadata for f in fields(cls) if f.name == name)


# ---------------------------------------------------------------- command-line flags -------------------------


def add_arguments(parser: argparse.ArgumentParser, cls=SimOptions, only: tuple[str, ...] | None = None,
                  exclude: tuple[str, ...] = (), default_note: dict[str, str] | None = None) -> None:
    """One flag per field of the options dataclass `cls` (those in `only`, less `exclude`), made by the options
    layer (thoughtkv_base.options.field_flag). Flags default to None, meaning "not given": `from_args` then takes
    the dataclass's own default, which the help shows (or `default_note[name]` where the caller decides it, e.g.
    crosscheck's async offload)."""
    notes = default_note or {}
    add_flags(parser, *(flag.use(default_text=notes[flag.key]) if flag.key in notes else flag
                        for flag in dataclass_flags(cls, only, exclude)))


def from_args(args: argparse.Namespace, cls=SimOptions, **given):
    """The `cls` instance the flags of `add_arguments` describe; flags not given keep the dataclass defaults,
    `given` (e.g. options=SimOptions(...)) sets fields that have no flag or a caller-decided value."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
    return cls(**{**values, **given})


def grid_keys(cls=SimOptions, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """The sweep-grid keys of an options dataclass: field name -> help text."""
    return {f.name: f.metadata["help"] for f in fields(cls) if "help" in f.metadata and f.name not in exclude}
