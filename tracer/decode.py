"""Greedy decoding with a tiered cache, step by step, always with true logical positions.

Step 0 is the prefill (it produces the first generated token); each later step feeds the previous token at
position `prompt_len + generated - 1`. Stops at EOS or `max_new_tokens`; NaN/inf logits stop the sample
and flag it (that step's token is never emitted).

`greedy_decode`: one sample (any cache, e.g. a plain DynamicCache as the untraced reference).
`decode_batch`: up to `batch_size` samples per step on one `TieredCache`, one row each, with continuous
refill: a sample that stops frees its row, and the next sample is prefilled into it before the next batched
decode step, so the batch stays full. Fresh rows whose prompts are one chunk each are prefilled in one
forward, left-padded to the longest (the pads are never stored, attended or scored; `_prefill_groups` bounds
the scores that forward holds); a longer prompt is prefilled alone, chunk by chunk. Every sample sees exactly
the steps it would see alone (same tokens, positions, tiers, recall, stop); only the wall times are shared: a
batched step's time (a batched prefill's too) is recorded for every sample in it.

Host synchronisation (counted by `HostSyncCounter`, tests/test_host_syncs.py): one per step, for the next tokens,
fetched in the same copy as every layer's recorded rows. The tiered cache adds none under the full, evict and
default hierarchy policies (paged pools sized from host-known counts, placement and recall as device masks,
DDR gathers by device-side ids); where a count is data-dependent it reads it back once per layer that places
or recalls (docs/design/tracer.md, "Sync-free steps").

CUDA graphs: a decode step is not captured. What still stops it: (1) shapes that change between steps: the
slots attended follow the fullest row's resident blocks and the recall count, the batch shrinks at a stop;
(2) host-side control flow on host-known values
(placement runs only when a target moved, recall only once DDR holds blocks), which a graph would have to
replay as fixed-size masked work every step; (3) buffers reallocated when the pool grows (now only past what
`TieredCache.reserve_length` allocated as samples were admitted: the pages at the policy's peak, the block
tables, score tables and DDR pool for the longest sample), and the small
host-to-device copies of host-known indices (pinned, non-blocking, but new buffers each step; a graph would
read them from fixed ones); (4) the documented read-backs above. A capturable step would keep the pools it has
(allocated for the run's longest sample), run placement and recall every step with masks for the unused slots, pad the
batch to a fixed size, and capture one graph per pool size bucket (as vLLM captures per batch size).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tracer.attention import ATTN_IMPLEMENTATION
from tracer.cache import TieredCache, UnsupportedBatch
from tracer.cache.speculation import watch_layer_inputs
from tracer.compat import cache_kwargs
from tracer.recorder import Recorder
from tracer.timing import LayerTimer, step_clock
from tracer.transfer import host_to_device


@dataclass
class DecodeResult:
    prompt_ids: list[int]
    generated_ids: list[int]
    stop_reason: str  # eos | max_new_tokens | nonfinite | forced (a teacher-forced job fed its last token)
    wall_s: float
    cache: TieredCache  # or the sample's TieredRow of a batched cache (valid until its row is refilled)
    logits: list[torch.Tensor] | None = None  # each step's logits when asked for (tests)


def use_tiered_attention(model) -> None:
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def encode_prompt(tokenizer, text: str, use_chat_template: bool) -> list[int]:
    """Token ids of the prompt; the chat template (with the generation prompt) when the tokenizer has one."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=True))


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@contextlib.contextmanager
def frozen_heap():
    """Decode with every object alive at entry (the model, torch, transformers: hundreds of thousands) moved to
    the garbage collector's permanent generation, after one collection, and back at exit: its full passes during
    the decode loop then walk only the run's own objects (each step's short-lived ones and what the recorders
    keep), not the whole heap. vLLM freezes its heap after warm-up (`freeze_gc_heap`), SGLang has `freeze_gc`.
    Measured on the micro model at B = 32 (tests/bench/collect_throughput.py, which decodes in one as `thoughtkv
    trace` does): 10.3-10.9 ms per recorded step frozen against 11.5-11.9 (with 14-15 ms outliers) not.
    Re-entrant: an inner use leaves the outer freeze in place."""
    outer = gc.get_freeze_count() > 0
    if not outer:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if not outer:
            gc.unfreeze()


