"""Prometheus exposition: a collector over the engine's one snapshot type, served with the health probes.

The names, types, help texts and labels come from one list (transport.metric_names). The HTTP server runs in
its own thread, so a scrape or a probe never waits on the asyncio loop; the engine is only touched on the
loop. `EngineView.run()` (an asyncio task beside the engine) copies the tenant snapshots and the GPU samples
into one immutable `View` every second, and the collector reads whichever `View` is current when the scrape
comes (one attribute read: a consistent copy, no lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from unisched import __version__
from unisched.enforce.seccomp.hooks import SessionHooks
from unisched.enforce.seccomp.stats import HookCounts
from unisched.policy import Resource
from unisched.policy.overlap import OverlapMix, SliceKind
from unisched.policy.saturation import GateState
from unisched.scheduler.core import Scheduler, TenantSnapshot
from unisched.scheduler.labels import LABEL_KEYS
from unisched.telemetry import GpuInfo, GpuSample
from unisched.transport.health import Health
from unisched.transport.metric_names import FAMILIES, family
from unisched.transport.metrics_http import READ_TIMEOUT_S, serve

if TYPE_CHECKING:
    from wsgiref.types import StartResponse
    from wsgiref.types import WSGIApplication as WSGIApp

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
    charges: tuple[tuple[Resource, str, float], ...]
    """GPU seconds charged to freezer-governed tenants since the start, per resource and the rule that split them."""
    hooks: tuple[HookCounts, ...]
    """How the session hooks have answered each hooked tenant's calls (running totals)."""
    mode: str
    taken: float


class EngineView:
    """The latest View of an engine. refresh() runs on the engine's loop; `current` is read from any thread."""

    def __init__(self, engine: Scheduler, hooks: SessionHooks | None = None) -> None:
        self.engine = engine
        self.hooks = hooks
        """The agent socket's session hooks (None: no agent socket, no hooked tenants)."""
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
            charges=self.engine.charged_by_rule(),
            hooks=tuple(self.hooks.counts()) if self.hooks is not None else (),
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
        out = _Families()
        out.add("unisched_build_info", [__version__, view.mode if view else ""], 1.0)
        if view is not None:
            out.add("unisched_view_age_seconds", [], max(0.0, time.monotonic() - view.taken))
            out.add("unisched_tenants", [], float(len(view.tenants)))
            uuids = {g.index: g.uuid for g in view.gpus}
            _tenant_metrics(out, view.tenants, uuids)
            _hook_metrics(out, view.hooks, view.tenants)
            _gpu_metrics(out, view.gpus, view.samples)
            _gate_metrics(out, view.gates, uuids, self.view.engine.config.slice_ms / 1000.0)
            _mix_metrics(out, view.mixes, uuids)
            for r, rule, seconds in view.charges:
                out.add("unisched_gpu_charged_seconds", [*_gpu(r.gpu, uuids), r.domain, rule], seconds)
        yield from out.families()


class _Families:
    """One metric family per entry of metric_names.FAMILIES, each built from that entry alone: the list is the
    only place a name, type, help text or label set is written."""

    def __init__(self) -> None:
        self._by_name: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(self, name: str, labels: Sequence[str], value: float) -> None:
        fam = self._by_name.get(name)
        if fam is None:
            spec = family(name)
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            fam = self._by_name[name] = cls(spec.name, spec.help, labels=list(spec.labels))
        fam.add_metric(list(labels), value)

    def families(self) -> Iterator[Metric]:
        """Every family of the list, in its order (empty ones too: HELP and TYPE say what may appear)."""
        for spec in FAMILIES:
            fam = self._by_name.get(spec.name)
            if fam is None:
                cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
                fam = cls(spec.name, spec.help, labels=list(spec.labels))
            yield fam


def _gpu(index: int, uuids: Mapping[int, str]) -> list[str]:
    """The per-GPU labels (gpu, UUID); UUID is empty where no GPU is seen (GPU 0 stands in without NVML)."""
    return [str(index), uuids.get(index, "")]


def _tenant_metrics(out: _Families, tenants: Sequence[TenantSnapshot], uuids: Mapping[int, str]) -> None:
    for s in tenants:
        n = _tenant(s.name, s.labels)
        out.add("unisched_tenant_weight", n, float(s.weight))
        out.add("unisched_tenant_base_weight", n, float(s.base_weight))
        for share in s.shares:
            where = [*n, *_gpu(share.resource.gpu, uuids), share.resource.domain]
            out.add("unisched_tenant_target_share_ratio", where, share.target)
            out.add("unisched_tenant_measured_share_ratio", where, share.measured)
            out.add("unisched_tenant_gpu_seconds", where, share.gpu_seconds)
            for how, seconds in share.charges:
                out.add("unisched_tenant_charged_seconds", [*where, how.rule, how.source], seconds)
        out.add("unisched_tenant_slices", n, float(s.slices))
        for kind, k in sorted(s.refusals.items()):
            out.add("unisched_tenant_session_refusals", [*n, kind], float(k))
        for kind, k in sorted(s.sessions.items()):
            out.add("unisched_tenant_sessions", [*n, kind], float(k))
        for kind, cap in sorted(s.caps.items()):
            if cap is not None:
                out.add("unisched_tenant_session_cap", [*n, kind], float(cap))
        for st in _STATES:
            out.add("unisched_tenant_state", [*n, st], 1.0 if s.state == st else 0.0)
        out.add("unisched_tenant_memory_seen_bytes", n, float(s.memory_bytes))
        if s.memory_cap is not None:
            out.add("unisched_tenant_memory_cap_bytes", n, float(s.memory_cap))
        out.add("unisched_tenant_over_memory", n, 1.0 if s.over_memory else 0.0)
        out.add("unisched_tenant_processes", n, float(len(s.pids)))
        for m in s.gpu_memory:
            g = [*n, *_gpu(m.gpu, uuids)]
            out.add("unisched_tenant_memory_used_bytes", g, float(m.used))
            out.add("unisched_tenant_memory_refusals", g, float(m.refused))
            if m.reserve:
                out.add("unisched_tenant_memory_reserve_bytes", g, float(m.reserve))


