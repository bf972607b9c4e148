"""A CPU core standing in for a GPU: unisched's scheduling, charging and saturation gate on a machine with none.

Without a GPU the engine charges freezer-governed tenants their CPU time and slices blind; a cooperative client's reported
time and a freezer-governed tenant's CPU time then meet on no common signal. Here one CPU core plays GPU 0: its busy
fraction over an interval is the CPU time all the daemon's tenants used in it (their cgroups sit under the
daemon's subtree, whose usage counts them all), so the engine meets the same signal NVML's utilization gives on a
GPU. Pin the tenants to one core and they contend the way two CUDA processes do. For trying unisched without a GPU
and for tests of what the GPU's signal drives; never for scheduling real GPU work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from unisched.telemetry.model import GpuInfo, GpuSample

__all__ = ["STAND_IN_NAME", "CpuStandIn"]

STAND_IN_NAME = "CPU stand-in"
"""The stand-in GPU's name: what `unisched status` shows, and no calibration file names a real GPU so."""


class CpuStandIn:
    """GPU 0 is one CPU core: busy fraction = tenants' CPU seconds / wall seconds over the interval, at most 1."""

    def __init__(self, usage_s: Callable[[], float | None], monotonic: Callable[[], float]) -> None:
        self._usage_s = usage_s
        self._monotonic = monotonic
        self._last: tuple[float, float] | None = None

    def gpus(self) -> Sequence[GpuInfo]:
        return (GpuInfo(0, STAND_IN_NAME, "CPU-STAND-IN-0", 0),)

    def sample(self) -> Sequence[GpuSample]:
        """The busy fraction since the previous call; a first call, or a subtree not there yet, reads as no sample
        (ok=False), as a failed NVML read does."""
        now, used = self._monotonic(), self._usage_s()
        last, self._last = self._last, (None if used is None else (now, used))
        if used is None or last is None or now <= last[0]:
            return (GpuSample(0, 0.0, 0.0, 0.0, 0, ok=False),)
        util = min(1.0, max(0.0, (used - last[1]) / (now - last[0])))
        return (GpuSample(0, util, util, util, 0),)

    def close(self) -> None:
        return None
