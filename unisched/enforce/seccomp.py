"""Session admission: seccomp user notification on NVIDIA's allocation ioctls.

A classic-BPF seccomp filter, installed in a tenant's first process just before exec (no_new_privs +
SECCOMP_FILTER_FLAG_NEW_LISTENER), sends only ioctls whose request is 'F'/RM_ALLOC (0x2B), 'F'/XFER (0xD3,
which wraps another escape) and, by default, 'F'/RM_FREE (0x29) to a supervisor; every other syscall runs
at kernel speed. Children and threads inherit the filter. The listener fd reaches the daemon over a Unix
socket (SCM_RIGHTS): from `unisched run`'s child, or from an OCI runtime (runc >= 1.1, crun >= 0.19) whose
seccomp profile has SCMP_ACT_NOTIFY and `listenerPath` (deploy/seccomp/unisched-gpu.json).

`SessionSupervisor` serves one listener for one tenant: it reads the call's argument from the tenant's memory
(/proc/PID/mem), decodes the class (NVOS21/NVOS64 hClass@12; XFER unwrapped), classifies it
(nvclasses.SessionKind), asks `decide(tenant, kind, h_class)` for engine sessions only, counts live sessions
(RM_FREE of the object or of any ancestor, process exit and the listener's hang-up uncount them), and answers
"continue" or EPERM. In the daemon (`attach(loop)`) a thread of the supervisor's own answers every call at once
except the first object of a new session, whose `decide` runs on the event loop: the hundred-odd allocations of
memory, channels and copy engines of a CUDA context never wait for the loop. It never wedges a tenant: any
failure while handling a call answers "continue"; a call whose notification is gone is skipped; if the daemon
dies (the listener's last fd closes), pending and later notified calls fail at once with ENOSYS and everything
else keeps working.

CAVEAT (seccomp_unotify(2)): "continue" makes the kernel re-read the argument from user memory, so a hostile
multithreaded tenant can swap the class after the supervisor looked at it, and the driver dispatches on an
escape's nr and size whatever the type byte says. This is admission control and QoS for cooperative or
unaware applications, NOT a security boundary against hostile code.

The tenant side (building and installing the filter, handing its listener over) is sessionfilter.py, which
imports no more than a new tenant process needs; its names are re-exported here.

Kernel ABI used (no libseccomp): seccomp(2) and prctl(2) through ctypes; the listener's ioctls RECV
0xC0502100 (struct seccomp_notif, 80 bytes), SEND 0xC0182101 (struct seccomp_notif_resp, 24 bytes),
ID_VALID (0x80082102, the number every kernel accepts; 0x40082102 on kernels that fixed its direction) and,
where the kernel has it (>= 6.6), SET_FLAGS 0x40082104 with SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno
import fcntl
import itertools
import json
import math
import os
import platform
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final

import structlog

from unisched.enforce.nvclasses import (
    NVOS00_SIZE,
    RM_ALLOC,
    RM_ALLOC_SIZES,
    RM_FREE,
    XFER,
    XFER_FORMAT,
    XFER_SIZE,
    SessionKind,
    classify,
    decode_ioctl,
)
from unisched.enforce.sessionfilter import (
    _SECCOMP_GET_ACTION_AVAIL,
    _SECCOMP_GET_NOTIF_SIZES,
    AUDIT_ARCH_AARCH64,
    AUDIT_ARCH_I386,
    AUDIT_ARCH_X86_64,
    DEFAULT_LISTENER_PATH,
    IOCTL_SYSCALL,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_USER_NOTIF,
    SeccompError,
    SeccompUnavailable,
    _seccomp,
    build_filter,
    hand_over,
    install_filter,
    make_agent_message,
    send_fd,
)

__all__ = [
    "AUDIT_ARCH_AARCH64",
    "AUDIT_ARCH_I386",
    "AUDIT_ARCH_X86_64",
    "IOCTL_SYSCALL",
    "SECCOMP_RET_ALLOW",
    "SECCOMP_RET_USER_NOTIF",
    "DEFAULT_LISTENER_PATH",
    "AgentHello",
    "EventAction",
    "SeccompError",
    "SeccompUnavailable",
    "SessionEvent",
    "SessionLedger",
    "SessionSupervisor",
    "SupervisorStats",
    "ack_agent",
    "agent_reply",
    "build_filter",
    "hand_over",
    "install_filter",
    "is_listener_fd",
    "make_agent_message",
    "parse_agent_message",
    "probe",
    "recv_agent_chunk",
    "recv_agent_message",
    "recv_fd",
    "send_fd",
]

log = structlog.get_logger("unisched.seccomp")


_NOTIF_RECV: Final = 0xC0502100
_NOTIF_SEND: Final = 0xC0182101
_NOTIF_ID_VALID_OLD: Final = 0x80082102
_NOTIF_ID_VALID: Final = 0x40082102
_NOTIF_SET_FLAGS: Final = 0x40082104  # SECCOMP_IOW(4, __u64), Linux >= 6.6; the flags are the argument itself
_FD_SYNC_WAKE_UP: Final = 1  # SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP
_FLAG_CONTINUE: Final = 1
_NOTIF_FORMAT: Final = "=QIIiIQ6Q"  # id, pid, flags, data{nr, arch, instruction_pointer, args[6]}
_NOTIF_SIZE: Final = struct.calcsize(_NOTIF_FORMAT)  # 80
_RESP_FORMAT: Final = "=QqiI"  # id, val, error (-errno), flags
_RESP_SIZE: Final = struct.calcsize(_RESP_FORMAT)  # 24
_DATA_SIZE: Final = 64




class _NotifSizes(ctypes.Structure):
    _fields_ = [("seccomp_notif", ctypes.c_ushort), ("seccomp_notif_resp", ctypes.c_ushort), ("seccomp_data", ctypes.c_ushort)]



def probe() -> str | None:
    """Why seccomp user notification cannot be used here, or None when it can. Installs nothing."""
    try:
        release = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    except ValueError:
        release = (99, 0)
    if release < (5, 5):
        return f"kernel {platform.release()} is older than 5.5 (no SECCOMP_USER_NOTIF_FLAG_CONTINUE)"
    try:
        action = ctypes.c_uint32(SECCOMP_RET_USER_NOTIF)
        _seccomp(_SECCOMP_GET_ACTION_AVAIL, 0, ctypes.byref(action))
        sizes = _NotifSizes()
        _seccomp(_SECCOMP_GET_NOTIF_SIZES, 0, ctypes.byref(sizes))
    except SeccompUnavailable as e:
        return str(e)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            return "the kernel does not offer SECCOMP_RET_USER_NOTIF"
        return f"seccomp(2) refused: {e.strerror} (kernel without CONFIG_SECCOMP_FILTER, or seccomp blocked)"
    if (sizes.seccomp_notif, sizes.seccomp_notif_resp, sizes.seccomp_data) != (_NOTIF_SIZE, _RESP_SIZE, _DATA_SIZE):
        return (
            f"unexpected seccomp struct sizes notif={sizes.seccomp_notif} resp={sizes.seccomp_notif_resp} "
            f"data={sizes.seccomp_data} (expected {_NOTIF_SIZE}/{_RESP_SIZE}/{_DATA_SIZE})"
        )
    return None


# --- handing the listener over ---------------------------------------------------------------------------------------
def recv_fd(sock: socket.socket, maxlen: int = 65536) -> tuple[int, bytes]:
    """One recvmsg: (the first fd received, the bytes that came with it). Extra fds are closed."""
    msg, fds, flags, _ = socket.recv_fds(sock, maxlen, 8)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise SeccompError("the fd message was truncated (MSG_CTRUNC): too many fds sent")
    if not fds:
        raise SeccompError("no file descriptor came with the message" if msg else "the peer closed without sending")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0], msg


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
    """Parse the OCI seccomp agent message (runtime-spec ContainerProcessState). ociVersion is not validated."""
    try:
        msg = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise SeccompError(f"seccomp agent message is not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise SeccompError("seccomp agent message must be a JSON object")
    state = msg.get("state") or {}
    if not isinstance(state, dict):
        raise SeccompError("seccomp agent message: 'state' must be an object")
    pid = msg.get("pid", state.get("pid"))
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise SeccompError(f"seccomp agent message: bad or missing pid {pid!r}")
    fds = msg.get("fds", ["seccompFd"])
    if not isinstance(fds, list) or "seccompFd" not in fds:
        raise SeccompError(f"seccomp agent message: fds {fds!r} does not name seccompFd")
    annotations = state.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise SeccompError("seccomp agent message: 'state.annotations' must be an object")
    return AgentHello(
        pid=pid,
        metadata=str(msg.get("metadata") or ""),
        container_id=str(state.get("id") or ""),
        status=str(state.get("status") or ""),
        annotations=MappingProxyType({str(k): str(v) for k, v in annotations.items()}),
        bundle=str(state.get("bundle") or ""),
        oci_version=str(msg.get("ociVersion") or ""),
        fd_index=fds.index("seccompFd"),
    )


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
    msg, fds, flags, _ = socket.recv_fds(sock, _AGENT_CHUNK, _AGENT_MAX_FDS)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise SeccompError("the fd message was truncated (MSG_CTRUNC): too many fds sent")
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


# --- events and counts -----------------------------------------------------------------------------------------------
class EventAction(StrEnum):
    ADMITTED = "admitted"
    """An engine session's allocation was let through and is counted (+1)."""
    REFUSED = "refused"
    """Refused with EPERM; not counted."""
    ABORTED = "aborted"
    """decide() said yes but the call was gone (killed or interrupted) before the answer; not counted."""
    FREED = "freed"
    """RM_FREE of the session object or of one of its ancestors (-1)."""
    EXITED = "exited"
    """The owning process exited, or every process of the filter did (-1)."""
    DETACHED = "detached"
    """The supervisor was closed while the session was still counted (-1: nobody follows it any more)."""


