"""A flood of connections must not hold the daemon's event loop. `loop.sock_accept` returns at once, without
yielding to the loop, while a connection is queued (Python 3.11+), so an accept loop that only awaits it runs
connection after connection for as long as a local user keeps connecting and closing (the seccomp agent's shared
socket is anyone's): the slices, every other client and systemd's watchdog (which kills the daemon past
WatchdogSec) wait meanwhile. Each accept loop lets the loop's other work run between its turns.

Connections are queued in the socket's backlog before its accept loop first runs, and a callback is scheduled
behind that loop: it must run before the loop has taken them all."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from unisched.enforce.seccomp.hooks import FakeSessionHooks
from unisched.scheduler.core import Scheduler
from unisched.transport import frontdoor
from unisched.transport.agent import HandOverLimits, SeccompAgentServer
from unisched.transport.frontdoor import FrontDoor, StreamLimits
from unisched.transport.identity import PeerCred

QUEUED = 100
"""Connections waiting in the backlog (the agent's holds 128, the front door's 1,024)."""


def _counted(admit: Callable[..., None], everyone: asyncio.Event, admitted: list[int]) -> Callable[..., None]:
    def counting(*args: Any) -> None:
        admit(*args)
        admitted[0] += 1
        if admitted[0] == QUEUED:
            everyone.set()

    return counting


async def _admitted_when_the_loop_came_round(path: str, admitted: list[int], everyone: asyncio.Event) -> int:
    """Queue QUEUED connections to `path`, whose accept loop is scheduled but has not run; how many had been
    admitted when a callback scheduled behind that loop ran."""
    clients = []
    try:
        for _ in range(QUEUED):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            clients.append(client)
            client.connect(path)  # (the kernel queues it: nothing accepts yet)
        seen: list[int] = []
        asyncio.get_running_loop().call_soon(lambda: seen.append(admitted[0]))
        await asyncio.wait_for(everyone.wait(), 30)
        return seen[0]
    finally:
        for client in clients:
            client.close()


def test_the_seccomp_agent_lets_the_loop_run_between_the_connections_it_accepts(tmp_path: Path) -> None:
    roomy = HandOverLimits(per_uid=QUEUED, users=QUEUED, root=QUEUED)  # every one admitted, none refused
    server = SeccompAgentServer(str(tmp_path / "agent.sock"), cast(Scheduler, object()), roomy, FakeSessionHooks())
    admitted, everyone = [0], asyncio.Event()
    server._admit = _counted(server._admit, everyone, admitted)  # type: ignore[method-assign]

    async def main() -> int:
        await server.start()
        try:
            return await _admitted_when_the_loop_came_round(server.path, admitted, everyone)
        finally:
            await server.close()

    assert asyncio.run(main()) < QUEUED


def test_the_front_door_lets_the_loop_run_between_its_batches_of_connections(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frontdoor, "ACCEPT_BATCH", 4)  # (256 a turn: more than QUEUED)

    async def serve(conn: socket.socket, cred: PeerCred, limits: StreamLimits) -> None:
        conn.close()

    async def main() -> int:
        door = FrontDoor()
        admitted, everyone = [0], asyncio.Event()
        door._admit = _counted(door._admit, everyone, admitted)  # type: ignore[method-assign]
        path = str(tmp_path / "d.sock")
        await door.open(path, serve)
        try:
            return await _admitted_when_the_loop_came_round(path, admitted, everyone)
        finally:
            await door.close()

    assert asyncio.run(main()) <= 1 + 4
