"""Checks a torch run makes before it loads anything: the device, the thread count, whether the weights fit,
where the model comes from. One home for `--device` and `--threads`, shared by trace, calibrate, crosscheck
and demo, so that each refuses bad values with the same one line (a `UserError`, exit 2).

torch is imported inside the functions: the CLI modules that import this one must start without it.
"""

from __future__ import annotations

import difflib
import re
import socket
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from thoughtkv_base import UserError
from traces.host import usable_cpus

# The README's install line for a CUDA build (`make` installs the CPU build on a fresh machine).
CUDA_INSTALL = ".venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128"
# Weights are not all a run holds: activations, the KV cache, the allocator's slack and (on CUDA) the CPU
# copy made before `.to(device)`. 10% over the weights plus 512 MiB keeps a run that passes from swapping.
MEMORY_MARGIN_FRACTION, MEMORY_MARGIN_BYTES = 0.10, 512 * 2**20
HUB_PROBE_TIMEOUT_S = 3.0
# An HF repo id: `name` or `owner/name` of letters, digits, `-`, `_`, `.` (huggingface_hub's own rule).
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class PreflightError(UserError):
    """A device, thread count, model source or memory size that cannot work; one line with the fix."""


# ---------------------------------------------------------------- device and threads -------------------------


def resolve_device(spec: str | None, option: str = "--device", allow_index: bool = True) -> str:
    """`None` -> cuda when torch sees a GPU, else cpu; `cpu`, `cuda`, `cuda:N` checked against this torch
    (`allow_index=False`: a command that always uses the first GPU refuses `cuda:N`)."""
    import torch

    if spec is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    text = str(spec).strip().lower()
    if text == "cpu":
        return "cpu"
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        hint = "; an NVIDIA GPU is `cuda`" if text in ("gpu", "nvidia") else ""
        raise PreflightError(f"{option} {spec!r}: unknown device; use cpu, cuda or cuda:N{hint}")
    if torch.version.cuda is None:
        raise PreflightError(
            f"{option} {spec}: this torch ({torch.__version__}) is a CPU build; install a CUDA build into .venv "
            f"(README: `{CUDA_INSTALL}`) or use --device cpu"
        )
    if not torch.cuda.is_available():
        raise PreflightError(
            f"{option} {spec}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU here "
            "(driver, CUDA_VISIBLE_DEVICES); use --device cpu"
        )
    if match.group(1) is not None and not allow_index:
        raise PreflightError(f"{option} {spec}: this command uses the first visible GPU; pick another with "
                             f"CUDA_VISIBLE_DEVICES={match.group(1)} and --device cuda")
    index, count = int(match.group(1) or 0), torch.cuda.device_count()
    if index >= count:
        raise PreflightError(f"{option} {spec}: torch sees {count} GPU(s), numbered 0..{count - 1}; pick one of those")
    return text


def resolve_threads(device: str, threads: int | None, option: str = "--threads") -> int:
    """One thread on CPU by default: a small model's ops are too short to split, and idle OpenMP threads
    spinning on a shared 2-core machine made decoding ~10x slower (and calibrate times one thread's CPU time).
    On CUDA torch's own default, since the host threads only launch kernels."""
    import torch

    if threads is None:
        return 1 if device == "cpu" else torch.get_num_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise PreflightError(f"{option} {threads}: must be a whole number >= 1")
    cpus = usable_cpus()
    if threads > cpus:
        raise PreflightError(f"{option} {threads}: this process may use {cpus} CPU(s); more threads only contend, "
                             f"use at most {cpus}")
    return threads


def apply_threads(threads: int) -> None:
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- memory -------------------------------------


def estimated_weight_bytes(config, dtype_bytes: int) -> int:
    """Parameters of a decoder-only transformers config from its shapes (the same count as
    `traces.architectures.Architecture.n_params`), times the bytes of the dtype it will be loaded in."""
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    kv_out = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    attention = 2 * h * q_out + 2 * h * kv_out
    if getattr(config, "attention_bias", False) or getattr(config, "model_type", "") == "qwen2":
        attention += q_out + 2 * kv_out  # Qwen2 always has q/k/v biases
    mlp = 3 * h * config.intermediate_size
    per_layer = attention + mlp + 2 * h
    tied = getattr(config, "tie_word_embeddings", False)
    embeddings = config.vocab_size * h * (1 if tied else 2)
    return (embeddings + config.num_hidden_layers * per_layer + h) * dtype_bytes


