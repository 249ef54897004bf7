"""Indices the host builds for the tiered cache's kernels, from counts it knows without reading the device.

`device_index` is the one way a host-known list or array of indices becomes a device tensor in the cache: on
CUDA a pinned, non-blocking copy (`tracer.transfer.host_to_device`), never a tensor indexed with a Python list
(which copies from pageable memory inside the op: a blocking host-to-device copy). The step path builds each
such index once per step, in the plans its layers share (`tracer.cache.step`), or once per distinct value
(`cached_device_index`); `tests/test_host_syncs.py` counts them. The rest are small host-side helpers of
the ragged layouts (rows of unequal counts laid end to end) and the per-row ranking the placement uses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tracer.transfer import host_to_device


def device_index(values, device: torch.device) -> torch.Tensor:
    """Host-known indices (a list, a NumPy array) as a tensor on the compute device, without making the host
    wait (`tracer.transfer.host_to_device`)."""
    return host_to_device(values, device)


@functools.lru_cache(maxsize=4096)
def cached_device_index(values: tuple, device: str) -> torch.Tensor:
    """`device_index` of a tuple that recurs step after step (a batch's rows, a recall's counts), kept: read-only."""
    return device_index(values, torch.device(device))


@functools.lru_cache(maxsize=4096)
def flat_selection(counts: tuple[int, ...], width: int) -> tuple[np.ndarray, np.ndarray]:
    """For rows of `width` entries of which the first `counts[i]` are wanted: their flat indices, and each
    one's index within its row (built on the host from host-known counts: nothing is read back; cached, as
    the same counts recur step after step). Read-only arrays."""
    within = np.arange(width)
    wanted = within[None, :] < np.asarray(counts)[:, None]
    flat = (np.arange(len(counts))[:, None] * width + within)[wanted]
    return flat, np.broadcast_to(within, wanted.shape)[wanted]


@functools.lru_cache(maxsize=4096)
def flat_selection_index(counts: tuple[int, ...], width: int, device: str) -> torch.Tensor:
    """`flat_selection`'s flat indices on the device (kept: the same counts recur)."""
    return device_index(flat_selection(counts, width)[0], torch.device(device))


@functools.lru_cache(maxsize=4096)
def staging_pages(counts: tuple[int, ...], width: int, first_page: int, device: str) -> torch.Tensor:
    """The staging page of each recalled block (`flat_selection`'s order): `first_page` + its index within its
    row, on the device (cached: the same recall counts recur step after step)."""
    return device_index(flat_selection(counts, width)[1] + first_page, torch.device(device))


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of `counts[i]` entries each, laid end to end: each entry's row and its index within the row."""
    total = int(counts.sum())
    return np.repeat(np.arange(len(counts)), counts), np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)


def ranks(values: torch.Tensor, descending: bool) -> torch.Tensor:
    """Each entry's rank within its row [m, n] (0 = first), ties by position: a per-row top-k whose k differs
    by row is `rank < k`."""
    order = torch.argsort(values, dim=1, descending=descending, stable=True)
    out = torch.empty_like(order)
    out.scatter_(1, order, torch.arange(values.shape[1], device=values.device).expand_as(order))
    return out


def block_of(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block holding each (non-negative) position: a shift for a power-of-two block size (integer division is
    ~4-10x slower on a CPU: 7.6 against 2.1 us for [24, 80] int64, 48 against 5 for [24, 700])."""
    if block_size & (block_size - 1) == 0:
        return positions >> (block_size.bit_length() - 1)
    return positions // block_size


def first_true(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the first `n` True entries of a 1-D mask, ascending: `mask.nonzero()` when the count is
    already known on the host, without the device->host read nonzero needs to size its result."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:n]


def consecutive(rows: list[int]) -> bool:
    return rows == list(range(rows[0], rows[0] + len(rows)))


class RowIndex(NamedTuple):
    """A set of rows as indices into a layer's `[rows, ...]` tensors."""

    tensor: torch.Tensor  # the row ids, on the device
    select: slice | torch.Tensor  # a slice (a view, no gather) when the rows are consecutive, else `tensor`


@dataclass
class BatchRows:
    """The active rows' `RowIndex`, made once per set of rows and shared by a cache's layers (a step's rows are
    every layer's). The cache passes one list per set of rows (`TieredCache.set_active`), recognised by identity."""

    listed: list | None = None  # the list the index was last asked for
    key: tuple = ()
    index: RowIndex | None = None

    def index_of(self, rows: list[int], device: torch.device) -> RowIndex:
        if self.listed is rows:
            return self.index
        key = tuple(rows)
        if self.key != key:
            tensor = device_index(rows, device)
            select = slice(rows[0], rows[0] + len(rows)) if consecutive(rows) else tensor
            self.key, self.index = key, RowIndex(tensor, select)
        self.listed = rows
        return self.index
