"""Step-columnar recording buffers -> the columns of trace v1 (traces/schema.py).

Each tiered layer hands a step's recording rows to the cache's one `StepRecording`: a `StepRows` per step
gathers, layer by layer, the rows' host-known counts (a tuple per row) and their device values still on the
device (`Deferred`: block masses, recalled and moved ids, quantization errors, fetched in the step's one copy,
tracer.cache.DeferredCopies). When the step ends, each row's recorder keeps its place in its StepRows (one per
step, not one per layer); a recorder resolves its ended steps together (`build_steps`, when it holds
`RESOLVE_EVERY` of them or its columns are read) into arrays over [steps, layers, rows], with one set of NumPy
operations for every step, layer and row (the derived columns, the sorted recalled ids, the DDR and HBM
masses); its columns are concatenated from its places when read. What is left per
row and layer is a tuple of counts and a look at its recall: the rest of a step's recording is a fixed set
of array operations, where it was about twenty list entries per row and layer and a dozen NumPy calls per
layer (at B = 16 on a 28-layer model, 448 row-layers a step: host time a GPU step cannot hide). The decode
loop sets each step's wall time and (tracer.decode.LayerTimer) each decoder layer's time. Nothing here
touches torch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

STEP_COLUMNS = (
    "step", "layer", "query_tokens", "logical_len", "hbm_tokens", "ddr_tokens", "evicted_tokens",
    "recalled_tokens", "hbm_blocks", "ddr_blocks", "evicted_blocks", "recalled_block_ids", "promoted_block_ids",
    "offloaded_block_ids", "evicted_block_ids", "bytes_h2d", "bytes_d2h", "hbm_kv_bytes", "ddr_kv_bytes",
    "mass_hbm", "mass_ddr",
)
OPTIONAL_STEP_COLUMNS = ("quant_max_rel_err", "quant_rms_rel_err")  # quantized DDR tier; None when not measured
# The integer columns, in the order of a `StepRows.ints` row.
INT_COLUMNS = ("layer", "query_tokens", "logical_len", "hbm_tokens", "ddr_tokens", "evicted_tokens",
               "recalled_tokens", "hbm_blocks", "ddr_blocks", "evicted_blocks", "bytes_h2d", "bytes_d2h",
               "hbm_kv_bytes", "ddr_kv_bytes")
MOVED_COLUMNS = ("promoted_block_ids", "offloaded_block_ids", "evicted_block_ids")
# What a layer knows on the host for each recording row, before placement (`LayerEntry.host`).
HOST_FIELDS = ("query_tokens", "logical_len", "blocks", "ddr_blocks", "evicted_blocks", "recalled_blocks",
               "bytes_h2d")


class Deferred:
    """A recorded value still on the device (tracer.cache.DeferredCopies): `value()` fetches it (once: the value
    is kept); `source`: the copy it travels in."""

    _unset = object()

    def __init__(self, fetch, source=None):
        self._fetch, self._value, self.source = fetch, Deferred._unset, source

    def value(self):
        if self._value is Deferred._unset:
            self._value = self._fetch()
        return self._value


@dataclass
class LayerEntry:
    """One decoder layer's recording rows of one step (lists over the rows, in the `StepRows`' order)."""

    constants: tuple[int, int, int, int]  # layer, block size, KV bytes of an HBM token, bytes of a DDR block
    host: list[tuple]  # per row: `HOST_FIELDS`, as the layer saw them at attention time (before placement)
    bytes_d2h: list[int] | tuple  # per row: bytes this step's placement offloaded (`repeated(0, n)`: none)
    masses: Deferred  # [layers, batch entries, blocks + 1] float32: attention mass per block (last: scratch),
    mass_layer: int  # shared by the step's layers: this layer's is masses[mass_layer]
    index: list[int] | None  # the rows' batch entries in `masses` (None: all of them, in order)
    recalled: list  # per row: None or (ids on the device, their Deferred, first, count): sorted when recorded
    # per row: None or (Deferred codes [placed rows, blocks], its row, bytes): codes 1-4 (`repeated(None, n)`: none)
    moved: list | tuple
    # per row: None or (Deferred [blocks, 2] max / mean-square relative error, first, count) (`repeated(None, n)`)
    errors: list | tuple
    # `--recall-buffer-blocks` only (else None): per row the recalled blocks its buffer held (hits) and the blocks
    # it holds after this step's recall
    hits: list[int] | None = None
    buffer_blocks: list[int] | None = None


@functools.cache
def repeated(value, n: int) -> tuple:
    """`n` times `value`, one tuple per (value, n): a `LayerEntry` list of rows none of which moved a block or
    measured an error (most steps), which the recorder recognises by identity and skips."""
    return (value,) * n


class StepRows:
    """One step's recording rows (`row_ids`, in order) over the layers that recorded them (`entries`, E of
    them), resolved for all rows and layers at once (`build_steps`, with other steps when a recorder reads its
    columns or holds `RESOLVE_EVERY` ended steps): `ints` [E, rows, len(INT_COLUMNS)] int64, `masses`
    [E, rows, 2] float64 (mass_hbm, mass_ddr), `recalled` [E, rows, k] sorted ids (or E lists of row lists),
    `moved` per row the (entry, promoted, offloaded, evicted) ids of the entries that moved blocks, `quant`
    [E, rows, 2] (NaN: not measured; None: no entry measured), `block_mass` [E, rows, width] float32 (a row's
    first `blocks` count). `closed`: its step ended (the next step's layers open a new one)."""

    def __init__(self, row_ids: tuple):
        self.row_ids, self.entries = row_ids, []
        self.ints = None
        self.closed = False

    @property
    def resolved(self) -> bool:
        return self.ints is not None

    def _build_alone(self) -> None:
        """The general case (layers whose rows recall unlike, masses in separate tensors): this step by itself."""
        entries, n_rows = self.entries, len(self.row_ids)
        host = _host_counts([entries], n_rows)[0]  # [E, rows, HOST_FIELDS + bytes_d2h]
        weights, bias = _derivations(tuple(entry.constants for entry in entries))
        mass = _step_masses(entries)  # [E, rows, width]
        recalled = [_ragged_ids(entry.recalled) for entry in entries]  # E lists of row lists
        mass_ddr = np.array([[mass[e, i, ids].sum(dtype=np.float64) for i, ids in enumerate(rows)]
                             for e, rows in enumerate(recalled)]).reshape(len(entries), n_rows)
        self._set(np.matmul(host, weights) + bias,
                  np.stack([mass.sum(-1, dtype=np.float64) - mass_ddr, mass_ddr], axis=-1), recalled, mass)

    def _set(self, ints: np.ndarray, masses: np.ndarray, recalled, block_mass: np.ndarray) -> None:
        entries, n_rows = self.entries, len(self.row_ids)
        self.entries = []  # (their device values are fetched: nothing else to keep)
        self.ints, self.masses, self.recalled, self.block_mass = ints, masses, recalled, block_mass
        self.hits = None
        if entries[0].hits is not None:  # a recall buffer: its hits, and its capacity in the HBM bytes
            self.hits = _buffer_columns(entries, ints)
        self.moved: list[list] = [[] for _ in range(n_rows)]
        self.quant = None
        nothing = repeated(None, n_rows)
        for e, entry in enumerate(entries):
            if entry.moved is not nothing:
                for i, ids in _moved_ids(entry.moved):
                    self.moved[i].append((e, *ids))
            for i, error in enumerate(() if entry.errors is nothing else entry.errors):
                if error is not None:
                    if self.quant is None:
                        self.quant = np.full((len(entries), n_rows, 2), np.nan)
                    part = error[0].value()[error[1] : error[1] + error[2]]
                    self.quant[e, i] = part[:, 0].max(), np.sqrt(part[:, 1].mean())


def _buffer_columns(entries: list[LayerEntry], ints: np.ndarray) -> np.ndarray:
    """[E, rows, 2] hits and misses of a step's rows under a recall buffer; adds to `ints`' `hbm_kv_bytes` the
    buffer's blocks beyond the step's recall (traces.recall_buffer.hbm_blocks: the recall takes max(held,
    recalled) blocks)."""
    hits = np.array([entry.hits for entry in entries], dtype=np.int64)
    out = np.zeros((*hits.shape, 2), dtype=np.int64)
    column = INT_COLUMNS.index
    for e, entry in enumerate(entries):
        _, bs, token_bytes, _ = entry.constants
        recalled = ints[e, :, column("recalled_tokens")] // bs
        out[e, :, 0], out[e, :, 1] = hits[e], recalled - hits[e]
        extra = np.maximum(np.asarray(entry.buffer_blocks) - recalled, 0)
        ints[e, :, column("hbm_kv_bytes")] += extra * bs * token_bytes
    return out


# A recorder resolves its ended steps at most this many at a time (and when its columns are read): together,
# the steps' derived columns, sorted recalled ids and masses are one set of NumPy operations for the lot, where
# one set per step would be a dozen calls on arrays of a few rows (a fixed host cost per step that a small model's
# decode cannot hide); the bound keeps the fetched copies they hold bounded.
RESOLVE_EVERY = 64


def build_steps(steps: list[StepRows]) -> None:
    """Resolve the unresolved `steps`. The usual step (every layer's rows recall alike, each its k ids, and the
    layers' masses share the step's tensor) is built with the steps like it, i.e. of the same rows, layers, k
    and mass width (a step's block count: the steps of one block share it), as arrays with a leading step axis;
    each row's result is the same as its step alone would give (the reductions run per row, in the same order)."""
    groups: dict[tuple, list] = {}
    for step in dict.fromkeys(steps):
        if step.resolved:
            continue
        entries, first = step.entries, step.entries[0]
        uniform = None
        if all(entry.masses is first.masses and entry.index == first.index for entry in entries):
            uniform = [_uniform_ids(entry.recalled) for entry in entries]
        if uniform is None or any(ids is None for ids in uniform) or len({ids.shape[1] for ids in uniform}) != 1:
            step._build_alone()
            continue
        mass = _step_masses(entries)  # [E, rows, width]
        key = (len(step.row_ids), tuple(entry.constants for entry in entries), uniform[0].shape[1], mass.shape[2])
        groups.setdefault(key, []).append((step, np.stack(uniform), mass))
    for (n_rows, constants, _, _), group in groups.items():
        host = _host_counts([step.entries for step, _, _ in group], n_rows)  # [steps, E, rows, fields]
        weights, bias = _derivations(constants)
        ints = np.matmul(host, weights) + bias
        # Recalled ids, staged by bound, recorded sorted by id; their blocks' mass is the DDR mass.
        recalled = np.sort(np.stack([ids for _, ids, _ in group]), axis=-1)  # [steps, E, rows, k]
        mass = np.stack([m for _, _, m in group])  # [steps, E, rows, width]
        mass_ddr = np.take_along_axis(mass, recalled, axis=-1).sum(-1, dtype=np.float64)
        masses = np.stack([mass.sum(-1, dtype=np.float64) - mass_ddr, mass_ddr], axis=-1)
        for s, (step, _, step_mass) in enumerate(group):
            step._set(ints[s], masses[s], recalled[s], step_mass)


def _host_counts(steps: list[list[LayerEntry]], n_rows: int) -> np.ndarray:
    """The steps' entries' host counts and bytes offloaded: [steps, E, rows, HOST_FIELDS + bytes_d2h] int64."""
    shape = (len(steps), len(steps[0]), n_rows)
    return np.concatenate([
        np.array([[entry.host for entry in entries] for entries in steps], dtype=np.int64).reshape(*shape, -1),
        np.array([[entry.bytes_d2h for entry in entries] for entries in steps], dtype=np.int64).reshape(*shape, 1)], -1)


@functools.lru_cache(maxsize=64)
def _derivations(constants: tuple[tuple[int, int, int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each integer column is linear in a row's host counts (`HOST_FIELDS` + bytes_d2h) with coefficients from its
    layer's constants: ([E, fields, columns] weights, [E, 1, columns] bias), so one matmul derives every row and
    layer of a step (cached: a cache's layers keep their constants)."""
    q, length, blocks, ddr, evicted, recalled, h2d, d2h = range(len(HOST_FIELDS) + 1)
    weights = np.zeros((len(constants), len(HOST_FIELDS) + 1, len(INT_COLUMNS)), dtype=np.int64)
    bias = np.zeros((len(constants), 1, len(INT_COLUMNS)), dtype=np.int64)
    for e, (layer, bs, token_bytes, ddr_block_bytes) in enumerate(constants):
        terms = {  # column -> {field: coefficient}
            "query_tokens": {q: 1}, "logical_len": {length: 1},
            "hbm_tokens": {length: 1, ddr: -bs, evicted: -bs}, "ddr_tokens": {ddr: bs},
            "evicted_tokens": {evicted: bs}, "recalled_tokens": {recalled: bs},
            "hbm_blocks": {blocks: 1, ddr: -1, evicted: -1}, "ddr_blocks": {ddr: 1}, "evicted_blocks": {evicted: 1},
            "bytes_h2d": {h2d: 1}, "bytes_d2h": {d2h: 1},
            # HBM bytes: resident tokens plus this step's recalled ones (staged)
            "hbm_kv_bytes": {length: token_bytes, ddr: -bs * token_bytes, evicted: -bs * token_bytes,
                             recalled: bs * token_bytes},
            "ddr_kv_bytes": {ddr: ddr_block_bytes},
        }
        for name, coefficients in terms.items():
            for field_index, coefficient in coefficients.items():
                weights[e, field_index, INT_COLUMNS.index(name)] = coefficient
        bias[e, 0, INT_COLUMNS.index("layer")] = layer
    weights.flags.writeable = bias.flags.writeable = False
    return weights, bias


def _step_masses(entries: list[LayerEntry]) -> np.ndarray:
    """The entries' block masses [E, rows, width]: one gather when they share the step's tensor (as a step's
    layers do), else each entry's slice, zero-padded to the widest."""
    first = entries[0]
    if all(entry.masses is first.masses and entry.index == first.index for entry in entries):
        mass = first.masses.value()[[entry.mass_layer for entry in entries]]
        return mass if first.index is None else mass[:, first.index]
    arrays = [entry.masses.value()[entry.mass_layer] for entry in entries]
    arrays = [a if entry.index is None else a[entry.index] for a, entry in zip(arrays, entries, strict=True)]
    out = np.zeros((len(arrays), arrays[0].shape[0], max(a.shape[1] for a in arrays)), dtype=np.float32)
    for e, a in enumerate(arrays):
        out[e, :, : a.shape[1]] = a
    return out


def _uniform_ids(recalled: list) -> np.ndarray | None:
    """[rows, k] ids (staging order) when each row recalled k ids laid end to end in one fetched array (k = 0
    when none recalled); None otherwise."""
    n = len(recalled)
    if recalled.count(None) == n:
        return np.zeros((n, 0), dtype=np.int64)
    try:  # (a row that recalled nothing, None, among rows that did: not uniform)
        _, sources, starts, counts = zip(*recalled, strict=True)
    except TypeError:
        return None
    k = counts[0]
    # (C-level tuple comparisons, not a check per row in Python: 28 layers x 16 rows a step at B = 16; a
    # fetched array compares by identity)
    if counts.count(k) != n or sources.count(sources[0]) != n or starts != _ends_to_end(k, n):
        return None
    return sources[0].value()[: n * k].reshape(n, k)


@functools.lru_cache(maxsize=256)
def _ends_to_end(k: int, n: int) -> tuple[int, ...]:
    return tuple(range(0, n * k, k))


def _ragged_ids(recalled: list) -> list[list[int]]:
    fetched: dict[int, list] = {}  # by fetched array
    out = []
    for entry in recalled:
        if entry is None:
            out.append([])
            continue
        ids = fetched.get(id(entry[1]))
        if ids is None:
            ids = fetched[id(entry[1])] = entry[1].value().tolist()
        out.append(sorted(ids[entry[2] : entry[2] + entry[3]]))
    return out


def _moved_ids(moved: list) -> Iterator[tuple[int, tuple[list[int], list[int], list[int]]]]:
    """(row, (promoted, offloaded, evicted) block ids) of each row that placed: its codes are its row of a
    fetched [placed rows, blocks] array (1 offloaded, 2 promoted, 3-4 evicted). The rows of one array are read
    together: one nonzero per outcome over all of them, split by row (per row and outcome, a nonzero and a list
    was ~5.6 us: 48 of them per placing layer at B = 16)."""
    by_source: dict[int, tuple[object, list[int], list[int]]] = {}  # fetched array -> (it, rows, its rows there)
    for i, move in enumerate(moved):
        if move is not None:
            group = by_source.setdefault(id(move[0]), (move[0], [], []))
            group[1].append(i)
            group[2].append(move[1])
    for source, rows, at in by_source.values():
        codes = source.value()[at]  # [rows placed, blocks]
        split = []
        for mask in (codes == 2, codes == 1, codes >= 3):
            row_of, block = np.nonzero(mask)  # (row-major: each row's ids ascending, rows in order)
            ends = np.searchsorted(row_of, np.arange(1, len(rows) + 1)).tolist()
            flat = block.tolist()
            split.append([flat[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)])
        for k, i in enumerate(rows):
            yield i, (split[0][k], split[1][k], split[2][k])


class StepRecording:
    """A cache's recording of the current step, shared by its layers: each recording layer adds its
    `LayerEntry` for the rows `row_ids`; the first layer of a step (or of a new set of rows) opens a `StepRows`
    and hands each row's recorder its place in it."""

    def __init__(self):
        self._current: StepRows | None = None

    def add(self, row_ids: tuple, states: list, entry: LayerEntry) -> None:
        group = self._current
        if group is None or group.closed or group.row_ids != row_ids:
            group = self._current = StepRows(row_ids)
            for index, state in enumerate(states):
                state.recorder.add_step_rows(group, index)
        group.entries.append(entry)


@dataclass
class Recorder:
    """One sample's recorded rows: per step, the `StepRows` it is part of, its index there and the step
    (pending until the step ends, then built), concatenated into columns when `columns` or a table is read."""

    record_access: bool = True
    step: int = 0
    _columns: dict[str, list] = field(default_factory=lambda: {name: [] for name in STEP_COLUMNS + OPTIONAL_STEP_COLUMNS})
    _block_mass: list[np.ndarray] = field(default_factory=list)
    step_us: list[float] = field(default_factory=list)
    pending: list[tuple] = field(default_factory=list)  # (StepRows, index, step)
    _parts: list[tuple] = field(default_factory=list)  # ended steps' (StepRows, index, step), not yet in `_columns`
    layer_us: list[list[float] | None] = field(default_factory=list)  # per step: each decoder layer's time
    # per step: the deferred scoring, recording and placement of the step's layers that ran inside each layer's
    # forward (tracer.decode.LayerTimer.read_deferred_us: all in the last layer's), included in its layer time
    deferred_us: list[list[float] | None] = field(default_factory=list)

    def add_step_rows(self, rows: StepRows, index: int) -> None:
        """This sample is row `index` of the step's `rows` (every layer of the step that records it)."""
        self.pending.append((rows, index, self.step))

    def _resolve(self) -> None:
        """Build the pending steps' rows (their device values fetched: one copy per step for every row and
        layer; the first recorder of a step builds it for all)."""
        pending, self.pending = self.pending, []
        build_steps([rows for rows, _, _ in pending])
        self._parts.extend(pending)

    @property
    def columns(self) -> dict[str, list]:
        """The step columns so far (`STEP_COLUMNS` + `OPTIONAL_STEP_COLUMNS`), one entry per (step, layer) row."""
        self._resolve()
        parts, self._parts = self._parts, []
        if parts:
            self._extend(parts)
        return self._columns

    def _extend(self, parts: list[tuple]) -> None:
        """Append the parts' rows to the columns: each array column concatenated over the parts at once."""
        columns = self._columns
        ints = np.concatenate([rows.ints[:, i] for rows, i, _ in parts])
        for j, name in enumerate(INT_COLUMNS):
            columns[name].extend(ints[:, j].tolist())
        masses = np.concatenate([rows.masses[:, i] for rows, i, _ in parts])
        columns["mass_hbm"].extend(masses[:, 0].tolist())
        columns["mass_ddr"].extend(masses[:, 1].tolist())
        counts = [rows.ints.shape[0] for rows, _, _ in parts]  # each step's layers
        columns["step"].extend(np.repeat([step for _, _, step in parts], counts).tolist())
        if all(isinstance(rows.recalled, np.ndarray) for rows, _, _ in parts) \
                and len({rows.recalled.shape[2] for rows, _, _ in parts}) == 1:
            columns["recalled_block_ids"].extend(np.concatenate([rows.recalled[:, i] for rows, i, _ in parts]).tolist())
        else:
            for rows, i, _ in parts:
                recalled = rows.recalled
                columns["recalled_block_ids"].extend(recalled[:, i].tolist() if isinstance(recalled, np.ndarray)
                                                     else [layer_rows[i] for layer_rows in recalled])
        # Most rows move nothing: they share one empty list per column (the columns are read, never written; a list
        # per row would be hundreds of objects per sample for the garbage collector to walk at every collection)
        moved = [[[]] * len(ints) for _ in MOVED_COLUMNS]
        quant = [[None] * len(ints) for _ in OPTIONAL_STEP_COLUMNS]
        for start, (rows, i, _) in zip(itertools.accumulate(counts, initial=0), parts):
            for e, *ids in rows.moved[i]:
                for column, values in zip(moved, ids, strict=True):
                    column[start + e] = values
            if rows.quant is not None:
                for e, values in enumerate(rows.quant[:, i].tolist()):
                    if not math.isnan(values[0]):
                        quant[0][start + e], quant[1][start + e] = values
        for name, column in zip(MOVED_COLUMNS + OPTIONAL_STEP_COLUMNS, moved + quant, strict=True):
            columns[name].extend(column)
        if parts[0][0].hits is not None:  # a recall buffer (every step of a run has one, or none does)
            counts = np.concatenate([rows.hits[:, i] for rows, i, _ in parts])
            columns.setdefault("recall_hits", []).extend(counts[:, 0].tolist())
            columns.setdefault("recall_misses", []).extend(counts[:, 1].tolist())
        if self.record_access:
            n_blocks = ints[:, INT_COLUMNS.index("hbm_blocks")] + ints[:, INT_COLUMNS.index("ddr_blocks")] \
                + ints[:, INT_COLUMNS.index("evicted_blocks")]
            masses = itertools.chain.from_iterable(rows.block_mass[:, i] for rows, i, _ in parts)
            self._block_mass.extend(map(_first, masses, n_blocks.tolist()))

    @property
    def block_mass(self) -> list[np.ndarray]:
        self.columns  # noqa: B018  (resolves and extends)
        return self._block_mass

    def end_step(self, wall_us: float, layer_us: list[float] | None = None,
                 deferred_us: list[float] | None = None) -> None:
        for rows, _, step in reversed(self.pending):  # this step's rows are complete
            if step != self.step:
                break
            rows.closed = True
        if len(self.pending) >= RESOLVE_EVERY:
            self._resolve()
        self.step_us.append(wall_us)
        self.layer_us.append(layer_us)
        self.deferred_us.append(deferred_us)
        self.step += 1

    def steps_table(self) -> dict[str, list]:
        table = dict(self.columns)
        table["measured_step_us"] = [self.step_us[s] for s in self.columns["step"]]
        table["measured_layer_us"] = [
            None if self.layer_us[s] is None else self.layer_us[s][layer]
            for s, layer in zip(self.columns["step"], self.columns["layer"], strict=True)
        ]
        table["measured_deferred_us"] = [
            None if self.deferred_us[s] is None else self.deferred_us[s][layer]
            for s, layer in zip(self.columns["step"], self.columns["layer"], strict=True)
        ]
        return table

    def access_table(self) -> dict[str, list] | None:
        columns = self.columns
        if not self.record_access:
            return None
        return {"step": columns["step"], "layer": columns["layer"], "block_mass": self._block_mass}


def _first(values: np.ndarray, n: int) -> np.ndarray:
    return values[:n]
