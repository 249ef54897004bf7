"""The cost model, in one place: how long one layer-step, one step's LM head and one transfer take.

Every formula here is also written out in `simulator/README.md`. All functions take numpy arrays (or scalars)
and are vectorised, so that the DES and the fast path compute their timeouts from the same numbers.

Roofline per GPU operation (one layer of one step, for a batch of `batch` identical sequences):

    flops  = batch * (2 * layer_params * q + 4 * n_heads * head_dim * pairs(q, a))
    bytes  = layer_weight_bytes + batch * (a + q) * kv_bytes_per_token_layer
    time_s = max(flops / achievable_flops_per_s, bytes / achievable_hbm_bytes_per_s) + layer_overhead_s

where layer_overhead_s = layer_overhead + token_overhead * batch * (a + q) (`layer_overhead_s`; the per-token
term is calibrated, 0 on datasheet profiles) and the overheads are the profile's streaming or cached set
(`overheads_for`: cached when the model's weights
fit in the profile's last-level cache), plus `placement_s` on the layer-steps whose placement moved blocks (the
tiered cache's bookkeeping when a block completes under a binding budget) and `recall_s` on those that recalled
(measured profiles only: `event_times`).

with q = query_tokens (1 when decoding, P at the prefill) and a = attended tokens = hbm_tokens +
recalled_tokens of the trace row (the new tokens included). `pairs(q, a)` counts causal (query, key) pairs.
Weights are read once per layer-step whatever the batch (that is what batching buys); KV is per sequence.

The host model (`host_times`, an overhead mode's `profile.host_model`): the host issues a step's ops while the GPU
runs them, so a step (its GPU chain G: operations, recall waits, synchronous offloads) ends at

    end = start + max(lead_s + G, step_s)        lead_s = step_host + lead_ops x op_s
                                                 step_s = step_host + (L x ops_per_layer + ops_per_step) x op_s

(the GPU starts once the host has issued the ops before the first matmul; the token is out no sooner than the host
has issued every op, and the host waits for it before the next step). Without a host model both are 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from hwprofiles import HardwareProfile
from traces.architectures import dtype_bytes
from traces.policy import CACHE_GEOMETRY_KEYS


@dataclass(frozen=True)
class ModelShape:
    """The shapes the cost model needs, read from a run's run.json `model` section."""

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: str
    kv_bytes_per_token: int  # all layers, K and V, as stored in HBM
    weight_bytes: int
    n_params: int
    intermediate_size: int = 0  # the MLP's inner width (0: derived from the parameter count, small_kernel_elements)

    @classmethod
    def from_manifest(cls, model: dict) -> ModelShape:
        return cls(
            name=str(model.get("id", model.get("architecture", "?"))),
            n_layers=int(model["n_layers"]),
            n_heads=int(model["n_heads"]),
            n_kv_heads=int(model["n_kv_heads"]),
            head_dim=int(model["head_dim"]),
            hidden_size=int(model["hidden_size"]),
            vocab_size=int(model["vocab_size"]),
            dtype=str(model["dtype"]),
            kv_bytes_per_token=int(model["kv_bytes_per_token"]),
            weight_bytes=int(model["weight_bytes"]),
            n_params=int(model["n_params"]),
            intermediate_size=int(model.get("intermediate_size") or 0),
        )

    @property
    def kv_bytes_per_token_layer(self) -> float:
        return self.kv_bytes_per_token / self.n_layers

    @property
    def head_params(self) -> int:
        """LM head (hidden -> vocab): computed once per step for the last position only."""
        return self.vocab_size * self.hidden_size

    @property
    def head_weight_bytes(self) -> int:
        return self.head_params * dtype_bytes(self.dtype)

    @property
    def layer_params(self) -> float:
        # Everything but the LM head is spread evenly over the layers (the input embedding too: it is a
        # gather, but counting it keeps "weights read per step = weight_bytes", the usual decode floor).
        return (self.n_params - self.head_params) / self.n_layers

    @property
    def layer_weight_bytes(self) -> float:
        return (self.weight_bytes - self.head_weight_bytes) / self.n_layers


