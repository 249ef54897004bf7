"""Transfer mechanisms: how recalled and offloaded KV blocks cross the host link, and what that costs the GPU.

One small class per mechanism, one interface, one static registry (`MECHANISMS`, a plain dict):

| name | recall (host -> GPU) | offload (GPU -> host) | GPU operation |
|---|---|---|---|
| `dma-per-block` | one DMA copy per sequence and layer-step: o + B / rate (or the copy curve) | same | roofline |
| `dma-batched` | one DMA call per layer-step and direction for the whole batch: one o, bytes summed | same | roofline |
| `sm-copy` | a copy kernel: o_k + B / kernel rate, one launch per layer-step for the batch | same | stretched by the kernel's SM share while a copy overlaps it |
| `zero-copy` | none: attention reads the recalled blocks over the link inside the kernel | DMA per block | max(FLOPs / F, HBM bytes / B, latency + remote bytes / link rate) |
| `cpu-attention` | none: the host attends the recalled blocks in DDR, the link carries queries and partial outputs | DMA per block | GPU over HBM blocks, plus what the host path adds beyond the GPU's own attention |

`dma-per-block` is the simulator's rule before mechanisms existed (and what the tracer does: it gathers one
layer's blocks of a sequence into a staging buffer and moves them in one copy); on it every result is unchanged.
Formulas, parameters and their simplifications: `simulator/README.md` ("Transfer mechanisms"). The profile
parameters live in the profile's optional `transfer:` section (`hwprofiles.schema.TransferSpec`); a mechanism
whose parameter a profile lacks is refused on it (`MechanismError`, one line naming the field).

Interface (both engines, the fast paths and serving use only this):
- `copy_s(ctx, direction, n_bytes)`: the duration of one copy of `n_bytes` (0 for nothing), `copy_overhead_s`;
- `batched`: True when all sequences of a batch share one copy per operation and direction;
- `copies_recalls` / `stages_recalls`: whether recalls are copies on the link, and whether they sit in HBM;
- `layer_times(ctx, load)`: the GPU time of one layer operation for the summed demand of a batch (`LayerLoad`);
- `stretch(ctx, op_s, overlapping_copy_s)`: the op's time when copies run beside it (sm-copy only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hwprofiles import HardwareProfile
from simulator import costs
from thoughtkv_base import UserError

if TYPE_CHECKING:
    from simulator.workload import StepArrays

DEFAULT_MECHANISM = "dma-per-block"
PARTIAL_STATS_BYTES = 8  # per query and head: the running max and sum of the partial softmax, fp32 each


class MechanismError(UserError):
    """A transfer mechanism that is unknown or lacks a parameter on a profile (one line, exit 2)."""


@dataclass(frozen=True)
class TransferContext:
    """One model on one profile with one offload tier: what every mechanism computes its costs from."""

    profile: HardwareProfile
    shape: costs.ModelShape
    tier: costs.OffloadTier
    host_read_bytes_per_s: float  # the host reading offloaded KV (cpu-attention): DDR, or the extra tier


def context(profile: HardwareProfile, shape: costs.ModelShape, tier: str = "ddr") -> TransferContext:
    home = costs.offload_tier(profile, tier)
    tiers = {t.name: t for t in profile.extra_tiers}
    host_rate = profile.host.ddr_bytes_per_s if tier == "ddr" else tiers[tier].bytes_per_s
    return TransferContext(profile, shape, home, host_rate)


@dataclass(frozen=True)
class LayerLoad:
    """The demand of one layer operation (arrays over operations), summed over the sequences of a batch.

    Weights are not included (read once per operation whatever the batch). Every field is a sum of
    per-sequence values, so a batch's load is the sum of its sequences' loads (`sequence_load`).
    """

    flops: np.ndarray  # GPU FLOPs (projections, MLP, attention over the blocks the GPU attends)
    kv_bytes: np.ndarray  # HBM KV bytes read and written (weights excluded)
    attn_flops: np.ndarray  # the attention part of `flops` (cpu-attention overlaps the host with it)
    remote_bytes: np.ndarray  # recalled KV read where it lives (zero-copy: over the link; cpu-attention: by the host)
    host_flops: np.ndarray  # cpu-attention: the host's attention FLOPs
    query_bytes: np.ndarray  # cpu-attention: queries to the host (D2H)
    partial_bytes: np.ndarray  # cpu-attention: partial outputs + softmax statistics back (H2D)
    has_host_work: np.ndarray  # bool: cpu-attention has a host path in this operation
    tokens: np.ndarray | float = 0.0  # query tokens through the operation's GEMMs and small kernels

    def total(self, axis: int = 0) -> LayerLoad:
        """Sum over sequences (axis of stacked per-sequence loads)."""
        return LayerLoad(**{f: (getattr(self, f).any(axis) if f == "has_host_work" else getattr(self, f).sum(axis))
                            for f in LOAD_FIELDS})

    def scaled(self, n: int) -> LayerLoad:
        """`n` identical sequences in lockstep."""
        return LayerLoad(**{f: getattr(self, f) if f == "has_host_work" else n * getattr(self, f) for f in LOAD_FIELDS})


LOAD_FIELDS = ("flops", "kv_bytes", "attn_flops", "remote_bytes", "host_flops", "query_bytes", "partial_bytes",
               "has_host_work", "tokens")


def sequence_load(mechanism: Mechanism, shape: costs.ModelShape, query_tokens, hbm_tokens, recalled_tokens,
                  recall_bytes) -> LayerLoad:
    """One sequence's demand per layer-step (arrays of any shape, e.g. [steps, layers]).

    `hbm_tokens` are the tokens attention reads in HBM (new ones included), `recalled_tokens` the DDR tokens
    recalled for it, `recall_bytes` their bytes (the trace's bytes_h2d).
    """
    q = np.asarray(query_tokens, dtype=np.float64)
    hbm = np.asarray(hbm_tokens, dtype=np.float64)
    rec = np.asarray(recalled_tokens, dtype=np.float64)
    recalled = np.asarray(recall_bytes, dtype=np.float64)
    gpu_tokens = hbm if mechanism.host_attends else hbm + rec  # the tokens the GPU's attention covers
    hbm_read_tokens = hbm + rec if mechanism.stages_recalls else hbm  # ... of which it reads from HBM
    flops, _ = costs.layer_flops_bytes(shape, q, gpu_tokens, batch=1)
    host = mechanism.host_attends
    zero = np.zeros_like(q)
    element = costs.dtype_bytes(shape.dtype)
    moving = rec > 0
    return LayerLoad(
        flops=flops,
        kv_bytes=(hbm_read_tokens + q) * shape.kv_bytes_per_token_layer,
        attn_flops=4.0 * shape.n_heads * shape.head_dim * costs.causal_pairs(q, gpu_tokens),
        remote_bytes=zero if mechanism.copies_recalls else recalled,
        # the host's attention over the recalled tokens: every new query against all of them (they precede
        # the step's queries, so no causal mask)
        host_flops=4.0 * shape.n_heads * shape.head_dim * q * rec if host else zero,
        query_bytes=np.where(moving, q * shape.n_heads * shape.head_dim * element, 0.0) if host else zero,
        partial_bytes=np.where(moving, q * shape.n_heads * (shape.head_dim * element + PARTIAL_STATS_BYTES), 0.0)
        if host else zero,
        has_host_work=moving if host else np.zeros(q.shape, dtype=bool),
        tokens=q,
    )


# ---------------------------------------------------------------- the copy curve -----------------------------


def curve_time_s(curve, n_bytes) -> np.ndarray:
    """Piecewise-linear interpolation of a measured copy curve (time vs bytes), extended beyond its ends by
    the first / last segment (so a curve that is a line gives that line everywhere); 0 for nothing moved."""
    x = np.asarray(curve.bytes, dtype=np.float64)
    y = np.asarray(curve.seconds, dtype=np.float64)
    b = np.asarray(n_bytes, dtype=np.float64)
    inside = np.interp(b, x, y)
    below = y[0] + (b - x[0]) * (y[1] - y[0]) / (x[1] - x[0])
    above = y[-1] + (b - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
    t = np.where(b < x[0], below, np.where(b > x[-1], above, inside))
    return np.where(b > 0, np.maximum(t, 0.0), 0.0)


def curve_intercept_s(curve) -> float:
    """The curve's time at 0 bytes (its fixed cost per copy), >= 0."""
    x, y = curve.bytes, curve.seconds
    return max(0.0, y[0] - x[0] * (y[1] - y[0]) / (x[1] - x[0]))


# ---------------------------------------------------------------- mechanisms ---------------------------------


class Mechanism:
    name = ""
    summary = ""
    batched = False  # one copy per operation and direction for a whole batch
    copies_recalls = True  # recalls are copies on the link (else read in place: zero-copy, cpu-attention)
    stages_recalls = True  # recalled blocks are staged in HBM for attention
    host_attends = False  # the host computes attention over the recalled blocks
    needs: tuple[str, ...] = ()  # TransferSpec fields this mechanism reads

    def check(self, profile: HardwareProfile) -> None:
        missing = [f for f in self.needs if getattr(profile.transfer, f) is None]
        if missing:
            key = missing[0].replace("_bytes_per_s", "_bandwidth").replace("_flops_per_s", "_flops")
            key = key.removesuffix("_s")
            raise MechanismError(f"--transfer {self.name} needs transfer.{key} in profile {profile.name}; add it "
                                 "(with a source) to the profile or pick another --transfer")

    # -- copies --------------------------------------------------------------------------------------------

    def copy_s(self, ctx: TransferContext, direction: str, n_bytes) -> np.ndarray:
        """One DMA copy of `n_bytes` (the default for both directions): the profile's pinned copy curve for this
        direction when it has one (host DDR only), else the fixed overhead + bytes / the slower of link and tier."""
        curve = ctx.profile.transfer.curve(f"{direction}_pinned")
        if curve is not None and ctx.tier.name == "ddr":
            return curve_time_s(curve, n_bytes)
        rate = ctx.tier.h2d_bytes_per_s if direction == "h2d" else ctx.tier.d2h_bytes_per_s
        return costs.transfer_s(n_bytes, rate, ctx.tier.transfer_overhead_s)

    def copy_overhead_s(self, ctx: TransferContext, direction: str) -> float:
        """The fixed part of one copy (the link model lets several copy engines overlap it)."""
        curve = ctx.profile.transfer.curve(f"{direction}_pinned")
        if curve is not None and ctx.tier.name == "ddr":
            return curve_intercept_s(curve)
        return ctx.tier.transfer_overhead_s

    # -- the GPU -------------------------------------------------------------------------------------------

    def layer_times(self, ctx: TransferContext, load: LayerLoad) -> costs.OpTimes:
        """A batch's layer operation as its kernels run (costs.kernel_times): the GEMMs over the summed query
        tokens (weights once), one attention kernel over the summed attention FLOPs and KV bytes."""
        return costs.kernel_times(ctx.shape, ctx.profile, load.tokens, load.attn_flops, load.kv_bytes)

    def stretch(self, ctx: TransferContext, op_s, overlapping_copy_s) -> np.ndarray:
        """The operation's time when copies of `overlapping_copy_s` run beside it (no effect but for sm-copy)."""
        return np.asarray(op_s, dtype=np.float64)


class DmaPerBlock(Mechanism):
    name = "dma-per-block"
    summary = "one DMA copy per sequence and layer-step (the tracer's staged copy); the per-copy overhead each time"


class DmaBatched(Mechanism):
    name = "dma-batched"
    summary = "one DMA call per layer-step and direction for the batch (cuMemcpyBatchAsync): one overhead"
    batched = True


class SmCopy(Mechanism):
    name = "sm-copy"
    summary = "a copy kernel on a few SMs (SGLang HiCache): kernel rate, one launch per layer-step; slows compute"
    batched = True
    needs = ("sm_copy_h2d_bytes_per_s", "sm_copy_d2h_bytes_per_s", "sm_copy_sm_share", "sm_copy_overhead_s")

    def copy_s(self, ctx, direction, n_bytes):
        t = ctx.profile.transfer
        kernel = t.sm_copy_h2d_bytes_per_s if direction == "h2d" else t.sm_copy_d2h_bytes_per_s
        tier_rate = ctx.tier.h2d_bytes_per_s if direction == "h2d" else ctx.tier.d2h_bytes_per_s
        if ctx.tier.name == "ddr":  # the DDR rate caps the kernel too (tier rate = min(link DMA, DDR))
            tier_rate = ctx.profile.host.ddr_bytes_per_s
        return costs.transfer_s(n_bytes, min(kernel, tier_rate), self.copy_overhead_s(ctx, direction))

    def copy_overhead_s(self, ctx, direction):
        return ctx.profile.transfer.sm_copy_overhead_s + (ctx.tier.transfer_overhead_s
                                                          - ctx.profile.link.transfer_overhead_s)

    def stretch(self, ctx, op_s, overlapping_copy_s):
        """The kernel holds a share s of the SMs while it runs: during an overlap of d the op progresses at
        1 - s, so an op of c takes c + s * min(d, c / (1 - s))."""
        s = ctx.profile.transfer.sm_copy_sm_share
        c = np.asarray(op_s, dtype=np.float64)
        d = np.asarray(overlapping_copy_s, dtype=np.float64)
        return c + s * np.minimum(d, c / (1.0 - s))


class ZeroCopy(Mechanism):
    name = "zero-copy"
    summary = "attention reads recalled blocks over the link inside the kernel (NVLink-C2C, UVA); no HBM staging"
    copies_recalls = False
    stages_recalls = False
    needs = ("zero_copy_bytes_per_s", "zero_copy_latency_s")

    def layer_times(self, ctx, load):
        """max(FLOPs / F, HBM bytes / B, latency + remote bytes / min(zero-copy rate, tier rate)) + overhead: the
        kernel streams HBM and host blocks at once; compute / HBM keep the GPU's own part, so the time a link-bound
        op takes beyond it shows as link stall."""
        base = Mechanism.layer_times(self, ctx, load)
        t = ctx.profile.transfer
        rate = min(t.zero_copy_bytes_per_s, ctx.tier.h2d_bytes_per_s if ctx.tier.name != "ddr"
                   else ctx.profile.host.ddr_bytes_per_s)
        remote = np.asarray(load.remote_bytes, dtype=np.float64)
        link_s = np.where(remote > 0, t.zero_copy_latency_s + (ctx.tier.transfer_overhead_s
                                                              - ctx.profile.link.transfer_overhead_s)
                          + remote / rate, 0.0)
        gpu_s = base.total_s - base.overhead_s
        return costs.OpTimes(total_s=np.maximum(gpu_s, link_s) + base.overhead_s, compute_s=base.compute_s,
                             hbm_s=base.hbm_s, overhead_s=base.overhead_s)


class CpuAttention(Mechanism):
    name = "cpu-attention"
    summary = "the host attends the recalled DDR blocks (MagicPIG-style); the link carries queries and partials"
    copies_recalls = False
    stages_recalls = False
    host_attends = True
    needs = ("host_attention_flops_per_s",)

    def layer_times(self, ctx, load):
        """GPU roofline over the HBM blocks (t_gpu), its attention part t_attn = max(attention FLOPs / F, KV
        bytes / B); the host path t_host = 2 o + query bytes / D2H + max(host FLOPs / host F, remote bytes /
        host read rate) + partial bytes / H2D runs beside the GPU's attention: op = t_gpu + max(0, t_host - t_attn)."""
        base = Mechanism.layer_times(self, ctx, load)
        profile = ctx.profile
        attn_s = costs.roofline(load.attn_flops, load.kv_bytes, profile, 0.0).total_s
        host_s = np.maximum(np.asarray(load.host_flops) / profile.transfer.host_attention_flops_per_s,
                            np.asarray(load.remote_bytes) / ctx.host_read_bytes_per_s)
        o = profile.link.transfer_overhead_s
        path_s = np.where(load.has_host_work, 2.0 * o + np.asarray(load.query_bytes) / profile.link.d2h_bytes_per_s
                          + host_s + np.asarray(load.partial_bytes) / profile.link.h2d_bytes_per_s, 0.0)
        extra = np.maximum(0.0, path_s - attn_s)  # the host path beyond the GPU's attention: a stall
        return costs.OpTimes(total_s=base.total_s + extra, compute_s=base.compute_s, hbm_s=base.hbm_s,
                             overhead_s=base.overhead_s)


MECHANISMS: dict[str, Mechanism] = {m.name: m for m in (DmaPerBlock(), DmaBatched(), SmCopy(), ZeroCopy(),
                                                         CpuAttention())}


def get_mechanism(name: str) -> Mechanism:
    try:
        return MECHANISMS[name]
    except KeyError:
        raise MechanismError(f"unknown --transfer {name!r}; use one of {', '.join(MECHANISMS)}") from None


def mechanism_for(name: str, profile: HardwareProfile) -> Mechanism:
    """The mechanism, checked against the profile (refused when the profile lacks one of its parameters)."""
    mechanism = get_mechanism(name)
    mechanism.check(profile)
    return mechanism


# ---------------------------------------------------------------- one sample as a Workload -------------------


def overlapping_copy_s(recall_s: np.ndarray, offload_s: np.ndarray, overlap: str, async_offload: bool) -> np.ndarray:
    """Per operation (flat), the copies that run beside its compute: the async offload issued after the operation
    before it, and with layer-prefetch the recall of the operation after it (issued when it starts)."""
    beside = np.zeros_like(recall_s)
    if async_offload:
        beside[1:] += offload_s[:-1]
    if overlap == "layer-prefetch":
        beside[:-1] += recall_s[1:]
    return beside


def build_workload(mechanism: Mechanism, sample_id: str, shape: costs.ModelShape, profile: HardwareProfile,
                   steps: StepArrays, *, batch: int = 1, tier: str = "ddr", overlap: str = "none",
                   async_offload: bool = True):
    """`workload.build_workload` under a transfer mechanism (one sample's StepArrays).

    `dma-per-block` without a copy curve is exactly `workload.build_workload`. The others replace the copy
    durations (`copy_s`), drop recall copies that do not happen (zero-copy, cpu-attention: their bytes are read
    in place; `step_hbm_kv_bytes` then excludes the staging buffers), recompute the layer operations
    (`layer_times`) and stretch operations beside copies (sm-copy). With a lockstep batch, `batched`
    mechanisms move the batch's blocks of an operation in one copy.
    """
    from simulator.workload import build_workload as base_workload

    mechanism.check(profile)
    hbm = np.asarray(steps.hbm_tokens, dtype=np.float64)
    rec = np.asarray(steps.recalled_tokens, dtype=np.float64)
    query_tokens, bytes_h2d = steps.query_tokens, steps.bytes_h2d
    moved_blocks, recalled_blocks = steps.moved_blocks, steps.recalled_blocks
    work = base_workload(sample_id, shape, profile, steps, batch=batch, tier=tier)
    ctx = context(profile, shape, tier)
    n_steps, n_layers = hbm.shape

    def with_head(per_layer, head_value: float = 0.0) -> np.ndarray:
        out = np.empty((n_steps, n_layers + 1), dtype=np.float64)
        out[:, :n_layers] = per_layer
        out[:, n_layers] = head_value
        return out.ravel()

    if type(mechanism).layer_times is not Mechanism.layer_times:
        load = sequence_load(mechanism, shape, query_tokens, hbm, rec, bytes_h2d).scaled(batch)
        layer = mechanism.layer_times(ctx, load)
        layer = costs.with_events(layer, shape, profile, moved_blocks, bytes_h2d, batch, recalled_blocks)
        head = costs.head_times(shape, profile, batch)
        work.compute_s = with_head(layer.total_s, float(head.total_s))
        work.compute_only_s = with_head(layer.compute_s, float(head.compute_s))
        work.hbm_only_s = with_head(layer.hbm_s, float(head.hbm_s))
        work.overhead_s = with_head(layer.overhead_s, float(head.overhead_s))
    if not mechanism.copies_recalls:
        work.recall_bytes = np.zeros_like(work.recall_bytes)
        staged = np.asarray(bytes_h2d, dtype=np.float64).sum(1)
        work.step_hbm_kv_bytes = np.maximum(work.step_hbm_kv_bytes - staged, 0.0)
    offload_mechanism = mechanism if mechanism.copies_recalls else MECHANISMS[DEFAULT_MECHANISM]  # offloads: DMA
    # A lockstep batch of n under a batched mechanism moves an operation's n x B bytes in one copy. The engine
    # issues n copies per operation; on a channel with one copy engine n back-to-back copies of a n-th of the
    # batched copy's time end when that one copy would (several engines would overlap their setups instead).
    copies = batch if mechanism.batched and batch > 1 else 1
    if copies > 1:
        from simulator.engine import engines_per_channel

        if engines_per_channel(profile) != 1:
            raise MechanismError(f"--transfer {mechanism.name} with --batch {batch} is modelled for one copy engine "
                                 f"per direction; {profile.name} has more: use serve-sim or --batch 1")
    work.recall_s = mechanism.copy_s(ctx, "h2d", work.recall_bytes * copies) / copies
    work.offload_s = offload_mechanism.copy_s(ctx, "d2h", work.offload_bytes * copies) / copies
    work.recall_overhead_s = mechanism.copy_overhead_s(ctx, "h2d")
    work.offload_overhead_s = offload_mechanism.copy_overhead_s(ctx, "d2h")
    beside = overlapping_copy_s(work.recall_s, work.offload_s, overlap, async_offload)
    work.compute_s = mechanism.stretch(ctx, work.compute_s, beside)
    return work


# ---------------------------------------------------------------- a serving iteration -----------------------


def custom_layers(mechanism: Mechanism) -> bool:
    """Whether the mechanism changes the layer operations' time (zero-copy, cpu-attention) beyond the roofline."""
    return type(mechanism).layer_times is not Mechanism.layer_times


def batch_op_s(mechanism: Mechanism, ctx: TransferContext, load: LayerLoad | None, batch: int, offload_group_s,
               following_group_s=None, async_offload: bool = True, layer_s=None) -> list[float]:
    """The operation times of one serving iteration (the layers, then the LM head) for the batch's summed
    `load` ([layers] arrays), or its layers' times `layer_s` as the caller priced them (a mechanism that keeps
    the kernels' time: costs.kernel_times with the prefill chunks apart); `offload_group_s` [ops] is the channel
    time of each operation's offload group, `following_group_s` [ops] (layer-prefetch) that of the recalls
    issued beside each operation. sm-copy stretches an operation by the copies beside it (as in
    `build_workload` for one sequence)."""
    shape, profile = ctx.shape, ctx.profile
    layer = mechanism.layer_times(ctx, load).total_s if layer_s is None else np.asarray(layer_s, dtype=np.float64)
    op_s = np.append(layer, float(costs.head_times(shape, profile, batch=batch).total_s))
    if type(mechanism).stretch is Mechanism.stretch:
        return op_s.tolist()
    beside = np.zeros_like(op_s)
    if async_offload:
        beside[1:] += np.asarray(offload_group_s, dtype=np.float64)[:-1]
    if following_group_s is not None:
        beside += np.asarray(following_group_s, dtype=np.float64)
    return mechanism.stretch(ctx, op_s, beside).tolist()


def needs_batch_op_s(mechanism: Mechanism) -> bool:
    """Whether a serving iteration must ask `batch_op_s` for its operation times (else the plain roofline)."""
    return custom_layers(mechanism) or type(mechanism).stretch is not Mechanism.stretch


def offload_mechanism(mechanism: Mechanism) -> Mechanism:
    """Who moves offloads: the mechanism itself, or DMA per block for those that read recalls in place."""
    return mechanism if mechanism.copies_recalls else MECHANISMS[DEFAULT_MECHANISM]


def coalesced_copy_s(mechanism: Mechanism, ctx: TransferContext, direction: str, n_bytes: float) -> float:
    """One copy moving a whole group's bytes of one operation (a batched mechanism, or --batch-copies)."""
    mover = mechanism if direction == "h2d" else offload_mechanism(mechanism)
    return float(mover.copy_s(ctx, direction, n_bytes))


def group_s(durations_s: np.ndarray, n_bytes: np.ndarray, coalesce) -> np.ndarray:
    """[ops] the channel time of each operation's group of copies ([members, ops] arrays): the members' summed
    durations, or with `coalesce(n_bytes)` one copy of their summed bytes when more than one member copies."""
    durations_s = np.asarray(durations_s, dtype=np.float64)
    total = durations_s.sum(axis=0)
    if coalesce is None:
        return total
    many = (durations_s > 0).sum(axis=0) > 1
    summed = np.asarray(n_bytes, dtype=np.float64).sum(axis=0)
    return np.array([coalesce(b) if m else t for t, b, m in zip(total.tolist(), summed.tolist(), many.tolist())])
