"""`thoughtkv trace`: decode a model with a tiered KV cache and record a trace v1 run (resumable).

No torch at module level: `run` imports the tracer lazily after validating every argument.
"""

from __future__ import annotations

import argparse
import sys

from tracer.preflight import DEVICE_HELP, THREADS_HELP
from traces.policy import add_policy_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF id or local path, `micro`, or `random:NAME` (traces.architectures)")
    parser.add_argument("--task", required=True, help="task name (gsm8k, math500, chains, ...)")
    parser.add_argument("--data-file", default=None, help="local dataset file for the task (no downloads at run time)")
    parser.add_argument("--n-samples", type=int, default=1, help="samples of the task to trace (default: 1)")
    # --policy, --hbm-budget, --evict-ratio, --block-size, --sink-tokens, --window-tokens, --recall-k,
    # --recall-budget, --recall-rule, --scorer, --promote, --ddr-dtype: generated from the policy contract
    # (traces/policy.py), whose defaults they show; the spec validates them once. The cache geometry, the decode
    # limit and the recall setting left unset come from the model's trace_defaults.json (tracer/model_defaults.py).
    add_policy_arguments(parser)
    from tracer.model_defaults import KEYS

    for action in parser._actions:  # their help says where the default comes from
        if action.dest in KEYS and action.help and "(default: " in action.help:
            action.help = action.help.replace("(default: ", "(default: the model's trace_defaults.json, else ")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="samples decoded per step, freed rows refilled at once; per-sample results as at 1 (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="decode limit per sample (default: the model's trace_defaults.json, else 256)")
    parser.add_argument("--allow-past-context", action="store_true",
                        help="trace a prompt longer than the model's context anyway: positions past it were never "
                             "trained (timings only; default: refuse)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=2048,
                        help="prefill a longer prompt in chunks of this many tokens: bounds the prefill's attention "
                             "scores; the prompt is placed after the last chunk, as one unchunked prefill (default: 2048)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds random weights, the random scorer and generated tasks (default: 0)")
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--no-access", action="store_true", help="do not record per-block masses (access table)")
    parser.add_argument("--also-score", default=None, metavar="A,B",
                        help="scorers computed alongside (not placing); recorded for `thoughtkv analyze correlation`")
    parser.add_argument("--grad-window", type=int, default=1, help="gradient scorer: next-token losses of the last N positions (default: 1)")
    parser.add_argument("--grad-interval", type=int, default=1, help="gradient scorer: a backward pass every N decode steps (default: 1)")
    parser.add_argument("--fidelity-reference", default=None, metavar="RUN",
                        help="a full-cache run of the same model and task: also decode each sample teacher-forced on "
                             "RUN's chain and on the task's human-written solution, and record KL, top-1 agreement, "
                             "NLL, first divergence and answer match against the full cache (tracer/fidelity.py; "
                             "default: none)")
    parser.add_argument("--out", required=True, help="run directory (created; rerun to resume)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars (the weights-loading bar included)")
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
        model=args.model, task=args.task, out=args.out, n_samples=args.n_samples, data_file=args.data_file,
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
