"""thoughtkv: trace collector + discrete-event memory-hierarchy simulator for reasoning-LLM KV caches.

This tiny package holds only what every other package shares: the version, the user-error type and the
`thoughtkv` command dispatcher. The work lives in `traces`, `hwprofiles`, `tracer`, `simulator`, `analysis`.
"""

from thoughtkv.errors import UserError

__version__ = "0.1.0"
__all__ = ["UserError", "__version__", "git_commit"]


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
