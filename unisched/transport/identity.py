"""Who is calling: the connecting process pinned by a pidfd, groups from the uid, admin only for host callers.

SO_PEERCRED gives the pid, uid and gid of the process that called connect(). A pid is only a number: once that
process exits, any process (root's included, placed with /proc/sys/kernel/ns_last_pid) may take it, and a
daemon that later reads /proc/<pid> or moves <pid> into a cgroup acts on that stranger. So each connection
keeps a pidfd of the process that connected (SO_PEERPIDFD, or pidfd_open right after accept where the kernel
lacks it): while the pidfd reports the process alive, the pid still names it, and what was read from /proc/<pid>
before that check was the caller's. A process that is gone is never acted on.

Admin rights are a property of the host: root (or a member of `admin_group`, by the uid's group list in
/etc/group and passwd, not by what the process happens to hold) in the daemon's own user and pid namespaces.
Root inside a container with its own pid namespace is an ordinary user, and not root: `peer_of` gives it the
uid CONTAINED_ROOT, so it owns nothing the host's root made (adopted tenants). A caller in a user namespace of its
own (rootless containers, toolbox) is known by the uid that made that namespace, so a user's subordinate uids do not
multiply its per-user bounds, and outside a pod it owns that user's tenants (`PeerCred.contained`); one root made
(a pod's) is CONTAINED_ROOT too. Every book kept per caller counts a
caller in a pod by its pod, whatever uid it runs as (`PeerCred.caller`): root in a pod may take any uid but 0.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field, replace

from unisched.enforce.seccomp.proc import state_and_start
from unisched.policy.callers import Caller, Pod

__all__ = ["CONTAINED_ROOT", "GONE_POD", "PeerCred", "ProcessHandle", "admin_uid", "in_host_namespaces",
           "in_our_namespaces_unpinned", "in_our_pid_ns_unpinned", "is_admin", "kernel_cred", "peer_of", "pin",
           "uid_groups"]

CONTAINED_ROOT = -2
"""The uid of a caller that is root outside the daemon's namespaces (module docstring). Not -1, which the pacing
uses for a caller without credentials."""
NS_GET_OWNER_UID = 0xB704
"""ioctl on a user namespace's fd: the uid that made it, as the daemon's namespace sees it (_IO(0xb7, 0x4))."""
NS_GET_USERNS = 0xB701
"""ioctl on a namespace's fd: an fd of the user namespace that owns it (_IO(0xb7, 0x1))."""
NS_GET_PARENT = 0xB702
"""ioctl on a pid namespace's fd: an fd of its parent (_IO(0xb7, 0x2)); EPERM above the daemon's own."""
MAX_PID_NS_DEPTH = 32
"""The kernel nests pid namespaces at most this deep."""
GONE_POD = 0
"""The pod of a caller gone before its namespaces were read (`peer_of`; no namespace has inode 0)."""

SO_PEERPIDFD = 77
"""getsockopt(SOL_SOCKET, SO_PEERPIDFD): a pidfd of the peer that connected (Linux 6.5+; no Python constant)."""
GROUPS_CACHE_S = 5.0
"""How long a uid's group list is reused: a flood of connections must not cost an /etc/group read each, and a
change of membership takes effect within seconds."""
_CRED = struct.Struct("3i")


