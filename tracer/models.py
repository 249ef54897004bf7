"""Load the model to trace: an HF id or local path, `micro` / `micro_long` (bundled), a packaged model
(`smollm2-135m`: a real pretrained LM that a pip package ships, converted once into the cache; tracer/packaged.py),
or `random:NAME` (a real architecture from traces.architectures with random weights, for timing-only runs: no
accuracy is reported).

Defaults: bf16 on CUDA, fp32 on CPU (never fp16 + eager: the seed's NaN trap). `trust_remote_code` stays off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from thoughtkv_base import UserError
from tracer.model_defaults import BUNDLED_MODELS
from tracer.preflight import check_fits, model_is_local, resolve_device
from traces.architectures import DTYPE_BYTES, Architecture, get_architecture

# BUNDLED_MODELS: the models shipped in the package (tracer/model_defaults.py, torch-free, lists them with their
# trace defaults); re-exported here for the callers that load them.
MICRO_DIR = BUNDLED_MODELS["micro"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(UserError):
    pass


class ByteTokenizer:
    """A stand-in tokenizer for random-weight models (no tokenizer can be downloaded): one token per UTF-8
    byte, ids 3..258; 0 pad, 1 bos, 2 eos. The text only sets the prompt length; nothing is scored."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    chat_template = None
    offset = 3

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        raw = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return raw.decode("utf-8", errors="replace")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: str
    random_weights: bool
    manifest: dict  # run.json "model"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> str:
    return "bfloat16" if device.type == "cuda" else "float32"


def load_model(spec: str, device: str | torch.device | None = None, dtype: str | None = None, seed: int = 0) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # One check of --device for every caller (preflight): a CPU build asked for cuda says how to install one.
    device = torch.device(resolve_device(None if device is None else str(device)))
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if spec.startswith("random:"):
        arch = get_architecture(spec.split(":", 1)[1])
        config = AutoConfig.for_model(arch.model_type, **_config_kwargs(arch))
        _check_supported(config, spec)
        check_fits(spec, config, dtype, DTYPE_BYTES[dtype], str(device))
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
        tokenizer, random_weights, revision = ByteTokenizer(), True, None
    else:
        from tracer.packaged import PACKAGED_MODELS, prepared_dir

        bundled = BUNDLED_MODELS.get(spec)
        if spec in PACKAGED_MODELS:
            bundled = prepared_dir(spec)
        path = str(bundled) if bundled is not None else spec
        local = Path(path).is_dir() if bundled is not None else model_is_local(path)
        if bundled is not None and not local:
            raise ModelLoadError(f"the bundled {spec} model is missing at {bundled}; reinstall thoughtkv")
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=local, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load model {spec!r}: {_first_line(exc)}; give a local directory or a cached "
                                 "HF id") from None
        except Exception as exc:  # noqa: BLE001 - transformers' config validators raise their own error types
            raise ModelLoadError(f"model {spec!r}: its config.json is not valid ({_first_line(exc)}); fix it") from None
        try:
            _check_supported(config, spec)
            check_fits(spec, config, dtype, DTYPE_BYTES[dtype], str(device))
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, attn_implementation="sdpa", local_files_only=local, trust_remote_code=False
            )
            # A `tokenizer/` subfolder (the bundled micro model's word-level tokenizer) is loaded from there:
            # in its model folder AutoTokenizer would force Qwen2's byte-level BPE class onto any qwen2 model.
            subfolder = "tokenizer" if local and (Path(path) / "tokenizer" / "tokenizer.json").is_file() else ""
            tokenizer = AutoTokenizer.from_pretrained(
                path, subfolder=subfolder, local_files_only=local, trust_remote_code=False
            )
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load model {spec!r}: {_first_line(exc)}; give a local directory or a cached "
                                 "HF id") from None
        random_weights, revision = False, getattr(config, "_commit_hash", None)
    if not getattr(model, "_supports_attention_backend", False):
        raise ModelLoadError(f"model {spec!r} ({type(model).__name__}) does not support custom attention functions; "
                             "the tiered cache needs one (Qwen2, Llama, Mistral... do)")
    model.to(device).eval()
    return LoadedModel(model, tokenizer, spec, random_weights, _manifest(model, spec, dtype, revision, random_weights))


def _first_line(exc: BaseException) -> str:
    """The last non-empty line of an error's message, shortened (transformers' validators put the cause last)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(exc).__name__


def _config_kwargs(arch: Architecture) -> dict:
    return dict(
        num_hidden_layers=arch.n_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.n_heads,
        num_key_value_heads=arch.n_kv_heads, head_dim=arch.head_dim, intermediate_size=arch.intermediate_size,
        vocab_size=arch.vocab_size, tie_word_embeddings=arch.tie_word_embeddings, rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings, bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id, pad_token_id=ByteTokenizer.pad_token_id,
    )


def _check_supported(config, spec: str) -> None:
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ModelLoadError(f"model {spec!r}: num_hidden_layers {layers!r} in its config.json; a model to trace "
                             "needs at least one layer")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"model {spec!r} is an encoder-decoder; the tiered cache supports decoder-only models")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ModelLoadError(
            f"model {spec!r} has {', '.join(sorted(layer_types - {'full_attention'}))} layers; the tiered cache "
            "supports full-attention layers only (disable sliding windows in the config)"
        )


def kv_bytes_per_token(config, dtype: str) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * DTYPE_BYTES[dtype]


def _manifest(model, spec: str, dtype: str, revision, random_weights: bool) -> dict:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "id": spec,
        "revision": revision,
        "architecture": type(model).__name__,
        "n_layers": config.num_hidden_layers,
        "n_heads": config.num_attention_heads,
        "n_kv_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "dtype": dtype,
        "kv_bytes_per_token": kv_bytes_per_token(config, dtype),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "n_params": n_params,
        "random_weights": random_weights,
    }


def decoder_layers(model) -> list:
    """The decoder layers of an HF causal LM (`model.model.layers`), for per-layer timers."""
    base = getattr(model, "model", model)
    return list(getattr(base, "layers", []))
