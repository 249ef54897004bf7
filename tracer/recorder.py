"""Per-sample recording buffers -> the columns of trace v1 (traces/schema.py).

The tiered layers call `add_layer_row` once per (step, layer) with the host-known columns and one `Deferred`
for the device-derived ones (block masses reduced on the device, moved and recalled ids), resolved at
`end_step` (one copy per step for every layer and row, tracer.cache.DeferredCopies); the decode loop sets `step`, the
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
    pending: list[tuple] = field(default_factory=list)  # rows added since the last resolve: (host values, Deferred)
    layer_us: list[list[float] | None] = field(default_factory=list)  # per step: each decoder layer's time

    def add_layer_row(self, *, deferred: Deferred | None = None, **values) -> None:
        """One (step, layer) row: the columns known on the host, and `deferred`, which resolves (from the step's
        one copy) to the columns that come from the device (masses, block ids, quantization error)."""
        values["step"] = self.step
        self.pending.append((values, deferred))

    def _resolve(self) -> None:
        """Append the pending rows, their device values fetched (one copy per step for every row and layer)."""
        pending, self.pending = self.pending, []
        columns = self.columns
        for values, deferred in pending:
            if deferred is not None:
                values.update(deferred.value())
            for name in STEP_COLUMNS:
                columns[name].append(values[name])
            for name in OPTIONAL_STEP_COLUMNS:
                columns[name].append(values.get(name))
            if self.record_access:
                self.block_mass.append(values["block_mass"])

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
