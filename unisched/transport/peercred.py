"""Caller identity from the kernel: SO_PEERCRED on the public Unix socket, which the daemon accepts itself.

Each accepted connection's SO_PEERCRED (pid, uid, gid) is read, then its opening bytes decide where it goes. A
lease stream (it opens with leasewire.MAGIC) is handed to the lease service with those credentials and served
in this loop. Anything else is gRPC: grpc does not expose the peer's credentials, so its bytes are relayed to
the gRPC server on a private loopback port. The relay's local port names the connection to the servicer, which looks up the
credentials by it. A connection that reaches the private port directly has no entry and is refused
everything but the public read-only calls, so identity cannot be forged by a request field or a side door.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import resource
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from unisched.transport.leasewire import MAGIC, is_lease_opening
from unisched.transport.options import MAX_CONNECTIONS

__all__ = ["LeaseHandler", "PeerCred", "PeerCredRelay"]

log = structlog.get_logger("unisched.transport")
_CRED = struct.Struct("3i")
_CHUNK = 1 << 16
FDS_PER_CONNECTION = 3  # the accepted Unix socket, the relay's loopback socket, and the gRPC server's end of it
FD_RESERVE = 256  # for everything else: cgroup files, state file, logs, seccomp listeners handed over by tenants
BACKLOG = 1024  # a burst of clients queues in the kernel instead of getting EAGAIN (asyncio's default is 100)


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


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


LeaseHandler = Callable[[PeerCred, bytes, asyncio.Future[None]], asyncio.Protocol]
"""Makes the protocol serving one lease connection from its caller, the bytes that came after MAGIC, and a
future it completes when the connection is lost."""


class PeerCredRelay:
    def __init__(self, socket_path: str, backend_port: int, max_connections: int = MAX_CONNECTIONS,
                 lease: LeaseHandler | None = None) -> None:
        self.socket_path = socket_path
        self.backend_port = backend_port
        self.lease = lease
        self.max_connections = max_connections
        self.refused = 0
        self._by_port: dict[int, PeerCred] = {}
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._refused_logged = 0
        self._refusal_logged_at = 0.0

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

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accept one connection at a time and decide on it before the next: asyncio's own server accepts a
        whole backlog in one go, so a burst of clients ran the daemon out of file descriptors (EMFILE) before
        any limit could apply."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:
                if listener.fileno() == -1:
                    return  # closed
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("out of file descriptors accepting a client; pausing accepts", error=e.strerror)
                    await asyncio.sleep(0.1)  # back off; the clients wait in the kernel's backlog meanwhile
                elif e.errno not in (errno.ECONNABORTED, errno.EAGAIN, errno.EINTR, errno.EPROTO):
                    log.error("accepting a client failed", error=e.strerror)
                    await asyncio.sleep(0.1)
                continue
            if len(self._tasks) >= self.max_connections:
                self._refuse()
                conn.close()
                continue
            task = asyncio.create_task(self._handle(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _refuse(self) -> None:
        """Count a refused connection; log the first of a burst and then at most once a second (a flood of
        clients must not become a flood of log lines)."""
        self.refused += 1
        now = time.monotonic()
        if self._refused_logged == 0 or now - self._refusal_logged_at >= 1.0:
            log.warning("too many connections; refusing", limit=self.max_connections,
                        refused=self.refused - self._refused_logged)
            self._refused_logged = self.refused
            self._refusal_logged_at = now

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._acceptor
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _handle(self, conn: socket.socket) -> None:
        """Serve one connection: a lease stream in this loop, or gRPC through the relay. The relay is two
        asyncio Protocols that write what one side receives straight to the other (one callback per chunk and
        direction); the client's bytes are held until its credentials are registered under the backend port."""
        loop = asyncio.get_running_loop()
        port = None
        lease_transport: asyncio.BaseTransport | None = None
        done: asyncio.Future[None] = loop.create_future()
        client, backend = _Half(done), _Half(done)
        client.peer, backend.peer = backend, client
        backend.ready = True
        try:
            cred = PeerCred(*_CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)))
            first = await _opening(loop, conn)
            if not first:
                return
            if self.lease is not None and is_lease_opening(first):
                proto = self.lease(cred, first[len(MAGIC):], done)
                lease_transport, _ = await loop.connect_accepted_socket(lambda: proto, sock=conn)
                await done
                return
            client._held.append(first)
            await loop.connect_accepted_socket(lambda: client, sock=conn)
            await loop.create_connection(lambda: backend, "127.0.0.1", self.backend_port)
            assert backend.transport is not None
            port = backend.transport.get_extra_info("sockname")[1]
            self._by_port[port] = cred
            client.start()
            await done
        except (ConnectionError, OSError):
            pass
        finally:
            if port is not None:
                self._by_port.pop(port, None)
            for half in (client, backend):
                if half.transport is not None:
                    half.transport.close()
            if lease_transport is not None:
                lease_transport.close()
            elif client.transport is None:
                conn.close()


async def _opening(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    """A connection's first bytes, enough to tell a lease stream from gRPC (b"" if it closed first). Both kinds
    of client speak first, so nothing waits on the daemon; a silent one holds only its own socket."""
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
