"""One daemon per socket and state directory (transport.claim): a lock held by a process that cannot be a daemon
does not keep the daemon out.

/run/unisched, where the socket's lock file lies, is mounted into pods, and flock needs only a read-only open: a pod's
process (root of its own pid namespace) or a local user (for a lock file an older version made 0644) that takes the
lock before a restart would otherwise keep every daemon from starting. A holder that could be a daemon (root in the
daemon's namespaces) still keeps a second one out."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from unisched.transport.claim import LockSquatted, SocketInUse, _squatted, claim_socket, claim_state_dir

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="taking a lock as another user needs root")

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def _holder(lock: Path, *prefix: str, user: int | None = None) -> subprocess.Popen[str]:
    """A process that opens `lock` read-only, holds its flock, says so, and keeps it until its stdin closes."""
    python = sys.executable if user is None else shutil.which("python3", path="/usr/bin:/bin")  # one others may run
    if python is None:
        pytest.skip("no python3 in /usr/bin for another user to run")
    proc = subprocess.Popen([*prefix, python, "-c", HOLD, str(lock)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, user=user)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _end(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    proc.wait(timeout=30)
    proc.stdout.close()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's own are root's alone), as /run/unisched is."""
    with tempfile.TemporaryDirectory(prefix="unisched-claim-", dir="/tmp") as d:
        os.chmod(d, 0o755)
        yield Path(d)


@needs_root
def test_a_lock_a_user_holds_on_an_older_readable_lock_file_is_taken_from_it(open_dir: Path) -> None:
    tmp_path = open_dir
    sock, lock = tmp_path / "unisched.sock", tmp_path / "unisched.sock.lock"
    lock.write_text("1\n")
    lock.chmod(0o644)  # as an older version made it
    squatter = _holder(lock, user=65534)
    try:
        old = lock.stat().st_ino
        claim = claim_socket(str(sock))
        assert lock.stat().st_ino != old and stat.S_IMODE(lock.stat().st_mode) == 0o600
        assert os.fstat(claim.fd).st_ino == lock.stat().st_ino
        with pytest.raises(SocketInUse, match=f"pid {os.getpid()}"):  # and the new lock keeps a second daemon out
            claim_socket(str(sock))
        claim.release()
    finally:
        _end(squatter)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unisched.sock.lock"]  # no temp file left


@needs_root
def test_the_daemon_takes_a_squatted_socket_lock_only_once_it_holds_its_state_directory(open_dir: Path) -> None:
    """Two daemons starting at once could each replace the squatted file, the second over the first's: the
    replacement waits for the state directory's lock, which only one of them gets (daemon._claim)."""
    from unisched.daemon import StartError, _claim
    from unisched.scheduler.config import DaemonConfig

    sock, state = open_dir / "unisched.sock", open_dir / "state"
    lock = open_dir / "unisched.sock.lock"
    lock.write_text("1\n")
    lock.chmod(0o644)
    squatter = _holder(lock, user=65534)
    try:
        old = lock.stat().st_ino
        with pytest.raises(LockSquatted):
            claim_socket(str(sock), replace=False)
        assert lock.stat().st_ino == old  # left as it was
        held = claim_state_dir(str(state))  # another daemon of this state directory is starting
        config = DaemonConfig(socket=str(sock), lease_socket=str(open_dir / "lease.sock"), state_dir=str(state))
        with pytest.raises(StartError, match="keeps its state in"):
            _claim(config)
        assert lock.stat().st_ino == old  # it did not replace the socket's lock before it was refused
        held.release()
        claims = _claim(config)
        assert lock.stat().st_ino != old
        for c in claims:
            c.release()
    finally:
        _end(squatter)


@needs_root
def test_a_lock_root_holds_in_the_daemons_namespaces_keeps_the_daemon_out(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    lock.touch(mode=0o600)
    holder = _holder(lock)
    try:
        with pytest.raises(SocketInUse, match="keeps its state in"):
            claim_state_dir(str(tmp_path))
        assert lock.exists()
    finally:
        _end(holder)
    claim_state_dir(str(tmp_path)).release()  # once let go, taken as ever


@needs_root
def test_a_lock_root_of_another_pid_namespace_holds_is_taken_from_it(tmp_path: Path) -> None:
    """A pod's root: uid 0, but in a pid namespace of its own."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--pid", "--fork", "true"], check=False).returncode != 0:
        pytest.skip("unshare --pid is not available here")
    lock = tmp_path / ".lock"
    lock.touch(mode=0o600)
    pod = _holder(lock, unshare, "--pid", "--fork")
    try:
        claim = claim_state_dir(str(tmp_path))
        claim.release()
    finally:
        _end(pod)


def test_an_unreadable_lock_table_or_no_holder_listed_is_never_a_squat(tmp_path: Path) -> None:
    st = os.stat(tmp_path)
    assert _squatted(st, tmp_path / "no-proc") is False
    (tmp_path / "locks").write_text(f"1: FLOCK  ADVISORY  WRITE 4242 00:00:{st.st_ino + 1} 0 EOF\n")
    assert _squatted(st, tmp_path) is False
