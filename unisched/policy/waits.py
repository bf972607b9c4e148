"""How the GPU drivers of a tenant's processes wait for the GPU: without spinning, so that CPU time follows work.

Why: a freezer-governed tenant's share of a busy GPU is split from the CPU time its processes used
(policy.charging.charge_rule), since NVML's per-process samples cannot give a rate to each of many processes
time-sliced on one GPU (they show a few a second, each whole to one process). NVIDIA's OpenGL/EGL driver waits for
the GPU in a loop that calls sched_yield(), which returns at once on a host with idle cores: a process that waits
behind other tenants' work spins, and is charged for that wait as if it were GPU work of its own. The more often a
tenant runs, the more it waits beside others, so the heaviest weights are overcharged the most and get less than
their share. The driver's __GL_YIELD=USLEEP makes each turn of that loop a usleep(0): the wait sleeps, and CPU time
is the process's own work again.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = ["DRIVER_WAIT_ENV"]

DRIVER_WAIT_ENV: Final[Mapping[str, str]] = MappingProxyType({"__GL_YIELD": "USLEEP"})
"""What every governed process starts with (`unisched run`'s command, a Kubernetes tenant's containers). Only the
NVIDIA OpenGL/EGL driver reads it; CUDA, NVDEC and NVENC ignore it."""
