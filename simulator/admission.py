"""The serving scheduler, written once: before each batch iteration, which requests run and with how many tokens,
which are admitted and which are preempted; after it, which emitted a token. Both serving engines call it (the
SimPy DES, serving.ServingSim, and the fast path, serving_fast.FastServing), so they schedule alike by
construction; what they differ in, and are held equal on by tests/test_serving_fast.py, is the time an
iteration takes.

The order is vLLM's V1 scheduler's (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`), with its token
budget `max_batched_tokens` (B) per iteration:

1. Running requests, in admission order. A decoding request takes 1 token of B; one still prefilling takes what
   is left of its prompt, up to what B has left (chunked prefill: decodes first, then prefill chunks). Each
   needs the KV blocks it holds after the iteration; when they do not fit in HBM (or its offloaded KV in its
   tier), the most recently admitted running request is preempted, again until they fit, or until the request
   itself was the one preempted.
2. Only if no request was preempted: waiting requests, FCFS (no overtaking), while B has tokens left, fewer
   than `max_batch` run and the head's blocks fit. A preempted request waits at the head of the queue.

What a request holds in HBM (`--admission`):
- `paged`: at a decode of traced step s, the KV its trace holds in HBM at that step (`hbm_kv_bytes[s]`, all
  layers, recall buffers included); during a prefill of N tokens, after x of them, F x ceil(x / block) /
  ceil(N / block) (F: that prefill's traced HBM bytes).
- `peak`: its peak HBM KV from admission to its end. Nothing grows, so nothing is preempted: a request is
  admitted when its peak fits (the reservation rule before paged admission existed).
Its offloaded KV (DDR, or a spill chain's tier) is reserved at its peak offloaded bytes at its first admission --
in DDR while DDR's reservations leave room for it, else in the spill tier, else it waits -- and kept to its end,
through preemptions (a recompute re-writes it into that reservation). Host tiers are the large ones; reserving
them keeps every preemption an HBM one, so the oldest running request always progresses.

Preemption (`--preempt`):
- `recompute` (vLLM's): the request's HBM KV is freed; when it resumes it prefills again the prompt and the
  tokens it generated (P + s for a request whose next step is s, chunked like any prefill) and the last chunk
  emits token s. That prefill attends everything in HBM, as the traced prefill does, and its offloads re-write
  the request's DDR KV of step s (one D2H copy of ddr_kv_bytes[s] / L after each layer). `recomputed_tokens`
  counts the KV tokens dropped (P + s - 1 for a decoding request, the chunks done for a prefilling one).
- `swap`: a decoding request's HBM blocks are copied to host DDR (D2H at the start of the iteration, the GPU
  waiting for it, as vLLM's V0 swap-out before the forward pass) and back (H2D) when it resumes, into the blocks
  of the step it resumes at. The swapped bytes hold a swap space in DDR (its own pool, up to DDR's capacity,
  beside the offloaded KV's reservations); when it has no room, or the request is still prefilling, the request
  is recomputed instead.

A running request emits one token per iteration from the iteration its prefill ends until it finishes or is
preempted (every running request is scheduled each iteration: B >= max_batch, and only the last admitted can
still be prefilling), so its token times are slices ("streaks") of the engine's iteration end times.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from simulator import costs
from simulator.errors import ServingError

DDR, SPILL = 0, 1


@dataclass
class Plan:
    """One iteration's schedule: entries in running order (arrays over entries) and the swaps before it."""

    rids: np.ndarray  # request ids
    steps: np.ndarray  # the traced step each runs (a decode's step; a prefill's: 0, or s for a recompute's)
    tokens: np.ndarray  # query tokens this iteration (1 for a decode, the chunk for a prefill)
    whole: np.ndarray  # bool: runs its traced step as traced (a decode, or a prefill of the prompt in one piece)
    final: np.ndarray  # bool: emits a token at the end of the iteration
    offset: np.ndarray  # prefill tokens done before this chunk (0 for a decode)
    target: np.ndarray  # the prefill's tokens (0 for a decode)
    refill: np.ndarray  # bool: a recompute's prefill (prompt + generated tokens: no traced row)
    goes_on: np.ndarray  # bool: decodes its next traced step next iteration (the step layer-prefetch recalls)
    hbm_bytes: float  # the KV the entries hold at their step (occupancy), all layers
    ddr_bytes: float
    swap_out: list = field(default_factory=list)  # (request, bytes) copied D2H before the iteration
    swap_in: list = field(default_factory=list)  # (request, bytes) copied H2D before the iteration
    preempted: list = field(default_factory=list)  # requests preempted while planning it
    admitted: list = field(default_factory=list)  # requests admitted for the first time (their tier is set)

    def __len__(self) -> int:
        return len(self.rids)