class ProcessHandle:
    """The process that connected. With a pidfd (the normal case) it is alive until the pidfd polls readable;
    without one, it is alive while /proc/<pid> shows the same start time and uid as at accept.

    `alive` may run on the registration's move thread while the loop closes the connection: the lock keeps the
    pidfd from being closed (and its number reused by another file) between its read and its poll."""

    def __init__(self, pid: int, uid: int, pidfd: int | None, start: str | None) -> None:
        self.pid = pid
        self.uid = uid
        self._fd = pidfd
        self._start = start
        self._closed = pidfd is None and start is None  # nothing to check against: treated as gone
        self._lock = threading.Lock()

    def alive(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            if self._fd is not None:
                p = select.poll()
                p.register(self._fd, select.POLLIN)
                return not p.poll(0)  # POLLIN: the process has exited
        return _start_and_uid(self.pid) == (self._start, self.uid)

    def close(self) -> None:
        """With the connection: after this the process counts as gone (the fd number may be reused)."""
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def holds_fd(self) -> bool:
        return self._fd is not None


@dataclass(frozen=True)
class PeerCred:
    """SO_PEERCRED at connect time, and the process it names (None where nothing was pinned: `kernel_cred`, or a
    test that builds one by hand)."""

    pid: int
    uid: int
    gid: int
    process: ProcessHandle | None = field(default=None, compare=False, repr=False)
    unpinned: bool = field(default=False, compare=False, repr=False)
    """`kernel_cred`'s: its pid may name another process by now, so `alive`, `in_host_namespaces` and `is_admin`
    refuse it (ValueError) rather than answer for whatever process has the pid now."""
    pod: int | None = field(default=None, compare=False)
    """The pod the caller is in (read by `peer_of`: a process never changes pid namespace); None for a caller in the
    daemon's pid namespace or a rootless container, and where nothing was read."""

    @property
    def caller(self) -> Caller:
        """Whom every book kept per caller counts it as (policy.callers): its pod when it is in one, whatever uid it
        runs as (root in a pod may take any uid but 0); else its uid as known here (`peer_of`)."""
        return self.uid if self.pod is None else Pod(self.pod)

    @property
    def contained(self) -> bool:
        """Whether it owns no host user's tenants (`peer_of` read it): in a pod, where root may take any uid but 0,
        or known only as CONTAINED_ROOT (root in a container, or in a user namespace root made). A caller in the
        daemon's pid namespace, or in a rootless container, inside a user namespace a host user made is that user,
        as the kernel takes it to be for that user's files: it owns that user's tenants, and is never an admin
        (`is_admin` asks for the host's namespaces)."""
        return self.pod is not None or self.uid == CONTAINED_ROOT

    @property
    def who(self) -> dict[str, int]:
        """Its uid, and its pod where it is in one: the fields a log line about the caller names it by."""
        return {"uid": self.uid} if self.pod is None else {"uid": self.uid, "pod": self.pod}

    def alive(self) -> bool:
        """Whether the process that connected still runs (so its pid still names it)."""
        if self.unpinned:
            raise ValueError(f"peer pid {self.pid} was never pinned (kernel_cred): whether it runs is unknown")
        return self.process is None or self.process.alive()


def _ids(conn: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid


def kernel_cred(conn: socket.socket) -> PeerCred:
    """SO_PEERCRED as the kernel recorded it at connect, nothing pinned nor read from /proc: all there is to know of
    a peer that may have exited since, where the socket's place alone says who could connect (the runtime agent
    socket). Marked `unpinned`: never to be asked who the peer is now."""
    return PeerCred(*_ids(conn), unpinned=True)


def peer_of(conn: socket.socket) -> PeerCred:
    """The credentials of an accepted Unix connection, with the connecting process pinned, its uid the one it is
    known by here and its pod (`_known`: one read of its namespaces)."""
    raw = PeerCred(*_ids(conn))
    cred = replace(raw, process=_pin(conn, raw.pid, raw.uid))
    uid, pod = _known(cred)
    return replace(cred, uid=uid, pod=pod)


def _known(cred: PeerCred) -> tuple[int, int | None]:
    """The uid the caller counts as and the pod it is in, from one read of its user and pid namespaces, checked
    alive after it (as `in_host_namespaces`); a caller gone before they were read is CONTAINED_ROOT in GONE_POD.

    Its uid (module docstring): its own in the daemon's user namespace, except root outside the daemon's pid
    namespace; the maker of its user namespace otherwise; CONTAINED_ROOT for root in a container. Its pod: the inode
    of the pid namespace just below the daemon's that holds it, so namespaces it makes inside its pod count as the
    pod's; None in the daemon's pid namespace, and in a rootless container (a top pid namespace a host user made in
    a user namespace of their own: only a process in the daemon's pid namespace can make one, so no pod can claim a
    host user's bucket this way; it is known by that user)."""
    gone = CONTAINED_ROOT, GONE_POD
    try:
        user_ns = os.open(f"/proc/{cred.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return gone
    try:
        pid_ns = os.open(f"/proc/{cred.pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(user_ns)
        return gone
    try:
        ours_pid = _is_ours(pid_ns, "pid")
        if _is_ours(user_ns, "user"):
            uid = CONTAINED_ROOT if cred.uid == 0 and not ours_pid else cred.uid
        else:
            owner = _owner(user_ns)
            uid = CONTAINED_ROOT if owner is None or owner == 0 else owner
        pod = None if ours_pid else _pod_below(pid_ns)
    finally:
        os.close(user_ns)
        os.close(pid_ns)
    return (uid, pod) if cred.alive() else gone


def _is_ours(ns_fd: int, kind: str) -> bool:
    """Whether the namespace open at `ns_fd` is the daemon's own of `kind` ("user", "pid")."""
    st = os.fstat(ns_fd)
    return (st.st_dev, st.st_ino) == _ns(f"/proc/self/ns/{kind}")


def _owner(user_ns_fd: int) -> int | None:
    """The uid that made the user namespace open at `user_ns_fd`, as the daemon's namespace sees it (None: unknown)."""
    try:
        return int(struct.unpack("I", fcntl.ioctl(user_ns_fd, NS_GET_OWNER_UID, bytes(4)))[0])
    except OSError:
        return None


def _pin(conn: socket.socket, pid: int, uid: int) -> ProcessHandle:
    try:
        return ProcessHandle(pid, uid, conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD), None)
    except OSError:
        return pin(pid, uid)  # an older kernel (ENOPROTOOPT), or the peer already gone (ESRCH)


def pin(pid: int, uid: int | None = None) -> ProcessHandle:
    """Process `pid` as it is now, held by a pidfd (where none can be had, by its start time and owner): what is read
    of /proc/<pid> after this and before its `alive()` says True was this process's. One that is gone, or (`uid`
    given) whose pid already names another user's process, counts as gone."""
    start = _start_and_uid(pid)
    if start is None or (uid is not None and start[1] != uid):
        return ProcessHandle(pid, -1 if uid is None else uid, None, None)
    try:
        fd: int | None = os.pidfd_open(pid)
    except OSError:
        fd = None
    if fd is not None and _start_and_uid(pid) != start:  # replaced between the read and pidfd_open
        os.close(fd)
        return ProcessHandle(pid, start[1], None, None)
    return ProcessHandle(pid, start[1], fd, start[0])


def _start_and_uid(pid: int) -> tuple[str, int] | None:
    """The start time of process `pid` and the owner of /proc/<pid>; None when it is gone or a zombie."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    stat = state_and_start(pid)
    if stat is None or stat[0] == "Z":
        return None
    return stat[1], uid


_groups: dict[int, tuple[float, frozenset[int]]] = {}


def uid_groups(uid: int) -> frozenset[int]:
    """The groups the uid belongs to by passwd and /etc/group (empty for a uid with no account)."""
    now = time.monotonic()
    hit = _groups.get(uid)
    if hit is not None and now - hit[0] < GROUPS_CACHE_S:
        return hit[1]
    try:
        pw = pwd.getpwuid(uid)
        groups = frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
    except (KeyError, OSError):
        groups = frozenset()
    if len(_groups) > 4096:
        _groups.clear()
    _groups[uid] = (now, groups)
    return groups


def _ns(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _ours(pid: int, kind: str) -> bool:
    """Whether process `pid` is in the daemon's own namespace of `kind` ("user", "pid"); False when it is gone."""
    theirs = _ns(f"/proc/{pid}/ns/{kind}")
    return theirs is not None and theirs == _ns(f"/proc/self/ns/{kind}")


def in_host_namespaces(cred: PeerCred) -> bool:
    """Whether the caller shares the daemon's user and pid namespaces (read through its pid, then checked
    alive: a live pidfd means the pid still named the caller when its namespaces were read)."""
    if cred.unpinned:
        raise ValueError(f"peer pid {cred.pid} was never pinned (kernel_cred): its namespaces cannot be vouched for")
    return _ours(cred.pid, "user") and _ours(cred.pid, "pid") and cred.alive()


def is_admin(cred: PeerCred, admin_gid: int | None) -> bool:
    """Root, or a member of the admin group by the uid's group list, and in the host's namespaces."""
    if cred.unpinned:
        raise ValueError(f"peer pid {cred.pid} was never pinned (kernel_cred): it cannot be an admin")
    return admin_uid(cred.uid, admin_gid) and in_host_namespaces(cred)


def admin_uid(uid: int, admin_gid: int | None) -> bool:
    """Whether `uid` is an admin's: root, or a member of the admin group by its group list (`is_admin` also asks
    that the caller be in the host's namespaces)."""
    return uid == 0 or (admin_gid is not None and admin_gid in uid_groups(uid))


def in_our_namespaces_unpinned(pid: int) -> bool:
    """Whether `pid` names a process in the daemon's user and pid namespaces now (unpinned, as
    `in_our_pid_ns_unpinned`: for a process that holds something, not one that asks; False when it is gone)."""
    return _ours(pid, "user") and _ours(pid, "pid")


def in_our_pid_ns_unpinned(pid: int) -> bool:
    """Whether `pid` names a process in the daemon's pid namespace now. Nothing is pinned, so the pid may name
    another process than the one that connected: only for deciding to refuse cheaply (frontdoor._surely_refused),
    where a wrong True costs a caller already gone its connection."""
    return _ours(pid, "pid")


def _pod_below(pid_ns: int) -> int | None:
    """The pod of a caller whose pid namespace (not the daemon's) is open at `pid_ns` (`_known`)."""
    ours = _ns("/proc/self/ns/pid")
    fd, st = pid_ns, os.fstat(pid_ns)
    try:
        for _ in range(MAX_PID_NS_DEPTH):
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except OSError:
                break  # not below the daemon's namespace: counted as a pod of its own
            pst = os.fstat(parent)
            if (pst.st_dev, pst.st_ino) == ours:
                os.close(parent)
                break
            if fd != pid_ns:
                os.close(fd)
            fd, st = parent, pst
        return None if _made_by_host_user(fd) else st.st_ino
    finally:
        if fd != pid_ns:
            os.close(fd)


def _made_by_host_user(pid_ns_fd: int) -> bool:
    """Whether the pid namespace is owned by a user namespace a non-root host uid made (a rootless container)."""
    try:
        user_ns = fcntl.ioctl(pid_ns_fd, NS_GET_USERNS)
    except OSError:
        return False
    try:
        if _is_ours(user_ns, "user"):
            return False
        owner = _owner(user_ns)
        return owner is not None and owner != 0
    except OSError:
        return False
    finally:
        os.close(user_ns)
