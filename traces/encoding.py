"""Stored form of per-block attention masses: one byte per block, log2-quantised, with a mass floor.

A mass m (a share of one step's attention, in [0, 1]) is stored as a code c in 0..255:

    c = 0                        if m < 2**FLOOR_LOG2       (the block is "cold": decoded as 0)
    c = 1 + round((log2 m - FLOOR_LOG2) * LEVELS_PER_OCTAVE), clipped to 1..255   otherwise

and decoded as 2 ** (FLOOR_LOG2 + (c - 1) / LEVELS_PER_OCTAVE). Error (see `max_relative_error`):
a mass at or above the floor comes back within a factor 2**(±1 / (2 * LEVELS_PER_OCTAVE)) of itself;
a mass below the floor comes back as 0, an absolute error below 2**FLOOR_LOG2 per block. Decoded masses
are NOT renormalised, so one step's decoded masses sum to 1 within those bounds.

Why log2: attention masses span many orders of magnitude and what the simulator asks of them (which
blocks matter, how much mass lands on offloaded blocks) depends on relative, not absolute, precision.
The parameters used to write a run are stored in run.json ("access"), so readers decode with them.
"""

from __future__ import annotations

import numpy as np

ENCODING_NAME = "log2-u8"
FLOOR_LOG2 = -16  # masses below 2**-16 of the step's attention are stored as 0
LEVELS_PER_OCTAVE = 8  # codes per factor of 2: 8 -> max relative error 2**(1/16) - 1 = 4.4 %


def encoding_params() -> dict:
    """What run.json records under "access" so that a reader can decode this run."""
    return {"encoding": ENCODING_NAME, "floor_log2": FLOOR_LOG2, "levels_per_octave": LEVELS_PER_OCTAVE}


def max_relative_error(levels_per_octave: int = LEVELS_PER_OCTAVE) -> float:
    """Largest |decoded - m| / m for a mass m at or above the floor (half a quantisation step in log2)."""
    return float(2.0 ** (0.5 / levels_per_octave) - 1.0)


def encode_block_mass(
    masses: np.ndarray, *, floor_log2: int = FLOOR_LOG2, levels_per_octave: int = LEVELS_PER_OCTAVE
) -> np.ndarray:
    """Masses (any shape, values in [0, 1]; NaN or negative count as 0) -> uint8 codes of the same shape."""
    m = np.asarray(masses, dtype=np.float64)
    codes = np.zeros(m.shape, dtype=np.uint8)
    warm = np.isfinite(m) & (m >= 2.0**floor_log2)
    steps = np.rint((np.log2(m[warm]) - floor_log2) * levels_per_octave)
    codes[warm] = np.clip(steps + 1, 1, 255).astype(np.uint8)
    return codes


def decode_block_mass(
    codes: np.ndarray, *, floor_log2: int = FLOOR_LOG2, levels_per_octave: int = LEVELS_PER_OCTAVE
) -> np.ndarray:
    """uint8 codes -> float32 masses (code 0 -> 0.0)."""
    c = np.asarray(codes, dtype=np.float64)
    masses = np.exp2(floor_log2 + (c - 1.0) / levels_per_octave)
    return np.where(c == 0, 0.0, masses).astype(np.float32)
