"""Caller identity from the kernel: SO_PEERCRED on the public Unix socket, which the daemon accepts itself.

Each accepted connection's SO_PEERCRED (pid, uid, gid) is read and the connecting process pinned by a pidfd
(identity.py), then its opening bytes decide where it goes. A
lease stream (it opens with leasewire.MAGIC) is handed to the lease service with those credentials and served
in this loop. Anything else is gRPC: grpc does not expose the peer's credentials, so its bytes are relayed to
the gRPC server on a private loopback port. The relay's local port names the connection to the servicer, which looks up the
credentials by it. A connection that reaches the private port directly has no entry and is refused
everything but the public read-only calls, so identity cannot be forged by a request field or a side door.

What one user's connections may cost is bounded (options.py gives each number's reason): connections per uid,
with a reserve the global cap keeps for admins; a deadline for a connection's opening bytes, a lease stream's
hello and each partial lease frame; the bytes of unfinished frames per uid; and an idle timeout for relayed
gRPC connections. Refusals happen at accept, before any read.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from unisched.logs import Throttle
from unisched.transport.identity import PeerCred, peer_of
from unisched.transport.options import (
    ADMIN_RESERVE,
    GRPC_IDLE_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_UID,
    MAX_PARTIAL_BYTES_PER_UID,
    OPENING_DEADLINE_S,
    PARTIAL_FRAME_S,
    TRIM_AFTER_CLOSED,
)
from unisched_wire.leasewire import MAGIC, is_lease_opening

__all__ = ["FrontDoorLimits", "LeaseHandler", "PeerCredRelay", "StreamLimits"]

log = structlog.get_logger("unisched.transport")
_CHUNK = 1 << 16
FDS_PER_CONNECTION = 4  # the accepted Unix socket, its caller's pidfd, the relay's loopback socket, the gRPC server's end
FD_RESERVE = 256  # for everything else: cgroup files, state file, logs, seccomp listeners handed over by tenants
BACKLOG = 1024  # a burst of clients queues in the kernel instead of getting EAGAIN (asyncio's default is 100)
REFUSAL_LOG_INTERVAL_S = 1.0
"""At most one 'too many connections' line a second, saying how many were refused since the last."""
ACCEPT_BATCH = 256
"""Connections taken from the backlog in one turn of the loop once one is ready. Refusing is cheap (no read, no
task), so a flood is drained quickly and root's connection, queued behind it, is reached within the turn."""
_ADMIN = -1
"""The bucket of connections admitted into the admins' reserve (not counted against a uid)."""


@dataclass(frozen=True)
class FrontDoorLimits:
    """The relay's limits (options.py says why each default is what it is); tests may pass smaller ones."""

    per_uid: int = MAX_CONNECTIONS_PER_UID
    admin_reserve: int = ADMIN_RESERVE
    opening_s: float = OPENING_DEADLINE_S
    partial_frame_s: float = PARTIAL_FRAME_S
    partial_bytes_per_uid: int = MAX_PARTIAL_BYTES_PER_UID
    grpc_idle_s: float = GRPC_IDLE_S


@dataclass(frozen=True)
class StreamLimits:
    """What one lease connection is held to: its hello and each partial frame in time, and its unfinished
    frames' bytes against its uid's budget (`hold(delta)` is False once that budget is exceeded)."""

    hello_s: float
    partial_frame_s: float
    hold: Callable[[int], bool]


