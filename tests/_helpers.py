"""Helpers several test files share: the tiny random model shapes, and running `thoughtkv` in a subprocess to
kill or interrupt it mid-run (pytest puts tests/ on sys.path, so `from _helpers import ...` works)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from transformers import LlamaConfig, MistralConfig, Qwen2Config

TINY_SHAPES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)
TINY_CONFIGS = {
    "qwen2": lambda: Qwen2Config(**TINY_SHAPES),
    "llama": lambda: LlamaConfig(**TINY_SHAPES),
    "mistral": lambda: MistralConfig(**TINY_SHAPES, sliding_window=None),
}


def default_sigint() -> None:
    """Give the child the default Ctrl-C (a `preexec_fn`). A job a non-interactive shell starts in the background
    (`make test &`, a CI runner's step) inherits SIGINT *ignored*, and Python then installs no KeyboardInterrupt
    handler: a test that sends SIGINT would see the child run on, whatever thoughtkv does with a Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_thoughtkv(args: list[str], cwd: Path, text: bool = False) -> subprocess.Popen:
    """`python -m thoughtkv ARGS` with one torch thread, stderr captured, Ctrl-C at its default."""
    return subprocess.Popen([sys.executable, "-m", "thoughtkv", *args], cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=text, preexec_fn=default_sigint)


def wait_while_running(process: subprocess.Popen, condition, timeout_s: float, poll_s: float = 0.05) -> None:
    """Poll `condition()` until it holds, the process ends, or `timeout_s` passes."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and process.poll() is None and not condition():
        time.sleep(poll_s)


def has_committed_part(table_dir: Path) -> bool:
    return table_dir.is_dir() and any(p.suffix == ".parquet" for p in table_dir.iterdir())


def kill_if_running(process: subprocess.Popen) -> bool:
    """SIGKILL the process if it still runs (then reap it); True when it was killed mid-run."""
    killed = process.poll() is None
    if killed:
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    return killed


def assert_same(a: dict, b: dict, what: str = "") -> None:
    """Every key of `a` equal in `b`: floats to 1e-9 relative (NaN equals NaN), anything else exactly."""
    prefix = f"{what}: " if what else ""
    for key, x in a.items():
        y = b[key]
        if isinstance(x, float) and isinstance(y, float) and not (math.isnan(x) and math.isnan(y)):
            assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12), f"{prefix}{key} {x} != {y}"
        elif not (isinstance(x, float) and math.isnan(x)):
            assert x == y, f"{prefix}{key} {x!r} != {y!r}"