def _tenant(name: str, labels: Mapping[str, str]) -> list[str]:
    """The per-tenant label values (metric_names.TENANT): its name, and where an orchestrator runs it."""
    return [name, *(labels.get(k, "") for k in LABEL_KEYS)]


def _hook_metrics(out: _Families, hooks: Sequence[HookCounts], tenants: Sequence[TenantSnapshot]) -> None:
    labels = {s.name: s.labels for s in tenants}
    for c in hooks:
        n = _tenant(c.tenant, labels.get(c.tenant, {}))
        out.add("unisched_tenant_hook_calls", n, float(c.calls))
        out.add("unisched_tenant_hook_answer_seconds", n, c.answer_s)
        out.add("unisched_tenant_hook_errors", n, float(c.errors))
        out.add("unisched_tenant_hook_decisions", n, float(c.decided))
        out.add("unisched_tenant_hook_decision_seconds", n, c.decided_s)
        out.add("unisched_tenant_hook_send_seconds", n, c.send_s)
        out.add("unisched_tenant_hook_paced", n, float(c.paced))
        out.add("unisched_tenant_hook_paced_seconds", n, c.paced_s)


def _gpu_metrics(out: _Families, gpus: Sequence[GpuInfo], samples: Sequence[GpuSample]) -> None:
    by_index = {s.index: s for s in samples}
    for g in gpus:
        key = [str(g.index), g.uuid]
        out.add("unisched_gpu_info", [*key, g.name], 1.0)
        out.add("unisched_gpu_memory_total_bytes", key, float(g.memory_total))
        s = by_index.get(g.index)
        if s is None:
            continue
        for engine, value in (("sm", s.sm_util), ("dec", s.dec_util), ("enc", s.enc_util)):
            out.add("unisched_gpu_utilization_ratio", [*key, engine], value)
        out.add("unisched_gpu_memory_used_bytes", key, float(s.memory_used))
        out.add("unisched_gpu_sample_ok", key, 1.0 if s.ok else 0.0)


def _gate_metrics(out: _Families, gates: Sequence[GateState], uuids: Mapping[int, str], slice_s: float) -> None:
    for g in gates:
        key = [*_gpu(g.resource.gpu, uuids), g.resource.domain]
        out.add("unisched_gpu_sliced", key, 1.0 if g.sliced else 0.0)
        out.add("unisched_gpu_open_hold_seconds", key, g.held_slices * slice_s)


def _mix_metrics(out: _Families, mixes: Sequence[tuple[int, OverlapMix, SliceKind]], uuids: Mapping[int, str]) -> None:
    for gpu, mix, kind in mixes:
        for k in SliceKind:
            key = [*_gpu(gpu, uuids), k.value]
            out.add("unisched_gpu_mixed_time_ratio", key, mix.fraction(k))
            out.add("unisched_gpu_mixed_now", key, 1.0 if k is kind else 0.0)


@dataclass
class MetricsServer:
    """The running HTTP listener (/metrics, /healthz, /readyz) and its thread."""

    httpd: WSGIServer
    thread: threading.Thread
    host: str
    port: int

    def close(self) -> None:
        """Stop serving (blocks until the server's poll loop notices: up to half a second)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5.0)


def _app(registry: CollectorRegistry, health: Health | None) -> WSGIApp:
    """/metrics (also /, as prometheus-client serves it), and /healthz and /readyz when `health` is given."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        probe = {"/healthz": health.live, "/readyz": health.ready}.get(path) if health is not None else None
        if probe is not None:
            result = probe()
            start_response(f"{result.status} {'OK' if result.ok else 'Service Unavailable'}",
                           [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")])
            return [result.body.encode()]
        if path in ("/", "/metrics"):
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: try /metrics, /healthz or /readyz\n"]

    return app


def start_metrics_server(host: str, port: int, view: EngineView, health: Health | None = None,
                         read_timeout_s: float = READ_TIMEOUT_S) -> MetricsServer:
    """Serve /metrics for `view` (and the probes of `health`) on HOST:PORT in a thread (a registry of our own:
    no process globals), a thread per connection within metrics_http's bounds."""
    registry = CollectorRegistry()
    registry.register(UnischedCollector(view))
    try:
        family_, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        httpd = serve(str(sockaddr[0]), port, family_, _app(registry, health), read_timeout_s)
    except OSError as e:
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
    thread = threading.Thread(target=httpd.serve_forever, name="unisched-metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread, host, int(httpd.server_address[1]))
