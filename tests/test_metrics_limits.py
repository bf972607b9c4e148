"""The metrics listener's bounds (transport.metrics_http): loopback addresses count as one client, and probe
slots answer /healthz and /readyz while every other connection is held."""

from __future__ import annotations

import http.client
import select
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import FakeTelemetry
from unisched.transport import metrics_http
from unisched.transport.health import Health, Heartbeat
from unisched.transport.metrics import EngineView, MetricsServer, start_metrics_server
from unisched.transport.metrics_http import LOOPBACK, MAX_CONNECTIONS_PER_ADDRESS, PROBE_SLOTS, client_key


@contextmanager
def _served(tmp_path: Path) -> Iterator[MetricsServer]:
    """A metrics server with a live /healthz; idle connections are not timed out during a test."""
    clock = FakeClock()
    engine = Scheduler(DaemonConfig(slice_ms=50), FakeCgroupDriver(), FakeTelemetry([]), StateStore(tmp_path), clock)
    view = EngineView(engine)
    view.refresh()
    beat = Heartbeat(clock.monotonic, 0.05)
    beat.beat()
    server = start_metrics_server("127.0.0.1", 0, view, Health(beat, []), read_timeout_s=60)
    try:
        yield server
    finally:
        server.close()


@contextmanager
def _idle(port: int, sources: list[str]) -> Iterator[list[socket.socket]]:
    """Connections from `sources` that send nothing (accepted in this order: the listener accepts first come,
    first served)."""
    held = [socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(src, 0)) for src in sources]
    try:
        yield held
    finally:
        for s in held:
            s.close()


def _status(port: int, path: str, source: str = "127.0.0.1") -> int:
    """The answer's status, 0 if the connection was closed unanswered."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        c.request("GET", path)
        return c.getresponse().status
    except (http.client.RemoteDisconnected, ConnectionError):
        return 0
    finally:
        c.close()


def _held(conns: list[socket.socket]) -> bool:
    """None of `conns` was answered or closed (each still holds its slot)."""
    readable, _, _ = select.select(conns, [], [], 0)
    return readable == []


def test_every_loopback_address_is_one_client() -> None:
    for a in ("127.0.0.1", "127.0.0.17", "127.255.3.4", "::1", "::ffff:127.0.0.2"):
        assert client_key(a) == LOOPBACK, a
    assert client_key("::ffff:10.1.2.3") == "10.1.2.3"  # a dual-stack listener's IPv4 client is that client
    assert client_key("10.1.2.3") == "10.1.2.3" and client_key("fe80::1%eth0") == "fe80::1"


def test_connections_from_many_loopback_addresses_are_bounded_as_one_address(tmp_path: Path) -> None:
    """A local user can bind any 127.x address: a connection each from 127.0.0.2, .3, ... are all one client's,
    so past its bound a scrape is not served (a probe slot answers it 503), and the probes still answer."""
    with _served(tmp_path) as server, \
            _idle(server.port, [f"127.0.0.{2 + i}" for i in range(MAX_CONNECTIONS_PER_ADDRESS)]) as idle:
        assert _status(server.port, "/metrics", f"127.0.0.{2 + MAX_CONNECTIONS_PER_ADDRESS}") == 503
        assert _status(server.port, "/healthz", "127.0.0.200") == 200
        assert _held(idle)


def test_healthz_answers_while_an_idle_client_holds_every_other_slot(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet's liveness probe restarts the daemon when unanswered: idle connections holding every general
    slot (here from one address, the bound per address raised to all of them) must not keep it out."""
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 6)
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS_PER_ADDRESS", 6)
    with _served(tmp_path) as server, _idle(server.port, ["127.0.0.1"] * 6) as idle:
        assert _status(server.port, "/healthz") == 200
        assert _status(server.port, "/readyz") == 200
        assert _status(server.port, "/metrics") == 503, "a probe slot serves the probes only"
        assert _held(idle)


def test_idle_connections_in_the_probe_slots_give_way_to_a_probe(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle connections past the general slots take the probe slots too; a new connection then takes the place of
    the one that has waited longest without a request, so they cannot keep a probe out."""
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 2)
    with _served(tmp_path) as server, _idle(server.port, ["127.0.0.1"] * (2 + PROBE_SLOTS)) as idle:
        assert _status(server.port, "/healthz") == 200
        assert idle[2].recv(1) == b"", "the oldest idle connection in a probe slot was closed for the probe"
        assert _held(idle[:2] + idle[3:])


def test_idle_connections_past_an_address_s_bound_get_no_more_threads(tmp_path: Path) -> None:
    """Each connection is a thread of the daemon: past its address's bound, one client's idle connections only
    take the probe slots, each new one closing the oldest there."""
    extra = 3
    with _served(tmp_path) as server, \
            _idle(server.port, ["127.0.0.1"] * (MAX_CONNECTIONS_PER_ADDRESS + PROBE_SLOTS + extra)) as idle:
        bounded, probe_slots = idle[:MAX_CONNECTIONS_PER_ADDRESS], idle[MAX_CONNECTIONS_PER_ADDRESS:]
        for s in probe_slots[:extra]:
            assert s.recv(1) == b"", "closed unanswered for a newer connection"
        assert _held(bounded + probe_slots[extra:])


def test_another_address_is_served_while_one_is_at_its_bound() -> None:
    slots = metrics_http.Slots(most=4, per_address=2, probes=1)
    a, b = socket.socketpair()
    with a, b:
        held = [slots.take(a, "10.0.0.1") for _ in range(2)]
        assert all(s is not None and not s.reserved for s in held)
        third = slots.take(a, "10.0.0.1")
        assert third is not None and third.reserved, "past its bound: a probe slot"
        other = slots.take(a, "10.0.0.2")
        assert other is not None and not other.reserved
        slots.give(other)
        assert slots.requested(third)
        assert slots.take(a, "10.0.0.1") is None, "no general slot for it, and the probe slot is serving a request"
