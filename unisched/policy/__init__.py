"""Scheduling policy: pure fairness math (no I/O, no asyncio, no grpc, no pynvml; time passed in)."""

from unisched.policy.contention import SEPARATE_GRAPHICS, SHARED_SM, ContentionMap
from unisched.policy.fairshare import Decision, FairShareConfig, TenantStats, WeightedFairShare
from unisched.policy.model import (
    CGROUP_FILE_PREFIXES,
    DEFAULT_WEIGHT,
    WEIGHT_MAX,
    WEIGHT_MIN,
    ChargeKind,
    ChargeSource,
    Engine,
    Mode,
    PolicyError,
    Priority,
    Resource,
    TenantSpec,
    validate_tenant_name,
    validate_weight,
)
from unisched.policy.tidal import TidalSchedule, TidalWindow, parse_clock

__all__ = [
    "CGROUP_FILE_PREFIXES",
    "DEFAULT_WEIGHT",
    "SEPARATE_GRAPHICS",
    "SHARED_SM",
    "WEIGHT_MAX",
    "WEIGHT_MIN",
    "ChargeKind",
    "ChargeSource",
    "ContentionMap",
    "Decision",
    "Engine",
    "FairShareConfig",
    "Mode",
    "PolicyError",
    "Priority",
    "Resource",
    "TenantSpec",
    "TenantStats",
    "TidalSchedule",
    "TidalWindow",
    "WeightedFairShare",
    "parse_clock",
    "validate_tenant_name",
    "validate_weight",
]
