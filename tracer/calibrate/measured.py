"""Measured decode runs for `thoughtkv crosscheck`: the tracer's own decode, timed step by step.

- `load_for_crosscheck(spec, device, dtype, seed)`: `random:NAME` models are created directly on the compute
  device (meta device -> `to_empty` -> in-place init), so that `random:qwen2-7b` never builds 15 GB on the
  CPU first; anything else goes through `tracer.models.load_model`.
- `StepTimer`: forward hooks on the model: they count the forwards (one per trace step) and time the forward
  alone (`forward_s`, by the thread's CPU time on a 1-thread CPU, and its wall time). The step's measured time
  is the trace's own `measured_step_us` and layer timer, which calibration fits too.
- `measured_run(loaded, config, clock)`: `tracer.run.run_trace` into a fresh directory with the timer
  attached -> the run directory and a per-step table (sample_id, step, measured_s and layers_s as the trace
  records them, the forward's wall_s and forward_s by the hooks).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

CLOCKS = {"thread_cpu": time.thread_time, "wall": time.perf_counter}


def load_for_crosscheck(spec: str, device: str, dtype: str | None = None, seed: int = 0):
    """A `tracer.models.LoadedModel`; random architectures are initialised on the device itself."""
    from tracer.models import load_model

    if not spec.startswith("random:"):
        return load_model(spec, device, dtype, seed=seed)
    return load_random_on_device(spec, torch.device(device), dtype, seed)


def load_random_on_device(spec: str, device: torch.device, dtype: str | None, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tracer.models import DTYPES, ByteTokenizer, LoadedModel, _config_kwargs, _manifest, default_dtype
    from traces.architectures import get_architecture

    dtype = dtype or default_dtype(device)
    arch = get_architecture(spec.split(":", 1)[1])
    config = AutoConfig.for_model(arch.model_type, **_config_kwargs(arch))
    with torch.device("meta"):  # shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation="sdpa")
    model.to_empty(device=device)
    for module in model.modules():  # nothing was initialised on the meta device; make sure HF initialises all
        if hasattr(module, "_is_hf_initialized"):
            del module._is_hf_initialized
    torch.manual_seed(seed)
    model.initialize_weights()  # in place, on the device: normal(0, 0.02) linears/embeddings, norms 1, RoPE
    model.tie_weights()
    model.eval()
    return LoadedModel(model, ByteTokenizer(), spec, True, _manifest(model, spec, dtype, None, True))


@dataclass
class StepTimer:
    """Per-forward (= per decode step) times from forward hooks, with `clock` and wall time: they count the
    forwards (one per trace step) and give the forward-only time; the step's measured time is the trace's."""

    clock_name: str = "thread_cpu"
    step_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)  # the forward's wall time (others' turns included)
    _handles: list = field(default_factory=list)
    _step_start: float = 0.0
    _wall_start: float = 0.0

    def attach(self, model: torch.nn.Module) -> StepTimer:
        clock = CLOCKS[self.clock_name]

        def step_begin(*_args, **_kwargs):
            self._wall_start = time.perf_counter()
            self._step_start = clock()

        def step_end(*_args, **_kwargs):
            self.step_s.append(clock() - self._step_start)
            self.wall_s.append(time.perf_counter() - self._wall_start)

        self._handles.append(model.register_forward_pre_hook(step_begin, with_kwargs=True))
        self._handles.append(model.register_forward_hook(step_end, with_kwargs=True))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def measured_run(loaded, config, clock_name: str) -> tuple[Path, pd.DataFrame]:
    """Traces `config` (its `out` must not hold a run yet) with the step timer attached; returns the run
    directory and per-step times (the trace's own; the hooks count the forwards and time them as forward_s
    with `clock_name`, 'trace' = wall)."""
    from tracer.run import run_trace
    from traces import open_run

    out = Path(config.out)
    if out.exists():
        shutil.rmtree(out)  # a crash leftover of this measurement: its samples' timings are lost anyway
    timer = StepTimer("wall" if clock_name == "trace" else clock_name).attach(loaded.model)
    try:
        run_trace(config, progress=False, loaded=loaded)
    finally:
        timer.detach()
    run = open_run(out)
    rows = run.steps(columns=["sample_id", "step", "layer", "measured_step_us", "measured_layer_us"])
    steps = (rows.groupby(["sample_id", "step"], sort=False)
             .agg(measured_step_us=("measured_step_us", "first"), layer_us=("measured_layer_us", "sum"),
                  layer_rows=("measured_layer_us", "count"))
             .reset_index())
    samples = run.samples()
    order = dict(zip(samples["sample_id"], samples["sample_index"]))
    steps = steps.assign(sample_index=steps["sample_id"].map(order)).sort_values(["sample_index", "step"])
    steps = steps.drop(columns="sample_index").reset_index(drop=True)
    if len(steps) != len(timer.step_s):
        raise RuntimeError(f"{len(timer.step_s)} forward passes for {len(steps)} trace steps in {out}: the "
                           "measured run must be the only decode with this model (no oracle teacher pass)")
    # The step as the trace records it (measured_step_us: the forward, the next tokens and the step's one
    # device->host copy, by the trace's step clock: thread CPU time on a 1-thread CPU) and its layers by the
    # trace's layer timer: the same quantities calibration fits (tracer.calibrate.tiered) and the demo's
    # Figure 6 sums. The forward hooks' own times (forward only) are kept as `forward_s`.
    complete = steps.pop("layer_rows") > 0
    steps["measured_s"] = steps.pop("measured_step_us") / 1e6
    steps["layers_s"] = (steps.pop("layer_us") / 1e6).where(complete)
    steps["wall_s"], steps["forward_s"] = timer.wall_s, timer.step_s
    return out, steps
