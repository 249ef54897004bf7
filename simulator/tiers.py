"""A spill chain of offload tiers: `--offload-tier ddr+nvme` = host DDR first, the profile's `nvme` tier when DDR
is full.

Offloaded KV lives in one tier per request (serve-sim) or per simulated sample (simulate: a sequence, or its
lockstep batch): serve-sim's admission reserves a request's peak offloaded bytes in DDR while DDR has room and
in the spill tier otherwise (DDR full -> spill), each tier's reservations never above its capacity; simulate
puts a sample in DDR when its batch's peak offloaded KV fits there, else in the spill tier, and counts
`max_concurrency_ddr` as the whole sequences that fit in DDR plus those that fit in the spill tier. A spilled
request's or sample's copies cost what the spill tier costs (`costs.offload_tier`: the slower of link and
tier, the link overhead + the tier's latency) on the same link channels. A plain tier name (`ddr`,
`cxl-expander`, `nvme`) is a chain of one.
"""

from __future__ import annotations

from dataclasses import dataclass

from hwprofiles import HardwareProfile
from simulator import costs
from simulator.errors import OptionError, ServingError


@dataclass(frozen=True)
class TierChain:
    primary: str
    spill: str | None = None


def tier_chain(profile: HardwareProfile, name: str) -> TierChain:
    """`ddr`, `TIER` or `ddr+TIER` -> the chain, each tier checked on the profile (one-line errors)."""
    primary, plus, spill = name.partition("+")
    if plus and (primary != "ddr" or not spill or "+" in spill):
        raise OptionError(f"--offload-tier {name!r}: a spill chain is ddr+TIER (host DDR, then one extra tier of "
                           "the profile, e.g. ddr+nvme)")
    costs.offload_tier(profile, primary)
    if spill:
        costs.offload_tier(profile, spill)
    return TierChain(primary, spill or None)


def capacity_bytes(profile: HardwareProfile, chain: TierChain) -> float:
    """Everything the chain can hold (the primary tier + the spill tier)."""
    total = costs.offload_tier(profile, chain.primary).capacity_bytes
    return total + (costs.offload_tier(profile, chain.spill).capacity_bytes if chain.spill else 0.0)


def tier_for(profile: HardwareProfile, chain: TierChain, offloaded_bytes: float) -> str:
    """Where offloaded KV of `offloaded_bytes` (at its peak) lives: the primary tier if it fits, else the spill
    tier if it fits there, else the primary (and the caller flags the overflow)."""
    if chain.spill and offloaded_bytes > costs.offload_tier(profile, chain.primary).capacity_bytes \
            and offloaded_bytes <= costs.offload_tier(profile, chain.spill).capacity_bytes:
        return chain.spill
    return chain.primary


def sequences_that_fit(profile: HardwareProfile, chain: TierChain, per_sequence_bytes: float) -> int:
    """Whole sequences of `per_sequence_bytes` offloaded KV the chain holds (each tier holds whole ones)."""
    tiers = [chain.primary] + ([chain.spill] if chain.spill else [])
    return sum(int(costs.offload_tier(profile, t).capacity_bytes // per_sequence_bytes) for t in tiers)


def check_spill(chain: TierChain, mechanism, coalesced: bool, engines: int) -> None:
    """What a spill chain is modelled for: copying mechanisms, one copy per request, one engine per channel."""
    if chain.spill is None:
        return
    if not mechanism.copies_recalls:
        raise ServingError(f"--transfer {mechanism.name} reads recalled blocks in place; a spill tier "
                           f"({chain.spill}) is only modelled for copying mechanisms (dma-per-block)")
    if coalesced:
        raise ServingError(f"a spill tier ({chain.spill}) with one copy per operation for the whole batch "
                           f"(--transfer {mechanism.name} / --batch-copies) is not modelled: the group would mix "
                           "tiers; use --transfer dma-per-block")
    if engines != 1:
        raise ServingError(f"a spill tier ({chain.spill}) is modelled for one copy engine per direction")


@dataclass(frozen=True)
class ServingMemory:
    """What a serving simulation may hold (the DES and its fast path read the same): HBM for KV beside the
    weights, the offload tier chain, its primary tier and the capacities of it and of the spill tier."""

    kv_capacity_bytes: float
    chain: TierChain
    tier: object  # costs.OffloadTier of chain.primary
    ddr_capacity_bytes: float
    spill_capacity_bytes: float


def serving_memory(profile: HardwareProfile, shape, offload_tier: str) -> ServingMemory:
    kv_capacity_bytes = profile.gpu.hbm_capacity_bytes - shape.weight_bytes
    if kv_capacity_bytes <= 0:
        raise ServingError(f"{shape.name}: weights ({shape.weight_bytes / 1e9:.1f} GB) do not fit in "
                           f"{profile.name}'s HBM; pick a larger GPU")
    chain = tier_chain(profile, offload_tier)  # ddr, TIER, or ddr+TIER (spill)
    tier = costs.offload_tier(profile, chain.primary)
    spill = costs.offload_tier(profile, chain.spill).capacity_bytes if chain.spill else 0.0
    return ServingMemory(kv_capacity_bytes, chain, tier, tier.capacity_bytes, spill)
