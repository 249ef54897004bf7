"""The host's cost per eager op: what this machine spends issuing one op of a transformers decode step.

The simulator's `hf-eager` mode (hwprofiles/overheads/hf-eager.yaml; simulator/README.md, "Host model") charges
every decode step the ops a transformers `generate` step issues x the host's cost per op. The cited cost comes
from published measured runs; this module measures it where the user is, so that a projection can say "this
host driving an H100" (`simulate --overhead-mode hf-eager --host-term <the calibrated profile>`).

How (`measure_host_op`): greedy `generate` of a near-zero-work Llama (hidden size 64) with a 7B's 32 layers, so
that each step issues a 7B step's ops (36 per layer + 32) and their kernels cost next to nothing; time per token
= (time of N new tokens - time of 1) / (N - 1), ops per token counted the same way (`OpCounter`, the counter of
launches.py); cost per op = time per token / ops per token: the definition the cited figure uses (whole steps,
the loop's Python spread over its ops). On CUDA this is the path a GPU decode pays: Python, the dispatcher, the
caching allocator and one kernel launch per op. On the CPU each launch is replaced by a CPU kernel on tiny
tensors; simulator/README.md says why that stands in only roughly, and the cited figure stays the default.

`generate_step_ops` counts the ops the hf-eager figures cite (ops outside the layers, those before the first
matmul); tests/test_overhead_modes.py holds the shipped counts to it.
"""

from __future__ import annotations

HOST_LAYERS = 32  # a 7B's layer count: the measured step issues a 7B step's ops
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "matmul", "linear", "baddbmm"})


def _counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    from tracer.calibrate.launches import NO_KERNEL_OPS

    class OpCounter(TorchDispatchMode):
        """Every dispatched op that launches a kernel (launches.py's rule), in order."""

        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name not in NO_KERNEL_OPS:
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    return OpCounter()


def tiny_llama(n_layers: int, device: str = "cpu"):
    """A random-weight Llama with near-zero work per op (hidden 64, 4 heads, vocab 128): its ops are a 7B's ops."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=n_layers, vocab_size=128)
    return LlamaForCausalLM(config).eval().to(device)


def _generate(model, new_tokens: int, sample: bool = False):
    import torch

    device = next(model.parameters()).device
    prompt = torch.tensor([[1, 2, 3, 4]], device=device)
    kwargs = dict(do_sample=sample, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                  eos_token_id=None)
    if sample:
        kwargs.update(top_k=50, temperature=0.8)
    with torch.no_grad():
        return model.generate(prompt, **kwargs)


def generate_ops_per_token(model, sample: bool = False, new_tokens: int = 9) -> float:
    """Ops `generate` issues per decode step of `model` (N tokens less 1 token, per token: the prefill cancels)."""

    def count(n: int) -> int:
        counter = _counter()
        with counter:
            _generate(model, n, sample)
        return len(counter.names)

    return (count(new_tokens) - count(1)) / (new_tokens - 1)


def generate_step_ops(sample: bool = False) -> dict:
    """{"per_layer", "per_step" (generate's whole step outside the layers), "lead" (ops before the first matmul of
    a decode step's forward)} of transformers `generate` on a Llama."""
    import torch
    from transformers import DynamicCache

    from tracer.compat import cache_kwargs

    one, two = (generate_ops_per_token(tiny_llama(n), sample) for n in (1, 2))
    model = tiny_llama(1)
    cache = DynamicCache()
    counter = _counter()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), **cache_kwargs(model, cache), use_cache=True)
        with counter:
            model(input_ids=torch.tensor([[5]]), **cache_kwargs(model, cache), use_cache=True,
                  position_ids=torch.tensor([[4]]))
    lead = next(i for i, name in enumerate(counter.names) if name in MATMUL_OPS)
    return {"per_layer": round(two - one), "per_step": round(one - (two - one)), "lead": lead}


def measure_host_op(timing, n_layers: int = HOST_LAYERS, new_tokens: int = 17) -> dict:
    """This host's cost per eager op (module docstring), as calibration figures: host_op_s, host_ops_per_token,
    host_time_per_token_s, host_layers. `timing` (bench.Timing) picks the device, clock, repeats and statistic."""
    model = tiny_llama(n_layers, str(timing.device))
    ops = generate_ops_per_token(model)
    per_token_s = (timing.time_s(lambda: _generate(model, new_tokens))
                   - timing.time_s(lambda: _generate(model, 1))) / (new_tokens - 1)
    return {"host_op_s": max(per_token_s, 0.0) / ops, "host_ops_per_token": ops,
            "host_time_per_token_s": per_token_s, "host_layers": float(n_layers)}


def host_step(figures: dict, timing):
    """One calibration step ("name", run) that adds the host's figures to `figures` (the profile's
    provenance.figures, where `--host-term <profile>` reads host_op_s). A smoke plan (fewer than 5 repeats) times
    4 layers: seconds, and its figure means little."""
    n_layers = HOST_LAYERS if timing.repeats >= 5 else 4
    return "host op", lambda: figures.update(measure_host_op(timing, n_layers))