def causal_pairs(query_tokens, attended_tokens):
    """(query, key) pairs under a causal mask: the i-th of q new queries sees a - q + i + 1 keys.

    Sum over i = q * (a - q) + q * (q + 1) / 2; for a decode step (q = 1) that is a.
    """
    q = np.asarray(query_tokens, dtype=np.float64)
    a = np.asarray(attended_tokens, dtype=np.float64)
    return q * (a - q) + q * (q + 1.0) / 2.0


def layer_flops_bytes(shape: ModelShape, query_tokens, attended_tokens, batch: int = 1):
    """FLOPs and HBM bytes of one layer-step (see the module docstring)."""
    q = np.asarray(query_tokens, dtype=np.float64)
    a = np.asarray(attended_tokens, dtype=np.float64)
    flops = batch * (2.0 * shape.layer_params * q + 4.0 * shape.n_heads * shape.head_dim * causal_pairs(q, a))
    hbm_bytes = shape.layer_weight_bytes + batch * (a + q) * shape.kv_bytes_per_token_layer
    return flops, hbm_bytes


def head_flops_bytes(shape: ModelShape, batch: int = 1):
    """The LM head of one step: logits for the last position of each sequence."""
    return batch * 2.0 * shape.head_params, float(shape.head_weight_bytes)


@dataclass(frozen=True)
class OpTimes:
    """Roofline time of GPU operations, split into the part that is compute, HBM or fixed overhead."""

    total_s: np.ndarray
    compute_s: np.ndarray  # time of compute-bound operations (FLOPs / achievable FLOP/s)
    hbm_s: np.ndarray  # time of bandwidth-bound operations (bytes / achievable HBM bandwidth)
    overhead_s: np.ndarray  # profile's fixed per-layer / per-step overheads


def roofline(flops, hbm_bytes, profile: HardwareProfile, overhead_s: float) -> OpTimes:
    """max(FLOPs / achievable compute, bytes / achievable HBM bandwidth) + a fixed overhead."""
    compute_time = np.asarray(flops, dtype=np.float64) / profile.gpu.matmul_flops_per_s
    memory_time = np.asarray(hbm_bytes, dtype=np.float64) / profile.gpu.hbm_bytes_per_s
    compute_time, memory_time = np.broadcast_arrays(compute_time, memory_time)
    compute_bound = compute_time >= memory_time
    overhead = np.broadcast_to(np.asarray(overhead_s, dtype=np.float64), compute_time.shape).copy()
    return OpTimes(
        total_s=np.maximum(compute_time, memory_time) + overhead,
        compute_s=np.where(compute_bound, compute_time, 0.0),
        hbm_s=np.where(compute_bound, 0.0, memory_time),
        overhead_s=overhead,
    )


@dataclass(frozen=True)
class Overheads:
    """The fixed costs charged to one model on one profile, and which of the profile's sets they are."""

    step_s: float  # once per step, with the LM head
    layer_s: float  # once per layer-step
    set: str  # "streaming" (the weights come from memory every step) or "cached" (they stay in the cache)
    placement_s: float = 0.0  # once per layer-step whose placement moved blocks (measured profiles only)
    token_s: float = 0.0  # per token a layer-step reads or writes KV of (measured profiles only)
    recall_s: float = 0.0  # once per layer-step that recalled blocks (measured hierarchy only)
    recall_block_s: float = 0.0  # per block recalled


def overheads_for(shape: ModelShape, profile: HardwareProfile) -> Overheads:
    """The profile's cached overheads when it has them and the model's weights fit in its last-level cache
    (W <= cache_bytes: on a CPU the weights then stay resident between steps and the framework's small ops
    run as fast as with no weights at all), else the streaming ones (every datasheet GPU profile)."""
    o = profile.overheads
    if o.has_cached and shape.weight_bytes <= o.cache_bytes:
        return Overheads(o.step_overhead_cached_s, o.layer_overhead_cached_s, "cached", o.placement_overhead_cached_s,
                         o.token_overhead_s, o.recall_overhead_cached_s, o.recall_block_overhead_cached_s)
    return Overheads(o.step_overhead_s, o.layer_overhead_s, "streaming", o.placement_overhead_s, o.token_overhead_s,
                     o.recall_overhead_s, o.recall_block_overhead_s)


