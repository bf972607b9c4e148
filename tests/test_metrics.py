"""Prometheus exposition: the collector over engine snapshots, and /metrics served by a real daemon."""

from __future__ import annotations

import asyncio
import os
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, cli, wait_until
from inproc import free_port, in_process_server
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.seccomp.hooks import FakeSessionHooks
from unisched.enforce.seccomp.stats import HookCounts
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample
from unisched.transport.client import DaemonClient
from unisched.transport.metrics import EngineView, MetricsServer, UnischedCollector
from unisched_wire import unisched_pb2 as pb

GiB = 1 << 30


Samples = list[tuple[str, dict[str, str], float]]


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def _get(samples: Samples, name: str, /, **labels: str) -> float | None:
    """The value of the one sample of `name` whose labels include `labels` (None: no such sample)."""
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else None


def _registry_samples(registry: CollectorRegistry) -> Samples:
    return [(s.name, dict(s.labels), s.value) for family in registry.collect() for s in family.samples]


def test_metrics_endpoint_reports_a_registered_tenant(tmp_path: Path) -> None:
    port = free_port()
    with in_process_server(tmp_path / "state", metrics_port=port) as srv:
        with DaemonClient(srv.socket) as c:
            c.register(pb.RegisterRequest(tenant="web", weight=250, engines=["compute", "decode"]))
        m = wait_until(lambda: s if _get(s := _scrape(port), "unisched_tenant_weight", tenant="web") else None,
                       10, "the tenant in /metrics")
        assert _get(m, "unisched_tenant_weight", tenant="web", namespace="", pod="", container="") == 250
        assert _get(m, "unisched_tenant_base_weight", tenant="web") == 250
        assert _get(m, "unisched_tenants") == 1
        # one series per contention domain the tenant uses (no GPU here: GPU 0 stands in, with no UUID)
        for domain in ("sm", "nvdec"):
            where = {"tenant": "web", "gpu": "0", "UUID": "", "domain": domain}
            assert _get(m, "unisched_tenant_target_share_ratio", **where) is not None
            assert _get(m, "unisched_tenant_measured_share_ratio", **where) is not None
            assert _get(m, "unisched_tenant_gpu_seconds_total", **where) is not None
        assert sum(_get(m, "unisched_tenant_state", tenant="web", state=st) or 0 for st in ("running", "idle", "frozen")) == 1
        assert _get(m, "unisched_tenant_state", tenant="web", state="frozen") == 0  # a tenant alone is never frozen
        assert _get(m, "unisched_tenant_slices_total", tenant="web") is not None
        assert _get(m, "unisched_tenant_processes", tenant="web") == 1  # this test process
        assert _get(m, "unisched_tenant_over_memory", tenant="web") == 0
        assert _get(m, "unisched_tenant_memory_seen_bytes", tenant="web") == 0
        assert (_get(m, "unisched_view_age_seconds") or 0) < 5
        assert any(n == "unisched_build_info" for n, _, _ in m)
        assert not any(n in ("unisched_tenant_frozen", "unisched_gpu_utilization") for n, _, _ in m)  # old names

        # a change shows within a refresh (the collector reads a copy the loop refreshes every second)
        with DaemonClient(srv.socket) as c:
            c.set_weight("web", 400)
        wait_until(lambda: _get(_scrape(port), "unisched_tenant_weight", tenant="web") == 400, 10, "weight 400")


