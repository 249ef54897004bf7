"""Which machine a measurement came from, and whether two measurements came from the same one. Torch-free.

Calibration writes `host_facts()` into a measured profile's `provenance.host_facts`; every trace run writes
them into `run.json["hardware"]["host_facts"]`. A measured profile says how fast *that* machine was on *that*
day; applying it to a run traced elsewhere compares two machines, so `simulate`, `plot` and `crosscheck` warn
(`provenance_warning`). Same host = same hostname, CPU model and core count (a container's hostname changes
per boot, so a profile calibrated before a restart of an identical box still warns: calibrate where you measure).
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
from pathlib import Path

IDENTITY_KEYS = ("hostname", "cpu_model", "cpu_count")


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo `model name`), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask a container or `taskset` sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory_bytes() -> int:
    """Memory a new allocation can take without swapping (Linux MemAvailable), else the physical RAM. The one
    reading of it: the tracer's preflight and the simulator's size estimates (synth, sweep) both ask here."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_facts() -> dict:
    """This machine, now: identity (hostname, CPU model, cores) and state (load, date)."""
    load, cpus = load_average(), usable_cpus()
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count() or 1,
        "usable_cpus": cpus,
        "machine": platform.machine(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "load_avg_1m": load,
        "contended": is_contended(load, cpus),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def is_contended(load_avg_1m: float | None, cpus: int) -> bool | None:
    """Other work competed for the CPUs: more runnable processes than CPUs (None when unknown)."""
    if load_avg_1m is None:
        return None
    return load_avg_1m > cpus


def describe(facts: dict | None) -> str:
    if not facts:
        return "an unrecorded host"
    return f"{facts.get('hostname', '?')} ({facts.get('cpu_model', '?')}, {facts.get('cpu_count', '?')} cores)"


def same_host(a: dict | None, b: dict | None) -> bool | None:
    """True/False when both sides recorded their host, None when one did not (an older profile or run)."""
    if not a or not b:
        return None
    return all(a.get(key) == b.get(key) for key in IDENTITY_KEYS)


def provenance_warning(profile_name: str, profile_provenance: dict, run_label: str, run_hardware: dict) -> str | None:
    """One line when a *measured* profile is applied to a run traced on another (or an unknown) host."""
    if (profile_provenance or {}).get("kind") != "measured":
        return None
    profile_host = profile_provenance.get("host_facts")
    run_host = (run_hardware or {}).get("host_facts")
    same = same_host(profile_host, run_host)
    if same:
        return None
    if same is None:
        which = "the profile" if not profile_host else "the run"
        return (f"warning: measured profile {profile_name} applied to {run_label}, but {which} does not record "
                "its host; calibrate where you trace (`thoughtkv calibrate`) to compare like with like")
    return (f"warning: measured profile {profile_name} was calibrated on {describe(profile_host)}, but {run_label} "
            f"was traced on {describe(run_host)}; calibrate on the tracing machine to compare like with like")
