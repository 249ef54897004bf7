"""Tracer throughput on one GPU (prepared; bounded by --budget-s; no network; installs nothing): traced vs
untraced tokens/s on random:qwen2-7b (DeepSeek-R1-Distill-Qwen-7B shapes, random bf16 weights initialised on the
device) at B = 1 and B = 16, host synchronisations per decode step, per-layer CUDA event timings, and the DDR
tier's recalls and offloads per layer on either way of moving blocks.

- untraced: HF `generate` with a plain DynamicCache + sdpa, `B` prompts of `--prompt` tokens, `--steps` new;
- traced: `thoughtkv trace`'s loop (tracer.decode.decode_batch) with hierarchy 30% (recall_k 4, block 16)
  and recording, the same prompts and tokens; full (recording only) at B = 1 for reference;
- syncs: tracer.decode.HostSyncCounter over the traced decode steps (goal: <= 1 per step), the cache built
  before counting (its setup is not a step's);
- layer times: the traced runs' `measured_layer_us` (timing events read after each step's own synchronisation);
- DDR moves: each layer's recall and offload calls (tracer.transfer.MoveTimer: events around each store call),
  on the default kernel path (gathers and scatters through the mapped pinned pool, on the SMs) and on the copy
  engine (`THOUGHTKV_DDR_COPY=copy-engine`: pinned staging and copies on a side stream), with that run's tok/s;
- writing: what one finished sample of ~2,500 steps costs this host to write, split as traces.WriteBehind
  splits it (prepared on the decode thread, committed on a writer thread on a GPU; `sample_write_ms`);
- issuing: the share of a decode step the host spends issuing its kernels (forward entry to return, over the
  step; ~1: launch-bound, where CUDA graphs would help; well below: the GPU's work bounds the step);
- the DDR pool: whether kernels use the mapped pinned pool (tracer.transfer.probe_mapping, once, on known
  bytes) and whether a put/get round-trips exactly either way (`ddr_mapped_view` in throughput.json).
Goals: traced/untraced >= 0.9 at B = 1 and >= 0.95 at B = 16.

Run on the lent machine through tests/gpu/on_device.sh (tests/gpu/README.md has the command). Writes under
$OUT: throughput.json (every figure, rewritten after each stage, so a timeout keeps what finished),
layer_us.csv (per step and layer), log.txt. `--device cpu` (with a small `--model`) is a smoke run against the
current code (tests/test_gpu_scripts.py, `make gpu-rehearsal`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from tracer.cache import TieredCache
from tracer.calibrate.measured import load_for_crosscheck
from tracer.compat import cache_kwargs
from tracer.decode import (
    DecodeJob,
    HostSyncCounter,
    decode_batch,
    frozen_heap,
    use_tiered_attention,
)
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings
from tracer.transfer import DDR_COPY_ENV, DDR_COPY_MODES, MoveTimer, PinnedBlockStore, probe_mapping

ROOT = Path(__file__).resolve().parents[2]


def source_commit() -> str | None:
    """The commit measured: `git rev-parse HEAD` where git and the repository are there, else the COMMIT file
    that `tests/gpu/rehearse.sh` writes into the carried wheel folder (the lent machine may have neither git nor
    .git), else None. Never raises."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    stamp = ROOT / ".gpu-wheels" / "COMMIT"
    return (stamp.read_text().strip() or None) if stamp.is_file() else None


def copy_modes() -> list[str]:
    """The ways of moving DDR blocks to measure: both, unless the environment pins one (tests/gpu/on_device.sh
    pins the copy engine where its probe found that kernels cannot use the mapped pool)."""
    pinned = os.environ.get(DDR_COPY_ENV)
    return [pinned] if pinned else list(DDR_COPY_MODES)


