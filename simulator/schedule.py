"""The recall -> compute -> offload schedule of one GPU step, written once.

A step runs operations i = 0..n-1 (the layers, then the LM head) for a group of *members*: one sequence,
the n lockstep copies of one (engine.sequence, `batch`), or every request of a serving iteration
(serving.ServingSim). Member j of operation i has a recall (H2D copy) that attention waits for before it and an
offload (D2H copy) after it, each a duration and a byte count (0 = no copy). For each operation:

1. recall: every member's recall for operation i must be done. Copies already in flight (prefetched during
   the operation before, `pending`) are waited for; the others are issued now, in member order, and waited for;
2. layer-prefetch only: the recalls for operation i+1 (for the last operation: the next step's first, given
   as `following_*`) are issued now, while operation i computes;
3. compute: the GPU is busy for `op_s[i]`;
4. offload: every member's offload is issued (in member order); with sync offload the step waits for them.

The step keeps its own clock `t`: waiting for a copy is t = max(t, end) and computing is t += op_s[i], with
no event, because nothing else can observe a GPU the step holds. It yields (a timeout to t) only where another
process could see it: before it issues copies (channels queue copies at env.now, in issue order across
processes) and at the end of the step. A channel's `issue` returns the copy's end time (engine.Channel: known
at issue, no event) or an event that fires at its end (engine.ResourceChannel, the reference); both work here.

Hook points for other transfer mechanisms: `_issue` is where a group of copies becomes channel
copies (per member, or one `coalesce`d copy for the whole group); `op_s` is where a mechanism that competes
with compute would add to an operation's time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import simpy

# (summed bytes) -> the duration of one copy moving a whole group's bytes of one operation (None: per member)
Coalesce = Callable[[str, float], float]


class StepSchedule:
    """The schedule for one process's steps on one machine (`hw`: engine.Hardware). `pending` carries
    prefetched recalls from one step to the next (member key -> channel token)."""

    def __init__(self, env: simpy.Environment, hw, prefetch: bool, async_offload: bool, recall_overhead_s: float,
                 offload_overhead_s: float, coalesce: Coalesce | None = None,
                 on_wait: Callable[[object, float], None] | None = None):
        self.env, self.hw = env, hw
        self.prefetch, self.async_offload = prefetch, async_offload
        self.overhead_s = {"h2d": recall_overhead_s, "d2h": offload_overhead_s}
        self.coalesce = coalesce
        self.on_wait = on_wait  # (member, seconds a copy spent queued beyond its own duration)
        self.pending: dict = {}

    def run(self, op_s: Sequence[float], recall_s: np.ndarray, recall_bytes: np.ndarray, offload_s: np.ndarray,
            offload_bytes: np.ndarray, members: Sequence, keys: Sequence, *, following_s: np.ndarray | None = None,
            following_bytes: np.ndarray | None = None, op_offset: int = 0, track: str | None = None,
            step: int = 0, n_layers: int | None = None):
        """A SimPy process body: one step. Arrays are [member, operation]; `op_offset` numbers the operations
        in timeline labels (the engine numbers them across steps); `track` records one GPU slice per operation."""
        env, hw = self.env, self.hw
        timeline = hw.timeline if track is not None else None
        labelled = hw.timeline is not None  # copy labels are only formatted when a timeline records them
        t = env.now
        for i in range(len(op_s)):
            needs = np.flatnonzero(recall_s[:, i])
            if needs.size:
                tokens, fresh = [], []
                for j in needs.tolist():
                    token = self.pending.pop(keys[j], None)
                    if token is None:
                        fresh.append(j)
                    else:
                        tokens.append(token)
                if fresh:
                    if t > env.now:
                        yield env.timeout(t - env.now)
                    tokens += self._issue(hw.h2d, "h2d", [members[j] for j in fresh], recall_bytes[fresh, i],
                                          recall_s[fresh, i], labelled and f"recall op {op_offset + i}")
                t = yield from self._wait(t, tokens)
            if self.prefetch:
                ahead = np.flatnonzero(following_s[:, i])
                if ahead.size:
                    if t > env.now:
                        yield env.timeout(t - env.now)
                    tokens = self._issue(hw.h2d, "h2d", [members[j] for j in ahead], following_bytes[ahead, i],
                                         following_s[ahead, i], labelled and f"recall op {op_offset + i + 1}")
                    for j, token in zip(ahead.tolist(), tokens):
                        self.pending[keys[j]] = token
            start = t
            t += op_s[i]
            if timeline is not None:
                timeline.span(track, "lm_head" if i == n_layers else f"layer {i}", start, t, step=step)
            moving = np.flatnonzero(offload_s[:, i])
            if moving.size:
                if t > env.now:
                    yield env.timeout(t - env.now)
                tokens = self._issue(hw.d2h, "d2h", [members[j] for j in moving], offload_bytes[moving, i],
                                     offload_s[moving, i], labelled and f"offload op {op_offset + i}")
                if not self.async_offload:
                    t = yield from self._wait(t, tokens)
        if t > env.now:
            yield env.timeout(t - env.now)

    def _issue(self, channel, direction: str, members: list, n_bytes: np.ndarray, durations_s: np.ndarray,
               label) -> list:
        """The copies of a group issued now, in member order; one token per member (its copy's end, or an
        event firing then). With `coalesce`, one copy of the group's summed bytes that every member shares."""
        asked_s = self.env.now
        overhead_s = self.overhead_s[direction]
        if self.coalesce is not None and len(members) > 1:
            total_bytes = float(n_bytes.sum())
            copy_s = self.coalesce(direction, total_bytes)
            token = channel.issue(direction, total_bytes, copy_s, overhead_s, label)
            for member in members:
                self._account(member, token, asked_s, copy_s)
            return [token] * len(members)
        tokens = []
        for member, b, d in zip(members, n_bytes.tolist(), durations_s.tolist()):
            token = channel.issue(direction, b, d, overhead_s, label)
            self._account(member, token, asked_s, d)
            tokens.append(token)
        return tokens

    def _account(self, member, token, asked_s: float, duration_s: float) -> None:
        if self.on_wait is None:
            return
        if isinstance(token, float):
            self.on_wait(member, token - asked_s - duration_s)
        else:
            env = self.env
            token.callbacks.append(lambda _event: self.on_wait(member, env.now - asked_s - duration_s))

    def _wait(self, t: float, tokens: list):
        """Until every token's copy is done: the step's clock afterwards (events are waited for in SimPy)."""
        events = []
        for token in tokens:
            if isinstance(token, float):
                if token > t:
                    t = token
            elif not token.processed:
                events.append(token)
        if events:
            env = self.env
            if t > env.now:
                yield env.timeout(t - env.now)
            yield events[0] if len(events) == 1 else env.all_of(events)
            if env.now > t:
                t = env.now
        return t