def connection_budget(wanted: int) -> int:
    """How many relayed connections the open-file limit allows, raising the soft limit towards the hard one
    first. Past it, accept() would fail with EMFILE (asyncio then spins logging it and gRPC stops accepting),
    so the relay refuses connections cleanly before that point."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted * FDS_PER_CONNECTION + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as e:
                log.warning("could not raise the open-file limit", soft=soft, hard=hard, error=str(e))
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - FD_RESERVE) // FDS_PER_CONNECTION))


LeaseHandler = Callable[[PeerCred, bytes, asyncio.Future[None], StreamLimits], asyncio.Protocol]
"""Makes the protocol serving one lease connection from its caller, the bytes that came after MAGIC, a future it
completes when the connection is lost, and the limits it is held to."""


class PeerCredRelay:
    def __init__(self, socket_path: str, backend_port: int, max_connections: int = MAX_CONNECTIONS,
                 lease: LeaseHandler | None = None, is_admin: Callable[[PeerCred], bool] | None = None,
                 limits: FrontDoorLimits | None = None) -> None:
        self.socket_path = socket_path
        self.backend_port = backend_port
        self.lease = lease
        self.is_admin = is_admin or (lambda cred: False)
        self.limits = limits or FrontDoorLimits()
        self.max_connections = max_connections
        self.refused = 0
        self._by_port: dict[int, PeerCred] = {}
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._per_uid: Counter[int] = Counter()
        """Connections held per bucket: a non-admin uid, or _ADMIN for those in the admins' reserve."""
        self._partial: Counter[int] = Counter()
        """Bytes of unfinished lease frames held per bucket."""
        self._relayed: dict[int, _Half] = {}
        """The client side of each relayed gRPC connection, by backend port (for the idle sweep)."""
        self._refusals = Throttle(REFUSAL_LOG_INTERVAL_S)
        self._closed_since_trim = 0
        self._trim_pending = False

    def lookup(self, grpc_peer: str) -> PeerCred | None:
        """grpc's context.peer() is 'ipv4:127.0.0.1:PORT' for relayed connections."""
        host, _, port = grpc_peer.rpartition(":")
        if host not in ("ipv4:127.0.0.1",) or not port.isdigit():
            return None
        return self._by_port.get(int(port))

    @property
    def connections(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        budget = connection_budget(self.max_connections)
        if budget < self.max_connections:
            log.warning(
                "open-file limit bounds client connections", max_connections=budget, wanted=self.max_connections,
                nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            )
            self.max_connections = budget
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.socket_path)
            listener.listen(BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._acceptor = asyncio.create_task(self._accept_loop(listener))
        self._sweeper = asyncio.create_task(self._sweep_idle())

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Wait for a connection, then take what the backlog holds (up to ACCEPT_BATCH), deciding on each as it
        is accepted: admitted ones get a task, the rest are closed at once, so limits apply before any read and
        a burst never runs the daemon out of file descriptors (EMFILE)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:
                if listener.fileno() == -1:
                    return  # closed
                await _accept_failed(e)
                continue
            self._admit(conn)
            for _ in range(ACCEPT_BATCH):
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    await _accept_failed(e)
                    break
                self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            cred = peer_of(conn)
        except OSError:
            conn.close()
            return
        bucket = self._bucket(cred)
        if bucket is None:
            self._refuse(cred.uid)
            if cred.process is not None:
                cred.process.close()
            conn.close()
            return
        self._per_uid[bucket] += 1
        task = asyncio.create_task(self._handle(conn, cred, bucket))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._closed(t, bucket))

    def _bucket(self, cred: PeerCred) -> int | None:
        """Which count the connection goes to, or None to refuse it: a uid's own (at most `per_uid`, and
        only while the global cap minus the admins' reserve has room), else the reserve if it is an admin's."""
        total = len(self._tasks)
        if total >= self.max_connections:
            return None
        reserve = min(self.limits.admin_reserve, self.max_connections // 4)
        if self._per_uid[cred.uid] < self.limits.per_uid and total < self.max_connections - reserve:
            return cred.uid
        return _ADMIN if self.is_admin(cred) else None

    def _closed(self, task: asyncio.Task[None], bucket: int) -> None:
        self._tasks.discard(task)
        self._per_uid[bucket] -= 1
        if self._per_uid[bucket] <= 0:
            del self._per_uid[bucket]
        self._closed_since_trim += 1
        if self._closed_since_trim >= TRIM_AFTER_CLOSED and not self._trim_pending:
            self._trim_pending = True
            asyncio.get_running_loop().call_later(1.0, self._trim)

    def _trim(self) -> None:
        """Give the heap a burst of connections left behind back to the system (glibc only)."""
        self._trim_pending = False
        self._closed_since_trim = 0
        _malloc_trim()

    def _hold(self, bucket: int, delta: int) -> bool:
        """Account bytes of a lease connection's unfinished frame; False when its uid is over its budget."""
        held = self._partial[bucket] + delta
        if held <= 0:
            self._partial.pop(bucket, None)
        else:
            self._partial[bucket] = held
        return bucket == _ADMIN or held <= self.limits.partial_bytes_per_uid

    def _refuse(self, uid: int) -> None:
        """Count a refused connection; log the first of a burst and then at most once a second (a flood of
        clients must not become a flood of log lines)."""
        self.refused += 1
        held_back = self._refusals.allow("refused")
        if held_back is not None:
            log.warning("too many connections; refusing", limit=self.max_connections, per_uid=self.limits.per_uid,
                        uid=uid, refused=held_back + 1)

    async def _sweep_idle(self) -> None:
        """Close relayed gRPC connections that carried nothing for `grpc_idle_s` (see options.GRPC_IDLE_S)."""
        idle = self.limits.grpc_idle_s
        while True:
            await asyncio.sleep(max(0.05, idle / 4))
            cutoff = time.monotonic() - idle
            for half in [h for h in self._relayed.values() if h.activity[0] < cutoff]:
                if half.transport is not None:
                    half.transport.close()

    async def close(self) -> None:
        for task in (self._acceptor, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._listener is not None:
            self._listener.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def _stream_limits(self, bucket: int) -> StreamLimits:
        return StreamLimits(self.limits.opening_s, self.limits.partial_frame_s, lambda d: self._hold(bucket, d))

    async def _handle(self, conn: socket.socket, cred: PeerCred, bucket: int) -> None:
        """Serve one connection: a lease stream in this loop, or gRPC through the relay. The relay is two
        asyncio Protocols that write what one side receives straight to the other (one callback per chunk and
        direction); the client's bytes are held until its credentials are registered under the backend port."""
        loop = asyncio.get_running_loop()
        port = None
        lease_transport: asyncio.BaseTransport | None = None
        done: asyncio.Future[None] = loop.create_future()
        client, backend = _Half(done), _Half(done)
        client.peer, backend.peer = backend, client
        backend.activity = client.activity
        backend.ready = True
        try:
            try:
                first = await asyncio.wait_for(_opening(loop, conn), self.limits.opening_s)
            except TimeoutError:
                return  # silent: it held one socket for a few seconds
            if not first:
                return
            if self.lease is not None and is_lease_opening(first):
                proto = self.lease(cred, first[len(MAGIC):], done, self._stream_limits(bucket))
                lease_transport, _ = await loop.connect_accepted_socket(lambda: proto, sock=conn)
                await done
                return
            client._held.append(first)
            await loop.connect_accepted_socket(lambda: client, sock=conn)
            await loop.create_connection(lambda: backend, "127.0.0.1", self.backend_port)
            assert backend.transport is not None
            port = backend.transport.get_extra_info("sockname")[1]
            self._by_port[port] = cred
            self._relayed[port] = client
            client.start()
            await done
        except (ConnectionError, OSError):
            pass
        finally:
            if port is not None:
                self._by_port.pop(port, None)
                self._relayed.pop(port, None)
            if cred.process is not None:
                cred.process.close()
            for half in (client, backend):
                if half.transport is not None:
                    half.transport.close()
            if lease_transport is not None:
                lease_transport.close()
            elif client.transport is None:
                conn.close()


async def _accept_failed(e: OSError) -> None:
    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
        log.error("out of file descriptors accepting a client; pausing accepts", error=e.strerror)
        await asyncio.sleep(0.1)  # back off; the clients wait in the kernel's backlog meanwhile
    elif e.errno not in (errno.ECONNABORTED, errno.EAGAIN, errno.EINTR, errno.EPROTO):
        log.error("accepting a client failed", error=e.strerror)
        await asyncio.sleep(0.1)


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


async def _opening(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    """A connection's first bytes, enough to tell a lease stream from gRPC (b"" if it closed first). Both kinds
    of client speak first, so nothing waits on the daemon; a silent one holds only its own socket until the
    opening deadline."""
    first = b""
    while True:
        chunk = await loop.sock_recv(conn, _CHUNK)
        if not chunk:
            return b""
        first += chunk
        if is_lease_opening(first) is not None:
            return first


class _Half(asyncio.Protocol):
    """One side of a relayed connection: what it receives is written to the other side's transport."""

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.peer: _Half | None = None
        self.transport: asyncio.Transport | None = None
        self.ready = False
        self._held: list[bytes] = []
        self._eof = False
        self.got_eof = False
        self.activity = [time.monotonic()]
        """When either side of the connection last carried bytes (shared by both halves)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def start(self) -> None:
        """Forward from now on (what arrived before goes first)."""
        self.ready = True
        for data in self._held:
            self._forward(data)
        self._held.clear()
        if self._eof:
            self.eof_received()

    def _forward(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.activity[0] = time.monotonic()
        if self.ready:
            self._forward(data)
        else:
            self._held.append(data)

    def eof_received(self) -> bool:
        if not self.ready:
            self._eof = True
            return True
        self.got_eof = True
        t = self.peer.transport if self.peer else None
        if t is None or (self.peer is not None and self.peer.got_eof) or not t.can_write_eof():
            return False  # both directions are done: close (connection_lost then closes the other side)
        with contextlib.suppress(OSError, RuntimeError):
            t.write_eof()
        return True  # half-closed: the other direction may still carry the answer

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    # flow control: when our side cannot take more, stop reading the other side
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()