def test_metrics_are_off_by_default(tmp_path: Path) -> None:
    assert DaemonConfig().metrics_port == 0
    port = free_port()
    with in_process_server(tmp_path / "state"), pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_metrics_port_in_use_fails_with_the_address(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"), \
                in_process_server(tmp_path / "state", metrics_port=port):
            pass


def _engine_with_gpu(tmp_path: Path) -> tuple[Scheduler, FakeCgroupDriver, FakeClock, FakeTelemetry]:
    telemetry = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-0000", 141 * GiB)])
    telemetry.next_samples = [GpuSample(0, sm_util=0.99, dec_util=0.25, enc_util=0.0, memory_used=10 * GiB)]
    driver, clock = FakeCgroupDriver(), FakeClock()
    engine = Scheduler(DaemonConfig(slice_ms=50), driver, telemetry, StateStore(tmp_path / "state"), clock)
    engine.start()
    return engine, driver, clock, telemetry


def _run_busy(engine: Scheduler, driver: FakeCgroupDriver, clock: FakeClock, names: tuple[str, ...],
              ticks: int) -> None:
    """Tick the engine with every named tenant busy: each burns CPU while thawed."""
    for _ in range(ticks):
        delay = engine.tick()
        for name in names:
            g = driver.groups[f"/unisched/{name}"]
            if not g.frozen:
                g.cpu_s += delay
        clock.advance(delay)


def _registry(engine: Scheduler) -> CollectorRegistry:
    """A registry whose collector reads a View of the engine taken now."""
    view = EngineView(engine)
    view.refresh()
    registry = CollectorRegistry()
    registry.register(UnischedCollector(view))
    return registry


def test_collector_numbers_follow_the_engine(tmp_path: Path) -> None:
    engine, driver, clock, _ = _engine_with_gpu(tmp_path)
    engine.register("a", 300, None, (), (), 1001, 0, True)
    engine.register("b", 100, None, (), (), 1002, 0, True)
    engine.set_limits("a", render=0, decode=None, encode=None, memory_bytes=8 * GiB)
    assert not engine.admit_session("a", "graphics", 0xC197)  # refused: render cap 0
    assert engine.admit_session("b", "compute", 0xC6C0)
    _run_busy(engine, driver, clock, ("a", "b"), 600)
    samples = _registry_samples(_registry(engine))

    def value(metric: str, /, **labels: str) -> float | None:
        return _get(samples, metric, **labels)

    assert value("unisched_tenant_weight", tenant="a") == 300
    assert value("unisched_tenant_target_share_ratio", tenant="a", gpu="0", UUID="GPU-0000", domain="sm") == \
        pytest.approx(0.75)
    assert value("unisched_tenant_target_share_ratio", tenant="b", gpu="0", domain="sm") == pytest.approx(0.25)
    assert value("unisched_tenant_measured_share_ratio", tenant="a", gpu="0", domain="sm") == pytest.approx(0.75, abs=0.05)
    snaps = {s.name: s for s in engine.snapshots()}
    for name in ("a", "b"):
        # GPU time by GPU and domain: here all of it on GPU 0's SMs
        assert snaps[name].gpu_seconds > 0
        assert value("unisched_tenant_gpu_seconds_total", tenant=name, gpu="0", UUID="GPU-0000", domain="sm") == \
            pytest.approx(snaps[name].gpu_seconds)
        # the same time by how each charge came (rule and source): every second of it, each one way
        charged = [(ls["rule"], ls["source"], v) for n, ls, v in samples if n == "unisched_tenant_charged_seconds_total"
                   and ls["tenant"] == name and ls["gpu"] == "0" and ls["UUID"] == "GPU-0000" and ls["domain"] == "sm"]
        assert sum(v for *_, v in charged) == pytest.approx(snaps[name].gpu_seconds)
        assert {rule for rule, _, _ in charged} == {"signal"} and ("signal", "beside-drain") in {c[:2] for c in charged}
        assert value("unisched_tenant_slices_total", tenant=name) == snaps[name].slices > 0
        assert value("unisched_tenant_state", tenant=name, state=snaps[name].state) == 1
    assert value("unisched_tenant_session_refusals_total", tenant="a", kind="graphics") == 1
    assert value("unisched_tenant_sessions", tenant="b", kind="compute") == 1
    assert value("unisched_tenant_session_cap", tenant="a", kind="render") == 0
    assert value("unisched_tenant_memory_cap_bytes", tenant="a") == 8 * GiB
    assert value("unisched_tenant_memory_cap_bytes", tenant="b") is None  # no cap: no series
    # per GPU, per engine
    assert value("unisched_gpu_info", gpu="0", UUID="GPU-0000", modelName="NVIDIA H200") == 1
    assert value("unisched_gpu_utilization_ratio", gpu="0", UUID="GPU-0000", engine="sm") == pytest.approx(0.99)
    assert value("unisched_gpu_sliced", gpu="0", domain="sm") == 1  # saturated: the two take turns
    # the busy time charged, by the rule that split it: here by CPU activity (no per-process samples), all of it
    assert value("unisched_gpu_charged_seconds_total", gpu="0", UUID="GPU-0000", domain="sm", rule="signal") == \
        pytest.approx(sum(s.gpu_seconds for s in snaps.values()), rel=0.01)
    assert value("unisched_gpu_charged_seconds_total", gpu="0", domain="sm", rule="process-rate") is None
    assert value("unisched_gpu_open_hold_seconds", gpu="0", domain="sm") == 0
    assert value("unisched_gpu_utilization_ratio", gpu="0", engine="dec") == pytest.approx(0.25)
    assert value("unisched_gpu_utilization_ratio", gpu="0", engine="enc") == 0
    assert value("unisched_gpu_memory_used_bytes", gpu="0") == 10 * GiB
    assert value("unisched_gpu_memory_total_bytes", gpu="0") == 141 * GiB
    assert value("unisched_gpu_sample_ok", gpu="0") == 1


def test_the_hooks_answers_are_exported_per_tenant_with_its_labels(tmp_path: Path) -> None:
    engine, driver, *_ = _engine_with_gpu(tmp_path)
    driver.create("/kubepods/pod1")
    engine.adopt("a", 300, None, "/kubepods/pod1", (), (), labels={"namespace": "ns", "pod": "p", "container": "c"})
    hooks = FakeSessionHooks()
    for tenant in ("a", "gone"):  # "gone": a listener served for a tenant the engine no longer has
        r, w = os.pipe()
        os.close(w)
        hooks.attach(r, tenant, 0)
    hooks.answered["a"] = HookCounts("a", 131, 2, 0.0075, 4, 0.0031, 0.0042, 7, 0.0123)
    view = EngineView(engine, hooks)
    view.refresh()
    registry = CollectorRegistry()
    registry.register(UnischedCollector(view))
    samples = _registry_samples(registry)
    where = {"tenant": "a", "namespace": "ns", "pod": "p", "container": "c"}
    assert _get(samples, "unisched_tenant_hook_calls_total", **where) == 131
    assert _get(samples, "unisched_tenant_hook_answer_seconds_total", **where) == pytest.approx(0.0075)
    assert _get(samples, "unisched_tenant_hook_errors_total", **where) == 2
    assert _get(samples, "unisched_tenant_hook_decisions_total", **where) == 4
    assert _get(samples, "unisched_tenant_hook_decision_seconds_total", **where) == pytest.approx(0.0031)
    assert _get(samples, "unisched_tenant_hook_send_seconds_total", **where) == pytest.approx(0.0042)
    assert _get(samples, "unisched_tenant_hook_paced_total", **where) == 7
    assert _get(samples, "unisched_tenant_hook_paced_seconds_total", **where) == pytest.approx(0.0123)
    assert _get(samples, "unisched_tenant_hook_calls_total", tenant="gone", namespace="") == 0
    assert _get(_registry_samples(_registry(engine)), "unisched_tenant_hook_calls_total", tenant="a") is None  # no hooks


def test_a_scrape_reads_the_copy_not_the_live_engine(tmp_path: Path) -> None:
    """Between refreshes the engine may change; a scrape sees the last consistent copy."""
    engine, *_ = _engine_with_gpu(tmp_path)
    engine.register("a", 300, None, (), (), 1001, 0, True)
    view = EngineView(engine)
    view.refresh()
    registry = CollectorRegistry()
    registry.register(UnischedCollector(view))
    engine.register("late", 100, None, (), (), 1002, 0, True)
    engine.set_weight("a", 500)
    assert _get(_registry_samples(registry), "unisched_tenant_weight", tenant="a") == 300
    assert _get(_registry_samples(registry), "unisched_tenant_weight", tenant="late") is None
    view.refresh()
    assert _get(_registry_samples(registry), "unisched_tenant_weight", tenant="a") == 500
    assert _get(_registry_samples(registry), "unisched_tenants") == 2


def test_serve_metrics_port_flag(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The real daemon from the command line (root, real cgroups) with --metrics-port."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    assert d.cli("run", "--tenant", f"{d.prefix}m", "--weight", "250", "--keep", "--", "true").returncode == 0
    m = wait_until(lambda: s if _get(s := _scrape(port), "unisched_tenant_weight", tenant=f"{d.prefix}m") else None,
                   10, "the tenant in /metrics")
    assert _get(m, "unisched_tenant_weight", tenant=f"{d.prefix}m") == 250
    assert _get(m, "unisched_tenant_state", tenant=f"{d.prefix}m", state="frozen") == 0


def test_a_hooked_run_s_calls_are_counted_in_the_metrics(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The real daemon's hooks (seccomp on /dev/null standing in for /dev/nvidiactl): every notified RM call of a
    `unisched run` is counted, with the time to its answer; an ioctl the filter does not notify is not."""
    from unisched.enforce.seccomp.abi import probe

    if (why := probe()) is not None:
        pytest.skip(f"seccomp user notification: {why}")
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    tenant = f"{d.prefix}hk"
    calls = [f"alloc:{cls:#x}:{0x100 + i:#x}" for i, cls in enumerate([0xC86F, 0xC8B5, 0xA06C, 0x0040, 0xCBC0])]
    run = d.cli("run", "--tenant", tenant, "--keep", "--", sys.executable, str(ROOT / "tests" / "nv_ioctls.py"),
                *calls, "free:0x100", "control:0x100")
    assert run.returncode == 0, run.stderr
    m = wait_until(lambda: s if _get(s := _scrape(port), "unisched_tenant_hook_calls_total", tenant=tenant) else None,
                   10, "the hooked calls in /metrics")
    assert _get(m, "unisched_tenant_hook_calls_total", tenant=tenant) == 6  # 5 allocations and the free
    answer_s = _get(m, "unisched_tenant_hook_answer_seconds_total", tenant=tenant) or 0
    assert 0 < answer_s < 5
    # the compute object (0xCBC0, a new session) alone is admitted by the event loop
    assert _get(m, "unisched_tenant_hook_decisions_total", tenant=tenant) == 1
    assert 0 < (_get(m, "unisched_tenant_hook_decision_seconds_total", tenant=tenant) or 0) <= answer_s
    assert 0 < (_get(m, "unisched_tenant_hook_send_seconds_total", tenant=tenant) or 0) < 5
    assert _get(m, "unisched_tenant_hook_errors_total", tenant=tenant) == 0


def test_metrics_port_out_of_range_is_a_config_error(tmp_path: Path) -> None:
    out = cli("serve", "--metrics-port", "70000", "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path))
    assert out.returncode == 2 and "'metrics_port': must be an integer in 0..65535; got 70000" in out.stderr


def test_a_failed_refresh_keeps_the_last_view_and_retries(tmp_path: Path) -> None:
    engine, *_ = _engine_with_gpu(tmp_path)
    view = EngineView(engine)
    first = view.refresh()
    stop = asyncio.Event()
    calls = 0

    def broken() -> list[object]:
        nonlocal calls
        calls += 1
        if calls == 3:
            stop.set()
        raise RuntimeError("boom")

    engine.snapshots = broken  # type: ignore[method-assign,assignment]
    asyncio.run(asyncio.wait_for(view.run(stop, interval=0.001), timeout=10))
    assert calls == 3 and view.current is first


def test_mixed_slices_are_exported(tmp_path: Path) -> None:
    """A GPU whose calibration measured a partial overlap (the H200's trainer + render: 0.22 / 0.92), both sides
    busy at 1:1: the mix's fractions and the kind running now."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "contention.json").write_text(
        '{"version": 1, "gpus": {"NVIDIA H200": {"compute_kept": 0.22, "graphics_kept": 0.92}}}')
    engine, driver, clock, telemetry = _engine_with_gpu(tmp_path)
    telemetry.next_samples = [GpuSample(0, sm_util=1.0, dec_util=0.0, enc_util=0.0, memory_used=0)]
    engine.register("cuda", 100, None, ("compute",), (), 1001, 0, True)
    engine.register("render", 100, None, ("graphics",), (), 1002, 0, True)
    _run_busy(engine, driver, clock, ("cuda", "render"), 60)
    samples = _registry_samples(_registry(engine))
    mix, kind = engine.mixed_slices(0) or (None, None)
    assert mix is not None and kind is not None
    assert _get(samples, "unisched_gpu_mixed_time_ratio", gpu="0", UUID="GPU-0000", kind="both") == \
        pytest.approx(mix.both) == pytest.approx(0.641, abs=1e-3)
    assert _get(samples, "unisched_gpu_mixed_time_ratio", gpu="0", kind="graphics") == 0.0
    assert _get(samples, "unisched_gpu_mixed_now", gpu="0", kind=kind.value) == 1.0


def _served(tmp_path: Path, read_timeout_s: float) -> MetricsServer:
    """A metrics server on a free port over an engine with a GPU, its connections' read timeout `read_timeout_s`."""
    from unisched.transport.metrics import start_metrics_server

    engine, *_ = _engine_with_gpu(tmp_path)
    view = EngineView(engine)
    view.refresh()
    return start_metrics_server("127.0.0.1", 0, view, read_timeout_s=read_timeout_s)


def test_an_idle_metrics_connection_is_closed_at_the_read_timeout(tmp_path: Path) -> None:
    import socket

    server = _served(tmp_path, 0.2)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            assert s.recv(1) == b""  # closed by the daemon, not left holding a thread
    finally:
        server.close()


def test_a_metrics_client_that_sends_its_request_a_byte_at_a_time_is_closed_at_the_read_timeout(tmp_path: Path) -> None:
    """Each read's timeout alone never closes a client that sends a byte now and then, so a few such clients
    held every connection slot (and the daemon's probes with them): the whole request has its deadline."""
    import select
    import socket
    import time

    server = _served(tmp_path, 0.3)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            give_up = time.monotonic() + 20
            closed = False
            while not closed and time.monotonic() < give_up:
                try:
                    s.sendall(b"X")  # a header that never ends, a byte at a time
                except OSError:
                    closed = True
                    break
                readable, _, _ = select.select([s], [], [], 0.05)
                closed = bool(readable) and s.recv(1 << 16) == b""
            assert closed, "a dribbling client kept its connection"
    finally:
        server.close()
