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
import socket
import struct
from dataclasses import dataclass

import structlog

__all__ = ["PeerCred", "PeerCredRelay"]

log = structlog.get_logger("unisched.transport")
_CRED = struct.Struct("3i")
_CHUNK = 1 << 16


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
        self._by_port: dict[int, PeerCred] = {}
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def lookup(self, grpc_peer: str) -> PeerCred | None:
        """grpc's context.peer() is 'ipv4:127.0.0.1:PORT' for relayed connections."""
        host, _, port = grpc_peer.rpartition(":")
        if host not in ("ipv4:127.0.0.1",) or not port.isdigit():
            return None
        return self._by_port.get(int(port))

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path=self.socket_path, limit=_CHUNK)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        port = None
        backend_writer: asyncio.StreamWriter | None = None
        try:
            if len(self._tasks) > self.max_connections:
                log.warning("too many connections; refusing one", limit=self.max_connections)
                return
            sock: socket.socket = writer.get_extra_info("socket")
            pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
            port = backend_writer.get_extra_info("sockname")[1]
            self._by_port[port] = PeerCred(pid, uid, gid)
            await asyncio.gather(_pump(reader, backend_writer), _pump(backend_reader, writer))
        except (ConnectionError, OSError):
            pass
        finally:
            if port is not None:
                self._by_port.pop(port, None)
            for w in (writer, backend_writer):
                if w is not None:
                    w.close()
            self._tasks.discard(task)


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
