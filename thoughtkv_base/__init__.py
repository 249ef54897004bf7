"""The bottom layer: what every thoughtkv package shares and nothing else — the user-error type, the version,
the one rule for seeds, and (thoughtkv_base.pool) the local process pool whose workers end with the command.

It imports nothing of the project (import-linter checks this), so `traces`, `hwprofiles`, `tracer`,
`simulator` and `analysis` can all import it without importing the `thoughtkv` command layer on top.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["SEED_MAX", "UserError", "__version__", "check_seed", "git_commit"]


class UserError(Exception):
    """Bad input or an impossible request: the message names the problem and the fix, in one line.

    Every package derives its own errors from this (e.g. `traces.TraceFormatError`), so the CLI and the
    property tests can tell "the project refused this input" from a crash.
    """

    exit_code = 2


# Every seed (trace, serve-sim, traces synth, the demo) is a whole number in [0, SEED_MAX]: what torch.manual_seed,
# numpy's generators and C unsigned longs all take (10**20 raised OverflowError inside torch; -1 numpy refused).
SEED_MAX = 2**32 - 1


def check_seed(value, option: str = "--seed") -> int:
    """`value` as a seed, or a UserError naming `option` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise UserError(f"{option} {value!r} must be a whole number in [0, {SEED_MAX}] (0 to 2**32 - 1)")
    return value


def git_commit() -> str | None:
    """The project's git commit when running from a checkout, else None (installed wheel)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
