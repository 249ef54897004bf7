"""Projections against published measured GPU runs: measured, projected and error for every row whose
configuration the profiles cover (model shapes, dtype, batch, context, overhead mode), and why the others are not.

    python tests/bench/published_gpu.py                                   # the tables on stdout (markdown)
    python tests/bench/published_gpu.py --out docs/validation/published_gpu.md

The rows are those of the project's notes on published GPU measurements plus a few found since, each with its
source. Decode rows are projected the way a user projects them: a synthetic trace of the model (policy full, the
row's context as the prompt, 32 decode steps) simulated on the row's profile with `SimOptions(overhead_mode=...,
batch=...)`; copy rows through the transfer mechanisms' copy time (`simulator.mechanisms`). A row whose figure a
profile or mode was derived from says so ("sets ..."): it checks the arithmetic, not the model; the others are
checks. tests/test_published_gpu.py asserts every covered row within its tolerance (25%), the eager/graph ratio
and the batch behaviour. Deterministic (no timing): minutes on a laptop, not a benchmark of this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DECODE_STEPS = 32
TOLERANCE = 0.25
# gpt-fast's eager decode issues other ops than transformers' (counted like tracer/calibrate/launches.py:
# hwprofiles/overheads/hf-eager.yaml, host_op_from[0], 48 per layer x 32 + 25 = 1,561 per token).
GPT_FAST_EAGER_OPS = (48, 25)
GPT_FAST = "gpt-fast README / PyTorch blog \"GPT, Fast\" (2023-11-30)"


@dataclass(frozen=True)
class DecodeRow:
    source: str
    setup: str
    measured_ms: float  # per token, per sequence
    profile: str
    model: str
    mode: str
    batch: int = 1
    context: int = 64  # prompt tokens: the context the decode steps attend
    host_ops: tuple[int, int] | None = None  # (per layer, per step) of the measured code, when not transformers'
    role: str = "check"  # "check", or what the row's figure set ("sets ...": not an independent check)


@dataclass(frozen=True)
class CopyRow:
    source: str
    setup: str
    measured_gbps: float
    profile: str
    direction: str  # h2d | d2h | both (both directions at once, summed)
    size_bytes: int  # one copy
    mechanism: str = "dma-per-block"
    role: str = "check"


@dataclass(frozen=True)
class NotCovered:
    source: str
    setup: str
    measured: str
    why: str


NVBANDWIDTH_BUFFER = 512 * 2**20  # nvbandwidth's default buffer (--bufferSize 512 MiB)

DECODE_ROWS = (
    DecodeRow("PyTorch blog \"GPT, Fast\", starting point", "gpt-fast eager, Llama-2-7B bf16, A100-80GB SXM4 at 330 W",
              39.22, "a100-80gb-sxm", "llama2-7b", "hf-eager", context=5, host_ops=GPT_FAST_EAGER_OPS,
              role="sets the cited host cost per op (with the next)"),
    DecodeRow("meta-pytorch/gpt-fast issue #59", "HF generate eager, Llama-2-7b-chat bf16 (GPU not stated: host-bound)",
              25.38, "a100-80gb-sxm", "llama2-7b", "hf-eager", context=16,
              role="sets the cited host cost per op (with the one before)"),
    DecodeRow("meta-pytorch/gpt-fast issue #59", "gpt-fast eager on the same machine (GPU not stated: host-bound)",
              35.71, "a100-80gb-sxm", "llama2-7b", "hf-eager", context=16, host_ops=GPT_FAST_EAGER_OPS),
    DecodeRow("h2oai/h2ogpt perf.md (backend transformers, 16-bit)",
              "HF generate, h2ogpt-4096-llama2-7b-chat, 1 x A100-SXM4-80GB (summarisation prompt: context ~1k assumed)",
              32.28, "a100-80gb-sxm", "llama2-7b", "hf-eager", context=1024),
    DecodeRow("h2oai/h2ogpt perf.md (backend transformers, 16-bit)",
              "HF generate, h2ogpt-4096-llama2-7b-chat, 1 x RTX 4090 (a desktop host; context ~1k assumed)",
              24.43, "rtx-4090", "llama2-7b", "hf-eager", context=1024),
    DecodeRow("PyTorch blog \"GPT, Fast\", step 1", "torch.compile reduce-overhead (CUDA graphs), static KV cache, "
              "Llama-2-7B bf16, A100-80GB SXM4 at 330 W", 9.35, "a100-80gb-sxm", "llama2-7b", "cuda-graphs", context=5,
              role="check (the step of the next row, the blog's run)"),
    DecodeRow("pytorch-labs/gpt-fast README, benchmarks", "compiled, Llama-2-7B bf16, A100-80GB at 330 W: 104.9 tok/s",
              9.53, "a100-80gb-sxm", "llama2-7b", "cuda-graphs", context=5,
              role="sets decode_hbm_fraction (1,397 of ~1,700 GB/s)"),
)

COPY_ROWS = (
    CopyRow("vLLM blog \"Inside vLLM's New KV Offloading Connector\"", "H100, Sapphire Rapids host, DMA, 1000 blocks of "
            "16 MB, one direction (\"up to about 50 GB/s\")", 50.0, "h100-sxm", "h2d", 16 * 2**20,
            role="sets link.h2d_bandwidth"),
    CopyRow("vLLM blog (as above)", "DMA, both directions at once, 2 MB blocks (sum)", 83.4, "h100-sxm", "both",
            2 * 2**20),
    CopyRow("NVIDIA/nvbandwidth issue #6", "H100 VM, host_to_device_memcpy_ce (3 of 4 GPUs; the 4th 14.2: topology)",
            57.0, "h100-sxm", "h2d", NVBANDWIDTH_BUFFER),
    CopyRow("NVIDIA/nvbandwidth issue #24", "8 x H100, host_to_device_memcpy_sm", 35.2, "h100-sxm", "h2d",
            NVBANDWIDTH_BUFFER, "sm-copy", role="sets transfer.sm_copy_h2d_bandwidth"),
    CopyRow("NVIDIA/nvbandwidth issue #24", "8 x H100, device_to_host_memcpy_sm", 52.8, "h100-sxm", "d2h",
            NVBANDWIDTH_BUFFER, "sm-copy", role="sets transfer.sm_copy_d2h_bandwidth"),
    CopyRow("NVIDIA/nvbandwidth issue #23", "GH200 480 GB + 96 GB, NVLink-C2C, host_to_device_memcpy_ce", 346.0,
            "gh200-96gb", "h2d", NVBANDWIDTH_BUFFER, role="sets link.h2d_bandwidth"),
    CopyRow("NVIDIA/nvbandwidth issue #23", "GH200, host_to_device_memcpy_sm (profile: Schieffer et al. 375 GB/s)",
            342.0, "gh200-96gb", "h2d", NVBANDWIDTH_BUFFER, "sm-copy"),
    CopyRow("NVIDIA/nvbandwidth issue #15", "8 x RTX 4090, host_to_device_memcpy_ce (median of 8 GPUs)", 26.19,
            "rtx-4090", "h2d", NVBANDWIDTH_BUFFER),
    CopyRow("NVIDIA/nvbandwidth issue #15", "8 x RTX 4090, device_to_host_memcpy_ce (median of 8 GPUs)", 26.80,
            "rtx-4090", "d2h", NVBANDWIDTH_BUFFER),
    *(CopyRow("jdh4/della-gpu-A100 README (bandwidthTest, pinned)", f"A100-PCIE-40GB, {direction.upper()} at {label}",
              rate, "a100-80gb-pcie", direction, size, role="sets transfer.copy_curve")
      for direction, rates in (("h2d", (18.0, 19.4, 24.1, 25.8)), ("d2h", (15.8, 25.4, 26.2, 25.7)))
      for (size, label), rate in zip(((10**6, "1 MB"), (10**7, "10 MB"), (10**8, "100 MB"), (10**9, "1 GB")), rates)),
)

NOT_COVERED = (
    NotCovered("ggml-org/llama.cpp issue #6763", "H100-PCIe, llama-2-7b Q4_K_M, all layers on the GPU",
               "6.98 ms/token eager -> 6.10 with CUDA graphs",
               "Q4_K_M weights (4.5 bits) are no dtype of traces.architectures, and llama.cpp's quantized kernels "
               "reach ~1/3 of HBM bandwidth at batch 1 (4.1 GB / 6.1 ms = 0.67 TB/s of 2.0); its C++ host launches "
               "ahead of the GPU (\"CPU-side launch overheads are not the issue\", PR #6766): the 0.9 ms graphs save "
               "are GPU-side gaps between kernels, which no mode models"),
    NotCovered("meta-pytorch/gpt-fast issue #59", "gpt-fast compiled, Llama-2-7b-chat, GPU not stated",
               "68.5 tok/s (14.6 ms/token)", "a captured step is GPU-bound, and the GPU is not stated (925 GB/s "
               "achieved suggests an RTX 4090)"),
    NotCovered("h2oai/h2ogpt perf.md", "HF generate, llama2-7b 16-bit on RTX 6000 Ada / RTX 3090",
               "23.8 / 55.4 ms/token", "no profile of either GPU (their hosts are not stated either)"),
)


# ---------------------------------------------------------------- projecting ---------------------------------


def _run(work_dir: Path, model: str, context: int) -> Path:
    from simulator.synth import synth_run

    path = work_dir / f"{model}-p{context}"
    if not (path / "run.json").exists():
        synth_run(path, model=model, prompt_tokens=context, decode_steps=DECODE_STEPS, policy="full", samples=1,
                  dtype="bfloat16", access=False)
    return path


def _profile(row: DecodeRow):
    from hwprofiles import load_profile
    from hwprofiles.overhead_modes import apply_mode

    profile = apply_mode(load_profile(row.profile), row.mode)
    if row.host_ops is not None:
        per_layer, per_step = row.host_ops
        profile = dataclasses.replace(profile, host_model=dataclasses.replace(
            profile.host_model, ops_per_layer=per_layer, ops_per_step=per_step))
    return profile


def project_decode(row: DecodeRow, work_dir: Path) -> dict:
    """{ms_per_token, host_ms (per step), gpu_ms (per decode step: kernels), bound, host_term} of one row."""
    from simulator import SimOptions, simulate_run

    result = simulate_run(_run(work_dir, row.model, row.context), _profile(row), SimOptions(batch=row.batch))
    summary = result.summary
    decode = result.steps[result.steps["step"] > 0]
    gpu_ms = 1e3 * float((decode["compute_s"] + decode["hbm_s"]).mean())
    host_ms = 1e3 * summary["host_s"] / summary["steps"]
    return {"ms_per_token": summary["ms_per_token"], "host_ms": host_ms, "gpu_ms": gpu_ms,
            "bound": "host" if host_ms > gpu_ms else "GPU", "host_term": summary["host_term"],
            "overhead_mode": summary["overhead_mode"], "hbm_overflow": bool(summary["hbm_overflow"])}


def project_copy(row: CopyRow) -> float:
    """The profile's rate (GB/s) for one copy of `size_bytes` (both: the two directions at once, summed)."""
    from hwprofiles import load_profile
    from simulator import costs, mechanisms
    from traces.manifest import model_manifest

    profile = load_profile(row.profile)
    mechanism = mechanisms.mechanism_for(row.mechanism, profile)
    ctx = mechanisms.context(profile, costs.ModelShape.from_manifest(model_manifest("tiny")))
    seconds = {d: float(mechanism.copy_s(ctx, d, row.size_bytes)) for d in ("h2d", "d2h")}
    if row.direction != "both":
        return row.size_bytes / seconds[row.direction] / 1e9
    if profile.link.full_duplex:
        return sum(row.size_bytes / s for s in seconds.values()) / 1e9
    return 2 * row.size_bytes / (seconds["h2d"] + seconds["d2h"]) / 1e9