def decode_grad_mode(settings) -> type:
    """The autograd mode a decode runs in: `torch.inference_mode` (no autograd bookkeeping and no version counter
    per op, which is most of an eager CPU op's fixed cost: a traced micro-model step at B = 1 took 4.26 ms under
    it against 5.04 under no_grad, interleaved in one process; README), unless the scorer of `settings` (a
    `TierSettings`, or None) runs a backward pass, whose saved tensors cannot be inference tensors: then
    `torch.no_grad`. A cache decoded under inference_mode holds inference tensors: read freely afterwards, but
    written again only under inference_mode (decode it again with these loops, not with `generate`)."""
    scorer = getattr(settings, "scorer", None)
    return torch.no_grad if scorer is not None and scorer.needs_autograd else torch.inference_mode


def greedy_decode(
    model, prompt_ids: list[int], cache: TieredCache, max_new_tokens: int, eos_ids: set[int],
    recorder: Recorder | None = None, progress=None,
) -> DecodeResult:
    """Greedy decode of one sample on `cache` (a TieredCache, or a DynamicCache as the untraced reference)."""
    with decode_grad_mode(getattr(cache, "settings", None))(), watch_layer_inputs(model, cache):
        return _greedy_decode(model, prompt_ids, cache, max_new_tokens, eos_ids, recorder, progress)


def _greedy_decode(model, prompt_ids, cache, max_new_tokens, eos_ids, recorder, progress) -> DecodeResult:
    device = model.device
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    input_ids = torch.tensor([prompt_ids], device=device)
    position_ids = torch.arange(len(prompt_ids), device=device)[None]
    generated: list[int] = []
    stop_reason = "max_new_tokens"
    # The gradient scorer's backward pass (tracer/scorers/) runs after each step, untimed; a plain
    # DynamicCache (the untraced reference) has no settings.
    after_step = getattr(getattr(getattr(cache, "settings", None), "scorer", None), "after_step", None)
    if hasattr(cache, "reserve_length"):  # (a TieredCache: its pools sized once)
        cache.reserve_length(len(prompt_ids), len(prompt_ids) + max_new_tokens)
    started = time.perf_counter()
    _, clock = step_clock(device)
    for _ in range(max_new_tokens):
        step_started = clock()
        logits = model(input_ids=input_ids, position_ids=position_ids, **cache_kwargs(model, cache), use_cache=True,
                       logits_to_keep=1).logits[0, -1]
        token, finite = int(logits.argmax()), bool(torch.isfinite(logits).all())
        synchronize()
        if recorder is not None:
            recorder.end_step((clock() - step_started) * 1e6)
        if progress is not None:
            progress.update(1)
        if not finite:
            stop_reason = "nonfinite"
            break
        generated.append(token)
        if after_step is not None:
            after_step(model, cache, prompt_ids + generated, len(generated) - 1)
        if token in eos_ids:
            stop_reason = "eos"
            break
        input_ids = torch.tensor([[token]], device=device)
        position_ids = torch.tensor([[len(prompt_ids) + len(generated) - 1]], device=device)
    return DecodeResult(prompt_ids, generated, stop_reason, time.perf_counter() - started, cache)


