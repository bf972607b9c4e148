"""'lease stream dropped' is logged at most once an interval per reason and uid, with how many were held back: one
uid opening lease streams only to have them dropped wrote 1,581 lines in 3 s before."""

from __future__ import annotations

import asyncio
from typing import cast

from structlog.testing import capture_logs

from unisched.logs import Throttle
from unisched.scheduler.core import Scheduler
from unisched.transport.identity import PeerCred
from unisched.transport.lease import LEASE_UNSENT_MAX, LeaseConnection, LeaseService
from unisched.transport.pacing import Pacer

DROPS = 100
INTERVAL_S = 1.0  # (lease.INTERVAL_S)


class Unread(asyncio.Transport):
    """A transport whose client reads nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return LEASE_UNSENT_MAX + 1

    def is_closing(self) -> bool:
        return self.closed

    def abort(self) -> None:
        self.closed = True


async def _drops(service: LeaseService, uid: int) -> int:
    """Connections of `uid` dropped for replies left unread; how many were."""
    loop = asyncio.get_running_loop()
    dropped = 0
    for _ in range(DROPS):
        conn = LeaseConnection(service, PeerCred(1, uid, uid), b"", loop.create_future())
        transport = Unread()
        conn.connection_made(transport)
        conn._write([b"grant"])
        dropped += transport.closed
    return dropped


def test_dropped_lease_streams_are_logged_once_an_interval_per_uid() -> None:
    now = [0.0]
    service = LeaseService(cast(Scheduler, object()), lambda cred: False, Pacer(lambda *args: None))
    service.drops = Throttle(INTERVAL_S, clock=lambda: now[0])

    async def main() -> list[int]:
        counts = [await _drops(service, 65534), await _drops(service, 1000)]
        now[0] += INTERVAL_S
        counts.append(await _drops(service, 65534))
        return counts

    with capture_logs() as logs:
        assert asyncio.run(main()) == [DROPS] * 3  # every one was dropped
    lines = [(e.get("uid"), e.get("held_back")) for e in logs if e["event"] == "lease stream dropped"]
    assert lines == [(65534, 0), (1000, 0), (65534, DROPS - 1)]
