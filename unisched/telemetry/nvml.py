"""The one module that imports pynvml.

Utilization over an interval comes from NVML's sample buffer (nvmlDeviceGetSamples), averaged over the
samples newer than the last call, so each engine tick sees the GPU's activity during that tick as well as
the driver's sampling period allows; decoder/encoder utilization and per-process hints come from the
plain queries. Every NVML error is caught: a lost GPU yields ok=False samples, never an exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import structlog

from unisched.policy import Engine
from unisched.telemetry.model import GpuInfo, GpuSample

__all__ = ["NvmlTelemetry", "open_nvml", "open_nvml_or_reason"]

log = structlog.get_logger("unisched.telemetry")

PROCESS_POLL_EVERY = 20  # per-process queries are slow; refresh them every N samples


def open_nvml() -> NvmlTelemetry | None:
    """NVML when a driver is there; None (and one log line) otherwise."""
    opened, reason = open_nvml_or_reason()
    if opened is None:
        log.warning("nvml unavailable, running on CPU signals", reason=reason)
    return opened


def open_nvml_or_reason() -> tuple[NvmlTelemetry | None, str]:
    """(NVML, "") when a driver is there; (None, why not) otherwise, unlogged (`unisched calibrate` says it)."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, str(e)
    try:
        return NvmlTelemetry(pynvml), ""
    except Exception as e:  # nvmlDeviceGetCount failed (driver in a bad state): never stop the daemon for it
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        return None, str(e)