@dataclass(frozen=True)
class SessionEvent:
    tenant: str
    action: EventAction
    kind: SessionKind
    h_class: int
    pid: int
    """Thread id that made the call (0 when not known)."""
    handle: int
    """hObjectNew (0 when the RM chose the handle)."""
    live: int
    """This supervisor's live count of `kind` after the event."""

    @property
    def delta(self) -> int:
        if self.action is EventAction.ADMITTED:
            return 1
        if self.action in (EventAction.FREED, EventAction.EXITED, EventAction.DETACHED):
            return -1
        return 0


@dataclass(frozen=True)
class SupervisorStats:
    tenant: str
    live: Mapping[SessionKind, int]
    """Live sessions per kind (what caps count)."""
    objects: Mapping[SessionKind, int]
    """Live RM objects per kind behind those sessions."""
    admitted: Mapping[SessionKind, int]
    refused: Mapping[SessionKind, int]
    notifications: int
    """Notifications answered or skipped."""
    skipped: int
    """Notifications that were gone before the answer (killed or interrupted callers)."""
    errors: int
    """Notifications answered "continue" because handling them failed."""
    latency_p50_us: float | None
    latency_p99_us: float | None
    """Answer latency (notification received -> answer sent), over the most recent samples."""
    latency_samples: int
    closed: bool
    asked_loop: int = 0
    """Session calls whose decision was asked on the event loop (`attach`); every other call was answered by
    the supervisor's thread alone."""
    pending: int = 0
    """Session calls waiting for the loop's decision now."""
    sync_wake_up: bool = False
    """Whether the kernel wakes supervisor and caller on each other's CPU (SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)."""


