"""Caller identity from the kernel: SO_PEERCRED on the daemon's Unix sockets, which the daemon accepts itself.

The daemon binds one socket per protocol: gRPC (`socket`, served by grpcdoor.py) and the lease stream
(`lease_socket`, lease.py). Each accepted connection's SO_PEERCRED (pid, uid, gid) is read and the connecting
process pinned by a pidfd (identity.py) before the socket's server sees a byte, and the server keeps those
credentials for the connection's life: no TCP port, no lookup by address, so identity cannot be forged by a
request field or reached through a side door.

What one user's connections may cost is bounded (options.py gives each number's reason), over both sockets
together: connections per uid, with a reserve the global cap keeps for admins (a caller outside the daemon's pid
namespace counts by its pod, not its uid, and pods together hold at most a share of the cap); a deadline for a connection's
opening bytes (the lease stream's MAGIC and hello, HTTP/2's preface) and for each unfinished request; the bytes
of unfinished requests per uid; and an idle timeout for gRPC connections. Refusals happen at accept, before any
read. A connection that opens with the other protocol's bytes is refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import resource
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from unisched.logs import Throttle
from unisched.policy.callers import Caller, Pod
from unisched.transport.identity import PeerCred, in_our_pid_ns_unpinned, kernel_cred, peer_of
from unisched.transport.options import (
    ADMIN_RESERVE,
    CONTAINED_SHARE,
    GRPC_CALLS_PER_CONNECTION,
    GRPC_IDLE_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_UID,
    MAX_PARTIAL_BYTES_PER_UID,
    OPENING_DEADLINE_S,
    PARTIAL_FRAME_S,
    TRIM_AFTER_CLOSED,
    TRIM_EVERY_S,
)

__all__ = ["FrontDoor", "FrontDoorLimits", "Serve", "StreamLimits", "read_opening"]

log = structlog.get_logger("unisched.transport")
_CHUNK = 1 << 16
FDS_PER_CONNECTION = 2  # the accepted Unix socket and its caller's pidfd
FD_RESERVE = 256  # for everything else: cgroup files, state file, logs, seccomp listeners handed over by tenants
BACKLOG = 1024  # a burst of clients queues in the kernel instead of getting EAGAIN (asyncio's default is 100)
REFUSAL_LOG_INTERVAL_S = 1.0
"""At most one 'too many connections' line a second, saying how many were refused since the last."""
ACCEPT_BATCH = 32
"""Connections taken from the backlog in one turn of the loop once one is ready; then the loop's other work runs.
Admitting one costs ~70 us (its caller pinned, /proc read), so a turn of 32 keeps a process churning
connect/close from holding the loop for more than a few ms. A refusal costs one getsockopt, so a flood is still
drained quickly."""
_ADMIN = -1
"""The bucket of connections admitted into the admins' reserve (not counted against a uid)."""
Bucket = Caller
"""Whose count a connection goes to: its caller (PeerCred.caller: a uid, or its pod), or _ADMIN."""
H2_STREAMS = 100
"""The calls in flight an HTTP/2 connection may carry by default (h2's own limit): admins' and the TLS listener's."""


@dataclass(frozen=True)
class FrontDoorLimits:
    """The front door's limits (options.py says why each default is what it is); tests may pass smaller ones."""

    per_uid: int = MAX_CONNECTIONS_PER_UID
    admin_reserve: int = ADMIN_RESERVE
    contained_share: float = CONTAINED_SHARE
    opening_s: float = OPENING_DEADLINE_S
    partial_frame_s: float = PARTIAL_FRAME_S
    partial_bytes_per_uid: int = MAX_PARTIAL_BYTES_PER_UID
    grpc_idle_s: float = GRPC_IDLE_S
    grpc_calls: int = GRPC_CALLS_PER_CONNECTION


@dataclass(frozen=True)
class StreamLimits:
    """What one connection is held to: its opening (hello) and each unfinished request in time, its unfinished
    requests' bytes against its uid's budget (`hold(delta)` is False once that budget is exceeded), and (gRPC)
    how long it may stay idle."""

    hello_s: float
    partial_frame_s: float
    hold: Callable[[int], bool]
    idle_s: float = GRPC_IDLE_S
    calls: int = H2_STREAMS
    """(gRPC) calls in flight at once on the connection."""


Serve = Callable[[socket.socket, PeerCred, StreamLimits], Awaitable[None]]
"""Serves one admitted connection of a socket until it ends. It owns the socket (closes it, or hands it to a
transport that does); the front door closes the caller's pidfd once it returns."""


