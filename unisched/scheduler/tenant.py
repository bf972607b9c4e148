"""A tenant as the scheduler keeps it (`Tenant`), as callers see it (`TenantSnapshot`), and the errors and
parsing every request path shares."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from unisched.policy import (
    ChargeKind,
    Engine,
    Priority,
    Resource,
)
from unisched.policy.caps import SessionLimits
from unisched.scheduler.memory import GpuMemory
from unisched.scheduler.state import SavedFields, SavedTenant

__all__ = [
    "CALLER_GONE", "SchedulerError", "LeaseAck", "ResourceShare", "Tenant", "TenantSnapshot", "need_alive", "off_gpu",
    "parse_engine", "parse_engines", "tenant_state",
]

MAX_MESSAGE_CHARS = 400
"""Error messages echo requests; clipped so that a 60 KiB name cannot make an error larger than gRPC's metadata
limit (the client then saw RESOURCE_EXHAUSTED 'metadata size exceeds hard limit' instead of the reason)."""


class SchedulerError(Exception):
    """A request the scheduler refuses. `kind` is not_found, invalid, permission or failed."""

    def __init__(self, kind: str, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ResourceShare:
    resource: Resource
    target: float
    measured: float
    gpu_seconds: float = 0.0
    """GPU time charged on this resource since the tenant was added."""
    charges: tuple[tuple[ChargeKind, float], ...] = ()
    """`gpu_seconds` by the rule and source each charge came by (policy.ChargeKind), in their order."""


@dataclass(frozen=True)
class TenantSnapshot:
    """One tenant as `unisched tenants`, metrics and logs see it."""

    name: str
    weight: int
    base_weight: int
    priority: Priority
    pids: tuple[int, ...]
    state: str
    target_share: float
    measured_share: float
    gpu_seconds: float
    cgroup: str
    engines: frozenset[Engine]
    shares: tuple[ResourceShare, ...]
    slices: int
    owner_uid: int
    adopted: bool
    sessions: Mapping[str, int] = field(default_factory=dict)
    refusals: Mapping[str, int] = field(default_factory=dict)
    caps: Mapping[str, int | None] = field(default_factory=dict)
    memory_cap: int | None = None
    memory_reserve: int | None = None
    memory_bytes: int = 0
    over_memory: bool = False
    devices: str | None = None
    cooperative: bool = False
    overrun_s: float = 0.0
    enforced: bool = False
    unit_s: float | None = None
    """Cooperative: the mean GPU time of its units, once it reported counted ones."""
    turn_s: float = 0.0
    """Cooperative: its minimum run (Tuning.run_units units, capped), 0 when its units are short."""
    env: Mapping[str, str] = field(default_factory=dict)
    """What its processes start with (`unisched run` sets it): the MPS client settings while the daemon runs MPS."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Where an orchestrator runs it (scheduler.labels: pod, namespace, container), for metrics."""
    gpu_memory: tuple[GpuMemory, ...] = ()
    """Video memory per GPU as the session hooks count it (exact), with its cap, reserve and refusals."""


@dataclass(frozen=True)
class LeaseAck:
    """The engine's answer to a want or a report: does the tenant hold the engine now."""

    engine: Engine
    held: bool
    lease: int


# Which engine an open session (unisched.enforce.nvclasses.SessionKind values) shows demand on.
_ENGINE_OF_KIND = {"graphics": Engine.GRAPHICS, "compute": Engine.COMPUTE, "nvdec": Engine.DECODE, "nvenc": Engine.ENCODE}