class SessionLedger:
    """Per-tenant live session counts against caps, shared by every supervisor of the daemon (thread-safe).

    `decide` reserves a slot when it says yes; the supervisor then reports ADMITTED (the reservation becomes
    a live session) or ABORTED (released), and FREED / EXITED / DETACHED give slots back. `cap(tenant, kind)`
    returns the cap, or None for no cap. Pass `ledger.decide` and `ledger.on_event` to each supervisor.
    """

    def __init__(self, cap: Callable[[str, SessionKind], int | None]) -> None:
        self._cap = cap
        self._lock = threading.Lock()
        self._live: collections.Counter[tuple[str, SessionKind]] = collections.Counter()
        self._pending: collections.Counter[tuple[str, SessionKind]] = collections.Counter()
        self._refused: collections.Counter[tuple[str, SessionKind]] = collections.Counter()

    def decide(self, tenant: str, kind: SessionKind, h_class: int) -> bool:
        cap = self._cap(tenant, kind)
        with self._lock:
            key = (tenant, kind)
            if cap is not None and self._live[key] + self._pending[key] >= cap:
                return False
            self._pending[key] += 1
            return True

    def on_event(self, event: SessionEvent) -> None:
        key = (event.tenant, event.kind)
        with self._lock:
            if event.action in (EventAction.ADMITTED, EventAction.ABORTED) and self._pending[key] > 0:
                self._pending[key] -= 1
            if event.action is EventAction.REFUSED:
                self._refused[key] += 1
            elif event.delta:
                self._live[key] = max(0, self._live[key] + event.delta)

    def live(self, tenant: str) -> dict[SessionKind, int]:
        with self._lock:
            return {k: n for (t, k), n in self._live.items() if t == tenant and n}

    def refused(self, tenant: str) -> dict[SessionKind, int]:
        with self._lock:
            return {k: n for (t, k), n in self._refused.items() if t == tenant and n}


# --- the supervisor --------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Session:
    """One engine session: one or more RM objects of one kind (see `SessionSupervisor`, "Sessions")."""

    kind: SessionKind
    h_class: int
    pid: int  # the thread that opened it
    handle: int  # its first object's handle
    objects: set[int] = field(default_factory=set)
    instances: set[int] = field(default_factory=set)
    last_ns: int = 0


@dataclass
class _Client:
    """One RM client (hRoot) and the part of its object tree seen through RM_ALLOC."""

    tgid: int
    start_time: str
    parent: dict[int, int] = field(default_factory=dict)
    children: dict[int, set[int]] = field(default_factory=dict)
    sessions: dict[int, _Session] = field(default_factory=dict)  # object handle -> its session
    latest: dict[SessionKind, _Session] = field(default_factory=dict)  # the session new objects may join


@dataclass
class _Call:
    """What one notification asks for, decoded from the tenant's memory."""

    op: int  # RM_ALLOC or RM_FREE; 0 = nothing to track
    h_root: int = 0
    h_parent: int = 0
    handle: int = 0  # hObjectNew (alloc) or hObjectOld (free)
    h_class: int = 0
    kind: SessionKind | None = None
    owner: tuple[int, str] | None = None  # (tgid, start time) when this client is new
    instance: int | None = None  # engineInstance from the allocation parameters (video engines)
    join: _Session | None = None  # the open session this object joins (no decision needed)
    node: int = 0  # where an admitted object was recorded


class _Gone(Exception):
    """The notification is no longer valid (the caller was killed or interrupted)."""


