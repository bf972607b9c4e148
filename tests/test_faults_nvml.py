"""The engine and the NVML telemetry when NVML fails: errors mid-run, a GPU lost before start or mid-run. No GPU
here: a stub NVML module and fake telemetry drive the real engine code."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from test_engine import SLICE, Rig

from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample
from unisched.telemetry.nvml import PROCESS_POLL_EVERY, NvmlTelemetry, open_nvml


# --- NVML errors mid-run ---------------------------------------------------------------------------------------
class FlakyTelemetry(FakeTelemetry):
    """FakeTelemetry that can raise (a telemetry must not, but the slice loop must survive one that does)."""

    def __init__(self) -> None:
        super().__init__([GpuInfo(0, "NVIDIA H200", "GPU-0", 1 << 30)])
        self.error: Exception | None = None

    def sample(self) -> Any:
        if self.error is not None:
            raise self.error
        return super().sample()


def test_engine_slices_on_when_telemetry_fails(tmp_path: Path) -> None:
    tel = FlakyTelemetry()
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("a", 300)
    rig.add("b", 100)

    def phase(steps: int) -> tuple[float, float]:
        a0, b0, g0 = rig.cpu("a"), rig.cpu("b"), sum(s.gpu_seconds for s in rig.engine.snapshots())
        rig.step(steps)
        return (rig.cpu("a") - a0) / (rig.cpu("b") - b0), sum(s.gpu_seconds for s in rig.engine.snapshots()) - g0

    tel.next_samples = [GpuSample(0, 0.9, 0.0, 0.0, 0)]
    _, gpu_s = phase(200)
    assert gpu_s == pytest.approx(0.9 * 200 * SLICE, rel=0.05)
    with capture_logs() as logs:
        tel.error = RuntimeError("NVML: GPU is lost (Xid 79)")
        ratio, _ = phase(400)  # tick() must not raise
        assert ratio == pytest.approx(3.0, rel=0.1), "without a GPU signal the CPU stand-in must keep the weights"
        tel.error = None
        tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0, ok=False)]  # a telemetry that says the GPU is unknown
        ratio, _ = phase(400)
        assert ratio == pytest.approx(3.0, rel=0.1)
        tel.next_samples = [GpuSample(0, 0.9, 0.0, 0.0, 0)]
        ratio, gpu_s = phase(400)
    assert ratio == pytest.approx(3.0, rel=0.1)
    assert gpu_s == pytest.approx(0.9 * 400 * SLICE, rel=0.05), "GPU charging did not resume"
    said = [e["event"] for e in logs if "telemetry" in e["event"]]
    assert said == ["telemetry failed; slicing on CPU signals until it recovers", "telemetry recovered"]


class StubNvml(types.SimpleNamespace):
    """Enough of pynvml for NvmlTelemetry: two H200s; `fail[gpu]` makes every call on that GPU raise."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):  # pynvml's names
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    class NVMLError_Unknown(NVMLError):  # what an Xid often surfaces as
        pass

    NVML_GPU_UTILIZATION_SAMPLES = 1

    def __init__(self) -> None:
        super().__init__()
        self.fail: dict[int, Exception] = {}
        self.count_error: Exception | None = None
        self.ts = 0

    def _check(self, h: int) -> None:
        if h in self.fail:
            raise self.fail[h]

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise self.count_error
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._check(i)
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        self._check(h)
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self._check(h)
        return types.SimpleNamespace(total=141 << 30, used=(1 + h) << 30)

    def nvmlDeviceGetSamples(self, h: int, kind: int, since: int) -> Any:
        self._check(h)
        self.ts += 1000
        return kind, [types.SimpleNamespace(timeStamp=self.ts, sampleValue=types.SimpleNamespace(uiVal=60))]

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._check(h)
        return types.SimpleNamespace(gpu=60)

    def nvmlDeviceGetDecoderUtilization(self, h: int) -> tuple[int, int]:
        self._check(h)
        return 10, 167000

    def nvmlDeviceGetEncoderUtilization(self, h: int) -> tuple[int, int]:
        raise self.NVMLError_NotSupported("no NVENC")

    def nvmlDeviceGetEncoderSessions(self, h: int) -> list[Any]:
        raise self.NVMLError_NotSupported("no NVENC")

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        self._check(h)
        return []

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._check(h)
        return []

    def nvmlDeviceGetProcessUtilization(self, h: int, since: int) -> list[Any]:
        self._check(h)
        return []

    def nvmlInit(self) -> None:
        return None

    def nvmlShutdown(self) -> None:
        return None