def layer_overhead_s(shape: ModelShape, profile: HardwareProfile, kv_bytes):
    """The fixed cost of layer operations whose KV reads and writes are `kv_bytes` (weights excluded; a batch's
    sum): the per-layer overhead plus the per-token one for the tokens those bytes hold (attention, scoring and
    the tiered cache's bookkeeping grow with the context; 0 on datasheet profiles). The one formula the trace
    replay, the mechanisms and both serving engines charge."""
    o = overheads_for(shape, profile)
    if o.token_s == 0:
        return o.layer_s
    return o.layer_s + o.token_s * np.asarray(kv_bytes, dtype=np.float64) / shape.kv_bytes_per_token_layer


def profile_for_policy(profile: HardwareProfile, policy: str) -> tuple[HardwareProfile, str]:
    """The profile with the framework overheads calibrated for this policy's decode path, and where they came
    from. `thoughtkv calibrate` measures every tiered decoder (full / evict / hierarchy) and keeps them in
    provenance.overheads_by_decoder; the profile's own `overheads` are one of them. Datasheet profiles have
    none: returned unchanged. Both the streaming and the cached set are taken when the profile has them.

    The hierarchy's calibration recalls on every step (its DDR holds more than recall_k blocks), a trace's
    hierarchy only where DDR holds blocks, and often fewer blocks: its layer-steps are charged the evict
    decoder's overhead (the same scoring, no recall), and a layer-step that recalls n blocks `recall_s +
    n x recall_block_s`, from the hierarchy decoders that recall 4 and 1 blocks a layer-step (without the
    1-block one: all of the difference to evict is the fixed part). The per-token cost is the base decoder's
    too, where the calibration measured one per decoder (evict's for the hierarchy, which scores alike)."""
    by_decoder = profile.provenance.get("overheads_by_decoder") or {}
    measured = by_decoder.get(f"tiered/{policy}")
    if measured is None:
        return profile, "profile overheads (no per-policy calibration in provenance)"
    base = by_decoder.get("tiered/evict", measured) if policy == "hierarchy" else measured

    def value(entry: dict, key: str) -> float:
        return max(0.0, float(entry.get(key, 0.0)))

    one_block = by_decoder.get("tiered/hierarchy-k1") if policy == "hierarchy" else None

    def recall(key: str) -> tuple[float, float]:  # (fixed, per block) of a recalling layer-step
        four = max(0.0, value(measured, key) - value(base, key))
        if one_block is None or key not in one_block:
            return four, 0.0
        per_block = max(0.0, (four - max(0.0, value(one_block, key) - value(base, key))) / 3)
        return max(0.0, four - 4 * per_block), per_block

    fixed, per_block = recall("layer_overhead_s")
    changes = dict(step_overhead_s=value(measured, "step_overhead_s"), layer_overhead_s=value(base, "layer_overhead_s"),
                   placement_overhead_s=value(measured, "placement_layer_overhead_s"),
                   recall_overhead_s=fixed, recall_block_overhead_s=per_block)
    if "token_overhead_s" in base:  # the decoder's own per-token cost (a scoring policy's exceeds the full cache's)
        changes["token_overhead_s"] = value(base, "token_overhead_s")
    if profile.overheads.has_cached and "warm_step_overhead_s" in measured:
        fixed, per_block = recall("warm_layer_overhead_s")
        changes.update(
            step_overhead_cached_s=value(measured, "warm_step_overhead_s"),
            layer_overhead_cached_s=value(base, "warm_layer_overhead_s"),
            placement_overhead_cached_s=value(measured, "warm_placement_layer_overhead_s"),
            recall_overhead_cached_s=fixed, recall_block_overhead_cached_s=per_block)
    overheads = dataclasses.replace(profile.overheads, **changes)
    return dataclasses.replace(profile, overheads=overheads), f"tiered/{policy}"


def geometry_warning(profile: HardwareProfile, spec, run_label: str) -> str | None:
    """One line when a measured profile's tiered overheads were timed with another block size, window or sinks
    than the policy simulated (`provenance.cache_geometry`, written by `thoughtkv calibrate`): a layer-step's
    cost depends on them (on the CPU, blocks of 4 cost ~8% more per step than blocks of 16)."""
    timed = (profile.provenance or {}).get("cache_geometry")
    if not timed or profile.provenance.get("kind") != "measured":
        return None
    wanted = {key: getattr(spec, key) for key in CACHE_GEOMETRY_KEYS}
    if all(timed.get(key) == value for key, value in wanted.items()):
        return None

    def text(geometry: dict) -> str:
        return ", ".join(f"{key.removesuffix('_tokens').replace('_', ' ')} {geometry.get(key)}" for key in CACHE_GEOMETRY_KEYS)

    flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in wanted.items())
    return (f"warning: measured profile {profile.name} timed its tiered decoders with {text(timed)}, but {run_label} "
            f"is simulated with {text(wanted)}; calibrate with `{flags}` to compare like with like")


