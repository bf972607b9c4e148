"""Simulated tenants: what work they submit, on which engine, and when.

A tenant has one or more streams. A stream is a queue of equal work items on one engine of one GPU: a CUDA
stream of short kernels, a render loop of frame-sized items, a decode session. While the tenant is thawed and
has work ("on"), it keeps each stream's queue `depth` items deep; frozen, it submits nothing, but what is
already queued keeps running (the drain a real GPU shows after a cgroup freeze).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from unisched.policy import DEFAULT_WEIGHT, Engine, PolicyError, Priority, validate_tenant_name, validate_weight

__all__ = [
    "Activity",
    "SimTenant",
    "StreamSpec",
    "bursty",
    "cuda",
    "decode",
    "idle",
    "mixed",
    "render",
]


@dataclass(frozen=True)
class StreamSpec:
    engine: Engine
    item_s: float
    """GPU time one work item takes when it runs alone."""
    depth: int = 1
    """Items kept queued ahead (1: the app waits for each item; deep CUDA queues drain long after a freeze)."""
    gpu: int = 0

    def __post_init__(self) -> None:
        if not (self.item_s > 0 and math.isfinite(self.item_s)):
            raise PolicyError(f"item_s must be a positive number of seconds, got {self.item_s}")
        if self.depth < 1:
            raise PolicyError(f"depth must be >= 1, got {self.depth}")
        if self.gpu < 0:
            raise PolicyError(f"gpu must be >= 0, got {self.gpu}")


@dataclass(frozen=True)
class Activity:
    """When a tenant has work: from `start_s` on, `on_s` with work then `off_s` without, repeating.

    `on_s = inf` is a tenant that always has work once started; `start_s = inf` one that never has.
    With `jitter`, each period is drawn from an exponential distribution with that mean (seeded).
    """

    on_s: float = math.inf
    off_s: float = 0.0
    start_s: float = 0.0
    jitter: bool = False

    def __post_init__(self) -> None:
        if not self.on_s > 0 or self.off_s < 0 or self.start_s < 0:
            raise PolicyError(f"activity needs on_s > 0, off_s >= 0, start_s >= 0: {self}")
        if not math.isinf(self.on_s) and self.off_s == 0:
            raise PolicyError("a bursty activity needs off_s > 0")

    @property
    def always(self) -> bool:
        return math.isinf(self.on_s)


ALWAYS = Activity()
NEVER = Activity(start_s=math.inf)


@dataclass(frozen=True)
class SimTenant:
    name: str
    weight: int = DEFAULT_WEIGHT
    streams: tuple[StreamSpec, ...] = ()
    activity: Activity = ALWAYS
    priority: Priority = Priority.OFFLINE
    min_run_s: float = 0.0
    """The policy's minimum run for it (what lease enforcement gives a tenant with long units)."""

    def __post_init__(self) -> None:
        validate_tenant_name(self.name)
        validate_weight(self.weight)
        if not 0.0 <= self.min_run_s <= 10.0:
            raise PolicyError(f"min_run_s must be within 0 .. 10 s, got {self.min_run_s}")


def cuda(
    name: str, weight: int = DEFAULT_WEIGHT, *, gpu: int = 0, kernel_s: float = 0.002, depth: int = 4,
    activity: Activity = ALWAYS, priority: Priority = Priority.OFFLINE,
) -> SimTenant:
    """Short kernels on the SMs; `depth` kernels in flight (450 x 2 ms is a ~0.9 s drain, as measured)."""
    return SimTenant(name, weight, (StreamSpec(Engine.COMPUTE, kernel_s, depth, gpu),), activity, priority)


def render(
    name: str, weight: int = DEFAULT_WEIGHT, *, gpu: int = 0, frame_s: float = 0.027, depth: int = 2,
    activity: Activity = ALWAYS, priority: Priority = Priority.OFFLINE,
) -> SimTenant:
    """Frame-sized items on the graphics engine (27 ms: the heavy 1080p fragment-shader load)."""
    return SimTenant(name, weight, (StreamSpec(Engine.GRAPHICS, frame_s, depth, gpu),), activity, priority)


def decode(
    name: str, weight: int = DEFAULT_WEIGHT, *, gpu: int = 0, frame_s: float = 0.003, depth: int = 2,
    activity: Activity = ALWAYS, priority: Priority = Priority.OFFLINE,
) -> SimTenant:
    """Frames on the video decode engine (its own contention domain)."""
    return SimTenant(name, weight, (StreamSpec(Engine.DECODE, frame_s, depth, gpu),), activity, priority)


def mixed(
    name: str, weight: int = DEFAULT_WEIGHT, *, gpu: int = 0, kernel_s: float = 0.002, frame_s: float = 0.027,
    activity: Activity = ALWAYS, priority: Priority = Priority.OFFLINE,
) -> SimTenant:
    """Rendering and CUDA at once (e.g. a renderer with CUDA post-processing): two engines, one weight."""
    streams = (StreamSpec(Engine.GRAPHICS, frame_s, 2, gpu), StreamSpec(Engine.COMPUTE, kernel_s, 4, gpu))
    return SimTenant(name, weight, streams, activity, priority)


def idle(name: str, weight: int = DEFAULT_WEIGHT, *, gpu: int = 0) -> SimTenant:
    """Registered, never submits."""
    return SimTenant(name, weight, (StreamSpec(Engine.COMPUTE, 0.002, 1, gpu),), NEVER)


def bursty(base: SimTenant, on_s: float, off_s: float, *, start_s: float = 0.0, jitter: bool = True) -> SimTenant:
    """`base` with work only in on/off periods (exponentially drawn around the means when `jitter`)."""
    return replace(base, activity=Activity(on_s, off_s, start_s, jitter))
