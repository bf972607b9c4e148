"""Running under systemd: sd_notify (READY, STATUS, WATCHDOG) to a real datagram socket posing as
NOTIFY_SOCKET, from a real daemon."""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon

from unisched.engine.runner import run_engine
from unisched.sdnotify import Notifier, Watchdog, watchdog_interval_s


class NotifySocket:
    """What systemd listens on: a datagram socket; each message is KEY=VALUE lines."""

    def __init__(self, name: str, abstract: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + name.encode() if abstract else name)
        self.env = "@" + name if abstract else name

    def receive(self, timeout: float) -> tuple[float, dict[str, str]] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        return time.monotonic(), dict(line.split("=", 1) for line in data.decode().splitlines())

    def wait_for(self, key: str, timeout: float) -> tuple[float, dict[str, str]]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = self.receive(left)
            if got is not None and key in got[1]:
                return got
        raise AssertionError(f"no {key} within {timeout:.0f} s")


@pytest.fixture(params=[False, True], ids=["path", "abstract"])
def notify(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    s = NotifySocket(str(tmp_path / "notify") if not request.param else f"unisched-test-{tmp_path.name}", request.param)
    monkeypatch.setenv("NOTIFY_SOCKET", s.env)
    yield s
    s.sock.close()


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        try:
            c.connect(path)
        except OSError:
            return False
    return True


def test_ready_is_sent_once_the_socket_answers(daemon_factory: Any, notify: NotifySocket) -> None:
    d: Daemon = daemon_factory("--slice-ms", "20")
    _, msg = notify.wait_for("READY", 20)
    assert msg["READY"] == "1" and msg["MAINPID"] == str(d.proc.pid)
    assert d.socket in msg["STATUS"]
    assert _answers(d.socket)
    d.stop()
    _, msg = notify.wait_for("STOPPING", 20)
    assert msg["STOPPING"] == "1" and "thawing" in msg["STATUS"]


def test_watchdog_pings_come_from_the_slice_loop_at_half_the_timeout(
    daemon_factory: Any, notify: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # WatchdogSec=0.4s: a ping every 0.2 s
    daemon_factory("--slice-ms", "20")
    notify.wait_for("WATCHDOG", 20)
    while notify.receive(0.01) is not None:
        pass  # what queued while the daemon started arrives at once: time only pings received as sent
    times = [notify.wait_for("WATCHDOG", 20)[0] for _ in range(8)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) >= 0.18, gaps  # never faster than half of WATCHDOG_USEC
    assert statistics.median(gaps) < 0.4, gaps  # and well inside the timeout


def test_no_watchdog_pings_without_watchdog_usec(daemon_factory: Any, notify: NotifySocket) -> None:
    daemon_factory("--slice-ms", "20")
    notify.wait_for("READY", 20)
    assert notify.receive(1.0) is None


# --- pure logic ---------------------------------------------------------------------------------------------


def test_watchdog_interval_follows_watchdog_usec_and_pid() -> None:
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, pid=7) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, pid=7) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None


def test_watchdog_pings_at_most_once_per_interval() -> None:
    sent: list[dict[str, str | int]] = []

    class Recorder(Notifier):
        def send(self, **fields: str | int) -> bool:
            sent.append(fields)
            return True

    now = [0.0]
    dog = Watchdog(Recorder("x"), 15.0, lambda: "ok", clock=lambda: now[0])
    for t in (0.0, 1.0, 14.9, 15.0, 20.0, 30.1):
        now[0] = t
        dog.alive()
    assert sent == [{"WATCHDOG": 1, "STATUS": "ok"}] * 3  # at 0, 15 and 30.1


def test_notifier_without_notify_socket_does_nothing() -> None:
    assert Notifier.from_env({}).ready("x") is False


class _Engine:
    """Stands in for KernelEngine in the loop: ticks that fail or succeed."""

    def __init__(self, fail: bool, stop: asyncio.Event) -> None:
        self.fail, self.stop, self.ticks = fail, stop, 0
        self.config = type("C", (), {"slice_ms": 1})()

    def tick(self) -> float:
        self.ticks += 1
        if self.ticks >= 5:
            self.stop.set()
        if self.fail:
            raise RuntimeError("slice failed")
        return 0.0

    def thaw_all(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("fail", [False, True])
def test_the_loop_reports_alive_only_after_a_slice_ran(fail: bool) -> None:
    calls: list[int] = []

    async def go() -> int:
        stop = asyncio.Event()
        engine = _Engine(fail, stop)
        await run_engine(engine, stop, lambda: calls.append(engine.ticks))  # type: ignore[arg-type]
        return engine.ticks

    ticks = asyncio.run(go())
    assert calls == ([] if fail else list(range(1, ticks + 1)))
