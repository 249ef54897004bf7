"""Known model architectures, torch-free: the one table of shapes shared by the tracer (`random:NAME`
models), synthetic traces and the simulator's cost model.

Shapes are copied from each model's `config.json` on the Hugging Face Hub (the `source` field).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from thoughtkv_base import UserError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_id: str  # the real model whose shapes these are
    architecture: str  # transformers class name
    model_type: str  # transformers config model_type
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    source: str

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """K and V, every layer, every KV head: 2 * L * H_kv * d * bytes (57,344 for the 7B in bf16)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes(dtype)

    def n_params(self) -> int:
        """Parameter count from the shapes (embeddings, attention with optional q/k/v bias, SwiGLU MLP, norms)."""
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.n_heads * hd, self.n_kv_heads * hd
        attention = h * q_out + 2 * h * kv_out + q_out * h
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h  # two RMSNorm weights
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.n_layers * per_layer + h  # + final norm

    def weight_bytes(self, dtype: str = "bfloat16") -> int:
        return self.n_params() * dtype_bytes(dtype)

    def as_dict(self) -> dict:
        return asdict(self)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def _hub(model_id: str) -> str:
    return f"https://huggingface.co/{model_id}/blob/main/config.json"


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        Architecture(
            "qwen2-7b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "Qwen2ForCausalLM", "qwen2",
            n_layers=28, hidden_size=3584, n_heads=28, n_kv_heads=4, head_dim=128, intermediate_size=18944,
            vocab_size=152064, tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=131072,
            qkv_bias=True, source=_hub("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"),
        ),
        Architecture(
            "qwen2-1.5b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "Qwen2ForCausalLM", "qwen2",
            n_layers=28, hidden_size=1536, n_heads=12, n_kv_heads=2, head_dim=128, intermediate_size=8960,
            vocab_size=151936, tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=131072,
            qkv_bias=True, source=_hub("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
        ),
        Architecture(
            "qwen2-32b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "Qwen2ForCausalLM", "qwen2",
            n_layers=64, hidden_size=5120, n_heads=40, n_kv_heads=8, head_dim=128, intermediate_size=27648,
            vocab_size=152064, tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=131072,
            qkv_bias=True, source=_hub("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"),
        ),
        Architecture(
            "llama2-7b", "meta-llama/Llama-2-7b-hf", "LlamaForCausalLM", "llama",
            n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=32, head_dim=128, intermediate_size=11008,
            vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=4096,
            qkv_bias=False, source=_hub("meta-llama/Llama-2-7b-hf"),
        ),
        Architecture(
            "llama3-8b", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "LlamaForCausalLM", "llama",
            n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate_size=14336,
            vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072,
            qkv_bias=False, source=_hub("deepseek-ai/DeepSeek-R1-Distill-Llama-8B"),
        ),
        Architecture(
            "mistral-7b", "mistralai/Mistral-7B-v0.1", "MistralForCausalLM", "mistral",
            n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate_size=14336,
            vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=32768,
            qkv_bias=False, source=_hub("mistralai/Mistral-7B-v0.1"),
        ),
        # A real pretrained LM that runs on a CPU (`--model smollm2-135m`: tracer/packaged.py); the shapes are those
        # its GGUF carries, held equal to the converted config.json by tests/test_real_model.py.
        Architecture(
            "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "LlamaForCausalLM", "llama",
            n_layers=30, hidden_size=576, n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536,
            vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
            qkv_bias=False, source=_hub("HuggingFaceTB/SmolLM2-135M-Instruct"),
        ),
        # ~20M parameters: a real Qwen2 layout small enough for CPU benchmarks and cross-checks.
        Architecture(
            "tiny", "(none: random weights)", "Qwen2ForCausalLM", "qwen2",
            n_layers=6, hidden_size=384, n_heads=6, n_kv_heads=2, head_dim=64, intermediate_size=1024,
            vocab_size=32000, tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=8192,
            qkv_bias=True, source="thoughtkv: a scaled-down Qwen2 for CPU timing runs",
        ),
    ]
}


def architecture_from_config(name: str, config: dict, source: str) -> Architecture:
    """An Architecture from a transformers `config.json` dict (a bundled or local model's own shapes)."""
    try:
        n_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        rope = config.get("rope_parameters") or {}
        return Architecture(
            name, "(local model)", (config.get("architectures") or ["?"])[0], str(config.get("model_type", "?")),
            n_layers=int(config["num_hidden_layers"]), hidden_size=hidden, n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or hidden // n_heads),
            intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            qkv_bias=str(config.get("model_type")) == "qwen2", source=source,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{source}: not a decoder config with the shapes thoughtkv needs ({exc})") from None


def get_architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UserError(
            f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}"
        ) from None
