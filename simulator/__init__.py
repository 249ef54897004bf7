"""SimPy discrete-event replay of trace runs against hardware profiles, with an exact fast path.

    from simulator import SimOptions, simulate_run
    result = simulate_run("runs/r1", "h200-sxm", SimOptions(overlap="layer-prefetch"))   # .samples .steps .summary

Modules: options (SimOptions: how a run is simulated, and the flags generated from it), costs (the cost model),
workload (a sample as operations), schedule (recall -> compute -> offload of one GPU step), engine (the DES),
fastpath (closed form), placement (block placement in numpy), whatif (replay of recorded masses), synth
(synthetic traces), simulate (simulate_run), columns (its results' columns), cli (`thoughtkv simulate`),
serving / sweep (+ their CLIs). See simulator/README.md.

Names are imported lazily so that `thoughtkv --help` does not pay for pandas and SimPy.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "simulate_run": "simulator.simulate",
    "SimResult": "simulator.simulate",
    "SimulationError": "simulator.errors",
    "SimOptions": "simulator.options",
    "ModelShape": "simulator.costs",
    "layer_flops_bytes": "simulator.costs",
    "head_flops_bytes": "simulator.costs",
    "layer_times": "simulator.costs",
    "head_times": "simulator.costs",
    "roofline": "simulator.costs",
    "transfer_s": "simulator.costs",
    "Hardware": "simulator.engine",
    "Channel": "simulator.engine",
    "ResourceChannel": "simulator.engine",
    "Timeline": "simulator.engine",
    "run_des": "simulator.engine",
    "run_fast": "simulator.fastpath",
    "Workload": "simulator.workload",
    "build_workload": "simulator.workload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'simulator' has no attribute {name!r}")
