"""The fast path: the DES's schedule for one sequence alone on a machine, in closed form with numpy.

With one sequence and nothing else on the machine, the DES's schedule is a recurrence over operations
i = 0..n-1 (c = compute_s, r = recall_s, o = offload_s of workload.py; S_i = start of operation i's compute):

- overlap none, synchronous offload:      S_{i+1} = S_i + c_i + o_i + r_{i+1}
- overlap none, async offload:            S_{i+1} = S_i + c_i + r_{i+1}            (full duplex)
- layer-prefetch, synchronous offload:    S_{i+1} = S_i + max(c_i + o_i, r_{i+1})  (full duplex)
                                          S_{i+1} = S_i + max(c_i, r_{i+1}) + o_i  (half duplex: the
                                             recall, issued first, holds the shared link before the offload)
- layer-prefetch, async offload:          S_{i+1} = S_i + max(c_i, r_{i+1})        (full duplex)

so S is a cumulative sum. Async offloads (full duplex) never delay the sequence; with one copy engine per
direction they form a FIFO queue whose end is the max-plus form of  end_k = max(ready_k, end_{k-1}) + o_k:
end_n = C_n + max_k (ready_k - C_{k-1}) with C the cumulative sum of durations.

Cases outside these (a lockstep batch, a half-duplex link with async offload, several copy engines per
direction with async offload) share a resource between transfers of the same sequence; `applies` says so
and the DES is used instead.
"""

from __future__ import annotations

import numpy as np

from hwprofiles import HardwareProfile
from simulator.engine import engines_per_channel
from simulator.workload import Timing, Workload


def applies(work: Workload, profile: HardwareProfile, overlap: str, async_offload: bool) -> bool:
    if work.batch != 1:
        return False
    if not async_offload:
        return overlap == "none" or profile.link.full_duplex or engines_per_channel(profile) == 1
    return profile.link.full_duplex and engines_per_channel(profile) == 1


def run_fast(work: Workload, profile: HardwareProfile, overlap: str = "none", async_offload: bool = True) -> Timing:
    if not applies(work, profile, overlap, async_offload):
        raise ValueError("the fast path only covers a single sequence without shared transfers; use the DES")
    c, r, o = work.compute_s, work.recall_s, work.offload_s
    r_next = np.append(r[1:], 0.0)  # the recall waited for before the next operation
    if overlap == "none":
        gap = c + r_next + (0.0 if async_offload else o)
    elif async_offload:
        gap = np.maximum(c, r_next)
    elif profile.link.full_duplex:
        gap = np.maximum(c + o, r_next)
    else:
        gap = np.maximum(c, r_next) + o
    start = r[0] + np.concatenate([[0.0], np.cumsum(gap[:-1])])
    end = start + c  # end of each operation's compute
    per_step = work.ops_per_step
    step_end_s = end[per_step - 1 :: per_step]
    if not async_offload:
        # A synchronous offload after the LM head (never: head ops move nothing) would extend the step.
        step_end_s = step_end_s + o[per_step - 1 :: per_step]

    last_d2h_end = 0.0
    moving = o > 0
    if moving.any():
        if async_offload:
            ready, duration = end[moving], o[moving]
            cumulative = np.cumsum(duration)
            last_d2h_end = float(cumulative[-1] + np.max(ready - (cumulative - duration)))
        elif overlap == "layer-prefetch" and not profile.link.full_duplex:
            # the offload waits for the next operation's recall, issued earlier on the shared link
            last_d2h_end = float((np.maximum(end, start + r_next) + o)[moving][-1])
        else:
            last_d2h_end = float((end + o)[moving][-1])
    return Timing(
        step_end_s=step_end_s,
        h2d_busy_s=float(r.sum()),
        d2h_busy_s=float(o.sum()),
        last_d2h_end_s=last_d2h_end,
        h2d_bytes=float(work.recall_bytes.sum()),
        d2h_bytes=float(work.offload_bytes.sum()),
    )
