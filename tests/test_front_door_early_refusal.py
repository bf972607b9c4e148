"""A connection its uid's full bucket will refuse is refused on the kernel's uid (one getsockopt), before its
caller is pinned and /proc read (~70 us each): one process churning connect/close kept the loop 74-126 ms late
while every refused connection was pinned first. A uid that may be an admin's is still pinned: the admins'
reserve may take it."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from unisched.transport import frontdoor
from unisched.transport.frontdoor import FrontDoor, FrontDoorLimits, StreamLimits
from unisched.transport.identity import PeerCred, peer_of

PER_UID = 2


async def _third_connection(tmp_path: Path, door: FrontDoor) -> tuple[int, int]:
    """Fill the test's uid's bucket (PER_UID connections held open), then connect once more: the connections
    the door admitted in all, and those it refused."""
    release = asyncio.Event()
    admitted = [0]

    async def serve(conn: socket.socket, cred: PeerCred, limits: StreamLimits) -> None:
        admitted[0] += 1
        await release.wait()
        conn.close()

    path = str(tmp_path / "d.sock")
    await door.open(path, serve)
    clients = []
    try:
        for want in range(1, PER_UID + 2):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            clients.append(client)
            client.connect(path)
            for _ in range(3000):  # until the door has decided on it (bounded: 30 s)
                if admitted[0] + door.refused >= want:
                    break
                await asyncio.sleep(0.01)
        return admitted[0], door.refused
    finally:
        release.set()
        for client in clients:
            client.close()
        await door.close()


def _counting_peer_of(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    def counting(conn: socket.socket) -> Any:
        calls[0] += 1
        return peer_of(conn)
    monkeypatch.setattr(frontdoor, "peer_of", counting)
    return calls


def test_a_full_bucket_refuses_before_pinning_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = _counting_peer_of(monkeypatch)
    door = FrontDoor(limits=FrontDoorLimits(per_uid=PER_UID))
    assert asyncio.run(_third_connection(tmp_path, door)) == (PER_UID, 1)
    assert pinned[0] == PER_UID  # the refused one was never pinned


def test_a_caller_that_may_be_an_admin_is_pinned_and_gets_the_reserve(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = _counting_peer_of(monkeypatch)
    door = FrontDoor(is_admin=lambda cred: True, limits=FrontDoorLimits(per_uid=PER_UID),
                     may_be_admin=lambda uid: True)
    assert asyncio.run(_third_connection(tmp_path, door)) == (PER_UID + 1, 0)
    assert pinned[0] == PER_UID + 1
