"""The access encoding's stated error bound, and the properties the access model promises."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from traces import AccessModel, decode_block_mass, encode_block_mass, max_relative_error, synth_block_masses
from traces.access_model import top_share
from traces.encoding import FLOOR_LOG2, LEVELS_PER_OCTAVE

FLOOR = 2.0**FLOOR_LOG2
masses_strategy = arrays(np.float64, st.integers(1, 300), elements=st.floats(0.0, 1.0))


@given(masses_strategy)
def test_encoding_error_is_within_the_documented_bound(masses):
    decoded = decode_block_mass(encode_block_mass(masses)).astype(np.float64)
    warm = masses >= FLOOR
    relative = np.abs(decoded[warm] - masses[warm]) / masses[warm]
    # float32 output adds at most one float32 rounding on top of the quantisation bound
    assert (relative <= max_relative_error() * (1 + 1e-6) + 2**-23).all()
    assert (decoded[~warm] == 0).all()  # below the floor: dropped, absolute error < FLOOR


def test_bound_is_tight_and_codes_are_monotone():
    # A mass halfway (in log2) between two codes sees the full half-step error: the bound is not loose.
    halfway = 2.0 ** (-3 + 0.5 / LEVELS_PER_OCTAVE) * (1 + 1e-9)  # rounds up
    decoded = float(decode_block_mass(encode_block_mass(np.array([halfway])))[0])
    assert abs(decoded - halfway) / halfway > 0.99 * max_relative_error()
    grid = np.geomspace(FLOOR, 1.0, 5000)
    codes = encode_block_mass(grid)
    assert (np.diff(codes.astype(int)) >= 0).all() and codes[0] == 1 and codes[-1] == 1 + 16 * LEVELS_PER_OCTAVE
    assert encode_block_mass(np.array([0.0, np.nan, -1.0, FLOOR * 0.99])).tolist() == [0, 0, 0, 0]


def test_access_model_rows_sum_to_one_and_are_deterministic():
    model = AccessModel(n_layers=5, seed=3)
    masses = model.masses(step=40, logical_len=1000)
    assert masses.shape == (5, 63)
    np.testing.assert_allclose(masses.sum(axis=1), 1.0, rtol=1e-12)
    assert (masses > 0).all()
    # A pure function of (seed, step, length): call order and a fresh instance do not change it.
    model.masses(step=7, logical_len=5000)
    np.testing.assert_array_equal(AccessModel(n_layers=5, seed=3).masses(40, 1000), masses)
    assert not np.array_equal(AccessModel(n_layers=5, seed=4).masses(40, 1000), masses)


def test_access_model_has_sinks_recency_persistent_heavy_hitters_and_a_long_tail():
    model = AccessModel(n_layers=8, seed=0)
    n_blocks = 2000 // 16
    full = [model.masses(s, 2000 + 16 * s) for s in range(0, 400, 20)]  # one new block per step
    steps = [m[:, :n_blocks] for m in full]
    stacked = np.stack(steps)  # [step, layer, block]: the blocks that exist at every step
    mean = stacked.mean(axis=0)
    median_block = np.median(mean, axis=1)
    assert (mean[:, 0] > 10 * median_block).all()  # the sink block
    newest = np.mean([m[:, -1] for m in full], axis=0)
    assert (newest > 10 * median_block).all()  # the most recent block, wherever the sequence ends
    # Top 20% of blocks hold 70-95% of the mass on average (what real reasoning models show).
    shares = np.array([top_share(m) for m in full])
    assert 0.70 <= shares.mean() <= 0.95
    # Heavy hitters persist: the top middle blocks at one step are mostly the top ones 100 steps later.
    middle = slice(1, n_blocks - 8)
    first = set(np.argsort(stacked[0, 4, middle])[-10:])
    later = set(np.argsort(stacked[5, 4, middle])[-10:])
    assert len(first & later) >= 5
    # Layers differ.
    assert not np.allclose(mean[2], mean[3], rtol=0.1)


def test_synth_block_masses_is_one_seeded_distribution():
    masses = synth_block_masses(100, seed=1)
    assert masses.shape == (100,) and abs(masses.sum() - 1) < 1e-12
    np.testing.assert_array_equal(masses, synth_block_masses(100, seed=1))
    assert 0.70 <= top_share(masses)[0] <= 0.97