def available_bytes(device: str) -> dict[str, int]:
    """Free memory a load would use: host RAM always (weights are built on the host first), plus the GPU's."""
    free = {"host RAM": _host_available_bytes()}
    if device.startswith("cuda"):
        import torch

        free["GPU memory"] = int(torch.cuda.mem_get_info(torch.device(device))[0])
    return free


def _host_available_bytes() -> int:
    """MemAvailable (what can be allocated without swapping), else physical RAM (traces.host, the one reading)."""
    from traces.host import available_memory_bytes

    return available_memory_bytes()


def needed_bytes(weight_bytes: int) -> int:
    return int(weight_bytes * (1 + MEMORY_MARGIN_FRACTION)) + MEMORY_MARGIN_BYTES


def check_fits(spec: str, config, dtype: str, dtype_bytes: int, device: str) -> None:
    """Refuse, before allocating anything, a model whose weights do not fit (a 7B in fp32 on a 24 GB host
    swapped the machine to a halt instead of failing)."""
    weights = estimated_weight_bytes(config, dtype_bytes)
    need = needed_bytes(weights)
    for where, free in available_bytes(device).items():
        if need > free:
            fix = "pass --dtype bfloat16 (half the bytes)" if dtype_bytes > 2 else "use a smaller model"
            raise PreflightError(
                f"--model {spec}: its {dtype} weights need ~{weights / 1e9:.1f} GB (+ margin) but {where} has "
                f"{free / 1e9:.1f} GB available; {fix}, or free memory"
            )


# ---------------------------------------------------------------- model source -------------------------------


def check_model_spec(spec: str) -> None:
    """Refuse, before a command writes anything, a --model that cannot load: an unknown `random:` architecture,
    a missing directory, an HF id that is neither cached nor downloadable here."""
    from tracer.model_defaults import BUNDLED_MODELS
    from tracer.packaged import PACKAGED_MODELS, is_prepared, model_file

    if spec in BUNDLED_MODELS:
        return
    if spec in PACKAGED_MODELS:
        if not is_prepared(PACKAGED_MODELS[spec]):
            model_file(PACKAGED_MODELS[spec])  # installed? (converted on first load)
        return
    if spec.startswith("random:"):
        from traces.architectures import get_architecture

        get_architecture(spec.split(":", 1)[1])
        return
    model_is_local(spec)


def model_is_local(spec: str) -> bool:
    """True for a local model directory (or an HF id already in the local cache: load it without the network);
    False for an HF id to download. Raises one line for a missing path, a file, or an unreachable Hub, so that
    an offline machine fails in seconds instead of retrying for ~25 s."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return True
    if path.exists():
        raise PreflightError(f"--model {spec}: is a file; pass the model's directory (with config.json) or an HF id")
    from tracer.model_defaults import BUNDLED_MODELS

    close = difflib.get_close_matches(spec, list(BUNDLED_MODELS), n=1, cutoff=0.8)
    if close and not _in_hub_cache(spec):  # a typo of a bundled model's name, not a model to download
        raise PreflightError(f"--model {spec}: no such bundled model, directory or cached model; did you mean "
                             f"{close[0]}? (bundled: {', '.join(BUNDLED_MODELS)})")
    if not HF_ID.match(spec) or spec.startswith((".", "~")) or spec.endswith("/"):
        raise PreflightError(f"--model {spec}: no such directory; pass an existing model directory or an HF id")
    if _in_hub_cache(spec):
        return True
    from huggingface_hub import constants

    offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _hub_unreachable(constants.ENDPOINT)
    if offline:
        raise PreflightError(
            f"--model {spec}: not in the local Hugging Face cache and the Hub cannot be used ({offline}); download "
            "it where the Hub is reachable and pass its local directory to --model (with --data-file for the "
            "task's dataset)"
        )
    return False


@contextmanager
def offline_if_unreachable():
    """Within: when the Hub cannot be reached, the HF libraries run offline, so that a cached dataset or
    model still loads and a download fails at once (datasets retried for ~40 s, printing a dozen lines)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or _hub_unreachable(constants.ENDPOINT) is None:
        yield
        return
    import datasets

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - an id the cache cannot hold is simply not cached
        return False
    return isinstance(found, str)


def _hub_unreachable(endpoint: str) -> str | None:
    """None when a TCP connection to the Hub opens within a few seconds, else why not (one phrase)."""
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{host}:{port} unreachable: {exc.strerror or type(exc).__name__}"