@dataclass
class Tenant:
    name: str
    base_weight: int
    priority: Priority
    engines: frozenset[Engine]
    gpus: tuple[int, ...] | None
    cgroup: str
    adopted: bool
    owner_uid: int
    frozen: bool = False
    froze: bool = False
    """Frozen since the last charge: its GPU work queued at the freeze (a render's frame in flight) drains in the
    interval, whatever CPU it shows, so it is charged for the interval (tick.py)."""
    last_cpu: float | None = None
    idle_run: int = 0
    active: bool = False
    missing: bool = False
    resources: frozenset[Resource] = field(default_factory=frozenset)
    limits: SessionLimits = field(default_factory=SessionLimits)
    sessions: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    memory_bytes: int = 0
    over_memory: bool = False
    devices_admitted: bool = False
    encoder_mismatch: int = 0
    """Consecutive once-a-second checks where NVML's encoder session list disagreed with `sessions`."""
    hooked: bool = False
    """Session hooks govern (some of) its processes: its session counts say when it holds a GPU context."""
    nvml_on_gpu: bool = True
    """NVML lists one of its processes on a GPU (refreshed once a second; True while unknown)."""
    ephemeral: bool = False
    """Made by `unisched run` without --keep: removed once its last process has exited (`_reap_emptied`)."""
    moving: int = 0
    """Registering callers being moved into its cgroup now (off the loop): until they are in, its cgroup may show
    no process, and an emptied run tenant must not be removed for that."""
    labels: Mapping[str, str] = field(default_factory=dict)
    gpu_rates: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per GPU, its GPU seconds per CPU second over a second where NVML's per-process samples showed its processes,
    and when it was taken, kept a while through seconds without one (scheduler.rates): the charge split weighs its
    CPU time by it (policy.charging.charge_rule)."""
    rate_cpu: tuple[float, float] | None = None
    """Its cumulative CPU seconds, and when, as its rates were last taken."""

    def saved(self) -> SavedTenant:
        return SavedTenant(*self.saved_fields())

    def saved_fields(self) -> SavedFields:
        """What the state file keeps of it, in SavedTenant's order (state.LineCache compares these)."""
        return (self.name, self.base_weight, self.priority, self.engines, self.gpus,
                self.cgroup, self.adopted, self.owner_uid, self.limits, self.ephemeral, self.labels)

    def all_engines(self) -> frozenset[Engine]:
        """Declared engines plus those its open sessions show (an open decoder is demand on NVDEC)."""
        seen = {_ENGINE_OF_KIND[k] for k, n in self.sessions.items() if n > 0 and k in _ENGINE_OF_KIND}
        return self.engines | seen


def tenant_state(t: Tenant, holds_lease: bool | None = None) -> str:
    """holds_lease: None for a freezer-governed tenant; for a cooperative one, whether it holds a lease now."""
    if t.frozen:
        return "frozen"
    if holds_lease is not None and t.active and not holds_lease:
        return "waiting"
    return "running" if t.active else "idle"


def off_gpu(t: Tenant) -> bool:
    """No GPU context anywhere in the tenant: the hooks count none and NVML lists none of its processes.

    Such a tenant cannot use the GPU, so it shows no demand there and is never frozen: freezing it would only
    slow its CPU start-up (at weight 1:3 a trainer's seconds of torch import and set-up take about four times as
    long) and charge it for the other tenant's GPU time. Both signals must agree,
    so an unclassified context class or a process outside the hooks still counts as on the GPU."""
    return t.hooked and not t.nvml_on_gpu and not any(n > 0 for n in t.sessions.values())


_ENGINES: dict[str, Engine] = {e.value: e for e in Engine}
"""Engines by name: every renewal names one, and a dict lookup is a fraction of Engine(name)'s enum call."""


def parse_engine(name: str) -> Engine:
    e = _ENGINES.get(name)
    if e is None:
        kinds = ", ".join(k.value for k in Engine)
        raise SchedulerError("invalid", f"engine must be one of {kinds}; got {name[:40]!r}")
    return e


CALLER_GONE = "the connecting process has exited"
"""Why a call that would act on the caller's process is refused once that process is gone."""


def need_alive(alive: Callable[[], bool] | None) -> None:
    if alive is not None and not alive():
        raise SchedulerError("failed", CALLER_GONE)


def parse_engines(names: Iterable[str]) -> frozenset[Engine]:
    try:
        engines = frozenset(Engine(n) for n in names)
    except ValueError:
        kinds = ", ".join(e.value for e in Engine)
        raise SchedulerError("invalid", f"engines must be among {kinds}; got {list(names)}") from None
    return engines or frozenset({Engine.COMPUTE})

