"""Where a calibration ran and everything it measured, for the profile's `provenance`: device, driver, library
versions, date, host facts, threads, clock, statistic, and every raw series, fit and figure (rounded)."""

from __future__ import annotations

import datetime
import platform
from dataclasses import asdict

from tracer.calibrate.derive import overheads_by_decoder
from tracer.calibrate.plan import Calibration


def provenance(cal: Calibration) -> dict:
    import torch
    import transformers

    from thoughtkv_base import __version__, git_commit
    from traces.host import host_facts

    def rounded(obj):
        if isinstance(obj, float):
            return float(f"{obj:.6g}")
        if isinstance(obj, dict):
            return {k: rounded(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [rounded(v) for v in obj]
        return obj

    cuda = torch.version.cuda if cal.device == "cuda" else None
    driver = None
    if cal.device == "cuda":
        try:
            driver = str(torch._C._cuda_getDriverVersion())
        except (AttributeError, RuntimeError):
            driver = None
    return {
        "kind": "measured",
        "tool": "thoughtkv calibrate",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": cal.device,
        "device_name": cal.device_name,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "host_facts": host_facts(),  # identity + load at calibration: simulate/plot/crosscheck compare it
        "driver": driver,
        "cuda": cuda,
        "torch": str(torch.__version__),
        "transformers": str(transformers.__version__),
        "python": platform.python_version(),
        "thoughtkv": __version__,
        "git_commit": git_commit(),
        "threads": cal.threads,
        "clock": cal.clock,
        "statistic": cal.statistic,
        "dtype": cal.dtype,
        "architecture_for_attention": cal.architecture,
        "overhead_decoder": cal.overhead_decoder,
        "cache_geometry": dict(cal.cache_geometry),
        "overheads_by_decoder": rounded(overheads_by_decoder(cal)),
        "plan": rounded(asdict(cal.plan)),
        "figures": rounded(cal.figures),
        "fits": rounded(cal.fits),
        "series": rounded(cal.series),
    }