def ddr_mapped_view_check(device: str) -> dict:
    """Whether kernels use the mapped pinned pool (the probe, once per process), and whether a put/get round-trips
    the blocks exactly on each way of moving them (compared with the host pool's own bytes)."""
    probe = probe_mapping(torch.device(device)) if "kernel" in copy_modes() else None
    result = {"mapped": None if probe is None else probe.mapped, "reason": None if probe is None else probe.reason,
              "round_trip_exact": {}}
    for mode in copy_modes():
        store = PinnedBlockStore(4, 16, 128, torch.bfloat16, torch.device(device), copy_mode=mode)
        rows, ids = torch.tensor([0, 1, 1], device=device), torch.tensor([3, 70, 9], device=device)
        keys = torch.randn(3, 4, 16, 128, device=device, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        store.reserve(2, 71)
        store.put(rows, ids, keys, values)
        got_k, got_v, result["bytes_per_get"] = store.get(rows.flip(0), ids.flip(0))
        if device == "cuda":
            torch.cuda.synchronize()
        result["round_trip_exact"][mode] = bool(
            torch.equal(got_k, keys.flip(0)) and torch.equal(got_v, values.flip(0))
            and torch.equal(store.keys[rows.cpu(), ids.cpu()], keys.cpu()))
    return result


def sample_write_ms(n_steps: int, n_layers: int, rounds: int = 2) -> dict:
    """What writing one finished sample costs this host, split as traces.WriteBehind splits it: `prepare` (the
    columns into Arrow tables, on the decode thread, between steps) and `commit` (access encoding, Parquet +
    zstd, fsync: on a thread when decoding on a GPU, where inline it would leave the GPU idle). A synthetic
    sample of `n_steps` decode steps x `n_layers` layers after a 256-token prompt, with movements (medians)."""
    import tempfile

    from traces import TraceWriter
    from traces.example import example_manifest, example_sample

    ids = [f"w{i}" for i in range(rounds)]
    times: dict[str, list[float]] = {"prepare": [], "commit": []}
    with tempfile.TemporaryDirectory() as tmp:
        writer = TraceWriter(Path(tmp) / "run", example_manifest(sample_ids=ids))
        for sample_id in ids:
            parts = example_sample(sample_id, prompt_tokens=256, generated_tokens=n_steps, n_layers=n_layers,
                                   movements=True)
            begin = time.perf_counter()
            prepared = writer.prepare_sample(**parts)
            middle = time.perf_counter()
            writer.commit_sample(prepared)
            times["prepare"].append((middle - begin) * 1e3)
            times["commit"].append((time.perf_counter() - middle) * 1e3)
    return {"steps": n_steps, "layers": n_layers} | {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen2-7b")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--write-steps", type=int, default=2500, help="decode steps of the synthetic sample whose "
                        "writing is timed (an R1 GSM8K answer's ~2,500)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no stage past this many seconds from "
                        "the start (what finished is written; the device command's timeout stays the hard stop)")
    parser.add_argument("--device", default="cuda", help="cuda (the device run), or cpu for a smoke run of this "
                        "script against the current code (tests/test_gpu_scripts.py)")
    args = parser.parse_args()
    started = time.perf_counter()
    device = args.device
    cuda = device == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = "bfloat16" if cuda else "float32"
    out = Path(os.environ.get("OUT", "gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "w")

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    assert not cuda or torch.cuda.is_available(), "no CUDA device visible to torch"
    commit = source_commit()
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    say(f"torch {torch.__version__} cuda {torch.version.cuda} {device_name}; commit {commit}")
    results: dict = {"model": args.model, "prompt": args.prompt, "steps": args.steps, "commit": commit,
                     "device": device_name, "torch": torch.__version__, "by_batch": {}, "skipped": []}
    layer_rows: list[str] = []

    def write() -> None:
        """Everything so far, replacing the last write (each file renamed into place: never half written)."""
        results["elapsed_s"] = time.perf_counter() - started
        for name, text in (("throughput.json", json.dumps(results, indent=2) + "\n"),
                           ("layer_us.csv", "batch,step,layer,measured_layer_us,measured_step_us\n"
                            + "".join(row + "\n" for row in layer_rows))):
            (out / f"{name}.tmp").write_text(text)
            os.replace(out / f"{name}.tmp", out / name)

    def time_left(stage: str) -> bool:
        if args.budget_s is None or time.perf_counter() - started < args.budget_s:
            return True
        results["skipped"].append(stage)
        say(f"budget of {args.budget_s:.0f}s spent: {stage} skipped")
        write()
        return False

    loaded = load_for_crosscheck(args.model, device, dtype)  # random weights initialised on the device itself
    model, n_layers = loaded.model, loaded.model.config.num_hidden_layers
    results["load_s"] = time.perf_counter() - started
    say(f"{args.model}: {loaded.manifest['n_params'] / 1e9:.2f}B params loaded in {results['load_s']:.0f}s")
    batches = [int(b) for b in args.batches.split(",")]
    prompts = torch.randint(3, 259, (max(batches), args.prompt), generator=torch.Generator().manual_seed(0))
    configs = {
        "hierarchy": TraceConfig(model=args.model, task="chains", out="-", policy="hierarchy", hbm_budget=0.3,
                                 block_size=16, recall_k=4, max_new_tokens=args.steps),
        "full": TraceConfig(model=args.model, task="chains", out="-", policy="full", block_size=16,
                            max_new_tokens=args.steps),
    }

    issue_share: dict[str, list[float]] = {}  # per run: the host's issuing share of each decode step

    class IssueTimer:
        """Per forward, when the model's forward was entered and when it returned: on a GPU it returns once its
        kernels are queued, so (return - entry) / (next entry - entry) is the share of a step the host spends
        issuing it: ~1, the host bounds the step (launch-bound: what CUDA graphs would remove); well below 1,
        the GPU's work does. (Thread CPU time cannot tell: CUDA's default sync spins while it waits.)"""

        def __init__(self, name: str):
            self.name, self.marks = name, []

        def __enter__(self):
            self.hooks = [model.register_forward_pre_hook(lambda *_: self.marks.append([time.perf_counter()])),
                          model.register_forward_hook(lambda *_: self.marks[-1].append(time.perf_counter()))]
            return self

        def __exit__(self, *exc):
            for hook in self.hooks:
                hook.remove()
            steps = self.marks[1:]  # (the first: the prefill)
            shares = [(a[1] - a[0]) / (b[0] - a[0]) for a, b in zip(steps, steps[1:])]
            if shares:
                issue_share.setdefault(self.name, []).append(statistics.median(shares))

    def untraced(batch: int) -> float:
        model.set_attn_implementation("sdpa")
        ids = prompts[:batch].to(device)
        synchronize()
        begin = time.perf_counter()
        with IssueTimer(f"untraced B={batch}"):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.steps,
                           min_new_tokens=args.steps, do_sample=False,
                           **cache_kwargs(model, DynamicCache(config=model.config)), pad_token_id=0)
        synchronize()
        return batch * args.steps / (time.perf_counter() - begin)

    def traced(batch: int, policy: str, around=None) -> tuple[float, list[Recorder], TieredCache]:
        """One traced decode of the batch: (tok/s, the recorders, the cache). `around`: a context the decode runs
        in (a sync counter, a move timer), entered after the cache is built."""
        use_tiered_attention(model)
        config = configs[policy]
        jobs = [DecodeJob(i, prompts[i].tolist(), make_settings(config), Recorder()) for i in range(batch)]
        cache = TieredCache(n_layers, jobs[0].settings)
        begin = time.perf_counter()
        with around if around is not None else IssueTimer(f"traced {policy} B={batch}"):
            list(decode_batch(model, jobs, cache, batch, args.steps, set()))
        synchronize()
        return batch * args.steps / (time.perf_counter() - begin), [job.recorder for job in jobs], cache

    def ddr_moves(batch: int, mode: str) -> dict:
        """A traced hierarchy run on one way of moving DDR blocks, each store call timed: its tok/s and per layer
        the median µs of a recall and of an offload, and the calls of each per decode step."""
        previous = os.environ.get(DDR_COPY_ENV)
        os.environ[DDR_COPY_ENV] = mode  # (read as the cache builds its stores: tracer.transfer.ddr_copy_mode)
        try:
            timer = MoveTimer(device)
            tok_s, _, cache = traced(batch, "hierarchy", timer)
        finally:
            if previous is None:
                del os.environ[DDR_COPY_ENV]
            else:
                os.environ[DDR_COPY_ENV] = previous
        by_layer = [timer.us(layer.ddr) for layer in cache.paged]
        entry: dict = {"traced_hierarchy_tok_s": tok_s}
        for direction in ("recall", "offload"):
            entry[f"{direction}_us_median_by_layer"] = [statistics.median(t[direction]) if t[direction] else 0.0
                                                        for t in by_layer]
            entry[f"{direction}_us_per_step_by_layer"] = [sum(t[direction]) / args.steps for t in by_layer]
            entry[f"{direction}_calls_per_step"] = sum(len(t[direction]) for t in by_layer) / args.steps
        return entry

    untraced(1), traced(1, "hierarchy")  # warm-up (kernels, allocator, the mapping probe)
    results["ddr_mapped_view"] = ddr_mapped_view_check(device)
    say(f"DDR pool: {results['ddr_mapped_view']}")
    write()
    with frozen_heap():  # as `thoughtkv trace` decodes (both sides measured in it)
        for batch in batches:
            if not time_left(f"B={batch}"):
                break
            base, tiered = [], []
            for _ in range(args.rounds):
                base.append(untraced(batch))
                tok_s, recorders, _ = traced(batch, "hierarchy")
                tiered.append(tok_s)
            entry = {"untraced_tok_s": statistics.median(base), "traced_hierarchy_tok_s": statistics.median(tiered)}
            entry["traced_over_untraced"] = entry["traced_hierarchy_tok_s"] / entry["untraced_tok_s"]
            # (and per round, each pair back to back, as tests/bench/collect_throughput.py reports it)
            entry["traced_over_untraced_paired"] = statistics.median(t / u for t, u in zip(tiered, base))
            if batch == 1:
                entry["traced_full_tok_s"] = statistics.median(traced(1, "full")[0] for _ in range(args.rounds))
            counter, forwards = HostSyncCounter(), [0]  # forwards: the batch's prefill(s), then its decode steps
            hook = model.register_forward_pre_hook(lambda *_, seen=forwards: seen.__setitem__(0, seen[0] + 1))
            try:
                traced(batch, "hierarchy", counter)
            finally:
                hook.remove()
            entry["host_syncs_per_step"] = counter.count / forwards[0]
            entry["host_syncs_by_op"] = counter.by_op
            table = recorders[0].steps_table()
            per_layer: dict[int, list[float]] = {}
            for step, layer, us, step_us in zip(table["step"], table["layer"], table["measured_layer_us"],
                                                table["measured_step_us"], strict=True):
                layer_rows.append(f"{batch},{step},{layer},{us:.1f},{step_us:.1f}")
                if step > 0:
                    per_layer.setdefault(layer, []).append(us)
            entry["decode_layer_us_median"] = [statistics.median(per_layer[k]) for k in sorted(per_layer)]
            entry["decode_step_us_median"] = statistics.median(
                us for s, us in zip(table["step"], table["measured_step_us"], strict=True) if s > 0)
            results["by_batch"][str(batch)] = entry
            goal = 0.9 if batch == 1 else 0.95
            say(f"B={batch}: untraced {entry['untraced_tok_s']:.1f} tok/s, traced hierarchy "
                f"{entry['traced_hierarchy_tok_s']:.1f} tok/s, ratio {entry['traced_over_untraced']:.3f} (goal >= {goal}); "
                f"host syncs/step {entry['host_syncs_per_step']:.2f} (goal <= 1); decode layer us median "
                f"{statistics.median(entry['decode_layer_us_median']):.0f}, step {entry['decode_step_us_median']:.0f}")
            write()
            entry["ddr_moves"] = {}
            for mode in copy_modes():
                if not time_left(f"B={batch} DDR moves ({mode})"):
                    break
                moves = entry["ddr_moves"][mode] = ddr_moves(batch, mode)
                say(f"B={batch} DDR moves ({mode}): {moves['traced_hierarchy_tok_s']:.1f} tok/s; per step "
                    f"{sum(moves['recall_us_per_step_by_layer']):.0f} us recalling ({moves['recall_calls_per_step']:.1f}"
                    f" calls), {sum(moves['offload_us_per_step_by_layer']):.0f} us offloading "
                    f"({moves['offload_calls_per_step']:.1f} calls), all layers")
                write()
    if time_left("sample writing"):
        results["sample_write_ms"] = sample_write_ms(args.write_steps, n_layers)
        say(f"writing one sample of {args.write_steps} steps x {n_layers} layers: prepare (decode thread) "
            f"{results['sample_write_ms']['prepare']:.0f} ms, commit (writer thread on a GPU) "
            f"{results['sample_write_ms']['commit']:.0f} ms")
    results["host_issue_share"] = {name: statistics.median(v) for name, v in issue_share.items()}
    say("share of a decode step the host spends issuing it (median; ~1: launch-bound): " + ", ".join(
        f"{name} {share:.2f}" for name, share in results["host_issue_share"].items()))
    write()
    say(f"done in {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
