"""The daemon's side of the hand-over: read the OCI seccomp agent message and its listener fd, and reply.

runc (>= 1.1), crun (>= 0.19) and `unisched run`'s trampoline (handover.py) send the listener with SCM_RIGHTS and
the runtime-spec ContainerProcessState as JSON. The reader does no I/O itself, so the daemon's event loop and a
blocking caller share it. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import reprlib
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from unisched.enforce.seccomp.abi import SeccompError


def is_listener_fd(fd: int) -> bool:
    """Whether `fd` is a seccomp notification listener (anon_inode:seccomp notify)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:seccomp notify"
    except OSError:
        return False


@dataclass(frozen=True)
class AgentHello:
    """What the OCI runtime (or `unisched run`) says when it hands over a listener."""

    pid: int
    """The process the filter was installed in, in the sender's pid namespace (the host's for runc/crun)."""
    metadata: str
    """The profile's listenerMetadata."""
    container_id: str
    status: str
    """"creating" for a container's init, "running" for each exec."""
    annotations: Mapping[str, str]
    bundle: str = ""
    oci_version: str = ""
    fd_index: int = 0
    """Index of "seccompFd" in `fds` (which SCM_RIGHTS fd is the listener)."""


def parse_agent_message(payload: bytes | str) -> AgentHello:
    """Parse the OCI seccomp agent message (runtime-spec ContainerProcessState). ociVersion is not validated. Any
    malformed message, nesting too deep for json included, is a SeccompError: a peer's refusal, never a crash."""
    try:
        msg = json.loads(payload)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise SeccompError(f"seccomp agent message is not JSON: {e}") from None
    return _hello_from(msg)


def _hello_from(msg: object) -> AgentHello:
    """The hand-over a decoded message describes. Errors quote the peer's values through reprlib (bounded, however
    large or deep the value)."""
    if not isinstance(msg, dict):
        raise SeccompError("seccomp agent message must be a JSON object")
    state = msg.get("state") or {}
    if not isinstance(state, dict):
        raise SeccompError("seccomp agent message: 'state' must be an object")
    pid = msg.get("pid", state.get("pid"))
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise SeccompError(f"seccomp agent message: bad or missing pid {reprlib.repr(pid)}")
    fds = msg.get("fds", ["seccompFd"])
    if not isinstance(fds, list) or "seccompFd" not in fds:
        raise SeccompError(f"seccomp agent message: fds {reprlib.repr(fds)} does not name seccompFd")
    annotations = state.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise SeccompError("seccomp agent message: 'state.annotations' must be an object")
    return AgentHello(
        pid=pid,
        metadata=_text(msg.get("metadata"), "metadata"),
        container_id=_text(state.get("id"), "state.id"),
        status=_text(state.get("status"), "state.status"),
        annotations=MappingProxyType({str(k): _text(v, "an annotation") for k, v in annotations.items()}),
        bundle=_text(state.get("bundle"), "state.bundle"),
        oci_version=_text(msg.get("ociVersion"), "ociVersion"),
        fd_index=fds.index("seccompFd"),
    )


def _text(value: object, what: str) -> str:
    """A string field ("" when absent or empty; a number taken as its text). An object or array is refused rather
    than turned into text: str() of a peer's deep nesting recurses as far as json did."""
    if not value:
        return ""
    if isinstance(value, (dict, list)):
        raise SeccompError(f"seccomp agent message: {what} must be a string")
    return str(value)


MAX_AGENT_MESSAGE_BYTES: Final = 1 << 20
"""The longest hand-over message read. The OCI state's annotations are its only large part (Kubernetes caps a
pod's at 256 KiB); 1 MiB leaves room for JSON escaping, and the agent's connection limits bound how many such
buffers a flood can pin."""
MAX_ACK_BYTES: Final = 1024
"""The longest reply line: it must fit in an empty socket buffer at once, so writing it never waits on a peer
that does not read."""
_AGENT_CHUNK: Final = 65536
"""Bytes per recvmsg: an honest message arrives in one."""
_AGENT_MAX_FDS: Final = 8
"""fds taken per recvmsg (all but the first hand-over fd are closed at once); more are cut off (MSG_CTRUNC)."""
_JSON_WS: Final = b" \t\n\r"
_OUTSIDE_STRING: Final = re.compile(rb'["{}\[\]]')
_INSIDE_STRING: Final = re.compile(rb'["\\]')


class _ObjectEnd:
    """Where a JSON object ends in a byte stream fed in pieces: nesting depth and string state carried between
    pieces, so the whole scan is linear (re-parsing the buffer after every byte a peer trickles would be
    quadratic). Only finds the end; json.loads judges the text once it is complete."""

    def __init__(self) -> None:
        self.seen = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, chunk: bytes) -> int | None:
        """Offset just past the object's closing brace in all bytes fed so far, or None while it is open."""
        base, pos = self.seen, 0
        self.seen += len(chunk)
        if self.depth == 0:
            pos = len(chunk) - len(chunk.lstrip(_JSON_WS))
            if pos == len(chunk):
                return None
            if chunk[pos:pos + 1] != b"{":
                raise SeccompError("seccomp agent message must be a JSON object")
            self.depth, pos = 1, pos + 1
        if self.escaped and pos < len(chunk):
            self.escaped, pos = False, pos + 1
        while (m := (_INSIDE_STRING if self.in_string else _OUTSIDE_STRING).search(chunk, pos)) is not None:
            c, pos = m.group(), m.end()
            if c == b'"':
                self.in_string = not self.in_string
            elif c == b"\\":  # inside a string: the next byte is escaped, maybe in the next piece
                self.escaped = pos >= len(chunk)
                pos += 1
            elif c in (b"{", b"["):
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return base + pos
        return None


