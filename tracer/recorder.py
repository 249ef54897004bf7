"""Per-sample recording buffers -> the columns of trace v1 (traces/schema.py).

The tiered layers call `add_layer_row` once per (step, layer) with scalars, id lists and the block masses
already reduced on the device; device values arrive as `Deferred` and are resolved at `end_step` (one copy
per step for every layer and row, tracer.cache.DeferredCopies); the decode loop sets `step`, the
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


class Deferred:
    """A recorded value still on the device (tracer.cache.DeferredCopies): `value()` fetches it (once: the value
    is kept); `then(f)` is the value passed through `f`, fetched with it."""

    _unset = object()

    def __init__(self, fetch):
        self._fetch, self._value = fetch, Deferred._unset

    def value(self):
        if self._value is Deferred._unset:
            self._value = self._fetch()
        return self._value

    def then(self, transform) -> Deferred:
        return Deferred(lambda: transform(self.value()))


@dataclass
class Recorder:
    record_access: bool = True
    step: int = 0
    columns: dict[str, list] = field(default_factory=lambda: {name: [] for name in STEP_COLUMNS + OPTIONAL_STEP_COLUMNS})
    block_mass: list[np.ndarray] = field(default_factory=list)
    step_us: list[float] = field(default_factory=list)
    pending: list[dict] = field(default_factory=list)  # rows added since the last resolve (device values deferred)
    layer_us: list[list[float] | None] = field(default_factory=list)  # per step: each decoder layer's time

    def add_layer_row(self, *, deferred: Deferred | None = None, **values) -> None:
        """One (step, layer) row: the columns' values, any of them a `Deferred`; `deferred` (optional) resolves
        to a dict of further columns (one fetch for several device values, e.g. a row's masses and moves)."""
        values["step"] = self.step
        if deferred is not None:
            values["_deferred"] = deferred
        self.pending.append(values)

    def _resolve(self) -> None:
        """Append the pending rows, their `Deferred` values replaced by host values (one copy per step for all)."""
        pending, self.pending = self.pending, []
        columns, block_mass, record_access = self.columns, self.block_mass, self.record_access
        for values in pending:
            more = values.pop("_deferred", None)
            if more is not None:
                values.update(more.value())
            for name in STEP_COLUMNS:
                value = values[name]
                columns[name].append(value.value() if isinstance(value, Deferred) else value)
            for name in OPTIONAL_STEP_COLUMNS:
                value = values.get(name)
                columns[name].append(value.value() if isinstance(value, Deferred) else value)
            if record_access:
                mass = values["block_mass"]
                block_mass.append(mass.value() if isinstance(mass, Deferred) else mass)

    def end_step(self, wall_us: float, layer_us: list[float] | None = None) -> None:
        self._resolve()
        self.step_us.append(wall_us)
        self.layer_us.append(layer_us)
        self.step += 1

    def steps_table(self) -> dict[str, list]:
        self._resolve()
        table = dict(self.columns)
        table["measured_step_us"] = [self.step_us[s] for s in self.columns["step"]]
        table["measured_layer_us"] = [
            None if self.layer_us[s] is None else self.layer_us[s][layer]
            for s, layer in zip(self.columns["step"], self.columns["layer"], strict=True)
        ]
        return table

    def access_table(self) -> dict[str, list] | None:
        self._resolve()
        if not self.record_access:
            return None
        return {"step": self.columns["step"], "layer": self.columns["layer"], "block_mass": self.block_mass}
