"""One daemon per socket: `<socket>.lock`, flock'ed for the daemon's life, taken before anything is touched (and
one per state directory: `<state_dir>/.lock`).

A second `unisched serve` on a live daemon's socket would delete the socket and thaw the first daemon's tenants;
it is refused instead, while another daemon holds the lock or answers on the socket (one that took no lock).
The lock file is never deleted: deleting it would let two daemons hold locks on two different files. It is
replaced only where no holder of its lock could be a daemon (`_squatted`): /run/unisched is mounted into pods, and
flock needs only a read-only open, so a pod (or a user, for a lock file made readable by an older version) could
otherwise hold the lock from before a restart and keep every daemon out.

Also where the sockets go: `replace_stale_socket` makes way for one, and `make_private_directory` makes the
runtime agent socket's directory the daemon's alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from unisched.transport.identity import in_our_namespaces_unpinned

__all__ = ["LockSquatted", "SocketClaim", "SocketInUse", "claim_socket", "claim_state_dir", "make_private_directory",
           "replace_stale_socket", "socket_answers"]

CONNECT_TIMEOUT_S = 2.0
"""A live daemon accepts a Unix connection at once (the kernel queues it); 2 s covers one busy on 2 cores."""


class SocketInUse(RuntimeError):
    """Another daemon serves on this socket; the message says which and what to do."""


class LockSquatted(SocketInUse):
    """Only processes that cannot be a daemon hold the lock (`_squatted`): taken from them with `replace=True`, once
    the caller holds its state directory's lock (so that two daemons starting at once cannot both replace it)."""


