"""gRPC on the daemon's Unix socket: grpclib's HTTP/2 server in the daemon's own loop, one connection at a time.

grpcio's server cannot be handed an accepted connection and never tells a call its peer's SO_PEERCRED, so it
would need a relay in front of it on a loopback TCP port, which any local user can reach. Here the front door accepts
the connection, reads its credentials, and this module runs grpclib's HTTP/2 protocol on that very socket with a
method table whose handlers carry those credentials: a call's identity is the connection's, fixed at accept.

grpclib buffers what a connection sends until its handlers read it, with no limit of its own on a message's
size. So each connection is held to the front door's limits here: a request that declares more than
MAX_MESSAGE_BYTES is answered RESOURCE_EXHAUSTED and the rest of it dropped unread (as grpcio did), one that
sends more than it declared ends the connection, and a request's bytes count against its uid's budget until its
call is answered; a request must arrive whole within the partial-frame
deadline; an idle connection is closed. h2 bounds the rest: 100 concurrent streams, 64 KiB of headers, 64
CONTINUATION frames. What a connection's frames may cost the loop is bounded in h2guard.py (a slice of its
bytes per turn, resets and control frames per second), and a connection is not read while its replies sit
unread. grpclib's per-connection parts (Handler, H2Protocol) are used directly because the daemon
does its own accepting; they are grpclib 0.4's (pyproject pins it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import structlog
from google.protobuf.message import Message
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.const import Handler as MethodHandler
from grpclib.encoding.proto import ProtoCodec
from grpclib.events import _DispatchServerEvents
from grpclib.exceptions import GRPCError
from grpclib.protocol import Connection, EventsProcessor, H2Protocol, _set_nodelay
from grpclib.server import Handler, Stream
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, RequestReceived, StreamEnded
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings

from unisched.transport.droplog import DropLog
from unisched.transport.frontdoor import StreamLimits, read_opening
from unisched.transport.h2guard import FEED_PER_TURN, FrameBudget
from unisched.transport.identity import PeerCred
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAX_REQUEST_BYTES, frame, is_lease_opening

__all__ = ["PREFACE", "Call", "GrpcDoor", "fail", "is_h2_opening"]

log = structlog.get_logger("unisched.grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What every HTTP/2 client sends first (RFC 9113 3.4)."""
MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES
"""One bound for every request, gRPC or lease stream."""
_PREFIX = 5
"""gRPC's message prefix: a compression flag and the message's length (4 bytes, big-endian)."""
_SWEEP_S = 0.5
"""How often open connections are checked against their partial-request and idle deadlines."""
UNSENT_MAX = 256 * 1024
"""Bytes the daemon may hold unsent for one connection when it reads from it; past this the connection is ended.
h2 acknowledges every PING and SETTINGS frame at once, so a client that sends them and never reads would grow
the daemon by what it sends: reading stops instead while the transport holds more than its high-water mark
(64 KiB; pause_writing), so at a read this is at most that plus one FEED_PER_TURN slice's acknowledgements and
the cap is a backstop. A reply larger than the cap (every tenant at MAX_TENANTS is ~2.5 MB) does not trip it:
while it drains, reading, and so this check, waits."""


def is_h2_opening(first: bytes) -> bool | None:
    """Whether a connection's first bytes open HTTP/2; None while too few have come to tell."""
    if first.startswith(PREFACE):
        return True
    return None if PREFACE.startswith(first) else False


@dataclass
class Call:
    """What a servicer method sees of its call besides the request: who called (None over TLS: no SO_PEERCRED
    there) and the trailing metadata it wants sent with its reply."""

    caller: PeerCred | None
    trailers: dict[str, str] = field(default_factory=dict)


Method = Callable[[Any, Call], Awaitable[Message]]


def fail(code: str, details: str) -> NoReturn:
    """End the call with gRPC status `code` (a grpc.StatusCode name) and `details`."""
    raise GRPCError(Status[code], details)