def attention_flops_bytes(shape: ModelShape, query_tokens, attended_tokens):
    """The attention kernel of one layer-step: its FLOPs (QK^T and PV over the causal pairs) and HBM bytes (the
    attended tokens' K and V read, the new tokens' written)."""
    q = np.asarray(query_tokens, dtype=np.float64)
    a = np.asarray(attended_tokens, dtype=np.float64)
    return 4.0 * shape.n_heads * shape.head_dim * causal_pairs(q, a), (a + q) * shape.kv_bytes_per_token_layer


def small_kernel_elements(shape: ModelShape) -> float:
    """Activation elements per token that a layer's small kernels read and write: two RMSNorms (2h each), the
    rotary embedding of q and k in place (2 (H + H_kv) d), SiLU-and-multiply (reads 2I, writes I) and one
    residual add (3h) -- the operations Vidur profiles besides the GEMMs and attention."""
    h, d = shape.hidden_size, shape.head_dim
    inner = shape.intermediate_size
    if inner <= 0:  # an old run.json without it: what the layer's parameters leave for a SwiGLU MLP
        attention = 2 * h * d * (shape.n_heads + shape.n_kv_heads)
        inner = max(0.0, (shape.layer_params - attention - 2 * h) / (3 * h))
    return 7.0 * h + 2.0 * (shape.n_heads + shape.n_kv_heads) * d + 3.0 * inner


# The small kernels (norms, rotary, activation, residual add) stream activations through HBM at this share of the
# profile's HBM rate. Calibrated on Vidur's measured H100 tables (microsoft/vidur, data/profiling/compute/h100/
# meta-llama/Llama-2-7b-hf/mlp.csv, TP 1: the medians of input_layernorm + post_attention_layernorm + attn_rope +
# mlp_act + add grow by 93.8 ns per token and layer, least squares over 1..4,096 tokens), against h100-sxm's rate
# under cuda-graphs (3.35 TB/s x 0.85 x 0.822): 78,080 elements x 2 B / 2.34 TB/s = 66.7 ns -> 0.71. The fixed part
# of those kernels (~19 us per layer at one token in the same table) is not added: it is paid once per iteration
# and layer whatever the tokens, and the decode calibration (decode_hbm_fraction: gpt-fast's measured step, which
# runs these kernels) already holds it.
SMALL_KERNEL_HBM_FRACTION = 0.71


def small_kernel_s(shape: ModelShape, profile: HardwareProfile, tokens):
    """The small kernels of one layer over `tokens` tokens (every query token of the iteration): activation bytes
    at SMALL_KERNEL_HBM_FRACTION of the HBM rate."""
    per_token_s = small_kernel_elements(shape) * dtype_bytes(shape.dtype) / (
        profile.gpu.hbm_bytes_per_s * SMALL_KERNEL_HBM_FRACTION)
    return np.asarray(tokens, dtype=np.float64) * per_token_s


def kernel_total_s(shape: ModelShape, profile: HardwareProfile, tokens, attn_flops, attn_bytes,
                   prefill_attn_flops=0.0, prefill_attn_bytes=0.0):
    """`kernel_times(...).total_s` alone (the serving fast path's per-iteration call): the same expression."""
    flops_per_s, bytes_per_s = profile.gpu.matmul_flops_per_s, profile.gpu.hbm_bytes_per_s
    tokens = np.asarray(tokens, dtype=np.float64)
    total = np.maximum(2.0 * shape.layer_params * tokens / flops_per_s, shape.layer_weight_bytes / bytes_per_s)
    total = total + np.maximum(np.asarray(attn_flops, dtype=np.float64) / flops_per_s,
                               np.asarray(attn_bytes, dtype=np.float64) / bytes_per_s)
    kv_bytes = attn_bytes
    if np.any(prefill_attn_bytes):
        total = total + np.maximum(np.asarray(prefill_attn_flops, dtype=np.float64) / flops_per_s,
                                   np.asarray(prefill_attn_bytes, dtype=np.float64) / bytes_per_s)
        kv_bytes = kv_bytes + prefill_attn_bytes
    return total + small_kernel_s(shape, profile, tokens) + layer_overhead_s(shape, profile, kv_bytes)