class HostSyncCounter(TorchDispatchMode):
    """Counts the operations that make the host wait for the device, inside a `with` block.

    Dispatch level: `aten._local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`), `aten.nonzero`,
    `aten.masked_select`, indexing with a boolean mask, and copies out of a non-CPU tensor into CPU memory.
    `Tensor.cpu`, `Tensor.tolist` and `Tensor.numpy` are counted too (wrapped for the block): on a CPU run
    they reach no dispatched op, yet on CUDA each is a device->host copy the host waits for, so a CPU test
    sees what a GPU would pay (`.cpu()` always counts; `.numpy()`/`.tolist()` of its result do not again).
    So are blocking host->device copies asked for outside torch and transformers: `torch.tensor`/`as_tensor`
    with a `device`, and `Tensor.to(device)` of a CPU tensor without `non_blocking` (on CUDA a copy from
    pageable memory synchronises the stream; `tracer.transfer.host_to_device` is the non-blocking way).
    `count` is the total; `by_op` names them.
    """

    SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique2", "aten._unique2"}
    # Under inference_mode (how the decode loops run: `decode_grad_mode`) a dispatch mode sees composite ops
    # before they decompose: `.item()`/`int()`/`bool()` arrive as these, not as `_local_scalar_dense`.
    SCALAR_READS = {"aten.item", "aten.is_nonzero"}

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}
        self._wrapped: list[tuple[str, object]] = []
        self._inside_wrapped = 0  # the copy inside a wrapped tolist/cpu is that call's, counted once
        self._fetched: dict[int, weakref.ref] = {}  # results of counted .cpu() calls: reading them is free

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def _add(self, name: str) -> None:
        self.by_op[name] = self.by_op.get(name, 0) + 1

    def __enter__(self):
        for name in ("tolist", "numpy", "cpu"):
            original = getattr(torch.Tensor, name)
            self._wrapped.append((torch.Tensor, name, original))
            setattr(torch.Tensor, name, self._counting(name, original))
        for owner, name in ((torch, "tensor"), (torch, "as_tensor"), (torch.Tensor, "to")):
            original = getattr(owner, name)
            self._wrapped.append((owner, name, original))
            setattr(owner, name, self._counting_uploads(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._wrapped):
            setattr(owner, name, original)
        self._wrapped.clear()
        return super().__exit__(*exc)

    def _counting_uploads(self, name: str, original):
        counter = self

        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith(("torch", "transformers")) and not kwargs.get("non_blocking", False):
                if name == "to":
                    tensor, rest = args[0], args[1:]
                    targets = [a.device if isinstance(a, torch.Tensor) else a for a in rest
                               if isinstance(a, (torch.device, str, torch.Tensor))] + [kwargs.get("device")]
                    blocking = tensor.device.type == "cpu" and any(t is not None for t in targets)
                else:
                    blocking = kwargs.get("device") is not None
                if blocking:
                    counter._add("blocking host->device copy")
            return original(*args, **kwargs)

        return wrapper

    def _counting(self, name: str, original):
        counter = self

        def wrapper(tensor, *args, **kwargs):
            # Every .cpu() counts, also of a CPU tensor on a CPU run: there it stands for the copy a GPU run
            # makes (the code calls it to bring device data to the host); what it returned reads for free.
            fetched = counter._fetched.get(id(tensor))
            copies = name == "cpu" or fetched is None or fetched() is not tensor
            if copies:
                counter._add(f"Tensor.{name}")
            counter._inside_wrapped += 1
            try:
                result = original(tensor, *args, **kwargs)
            finally:
                counter._inside_wrapped -= 1
            if name == "cpu":
                counter._fetched[id(result)] = weakref.ref(result)
            return result

        return wrapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if self._inside_wrapped:
            pass
        elif name in self.SYNC_OPS:
            self._add(name)
        elif name in self.SCALAR_READS:
            self._add("aten._local_scalar_dense")
        elif name == "aten.where" and len(args) + len(kwargs) == 1:  # where(condition): nonzero, composite
            self._add("aten.nonzero")
        elif name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self._add("boolean-mask index")  # its result size needs the mask's count on the host
        elif name in ("aten._to_copy", "aten.copy_", "aten.to"):  # (`to` itself under inference_mode)
            source = args[1] if name == "aten.copy_" else args[0]
            target_device = args[0].device if name == "aten.copy_" else kwargs.get("device")
            if name == "aten.to" and target_device is None and len(args) > 1:  # to(device, ...) or to(tensor, ...)
                target = args[1].device if isinstance(args[1], torch.Tensor) else args[1]
                target_device = target if isinstance(target, (torch.device, str)) else None
            if isinstance(source, torch.Tensor) and source.device.type != "cpu" and target_device is not None \
                    and torch.device(target_device).type == "cpu":
                self._add("device->host copy")
        return func(*args, **kwargs)


@dataclass
class DecodeJob:
    """One sample to decode: its prompt, its own placement settings (scorer state is per sample) and recorder."""

    key: object  # the caller's handle (e.g. the task sample)
    prompt_ids: list[int]
    settings: object  # tracer.cache.TierSettings
    recorder: Recorder | None = None
    # Teacher forcing: the tokens fed after the prompt, one per step, in place of the greedy ones (the job
    # stops after the last, whatever `max_new_tokens` says); None: greedy. `on_logits(step, logits)` sees each
    # step's next-token logits [vocab] (step 0: the prefill's) before the next token is fed.
    forced_ids: list[int] | None = None
    on_logits: Callable[[int, torch.Tensor], None] | None = None

    def token_limit(self, max_new_tokens: int) -> int:
        """How many tokens this job generates at most: its forced tokens, else `max_new_tokens`."""
        return len(self.forced_ids) if self.forced_ids is not None else max_new_tokens


@dataclass
class _Row:
    job: DecodeJob
    started: float
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    stop_reason: str | None = None

    @property
    def next_position(self) -> int:
        return len(self.job.prompt_ids) + len(self.generated) - 1


def _advance(row: _Row, token: int, finite: bool, max_new_tokens: int, eos_ids: set[int], after_step, model, view) -> None:
    """Apply one step's token to a row, exactly as `greedy_decode` does (nonfinite: the token is dropped); a
    teacher-forced row takes its next forced token instead and stops after the last."""
    if not finite:
        row.stop_reason = "nonfinite"
        return
    forced = row.job.forced_ids
    if forced is not None:
        token = forced[len(row.generated)]
    row.generated.append(token)
    if after_step is not None:
        after_step(model, view, row.job.prompt_ids + row.generated, len(row.generated) - 1)
    if forced is not None:
        if len(row.generated) >= len(forced):
            row.stop_reason = "forced"
    elif token in eos_ids:
        row.stop_reason = "eos"
    elif len(row.generated) >= max_new_tokens:
        row.stop_reason = "max_new_tokens"


def decode_step(model, cache: TieredCache, rows: list[int], input_ids: torch.Tensor, position_ids: torch.Tensor,
                timer: LayerTimer, clock, synchronize, new_tokens: list[int] | None = None):
    """One forward of the active `rows`, as the trace times it: (logits [rows, vocab], next tokens, finite flags,
    step µs, per-layer µs). `decode_batch` runs every step through here, and so does calibration's overhead
    benchmark (tracer/calibrate/tiered.py), so the overhead it fits is this path's."""
    started = clock()
    cache.set_active(rows, new_tokens)
    cache.layer_timer = timer  # (times the layers' deferred work apart: `LayerTimer.read_deferred_us`)
    logits = model(input_ids=input_ids, position_ids=position_ids, **cache_kwargs(model, cache), use_cache=True,
                   logits_to_keep=1).logits[:, -1]
    # The step's one device->host copy: each row's next token and whether its logits were finite, fetched
    # together with the values every layer recorded this step (tracer.cache.DeferredCopies).
    # Finite logits: x * 0 is 0 for a finite x and NaN for inf or NaN, and a sum of zeros cannot overflow (in
    # fp16 either): two passes over the vocabulary instead of isfinite's five.
    packed = torch.stack([logits.argmax(-1), ((logits * 0).sum(-1) == 0).long()])
    tokens, finite = cache.copies.add(packed, lambda a: a.astype(np.int64).reshape(2, -1).tolist()).value()
    synchronize()
    wall_us = (clock() - started) * 1e6  # step_clock: the decode thread's CPU time on a 1-thread CPU
    return logits, tokens, finite, wall_us, timer.read_us()


def decode_batch(
    model, jobs: Iterable[DecodeJob], cache: TieredCache, batch_size: int, max_new_tokens: int, eos_ids: set[int],
    progress=None, keep_logits: bool = False, prefill_chunk_tokens: int | None = None,
) -> Iterator[tuple[DecodeJob, DecodeResult]]:
    """Decode `jobs` with up to `batch_size` in flight; yields (job, result) as each finishes (completion
    order). Consume each result (e.g. `tokens_table`) before asking for the next: its row is then refilled.
    A prompt longer than `prefill_chunk_tokens` is prefilled in chunks of that many tokens (None: at once), which
    bounds the prefill's attention scores at chunk x prompt instead of prompt x prompt; the prompt is placed
    and recorded after the last chunk, as one prefill step (`_prefill_front`). Runs under `decode_grad_mode` of
    the cache's settings (each resumption of the generator: the caller's code between results runs outside)."""
    mode = decode_grad_mode(cache.settings)
    return mode()(_decode_batch)(model, jobs, cache, batch_size, max_new_tokens, eos_ids, progress, keep_logits,
                                 prefill_chunk_tokens, mode is torch.no_grad)


def _decode_batch(model, jobs, cache, batch_size, max_new_tokens, eos_ids, progress, keep_logits,
                  prefill_chunk_tokens, autograd_allowed: bool) -> Iterator[tuple[DecodeJob, DecodeResult]]:
    device = model.device
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pending = iter(jobs)
    free, active = list(range(batch_size)), {}
    exhausted = False
    timer = LayerTimer(model)
    _, clock = step_clock(device)
    cache.reserve_rows(batch_size)
    watching = contextlib.ExitStack()  # (a rule that speculates from the previous layer's input: its hooks)
    watching.enter_context(watch_layer_inputs(model, cache))

    def step(rows: list[int], input_ids: torch.Tensor, position_ids: torch.Tensor,
             earlier: tuple[float, list[float] | None] = (0.0, None),
             new_tokens: list[int] | None = None) -> Iterator[tuple[DecodeJob, DecodeResult]]:
        logits, tokens, finite, wall_us, layer_us = decode_step(model, cache, rows, input_ids, position_ids, timer,
                                                                clock, synchronize, new_tokens)
        deferred_us = timer.read_deferred_us()
        wall_us += earlier[0]  # a chunked prefill: the chunks before this last one belong to the same step
        if earlier[1] is not None and layer_us is not None:
            layer_us = [a + b for a, b in zip(layer_us, earlier[1], strict=True)]
        for index, row_id in enumerate(rows):
            row = active[row_id]
            if row.job.recorder is not None:
                row.job.recorder.end_step(wall_us, layer_us, deferred_us)
            if progress is not None:
                progress.update(1)
            if row.logits is not None:
                row.logits.append(logits[index].clone())
            if row.job.on_logits is not None:
                row.job.on_logits(len(row.generated), logits[index])
            after_step = getattr(row.job.settings.scorer, "after_step", None)
            _advance(row, tokens[index], finite[index], max_new_tokens, eos_ids, after_step, model, cache.row_view(row_id))
            if row.stop_reason is not None:
                del active[row_id]
                result = DecodeResult(row.job.prompt_ids, row.generated, row.stop_reason,
                                      time.perf_counter() - row.started, cache.row_view(row_id), row.logits)
                yield row.job, result
                free.append(row_id)

    def prefill(rows: list[int]) -> Iterator[tuple[DecodeJob, DecodeResult]]:
        """One forward for the prompts of fresh `rows` (each one chunk), left-padded to the longest: the batch's
        prefill step (its time shared by the rows, as a decode step's is)."""
        prompts = [active[r].job.prompt_ids for r in rows]
        length = max(map(len, prompts))
        # Pads: token 0 at position 0 (any id would do: the cache stores none of them and no query reads one).
        padded = host_to_device([[[0] * (length - len(p)) + p for p in prompts],
                                 [[0] * (length - len(p)) + list(range(len(p))) for p in prompts]], device)
        yield from step(rows, padded[0], padded[1], new_tokens=[len(p) for p in prompts])

    try:  # the continuous-refill schedule: fill free rows (their prefills batched), then one step of all rows
        while True:
            starting: list[int] = []  # fresh rows whose prompt is one chunk: prefilled together below
            while free and not exhausted:
                job = next(pending, None)
                if job is None:
                    exhausted = True
                    break
                row_id = min(free)
                free.remove(row_id)
                if not autograd_allowed and decode_grad_mode(job.settings) is torch.no_grad:
                    raise UnsupportedBatch("a batch's samples share one scorer kind: this one runs autograd, the "
                                           "cache's first does not; decode them separately")
                cache.reset_row(row_id, job.settings, job.recorder)
                cache.reserve_length(len(job.prompt_ids), len(job.prompt_ids) + job.token_limit(max_new_tokens))
                active[row_id] = _Row(job, time.perf_counter(), logits=[] if keep_logits else None)
                prompt = job.prompt_ids
                last = prefill_chunks(len(prompt), prefill_chunk_tokens)[-1]
                if last.start == 0:
                    starting.append(row_id)
                    continue
                earlier = _prefill_front(model, cache, row_id, prompt[: last.start], prefill_chunk_tokens, timer, clock,
                                         synchronize)
                yield from step([row_id], host_to_device([prompt[last]], device),
                                torch.arange(last.start, last.stop, device=device)[None], earlier)
            if starting:
                for group in _prefill_groups(starting, [len(active[r].job.prompt_ids) for r in starting],
                                             prefill_chunk_tokens):
                    yield from prefill(group)  # one row: no pads, its plain prefill
                continue  # a sample that stopped at its first token freed its row: fill it before decoding
            if not active:
                return
            rows = sorted(active)
            # Tokens and positions in one transfer, pinned and non-blocking (tracer.transfer.host_to_device).
            inputs = host_to_device([[active[r].generated[-1] for r in rows], [active[r].next_position for r in rows]],
                                    device)
            yield from step(rows, inputs[0][:, None], inputs[1][:, None])
    finally:
        watching.close()
        timer.close()


def _prefill_groups(rows: list[int], lengths: list[int], chunk_tokens: int | None) -> list[list[int]]:
    """Fresh rows prefilled together, in order: a group of m rows padded to length L attends m x L x L scores,
    kept within one chunk's chunk_tokens x chunk_tokens (the bound `--prefill-chunk-tokens` sets for one
    prompt); with no chunking (None) the rows go at once, as `generate` prefills its batch."""
    groups: list[list[int]] = []
    widest = 0  # the current group's longest prompt
    for row, length in zip(rows, lengths, strict=True):
        widest = max(widest, length)
        if groups and (chunk_tokens is None or (len(groups[-1]) + 1) * widest * widest <= chunk_tokens * chunk_tokens):
            groups[-1].append(row)
        else:
            groups.append([row])
            widest = length
    return groups


def prefill_chunks(n_tokens: int, chunk_tokens: int | None) -> list[slice]:
    """The prompt's prefill forwards: consecutive slices of at most `chunk_tokens` (one slice when None), the
    remainder first, so that the last chunk is a whole one: a scorer that reads a prefill's last queries (snapkv,
    rkv: their window) sees what the unchunked prefill would whenever the chunk holds its window."""
    if chunk_tokens is None or n_tokens <= chunk_tokens:
        return [slice(0, n_tokens)]
    first = n_tokens % chunk_tokens or chunk_tokens
    return [slice(0, first)] + [slice(start, start + chunk_tokens) for start in range(first, n_tokens, chunk_tokens)]


def _prefill_front(model, cache: TieredCache, row_id: int, front: list[int], chunk_tokens: int | None, timer, clock,
                   synchronize) -> tuple[float, list[float] | None]:
    """Prefill every chunk of the prompt but the last (`front`) into `row_id`'s layers, with their placement and
    recording deferred to the last chunk; returns those forwards' (µs, per-layer µs), which the prefill step's
    timing includes. Each chunk attends the whole prefix so far (all of it still in HBM: nothing is placed yet)
    and its own tokens causally, so the logits equal one unchunked prefill's."""
    if not front:
        return 0.0, None
    layers = cache.rows[row_id]
    total_us, total_layer_us = 0.0, None
    device = model.device
    for layer in layers:
        layer.defer_placement = True
    try:
        for chunk in prefill_chunks(len(front), chunk_tokens):
            started = clock()
            cache.set_active([row_id])
            model(input_ids=host_to_device([front[chunk]], device), **cache_kwargs(model, cache), use_cache=True,
                  position_ids=torch.arange(chunk.start, chunk.stop, device=device)[None], logits_to_keep=1)
            synchronize()
            total_us += (clock() - started) * 1e6
            layer_us = timer.read_us()
            if layer_us is not None:
                total_layer_us = layer_us if total_layer_us is None else [a + b for a, b in zip(total_layer_us, layer_us)]
    finally:
        for layer in layers:
            layer.defer_placement = False
    return total_us, total_layer_us


def tokens_table(result: DecodeResult) -> dict[str, object]:
    """trace v1 `tokens` columns: importance received over decode steps and the final tier, per layer."""
    token_ids = result.prompt_ids + result.generated_ids
    n = len(token_ids)
    layers = result.cache.layers
    by_layer = np.zeros((n, len(layers)), dtype=np.float32)
    by_layer_max = np.zeros((n, len(layers)), dtype=np.float32)
    tiers = np.zeros((n, len(layers)), dtype=np.uint8)  # a position never cached (the last token) counts as HBM
    for index, layer in enumerate(layers):
        stored = min(n, layer.logical_len)
        by_layer[:stored, index] = layer.importance[:stored].cpu().numpy()
        by_layer_max[:stored, index] = layer.importance_max[:stored].cpu().numpy()
        tiers[:stored, index] = layer.final_tiers()[:stored].cpu().numpy()
    return {
        "position": np.arange(n, dtype=np.int32),
        "token_id": np.asarray(token_ids, dtype=np.int32),
        "is_prompt": np.arange(n) < len(result.prompt_ids),
        "importance": by_layer.mean(1),
        "importance_max": by_layer_max.mean(1),
        "importance_by_layer": list(by_layer),
        "final_tier_by_layer": list(tiers),
    }
