"""A spill chain of offload tiers: `--offload-tier ddr+nvme` = host DDR first, the profile's `nvme` tier when DDR
is full (serve-sim).

Offloaded KV lives in one tier per request: serve-sim's admission reserves a request's peak offloaded bytes in
DDR while DDR has room and in the spill tier otherwise (DDR full -> spill), each tier's reservations never
above its capacity; a spilled request's copies cost what the spill tier costs (`costs.offload_tier`: the
slower of link and tier, the link overhead + the tier's latency) and share the same link channels. A plain
tier name (`ddr`, `cxl-expander`, `nvme`) is a chain of one.
"""

from __future__ import annotations

from dataclasses import dataclass

from hwprofiles import HardwareProfile
from simulator import costs
from simulator.errors import ServingError


@dataclass(frozen=True)
class TierChain:
    primary: str
    spill: str | None = None


def tier_chain(profile: HardwareProfile, name: str) -> TierChain:
    """`ddr`, `TIER` or `ddr+TIER` -> the chain, each tier checked on the profile (one-line errors)."""
    primary, plus, spill = name.partition("+")
    if plus and (primary != "ddr" or not spill or "+" in spill):
        raise ServingError(f"--offload-tier {name!r}: a spill chain is ddr+TIER (host DDR, then one extra tier of "
                           "the profile, e.g. ddr+nvme)")
    costs.offload_tier(profile, primary)
    if spill:
        costs.offload_tier(profile, spill)
    return TierChain(primary, spill or None)


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