class NvmlTelemetry:
    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._handles: list[Any] = []
        self._info: list[GpuInfo] = []
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                name = nvml.nvmlDeviceGetName(h)
                info = GpuInfo(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    uuid=str(nvml.nvmlDeviceGetUUID(h)),
                    memory_total=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                )
            except nvml.NVMLError as e:  # lost already (Xid 79): serve the other GPUs
                log.error("GPU unusable at start; left out", gpu=i, error=str(e))
                continue
            self._handles.append(h)
            self._info.append(info)
        self._last_ts = [0] * len(self._handles)
        self._last_util = [0.0] * len(self._handles)
        self._procs: list[dict[int, frozenset[Engine]]] = [{} for _ in self._handles]
        self._memory: list[dict[int, int]] = [{} for _ in self._handles]
        self._pids: list[frozenset[int] | None] = [None for _ in self._handles]
        self._process_sm: list[dict[int, float] | None] = [None for _ in self._handles]
        self._process_ts = [0] * len(self._handles)
        self._encoders: dict[int, dict[int, int] | None] = {}
        self._calls = 0
        self._failing: set[int] = set()

    def gpus(self) -> Sequence[GpuInfo]:
        return tuple(self._info)

    def sample(self) -> Sequence[GpuSample]:
        self._calls += 1
        out = []
        for k, h in enumerate(self._handles):
            i = self._info[k].index
            try:
                out.append(self._sample_one(k, h))
                if i in self._failing:
                    self._failing.discard(i)
                    log.info("nvml recovered", gpu=i)
            except Exception as e:  # NVMLError (GPU lost, Xid, timeout) or anything else: never raise
                if i not in self._failing:
                    self._failing.add(i)
                    log.error("nvml error, GPU treated as unknown", gpu=i, error=str(e) or repr(e))
                out.append(GpuSample(i, 0.0, 0.0, 0.0, 0, ok=False))
        return tuple(out)

    def _sample_one(self, k: int, h: Any) -> GpuSample:
        """k is the GPU's position in our lists (a GPU lost at start is left out, so not always its NVML index)."""
        nvml = self._nvml
        sm = self._sm_util(k, h)
        dec = nvml.nvmlDeviceGetDecoderUtilization(h)[0] / 100.0
        try:
            enc = nvml.nvmlDeviceGetEncoderUtilization(h)[0] / 100.0
        except nvml.NVMLError:
            enc = 0.0  # GPUs without NVENC (H100/H200)
        mem = int(nvml.nvmlDeviceGetMemoryInfo(h).used)
        if self._calls % PROCESS_POLL_EVERY == 1:
            self._procs[k], self._process_sm[k] = self._process_utilization(k, h)
            self._memory[k], self._pids[k] = self._process_memory(h)
            self._encoders[k] = self._encoder_sessions(h)
        enc_sessions = self._encoders.get(k)
        return GpuSample(self._info[k].index, sm, dec, enc, mem, dict(self._procs[k]), dict(self._memory[k]),
                         encoder_sessions=None if enc_sessions is None else dict(enc_sessions),
                         gpu_pids=self._pids[k], process_sm=self._process_sm[k])

    def _encoder_sessions(self, h: Any) -> dict[int, int] | None:
        """NVENC sessions per pid (what the session hooks' encoder counts are reconciled against)."""
        nvml = self._nvml
        query = getattr(nvml, "nvmlDeviceGetEncoderSessions", None)  # older nvidia-ml-py releases lack it
        if query is None:
            return None
        try:
            sessions = query(h)
        except nvml.NVMLError:
            return None  # no NVENC on this GPU (H100/H200), or the driver does not say
        out: dict[int, int] = {}
        for s in sessions:
            out[int(s.pid)] = out.get(int(s.pid), 0) + 1
        return out

    def _sm_util(self, i: int, h: Any) -> float:
        nvml = self._nvml
        try:
            _, samples = nvml.nvmlDeviceGetSamples(h, nvml.NVML_GPU_UTILIZATION_SAMPLES, self._last_ts[i])
        except nvml.NVMLError_NotFound:
            samples = []
        fresh = [s for s in samples if s.timeStamp > self._last_ts[i]]
        if fresh:
            self._last_ts[i] = max(s.timeStamp for s in fresh)
            self._last_util[i] = sum(s.sampleValue.uiVal for s in fresh) / len(fresh) / 100.0
        elif not samples:
            self._last_util[i] = nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        return self._last_util[i]

    def _process_utilization(self, k: int, h: Any) -> tuple[dict[int, frozenset[Engine]], dict[int, float] | None]:
        """Which engines each process used (graphics: NVML lists it; decode and encode: its samples show them), and
        each sampled pid's SM busy fraction, averaged over the samples since the previous query (None when the query
        failed)."""
        nvml = self._nvml
        engines: dict[int, set[Engine]] = {}
        try:
            for p in nvml.nvmlDeviceGetGraphicsRunningProcesses(h):
                engines.setdefault(int(p.pid), set()).add(Engine.GRAPHICS)
        except nvml.NVMLError:
            pass
        sm: dict[int, list[float]] | None = {}
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(h, self._process_ts[k])
        except nvml.NVMLError_NotFound:
            samples = []  # no process has a sample since then
        except nvml.NVMLError:
            samples, sm = [], None
        for s in samples:
            pid = int(s.pid)
            if s.decUtil > 0:
                engines.setdefault(pid, set()).add(Engine.DECODE)
            if s.encUtil > 0:
                engines.setdefault(pid, set()).add(Engine.ENCODE)
            if sm is not None:
                sm.setdefault(pid, []).append(s.smUtil / 100.0)
            self._process_ts[k] = max(self._process_ts[k], int(s.timeStamp))
        return ({pid: frozenset(e) for pid, e in engines.items()},
                None if sm is None else {pid: sum(v) / len(v) for pid, v in sm.items()})

    def _process_memory(self, h: Any) -> tuple[dict[int, int], frozenset[int] | None]:
        """GPU memory per listed pid, and every pid listed with a context (None when a list failed)."""
        nvml = self._nvml
        out: dict[int, int] = {}
        pids: set[int] | None = set()
        for query in (nvml.nvmlDeviceGetGraphicsRunningProcesses, nvml.nvmlDeviceGetComputeRunningProcesses):
            try:
                for p in query(h):
                    if pids is not None:
                        pids.add(int(p.pid))
                    used = p.usedGpuMemory
                    if isinstance(used, int):  # None when the driver does not say
                        out[int(p.pid)] = max(out.get(int(p.pid), 0), used)
            except nvml.NVMLError:
                pids = None
        return out, None if pids is None else frozenset(pids)

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()
