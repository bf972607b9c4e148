"""Per-tenant caps on live GPU sessions (render contexts, decode and encode sessions) and GPU memory.

A cap follows the tenant's weight share of the GPU's engines unless configured: a tenant owed 25% of a GPU
with 8 NVDEC engines may hold 2 decode sessions at a time (at least 1 while it has any share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from unisched.policy.model import PolicyError

__all__ = ["MAX_MEMORY_BYTES", "CapKind", "SessionLimits", "VideoEngines", "default_cap", "video_engines_for"]

MAX_SESSIONS = 100_000
MAX_MEMORY_BYTES = 1 << 50
"""1 PiB: a memory cap or reserve per GPU above it is a mistake (GPUs hold about 1/7000 of it), refused."""


class CapKind(StrEnum):
    RENDER = "render"
    DECODE = "decode"
    ENCODE = "encode"


@dataclass(frozen=True)
class SessionLimits:
    """Configured caps; None means 'follow the weight share' (render: unlimited)."""

    render: int | None = None
    decode: int | None = None
    encode: int | None = None
    memory_bytes: int | None = None
    memory_reserve: int | None = None
    """GPU memory kept for the tenant on each GPU it may use (policy.memory); None: none."""

    def __post_init__(self) -> None:
        for name in ("render", "decode", "encode"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_SESSIONS):
                raise PolicyError(f"{name} cap must be an integer in 0..{MAX_SESSIONS}, got {v!r}")
        m = self.memory_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= MAX_MEMORY_BYTES):
            raise PolicyError(f"memory cap must be a number of bytes in 0..{MAX_MEMORY_BYTES} (1 PiB), got {m!r}")
        r = self.memory_reserve
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= MAX_MEMORY_BYTES):
            raise PolicyError(f"memory reserve must be a number of bytes in 0..{MAX_MEMORY_BYTES} (1 PiB), got {r!r}")
        if r is not None and m is not None and r > m:
            raise PolicyError(f"memory reserve {r} B exceeds the tenant's memory cap {m} B")

    def get(self, kind: CapKind) -> int | None:
        value: int | None = getattr(self, kind.value)
        return value


@dataclass(frozen=True)
class VideoEngines:
    nvdec: int
    nvenc: int


# Engine counts per model (vendor data sheets; the H200's seen on the driver: NVDEC yes, NVENC none).
_VIDEO_ENGINES = (
    ("H200", VideoEngines(7, 0)),
    ("H100", VideoEngines(7, 0)),
    ("H20", VideoEngines(7, 0)),
    ("A100", VideoEngines(5, 0)),
    ("A30", VideoEngines(4, 0)),
    ("L40", VideoEngines(3, 3)),
    ("L4", VideoEngines(4, 2)),
    ("A10", VideoEngines(2, 1)),
    ("T4", VideoEngines(2, 1)),
    ("V100", VideoEngines(1, 3)),
)


def video_engines_for(gpu_name: str) -> VideoEngines:
    upper = gpu_name.upper()
    for model, engines in _VIDEO_ENGINES:
        if model in upper:
            return engines
    return VideoEngines(1, 1)


def default_cap(kind: CapKind, share: float, engines: VideoEngines) -> int | None:
    """The cap that follows a weight share; None = unlimited (render contexts are not engine-bound)."""
    if kind is CapKind.RENDER:
        return None
    count = engines.nvdec if kind is CapKind.DECODE else engines.nvenc
    if count == 0:
        return 0
    return max(1, math.floor(share * count + 1e-9))
