"""/healthz and /readyz on the metrics listener: the checks on an injected clock, and a real daemon's answers."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

from conftest import wait_until
from inproc import free_port, in_process_server

from unisched.scheduler.clock import FakeClock
from unisched.transport.health import (
    LIVE_SLICES,
    Health,
    Heartbeat,
    cgroups_check,
    nvml_check,
    socket_check,
)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return int(r.status), str(r.read().decode())
    except urllib.error.HTTPError as e:
        return int(e.code), str(e.read().decode())
    except (urllib.error.URLError, ConnectionError):
        return 0, ""  # not listening (yet)


def test_live_follows_the_last_slice_on_the_clock() -> None:
    clock = FakeClock()
    beat = Heartbeat(clock.monotonic, slice_s=0.05)
    assert beat.limit_s == LIVE_SLICES * 0.05
    assert not beat.live().ok and beat.live().body == "loop: no slice has run yet\n"
    beat.beat()
    clock.advance(beat.limit_s - 0.01)
    assert beat.live().ok and beat.live().status == 200
    clock.advance(0.02)  # one slice too many without a beat
    stalled = beat.live()
    assert stalled.status == 503 and stalled.body.startswith("loop: stalled: last slice 5.0 s ago (limit 5.0 s)")
    beat.beat()
    assert beat.live().ok


def test_ready_lists_every_check_and_fails_on_any(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    serving = threading.Event()
    checks = [socket_check(str(sock), serving.is_set), nvml_check(False, False, lambda: 0)]
    health = Health(Heartbeat(FakeClock().monotonic, 0.05), checks)
    assert health.ready().body == f"socket: {sock} not served yet\nnvml: unavailable (off by the config: nvml = false)\n"
    serving.set()
    assert not health.ready().ok and "No such file or directory" in health.ready().body
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        assert health.ready().ok and health.ready().body.startswith(f"socket: ok ({sock})\n")


def test_nvml_wanted_but_missing_is_not_ready() -> None:
    assert nvml_check(True, True, lambda: 2)() == (True, "nvml: ok (2 GPUs)")
    ok, line = nvml_check(True, False, lambda: 0)()
    assert not ok and line.startswith("nvml: unavailable, and the config wants it")


def test_cgroups_must_be_a_mounted_cgroup_filesystem(tmp_path: Path) -> None:
    assert cgroups_check("v2", tmp_path)() == (False, f"cgroups: {tmp_path} is not a mounted cgroup filesystem")
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    real = next((Path(f[1]) for f in mounts if f[2] in ("cgroup", "cgroup2")), None)
    if real is not None:
        assert cgroups_check("v2", real)() == (True, f"cgroups: ok (v2 at {real})")


def test_a_real_daemon_is_live_and_ready(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))  # --no-nvml: ready without a GPU signal
    status, body = wait_until(lambda: r if (r := _get(port, "/healthz"))[0] == 200 else None, 20, "/healthz 200")
    assert body.startswith("loop: ok (last slice ")
    status, body = _get(port, "/readyz")
    lines = body.splitlines()
    assert status == 200, body
    assert lines[0] == f"socket: ok ({d.socket})" and lines[1].startswith("cgroups: ok (")
    assert lines[2] == "nvml: unavailable (off by the config: nvml = false)"
    assert _get(port, "/nothing")[0] == 404
    assert "unisched_build_info" in _get(port, "/metrics")[1]


def test_a_daemon_that_wants_nvml_without_it_is_not_ready(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    daemon_factory("--metrics-port", str(port), nvml=True)
    status, body = wait_until(lambda: r if (r := _get(port, "/readyz"))[0] != 0 else None, 20, "/readyz")
    if "nvml: ok" in body:
        return  # a GPU host: NVML opened, nothing to check here
    assert status == 503 and "nvml: unavailable, and the config wants it" in body
    assert _get(port, "/healthz")[0] == 200  # live all the same: the loop runs


def test_a_stalled_loop_fails_healthz_and_recovers(tmp_path: Path) -> None:
    """The daemon's own loop, blocked for real (a call that waits on an event, put on the loop): the HTTP thread
    still answers, /healthz turns 503 once LIVE_SLICES slices' time passed, and 200 once the loop runs again."""
    port = free_port()
    with in_process_server(tmp_path / "state", metrics_port=port, slice_ms=10.0) as srv:
        wait_until(lambda: _get(port, "/healthz")[0] == 200, 20, "/healthz 200")
        release = threading.Event()
        srv.loop.call_soon_threadsafe(release.wait, 60.0)
        try:
            _, body = wait_until(lambda: r if (r := _get(port, "/healthz"))[0] == 503 else None, 30,
                                 "/healthz 503 while the loop is blocked")
            assert body.startswith("loop: stalled: last slice ") and "(limit 1.0 s)" in body
        finally:
            release.set()
        wait_until(lambda: _get(port, "/healthz")[0] == 200, 20, "/healthz 200 again")
