"""A real daemon (serve_async) in a thread of the test process, on a temporary socket, with fake cgroups.

With config overrides (metrics, TLS listener), fake cgroups and telemetry of the test's choosing. The one way
the tests run a server in-process (test_grpc, test_security, test_fuzz_grpc, test_metrics, test_top, test_tls).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.scheduler.clock import SystemClock
from unisched.scheduler.config import DaemonConfig, runtime_agent_socket_beside
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import GpuTelemetry, NoGpuTelemetry
from unisched.transport.server import Doors, serve_async


@dataclass
class InProcessServer:
    socket: str
    config: DaemonConfig
    driver: FakeCgroupDriver
    engine: Scheduler
    doors: Doors
    loop: asyncio.AbstractEventLoop
    """The loop the daemon runs in (its own thread)."""

    @property
    def lease_socket(self) -> str:
        return self.config.lease_socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def in_process_server(
    state_dir: Path, telemetry: GpuTelemetry | None = None, driver: FakeCgroupDriver | None = None, **overrides: Any
) -> Iterator[InProcessServer]:
    sock_dir = Path(tempfile.mkdtemp(prefix="us-inproc-"))
    sock_dir.chmod(0o755)
    runtime_socket = runtime_agent_socket_beside(str(sock_dir / "s.sock"))
    config = replace(
        DaemonConfig(socket=str(sock_dir / "s.sock"), agent_socket=str(sock_dir / "agent.sock"),
                     runtime_agent_socket=runtime_socket,
                     lease_socket=str(sock_dir / "lease.sock"), state_dir=str(state_dir)),
        **overrides,
    )
    driver = driver or FakeCgroupDriver()
    store = StateStore(config.state_dir, driver.subtree)
    engine = Scheduler(config, driver, telemetry or NoGpuTelemetry(), store, SystemClock())
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    started = threading.Event()
    failed: list[BaseException] = []
    doors: list[Doors] = []

    def ready(serving: Doors) -> None:
        doors.append(serving)
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve_async(config, engine, False, stop=stop, ready=ready))
        except BaseException as e:  # surfaced to the test below
            failed.append(e)
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(20), "server did not start"
        if failed:
            raise failed[0]
        yield InProcessServer(config.socket, config, driver, engine, doors[0], loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)
        loop.close()
        shutil.rmtree(sock_dir)
        # the daemon removes the runtime agent socket's directory it made at stop; should it not have, only ours
        # goes, and only empty: never one an override names, nor anything in it
        if config.runtime_agent_socket == runtime_socket:
            with contextlib.suppress(OSError):
                Path(runtime_socket).parent.rmdir()
