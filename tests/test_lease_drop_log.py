"""'lease stream dropped' (and 'grpc connection dropped') is logged at most once an interval per reason and caller,
with how many were held back: one uid opening lease streams only to have them dropped wrote 1,581 lines in 3 s
before. A pod's connections count as its pod's, whatever uid they run as."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

from structlog.testing import capture_logs

from unisched.logs import Throttle
from unisched.scheduler.core import Scheduler
from unisched.transport.droplog import DropLog
from unisched.transport.frontdoor import StreamLimits
from unisched.transport.grpcdoor import PREFACE, UNSENT_MAX, GrpcDoor
from unisched.transport.identity import PeerCred
from unisched.transport.lease import LEASE_UNSENT_MAX, LeaseConnection, LeaseService
from unisched.transport.pacing import Pacer
from unisched_wire import unisched_pb2 as pb

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


async def _drops(service: LeaseService, uid: int, pod: int | None = None) -> int:
    """Connections of `uid` (in pod `pod`: as peer_of gives a pod's process) dropped for replies left unread; how
    many were."""
    loop = asyncio.get_running_loop()
    dropped = 0
    for _ in range(DROPS):
        conn = LeaseConnection(service, PeerCred(1, uid, uid, pod=pod), b"", loop.create_future())
        transport = Unread()
        conn.connection_made(transport)
        conn._write([b"grant"])
        dropped += transport.closed
    return dropped


def test_dropped_lease_streams_are_logged_once_an_interval_per_uid() -> None:
    now = [0.0]
    service = LeaseService(cast(Scheduler, object()), lambda cred: False, Pacer(lambda *args: None))
    service.drops = DropLog("lease stream dropped", Throttle(INTERVAL_S, clock=lambda: now[0]))

    async def main() -> list[int]:
        counts = [await _drops(service, 65534), await _drops(service, 1000)]
        now[0] += INTERVAL_S
        counts.append(await _drops(service, 65534))
        return counts

    with capture_logs() as logs:
        assert asyncio.run(main()) == [DROPS] * 3  # every one was dropped
    lines = [(e.get("uid"), e.get("held_back")) for e in logs if e["event"] == "lease stream dropped"]
    assert lines == [(65534, 0), (1000, 0), (65534, DROPS - 1)]


def test_a_pod_s_dropped_lease_streams_are_logged_apart_from_the_host_uid_it_runs_as() -> None:
    """uid 1000 in a pod is not the host's uid 1000: the pod's drops hold back the pod's own lines, not that host
    user's."""
    service = LeaseService(cast(Scheduler, object()), lambda cred: False, Pacer(lambda *args: None))
    service.drops = DropLog("lease stream dropped", Throttle(INTERVAL_S, clock=lambda: 0.0))

    async def main() -> None:
        await _drops(service, 1000, pod=7)
        await _drops(service, 1000)

    with capture_logs() as logs:
        asyncio.run(main())
    lines = [(e.get("pod"), e.get("uid"), e.get("held_back")) for e in logs if e["event"] == "lease stream dropped"]
    assert lines == [(7, 1000, 0), (None, 1000, 0)]


def test_a_pod_s_dropped_grpc_connections_are_logged_apart_from_the_host_uid_it_runs_as() -> None:
    """The same for the gRPC socket's connections."""
    door = GrpcDoor(SimpleNamespace(**{m.name: None for m in pb.DESCRIPTOR.services_by_name["Unisched"].methods}),
                    "unisched.sock")  # (no call is made)
    door._drops = DropLog("grpc connection dropped", Throttle(INTERVAL_S, clock=lambda: 0.0))
    limits = StreamLimits(hello_s=5.0, partial_frame_s=5.0, hold=lambda delta: True)

    async def main() -> None:
        try:
            for cred in (PeerCred(1, 1000, 1000, pod=7), PeerCred(1, 1000, 1000)):
                for _ in range(DROPS):
                    door._connection(cred, b"", limits)._dropped("streams", "too many streams")
        finally:
            await door.close()

    with capture_logs() as logs:
        asyncio.run(main())
    lines = [(e.get("pod"), e.get("uid"), e.get("held_back")) for e in logs if e["event"] == "grpc connection dropped"]
    assert lines == [(7, 1000, 0), (None, 1000, 0)]


class UnreadH2(Unread):
    """A transport whose client has left `unsent` bytes unread, as the gRPC door's connections see it."""

    def __init__(self, unsent: int) -> None:
        super().__init__()
        self.unsent = unsent

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def pause_reading(self) -> None:
        pass


def test_grpc_drops_for_one_kind_of_reason_share_a_line_whatever_numbers_their_reasons_carry() -> None:
    """The throttle keys on the kind of reason, not its text: 'client left N bytes unread' with another N each time
    must not get a line each."""
    door = GrpcDoor(SimpleNamespace(**{m.name: None for m in pb.DESCRIPTOR.services_by_name["Unisched"].methods}),
                    "unisched.sock")
    door._drops = DropLog("grpc connection dropped", Throttle(INTERVAL_S, clock=lambda: 0.0))
    limits = StreamLimits(hello_s=5.0, partial_frame_s=5.0, hold=lambda delta: True)
    transports = [UnreadH2(UNSENT_MAX + 1 + i) for i in range(DROPS)]

    async def main() -> None:
        try:
            for t in transports:
                door._connection(PeerCred(1, 1000, 1000), PREFACE, limits).connection_made(t)
        finally:
            await door.close()

    with capture_logs() as logs:
        asyncio.run(main())
    assert all(t.closed for t in transports)
    lines = [e["reason"] for e in logs if e["event"] == "grpc connection dropped"]
    assert lines == [f"client left {UNSENT_MAX + 1} bytes unread"]