def kernel_times(shape: ModelShape, profile: HardwareProfile, tokens, attn_flops, attn_bytes,
                 prefill_attn_flops=0.0, prefill_attn_bytes=0.0) -> OpTimes:
    """One layer operation priced as its kernels run, one after another, each at its own roofline:

        GEMMs      max(2 P_layer T / F, W_layer / B)          T = the operation's query tokens (all sequences)
        attention  max(attn FLOPs / F, KV bytes / B)          the decodes' (and the trace replay's) kernel
        prefill    max(prefill FLOPs / F, prefill KV / B)     the prefill chunks' attention, its own kernel
        small      T x small_kernel_elements x b / (B x SMALL_KERNEL_HBM_FRACTION)
        + layer_overhead_s (the profile's fixed per-layer and per-token costs)

    One roofline over the sum would hide a prefill's GEMM compute under the decodes' KV reads; the kernels do not
    overlap on the GPU. Arrays over operations (or scalars)."""
    flops_per_s, bytes_per_s = profile.gpu.matmul_flops_per_s, profile.gpu.hbm_bytes_per_s
    tokens = np.asarray(tokens, dtype=np.float64)
    parts = [(2.0 * shape.layer_params * tokens / flops_per_s, np.broadcast_to(shape.layer_weight_bytes / bytes_per_s,
                                                                               tokens.shape)),
             (np.asarray(attn_flops, dtype=np.float64) / flops_per_s, np.asarray(attn_bytes, dtype=np.float64) / bytes_per_s),
             (np.asarray(prefill_attn_flops, dtype=np.float64) / flops_per_s,
              np.asarray(prefill_attn_bytes, dtype=np.float64) / bytes_per_s)]
    compute_s = hbm_s = 0.0
    for compute, memory in parts:
        compute, memory = np.broadcast_arrays(compute, memory)
        bound = compute >= memory
        compute_s = compute_s + np.where(bound, compute, 0.0)
        hbm_s = hbm_s + np.where(bound, 0.0, memory)
    hbm_s = hbm_s + small_kernel_s(shape, profile, tokens)
    total = kernel_total_s(shape, profile, tokens, attn_flops, attn_bytes, prefill_attn_flops, prefill_attn_bytes)
    out_shape = np.broadcast(compute_s, hbm_s, total).shape
    overhead = layer_overhead_s(shape, profile, np.asarray(attn_bytes, dtype=np.float64) + prefill_attn_bytes)
    return OpTimes(total_s=np.broadcast_to(total, out_shape).astype(np.float64),
                   compute_s=np.broadcast_to(compute_s, out_shape).astype(np.float64),
                   hbm_s=np.broadcast_to(hbm_s, out_shape).astype(np.float64),
                   overhead_s=np.broadcast_to(overhead, out_shape).astype(np.float64))


def layer_times(shape: ModelShape, profile: HardwareProfile, query_tokens, attended_tokens, batch: int = 1) -> OpTimes:
    """`batch` identical sequences' layer-step (the trace replay): `kernel_times` of their summed demand."""
    q = np.asarray(query_tokens, dtype=np.float64)
    attn_flops, attn_bytes = attention_flops_bytes(shape, q, attended_tokens)
    return kernel_times(shape, profile, batch * q, batch * attn_flops, batch * attn_bytes)


def event_times(shape: ModelShape, profile: HardwareProfile, moved_blocks, recall_bytes, batch: int = 1,
                recalled_blocks=None) -> np.ndarray:
    """The tiered cache's bookkeeping that only some layer-steps pay: the placement overhead where the placement
    moved blocks (`moved_blocks` > 0; None: unknown, none charged) and, where blocks were recalled
    (`recall_bytes` > 0), the recall overhead plus the per-block one for `recalled_blocks` (None: one block),
    `batch` times (each sequence of a lockstep batch does its own)."""
    o = overheads_for(shape, profile)
    recalled = np.asarray(recall_bytes, dtype=np.float64) > 0
    blocks = recalled if recalled_blocks is None else np.asarray(recalled_blocks, dtype=np.float64) * recalled
    out = batch * (o.recall_s * recalled + o.recall_block_s * blocks)
    if moved_blocks is not None:
        out = out + o.placement_s * batch * (np.asarray(moved_blocks, dtype=np.float64) > 0)
    return out


