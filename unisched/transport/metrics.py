"""Prometheus exposition: a collector over the engine's one snapshot type, served by prometheus-client.

The HTTP server runs in prometheus-client's own thread, so a scrape never waits on the asyncio loop; the
engine is only touched on the loop. `EngineView.run()` (an asyncio task beside the engine) copies the
tenant snapshots and the GPU samples into one immutable `View` every second, and the collector reads
whichever `View` is current when the scrape comes (one attribute read: a consistent copy, no lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from unisched import __version__
from unisched.engine.core import Scheduler, TenantSnapshot
from unisched.policy.overlap import OverlapMix, SliceKind
from unisched.policy.saturation import GateState
from unisched.telemetry import GpuInfo, GpuSample

__all__ = ["REFRESH_S", "EngineView", "MetricsServer", "UnischedCollector", "View", "start_metrics_server"]

log = structlog.get_logger("unisched.metrics")

REFRESH_S = 1.0
_STATES = ("running", "idle", "frozen")


@dataclass(frozen=True)
class View:
    """What a scrape reports: copies taken on the engine's loop at `taken` (time.monotonic())."""

    tenants: tuple[TenantSnapshot, ...]
    gpus: tuple[GpuInfo, ...]
    samples: tuple[GpuSample, ...]
    gates: tuple[GateState, ...]
    mixes: tuple[tuple[int, OverlapMix, SliceKind], ...]
    """Per GPU that mixes slices now (partly overlapping compute + graphics): its mix and the kind running."""
    mode: str
    taken: float


class EngineView:
    """The latest View of an engine. refresh() runs on the engine's loop; `current` is read from any thread."""

    def __init__(self, engine: Scheduler) -> None:
        self.engine = engine
        self.current: View | None = None

    def refresh(self) -> View:
        view = View(
            tenants=tuple(self.engine.snapshots()),
            gpus=tuple(self.engine.telemetry.gpus()),
            samples=tuple(self.engine.gpu_samples()),
            gates=self.engine.gate_states(),
            mixes=tuple((g, *m) for g in self.engine.gpu_indices if (m := self.engine.mixed_slices(g)) is not None),
            mode=self.engine.config.mode.value,
            taken=time.monotonic(),
        )
        self.current = view  # one reference swap: a reader sees the old View or the new one, never a mix
        return view

    async def run(self, stop: asyncio.Event, interval: float = REFRESH_S) -> None:
        """Refresh every `interval` seconds until `stop` is set; a failed refresh keeps the last View (its age
        shows in unisched_view_age_seconds) and is tried again next time."""
        while not stop.is_set():
            try:
                self.refresh()
            except Exception:
                log.exception("metrics refresh failed; serving the previous values")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)