class Scheduler:
    """Admission, chunking and preemption for one serving run. `hbm_kv` / `ddr_kv`: every sample's per-step KV
    bytes stacked (a request at step s reads row `row0[request] + s`); capacities in bytes of KV."""

    def __init__(self, *, admission: str, preempt: str, budget: int, max_batch: int, block_tokens: int,
                 hbm_kv: np.ndarray, ddr_kv: np.ndarray, row0: np.ndarray, n_steps: np.ndarray, prompt: np.ndarray,
                 peak_hbm: np.ndarray, peak_ddr: np.ndarray, kv_capacity_bytes: float, ddr_capacity_bytes: float,
                 spill_capacity_bytes: float):
        self.paged, self.swap = admission == "paged", preempt == "swap"
        self.budget, self.max_batch, self.block_tokens = int(budget), int(max_batch), max(1, int(block_tokens))
        self.hbm_kv, self.ddr_kv = hbm_kv, ddr_kv
        self.row0, self.n_steps, self.prompt = row0, n_steps, np.maximum(prompt, 1)
        self.peak_hbm, self.peak_ddr = peak_hbm, peak_ddr
        # HBM, DDR (offloaded KV's reservations), the spill tier, DDR's swap space
        self.capacity = (float(kv_capacity_bytes), float(ddr_capacity_bytes), float(spill_capacity_bytes),
                         float(ddr_capacity_bytes))
        n = len(row0)
        self.step = np.zeros(n, dtype=np.int64)  # next traced step to run
        self.fill_target = np.where(n_steps > 0, self.prompt, 0).astype(np.int64)  # > 0: still prefilling
        self.fill_done = np.zeros(n, dtype=np.int64)
        self.held_hbm = np.zeros(n)  # HBM bytes held now
        self.held_ddr = np.zeros(n)  # its offload tier's reservation (its peak offloaded bytes, once admitted)
        self.tier = np.full(n, DDR, dtype=np.int64)
        self.placed = np.zeros(n, dtype=bool)  # its offload tier chosen (first admission)
        self.swapped = np.zeros(n)  # HBM bytes it has in DDR's swap space (0: not swapped out)
        self.used = [0.0, 0.0, 0.0, 0.0]  # as `capacity`
        self.running = np.zeros(0, dtype=np.int64)  # admission order
        self.waiting: deque[int] = deque()
        self.admitted_s = np.full(n, math.nan)  # first admission
        self.queued_s = np.full(n, math.nan)  # when it last joined the queue
        self.wait_s = np.zeros(n)  # all its time in the queue (first wait and after preemptions)
        self.preemptions = np.zeros(n, dtype=np.int64)
        self.recomputed = np.zeros(n, dtype=np.int64)
        self.swapped_out = np.zeros(n)  # bytes it swapped out, over the run
        self.streak = np.full(n, -1, dtype=np.int64)  # iteration its current token streak began (-1: none)
        self.streaks: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (first iteration, tokens)
        self.queue_changes: list[tuple[float, int]] = [(0.0, 0)]
        self.n_recomputed_preemptions = self.n_swapped_preemptions = 0

    # -- the queue ------------------------------------------------------------------------------------------

    def arrive(self, rid: int, now: float) -> None:
        self.waiting.append(rid)
        self.queued_s[rid] = now
        self.queue_changes.append((now, len(self.waiting)))

    @property
    def idle(self) -> bool:
        return not len(self.running) and not self.waiting

    # -- what a request holds ---------------------------------------------------------------------------------

    def _fill_need(self, rid: int, done_after: int) -> float:
        """HBM bytes a prefilling request holds once `done_after` of its tokens are done."""
        if not self.paged:
            return float(self.peak_hbm[rid])
        row = self.row0[rid] + self.step[rid]
        target = int(self.fill_target[rid])
        if done_after >= target:
            return float(self.hbm_kv[row])
        blocks = self.block_tokens
        return float(self.hbm_kv[row]) * (-(-done_after // blocks)) / (-(-target // blocks))

    def _decode_need(self, rids: np.ndarray) -> np.ndarray:
        if not self.paged:
            return np.array(self.peak_hbm[rids], dtype=np.float64)
        return np.array(self.hbm_kv[self.row0[rids] + self.step[rids]], dtype=np.float64)

    def _fits(self, rid: int, need: float) -> bool:
        return self.used[0] + (need - self.held_hbm[rid]) <= self.capacity[0]

    def _hold(self, rid: int, need: float) -> None:
        self.used[0] += need - self.held_hbm[rid]
        self.held_hbm[rid] = need

    # -- one iteration ----------------------------------------------------------------------------------------

    def plan(self, now: float, iteration: int) -> Plan:
        """The next iteration's entries (possibly none: nothing runs and the queue's head must wait)."""
        budget = self.budget
        swap_out, swap_in, preempted = [], [], []
        run = self.running
        tokens = np.ones(len(run), dtype=np.int64)
        filling = self.fill_target[run] > 0
        if filling.any():  # prefills (the last admitted only: see the module docstring) take what decodes leave
            left = budget - int((~filling).sum())
            for k in np.flatnonzero(filling).tolist():
                rid = int(run[k])
                tokens[k] = max(0, min(int(self.fill_target[rid] - self.fill_done[rid]), left))
                left -= int(tokens[k])
            starved = np.flatnonzero(tokens == 0)
            if len(starved):
                if not filling[starved[0]:].all():
                    raise ServingError("internal: a decode queued behind a starved prefill; please report this")
                run = run[:starved[0]]
        need = self._decode_need(run)
        for k in np.flatnonzero(filling[:len(run)]).tolist():
            rid = int(run[k])
            need[k] = self._fill_need(rid, int(self.fill_done[rid] + tokens[k]))
        candidates, scheduled, capacity = len(run), 0, self.capacity[0]
        while scheduled < min(candidates, len(self.running)):
            # every entry from `scheduled` on that fits in order, at once; then a preemption, and again
            end = min(candidates, len(self.running))
            chunk = self.running[scheduled:end]
            delta = need[scheduled:end] - self.held_hbm[chunk]
            over = np.flatnonzero(self.used[0] + np.cumsum(delta) > capacity)
            fit = end - scheduled if not len(over) else int(over[0])
            if fit:
                self.used[0] += float(delta[:fit].sum())
                self.held_hbm[chunk[:fit]] = need[scheduled:scheduled + fit]
                scheduled += fit
            if scheduled >= end:
                break
            rid = int(self.running[scheduled])  # does not fit: preempt the last admitted until it does
            while not self._fits(rid, float(need[scheduled])):
                victim = int(self.running[-1])
                self._preempt(victim, now, iteration, swap_out)
                preempted.append(victim)
                if victim == rid:
                    break
            if preempted and preempted[-1] == rid:
                break
            self._hold(rid, float(need[scheduled]))
            scheduled += 1
        run = self.running[:scheduled]
        tokens = tokens[:scheduled].tolist()
        rids = run.tolist()
        admitted, first_time = [], []
        if not preempted:  # then the queue, FCFS, while the budget lasts and the head's blocks fit
            left = budget - sum(tokens)
            while self.waiting and left > 0 and len(self.running) + len(admitted) < self.max_batch:
                head = self.waiting[0]
                new = not self.placed[head]
                n = self._admit(head, left, now, swap_in)
                if n == 0:
                    break
                self.waiting.popleft()
                self.queue_changes.append((now, len(self.waiting)))
                admitted.append(head)
                if new:
                    first_time.append(head)
                rids.append(head)
                tokens.append(n)
                left -= n
            if admitted:
                self.running = np.concatenate([self.running, np.array(admitted, dtype=np.int64)])
        plan = self._entries(np.array(rids, dtype=np.int64), np.array(tokens, dtype=np.int64), swap_out, swap_in,
                             preempted)
        plan.admitted = first_time
        return plan

    def _admit(self, rid: int, left: int, now: float, swap_in: list) -> int:
        """Admit the queue's head if its blocks fit: the tokens it runs this iteration, else 0."""
        if self.swapped[rid] > 0:  # back from a swap: its blocks return, then it decodes its next step
            need = float(self._decode_need(np.array([rid]))[0])
            if not self._fits(rid, need):
                return 0
            swap_in.append((rid, float(self.swapped[rid])))
            self.used[3] -= self.swapped[rid]
            self.swapped[rid] = 0.0
            n = 1
        else:
            if not self.placed[rid]:  # its offloaded KV's tier and reservation (a spill chain: DDR while it has room)
                peak = float(self.peak_ddr[rid])
                tier = DDR if self.used[1] + peak <= self.capacity[1] else SPILL
                if self.used[1 + tier] + peak > self.capacity[1 + tier]:
                    return 0
            n = min(int(self.fill_target[rid] - self.fill_done[rid]), left)
            need = self._fill_need(rid, int(self.fill_done[rid] + n))
            if not self._fits(rid, need):
                return 0
            if not self.placed[rid]:
                self.placed[rid] = True
                self.tier[rid] = tier
                self.held_ddr[rid] = peak
                self.used[1 + tier] += peak
        self._hold(rid, need)
        if math.isnan(self.admitted_s[rid]):
            self.admitted_s[rid] = now
        self.wait_s[rid] += now - self.queued_s[rid]
        return n

    def _preempt(self, rid: int, now: float, iteration: int, swap_out: list) -> None:
        self.running = self.running[:-1]  # the victim is always the last admitted
        self.preemptions[rid] += 1
        if self.streak[rid] >= 0:  # its tokens so far: one per iteration since its streak began
            self.streaks[rid].append((int(self.streak[rid]), iteration - int(self.streak[rid])))
            self.streak[rid] = -1
        held = float(self.held_hbm[rid])
        decoding = self.fill_target[rid] == 0
        if self.swap and decoding and self.used[3] + held <= self.capacity[3]:
            swap_out.append((rid, held))
            self.used[3] += held
            self.swapped[rid] = held
            self.swapped_out[rid] += held
            self.n_swapped_preemptions += 1
        else:
            self.recomputed[rid] += int(self.prompt[rid] + self.step[rid] - 1) if decoding else int(self.fill_done[rid])
            self.fill_target[rid] = int(self.prompt[rid] + self.step[rid])
            self.fill_done[rid] = 0
            self.n_recomputed_preemptions += 1
        self._hold(rid, 0.0)
        self.waiting.appendleft(rid)
        self.queued_s[rid] = now
        self.queue_changes.append((now, len(self.waiting)))

    def _entries(self, rids, tokens, swap_out, swap_in, preempted) -> Plan:
        steps = self.step[rids]
        target = self.fill_target[rids]
        rows = self.row0[rids] + steps
        filling = target > 0
        if not filling.any():  # decodes only (most iterations)
            ones = np.ones(len(rids), dtype=bool)
            return Plan(rids=rids, steps=steps, tokens=np.ones(len(rids), dtype=np.int64), whole=ones, final=ones,
                        offset=target, target=target, refill=~ones, goes_on=steps + 1 < self.n_steps[rids],
                        hbm_bytes=float(self.held_hbm[rids].sum()),
                        ddr_bytes=float(self.ddr_kv[rows].sum()) + self.used[3], swap_out=swap_out, swap_in=swap_in,
                        preempted=preempted)
        offset = self.fill_done[rids]
        final = ~filling | (offset + tokens >= target)
        return Plan(rids=rids, steps=steps, tokens=np.where(filling, tokens, 1),
                    whole=~filling | ((steps == 0) & (offset == 0) & (tokens >= target)), final=final,
                    offset=np.where(filling, offset, 0), target=target, refill=filling & (steps > 0),
                    goes_on=final & (steps + 1 < self.n_steps[rids]), hbm_bytes=float(self.held_hbm[rids].sum()),
                    ddr_bytes=float(np.where(final, self.ddr_kv[rows], 0.0).sum()) + self.used[3],
                    swap_out=swap_out, swap_in=swap_in, preempted=preempted)

    def finish(self, plan: Plan, iteration: int) -> np.ndarray:
        """After the iteration (index `iteration`): prefill progress, steps, token streaks; returns the requests
        that finished (their KV freed)."""
        rids = plan.rids
        if not len(rids):
            return rids
        filling = plan.target > 0
        if filling.any():
            self.fill_done[rids[filling]] += plan.tokens[filling]
        emitted = rids[plan.final]
        self.fill_target[emitted] = 0
        self.fill_done[emitted] = 0
        self.step[emitted] += 1
        starting = emitted[self.streak[emitted] < 0]
        self.streak[starting] = iteration
        done = emitted[self.step[emitted] >= self.n_steps[emitted]]
        if len(done):
            for rid in done.tolist():
                self.streaks[rid].append((int(self.streak[rid]), iteration + 1 - int(self.streak[rid])))
                self.streak[rid] = -1
                self._hold(rid, 0.0)
                self.used[1 + int(self.tier[rid])] -= self.held_ddr[rid]
                self.held_ddr[rid] = 0.0
            self.running = self.running[~np.isin(self.running, done)]
        return done

    # -- results ----------------------------------------------------------------------------------------------

    def token_times(self, rid: int, iteration_end_s: np.ndarray) -> np.ndarray:
        """The times of a request's tokens: its streaks' slices of the iteration end times."""
        parts = [iteration_end_s[start:start + count] for start, count in self.streaks[rid]]
        return np.concatenate(parts) if parts else np.zeros(0)

    @property
    def reserved(self) -> tuple[float, float]:
        """(HBM, DDR) bytes held now: HBM blocks (or peak reservations) and DDR's reservations + swap space."""
        return self.used[0], self.used[1] + self.used[3]


# ---------------------------------------------------------------- shared by both engines ----------------------


def scheduler_for(config, profile, works: list, requests: list, sample_of, memory, block_tokens: int) -> Scheduler:
    """The Scheduler of a serving run: `requests` (serving.Request, replaying works[sample_of[i]] cut to their
    tokens), `memory` (tiers.serving_memory) and the run's KV block size in tokens."""
    bases = np.concatenate([[0], np.cumsum([w.n_steps for w in works])[:-1]]).astype(np.int64)
    sample_of = np.asarray(sample_of, dtype=np.int64)
    return Scheduler(
        admission=config.admission, preempt=config.preempt,
        budget=config.batched_tokens(profile.gpu.hbm_capacity_bytes, f"{profile.gpu.name} {profile.name}"),
        max_batch=config.max_batch, block_tokens=block_tokens,
        hbm_kv=np.concatenate([w.hbm_kv_bytes for w in works]), ddr_kv=np.concatenate([w.ddr_kv_bytes for w in works]),
        row0=bases[sample_of] if len(sample_of) else np.zeros(0, dtype=np.int64),
        n_steps=np.array([r.work.n_steps for r in requests], dtype=np.int64),
        prompt=np.array([r.work.prompt_tokens for r in requests], dtype=np.int64),
        peak_hbm=np.array([r.work.peak_hbm_kv_bytes for r in requests], dtype=np.float64),
        peak_ddr=np.array([r.work.peak_ddr_kv_bytes for r in requests], dtype=np.float64),
        kv_capacity_bytes=memory.kv_capacity_bytes, ddr_capacity_bytes=memory.ddr_capacity_bytes,
        spill_capacity_bytes=memory.spill_capacity_bytes)


def prefill_demand(shape, tokens: int, offset: int, target: int, query0=None, attended0=None):
    """A prefill chunk's per-layer demand ([layers] arrays: query tokens, attended tokens, attention FLOPs and
    bytes): `tokens` of a prefill of `target` tokens after `offset` of them. The prompt's traced prefill
    (`query0`, `attended0`: its step-0 row) keeps that row's per-layer counts (a chunk is its share of the query
    tokens, attending what came before it); a recompute's (None) attends every token before it in every layer."""
    if query0 is None:
        q = np.full(shape.n_layers, float(tokens))
        a = np.full(shape.n_layers, float(offset + tokens))
    else:
        share = np.asarray(query0, dtype=np.float64) / target
        q = tokens * share
        a = (np.asarray(attended0, dtype=np.float64) - query0) + (offset + tokens) * share
    flops, kv_bytes = costs.attention_flops_bytes(shape, q, a)
    return q, a, flops, kv_bytes


def record_requests(requests: list, scheduler: Scheduler, iteration_end_s, link_wait, spill_works, sample_of) -> None:
    """Fill the Request records serving.summarise reads: admission, token times, waits, link wait, tier."""
    ends = np.asarray(iteration_end_s, dtype=np.float64)
    for r in requests:
        rid = r.rid
        r.link_wait_s = float(link_wait[rid])
        r.preemptions = int(scheduler.preemptions[rid])
        r.recomputed_tokens = int(scheduler.recomputed[rid])
        r.swapped_bytes = float(scheduler.swapped_out[rid])
        r.wait_s = float(scheduler.wait_s[rid])
        if scheduler.placed[rid] and scheduler.tier[rid] == SPILL:
            r.spilled = True
            r.work = spill_works[int(sample_of[rid])].truncated(r.work.n_steps)
        if r.rejected or math.isnan(scheduler.admitted_s[rid]):
            continue
        r.admitted_s = float(scheduler.admitted_s[rid])
        times = scheduler.token_times(rid, ends)
        if not len(times):
            continue
        r.first_token_s = float(times[0])
        if len(times) == r.work.n_steps:
            r.finish_s = r.last_token_s = float(times[-1])
        r.step = len(times)
        r.tbt_s = np.diff(times)


def iteration_layer_s(shape, profile, decode, prefill):
    """[layers] times of an iteration's layer operations (costs.kernel_total_s) from its decodes' and its
    prefills' summed demand, [3, layers] each (query tokens, attention FLOPs, attention bytes; None: none)."""
    zeros = np.zeros(shape.n_layers)
    d = decode if decode is not None else (zeros, zeros, zeros)
    p = prefill if prefill is not None else (zeros, zeros, zeros)
    return costs.kernel_total_s(shape, profile, d[0] + p[0], d[1], d[2], p[1], p[2])
