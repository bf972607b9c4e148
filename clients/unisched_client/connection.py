"""The client's end of the lease stream: which socket, connecting, writing frames, reading replies.

The stream is a plain connection to the daemon's Unix socket speaking unisched_wire.leasewire: the magic, then
length-prefixed protobuf frames both ways. Whichever thread has something to say writes it itself (under the
client's lock); one reader thread reads the replies.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterator

from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, FrameReader, frame, lease_socket_for

__all__ = ["DEFAULT_SOCKET", "SEND_TIMEOUT_S", "Connection", "dial", "lease_socket_path"]

DEFAULT_SOCKET = os.environ.get("UNISCHED_SOCKET", "/run/unisched/unisched.sock")
SEND_TIMEOUT_S = 5.0
"""A write the daemon leaves unread this long (its socket buffer full) ends the connection, which is then
made again: the app's threads, which write under the client's lock, never wait on a stuck daemon for longer."""
MIN_CONNECT_TIMEOUT_S = 0.05
"""The shortest connect attempt: a local Unix socket that is there answers well within it, even on a busy host."""
READ_BYTES = 1 << 16


def lease_socket_path(socket_path: str | None) -> str:
    """The socket the lease stream connects to, for the daemon on `socket_path` (else $UNISCHED_SOCKET, else the
    default): $UNISCHED_LEASE_SOCKET, else lease.sock beside the daemon's socket (unisched_wire.leasewire)."""
    return lease_socket_for(socket_path or DEFAULT_SOCKET, os.environ)


def dial(path: str, connect_timeout: float) -> Connection:
    """Connect to the daemon's socket (OSError when nobody answers within `connect_timeout`)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(MIN_CONNECT_TIMEOUT_S, connect_timeout))
        sock.connect(path)
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
    except OSError:
        sock.close()
        raise
    return Connection(sock)


def opening(hello: pb.LeaseHello, wanted: list[str]) -> bytes:
    """What a connection starts with: the magic, the hello, and a want for each engine still wanted (a reconnect)."""
    wants = [frame(pb.LeaseRequest(want=pb.LeaseWant(engine=engine))) for engine in wanted]
    return MAGIC + frame(pb.LeaseRequest(hello=hello)) + b"".join(wants)


class Connection:
    """One connection of the lease stream: its writes (made under the client's lock), its replies and its end."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, req: pb.LeaseRequest) -> None:
        self.write(frame(req))

    def write(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            self.broken()  # a partial write leaves the stream unreadable: the reader reconnects

    def replies(self) -> Iterator[pb.LeaseReply]:
        """The daemon's replies until it closes the stream (OSError, FrameError or DecodeError when it breaks)."""
        reader = FrameReader(MAX_REPLY_BYTES)
        while data := self.sock.recv(READ_BYTES):
            for payload in reader.feed(data):
                yield pb.LeaseReply.FromString(payload)

    def finish(self) -> None:
        """Say we are done: the daemon reads what was sent, then ends the session."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def broken(self) -> None:
        """Wake the reader with an error or EOF so that it connects again."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()
