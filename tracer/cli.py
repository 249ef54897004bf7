"""`thoughtkv trace`: decode a model with a tiered KV cache and record a trace v1 run (resumable).

No torch at module level: `run` imports the tracer lazily after validating every argument.
"""

from __future__ import annotations

import argparse
import sys

from thoughtkv_base.options import INT, SHARED, TEXT, Flag, add_flags
from traces.policy import PolicySpec, add_policy_arguments

# Defaults that come from the model's trace_defaults.json when the flag is not given (tracer/model_defaults.py).
FROM_MODEL = "the model's trace_defaults.json, else {}"

OWN = (
    Flag("--allow-past-context", "trace a prompt longer than the model's context anyway: positions past it were "
         "never trained (timings only; default: refuse)", None, action="store_true", default=False),
    Flag("--prefill-chunk-tokens", "prefill a longer prompt in chunks of this many tokens: bounds the prefill's "
         "attention scores; the prompt is placed after the last chunk, as one unchunked prefill", INT,
         default=2048),  # at least 1: TraceConfig checks it, for the CLI and the API alike
    Flag("--also-score", "scorers computed alongside (not placing); recorded for `thoughtkv analyze correlation`",
         TEXT, metavar="A,B"),
    Flag("--grad-window", "gradient scorer: next-token losses of the last N positions", INT, default=1),
    Flag("--grad-interval", "gradient scorer: a backward pass every N decode steps", INT, default=1),
    Flag("--fidelity-reference", "a full-cache run of the same model and task: also decode each sample "
         "teacher-forced on RUN's chain and on the task's human-written solution, and record KL, top-1 agreement, "
         "NLL, first divergence and answer match against the full cache (tracer/fidelity.py; default: none)",
         TEXT, metavar="RUN"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tracer.model_defaults import KEYS

    add_flags(parser, SHARED["model"].use(required=True), SHARED["task"].use(required=True), "data_file",
              SHARED["n_samples"].use(help="samples of the task to trace"))
    # --policy, --hbm-budget, --evict-ratio, --block-size, --sink-tokens, --window-tokens, --recall-k,
    # --recall-budget, --recall-rule, --scorer, --promote, --ddr-dtype: generated from the policy contract
    # (traces/policy.py), whose defaults they show; the spec validates them once. The cache geometry, the decode
    # limit and the recall setting left unset come from the model's trace_defaults.json (tracer/model_defaults.py).
    add_policy_arguments(parser, default_text={key: FROM_MODEL.format(getattr(PolicySpec(), key))
                                               for key in KEYS if hasattr(PolicySpec, key)})
    add_flags(parser, SHARED["batch_size"].use(help="samples decoded per step, freed rows refilled at once; "
                                                    "per-sample results as at 1"),
              SHARED["max_new_tokens"].use(default_text=FROM_MODEL.format(256)),
              SHARED["seed"].use(help="seeds random weights, the random scorer and generated tasks"),
              "device", "threads", SHARED["dtype"].use(default_text="bf16 on CUDA, fp32 on CPU"), "no_access", *OWN,
              SHARED["out"].use(help="run directory (created; rerun to resume)", required=True),
              SHARED["quiet"].use(help="no progress bars (the weights-loading bar included)"))
    parser.set_defaults(_trace_parser=parser)


def command_words(args: argparse.Namespace) -> list[str]:
    """The `thoughtkv trace` argv that gives these settings: every option not at its default, as typed. Recorded
    in run.json (tracer.command) so that `traces validate` can print the exact command that repairs a run."""
    words = ["thoughtkv", "trace"]
    for action in args._trace_parser._actions:
        if not action.option_strings or action.dest in ("help", "quiet"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if action.nargs == 0:  # a flag; a --x/--no-x pair picks the spelling of its value
            words.append(action.option_strings[0] if value or len(action.option_strings) == 1 else action.option_strings[1])
        elif isinstance(value, list):
            words += [action.option_strings[-1], *map(str, value)]
        else:
            words += [action.option_strings[-1], str(value)]
    return words


def config_from_args(args: argparse.Namespace):
    from tracer.run import TraceConfig
    from traces.policy import given_flags, spec_from_args

    spec = spec_from_args(args)  # the policy flags, validated once (one line, exit 2)
    # Only the flags given: the others come from the model's trace_defaults.json or the tool's defaults.
    given = {name: getattr(spec, name) for name in given_flags(args)}
    return TraceConfig(
        model=args.model, task=args.task, out=str(args.out), n_samples=args.n_samples,
        data_file=None if args.data_file is None else str(args.data_file),
        **given, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        seed=args.seed, device=args.device, dtype=args.dtype, access=not args.no_access,
        also_score=args.also_score, grad_window=args.grad_window, grad_interval=args.grad_interval,
        threads=args.threads, command=command_words(args), allow_past_context=args.allow_past_context,
        fidelity_reference=args.fidelity_reference,
    )


def run_accuracy_lines(run_dir) -> list[str]:
    """Share stopped by the token limit, accuracy over all scored samples and over the finished ones (resumed
    samples included), each with n and its 95% CI (traces.stats.completion_lines)."""
    from traces import open_run
    from traces.stats import completion_lines

    return [f"{label}: {text}" for label, text in completion_lines(open_run(run_dir).samples())]


def run_traffic_line(run_dir) -> str:
    """What the run moved over the link (decode steps; traces.stats.traffic_summary), with qwen2-7b pricing."""
    from traces import open_run
    from traces.stats import run_traffic, traffic_line

    return traffic_line(run_traffic(open_run(run_dir)))


def run(args: argparse.Namespace) -> int:
    from tracer.run import run_trace

    config = config_from_args(args)
    config.validate()
    if args.quiet:  # transformers' and the Hub's own bars (weights loading, downloads) too
        import huggingface_hub.utils
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
    out = run_trace(config, progress=not args.quiet)
    print(f"trace written to {out}")
    for line in run_accuracy_lines(out):
        print(line)
    print(f"traffic: {run_traffic_line(out)}")
    from traces import open_run
    from traces.fidelity import has_fidelity, summary_line

    samples = open_run(out).samples()
    if has_fidelity(samples):
        print(summary_line(samples))
    warning = zero_recall_warning(out)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def zero_recall_warning(run_dir) -> str | None:
    """After the run, once: the recall budget rounded to zero blocks for most of the decode steps the samples
    took (tracer.run.recall_rounding_note), unless the same was said before the run (run.json records it)."""
    from tracer.run import recall_rounding_note
    from traces import open_run
    from traces.policy import PolicySpec

    run = open_run(run_dir)
    if "recall_rounds_to_zero" in (run.manifest.get("tracer") or {}):
        return None
    samples = run.samples()
    spans = list(zip(samples["prompt_tokens"].astype(int), samples["generated_tokens"].astype(int)))
    note = recall_rounding_note(PolicySpec.from_manifest(run.manifest["policy"]), spans, upper_bound=False)
    return None if note is None else note["warning"]
