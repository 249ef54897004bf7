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

A lockstep batch of n (`--batch n`) on a link with one copy engine per direction is the same recurrence: the DES
issues the n members' copies of an operation at one instant, back to back in one FIFO queue, so the last ends
when one copy of their summed duration would (r and o above become n r and n o). Cases outside these (a
lockstep batch on several copy engines per direction, a half-duplex link with async offload, several copy
engines per direction with async offload) share a resource between transfers in ways a sum does not capture;
`applies` says so and the DES is used instead.

With a host model (costs.host_times: lead_s, step_s) the steps are no longer one cumulative sum: step s begins
when the previous token is out (T_s = E_{s-1}); its first operation starts at T_s + lead_s + r_first (with
layer-prefetch: max(T_s + lead_s, S_head(s-1) + r_first), the recall issued as the previous LM head started);
the operations after it keep their offsets within the step (the same gaps as above), and the step ends at
E_s = max(GPU end, T_s + step_s). That is a scalar recurrence over steps on top of the per-step cumulative sums.
"""

from __future__ import annotations

import numpy as np

from hwprofiles import HardwareProfile
from simulator.engine import engines_per_channel
from simulator.workload import Timing, Workload


def applies(work: Workload, profile: HardwareProfile, overlap: str, async_offload: bool) -> bool:
    if work.batch != 1 and engines_per_channel(profile) != 1:
        return False
    if not async_offload:
        return overlap == "none" or profile.link.full_duplex or engines_per_channel(profile) == 1
    return profile.link.full_duplex and engines_per_channel(profile) == 1


def run_fast(work: Workload, profile: HardwareProfile, overlap: str = "none", async_offload: bool = True) -> Timing:
    if not applies(work, profile, overlap, async_offload):
        raise ValueError("the fast path only covers a single sequence without shared transfers; use the DES")
    # (a lockstep batch: its members' copies of an operation, back to back on one engine, as one copy)
    c, r, o = work.compute_s, work.batch * work.recall_s, work.batch * work.offload_s
    r_next = np.append(r[1:], 0.0)  # the recall waited for before the next operation
    if overlap == "none":
        gap = c + r_next + (0.0 if async_offload else o)
    elif async_offload:
        gap = np.maximum(c, r_next)
    elif profile.link.full_duplex:
        gap = np.maximum(c + o, r_next)
    else:
        gap = np.maximum(c, r_next) + o
    per_step = work.ops_per_step
    if work.host.lead_s or work.host.step_s:
        start, step_end_s = _host_schedule(work, gap, r, o, overlap == "layer-prefetch", async_offload)
        end = start + c
    else:
        start = r[0] + np.concatenate([[0.0], np.cumsum(gap[:-1])])
        end = start + c  # end of each operation's compute
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
        h2d_bytes=float(work.batch * work.recall_bytes.sum()),
        d2h_bytes=float(work.batch * work.offload_bytes.sum()),
    )


def _host_schedule(work: Workload, gap: np.ndarray, r: np.ndarray, o: np.ndarray, prefetch: bool,
                   async_offload: bool):
    """(start of every operation, end of every step) under a host model (module docstring): the within-step
    offsets are cumulative sums of `gap`; the steps' starts and ends a scalar recurrence."""
    n, per_step = work.n_steps, work.ops_per_step
    lead_s, host_s = work.host.lead_s, work.host.step_s
    rel = np.zeros((n, per_step))
    rel[:, 1:] = np.cumsum(gap.reshape(n, per_step)[:, :-1], axis=1)  # offsets from the step's first operation
    head_c = work.compute_s[per_step - 1 :: per_step]
    head_o = 0.0 if async_offload else o[per_step - 1 :: per_step]
    gpu_end_rel = (rel[:, -1] + head_c + head_o).tolist()
    head_rel = rel[:, -1].tolist()
    r_first = r[::per_step].tolist()
    first = [0.0] * n
    step_end = [0.0] * n
    step_start = head_start = 0.0
    for s in range(n):
        ready = step_start + lead_s  # the host has issued the ops before the first matmul
        if prefetch and s > 0 and r_first[s] > 0:
            first_s = max(ready, head_start + r_first[s])  # issued as the previous LM head started
        else:
            first_s = ready + r_first[s]
        first[s] = first_s
        head_start = first_s + head_rel[s]
        step_start = step_end[s] = max(first_s + gpu_end_rel[s], step_start + host_s)
    start = (np.asarray(first)[:, None] + rel).ravel()
    return start, np.asarray(step_end)
