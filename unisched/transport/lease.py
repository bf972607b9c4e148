"""Lease enforcement's lease stream, served in the daemon's event loop on its own socket (`lease_socket`).

One `LeaseConnection` (an asyncio Protocol) per client connection that opened with `leasewire.MAGIC`: hello,
then wants, reports and codec sessions, each with a seq answered by an ack; the engine's grants and revokes
are written to it directly (it is the session's LeaseChannel). A renewal is answered within the loop turn that
read it, with no task, queue or thread between. A hello is welcomed once its caller is in its tenant's cgroup (a
move made off the loop: scheduler.moves); what came after it waits for that. Identity is the accepted socket's
SO_PEERCRED, read by the front door: no request field names a process. A connection that opens with anything
but MAGIC (a gRPC client sent to the wrong socket) is closed at once. Closing the connection ends the session (its
demand, its codec sessions). An error is sent as a LeaseError (a gRPC status name and why) and ends the connection.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import structlog
from google.protobuf.message import DecodeError

from unisched.enforce.leases import LeaseGrant, LeaseMessage
from unisched.scheduler.core import LeaseAck, RegisterAsk, Scheduler, SchedulerError, TenantSnapshot
from unisched.transport.convert import PRIORITY, snapshot_to_pb
from unisched.transport.droplog import DropLog
from unisched.transport.frontdoor import StreamLimits, read_opening
from unisched.transport.identity import PeerCred
from unisched.transport.pacing import Pacer
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REQUEST_BYTES, FrameError, FrameReader, frame, is_lease_opening

__all__ = ["ANSWERED_PER_TURN", "ERROR_CODES", "LEASE_UNSENT_MAX", "LeaseConnection", "LeaseService"]

log = structlog.get_logger("unisched.transport")

ERROR_CODES = {
    "not_found": "NOT_FOUND",
    "invalid": "INVALID_ARGUMENT",
    "permission": "PERMISSION_DENIED",
    "failed": "FAILED_PRECONDITION",
}
"""SchedulerError kinds as the status names clients see (gRPC's, for the lease stream as for the other calls)."""

ANSWERED_PER_TURN = 32
"""Requests of one connection answered in one turn of the event loop; more read at once wait for the next turns."""
LEASE_UNSENT_MAX = 256 * 1024
"""Reply bytes a lease connection may leave unread (thousands of grants and acks); past it the client, which
is not reading, is dropped so that it cannot grow the daemon's memory."""

class LeaseService:
    """Serves the lease socket's connections (one service per daemon)."""

    def __init__(self, engine: Scheduler, is_admin: Callable[[PeerCred], bool], pacer: Pacer) -> None:
        self.engine = engine
        self.is_admin = is_admin
        self.pacer = pacer
        self.drops = DropLog("lease stream dropped")
        """Throttles the connections' 'lease stream dropped' lines (a test may give it its own clock)."""

    async def serve(self, conn: socket.socket, cred: PeerCred, limits: StreamLimits) -> None:
        """One admitted connection (the front door's Serve): its MAGIC within the opening deadline, then the
        stream until it ends."""
        first = await read_opening(conn, is_lease_opening, limits.hello_s)
        if not is_lease_opening(first):
            conn.close()  # silent, gone, or another protocol: nothing to answer in
            return
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        proto = LeaseConnection(self, cred, first[len(MAGIC):], closed, limits)
        transport, _ = await loop.connect_accepted_socket(lambda: proto, sock=conn)
        try:
            await closed
        finally:
            transport.close()


class LeaseConnection(asyncio.Protocol):
    def __init__(self, service: LeaseService, cred: PeerCred, first: bytes, closed: asyncio.Future[None],
                 limits: StreamLimits | None = None) -> None:
        self.service = service
        self.cred = cred
        self.closed = closed
        self.limits = limits
        self._first = first
        self._held = 0
        """Bytes of an unfinished frame, as accounted against the uid's budget."""
        self._timer: asyncio.TimerHandle | None = None
        """The deadline running now: for the hello, then for each partial frame."""
        self._reader = FrameReader(MAX_REQUEST_BYTES)
        self._transport: asyncio.Transport | None = None
        self._sid: int | None = None
        self._log = log.bind(pid=cred.pid, **cred.who)
        """Bound once per connection: binding the module's lazy logger on every renewal cost ~6-15 us."""
        self._pushed: list[bytes] | None = None
        """While a request is being answered: the engine's grants and revokes, written after its reply."""
        self._ended = False
        self._stash: list[bytes] | None = None
        """Requests read and not answered yet: a hello waiting for the pacer's turn to register (pacing.Pacer), or
        those past ANSWERED_PER_TURN of one read."""
        self._paused = False
        """Reading is paused while requests are kept (_hold)."""
        self._queued: Callable[[], bool] | None = None
        """The hello's turn while it waits in the pacer's queue: withdrawn when the connection ends first."""
        self.opening: asyncio.Future[tuple[int, TenantSnapshot]] | None = None
        """The hello's registration while its caller is moved into the tenant's cgroup, off the loop; what came
        after the hello waits for it (kept as in _hold)."""
        self._early: list[bytes] = []
        """Grants and revokes for the session sent before its welcome was written: written after it."""

    # asyncio.Protocol ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self.limits is not None:
            self._deadline(self.limits.hello_s, "no hello")
        first, self._first = self._first, b""
        if first:
            self.data_received(first)

    def _deadline(self, seconds: float, why: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expired, why)

    def _expired(self, why: str) -> None:
        self._timer = None
        if self._transport is not None and not self._ended:
            self._ended = True
            self._dropped("deadline", f"{why} within its deadline", warn=False)
            self._transport.abort()

    def _account(self) -> None:
        """After a read: the unfinished frame's deadline (from its first byte: a drip of bytes does not extend
        it), and its bytes, with those of requests waiting for their turn, against the uid's budget."""
        if self.limits is None:
            return
        partial = self._reader.pending
        if self._sid is not None:  # (before the hello, the hello's deadline runs)
            if partial and self._timer is None:
                self._deadline(self.limits.partial_frame_s, "a partial frame was not completed")
            elif not partial and self._timer is not None:
                self._timer.cancel()
                self._timer = None
        pending = partial + sum(map(len, self._stash or ()))
        if pending == self._held:
            return
        was, self._held = self._held, pending
        if not self.limits.hold(pending - was) and not self._ended:
            self._ended = True
            self._dropped("unfinished", "its uid holds too many bytes of unfinished frames")
            if self._transport is not None:
                self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return
        try:
            payloads = self._reader.feed(data)
        except FrameError as e:
            out: list[bytes] = []
            self._end(out, "RESOURCE_EXHAUSTED", str(e))
            self._account()
            self._send_and_maybe_close(out)
            return
        if self._stash is not None:  # (reading is paused while requests wait: only what was already read)
            self._stash += payloads
            self._account()
        elif payloads and self._sid is None and not self.service.pacer.take():
            self._hold(payloads)  # the hello registers: in a later loop turn, not in this one
            self._queued = self._take_turn
            self.service.pacer.queue(self._queued, self.cred.caller)
        else:
            self._answer_some(payloads)

    def _hold(self, payloads: list[bytes]) -> None:
        """Keep requests read for a later loop turn, and read nothing more meanwhile. Their bytes count against the
        uid's budget as unfinished frames do."""
        self._stash = payloads
        if self._sid is None and self._timer is not None:  # a whole request came within the hello's deadline
            self._timer.cancel()
            self._timer = None
        if self._transport is not None and not self._paused:
            self._paused = True
            self._transport.pause_reading()
        self._account()

    def _take_turn(self) -> bool:
        """A later loop turn: answer the requests kept (the pacer's turn for a hello and what came with it, or the
        rest of a read). False when the connection ended meanwhile: the turn was not used."""
        self._queued = None
        payloads, self._stash = self._stash or [], None
        if self._ended or self._transport is None or self._transport.is_closing():
            self._account()
            return False
        self._answer_some(payloads)
        return True

    def _answer_some(self, payloads: list[bytes]) -> None:
        """Answer at most ANSWERED_PER_TURN requests now; the rest in the next loop turns, so that one read full of
        requests (a read holds up to 256 KiB: thousands of them) cannot hold the loop from every other tenant."""
        unanswered = self._answer_all(payloads[:ANSWERED_PER_TURN])
        rest = payloads[ANSWERED_PER_TURN:]
        if self.opening is not None and not self._ended:  # after the welcome (_opened)
            self._hold(unanswered + rest)
        elif rest and not self._ended:
            self._hold(rest)
            asyncio.get_running_loop().call_soon(self._take_turn)
        elif self._paused and self._transport is not None and not self._ended:
            self._paused = False
            self._transport.resume_reading()

    def _answer_all(self, payloads: list[bytes]) -> list[bytes]:
        """Answer `payloads` in one write, up to a hello whose registration went off the loop: returns those after
        it, unanswered."""
        out: list[bytes] = []  # everything this read answers, in one write
        pushed: list[bytes] = []
        self._pushed = pushed
        unanswered: list[bytes] = []
        try:
            for i, payload in enumerate(payloads):
                try:
                    req = pb.LeaseRequest.FromString(payload)
                except DecodeError:
                    self._end(out, "INVALID_ARGUMENT", "malformed lease request (not a LeaseRequest)")
                    break
                try:
                    if self._sid is None and req.WhichOneof("kind") == "hello":
                        self._hello(req)
                        unanswered = payloads[i + 1:]
                        break
                    reply = self._answer(req)
                except SchedulerError as e:
                    self._end(out, ERROR_CODES[e.kind], str(e))
                    break
                if reply is not None:
                    out.append(frame(reply))
                out += pushed
                pushed.clear()
        finally:
            self._pushed = None
            self._account()
        self._send_and_maybe_close(out)
        return unanswered

    def _hello(self, req: pb.LeaseRequest) -> None:
        """Register the caller and open its session: refusals raise now; the welcome comes once the caller is in
        the tenant's cgroup (_opened), the move being made off the loop."""
        h, cred = req.hello, self.cred
        ask = RegisterAsk(h.tenant, h.weight or None, PRIORITY.get(h.priority), tuple(h.engines), (), cred.pid,
                          cred.uid, self.service.is_admin(cred), alive=cred.alive, contained=cred.contained,
                          caller=cred.caller)
        self.opening = self.service.engine.start_lease_open(ask, h.gpu, self)
        self.opening.add_done_callback(lambda done: self._opened(done, req.seq))

    def _opened(self, done: asyncio.Future[tuple[int, TenantSnapshot]], seq: int) -> None:
        """The hello's registration ended: the welcome (then the grants sent meanwhile and the requests kept), or
        the refusal. A connection closed meanwhile gets no session (one opened is closed at once)."""
        self.opening = None
        early, self._early = self._early, []
        engine = self.service.engine
        err = done.exception()
        if self._ended:
            if err is None:
                engine.lease_close(done.result()[0])
            return
        out: list[bytes] = []
        if err is not None:
            if not isinstance(err, SchedulerError):
                self._log.error("lease hello failed", error=repr(err))
                err = SchedulerError("failed", "the daemon could not register the caller")
            self._end(out, ERROR_CODES[err.kind], str(err))
            self._send_and_maybe_close(out)
            return
        sid, snap = done.result()
        self._sid = sid
        self._log = self._log.bind(tenant=snap.name, session=sid)
        self._log.info("lease session")
        cfg = engine.config
        out.append(frame(pb.LeaseReply(welcome=pb.LeaseWelcome(
            tenant=snapshot_to_pb(snap), session=sid, slice_s=cfg.slice_ms / 1000.0,
            valid_s=cfg.lease_timeout_ms / 1000.0,
        ), seq=seq)))
        self._write(out + early)
        self._take_turn()  # what came after the hello

    def _send_and_maybe_close(self, out: list[bytes]) -> None:
        self._write(out)
        if self._ended and self._transport is not None:
            self._transport.close()  # after what was written: the client reads the error, then EOF

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        self._stash = None
        queued, self._queued = self._queued, None
        if queued is not None:
            self.service.pacer.withdraw(queued, self.cred.caller)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.limits is not None and self._held:
            self.limits.hold(-self._held)
            self._held = 0
        sid, self._sid = self._sid, None
        if sid is not None:
            self.service.engine.lease_close(sid)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        """The client stopped reading: grants and revokes pile up in the transport (bounded by _write)."""

    def resume_writing(self) -> None:
        pass

    # LeaseChannel -----------------------------------------------------------------------------------------
    def send(self, message: LeaseMessage) -> None:
        """The engine's grant or revoke; after the reply being written, when it comes while one is."""
        if isinstance(message, LeaseGrant):
            reply = pb.LeaseReply(grant=pb.LeaseGrant(
                lease=message.lease, engine=message.engine.value, valid_s=message.valid_s,
                contended=message.contended, slice_left_s=message.slice_left_s, jump=message.jump,
            ))
        else:
            reply = pb.LeaseReply(revoke=pb.LeaseRevoke(lease=message.lease, engine=message.engine.value,
                                                        reason=message.reason))
        if self._pushed is not None:
            self._pushed.append(frame(reply))
        elif self.opening is not None:
            self._early.append(frame(reply))
        else:
            self._write([frame(reply)])

    # ----------------------------------------------------------------------------------------------------
    def _write(self, frames: list[bytes]) -> None:
        t = self._transport
        if not frames or t is None or t.is_closing():
            return
        t.write(b"".join(frames))
        unsent = t.get_write_buffer_size()
        if unsent > LEASE_UNSENT_MAX:
            self._ended = True
            self._dropped("unread", f"client left {unsent} bytes of lease replies unread")
            t.abort()

    def _dropped(self, kind: str, reason: str, warn: bool = True) -> None:
        """Log that the connection was dropped (DropLog: the first of its caller's for this `kind` of reason in an
        interval)."""
        self.service.drops(self._log, self.cred.caller, kind, reason, warn)

    def _end(self, out: list[bytes], code: str, details: str) -> None:
        """Answer with the error and end the connection once it is written; later requests are ignored."""
        self._ended = True
        out.append(frame(pb.LeaseReply(error=pb.LeaseError(code=code, details=details))))

    def _answer(self, req: pb.LeaseRequest) -> pb.LeaseReply | None:
        """The reply to one lease message; None for a want or report without a seq (no ack asked)."""
        engine = self.service.engine
        kind = req.WhichOneof("kind")
        if kind == "hello":  # (the first is _hello's)
            raise SchedulerError("invalid", "hello was already sent on this stream")
        if self._sid is None:
            raise SchedulerError("invalid", "the first message on a lease stream must be hello")
        sid = self._sid
        if kind == "want":
            ack = engine.lease_want(sid, req.want.engine)
            return _ack_pb(ack, req.seq) if req.seq else None
        if kind == "report":
            r = req.report
            ack = engine.lease_report(sid, r.engine, r.gpu_seconds, r.release, r.yielded, r.units, r.ended_ago_s)
            return _ack_pb(ack, req.seq) if req.seq else None
        if kind == "session":
            ok, why = engine.lease_codec(sid, req.session.kind, req.session.open)
            return pb.LeaseReply(ack=pb.LeaseAck(admitted=ok, reason=why), seq=req.seq)
        raise SchedulerError("invalid", "empty lease request (set hello, want, report or session)")


def _ack_pb(ack: LeaseAck, seq: int) -> pb.LeaseReply:
    return pb.LeaseReply(ack=pb.LeaseAck(engine=ack.engine.value, held=ack.held, lease=ack.lease), seq=seq)