def connection_budget(wanted: int) -> int:
    """How many connections the open-file limit allows, raising the soft limit towards the hard one first. Past
    it, accept() would fail with EMFILE (asyncio then spins logging it), so the front door refuses connections
    cleanly before that point."""
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


class FrontDoor:
    """Every Unix socket the daemon serves, with one set of counts: a uid's connections to any of them count
    against the same cap."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS, is_admin: Callable[[PeerCred], bool] | None = None,
                 limits: FrontDoorLimits | None = None, may_be_admin: Callable[[int], bool] | None = None) -> None:
        self.is_admin = is_admin or (lambda cred: False)
        self.may_be_admin = may_be_admin or ((lambda uid: False) if is_admin is None else (lambda uid: True))
        """Whether a caller of this raw SO_PEERCRED uid could be an admin (root, the admin group): only such callers
        are pinned and asked `is_admin` once their uid's bucket or the non-admin part of the cap is full."""
        self.limits = limits or FrontDoorLimits()
        self.max_connections = max_connections
        self.refused = 0
        self._listeners: list[socket.socket] = []
        self._acceptors: list[asyncio.Task[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._per_uid: Counter[Bucket] = Counter()
        """Connections held per bucket: a non-admin host uid, a pod's pid namespace, or _ADMIN for the reserve."""
        self._contained = 0
        """Connections held by pods' buckets together."""
        self._partial: Counter[Bucket] = Counter()
        """Bytes of unfinished requests held per bucket."""
        self._refusals = Throttle(REFUSAL_LOG_INTERVAL_S)
        self._closed_since_trim = 0
        self._trim_pending = False
        self._trimmed_at = float("-inf")
        budget = connection_budget(max_connections)
        if budget < max_connections:
            log.warning("open-file limit bounds client connections", max_connections=budget, wanted=max_connections,
                        nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            self.max_connections = budget

    @property
    def connections(self) -> int:
        return len(self._tasks)

    async def open(self, path: str, serve: Serve) -> None:
        """Bind `path` (the caller has claimed it: transport.claim) and serve its connections with `serve`."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listeners.append(listener)
        self._acceptors.append(asyncio.create_task(self._accept_loop(listener, serve)))

    async def _accept_loop(self, listener: socket.socket, serve: Serve) -> None:
        """Wait for a connection, then take what the backlog holds (up to ACCEPT_BATCH), deciding on each as it
        is accepted: admitted ones get a task, the rest are closed at once, so limits apply before any read and
        a burst never runs the daemon out of file descriptors (EMFILE). Then the loop's other work runs:
        `sock_accept` returns at once, without yielding, while connections are queued, so a flood would otherwise
        hold the whole loop."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:
                if listener.fileno() == -1:
                    return  # closed
                await _accept_failed(e)
                continue
            self._admit(conn, serve)
            for _ in range(ACCEPT_BATCH):
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    await _accept_failed(e)
                    break
                self._admit(conn, serve)
            await asyncio.sleep(0)

    def _admit(self, conn: socket.socket, serve: Serve) -> None:
        conn.setblocking(False)
        try:
            raw = kernel_cred(conn)
            raw_uid = raw.uid
            if self._surely_refused(raw_uid, raw.pid):
                self._refuse(raw_uid)
                conn.close()
                return
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
        self._contained += isinstance(bucket, Pod)
        task = asyncio.create_task(self._handle(conn, cred, bucket, serve))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._closed(t, bucket))

    def _reserve(self) -> int:
        return min(self.limits.admin_reserve, self.max_connections // 4)

    def _surely_refused(self, raw_uid: int, raw_pid: int) -> bool:
        """Whether _bucket would refuse the caller whoever it turns out to be, judged by the kernel's credentials
        (one getsockopt, before the ~70 us of pinning it): the cap is full, or the caller cannot be an admin and
        the non-admin part of the cap is, or its uid's bucket is and its pid is in the daemon's pid namespace (one
        stat, only then). A caller in a pod is counted by its pod, never by the uid it runs as, so a host user's
        full bucket must not refuse a pod's process of the same raw uid: it is pinned and bucketed by peer_of.
        The pid is not pinned here, so this only ever refuses: a pid reused meanwhile by a host process means the
        caller is gone. A subordinate uid (a rootless container's) counts here as itself: it is refused early
        only when that very host uid holds a full bucket."""
        if self._full():
            return True
        if self.may_be_admin(raw_uid):
            return False
        if not self._non_admin_room():
            return True
        return not self._bucket_room(raw_uid) and in_our_pid_ns_unpinned(raw_pid)

    def _full(self) -> bool:
        """The cap is reached: no one else gets in, admins neither."""
        return len(self._tasks) >= self.max_connections

    def _non_admin_room(self) -> bool:
        """The cap less the admins' reserve has room."""
        return len(self._tasks) < self.max_connections - self._reserve()

    def _bucket_room(self, bucket: Bucket) -> bool:
        """`bucket` holds fewer than `per_uid` connections."""
        return self._per_uid[bucket] < self.limits.per_uid

    def _contained_cap(self) -> int:
        return int((self.max_connections - self._reserve()) * self.limits.contained_share)

    def _bucket(self, cred: PeerCred) -> Bucket | None:
        """Which count the connection goes to, or None to refuse it. A caller outside the daemon's pid namespace
        goes to its pod's (PeerCred.caller: at most `per_uid`, whatever uids root in the pod takes, and only while
        pods together hold less than their share of the non-admin cap, so pods never lock host users out and a
        pod's own namespaces do not multiply its bucket); any other to its uid's (at most `per_uid`, while the
        global cap minus the admins' reserve has room), else the reserve if it is an admin's."""
        if self._full():
            return None
        room = self._non_admin_room()
        caller = cred.caller
        if isinstance(caller, Pod):
            ok = room and self._bucket_room(caller) and self._contained < self._contained_cap()
            return caller if ok else None  # never an admin: admins are in the host's namespaces
        if room and self._bucket_room(caller):
            return caller
        return _ADMIN if self.is_admin(cred) else None

    def _closed(self, task: asyncio.Task[None], bucket: Bucket) -> None:
        self._tasks.discard(task)
        self._contained -= isinstance(bucket, Pod)
        self._per_uid[bucket] -= 1
        if self._per_uid[bucket] <= 0:
            del self._per_uid[bucket]
        self._closed_since_trim += 1
        if self._closed_since_trim >= TRIM_AFTER_CLOSED and not self._trim_pending:
            self._trim_pending = True
            loop = asyncio.get_running_loop()
            loop.call_later(max(1.0, self._trimmed_at + TRIM_EVERY_S - loop.time()), self._trim)

    def _trim(self) -> None:
        """Give the heap a burst of connections left behind back to the system (glibc only), once a TRIM_EVERY_S."""
        self._trim_pending = False
        self._closed_since_trim = 0
        self._trimmed_at = asyncio.get_running_loop().time()
        trim = _malloc_trim()
        if trim is not None:
            trim(0)

    def _hold(self, bucket: Bucket, delta: int) -> bool:
        """Account bytes of a connection's unfinished requests; False when its uid is over its budget."""
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

    async def close(self) -> None:
        for task in self._acceptors:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for listener in self._listeners:
            listener.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def _stream_limits(self, bucket: Bucket, admin: bool) -> StreamLimits:
        lim = self.limits
        return StreamLimits(lim.opening_s, lim.partial_frame_s, lambda d: self._hold(bucket, d), lim.grpc_idle_s,
                            H2_STREAMS if admin else lim.grpc_calls)

    async def _handle(self, conn: socket.socket, cred: PeerCred, bucket: Bucket, serve: Serve) -> None:
        try:
            await serve(conn, cred, self._stream_limits(bucket, self.is_admin(cred)))
        except (ConnectionError, OSError):
            conn.close()
        finally:
            if cred.process is not None:
                cred.process.close()


async def read_opening(conn: socket.socket, verdict: Callable[[bytes], bool | None], timeout_s: float) -> bytes:
    """A connection's first bytes, once `verdict` can tell whether they open this socket's protocol (b"" if the
    connection closed or stayed silent past `timeout_s`). Clients of both protocols speak first, so nothing waits
    on the daemon; a silent one holds only its own socket until the deadline."""
    loop = asyncio.get_running_loop()

    async def read() -> bytes:
        first = b""
        while True:
            chunk = await loop.sock_recv(conn, _CHUNK)
            if not chunk:
                return b""
            first += chunk
            if verdict(first) is not None:
                return first

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        return b""  # silent: it held one socket for a few seconds


async def _accept_failed(e: OSError) -> None:
    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
        log.error("out of file descriptors accepting a client; pausing accepts", error=e.strerror)
        await asyncio.sleep(0.1)  # back off; the clients wait in the kernel's backlog meanwhile
    elif e.errno not in (errno.ECONNABORTED, errno.EAGAIN, errno.EINTR, errno.EPROTO):
        log.error("accepting a client failed", error=e.strerror)
        await asyncio.sleep(0.1)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, looked up once (find_library runs `ldconfig -p`, a process, each time); None elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim
