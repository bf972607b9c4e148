"""The lease stream's wire format on the daemon's lease socket, shared by the daemon and the client library.

The daemon serves the lease stream on a Unix socket of its own (`lease_socket`; gRPC has the main socket), by
default `LEASE_SOCKET_NAME` beside the main one; `lease_socket_for` is how a client finds it. A cooperative
client opens it and sends `MAGIC` first (a connection that opens otherwise is closed); after it, each way, every
message is a 4-byte big-endian length and a serialized protobuf: LeaseRequest from the client, LeaseReply from
the daemon. Why not the gRPC stream it replaced: a renewal's round trip through gRPC aio woke four idle threads
and loops (client, a relay in front of gRPC, gRPC's poller, the daemon's loop) and its p99 was ~2 ms at 25 ms
spacing on the 2-core VM; these frames are read and answered in one turn of the daemon's loop and read by one client thread
(bench/results/2026-12-01-cpu/lease-stream/README.md).
"""

from __future__ import annotations

import posixpath
import struct
from collections.abc import Mapping

from google.protobuf.message import Message

__all__ = ["LEASE_SOCKET_ENV", "LEASE_SOCKET_NAME", "MAGIC", "MAX_REPLY_BYTES", "MAX_REQUEST_BYTES", "FrameError",
           "FrameReader", "frame", "is_lease_opening", "lease_socket_beside", "lease_socket_for"]

MAGIC = b"unisched-lease/1\n"
MAX_REQUEST_BYTES = 64 * 1024
"""A LeaseRequest longer than this ends the connection (the same as the gRPC server's receive limit)."""
MAX_REPLY_BYTES = 16 * 1024 * 1024
"""What a client accepts from the daemon in one message: a lease welcome (the tenant's snapshot), and a gRPC reply
(an admin's ListTenants of thousands of tenants, each share with its charges by rule and source, passes gRPC's
default 4 MiB)."""
LEASE_SOCKET_NAME = "lease.sock"
"""The lease socket's name, in the main socket's directory unless the daemon's `lease_socket` says otherwise."""
LEASE_SOCKET_ENV = "UNISCHED_LEASE_SOCKET"
"""Names the lease socket for a client (`unisched run` sets it for its command from the daemon's reply)."""
_LEN = struct.Struct(">I")


def lease_socket_beside(socket_path: str) -> str:
    """The lease socket by default: LEASE_SOCKET_NAME in the directory of the daemon's main socket."""
    return posixpath.join(posixpath.dirname(socket_path), LEASE_SOCKET_NAME)


def lease_socket_for(socket_path: str, env: Mapping[str, str]) -> str:
    """Where a client of the daemon on `socket_path` finds its lease stream: $UNISCHED_LEASE_SOCKET, else the
    default beside the main socket."""
    return env.get(LEASE_SOCKET_ENV) or lease_socket_beside(socket_path)


class FrameError(Exception):
    """A frame declared longer than the reader's limit: the peer is broken or hostile; drop the connection."""


def frame(message: Message) -> bytes:
    data: bytes = message.SerializeToString()
    return _LEN.pack(len(data)) + data


def is_lease_opening(first: bytes) -> bool | None:
    """Whether a connection's first bytes open a lease stream; None while too few have come to tell."""
    if first.startswith(MAGIC):
        return True
    return None if MAGIC.startswith(first) else False


class FrameReader:
    """Bytes in, whole message payloads out; buffers at most one frame of `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        # with nothing held (the usual read: whole frames), frames are cut from `data` itself, and only an unfinished
        # one is kept: a renewal's frame is not copied into the buffer and out again
        src: bytes | bytearray = data
        if buf:
            buf += data
            src = buf
        out = []
        start = 0
        while len(src) - start >= _LEN.size:
            (n,) = _LEN.unpack_from(src, start)
            if n > self.limit:
                if src is data:
                    buf += data  # (held, as the buffer holds a partial frame's bytes)
                raise FrameError(f"message of {n} bytes exceeds the limit of {self.limit}")
            end = start + _LEN.size + n
            if len(src) < end:
                break
            out.append(bytes(src[start + _LEN.size:end]))
            start = end
        if src is data:
            if start < len(data):
                buf += data[start:]
        elif start:
            del buf[:start]
        return out
