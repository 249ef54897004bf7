"""Count the kernels a transformers eager decode step launches: per decoder layer and per step outside the
layers. The `hf-eager` overhead mode (hwprofiles/overheads/hf-eager.yaml) charges the host these ops (plus
generate's own, counted by host.py) x a cost per op; `tests/test_overhead_modes.py` holds the shipped counts to
this measurement.

How: a `TorchDispatchMode` sees every aten op of one decode step (batch 1, a `DynamicCache`, the default
attention) of a random-weight Qwen2 / Llama with 1 and 2 layers; per layer = the difference, per step = the
rest. Ops that only make a view or allocate (`view`, `transpose`, `empty`, ...) launch no kernel and are not
counted. On CUDA each counted op is one kernel launch in eager mode (sdpa picks one fused kernel, like the
CPU's flash kernel counted here); that one-to-one mapping is the estimate's assumption.
"""

from __future__ import annotations

NO_KERNEL_OPS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
    "alias", "as_strided", "detach", "split", "split_with_sizes", "unbind", "_reshape_alias", "reshape",
    "lift_fresh", "empty", "empty_strided",
})


def _decode_step_ops(family: str, n_layers: int) -> int:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tracer.compat import cache_kwargs

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    config_cls, model_cls = classes[family]

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in NO_KERNEL_OPS:
                self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    config = config_cls(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=n_layers, vocab_size=128)
    model = model_cls(config).eval()
    cache = DynamicCache()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4]]), **cache_kwargs(model, cache), use_cache=True).logits
        counter = Count()
        with counter:
            model(input_ids=logits[:, -1:].argmax(-1), **cache_kwargs(model, cache), use_cache=True,
                  position_ids=torch.tensor([[4]]))
    return counter.n


def launches_per_decode_step(family: str = "qwen2") -> dict:
    """{"per_layer": kernels per decoder layer, "per_step": kernels outside the layers} for one decode step."""
    one, two = _decode_step_ops(family, 1), _decode_step_ops(family, 2)
    return {"per_layer": two - one, "per_step": one - (two - one)}
