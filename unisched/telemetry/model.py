"""What telemetry reports: per-GPU utilization per engine over the last interval, memory, and hints
about which processes use which engine (NVML lists graphics and some decode processes; never rely on it
alone: on the H200 it does not list CUDA processes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from unisched.policy import Engine

__all__ = ["FakeTelemetry", "GpuInfo", "GpuSample", "GpuTelemetry", "NoGpuTelemetry"]


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total: int


@dataclass(frozen=True)
class GpuSample:
    index: int
    sm_util: float
    """0..1, busy fraction of the SMs (NVML 'gpu' utilization) over the interval."""
    dec_util: float
    enc_util: float
    memory_used: int
    process_engines: Mapping[int, frozenset[Engine]] = field(default_factory=dict)
    process_memory: Mapping[int, int] = field(default_factory=dict)
    """GPU memory per pid, for the processes NVML lists (graphics processes, and compute where listed)."""
    ok: bool = True
    """False when NVML failed for this GPU this time (GPU lost, Xid): values are stale zeros."""
    encoder_sessions: Mapping[int, int] | None = None
    """Live NVENC sessions per pid from NVML's encoder session list; None where NVML cannot say (no NVENC)."""
    gpu_pids: frozenset[int] | None = None
    """Processes NVML lists with a graphics or compute context on this GPU; None where it cannot list them."""
    process_sm: Mapping[int, float] | None = None
    """SM (3D and compute) busy fraction per pid, averaged over NVML's per-process samples since its previous
    per-process query (about a second); None where NVML cannot say. NVML leaves out processes it has no samples
    for, and some it should have (CUDA ones on the H200): a pid missing is unknown, not idle."""

    def util(self, engine: Engine) -> float:
        if engine is Engine.DECODE:
            return self.dec_util
        if engine is Engine.ENCODE:
            return self.enc_util
        return self.sm_util


class GpuTelemetry(Protocol):
    def gpus(self) -> Sequence[GpuInfo]: ...
    def sample(self) -> Sequence[GpuSample]:
        """Utilization since the previous call. Must not raise: failures give ok=False samples."""
        ...

    def close(self) -> None: ...


class NoGpuTelemetry:
    """No NVML (no GPU or driver): the engine runs on CPU signals alone."""

    def gpus(self) -> Sequence[GpuInfo]:
        return ()

    def sample(self) -> Sequence[GpuSample]:
        return ()

    def close(self) -> None:
        return None


class FakeTelemetry:
    """Tests set `next_samples`; `sample()` returns them."""

    def __init__(self, gpus: Sequence[GpuInfo]) -> None:
        self._gpus = tuple(gpus)
        self.next_samples: list[GpuSample] = [GpuSample(g.index, 0.0, 0.0, 0.0, 0) for g in self._gpus]

    def gpus(self) -> Sequence[GpuInfo]:
        return self._gpus

    def sample(self) -> Sequence[GpuSample]:
        return tuple(self.next_samples)

    def close(self) -> None:
        return None
