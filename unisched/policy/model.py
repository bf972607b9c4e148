"""Values the scheduling policy speaks in: engines, priorities, modes, tenant specs, resources.

Pure data: no I/O, no clocks. Everything here is a frozen dataclass or an enum so that decisions are
plain values that can be compared in tests and logged as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "DEFAULT_WEIGHT",
    "WEIGHT_MAX",
    "WEIGHT_MIN",
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
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise PolicyError(
            f"tenant name must be 1-63 characters of letters, digits, '_', '.', '-' starting with a letter or digit, got {name!r}"
        )
    return name