def with_events(layer: OpTimes, shape: ModelShape, profile: HardwareProfile, moved_blocks, recall_bytes,
                batch: int = 1, recalled_blocks=None) -> OpTimes:
    """`layer` with `event_times` added to its total and overhead (the trace replay and the mechanisms)."""
    events = event_times(shape, profile, moved_blocks, recall_bytes, batch, recalled_blocks)
    return dataclasses.replace(layer, total_s=layer.total_s + events, overhead_s=layer.overhead_s + events)


def add_layer_events(op_s: list[float], events: np.ndarray) -> list[float]:
    """A serving iteration's operation times (layers, then the LM head) with per-layer `events` added."""
    if not np.any(events):
        return op_s
    return [*(np.asarray(op_s[:-1]) + events).tolist(), op_s[-1]]


@dataclass(frozen=True)
class HostTimes:
    """The host's part of every decode step on one profile (0, 0: no host model)."""

    lead_s: float  # host time before the step's GPU work can start
    step_s: float  # the host's whole step: the token is out no sooner


NO_HOST = HostTimes(0.0, 0.0)


def host_times(shape: ModelShape, profile: HardwareProfile) -> HostTimes:
    """lead_s and step_s of the profile's host model for this model (see the module docstring): the host issues
    the same ops whatever the batch and the context, so one pair serves every step."""
    h = profile.host_model
    if not h.active:
        return NO_HOST
    return HostTimes(lead_s=h.step_s + h.lead_ops * h.op_s,
                     step_s=h.step_s + (shape.n_layers * h.ops_per_layer + h.ops_per_step) * h.op_s)


def host_step_s(gpu_step_s, host: HostTimes):
    """A step whose GPU chain takes `gpu_step_s`: max(lead_s + GPU, step_s) (vectorised)."""
    return np.maximum(host.lead_s + np.asarray(gpu_step_s, dtype=np.float64), host.step_s)


def head_times(shape: ModelShape, profile: HardwareProfile, batch: int = 1) -> OpTimes:
    flops, hbm_bytes = head_flops_bytes(shape, batch)
    return roofline(flops, hbm_bytes, profile, overheads_for(shape, profile).step_s)


@dataclass(frozen=True)
class OffloadTier:
    """Where offloaded KV lives and what a copy to/from it costs (host DDR, or an extra tier such as CXL)."""

    name: str
    capacity_bytes: float
    h2d_bytes_per_s: float  # the slower of the tier and the GPU's host link
    d2h_bytes_per_s: float
    transfer_overhead_s: float  # link overhead + the tier's added latency


def offload_tier(profile: HardwareProfile, name: str = "ddr") -> OffloadTier:
    """Recall reads the tier and crosses the link: the slower of the two sets the rate."""
    link = profile.link
    if name == "ddr":
        bw, latency, capacity = profile.host.ddr_bytes_per_s, 0.0, profile.host.ddr_capacity_bytes
    else:
        tiers = {t.name: t for t in profile.extra_tiers}
        if name not in tiers:
            from thoughtkv_base import UserError

            known = ", ".join(["ddr", *tiers])
            raise UserError(f"profile {profile.name} has no memory tier {name!r}; use one of {known}")
        tier = tiers[name]
        bw, latency, capacity = tier.bytes_per_s, tier.latency_s, tier.capacity_bytes
    return OffloadTier(name, float(capacity), min(link.h2d_bytes_per_s, bw), min(link.d2h_bytes_per_s, bw),
                       link.transfer_overhead_s + latency)


def transfer_s(n_bytes, bytes_per_s: float, overhead_s: float):
    """One copy of B bytes: fixed overhead (launch + DMA setup) + B / bandwidth; 0 when nothing moves."""
    b = np.asarray(n_bytes, dtype=np.float64)
    return np.where(b > 0, overhead_s + b / bytes_per_s, 0.0)

