"""Values the scheduling policy speaks in: engines, priorities, modes, tenant specs, resources.

Pure data: no I/O, no clocks. Everything here is a frozen dataclass or an enum so that decisions are
plain values that can be compared in tests and logged as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "CGROUP_FILE_PREFIXES",
    "DEFAULT_WEIGHT",
    "WEIGHT_MAX",
    "WEIGHT_MIN",
    "ChargeKind",
    "ChargeSource",
    "Engine",
    "Mode",
    "PolicyError",
    "Priority",
    "Resource",
    "TenantSpec",
    "validate_tenant_name",
    "validate_weight",
]

WEIGHT_MIN = 1
WEIGHT_MAX = 10_000
DEFAULT_WEIGHT = 100
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
CGROUP_FILE_PREFIXES = frozenset({
    "cgroup", "cpu", "cpuset", "cpuacct", "io", "blkio", "memory", "hugetlb", "pids", "rdma", "misc", "freezer",
    "devices", "net_cls", "net_prio", "perf_event", "dmem", "irq", "debug",
})
"""What a cgroup interface file's name starts with, before its first '.': the controllers' (cgroup v1 and v2), the
core's (cgroup.procs) and PSI's (irq.pressure). A tenant's cgroup is a directory named after the tenant beside such
files, and one named like a file that is not there yet (hugetlb.2MB.max before hugetlb is enabled) makes the kernel
fail root's `+hugetlb` in cgroup.subtree_control with EEXIST, host-wide; so no tenant name has such a prefix."""


class PolicyError(ValueError):
    """A request the policy cannot accept (bad weight, unknown tenant, bad name)."""


class Engine(StrEnum):
    """GPU engines a tenant can use. One weight covers all of them."""

    COMPUTE = "compute"
    GRAPHICS = "graphics"
    DECODE = "decode"
    ENCODE = "encode"


class Priority(StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"


class Mode(StrEnum):
    """How slices are handed out; see docs/concepts.md (Modes)."""

    SHARED = "shared"
    PREEMPTIVE = "preemptive"
    TIMESHARE = "timeshare"
    TIDAL = "tidal"


@dataclass(frozen=True, order=True)
class Resource:
    """One contended unit: a contention domain on one GPU (e.g. the SMs of GPU 0).

    Engines map to domains through a ContentionMap: on most GPUs compute and graphics share the "sm"
    domain; on the H100/H200 graphics has its own.
    """

    gpu: int
    domain: str
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # resources key every per-slice map: hash once, not per lookup (the generated hash rebuilds a tuple)
        object.__setattr__(self, "_hash", hash((self.gpu, self.domain)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"gpu{self.gpu}/{self.domain}"


class ChargeSource(StrEnum):
    """What a tenant was doing where a charge came from, beside the rule that split the busy time: the parts of the
    charging model that can put another tenant's work on it are told apart, so a share that misses its weight can be
    traced to one (docs/design/scheduling.md, Charging)."""

    ALONE = "alone"
    """Thawed, the only tenant charged on the resource in the interval: the busy time measured there (less what
    cooperative tenants reported)."""
    SHARED = "shared"
    """Thawed, its part of the busy time split with the other tenants thawed beside it."""
    BESIDE_DRAIN = "beside-drain"
    """Thawed, its part of the busy time of an interval in which another tenant on the resource was frozen: that
    tenant's work queued at its freeze drained in it, and a split by CPU activity puts most of it here."""
    DRAIN = "drain"
    """Frozen in the interval, its queued work draining: its part of the split; or (rule `report`) that drain as a
    client's units timed it."""
    FROZEN_TAIL = "frozen-tail"
    """Frozen before the interval, charged for the CPU it still used in it."""
    REPORTED = "reported"
    """A cooperative tenant's own GPU time, as its reports gave it less the other tenants' work they timed."""


@dataclass(frozen=True, order=True, slots=True)
class ChargeKind:
    """How a charge came: the rule that split it (a policy.plan.Rule value; `report` for what a cooperative report
    gave) and its source."""

    rule: str
    source: ChargeSource

    def __str__(self) -> str:
        return f"{self.rule}/{self.source}"


@dataclass(frozen=True)
class TenantSpec:
    name: str
    weight: int = DEFAULT_WEIGHT
    priority: Priority = Priority.OFFLINE

    def __post_init__(self) -> None:
        validate_tenant_name(self.name)
        validate_weight(self.weight)


def validate_weight(weight: int) -> int:
    if isinstance(weight, bool) or not isinstance(weight, int):
        raise PolicyError(f"weight must be an integer in {WEIGHT_MIN}..{WEIGHT_MAX}, got {weight!r}")
    if not WEIGHT_MIN <= weight <= WEIGHT_MAX:
        raise PolicyError(f"weight must be in {WEIGHT_MIN}..{WEIGHT_MAX}, got {weight}")
    return weight


def validate_tenant_name(name: str) -> str:
    """The one rule for tenant names (registration, configuration, the state file, re-adoption all ask here)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise PolicyError(
            f"tenant name must be 1-63 characters of letters, digits, '_', '.', '-' starting with a letter or digit, got {name!r}"
        )
    prefix, dot, _ = name.partition(".")
    if dot and prefix in CGROUP_FILE_PREFIXES:
        raise PolicyError(
            f"tenant name {name!r} starts with '{prefix}.', as cgroup interface files are named (the tenant's cgroup "
            "could keep a controller's file from being created, host-wide); choose another name"
        )
    return name
