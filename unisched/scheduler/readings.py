"""What a tick reads from the machine (the GPUs' telemetry, the tenants' cgroup CPU time and, once a second, their
process lists), in one call that touches nothing else, so that the engine's loop can make it on a worker thread.
NVML's calls block: a per-process query costs milliseconds on some machines, and a tick that made them on the event
loop held every lease renewal and every seccomp decision behind them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from unisched.enforce.cgroups import CgroupDriver
from unisched.telemetry import GpuSample, GpuTelemetry

__all__ = ["Readings", "read", "reader"]


@dataclass(frozen=True)
class Readings:
    """One tick's reads. `failure`: what the telemetry raised (it must not), and then `samples` is empty."""

    samples: tuple[GpuSample, ...]
    failure: str | None = None
    cpu_usage_s: Mapping[tuple[str, str], float | None] = field(default_factory=dict)
    """Cumulative CPU seconds by (tenant, cgroup) as read; None: the cgroup was not there."""
    pids: Mapping[str, list[int]] = field(default_factory=dict)
    """Process lists by cgroup, read for the ticks that check memory (upkeep, once a second)."""


def read(telemetry: GpuTelemetry, driver: CgroupDriver, cgroups: Sequence[tuple[str, str]],
         pid_cgroups: Sequence[str] = ()) -> Readings:
    """The reads of one tick: CPU time for the (tenant, cgroup) pairs given, process lists for `pid_cgroups`.
    Never raises for the telemetry: its failure is reported in the result, as the tick reports it."""
    try:
        samples, failure = tuple(telemetry.sample()), None
    except Exception as e:
        samples, failure = (), repr(e)
    return Readings(samples, failure, {(name, cg): driver.cpu_usage_s(cg) for name, cg in cgroups},
                    {cg: driver.pids(cg) for cg in pid_cgroups})


def reader(telemetry: GpuTelemetry, driver: CgroupDriver, cgroups: Sequence[tuple[str, str]],
           pid_cgroups: Sequence[str] = ()) -> Callable[[], Readings]:
    """`read` for these, as a call without arguments (for a worker thread)."""
    pairs, listed = tuple(cgroups), tuple(pid_cgroups)
    return lambda: read(telemetry, driver, pairs, listed)