def test_nvml_errors_give_unknown_samples_and_recover() -> None:
    nvml = StubNvml()
    tel = NvmlTelemetry(nvml)
    assert [(s.index, s.ok, s.sm_util) for s in tel.sample()] == [(0, True, 0.6), (1, True, 0.6)]
    with capture_logs() as logs:
        for error in (StubNvml.NVMLError_GpuIsLost("GPU is lost"), StubNvml.NVMLError_Unknown("Unknown Error"),
                      RuntimeError("a binding that raises something else")):
            nvml.fail[1] = error
            for _ in range(3):
                got = tel.sample()  # must not raise
                assert [(s.index, s.ok) for s in got] == [(0, True), (1, False)]
                assert got[1].sm_util == 0.0 and got[0].sm_util == 0.6
        del nvml.fail[1]
        got = tel.sample()
    assert [(s.index, s.ok, s.sm_util, s.memory_used) for s in got] == [(0, True, 0.6, 1 << 30), (1, True, 0.6, 2 << 30)]
    said = [(e["event"], e.get("gpu")) for e in logs]
    assert said == [("nvml error, GPU treated as unknown", 1), ("nvml recovered", 1)], said


def test_nvml_lists_the_pids_with_a_gpu_context_or_says_it_cannot() -> None:
    nvml = StubNvml()
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=41, usedGpuMemory=None)]  # type: ignore[method-assign]
    assert [s.gpu_pids for s in NvmlTelemetry(nvml).sample()] == [frozenset({41})] * 2  # listed, memory unknown

    def refuse(h: int) -> list[Any]:
        raise StubNvml.NVMLError_NotSupported("not in this VM")
    nvml.nvmlDeviceGetGraphicsRunningProcesses = refuse  # type: ignore[method-assign]
    assert [s.gpu_pids for s in NvmlTelemetry(nvml).sample()] == [None, None]  # one list failed: unknown


def test_nvml_gives_each_sampled_pids_sm_busy_since_its_last_query() -> None:
    """Per-process SM busy fractions are the mean of the samples newer than the previous query's (NVML is asked
    from that timestamp on); a pid with no sample is left out (unknown); a failed query says unknown (None), and
    one that finds no sample says nobody was sampled ({})."""
    nvml = StubNvml()
    asked: list[int] = []
    batches: list[Any] = [
        [(7, 10, 40), (7, 20, 60), (8, 20, 10)],  # pid, timestamp, smUtil %
        [(7, 30, 90)],
        StubNvml.NVMLError_NotFound("no samples"),
        StubNvml.NVMLError_NotSupported("not in this VM"),
    ]

    def utilization(h: int, since: int) -> list[Any]:
        if h == 0:
            asked.append(since)
        got = batches[0] if h == 0 else []
        if isinstance(got, Exception):
            raise got
        return [types.SimpleNamespace(pid=p, timeStamp=t, smUtil=u, memUtil=0, encUtil=0, decUtil=0)
                for p, t, u in got]
    nvml.nvmlDeviceGetProcessUtilization = utilization  # type: ignore[method-assign]
    tel = NvmlTelemetry(nvml)
    seen = []
    while batches:
        seen.append(tel.sample()[0].process_sm)
        for _ in range(PROCESS_POLL_EVERY - 1):  # the samples between per-process queries carry the last one's
            assert tel.sample()[0].process_sm == seen[-1]
        batches.pop(0)
    assert seen == [{7: pytest.approx(0.5), 8: pytest.approx(0.1)}, {7: pytest.approx(0.9)}, {}, None]
    assert asked == [0, 20, 30, 30]


def test_nvml_gpu_lost_before_start(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = StubNvml()
    nvml.fail[0] = StubNvml.NVMLError_GpuIsLost("GPU is lost")
    tel = NvmlTelemetry(nvml)  # the daemon starts with the GPU that is left
    assert [g.index for g in tel.gpus()] == [1]
    assert [(s.index, s.ok) for s in tel.sample()] == [(1, True)]
    broken = StubNvml()
    broken.count_error = StubNvml.NVMLError_Unknown("Unknown Error")
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert open_nvml() is None  # CPU signals instead of a daemon that does not start


def test_engine_with_nvml_losing_a_gpu_mid_run(tmp_path: Path) -> None:
    nvml = StubNvml()
    rig = Rig(tmp_path, telemetry=NvmlTelemetry(nvml))
    rig.add("a", 300)
    rig.add("b", 100)
    rig.step(50)
    nvml.fail[0] = StubNvml.NVMLError_GpuIsLost("GPU is lost")
    nvml.fail[1] = StubNvml.NVMLError_Unknown("Xid 13")
    a0, b0 = rig.cpu("a"), rig.cpu("b")
    rig.step(400)
    assert (rig.cpu("a") - a0) / (rig.cpu("b") - b0) == pytest.approx(3.0, rel=0.1)
    nvml.fail.clear()
    rig.step(50)
    assert all(s.ok for s in rig.engine.gpu_samples())
