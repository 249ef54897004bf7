"""Microbenchmarks of the machine at hand, one function per term of the simulator's cost model.

Each returns raw timings (sizes and seconds) so that `tracer.calibrate.fit` fits them and the profile
records both. The same code runs on CUDA and on the CPU:

| cost-model term            | CUDA                                        | CPU (the "GPU" is the host)          |
|----------------------------|---------------------------------------------|--------------------------------------|
| link H2D / D2H             | pinned host <-> device, non_blocking copy   | host -> host `copy_` (same code path) |
| both directions at once    | H2D and D2H on two streams                  | two threads (recorded, see calibrate) |
| HBM bandwidth              | device copy and weight-read-bound matvec    | the same, in DRAM                    |
| matmul rate                | bf16 GEMM                                   | fp32 GEMM                            |
| attention decode           | sdpa, 1 query, the model's heads, vs KV len | the same                             |

Timing: CUDA events on a GPU; on the CPU the clock that `cpu_clock` picks: with one intra-op thread all work
runs on the calling thread, so its CPU time (`time.thread_time`) measures the work without the time other
processes on a shared box steal (under load a matvec's wall time varies several-fold while its thread CPU time
stays within ~10%). Every figure reduces `repeats` runs after `warmup` runs by the median (default) or the
minimum (`Timing.statistic`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Series:
    """One swept microbenchmark: x (bytes, KV tokens, layers...) and the time at each x."""

    name: str
    x: list[float]
    time_s: list[float]
    unit: str  # what x counts


Clock = Callable[[], float]
STATISTICS = {"median": statistics.median, "min": min}


def cpu_clock(threads: int) -> tuple[str, Clock]:
    """(name, clock) for CPU timings: the calling thread's CPU time when torch runs on that one thread, else
    wall time (several threads' work is not one thread's CPU time)."""
    return ("thread_cpu", time.thread_time) if threads == 1 else ("wall", time.perf_counter)


@dataclass(frozen=True)
class Timing:
    """How every microbenchmark is timed: `repeats` runs after `warmup`, reduced by `statistic` (median, or
    min: the uncontended cost, as `timeit` recommends, when other processes share the machine)."""

    device: torch.device
    repeats: int = 11
    warmup: int = 3
    clock: Clock = time.perf_counter
    statistic: str = "median"

    def time_s(self, fn: Callable[[], object]) -> float:
        """Time of `fn()`: CUDA events on a GPU (so that asynchronous work is included), else `clock`."""
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(self.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(self.repeats):
                start = self.clock()
                fn()
                times.append(self.clock() - start)
        return STATISTICS[self.statistic](times)


def host_buffer(n_bytes: int, device: torch.device, pinned: bool = True) -> torch.Tensor:
    """Host memory as the DDR tier holds it: pinned when the compute device is CUDA (unless `pinned=False`:
    pageable memory, which a CUDA copy stages through a driver buffer)."""
    return torch.empty(n_bytes, dtype=torch.uint8, pin_memory=pinned and device.type == "cuda")


def copy_sweep(direction: str, sizes_bytes: list[int], timing: Timing, pinned: bool = True) -> Series:
    """Time one copy of each size: 'h2d' (host -> device), 'd2h' (device -> host), 'd2d' (device -> device) or
    'h2h' (host -> host, the DDR tier's own bandwidth); host memory pinned, or pageable with `pinned=False`
    (series `copy_{direction}_pageable`).

    Buffers are allocated once at the largest size and sliced, so no allocation is timed.
    """
    device, largest = timing.device, max(sizes_bytes)
    if direction == "d2d":
        src = torch.empty(largest, dtype=torch.uint8, device=device)
        dst = torch.empty(largest, dtype=torch.uint8, device=device)
    elif direction == "h2h":
        src, dst = host_buffer(largest, device), host_buffer(largest, device)
    else:
        host = host_buffer(largest, device, pinned)
        dev = torch.empty(largest, dtype=torch.uint8, device=device)
        src, dst = (host, dev) if direction == "h2d" else (dev, host)
    src.fill_(1)
    dst.fill_(0)  # touch every page so that first-touch faults are not timed
    times = []
    for n in sizes_bytes:
        s, d = src[:n], dst[:n]
        times.append(timing.time_s(lambda s=s, d=d: d.copy_(s, non_blocking=True)))
    return Series(f"copy_{direction}" + ("" if pinned else "_pageable"), [float(n) for n in sizes_bytes], times, "bytes")


def duplex_time_s(n_bytes: int, timing: Timing) -> tuple[float, float, float]:
    """(h2d alone, d2h alone, both at once) seconds for one copy of `n_bytes` each way.

    CUDA: the two copies run on two streams (what the tiered cache's transfer streams do). CPU: two threads,
    which is what "both directions at once" can mean for host memory; the CPU tracer does not do it.
    """
    device = timing.device
    host_in, host_out = host_buffer(n_bytes, device), host_buffer(n_bytes, device)
    dev_in = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dev_out = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    for t in (host_in, host_out, dev_in, dev_out):
        t.fill_(1)

    def h2d() -> None:
        dev_in.copy_(host_in, non_blocking=True)

    def d2h() -> None:
        host_out.copy_(dev_out, non_blocking=True)

    if device.type == "cuda":
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

        def both() -> None:
            current = torch.cuda.current_stream(device)
            for stream, copy in zip(streams, (h2d, d2h)):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    copy()
            for stream in streams:
                current.wait_stream(stream)

    else:

        def both() -> None:
            other = threading.Thread(target=d2h)
            other.start()
            h2d()
            other.join()

    return timing.time_s(h2d), timing.time_s(d2h), timing.time_s(both)


def matvec_read_bytes_per_s(n: int, dtype: torch.dtype, timing: Timing) -> float:
    """Bandwidth of a weight-read-bound matvec (one token through an n x n linear layer): what a decode step's
    weight reads see. Bytes counted = the weight matrix (the vectors are negligible)."""
    weight = torch.randn(n, n, device=timing.device).to(dtype)
    x = torch.randn(1, n, device=timing.device).to(dtype)
    seconds = timing.time_s(lambda: F.linear(x, weight))
    return weight.numel() * weight.element_size() / seconds


def gemm_flops_per_s(n: int, dtype: torch.dtype, timing: Timing) -> float:
    a = torch.randn(n, n, device=timing.device).to(dtype)
    b = torch.randn(n, n, device=timing.device).to(dtype)
    seconds = timing.time_s(lambda: a @ b)
    return 2.0 * n**3 / seconds


def attention_decode_sweep(
    kv_lengths: list[int],
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    timing: Timing,
) -> Series:
    """sdpa time for one new query over a KV cache of each length (one layer, the model's head shapes).
    x = bytes of K and V read, so the fit's slope is an effective attention bandwidth."""
    element = torch.tensor([], dtype=dtype).element_size()
    times, kv_bytes = [], []
    device = timing.device
    query = torch.randn(1, n_heads, 1, head_dim, device=device).to(dtype)
    for n in kv_lengths:
        k = torch.randn(1, n_kv_heads, n, head_dim, device=device).to(dtype)  # contiguous, as a cache holds it
        v = torch.randn(1, n_kv_heads, n, head_dim, device=device).to(dtype)
        times.append(timing.time_s(lambda k=k, v=v: F.scaled_dot_product_attention(query, k, v, enable_gqa=True)))
        kv_bytes.append(float(2 * n_kv_heads * n * head_dim * element))
    return Series("attention_decode", kv_bytes, times, "kv_bytes")


def working_set_sweep(sizes_bytes: list[int], dtype: torch.dtype, timing: Timing) -> Series:
    """Time of reading weight sets of each size as a decode step does (one token through each matrix in turn,
    1 MiB matrices, repeated back to back): while the set fits in what the cache gives this process, the reads
    come from the cache and run several times faster than from memory. x = bytes of the set."""
    element = torch.tensor([], dtype=dtype).element_size()
    side = int((2**20 // element) ** 0.5)  # one matrix = 1 MiB
    matrices = [torch.empty(side, side, device=timing.device, dtype=dtype).normal_(0, 0.02)
                for _ in range(max(1, max(sizes_bytes) // (side * side * element)))]
    x = torch.randn(1, side, device=timing.device).to(dtype)
    times = []
    for n_bytes in sizes_bytes:
        chosen = matrices[: max(1, n_bytes // (side * side * element))]

        def read(chosen=chosen) -> None:
            for weight in chosen:
                F.linear(x, weight)

        times.append(timing.time_s(read))
    return Series("working_set_read", [float(n) for n in sizes_bytes], times, "bytes")


class ModelWeights:
    """The linear weights one decode step of `arch` reads: q, k, v, o, gate, up, down of `n_copies` distinct
    layers (enough to pass `min_bytes`, so that a layer's reads come from memory, not a cache; at most the
    model's layer count) and the lm_head, each applied to one token. `layer(i)` reads copy i % n_copies."""

    def __init__(self, arch, dtype: torch.dtype, device: torch.device, min_bytes: int = 256 * 2**20):
        h, hd = arch.hidden_size, arch.head_dim
        q_out, kv_out = arch.n_heads * hd, arch.n_kv_heads * hd
        shapes = [(q_out, h, arch.qkv_bias), (kv_out, h, arch.qkv_bias), (kv_out, h, arch.qkv_bias),
                  (h, q_out, False), (arch.intermediate_size, h, False), (arch.intermediate_size, h, False),
                  (h, arch.intermediate_size, False)]
        element = torch.tensor([], dtype=dtype).element_size()
        self.layer_bytes = sum(out * inp for out, inp, _ in shapes) * element
        self.head_bytes = arch.vocab_size * h * element
        self.n_copies = min(arch.n_layers, max(1, -(-min_bytes // self.layer_bytes)))

        def linear(out: int, inp: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
            weight = torch.empty(out, inp, device=device, dtype=dtype).normal_(0, 0.02)
            return weight, (torch.zeros(out, device=device, dtype=dtype) if bias else None)

        self.layers = [[linear(*shape) for shape in shapes] for _ in range(self.n_copies)]
        self.lm_head = linear(arch.vocab_size, h, False)
        self.inputs = {n: torch.randn(1, n, device=device).to(dtype) for n in (h, q_out, arch.intermediate_size)}
        self._next = 0

    def layer(self, index: int | None = None) -> None:
        """One layer's weight reads (the next copy in turn when `index` is None)."""
        if index is None:
            index, self._next = self._next, self._next + 1
        for weight, bias in self.layers[index % self.n_copies]:
            F.linear(self.inputs[weight.shape[1]], weight, bias)

    def head(self) -> None:
        F.linear(self.inputs[self.lm_head[0].shape[1]], self.lm_head[0])

    def one_step(self) -> None:
        for index in range(self.n_copies):
            self.layer(index)
        self.head()

    def prefill_layers(self, inputs: dict[int, torch.Tensor]) -> None:
        """Every copied layer's linears applied to a batch of tokens (`inputs`: width -> [tokens, width])."""
        for layer in self.layers:
            for weight, bias in layer:
                F.linear(inputs[weight.shape[1]], weight, bias)

    @property
    def step_bytes(self) -> int:
        return self.n_copies * self.layer_bytes + self.head_bytes


def model_weights_read_bytes_per_s(weights: ModelWeights, timing: Timing) -> float:
    """Bandwidth of one decode step's weight reads for the model's own linear shapes (`ModelWeights`).

    GEMV speed depends on the shape (narrow matrices such as `tiny`'s 384-wide ones read at about half the rate
    of a 4096^2 one: compare the profile's `matvec_read_bytes_per_s` and `model_weights_read_bytes_per_s`),
    which is why the `hbm_efficiency` of a measured profile comes from this and not a square matvec.
    """
    return weights.step_bytes / timing.time_s(weights.one_step)


def model_gemm_flops_per_s(weights: ModelWeights, tokens: int, timing: Timing) -> float:
    """FLOP rate of the model's own linear layers on `tokens` tokens at once (a prefill's GEMMs): smaller and
    skinnier than a square GEMM, hence slower per FLOP on most machines."""
    dtype, device = weights.lm_head[0].dtype, weights.lm_head[0].device
    inputs = {n: torch.randn(tokens, n, device=device).to(dtype) for n in weights.inputs}
    seconds = timing.time_s(lambda: weights.prefill_layers(inputs))
    element = weights.lm_head[0].element_size()
    return 2.0 * tokens * weights.n_copies * weights.layer_bytes / element / seconds
