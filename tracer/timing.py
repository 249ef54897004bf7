"""How the trace times a step and each decoder layer: the step's clock (`step_clock`, recorded in run.json) and
`LayerTimer` (`measured_layer_us`, and apart the deferred work of layers placed together: `measured_deferred_us`).
"""

from __future__ import annotations

import time

import torch


def step_clock(device) -> tuple[str, callable]:
    """The clock a step's `measured_step_us` is read with, and its name (recorded in run.json): on a CPU with one
    intra-op thread, the decode thread's CPU time — all of a step's work runs on it, it is what `thoughtkv
    calibrate` times, and other processes' turns on a shared machine do not inflate it; otherwise (CUDA, or
    several CPU threads whose work this thread's CPU time would miss) the wall clock."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return "thread_cpu", time.thread_time
    return "wall", time.perf_counter


class LayerTimer:
    """Each decoder layer's time in a forward pass (`measured_layer_us`), from a timing wrapper around each
    layer's `forward` (an instance attribute, removed by `close`). Not forward hooks: a module with hooks runs
    every call through `Module._call_impl`'s slow path (about twice the per-call cost of an empty module).

    CUDA: a pair of timing events per layer, recorded on the compute stream and read only after the step's
    own synchronisation (`read_us`), so timing adds no host sync; the time is the GPU time between the layer's
    first and last kernel. CPU: the wall time of the layer's forward. A batched step's layer time covers all its
    rows (as the step time does).

    A decode step of layers alike defers every layer's scoring, recording and placement to the end of its last
    layer's forward (tracer.cache.step.after_attention_of_layers), so that layer's time includes them: the cache
    brackets that work with `begin_deferred` / `end_deferred` (`TieredCache.layer_timer`), and `read_deferred_us`
    gives it per layer (`measured_deferred_us`: the deferred work that ran inside each layer's forward, 0 where
    none did; a layer's own time is `measured_layer_us - measured_deferred_us`).
    """

    def __init__(self, model):
        from tracer.models import decoder_layers

        self.cuda = model.device.type == "cuda"
        self.clock = step_clock(model.device)[1]  # the step's own clock, so layer times add up within it
        self.layers = decoder_layers(model)
        n = len(self.layers)
        if self.cuda:
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        self.begun, self.ended = [0.0] * n, [0.0] * n
        self.current = 0  # the layer whose forward runs (deferred work is timed against it)
        # This forward's deferred runs: (layer, begin, end) as clock stamps (CPU) or a pair of events (CUDA).
        self.deferred: list[list] = []
        self.wrappers = [self._timed(index, layer.forward) for index, layer in enumerate(self.layers)]
        for layer, wrapper in zip(self.layers, self.wrappers, strict=True):
            layer.forward = wrapper

    def _timed(self, index: int, forward):
        def timed_forward(*args, **kwargs):
            if not self.layers:  # closed while another timer's wrapper sat on top: pass through
                return forward(*args, **kwargs)
            self._mark(index, 0)
            out = forward(*args, **kwargs)
            self._mark(index, 1)
            return out
        timed_forward.unwrapped, timed_forward.timer = forward, self
        return timed_forward

    def _mark(self, index: int, end: int) -> None:
        if not end:
            self.current = index
            if index == 0:  # a forward begins
                self.deferred.clear()
        if self.cuda:
            self.events[index][end].record()
        else:
            (self.ended if end else self.begun)[index] = self.clock()

    def begin_deferred(self) -> None:
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self.deferred.append([self.current, begin, end])
        else:
            self.deferred.append([self.current, self.clock(), None])

    def end_deferred(self) -> None:
        run = self.deferred[-1]
        if self.cuda:
            run[2].record()
        else:
            run[2] = self.clock()

    def read_deferred_us(self) -> list[float] | None:
        """The last forward's deferred work per layer (µs, by the layer whose forward ran it); call after the step
        has synchronised. None when the timer is closed."""
        if not self.layers:
            return None
        out = [0.0] * len(self.layers)
        for layer, begin, end in self.deferred:
            out[layer] += begin.elapsed_time(end) * 1e3 if self.cuda else (end - begin) * 1e6
        return out

    def read_us(self) -> list[float] | None:
        """The last forward's per-layer times (µs); call after the step has synchronised."""
        if not self.layers:
            return None
        if self.cuda:
            return [start.elapsed_time(end) * 1e3 for start, end in self.events]
        return [(end - begin) * 1e6 for begin, end in zip(self.begun, self.ended, strict=True)]

    def close(self) -> None:
        for layer, wrapper in zip(self.layers, self.wrappers, strict=True):
            if vars(layer).get("forward") is wrapper:  # ours is the outermost: restore what it wrapped
                forward = wrapper.unwrapped
                while getattr(forward, "timer", None) is not None and not forward.timer.layers:
                    forward = forward.unwrapped  # (a timer closed beneath ours: it goes too)
                if getattr(forward, "__func__", None) is type(layer).forward and forward.__self__ is layer:
                    del layer.forward
                else:
                    layer.forward = forward
        self.layers = []
