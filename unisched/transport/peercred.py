"""Caller identity from the kernel: SO_PEERCRED on the public Unix socket.

grpc does not expose the peer's credentials, so the daemon owns the public socket itself: each accepted
connection's SO_PEERCRED (pid, uid, gid) is read, then its bytes are relayed to the gRPC server on a
private loopback port. The relay's local port names the connection to the servicer, which looks up the
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
from dataclasses import dataclass

import structlog

__all__ = ["PeerCred", "PeerCredRelay"]

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


class PeerCredRelay:
    def __init__(self, socket_path: str, backend_port: int, max_connections: int = 4096) -> None:
        self.socket_path = socket_path
        self.backend_port = backend_port
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
        port = None
        writer: asyncio.StreamWriter | None = None
        backend_writer: asyncio.StreamWriter | None = None
        try:
            pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=_CHUNK)
            backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
            port = backend_writer.get_extra_info("sockname")[1]
            self._by_port[port] = PeerCred(pid, uid, gid)
            await asyncio.gather(_pump(reader, backend_writer), _pump(backend_reader, writer))
        except (ConnectionError, OSError):
            pass
        finally:
            if port is not None:
                self._by_port.pop(port, None)
            if writer is None:
                conn.close()
            for w in (writer, backend_writer):
                if w is not None:
                    w.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
