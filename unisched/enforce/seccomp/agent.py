"""The daemon's side of the hand-over: read the OCI seccomp agent message and its listener fd, and reply.

runc (>= 1.1), crun (>= 0.19) and `unisched run`'s trampoline (handover.py) send the listener with SCM_RIGHTS and
the runtime-spec ContainerProcessState as JSON. The reader does no I/O itself, so the daemon's event loop and a
blocking caller share it. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
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


def _first_object(data: bytes | bytearray) -> object:
    """The JSON value at the start of `data` (UTF-8), whatever follows it; SeccompError when there is none."""
    try:
        return json.JSONDecoder().raw_decode(data.decode().lstrip(" \t\n\r"))[0]
    except (ValueError, RecursionError) as e:
        raise SeccompError(f"seccomp agent message is not JSON: {e}") from None


def _text(value: object, what: str) -> str:
    """A string field ("" when absent or empty; a number taken as its text). An object or array is refused rather
    than turned into text: str() of a peer's deep nesting recurses as far as json did."""
    if not value:
        return ""
    if isinstance(value, (dict, list)):
        raise SeccompError(f"seccomp agent message: {what} must be a string")
    return str(value)


MAX_AGENT_MESSAGE_BYTES: Final = 1 << 20
"""The longest hand-over message read. runc and crun send a few hundred bytes besides the container's annotations
(a pod's, where the runtime passes them on, are capped by Kubernetes at 256 KiB); 1 MiB leaves room for JSON
escaping. Reading a byte costs C-speed passes only, so this bounds memory (the agent's connection limits bound how
many such buffers a flood can pin), and MAX_AGENT_MESSAGE_TOKENS bounds json's work."""
MAX_AGENT_MESSAGE_TOKENS: Final = 16384
"""The most quotes, commas, objects and arrays (outside strings) a hand-over message may hold. json spends its time
per value, not per byte: a megabyte of `[],` or `"",` would take it tens of milliseconds on the event loop, this many
a millisecond or two. runc's or crun's message has a few dozen (ten fields and each annotation's four quotes and a
comma), a pod with a thousand annotations some 5,000."""
MAX_ACK_BYTES: Final = 1024
"""The longest reply line: it must fit in an empty socket buffer at once, so writing it never waits on a peer
that does not read."""
_AGENT_CHUNK: Final = 65536
"""Bytes per recvmsg: an honest message arrives in one."""
_AGENT_MAX_FDS: Final = 8
"""fds taken per recvmsg (all but the first hand-over fd are closed at once); more are cut off (MSG_CTRUNC)."""
_JSON_WS: Final = b" \t\n\r"


class _ObjectEnd:
    """Whether a JSON object fed in pieces may be complete: its brackets outside strings all closed. Each piece
    costs a few C-speed passes (bytes.replace, count, split; no Python step per byte or bracket), with the string
    and escape state carried between pieces, so the scan is linear and a trickling peer's bytes cost next to
    nothing. It only finds where to stop reading: json judges the text once, and a message that would cost json
    more than MAX_AGENT_MESSAGE_TOKENS is refused before that."""

    def __init__(self, max_tokens: int = MAX_AGENT_MESSAGE_TOKENS) -> None:
        self.started = False
        self.depth = 0
        self.tokens = 0
        self.in_string = False
        self.escaped = False
        self._max_tokens = max_tokens

    def feed(self, piece: bytes) -> bool:
        """True once every bracket opened so far is closed (the object is complete, or malformed: json says)."""
        if not self.started:
            piece = piece.lstrip(_JSON_WS)
            if not piece:
                return False
            if piece[:1] != b"{":
                raise SeccompError("seccomp agent message must be a JSON object")
            self.started = True
        if self.escaped:  # the last piece ended on a string's backslash: this byte is the escaped one
            piece, self.escaped = piece[1:], False
        if b"\\" in piece:  # escaped backslashes, then escaped quotes, go: each quote left opens or closes a string
            piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
            if piece.endswith(b"\\"):
                piece, self.escaped = piece[:-1], True
        quotes = piece.count(b'"')
        self._count(quotes)  # before the split, which makes a part per quote
        if quotes:  # the parts between quotes alternate outside and inside strings
            outside = b"".join(piece.split(b'"')[int(self.in_string)::2])
            self.in_string ^= quotes % 2 == 1
        else:
            outside = b"" if self.in_string else piece
        opens = outside.count(b"{") + outside.count(b"[")
        self._count(opens + outside.count(b","))
        self.depth += opens - outside.count(b"}") - outside.count(b"]")
        return self.depth <= 0

    def _count(self, tokens: int) -> None:
        self.tokens += tokens
        if self.tokens > self._max_tokens:
            raise SeccompError(f"seccomp agent message has too many JSON values (more than {self._max_tokens} "
                               "quotes, commas and brackets)")


class AgentMessageReader:
    """One hand-over (the listener fd and the OCI JSON) assembled from whatever each recvmsg returns. It does no
    I/O itself, so the daemon's event loop and a blocking caller share it. It owns every fd it is fed: the
    first is the listener (`take_fd`), checked at once; the others that came with it are closed at once; fds in a
    later recvmsg end the hand-over (each such message ends a recvmsg, so a peer could otherwise make every byte
    cost a recvmsg and the closing of its fds); and `close` closes what it still holds."""

    def __init__(self, max_bytes: int = MAX_AGENT_MESSAGE_BYTES) -> None:
        self._fd = -1
        self._data = bytearray()
        self._end = _ObjectEnd()
        self._max = max_bytes

    def feed(self, data: bytes, fds: list[int]) -> AgentHello | None:
        """Add one recvmsg's bytes and fds: the parsed message once complete, else None. Raises SeccompError
        for a closed peer, a missing fd, an fd that is no listener, fds after the first message's, or an overlong,
        overfull or malformed message."""
        if fds and self._fd >= 0:
            for fd in fds:
                os.close(fd)
            raise SeccompError("file descriptors came after the message's first bytes (send the listener once, "
                               "with them)")
        if fds:
            self._fd = fds[0]
            for extra in fds[1:]:
                os.close(extra)
            if not is_listener_fd(self._fd):
                raise SeccompError("the fd received is not a seccomp notification listener")
        if not data:
            raise SeccompError("the peer closed before the message was complete" if self._data or self._fd >= 0
                               else "the peer closed without sending")
        if self._fd < 0:
            raise SeccompError("no file descriptor came with the message")
        if len(self._data) + len(data) > self._max:
            raise SeccompError("seccomp agent message too long")
        self._data += data
        if not self._end.feed(data):
            return None
        hello = _hello_from(_first_object(self._data))
        if hello.fd_index != 0:
            raise SeccompError("seccomp agent message: only one fd (seccompFd) is supported")
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