class GrpcDoor:
    """Serves the gRPC socket's connections (the front door's Serve) and the optional TLS listener, with the
    methods of `servicer` named as in the proto's service."""

    def __init__(self, servicer: object, lease_socket: str) -> None:
        service = pb.DESCRIPTOR.services_by_name["Unisched"]
        self._table: dict[str, tuple[Method, type, type]] = {
            f"/{service.full_name}/{m.name}": (getattr(servicer, m.name), getattr(pb, m.input_type.name),
                                               getattr(pb, m.output_type.name))
            for m in service.methods
        }
        self.lease_socket = lease_socket
        self.caller: Callable[[PeerCred | None], PeerCred | None] = lambda cred: cred
        """Who a call's method sees for its connection's credentials (a test may stand in other uids)."""
        self._config = Configuration().__for_server__()
        self._h2 = H2Configuration(client_side=False, header_encoding="ascii", validate_inbound_headers=False,
                                   validate_outbound_headers=False, normalize_inbound_headers=False,
                                   normalize_outbound_headers=False)  # grpclib's server settings
        self._codec = ProtoCodec()
        self._dispatch = _DispatchServerEvents()
        self._open: set[_Connection] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._tls: asyncio.Server | None = None
        self.clock: Callable[[], float] = time.monotonic
        """The clock of connections' frame budgets (h2guard), made after it is set (a test's stands still)."""
        self._drops = DropLog("grpc connection dropped")
        """Throttles the connections' 'grpc connection dropped' lines (a test may give it its own clock)."""

    @property
    def connections(self) -> int:
        return len(self._open)

    def _methods(self, cred: PeerCred | None) -> Mapping[str, MethodHandler]:
        return {path: MethodHandler(self._unary(fn, cred), Cardinality.UNARY_UNARY, req, rep)
                for path, (fn, req, rep) in self._table.items()}

    def _unary(self, fn: Method, cred: PeerCred | None) -> Callable[[Stream[Any, Any]], Awaitable[None]]:
        async def handle(stream: Stream[Any, Any]) -> None:
            request = await stream.recv_message()
            call = Call(self.caller(cred))
            reply = await fn(request, call)
            await stream.send_message(reply)
            if call.trailers:
                await stream.send_trailing_metadata(metadata=call.trailers)
        return handle

    def _connection(self, cred: PeerCred | None, first: bytes, limits: StreamLimits) -> _Connection:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep())
        handler = _Handler(dict(self._methods(cred)), self._codec, None, self._dispatch)
        who: dict[str, int | None] = {"uid": None} if cred is None else {**cred.who}
        dropped = functools.partial(self._drops, log.bind(**who), None if cred is None else cred.caller)
        conn = _Connection(handler, self._config, self._h2, first, limits, self._open, dropped, FrameBudget(self.clock))
        handler.connection = conn
        return conn

    async def serve(self, conn: socket.socket, cred: PeerCred, limits: StreamLimits) -> None:
        """One admitted connection of the Unix socket: HTTP/2's preface within the opening deadline, then calls
        until either side ends it. Lease bytes are answered with a LeaseError naming the lease socket."""
        first = await read_opening(conn, is_h2_opening, limits.hello_s)
        if not is_h2_opening(first):
            if first and is_lease_opening(first):
                self._wrong_socket(conn)
            conn.close()
            return
        loop = asyncio.get_running_loop()
        proto = self._connection(cred, first, limits)
        transport, _ = await loop.connect_accepted_socket(lambda: proto, sock=conn)
        try:
            await proto.done
        finally:
            transport.close()

    def _wrong_socket(self, conn: socket.socket) -> None:
        error = pb.LeaseError(code="FAILED_PRECONDITION",
                              details=f"this is the unisched daemon's gRPC socket; lease streams go to {self.lease_socket}")
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RD)  # what it sent stays unread: closing must not reset the reply
            conn.send(frame(pb.LeaseReply(error=error)))

    async def start_tls(self, host: str, port: int, context: ssl.SSLContext) -> None:
        """The TCP listener with TLS client certificates: calls there have no caller (public calls only)."""
        unbounded = StreamLimits(self._config._keepalive_timeout, 5.0, lambda delta: True)
        self._tls = await asyncio.get_running_loop().create_server(
            lambda: self._connection(None, b"", unbounded), host, port, ssl=context)

    async def close(self) -> None:
        if self._tls is not None:
            self._tls.close()
        for conn in list(self._open):
            conn.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.monotonic()
            for conn in list(self._open):
                conn.check(now)


@dataclass
class _Request:
    """A call's request as it arrives, until the call is answered."""

    began: float
    size: int = 0
    prefix: bytes = b""
    whole: bool = False
    refused: bool = False


class _Handler(Handler):
    """grpclib's per-connection call handler, telling its connection when each call is done."""

    connection: _Connection | None = None

    def accept(self, stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            release_stream()
            if self.connection is not None:
                self.connection.answered(stream.id)
        super().accept(stream, headers, release)
        # grpclib releases a stream in its call's `finally`, which a call cancelled before its first step never
        # reaches (its stream reset in the read that opened it, or refused by _refuse): a client sending HEADERS
        # and RST_STREAM together, stream after stream, would leave each one held. So also release on the task's end.
        self._tasks[stream].add_done_callback(lambda _task: release())


class _Connection(H2Protocol):
    """grpclib's HTTP/2 protocol on one connection, held to the front door's limits (module docstring)."""

    def __init__(self, handler: _Handler, config: Configuration, h2_config: H2Configuration, first: bytes,
                 limits: StreamLimits, registry: set[_Connection], dropped: Callable[[str, str], None],
                 budget: FrameBudget) -> None:
        super().__init__(handler, config, h2_config)
        self._dropped = dropped
        """Logs a drop (DropLog, bound to the connection's logger and caller): kind of reason, reason."""
        self._budget = budget
        self._backlog = bytearray()
        """Bytes read and not yet given to h2 (at most FEED_PER_TURN a turn); reading is paused meanwhile."""
        self._feeding = False
        """A later turn's feed is scheduled."""
        self._ended = False
        self._pauses: set[str] = set()
        """Why reading is paused now: "backlog" (bytes wait in _backlog), "unread" (the client is not reading)."""
        self._unread_since = 0.0
        self.limits = limits
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._first = first
        self._registry = registry
        self._transport: asyncio.BaseTransport | None = None
        self._requests: dict[int, _Request] = {}
        """Calls not yet answered, by stream id."""
        self._refusing: set[asyncio.Task[None]] = set()
        self._unparsed = 0
        """Bytes read since the last HTTP/2 event (a header block or frame still coming)."""
        self._unparsed_since = 0.0
        self._held = 0
        self._last = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._h2_made(transport)
        self._transport = transport
        self._registry.add(self)
        first, self._first = self._first, b""
        if first:
            self.data_received(first)

    def _h2_made(self, transport: asyncio.BaseTransport) -> None:
        """grpclib 0.4's H2Protocol.connection_made, but the H2Connection holds the peer to `limits.calls` streams
        at once from its first SETTINGS frame: h2 enforces a local setting before the peer acknowledges it only
        when it is the initial value (a later update_settings would let a client's first flight of 100 in)."""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _set_nodelay(sock)
        h2_conn = H2Connection(config=self.h2_config)
        h2_conn.local_settings = Settings(client=False, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: self.limits.calls,
            SettingCodes.MAX_HEADER_LIST_SIZE: h2_conn.DEFAULT_MAX_HEADER_LIST_SIZE,
        })
        h2_conn.initiate_connection()
        initial = h2_conn.local_settings.initial_window_size
        conn_delta = self.config.http2_connection_window_size - initial
        stream_delta = self.config.http2_stream_window_size - initial
        if conn_delta:
            h2_conn.increment_flow_control_window(conn_delta)
        if stream_delta:
            h2_conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size})
        self.connection = Connection(h2_conn, cast(asyncio.Transport, transport), config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)

    def data_received(self, data: bytes) -> None:
        """Keep what was read; h2 gets it FEED_PER_TURN at a time, one slice a turn (h2guard)."""
        if self._ended:
            return
        self._backlog += data
        if not self._feeding:
            self._feed_some()

    def _feed_some(self) -> None:
        self._feeding = False
        if self._ended or "unread" in self._pauses:
            return  # (resume_writing goes on)
        chunk = bytes(self._backlog[:FEED_PER_TURN])
        del self._backlog[:FEED_PER_TURN]
        self._feed(chunk)
        if self._ended:
            return
        if self._backlog:
            self._feeding = True
            self._pause("backlog", True)
            asyncio.get_running_loop().call_soon(self._feed_some)
        else:
            self._pause("backlog", False)

    def pause_writing(self) -> None:
        """The client stopped reading: read nothing more from it until it does (what it sends makes h2 write)."""
        super().pause_writing()
        self._unread_since = time.monotonic()
        self._pause("unread", True)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._pause("unread", False)
        if self._backlog and not self._feeding and not self._ended:
            self._feeding = True
            asyncio.get_running_loop().call_soon(self._feed_some)

    def _pause(self, why: str, on: bool) -> None:
        """Pause reading while any reason holds; resume once none does."""
        was = bool(self._pauses)
        if on:
            self._pauses.add(why)
        else:
            self._pauses.discard(why)
        t = cast(asyncio.ReadTransport | None, self._transport)
        if t is None or t.is_closing() or was == bool(self._pauses):
            return
        if self._pauses:
            t.pause_reading()
        else:
            t.resume_reading()

    def _feed(self, data: bytes) -> None:
        now = self._last = time.monotonic()
        try:
            events = self.connection.feed(data)
        except ProtocolError:
            self.abort()
            return
        self.connection.flush()
        if events:
            self._unparsed = 0
        else:
            self._unparsed_since = self._unparsed_since if self._unparsed else now
            self._unparsed += len(data)
        opened: set[int] = set()  # streams this slice opened: one it also resets is the rapid-reset pattern
        for event in events:
            if isinstance(event, RequestReceived) and event.stream_id is not None:
                opened.add(event.stream_id)
            over = self._budget.over(event, opened)
            if over is not None:
                self._drop("frames", over)
                return
            request = self._requests.get(getattr(event, "stream_id", None) or 0)
            if isinstance(event, RequestReceived) and event.stream_id is not None:
                self._requests[event.stream_id] = _Request(now)
            elif isinstance(event, DataReceived) and request is not None:
                if not self._data(event, request):
                    return
                if request.refused:
                    continue
            elif isinstance(event, StreamEnded) and request is not None:
                request.whole = True
                if request.refused:
                    continue
            self.processor.process(event)
        self.connection.flush()
        self._account()
        t = cast(asyncio.WriteTransport | None, self._transport)
        unsent = t.get_write_buffer_size() if t is not None else 0
        if unsent > UNSENT_MAX:
            self._drop("unread", f"client left {unsent} bytes unread")

    def _drop(self, kind: str, reason: str) -> None:
        """End the connection; `kind`: its reason's, for the log's throttle (the reason's text carries numbers)."""
        self._dropped(kind, reason)
        self.abort()

    def _data(self, event: DataReceived, request: _Request) -> bool:
        """Count a request's bytes; refuse it once its prefix declares too much (False: the connection ended)."""
        size = event.flow_controlled_length or 0
        request.size += size
        if request.refused:
            self.connection.ack(event.stream_id, size)  # dropped unread: let the client send the rest
            return True
        if len(request.prefix) < _PREFIX:
            request.prefix += (event.data or b"")[:_PREFIX - len(request.prefix)]
        declared = int.from_bytes(request.prefix[1:], "big") if len(request.prefix) == _PREFIX else 0
        if declared > MAX_MESSAGE_BYTES:
            request.refused = True
            self.connection.ack(event.stream_id, size)
            self._refuse(event.stream_id, declared)
        elif request.size > _PREFIX + max(declared, MAX_MESSAGE_BYTES):
            self.abort()  # more than one message, or more than it declared: not a unary gRPC client
            return False
        return True

    def _refuse(self, stream_id: int, declared: int) -> None:
        stream = self.processor.streams.get(stream_id)
        if stream is None:
            return

        with contextlib.suppress(KeyError):
            self.handler.cancel(stream)  # its call waits for the message: it ends without a word

        async def refuse() -> None:
            with contextlib.suppress(Exception):
                await stream.send_headers([
                    (":status", "200"), ("content-type", "application/grpc+proto"),
                    ("grpc-status", str(Status.RESOURCE_EXHAUSTED.value)),
                    ("grpc-message", f"request of {declared} bytes is over the limit of {MAX_MESSAGE_BYTES}"),
                ], end_stream=True)
                if stream.closable:
                    stream.reset_nowait()

        task = asyncio.get_running_loop().create_task(refuse())
        self._refusing.add(task)
        task.add_done_callback(self._refusing.discard)

    def answered(self, stream_id: int) -> None:
        self._last = time.monotonic()
        if self._requests.pop(stream_id, None) is not None:
            self._account()

    def _account(self) -> None:
        held = self._unparsed + len(self._backlog) + sum(r.size for r in self._requests.values() if not r.refused)
        delta, self._held = held - self._held, held
        if delta and not self.limits.hold(delta):
            self.abort()

    def check(self, now: float) -> None:
        """Past a deadline: a request (or a header block) not whole within partial_frame_s, nothing at all
        carried for idle_s with no call in flight, or replies left unread for idle_s."""
        late = now - self.limits.partial_frame_s
        unfinished = (self._unparsed and self._unparsed_since < late) or any(
            not r.whole and r.began < late for r in self._requests.values())
        idle = not self._requests and self._last < now - self.limits.idle_s
        unread = "unread" in self._pauses and self._unread_since < now - self.limits.idle_s
        if unfinished or idle or unread:
            self.abort()

    def abort(self) -> None:
        self._ended = True
        self._backlog.clear()
        if self._transport is not None:
            self._transport.abort()  # type: ignore[attr-defined]

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._registry.discard(self)
        self._requests.clear()
        if self._held:
            self.limits.hold(-self._held)
            self._held = 0
        if not self.done.done():
            self.done.set_result(None)
