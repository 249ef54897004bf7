"""What a speculative recall rule decides from: the query a layer would have, made before the layer runs.

Two sources, both known before layer i's attention at decode step t (so the rule's copy can be issued while
earlier compute runs: `traces.policy.PREFETCHABLE_RECALL_RULES`):

- the previous layer's input (InfiniGen, Lee et al., OSDI '24: layer i's attention is speculated from the
  input of layer i - 1): the hidden state entering decoder layer i - 1, put through layer i's own input norm,
  `q_proj` (and `q_norm` where the model has one) and RoPE at the current position (`previous_layer_query`).
  The residual stream changes little from one layer to the next, so this is layer i's query up to what layer
  i - 1 adds to it. Layer 0 has no layer before it in the step: it takes its query of the previous step (below),
  which exists while the previous step's LM head runs, the compute its copy overlaps (the simulator's layer
  prefetch issues layer 0's recall there). The hidden states are caught by a forward pre-hook on every decoder
  layer (`watch_layer_inputs`), only while a rule reads them: a module with hooks runs each call through
  `Module._call_impl`'s slow path;
- the previous step's query of the same layer (`previous_step_query`): each layer keeps its rows' last query
  (`PagedLayer.keep_query`, written after recall: a row's first decode step reads its prompt's last query),
  rotated at the previous position.

Both are device tensors computed from device tensors: nothing is read back, and each row's query is its own
(a batched step gives every row the query of its batch-1 run).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

from thoughtkv_base import UserError


class SpeculationError(UserError):
    pass


@dataclass
class LayerInputs:
    """The current forward's decoder layers as they begin: the hidden state entering each ([batch entries, q,
    hidden]: references, not copies; a decoder layer returns a new tensor, it does not write its input), the
    layer module itself, and the forward's rotary embeddings (cos, sin), one per forward."""

    hidden: list = field(default_factory=list)
    decoders: list = field(default_factory=list)
    position_embeddings: tuple | None = None

    def enter(self, layer_idx: int, decoder, hidden: torch.Tensor, position_embeddings) -> None:
        while len(self.hidden) <= layer_idx:
            self.hidden.append(None)
            self.decoders.append(None)
        self.hidden[layer_idx], self.decoders[layer_idx] = hidden, decoder
        self.position_embeddings = position_embeddings


def speculative_layers(model) -> list:
    """The model's decoder layers a speculative query is made with: every module with a `self_attn` (holding its
    `q_proj` and `layer_idx`) and an `input_layernorm`, as HF's llama, qwen2 and mistral decoder layers are."""
    return [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "input_layernorm")
            and hasattr(m.self_attn, "q_proj")]


@contextlib.contextmanager
def watch_layer_inputs(model, cache):
    """While inside: every decoder layer's input reaches `cache` (`LayerInputs`: a forward pre-hook on each),
    when the cache's recall rule reads the previous layer's input (`TieredCache.reads_layer_inputs`); otherwise
    (a DynamicCache, any other rule) nothing is installed."""
    if not getattr(cache, "reads_layer_inputs", False):
        yield
        return
    layers = speculative_layers(model)
    if not layers:
        raise SpeculationError(f"--recall-rule {cache.settings.spec.recall_rule} makes layer i's query from layer "
                               f"i-1's input, but {type(model).__name__} has no decoder layer with self_attn.q_proj and "
                               "input_layernorm (llama, qwen2, mistral have them); use another --recall-rule")
    inputs = cache.shared.layer_inputs

    def layer_begins(decoder, args, kwargs) -> None:  # its input hidden state and the forward's rotary embeddings
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs.enter(decoder.self_attn.layer_idx, decoder, hidden, kwargs.get("position_embeddings"))

    handles = [layer.register_forward_pre_hook(layer_begins, with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _rotary(attention):
    """The model's own `apply_rotary_pos_emb` (from its modeling module), so that the speculative query is rotated
    as the layer rotates its own."""
    function = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
    if function is None:
        raise SpeculationError(f"{type(attention).__module__} has no apply_rotary_pos_emb: the previous layer's "
                               "input cannot be rotated as this model rotates its queries; use another --recall-rule")
    return function


def previous_layer_query(layer, entries: torch.Tensor | None, rows) -> torch.Tensor:
    """Layer i's query speculated from the input of layer i - 1 for the recalling batch `entries` (None: every
    entry), [m, Hq, d]: layer i's input norm, `q_proj` (and `q_norm`) and RoPE at the current position applied to
    the hidden state entering layer i - 1. Layer 0: its query of the previous step (`previous_step_query`)."""
    index = layer.layer_idx
    if index == 0:
        return previous_step_query(layer, rows)
    inputs = layer.shared.layer_inputs
    if len(inputs.hidden) <= index or inputs.hidden[index - 1] is None or inputs.decoders[index] is None \
            or inputs.position_embeddings is None:
        raise SpeculationError("the previous layer's input was not caught for this forward: decode under "
                               "tracer.cache.speculation.watch_layer_inputs(model, cache) (the decode loop does), or "
                               "use another --recall-rule")
    hidden, decoder = inputs.hidden[index - 1], inputs.decoders[index]
    cos, sin = inputs.position_embeddings
    if entries is not None:
        hidden, cos, sin = hidden[entries], cos[entries], sin[entries]
    hidden, cos, sin = hidden[:, -1:], cos[:, -1:], sin[:, -1:]  # (the step's one position)
    attention = decoder.self_attn
    query = attention.q_proj(decoder.input_layernorm(hidden))
    query = query.view(query.shape[0], 1, -1, attention.head_dim)  # [m, 1, Hq, d]
    q_norm = getattr(attention, "q_norm", None)
    if q_norm is not None:
        query = q_norm(query)
    query = query.transpose(1, 2)  # [m, Hq, 1, d]
    query = _rotary(attention)(query, query, cos, sin)[0]
    return query[:, :, 0]


def previous_step_query(layer, rows) -> torch.Tensor:
    """The layer's query of the previous step for `rows` (a slice or an index of row ids), [m, Hq, d]: for a
    row's first decode step, its prompt's last query."""
    if layer.last_query is None:
        raise SpeculationError("no earlier query kept for this layer: the prefill keeps it; decode a prompt first")
    return layer.last_query[rows]
