"""Each tenant's GPU seconds per CPU second (scheduler.rates), taken once a second from NVML's per-process samples,
against fake cgroups, fake telemetry and an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs
from test_engine import SLICE, Rig

from unisched.policy.tuning import TUNING
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.tenant import Tenant
from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample


def rates(t: Tenant) -> dict[int, float]:
    """A tenant's rates per GPU, without when they were taken."""
    return {i: rate for i, (rate, _) in t.gpu_rates.items()}


def test_a_tenants_rate_is_its_processes_gpu_busy_over_its_cpu(tmp_path: Path) -> None:
    """a's one process shows 0.3 of the GPU on half a core (0.6 GPU seconds a CPU second); b is not in NVML's
    samples (unknown, not idle); c used too little CPU for a ratio. Rates are taken over the second before, so
    none exists until two checks have passed; once NVML shows nothing, a's stands for Tuning.rate_keep_s."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000, saturated_util=1.0), telemetry=tel)
    for name in "abc":
        rig.add(name, 100, engines=("graphics",))
    tenants = rig.engine._c.tenants
    for name in "abc":
        tenants[name].hooked = True  # under the session hooks (`unisched run`)
    rig.rate.update({"a": 0.5, "b": 0.5, "c": 0.001})
    pid = {n: rig.driver.groups[f"/unisched/{n}"].pids[0] for n in "abc"}
    tel.next_samples = [GpuSample(0, 0.5, 0.0, 0.0, 0, process_sm={pid["a"]: 0.3, pid["c"]: 0.2, 99999: 0.9})]
    rig.step(2)
    assert all(not t.gpu_rates for t in tenants.values())  # one check: nothing to take a rate over yet
    rig.step(int(3.0 / SLICE))
    assert rates(tenants["a"]) == {0: pytest.approx(0.6, rel=0.05)}
    assert tenants["b"].gpu_rates == {} and tenants["c"].gpu_rates == {}
    tel.next_samples = [GpuSample(0, 0.5, 0.0, 0.0, 0, process_sm=None)]  # NVML cannot say any more
    rig.step(int(1.5 / SLICE))
    assert rates(tenants["a"]) == {0: pytest.approx(0.6, rel=0.05)}  # kept a while (Tuning.rate_keep_s)
    rig.step(int(TUNING.rate_keep_s / SLICE))
    assert tenants["a"].gpu_rates == {}


@pytest.mark.parametrize("why", ["no hooks", "a compute context", "declared compute"])
def test_a_tenant_whose_gpu_work_nvml_may_not_see_gets_no_rate(tmp_path: Path, why: str) -> None:
    """NVML leaves CUDA processes out of its samples on the H200: a tenant running CUDA beside a small render would
    show the render's rate alone and pay for little of its GPU time. So a tenant outside the session hooks (whose
    contexts nobody counts), one whose hooks count a compute context, and one declared compute get none."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000, saturated_util=1.0), telemetry=tel)
    rig.add("a", 100, engines=("compute", "graphics") if why == "declared compute" else ("graphics",))
    t = rig.engine._c.tenants["a"]
    t.hooked = why != "no hooks"
    if why == "a compute context":
        t.sessions["compute"] = 1
    rig.rate["a"] = 0.5
    pid = rig.driver.groups["/unisched/a"].pids[0]
    tel.next_samples = [GpuSample(0, 0.5, 0.0, 0.0, 0, process_sm={pid: 0.05})]
    rig.step(int(3.0 / SLICE))
    assert t.gpu_rates == {}


def test_each_tenants_rate_or_why_it_has_none_is_logged(tmp_path: Path) -> None:
    """At --log-level debug each check logs how many pids NVML's samples showed and, per tenant, its rate with the
    busy and cores it came from, or why it has none: what tells, on a real GPU, whether the split used the rates."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000, saturated_util=1.0), telemetry=tel)
    rig.add("a", 100, engines=("graphics",))
    rig.add("b", 100, engines=("graphics",))
    rig.engine._c.tenants["a"].hooked = True
    rig.rate.update({"a": 0.5, "b": 0.5})
    pid = rig.driver.groups["/unisched/a"].pids[0]
    tel.next_samples = [GpuSample(0, 0.5, 0.0, 0.0, 0, process_sm={pid: 0.3, 99999: 0.9})]
    with capture_logs() as logs:
        rig.step(int(3.0 / SLICE))
    lines = [e for e in logs if e["event"] == "rates"]
    assert len(lines) >= 2
    last = lines[-1]
    assert last["sampled"] == {0: 2}
    assert last["tenants"]["b"] == "not visible"
    assert last["tenants"]["a"]["rates"][0] == [pytest.approx(0.6, rel=0.05), 0.0]  # rate, and its age
    assert last["tenants"]["a"]["busy"] == {0: 0.3}
