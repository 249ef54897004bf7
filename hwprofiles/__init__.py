"""Hardware profiles: GPU, host memory, host link and extra tiers, read from YAML files with cited sources.

    from hwprofiles import load_profile
    profile = load_profile("h100-sxm")
    profile.link.h2d_bytes_per_s, profile.gpu.hbm_bytes_per_s  # SI units: bytes, seconds, FLOP/s

No torch here: the simulator and the analysis import this package.
"""

from hwprofiles.loader import (
    MEASURED_DIR,
    PROFILES_DIR,
    list_profiles,
    load_profile,
    load_profile_file,
    search_dirs,
    validate_profile_file,
)
from hwprofiles.schema import (
    LINK_KINDS,
    TIER_KINDS,
    CopyCurve,
    GPUSpec,
    HardwareProfile,
    HostSpec,
    LinkSpec,
    OverheadSpec,
    ProfileError,
    TierSpec,
    TransferSpec,
    profile_from_dict,
    profile_to_yaml_dict,
)

__all__ = [
    "CopyCurve", "TransferSpec",
    "GPUSpec", "HardwareProfile", "HostSpec", "LINK_KINDS", "LinkSpec", "MEASURED_DIR", "OverheadSpec",
    "PROFILES_DIR", "ProfileError", "TIER_KINDS", "TierSpec", "list_profiles", "load_profile",
    "load_profile_file", "profile_from_dict", "profile_to_yaml_dict", "search_dirs", "validate_profile_file",
]