class UnischedCollector(Collector):
    """Turns the current View into metric families at scrape time (nothing is kept between scrapes)."""

    def __init__(self, view: EngineView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        view = self.view.current
        info = GaugeMetricFamily("unisched_build_info", "unisched version (always 1)", labels=["version", "mode"])
        info.add_metric([__version__, view.mode if view else ""], 1.0)
        yield info
        if view is None:
            return
        age = GaugeMetricFamily("unisched_view_age_seconds", "Age of the engine state this scrape reports "
                                                             "(it grows when the daemon's loop is stuck)")
        age.add_metric([], max(0.0, time.monotonic() - view.taken))
        yield age
        count = GaugeMetricFamily("unisched_tenants", "Tenants known to the daemon")
        count.add_metric([], float(len(view.tenants)))
        yield count
        yield from _tenant_metrics(view.tenants)
        yield from _gpu_metrics(view.gpus, view.samples)
        yield from _gate_metrics(view.gates, self.view.engine.config.slice_ms / 1000.0)
        yield from _mix_metrics(view.mixes)


def _tenant_metrics(tenants: Sequence[TenantSnapshot]) -> Iterator[Metric]:
    t_ = ["tenant"]
    weight = GaugeMetricFamily("unisched_tenant_weight", "Weight in effect (after tidal schedules)", labels=t_)
    base = GaugeMetricFamily("unisched_tenant_base_weight", "Configured weight", labels=t_)
    target = GaugeMetricFamily("unisched_tenant_target_share", "Share the tenant is entitled to now (0..1) "
                               "per contention domain", labels=["tenant", "gpu", "domain"])
    measured = GaugeMetricFamily("unisched_tenant_measured_share", "Share the tenant got over the share window "
                                 "(0..1) per contention domain", labels=["tenant", "gpu", "domain"])
    seconds = CounterMetricFamily("unisched_tenant_gpu_seconds", "GPU seconds charged to the tenant", labels=t_)
    slices = CounterMetricFamily("unisched_tenant_slices", "Slices the tenant was given", labels=t_)
    refusals = CounterMetricFamily("unisched_tenant_session_refusals", "Sessions (and memory-cap crossings, "
                                   "kind=memory) refused", labels=["tenant", "kind"])
    sessions = GaugeMetricFamily("unisched_tenant_sessions", "Live GPU sessions by kind", labels=["tenant", "kind"])
    caps = GaugeMetricFamily("unisched_tenant_session_cap", "Session cap in effect (absent: unlimited)",
                             labels=["tenant", "kind"])
    frozen = GaugeMetricFamily("unisched_tenant_frozen", "1 while the tenant's cgroup is frozen", labels=t_)
    state = GaugeMetricFamily("unisched_tenant_state", "1 for the tenant's state (running, idle, frozen)",
                              labels=["tenant", "state"])
    memory = GaugeMetricFamily("unisched_tenant_memory_bytes", "GPU memory NVML reports for the tenant's "
                               "processes", labels=t_)
    memory_cap = GaugeMetricFamily("unisched_tenant_memory_cap_bytes", "GPU memory cap (absent: none)", labels=t_)
    over = GaugeMetricFamily("unisched_tenant_over_memory", "1 while the tenant is over its memory cap", labels=t_)
    pids = GaugeMetricFamily("unisched_tenant_processes", "Processes in the tenant's cgroup", labels=t_)
    for s in tenants:
        n = [s.name]
        weight.add_metric(n, float(s.weight))
        base.add_metric(n, float(s.base_weight))
        for share in s.shares:
            labels = [s.name, str(share.resource.gpu), share.resource.domain]
            target.add_metric(labels, share.target)
            measured.add_metric(labels, share.measured)
        seconds.add_metric(n, s.gpu_seconds)
        slices.add_metric(n, float(s.slices))
        for kind, k in sorted(s.refusals.items()):
            refusals.add_metric([s.name, kind], float(k))
        for kind, k in sorted(s.sessions.items()):
            sessions.add_metric([s.name, kind], float(k))
        for kind, cap in sorted(s.caps.items()):
            if cap is not None:
                caps.add_metric([s.name, kind], float(cap))
        frozen.add_metric(n, 1.0 if s.state == "frozen" else 0.0)
        for st in _STATES:
            state.add_metric([s.name, st], 1.0 if s.state == st else 0.0)
        memory.add_metric(n, float(s.memory_bytes))
        if s.memory_cap is not None:
            memory_cap.add_metric(n, float(s.memory_cap))
        over.add_metric(n, 1.0 if s.over_memory else 0.0)
        pids.add_metric(n, float(len(s.pids)))
    yield from (weight, base, target, measured, seconds, slices, refusals, sessions, caps, frozen, state, memory,
                memory_cap, over, pids)


def _gpu_metrics(gpus: Sequence[GpuInfo], samples: Sequence[GpuSample]) -> Iterator[Metric]:
    by_index = {s.index: s for s in samples}
    info = GaugeMetricFamily("unisched_gpu_info", "GPUs the daemon sees (always 1)", labels=["gpu", "name", "uuid"])
    util = GaugeMetricFamily("unisched_gpu_utilization", "Busy fraction (0..1) over the last slice per engine "
                             "(sm: SMs, dec: NVDEC, enc: NVENC)", labels=["gpu", "engine"])
    used = GaugeMetricFamily("unisched_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
    total = GaugeMetricFamily("unisched_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
    ok = GaugeMetricFamily("unisched_gpu_sample_ok", "1 when the last NVML sample of the GPU succeeded "
                           "(0: GPU lost, Xid)", labels=["gpu"])
    for g in gpus:
        i = str(g.index)
        info.add_metric([i, g.name, g.uuid], 1.0)
        total.add_metric([i], float(g.memory_total))
        s = by_index.get(g.index)
        if s is None:
            continue
        for engine, value in (("sm", s.sm_util), ("dec", s.dec_util), ("enc", s.enc_util)):
            util.add_metric([i, engine], value)
        used.add_metric([i], float(s.memory_used))
        ok.add_metric([i], 1.0 if s.ok else 0.0)
    yield from (info, util, used, total, ok)


def _gate_metrics(gates: Sequence[GateState], slice_s: float) -> Iterator[Metric]:
    labels = ["gpu", "domain"]
    sliced = GaugeMetricFamily("unisched_gpu_sliced", "1 while the tenants of a GPU domain take turns (it is "
                               "saturated), 0 while every tenant runs", labels=labels)
    held = GaugeMetricFamily("unisched_gpu_open_hold_seconds", "How long a GPU domain stays open whatever its "
                             "busy fraction, because slicing left its turns unused (paced tenants)", labels=labels)
    for g in gates:
        key = [str(g.resource.gpu), g.resource.domain]
        sliced.add_metric(key, 1.0 if g.sliced else 0.0)
        held.add_metric(key, g.held_slices * slice_s)
    yield from (sliced, held)


def _mix_metrics(mixes: Sequence[tuple[int, OverlapMix, SliceKind]]) -> Iterator[Metric]:
    labels = ["gpu", "kind"]
    fraction = GaugeMetricFamily("unisched_gpu_mixed_fraction", "Where compute and graphics overlap partly: the "
                                 "part of the time each kind of slice gets (both, compute, graphics)", labels=labels)
    now = GaugeMetricFamily("unisched_gpu_mixed_now", "1 for the kind of mixed slice running now", labels=labels)
    for gpu, mix, kind in mixes:
        for k in SliceKind:
            fraction.add_metric([str(gpu), k.value], mix.fraction(k))
            now.add_metric([str(gpu), k.value], 1.0 if k is kind else 0.0)
    yield from (fraction, now)


@dataclass
class MetricsServer:
    """The running exposition: prometheus-client's HTTP server and its thread."""

    httpd: WSGIServer
    thread: threading.Thread
    host: str
    port: int

    def close(self) -> None:
        """Stop serving (blocks until the server's poll loop notices: up to half a second)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5.0)


def start_metrics_server(host: str, port: int, view: EngineView) -> MetricsServer:
    """Serve /metrics for `view` on HOST:PORT in a thread (a registry of our own: no process globals)."""
    registry = CollectorRegistry()
    registry.register(UnischedCollector(view))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
    return MetricsServer(httpd, thread, host, int(httpd.server_address[1]))
