"""The simulator's user errors (one line, exit 2), in one place so that options shared by every command can
raise the error each command's callers catch."""

from __future__ import annotations

from thoughtkv_base import UserError


class SimulationError(UserError):
    """`simulate`: inconsistent options, or a run it cannot replay."""


class ServingError(UserError):
    """`serve-sim`: serving options or an arrival file that cannot be simulated as given."""


class OptionError(SimulationError, ServingError):
    """A value a simulator option (SimOptions, ServingConfig) cannot take. The options are shared by
    simulate, serve-sim, sweeps and crosscheck, so this is an error of whichever of them was given it."""


class ProjectionError(OptionError):
    """A projection to another model's shapes that cannot be made (`--as-model`, `--as-dtype`, `--context-scale`,
    `--recalls`: simulate, serve-sim and grids alike)."""