_MAX_NODES = 200_000
_JOIN_TIMEOUT_S: Final = 5.0  # close() waits this long for the supervisor's thread (it never waits on the loop)
_ENGINE_KINDS: Final = frozenset({SessionKind.NVDEC, SessionKind.NVENC, SessionKind.NVJPG, SessionKind.OFA})
_GROUPED_KINDS: Final = _ENGINE_KINDS | {SessionKind.COMPUTE}


def _read_mem(fd: int, addr: int, size: int) -> bytes:
    if not 0 < addr < 1 << 63:
        raise ValueError(f"bad user address {addr:#x}")
    data = os.pread(fd, size, addr)
    if len(data) != size:
        raise ValueError(f"short read of {size} bytes at {addr:#x}")
    return data


def _owner(tid: int) -> tuple[int, str]:
    """(tgid, start time) of the process that thread `tid` belongs to."""
    tgid = tid
    with open(f"/proc/{tid}/status") as f:
        for line in f:
            if line.startswith("Tgid:"):
                tgid = int(line.split()[1])
                break
    return tgid, _start_time(tgid) or ""


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None


class SessionSupervisor:
    """Serves ONE seccomp listener fd for ONE tenant (see the module docstring).

    Two ways to run it; either way one thread of its own receives and answers the notifications, and it owns
    the fd: `close()` (or the tenant's last process exiting) closes it.

    - `serve_forever()` in a thread of the caller's: `decide` and `on_event` run on that thread.
    - `attach(loop)`: the supervisor starts its own thread, which answers every call that needs no decision
      at once, without the loop: non-session classes (memory, channels, copy engines...), frees, objects that
      join an open session, and unreadable or malformed calls. Only the first object of a new session waits:
      `decide` is called on the loop (call_soon_threadsafe) and the thread answers when it returns, while it
      keeps answering the tenant's other calls. `on_event` runs on the loop too. If the loop is closed, a
      session call is admitted (never wedged); a decision still on the loop when the supervisor closes is
      not asked any more, or reported ABORTED when it had been admitted.

    On kernels >= 6.6 the listener is put in sync wake-up mode (`sync_wake_up`): the tenant only waits while
    its call is handled, so the kernel runs the supervisor's thread on the tenant's CPU and back, instead of
    waking another (possibly idle) CPU each way.

    `decide` and `on_event` must be quick and non-blocking; `decide` is consulted only for engine sessions,
    and an exception in it admits the call. `stats()` may be called from any thread; `close()` too (with
    `attach`, it joins the supervisor's thread).

    Sessions: the driver allocates several objects for one session of some kinds (on the H200 a CUDA context
    made 8 compute objects, one PyAV decoder 7 NVDEC objects, one per engine), so counts and caps are kept
    per session, and `decide` is asked once, for the first object. A later object of a video engine kind joins
    the same client's latest session of that kind when the same thread allocates it within `join_window_s` of
    the previous one and on an engine instance that session does not use yet (engineInstance from the
    allocation parameters); a second decoder, which needs engine 0 again, opens a new session. Compute
    objects join on the same thread and window; graphics and NVENC_SW_SESSION objects are one session each.
    A session ends when its last object is freed (directly or with an ancestor) or its process exits.
    """

    def __init__(
        self,
        listener_fd: int,
        tenant: str,
        decide: Callable[[str, SessionKind, int], bool],
        on_event: Callable[[SessionEvent], None] | None = None,
        *,
        reconcile_interval_s: float = 2.0,
        latency_window: int = 4096,
        join_window_s: float = 1.0,
        sync_wake_up: bool = True,
    ) -> None:
        self._fd = listener_fd
        self.tenant = tenant
        self._decide = decide
        self._on_event = on_event
        self._reconcile_interval = reconcile_interval_s
        self._join_window_ns = int(join_window_s * 1e9)
        self._id_valid_cmd = _NOTIF_ID_VALID_OLD
        self._lock = threading.Lock()
        self._clients: dict[int, _Client] = {}
        self._nodes = 0
        self._synthetic = itertools.count(-1, -1)
        self._live: collections.Counter[SessionKind] = collections.Counter()
        self._objects: collections.Counter[SessionKind] = collections.Counter()
        self._admitted: collections.Counter[SessionKind] = collections.Counter()
        self._refused: collections.Counter[SessionKind] = collections.Counter()
        self._notifications = 0
        self._skipped = 0
        self._errors = 0
        self._asked = 0
        self._sync_wake_up = sync_wake_up and self._set_sync_wake_up()
        self._latency_ns: collections.deque[int] = collections.deque(maxlen=latency_window)
        self._warned: set[str] = set()
        self._closed = False
        self._finished = False
        self._done = threading.Event()
        self._serving = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Session calls waiting for the loop's decision (serving thread only), and decisions back from the
        # loop not yet answered (under _lock: the loop appends, the serving thread takes).
        self._pending: dict[int, tuple[_Call, int, int]] = {}  # notification id -> (call, tid, t0)
        self._decided: collections.deque[tuple[int, bool, BaseException | None]] = collections.deque()

    # ---- running ----
    def serve_forever(self) -> None:
        """Serve until `close()` or until every process of the filter has exited. Blocking; for a thread."""
        with self._lock:
            if self._closed or self._serving or self._loop is not None:
                raise SeccompError("this supervisor is closed or already serving")
            self._serving = True
        self._serve()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve from a thread of its own, asking `decide` (and calling `on_event`) on `loop`."""
        with self._lock:
            if self._closed or self._serving or self._loop is not None:
                raise SeccompError("this supervisor is closed or already serving")
            self._loop = loop
            self._serving = True
            self._thread = threading.Thread(target=self._serve, name=f"unisched-seccomp-{self.tenant}", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as e:  # no thread to be had: nobody would answer, so let go of the listener (ENOSYS)
            self._thread = None
            self._finish(EventAction.DETACHED)
            raise SeccompError(f"cannot start the session supervisor's thread: {e}") from None

    def close(self) -> None:
        """Stop serving and close the listener. Any thread; with `attach`, returns once its thread has ended.

        Closing while the tenant still runs makes its pending and later session allocations fail with ENOSYS;
        sessions still counted are reported DETACHED.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
            serving = self._serving
            if first and serving:  # the serving thread closes the fd itself once it wakes up
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"x")
            thread = self._thread
        if first and not serving:
            self._finish(EventAction.DETACHED)
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.error("seccomp supervisor thread did not stop", tenant=self.tenant)

    def _set_sync_wake_up(self) -> bool:
        """SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (Linux >= 6.6): the kernel wakes the supervisor on the caller's CPU
        and the caller on the supervisor's, as the caller only waits meanwhile (no idle CPU to wake, no IPI).
        False where the kernel does not offer it."""
        try:
            fcntl.ioctl(self._fd, _NOTIF_SET_FLAGS, _FD_SYNC_WAKE_UP)
        except OSError:
            return False
        return True

    @property
    def closed(self) -> bool:
        return self._done.is_set()

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        next_reconcile = time.monotonic() + self._reconcile_interval
        why = EventAction.DETACHED
        try:
            while not self._closed:
                timeout_ms = max(0, math.ceil((next_reconcile - time.monotonic()) * 1000))
                events = dict(poller.poll(timeout_ms))
                try:
                    if events.get(self._wake_r, 0):
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        self._answer_decided()
                    ev = events.get(self._fd, 0)
                    if ev & select.POLLIN:
                        self._handle_one()
                    elif ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        why = EventAction.EXITED  # every process using the filter has exited: their sessions are gone
                        return
                    if time.monotonic() >= next_reconcile:
                        next_reconcile = time.monotonic() + self._reconcile_interval
                        self.reconcile()
                except Exception:  # a bug here must not take the tenant's hooks down: log it, serve on
                    with self._lock:
                        self._errors += 1
                    log.exception("seccomp supervisor error; serving on", tenant=self.tenant)
        finally:
            self._finish(why)

    def _finish(self, action: EventAction) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._closed = True
            self._serving = False
            os.close(self._fd)
            os.close(self._wake_r)
            os.close(self._wake_w)
            decided = list(self._decided)
            self._decided.clear()
        # The callers still waiting got ENOSYS when the fd closed. Admissions the loop already made are given
        # back; decisions still on the loop are not asked any more (see _decide_on_loop).
        events = []
        for nid, admitted, _ in decided:
            entry = self._pending.pop(nid, None)
            kind = entry[0].kind if entry is not None else None
            if admitted and entry is not None and kind is not None:
                call, tid = entry[0], entry[1]
                events.append(SessionEvent(self.tenant, EventAction.ABORTED, kind, call.h_class, tid, call.handle, 0))
        self._pending.clear()
        self._emit_all(events + self._release_clients(list(self._clients), action))
        self._done.set()
        log.debug("seccomp supervisor closed", tenant=self.tenant, why=action.value)

    # ---- process exit ----
    def reconcile(self) -> None:
        """Uncount the sessions of RM clients whose process has exited (the driver freed them on close).

        Runs on the serving thread every `reconcile_interval_s`; do not call it from another thread while serving.
        """
        gone = [h for h, c in self._clients.items() if c.tgid and _start_time(c.tgid) != c.start_time]
        self._emit_all(self._release_clients(gone, EventAction.EXITED))

    def _release_clients(self, roots: list[int], action: EventAction) -> list[SessionEvent]:
        events: list[SessionEvent] = []
        for h_root in roots:
            client = self._clients.pop(h_root, None)
            if client is not None:
                self._nodes -= len(client.parent)
                sessions = list({id(x): x for x in client.sessions.values()}.values())
                with self._lock:
                    for x in sessions:
                        self._objects[x.kind] -= len(x.objects)
                events += self._uncount(sessions, action)
        return events

    def _uncount(self, sessions: list[_Session], action: EventAction) -> list[SessionEvent]:
        events = []
        for s in sessions:
            with self._lock:
                self._live[s.kind] -= 1
                live = self._live[s.kind]
            events.append(SessionEvent(self.tenant, action, s.kind, s.h_class, s.pid, max(s.handle, 0), live))
        return events

    # ---- one notification ----
    def _handle_one(self) -> None:
        buf = bytearray(_NOTIF_SIZE)  # zeroed, as the kernel requires
        try:
            fcntl.ioctl(self._fd, _NOTIF_RECV, buf, True)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.EINTR, errno.EAGAIN):  # ENOENT: the caller went away meanwhile
                self._warn_once("recv", f"seccomp receive failed: {e.strerror}")
            return
        t0 = time.perf_counter_ns()
        nid, pid, _flags, nr, arch, _ip, *args = struct.unpack(_NOTIF_FORMAT, buf)
        call: _Call | None = None
        admitted = False
        failure: tuple[str, BaseException] | None = None
        try:
            call = self._examine(nid, pid, nr, arch, args)
            if call.kind is not None:
                client = self._clients.get(call.h_root)
                if call.handle and client is not None and call.handle in client.sessions:
                    call.kind = None  # the same handle again: the driver refuses it (or a free was missed); count once
                elif client is not None and (joined := self._joinable(client, call, pid)) is not None:
                    call.join, admitted = joined, True
                elif self._loop is not None:
                    self._ask_loop(self._loop, nid, pid, t0, call)
                    return
                else:
                    try:
                        admitted = bool(self._decide(self.tenant, call.kind, call.h_class))
                    except Exception as e:
                        failure, admitted = ("seccomp decide() failed; admitting the call", e), True
        except _Gone:
            with self._lock:
                self._notifications += 1
                self._skipped += 1
            return
        except Exception as e:
            failure, call = ("seccomp notification handling failed; letting the call continue", e), None
        self._conclude(nid, pid, t0, call, admitted, failure)

    def _ask_loop(self, loop: asyncio.AbstractEventLoop, nid: int, tid: int, t0: int, call: _Call) -> None:
        """A new session: ask `decide` on the loop; `_answer_decided` answers when it is back."""
        assert call.kind is not None
        self._pending[nid] = (call, tid, t0)
        try:
            loop.call_soon_threadsafe(self._decide_on_loop, nid, call.kind, call.h_class)
        except RuntimeError as e:  # the loop is closed: nobody can decide, and the caller must not wait
            del self._pending[nid]
            self._conclude(nid, tid, t0, call, True, ("the daemon's event loop is closed; admitting the call", e))
            return
        with self._lock:
            self._asked += 1

    def _decide_on_loop(self, nid: int, kind: SessionKind, h_class: int) -> None:
        """On the loop: ask `decide`, hand the answer back to the serving thread."""
        if self._closed:
            return  # the call failed with ENOSYS when the listener closed (or will): nothing to decide
        admitted, error = False, None
        try:
            admitted = bool(self._decide(self.tenant, kind, h_class))
        except Exception as e:
            admitted, error = True, e
        with self._lock:
            if not self._finished:
                self._decided.append((nid, admitted, error))
                with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the thread
                    os.write(self._wake_w, b"d")
                return
        if admitted:  # closed meanwhile: the caller got ENOSYS; give back what decide() reserved
            self._emit_now([SessionEvent(self.tenant, EventAction.ABORTED, kind, h_class, 0, 0, 0)])

    def _answer_decided(self) -> None:
        while True:
            with self._lock:
                if not self._decided:
                    return
                nid, admitted, error = self._decided.popleft()
            entry = self._pending.pop(nid, None)
            if entry is None:
                continue
            call, tid, t0 = entry
            failure = None if error is None else ("seccomp decide() failed; admitting the call", error)
            self._conclude(nid, tid, t0, call, admitted, failure)

    def _conclude(
        self, nid: int, pid: int, t0: int, call: _Call | None, admitted: bool, failure: tuple[str, BaseException] | None
    ) -> None:
        """Count, answer, then report: the tail of every notification, decided or not."""
        refused = False
        events: list[SessionEvent] = []
        if call is not None:
            refused = call.kind is not None and not admitted
            try:
                # Book-keeping happens before the answer, so counts are exact by the time the caller resumes;
                # callbacks and logging wait until after it, so they cost the caller nothing.
                events = self._commit(call, nid, pid, refused)
            except Exception as e:
                failure, refused = ("seccomp notification handling failed; letting the call continue", e), False
                if admitted and call.kind is not None and call.join is None:  # decide() may have reserved
                    events = [SessionEvent(self.tenant, EventAction.ABORTED, call.kind, call.h_class, pid, call.handle, 0)]
                call = None
        with self._lock:
            self._notifications += 1
        answered = self._answer(nid, -errno.EPERM if refused else 0)
        with self._lock:
            self._latency_ns.append(time.perf_counter_ns() - t0)
            if not answered:
                self._skipped += 1
        if not answered:
            events = self._undo(call, events)
        self._emit_all(events)
        if failure is not None:
            with self._lock:
                self._errors += 1
            log.error(failure[0], tenant=self.tenant, pid=pid, exc_info=failure[1])
        if refused and call is not None and answered:
            log.info("gpu session refused", tenant=self.tenant, kind=str(call.kind), h_class=f"{call.h_class:#06x}", pid=pid)

    def _answer(self, nid: int, error: int) -> bool:
        """SEND: "continue" (error 0) or fail the call with `error` (-errno). False when the call is gone."""
        resp = struct.pack(_RESP_FORMAT, nid, 0, error, 0 if error else _FLAG_CONTINUE)
        try:
            fcntl.ioctl(self._fd, _NOTIF_SEND, resp)
        except OSError as e:
            if e.errno != errno.ENOENT:
                self._warn_once("send", f"seccomp answer failed: {e.strerror}")
            return False
        return True

    def _id_valid(self, nid: int) -> bool:
        arg = struct.pack("=Q", nid)
        while True:
            try:
                fcntl.ioctl(self._fd, self._id_valid_cmd, arg)
                return True
            except OSError as e:
                if e.errno == errno.ENOENT:
                    return False
                if e.errno in (errno.EINVAL, errno.ENOTTY) and self._id_valid_cmd == _NOTIF_ID_VALID_OLD:
                    self._id_valid_cmd = _NOTIF_ID_VALID
                    continue
                raise

    def _examine(self, nid: int, pid: int, nr: int, arch: int, args: list[int]) -> _Call:
        """Decode the call from the caller's memory. _Call(0) means: nothing to decide or track, continue."""
        if IOCTL_SYSCALL.get(arch) != nr:
            return _Call(0)
        _type, enr, size = decode_ioctl(args[1])
        if enr not in (RM_ALLOC, RM_FREE, XFER):
            return _Call(0)
        if pid == 0:
            self._warn_once("pid0", "a notified caller is outside the daemon's pid namespace; letting its calls continue")
            return _Call(0)
        try:
            mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except PermissionError:
            self._warn_once("mem", "cannot read tenants' memory (/proc/PID/mem): run the daemon as root; letting calls continue")
            return _Call(0)
        except OSError:
            return _Call(0)  # gone already: the answer will fail harmlessly
        try:
            addr = args[2]
            if enr == XFER:
                if size != XFER_SIZE:
                    return _Call(0)  # the driver refuses it (EINVAL)
                enr, size, addr = struct.unpack(XFER_FORMAT, _read_mem(mem, addr, XFER_SIZE))
            if enr == RM_ALLOC and size in RM_ALLOC_SIZES:
                h_root, h_parent, h_new, h_class, params = struct.unpack("=IIIIQ", _read_mem(mem, addr, 24))
                call = _Call(RM_ALLOC, h_root, h_parent, h_new, h_class, classify(h_class))
                if call.kind in _ENGINE_KINDS and params:
                    with contextlib.suppress(OSError, ValueError):  # NV_BSP/MSENC/NVJPG/OFA_ALLOCATION_PARAMETERS
                        p_size, _prohibit, instance = struct.unpack("=III", _read_mem(mem, params, 12))
                        call.instance = instance if p_size >= 12 else None
            elif enr == RM_FREE and size == NVOS00_SIZE:
                h_root, h_parent, h_old = struct.unpack("=III", _read_mem(mem, addr, 12))
                call = _Call(RM_FREE, h_root, h_parent, h_old)
            else:
                return _Call(0)
        except (OSError, ValueError):
            return _Call(0)  # unreadable argument: the driver fails the call with EFAULT itself
        finally:
            os.close(mem)
        if call.op == RM_ALLOC and call.h_root not in self._clients:
            try:
                call.owner = _owner(pid)
            except (OSError, ValueError):
                call.owner = (0, "")
        # Before a decision or a count that depends on what was read, make sure it was read from the caller
        # (its pid not reused meanwhile). Frees check in _commit, only when they uncount something.
        if call.kind is not None and not self._id_valid(nid):
            raise _Gone
        return call

    def _commit(self, call: _Call, nid: int, pid: int, refused: bool) -> list[SessionEvent]:
        """Apply the call to the counts and the object tree; return the events to emit after the answer."""
        kind = call.kind
        if call.op == 0:
            return []
        if refused and kind is not None:
            with self._lock:
                self._refused[kind] += 1
                live = self._live[kind]
            return [SessionEvent(self.tenant, EventAction.REFUSED, kind, call.h_class, pid, call.handle, live)]
        if call.op == RM_FREE:
            return self._free(call, nid)
        client = self._clients.get(call.h_root)
        if client is None:
            tgid, start = call.owner or (0, "")
            client = self._clients[call.h_root] = _Client(tgid, start)
        node = call.handle or next(self._synthetic)
        if node != call.h_parent and (kind is not None or self._nodes < _MAX_NODES):
            if node not in client.parent:
                self._nodes += 1
            client.parent[node] = call.h_parent
            client.children.setdefault(call.h_parent, set()).add(node)
        elif kind is None and node != call.h_parent:
            self._warn_once("nodes", "too many RM objects tracked; frees of ancestors may be missed until exit")
        if kind is None:
            return []
        call.node = node
        session = call.join
        opened = session is None
        if session is None:
            session = _Session(kind, call.h_class, pid, call.handle)
            client.latest[kind] = session
        session.objects.add(node)
        if call.instance is not None:
            session.instances.add(call.instance)
        session.last_ns = time.monotonic_ns()
        client.sessions[node] = session
        with self._lock:
            self._objects[kind] += 1
            if not opened:
                return []
            self._live[kind] += 1
            self._admitted[kind] += 1
            live = self._live[kind]
        return [SessionEvent(self.tenant, EventAction.ADMITTED, kind, call.h_class, pid, call.handle, live)]

    def _joinable(self, client: _Client, call: _Call, tid: int) -> _Session | None:
        kind = call.kind
        if kind not in _GROUPED_KINDS:
            return None
        session = client.latest.get(kind)
        if session is None or not session.objects or session.pid != tid:
            return None
        if time.monotonic_ns() - session.last_ns > self._join_window_ns:
            return None
        if kind in _ENGINE_KINDS and (call.instance is None or call.instance in session.instances):
            return None
        return session

    def _undo(self, call: _Call | None, events: list[SessionEvent]) -> list[SessionEvent]:
        """The answer found the call gone: take back an admission or a refusal that did not happen."""
        out = []
        client = self._clients.get(call.h_root) if call is not None else None
        if call is not None and call.kind is not None and call.node and client is not None:
            session = client.sessions.pop(call.node, None)
            if session is not None:  # the object was recorded: take it back (its session stays if it has others)
                session.objects.discard(call.node)
                with self._lock:
                    self._objects[session.kind] -= 1
        for e in events:
            if e.action is EventAction.ADMITTED:
                with self._lock:
                    self._live[e.kind] -= 1
                    self._admitted[e.kind] -= 1
                    live = self._live[e.kind]
                out.append(SessionEvent(e.tenant, EventAction.ABORTED, e.kind, e.h_class, e.pid, e.handle, live))
            elif e.action is EventAction.REFUSED:
                with self._lock:
                    self._refused[e.kind] -= 1
            else:
                out.append(e)
        return out

    def _free(self, call: _Call, nid: int) -> list[SessionEvent]:
        client = self._clients.get(call.h_root)
        if client is None:
            return []
        if client.sessions and not self._id_valid(nid):
            return []  # read from a process that is gone: uncount nothing
        if call.handle == call.h_root:  # freeing the client frees everything it holds
            return self._release_clients([call.h_root], EventAction.FREED)
        ended: list[_Session] = []
        stack, seen = [call.handle], set()
        while stack:
            h = stack.pop()
            if h in seen:
                continue
            seen.add(h)
            stack.extend(client.children.pop(h, ()))
            parent = client.parent.pop(h, None)
            if parent is not None:
                self._nodes -= 1
                siblings = client.children.get(parent)
                if siblings is not None:
                    siblings.discard(h)
            session = client.sessions.pop(h, None)
            if session is not None and h in session.objects:
                session.objects.discard(h)
                with self._lock:
                    self._objects[session.kind] -= 1
                if not session.objects:
                    ended.append(session)
                    if client.latest.get(session.kind) is session:
                        del client.latest[session.kind]
        return self._uncount(ended, EventAction.FREED)

    def _emit_all(self, events: list[SessionEvent]) -> None:
        """Report events: at once without a loop; with one, on the loop (dropped once it is closed)."""
        if not events or self._on_event is None:
            return
        if self._loop is None:
            self._emit_now(events)
            return
        try:
            self._loop.call_soon_threadsafe(self._emit_now, events)
        except RuntimeError:
            log.debug("event loop closed; session events dropped", tenant=self.tenant, n=len(events))

    def _emit_now(self, events: list[SessionEvent]) -> None:
        if self._on_event is None:
            return
        for event in events:
            try:
                self._on_event(event)
            except Exception:
                log.exception("seccomp on_event callback failed", tenant=self.tenant)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, tenant=self.tenant)

    # ---- numbers ----
    def stats(self) -> SupervisorStats:
        with self._lock:
            samples = sorted(self._latency_ns)
            live = {k: n for k, n in self._live.items() if n}
            objects = {k: n for k, n in self._objects.items() if n}
            admitted = dict(self._admitted)
            refused = dict(self._refused)
            notifications, skipped, errors = self._notifications, self._skipped, self._errors
            asked, pending = self._asked, len(self._pending)

        def pct(p: float) -> float | None:
            if not samples:
                return None
            return samples[min(len(samples) - 1, int(p * len(samples)))] / 1000.0

        return SupervisorStats(
            tenant=self.tenant,
            live=MappingProxyType(live),
            objects=MappingProxyType(objects),
            admitted=MappingProxyType(admitted),
            refused=MappingProxyType(refused),
            notifications=notifications,
            skipped=skipped,
            errors=errors,
            latency_p50_us=pct(0.50),
            latency_p99_us=pct(0.99),
            latency_samples=len(samples),
            closed=self._done.is_set(),
            asked_loop=asked,
            pending=pending,
            sync_wake_up=self._sync_wake_up,
        )