def error(projected: float, measured: float) -> float:
    return projected / measured - 1


# The batch behaviour: a 7B decode step at batch 1, 32 and 64 (llama2-7b: 64 Ki sequence-tokens of KV at 32 x
# 2,048 and 64 x 1,024, 34 GB next to 13.5 GB of weights in 80 GB), and a GQA 7B whose KV is 1/8 of it.
BATCH_CASES = (("llama2-7b", 1, 2048), ("llama2-7b", 32, 2048), ("llama2-7b", 64, 1024), ("qwen2-7b", 1, 4096),
               ("qwen2-7b", 64, 4096))


def project_batches(work_dir: Path, profile: str = "a100-80gb-sxm") -> list[dict]:
    rows = []
    for model, batch, context in BATCH_CASES:
        for mode in ("hf-eager", "cuda-graphs"):
            row = DecodeRow("", "", float("nan"), profile, model, mode, batch=batch, context=context)
            rows.append({"model": model, "batch": batch, "context": context, "mode": mode,
                         **project_decode(row, work_dir)})
    return rows


# ---------------------------------------------------------------- the report ---------------------------------


def report(work_dir: Path) -> str:
    from thoughtkv_base import __version__

    lines = [
        "# Projections against published measured GPU runs",
        "",
        f"Generated by `tests/bench/published_gpu.py` on {datetime.date.today().isoformat()} with thoughtkv {__version__}; "
        "`tests/test_published_gpu.py` asserts the covered rows within "
        f"±{TOLERANCE:.0%}. Decode rows: a synthetic trace of the model (policy full, the context as prompt, "
        f"{DECODE_STEPS} decode steps) simulated on the profile in the overhead mode with the default (cited) host "
        "term; ms/token per sequence. \"sets ...\": the profile or mode figure was derived from that row, so the "
        "row checks the arithmetic rather than the model. Formulas: simulator/README.md (\"Host model\").",
        "",
        "## Decode, 7B, bf16",
        "",
        "| source | setup | profile | mode | batch | measured ms | projected ms | error | host / GPU ms per step "
        "| role |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in DECODE_ROWS:
        p = project_decode(row, work_dir)
        ops = f", {row.host_ops[0]}/{row.host_ops[1]} ops" if row.host_ops else ""
        lines.append(f"| {row.source} | {row.setup} | {row.profile} | {row.mode}{ops} | {row.batch} | "
                     f"{row.measured_ms:.2f} | {p['ms_per_token']:.2f} | {error(p['ms_per_token'], row.measured_ms):+.1%} | "
                     f"{p['host_ms']:.2f} / {p['gpu_ms']:.2f} ({p['bound']}) | {row.role} |")
    eager = project_decode(DECODE_ROWS[0], work_dir)["ms_per_token"]
    graphs = project_decode(DECODE_ROWS[5], work_dir)["ms_per_token"]
    hf_eager = project_decode(dataclasses.replace(DECODE_ROWS[0], host_ops=None), work_dir)["ms_per_token"]
    measured_ratio = DECODE_ROWS[0].measured_ms / DECODE_ROWS[5].measured_ms
    lines += [
        "",
        "## Eager / CUDA-graph ratio, Llama-2-7B at batch 1 on the A100 (a100-80gb-sxm)",
        "",
        "| what | measured | projected | error |",
        "|---|---|---|---|",
        f"| gpt-fast eager / compiled (blog: 39.22 / 9.35 ms) | {measured_ratio:.2f}x | {eager / graphs:.2f}x | "
        f"{error(eager / graphs, measured_ratio):+.1%} |",
        f"| transformers eager (hf-eager) / cuda-graphs | - | {hf_eager / graphs:.2f}x | - |",
        "",
        "## Host link copies",
        "",
        "| source | setup | profile | mechanism | measured GB/s | projected GB/s | error | role |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in COPY_ROWS:
        projected = project_copy(row)
        lines.append(f"| {row.source} | {row.setup} | {row.profile} | {row.mechanism} | {row.measured_gbps:.1f} | "
                     f"{projected:.1f} | {error(projected, row.measured_gbps):+.1%} | {row.role} |")
    lines += [
        "",
        "## Batch behaviour (projections; no measured row)",
        "",
        "The host issues the same ops per step whatever the batch; the GPU's work grows with it. a100-80gb-sxm, "
        "ms per step (all sequences of the batch):",
        "",
        "| model | batch | context | mode | host ms | GPU ms | step ms | bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in project_batches(work_dir):
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['mode']} | {r['host_ms']:.2f} | "
                     f"{r['gpu_ms']:.1f} | {r['ms_per_token']:.1f} | {r['bound']} |")
    lines += [
        "",
        "Llama-2-7B (32 KV heads) is GPU-bound at batch 32-64 in both modes at these contexts: its KV reads outgrow "
        "the host's ~27 ms. A GQA 7B (qwen2-7b: 4 KV heads, 1/8 of the KV bytes) stays host-bound in eager mode "
        "even at batch 64 and 4,096 tokens of context on this GPU: the host, not the batch, bounds an eager decode "
        "there.",
        "",
        "## Not covered",
        "",
        "| source | setup | measured | why |",
        "|---|---|---|---|",
        *(f"| {n.source} | {n.setup} | {n.measured} | {n.why} |" for n in NOT_COVERED),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here (default: stdout)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the synthetic traces go (default: temp)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as temp:
        text = report(args.work_dir or Path(temp))
    if args.out is None:
        print(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