class AgentMessageReader:
    """One hand-over (the listener fd and the OCI JSON) assembled from whatever each recvmsg returns. It does no
    I/O itself, so the daemon's event loop and a blocking caller share it. It owns every fd it is fed: the
    first is the listener (`take_fd`), the rest are closed at once, and `close` closes what it still holds."""

    def __init__(self, max_bytes: int = MAX_AGENT_MESSAGE_BYTES) -> None:
        self._fd = -1
        self._data = bytearray()
        self._end = _ObjectEnd()
        self._max = max_bytes

    def feed(self, data: bytes, fds: list[int]) -> AgentHello | None:
        """Add one recvmsg's bytes and fds: the parsed message once complete, else None. Raises SeccompError
        for a closed peer, a missing fd, an overlong or malformed message, or an fd that is no listener."""
        for extra in fds if self._fd >= 0 else fds[1:]:
            os.close(extra)
        if self._fd < 0 and fds:
            self._fd = fds[0]
        if not data:
            raise SeccompError("the peer closed before the message was complete" if self._data or self._fd >= 0
                               else "the peer closed without sending")
        if self._fd < 0:
            raise SeccompError("no file descriptor came with the message")
        if len(self._data) + len(data) > self._max:
            raise SeccompError("seccomp agent message too long")
        self._data += data
        end = self._end.feed(data)
        if end is None:
            return None
        hello = parse_agent_message(bytes(self._data[:end]))
        if hello.fd_index != 0:
            raise SeccompError("seccomp agent message: only one fd (seccompFd) is supported")
        if not is_listener_fd(self._fd):
            raise SeccompError("the fd received is not a seccomp notification listener")
        return hello

    def take_fd(self) -> int:
        """The listener, now the caller's to close."""
        fd, self._fd = self._fd, -1
        return fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def recv_agent_chunk(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One recvmsg on an agent connection: (bytes, fds). Raises BlockingIOError on a non-blocking socket with
    nothing to read; fds cut off by MSG_CTRUNC were closed by the kernel and those received are closed here."""
    # close-on-exec from the start: a listener leaked into a child the daemon runs would keep it open (its callers
    # would wait on a daemon that is gone instead of failing with ENOSYS)
    msg, fds, flags, _ = socket.recv_fds(sock, _AGENT_CHUNK, _AGENT_MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise SeccompError("the fd message was truncated (MSG_CTRUNC): too many fds sent")
    for fd in fds:
        os.set_inheritable(fd, False)  # where MSG_CMSG_CLOEXEC was not honoured (seen on a 6.18 VM kernel)
    return msg, fds


def recv_agent_message(sock: socket.socket, timeout: float = 5.0) -> tuple[int, AgentHello]:
    """Receive one hand-over on an accepted agent connection: (listener fd, parsed message). Blocking, for one
    trusted peer (tests, a helper process); the daemon reads with `AgentMessageReader` from its event loop.

    Reads until the JSON is complete, within `timeout` for the whole message (runc and crun send it in one
    message and close; `hand_over` keeps the connection open for `ack_agent`'s reply). The fd is checked to be
    a seccomp listener.
    """
    reader = AgentMessageReader()
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SeccompError(f"seccomp agent message not complete within {timeout:g} s")
            sock.settimeout(left)
            try:
                data, fds = recv_agent_chunk(sock)
            except TimeoutError:
                raise SeccompError(f"seccomp agent message not complete within {timeout:g} s") from None
            hello = reader.feed(data, fds)
            if hello is not None:
                return reader.take_fd(), hello
    finally:
        reader.close()


def agent_reply(error: str | None = None, *, busy: bool = False) -> bytes:
    """The reply line: "ok", "error REASON" (the daemon will not govern it), or "busy REASON" (too many
    hand-overs in progress: `hand_over` tries again). At most MAX_ACK_BYTES."""
    line = "ok" if error is None else f"{'busy' if busy else 'error'} {' '.join(error.split())}"
    return line.encode(errors="replace")[: MAX_ACK_BYTES - 1] + b"\n"


def ack_agent(sock: socket.socket, error: str | None = None, *, busy: bool = False) -> None:
    """Reply to a hand-over without waiting: one short line into the socket's (empty) buffer. OCI runtimes have
    hung up by then and read no reply, and a peer that never reads must not hold the daemon: a closed or full
    peer is ignored."""
    with contextlib.suppress(OSError):
        sock.send(agent_reply(error, busy=busy), socket.MSG_DONTWAIT)
