"""Per-sample recording buffers -> the columns of trace v1 (traces/schema.py).

Each tiered layer hands every recording row of a step one `LayerRows` (the layer's columns for all its rows:
host-known ones as lists, the device-derived ones — block masses reduced on the device, moved and recalled ids
— resolved for all rows at once from the step's one copy, tracer.cache.DeferredCopies); each row's recorder
keeps (LayerRows, its index), and at `end_step` that row's tuple of values (built once per LayerRows), transposed
into columns when a table is read. No dict per row and layer: at a batch of B
that is B x layers of them per step, Python time a GPU step cannot hide. The decode loop sets `step`, the
step's wall time and (tracer.decode.LayerTimer) each decoder layer's time. Nothing here touches torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STEP_COLUMNS = (
    "step", "layer", "query_tokens", "logical_len", "hbm_tokens", "ddr_tokens", "evicted_tokens",
    "recalled_tokens", "hbm_blocks", "ddr_blocks", "evicted_blocks", "recalled_block_ids", "promoted_block_ids",
    "offloaded_block_ids", "evicted_block_ids", "bytes_h2d", "bytes_d2h", "hbm_kv_bytes", "ddr_kv_bytes",
    "mass_hbm", "mass_ddr",
)
OPTIONAL_STEP_COLUMNS = ("quant_max_rel_err", "quant_rms_rel_err")  # quantized DDR tier; None when not measured
_ROW_COLUMNS = STEP_COLUMNS[1:]  # what a layer records per row (the recorder adds the step)
_ROW_VALUES = _ROW_COLUMNS + OPTIONAL_STEP_COLUMNS  # a row's values, as `LayerRows.rows` holds them


class Deferred:
    """A recorded value still on the device (tracer.cache.DeferredCopies): `value()` fetches it (once: the value
    is kept)."""

    _unset = object()

    def __init__(self, fetch):
        self._fetch, self._value = fetch, Deferred._unset

    def value(self):
        if self._value is Deferred._unset:
            self._value = self._fetch()
        return self._value


class LayerRows:
    """One decoder layer's rows of one step for every recording row of a batch (index i: the i-th of them):
    `host` columns as lists over the rows, and `device`, a callable returning the device-derived columns as
    lists over the same rows, called once (after the step's copy) for all of them."""

    def __init__(self, host: dict[str, list], device=None):
        self.host, self._device, self._columns, self._rows = host, device, None, None

    def columns(self) -> dict[str, list]:
        if self._columns is None:
            self._columns = self.host if self._device is None else {**self.host, **self._device()}
        return self._columns

    def rows(self) -> list[tuple]:
        """Each row's values as one tuple in `_ROW_VALUES` order (None for an optional column not measured), built
        once for all rows: a recorder keeps its rows' tuples and transposes them when read."""
        if self._rows is None:
            columns = self.columns()
            n = len(columns["layer"])
            self._rows = list(zip(*[columns.get(name) or [None] * n for name in _ROW_VALUES], strict=True))
        return self._rows


@dataclass
class Recorder:
    """One sample's recorded rows. A step's rows arrive as (LayerRows, index, step), one per layer; when the step
    ends each becomes one tuple (and its block masses, when recorded), and the tuples are transposed into
    columns when `columns` or a table is read: a step costs a sample two appends per layer, not 20."""

    record_access: bool = True
    step: int = 0
    _columns: dict[str, list] = field(default_factory=lambda: {name: [] for name in STEP_COLUMNS + OPTIONAL_STEP_COLUMNS})
    _block_mass: list[np.ndarray] = field(default_factory=list)
    step_us: list[float] = field(default_factory=list)
    pending: list[tuple] = field(default_factory=list)  # this step's rows: (LayerRows, index, step)
    _row_tuples: list[tuple] = field(default_factory=list)  # ended steps' rows, not yet in `_columns`
    _row_steps: list[int] = field(default_factory=list)
    layer_us: list[list[float] | None] = field(default_factory=list)  # per step: each decoder layer's time

    @property
    def columns(self) -> dict[str, list]:
        """The step columns so far (`STEP_COLUMNS` + `OPTIONAL_STEP_COLUMNS`), one entry per (step, layer) row."""
        self._resolve()
        if self._row_tuples:
            columns = self._columns
            columns["step"].extend(self._row_steps)
            for name, values in zip(_ROW_VALUES, zip(*self._row_tuples, strict=True), strict=True):
                columns[name].extend(values)
            self._row_tuples, self._row_steps = [], []
        return self._columns

    @property
    def block_mass(self) -> list[np.ndarray]:
        self._resolve()
        return self._block_mass

    def add_layer_rows(self, rows: LayerRows, index: int) -> None:
        """This sample's (step, layer) row: row `index` of a layer's `rows` (`_ROW_COLUMNS`, `block_mass`, and
        the optional columns where measured)."""
        self.pending.append((rows, index, self.step))

    def _resolve(self) -> None:
        """Keep the pending rows as tuples, their device values fetched (one copy per step for every row and
        layer), so that their LayerRows die with the step (thousands of them alive until the sample ends made
        Python's garbage collector walk them: 10-30% of a batch-32 micro step)."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        self._row_steps.extend([step for _, _, step in pending])
        self._row_tuples.extend([rows.rows()[index] for rows, index, _ in pending])
        if self.record_access:
            self._block_mass.extend([rows.columns()["block_mass"][index] for rows, index, _ in pending])

    def end_step(self, wall_us: float, layer_us: list[float] | None = None) -> None:
        self._resolve()
        self.step_us.append(wall_us)
        self.layer_us.append(layer_us)
        self.step += 1

    def steps_table(self) -> dict[str, list]:
        table = dict(self.columns)
        table["measured_step_us"] = [self.step_us[s] for s in self.columns["step"]]
        table["measured_layer_us"] = [
            None if self.layer_us[s] is None else self.layer_us[s][layer]
            for s, layer in zip(self.columns["step"], self.columns["layer"], strict=True)
        ]
        return table

    def access_table(self) -> dict[str, list] | None:
        columns = self.columns
        if not self.record_access:
            return None
        return {"step": columns["step"], "layer": columns["layer"], "block_mass": self._block_mass}
