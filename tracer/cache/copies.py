"""The step's one device->host copy: what the tiered cache records on the device reaches the host together.

`DeferredCopies` (one per `TieredCache`, shared by its layers and rows) collects the values a decode step
records (block masses, recalled and moved block ids, quantization errors, the next tokens) and fetches them
with one `torch.cat` and one copy when the recorder resolves the step, so a step's recording costs one copy
whatever the layers and batch.
"""

from __future__ import annotations

import numpy as np
import torch

from tracer.recorder import Deferred

# dtypes a recorded value travels in as its own bytes (the others are converted to float32 first)
_HOST_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32,
                torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}


class DeferredCopies:
    """Recorded device values, copied to the host together: each `add` returns a `Deferred` whose value is
    fetched (one `torch.cat` + one device->host copy for everything added since the last fetch) when the
    recorder resolves its rows at step end. Values travel as their own bytes (a view, no conversion kernel) and
    come back, as NumPy arrays of their dtype, through the `transform` given."""

    def __init__(self):
        self._batch = _CopyBatch()

    def fetched_since(self, deferred: Deferred | None) -> bool:
        """Whether the copy `deferred` was added to has reached the host (a value added now would be in the next)."""
        return deferred is None or deferred.source is not self._batch or self._batch.fetched

    def add(self, tensor: torch.Tensor, transform) -> Deferred:
        if self._batch.fetched:  # the previous batch reached the host: start a new one
            self._batch = _CopyBatch()
        batch = self._batch
        dtype = _HOST_DTYPES.get(tensor.dtype)
        if dtype is not None and tensor.is_contiguous() and not tensor.requires_grad:  # bytes by two views
            raw = tensor.view(-1).view(torch.uint8)
        else:
            flat = tensor.detach().reshape(-1)
            if dtype is None:  # e.g. bfloat16, which NumPy has not
                flat, dtype = flat.float(), np.float32
            raw = flat.contiguous().view(torch.uint8)  # (a reshape(-1) of a strided tensor may be a strided view)
        batch.tensors.append(raw)
        batch.dtypes.append(dtype)
        batch.offsets.append(batch.offsets[-1] + raw.shape[0])
        index = len(batch.tensors) - 1
        return Deferred(lambda: transform(batch.host(index)), source=batch)


class _CopyBatch:
    def __init__(self):
        self.tensors: list[torch.Tensor] = []  # bytes
        self.dtypes: list = []
        self.offsets: list[int] = [0]  # where each value starts in the fetched bytes
        self._host: np.ndarray | None = None

    @property
    def fetched(self) -> bool:
        return self._host is not None

    def host(self, index: int) -> np.ndarray:
        if self._host is None:
            self._host = torch.cat(self.tensors).cpu().numpy()
            self.tensors = []
        return self._host[self.offsets[index] : self.offsets[index + 1]].view(self.dtypes[index])


def as_int64(array: np.ndarray) -> np.ndarray:
    return array.astype(np.int64)


class LayerIds:
    """One layer's recalled ids (`ids`, on the device) as part of the one copy of every layer's that a step of
    layers placed together adds (`tracer.cache.step.after_attention_of_layers`; `deferred`, from `base` on): a
    `Deferred` of this layer's part, so that the rows that recalled need not be visited again."""

    __slots__ = ("ids", "deferred", "base")

    def __init__(self, ids: torch.Tensor):
        self.ids, self.deferred, self.base = ids, None, 0

    def value(self) -> np.ndarray:
        return self.deferred.value()[self.base : self.base + self.ids.shape[0]]