@dataclass
class SocketClaim:
    """Held for the daemon's life; the lock goes with the process (also on SIGKILL)."""

    lock_path: Path
    fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def socket_answers(path: str) -> bool:
    """Whether something accepts connections on the Unix socket `path` now."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(CONNECT_TIMEOUT_S)
    try:
        s.connect(path)
    except OSError as e:
        # EAGAIN: a listener whose backlog is full lives
        return e.errno in (errno.EAGAIN, errno.ETIMEDOUT) or isinstance(e, TimeoutError)
    finally:
        s.close()
    return True


def replace_stale_socket(path: str) -> None:
    """Make way for a socket at `path`: create its directory and remove a stale socket file left there, but never
    a file that is not a socket, nor a socket something answers on (another daemon's: the main socket and the
    seccomp agent's alike). Raises OSError saying why not."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise OSError(f"{path} exists and is not a socket; refusing to replace it")
        if socket_answers(path):
            raise OSError(f"a daemon answers on {path}; refusing to replace its socket")
        p.unlink()


def make_private_directory(directory: str, own: str) -> bool:
    """Make `directory` this daemon's user's alone (0700) for the one file `own` (a socket's name): created if
    missing (True), else narrowed to 0700 only if it is empty or holds just `own` (a stale socket): what systemd's
    RuntimeDirectory= or a Kubernetes hostPath gives. Any other directory (one that holds other files, such as /etc;
    one another user owns or others may write; a link) is left as it is and refused with an OSError: narrowing it
    would take it from whoever else uses it, and what is in it need not be ours."""
    made = True
    try:
        Path(directory).mkdir(mode=0o700, parents=True)
    except FileExistsError:
        made = False
    own_it = "give the runtime agent socket a directory of its own"
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # (a link to a directory: ENOTDIR, not ELOOP, with O_DIRECTORY)
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        raise OSError(e.errno, f"{directory} is a link or not a directory; {own_it}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise OSError(f"{directory} belongs to uid {st.st_uid}, not to this daemon's; {own_it}")
        if st.st_mode & 0o022:
            raise OSError(f"others may write to {directory} (mode {stat.S_IMODE(st.st_mode):04o}); {own_it}")
        others = sorted(set(os.listdir(fd)) - {own})
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise OSError(f"{directory} holds other files ({shown}), so it is not made this daemon's alone (0700); "
                          f"{own_it}")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return made


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().strip())
        return f"pid {pid}"
    return "another process"


PROC = Path("/proc")


def _lock(lock_path: Path, taken: str, replace: bool = True, proc: Path = PROC) -> int:
    """The flock'ed fd of `lock_path` (made if need be, root's alone, never through a link), or SocketInUse: `taken`
    says what the holder does (with {holder} for who it is). A lock only processes that cannot be a daemon hold is
    taken from them (`_squatted`) where `replace`: the file is replaced by a new one, locked before it takes the
    name; else LockSquatted."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        squatted = _squatted(os.fstat(fd), proc)
        holder = _holder(fd)
        os.close(fd)
        if not squatted:
            raise SocketInUse(taken.format(holder=holder)) from None
        if not replace:
            raise LockSquatted(f"{lock_path} is held by processes that cannot be a daemon ({holder})") from None
        return _replace_lock(lock_path)
    os.fchmod(fd, 0o600)  # (one made readable by an older version)
    return fd


def _squatted(st: os.stat_result, proc: Path = PROC) -> bool:
    """Whether every holder of a flock on the file `st` is a process that cannot be a daemon: not root, or root of
    another pid or user namespace (a pod's), or gone. False where /proc/locks shows no holder (it was let go: try
    again) or cannot be read."""
    try:
        text = (proc / "locks").read_text()
    except OSError:
        return False
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = [int(f[4]) for f in (line.split() for line in text.splitlines())
            if len(f) > 5 and f[1] == "FLOCK" and f[5] == inode and f[4].isdigit()]
    return bool(pids) and not any(_could_be_a_daemon(pid) for pid in pids)


def _could_be_a_daemon(pid: int) -> bool:
    """Root (its effective uid: /proc/PID's owner is root for any process that made itself undumpable) in this
    process's pid and user namespaces, as a daemon is; the kernel lists a pod's process here too, by its pid here.
    False when it is gone (or never was: the lock's fd passed on by a process that exited)."""
    try:
        status = (PROC / str(pid) / "status").read_text()
        uid = next(line.split()[2] for line in status.splitlines() if line.startswith("Uid:"))
    except (OSError, StopIteration, IndexError):
        return False
    return uid == "0" and in_our_namespaces_unpinned(pid)


def _replace_lock(lock_path: Path) -> int:
    """A new lock file, flock'ed, renamed over `lock_path`: whoever held the old one holds a file no daemon uses."""
    tmp = lock_path.with_name(f".{lock_path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, lock_path)
        if os.stat(lock_path).st_ino != os.fstat(fd).st_ino:  # replaced again meanwhile: not ours to run on
            raise SocketInUse(f"{lock_path} was replaced by another process while this daemon took it")
    except (OSError, SocketInUse):
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()  # (gone after the rename)
        raise
    return fd


def _mark(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def claim_state_dir(directory: str) -> SocketClaim:
    """Take `<directory>/.lock`: two daemons saving tenants to one state file would each replace the other's (and at
    its next start each would set the other's entries aside as damaged); SocketInUse otherwise."""
    lock_path = Path(directory) / ".lock"
    fd = _lock(lock_path, f"another unisched daemon ({{holder}}) keeps its state in {directory} (it holds "
                          f"{lock_path}); give this one its own --state-dir")
    _mark(fd)
    return SocketClaim(lock_path, fd)


def claim_socket(path: str, replace: bool = True) -> SocketClaim:
    """Take `<path>.lock` and make sure nothing answers on `path`; SocketInUse otherwise (LockSquatted where only
    processes that cannot be a daemon hold it and not `replace`)."""
    lock_path = Path(f"{path}.lock")
    fd = _lock(lock_path, f"another unisched daemon ({{holder}}) serves on {path} (it holds {lock_path}); "
                          f"stop it first, or give this one its own --socket and --cgroup-subtree", replace)
    if socket_answers(path):
        os.close(fd)
        raise SocketInUse(f"a daemon answers on {path} (without holding {lock_path}); "
                          f"stop it first, or give this one its own --socket and --cgroup-subtree")
    _mark(fd)
    return SocketClaim(lock_path, fd)
