"""The seccomp listener fd's ioctls: receive a notification, check it is still valid, answer it, and write a
refused call's status into the caller's memory. No decisions here; the supervisor makes them."""

from __future__ import annotations

import errno
import fcntl
import os
import select
import struct
import time
from collections.abc import Callable
from typing import Final, NamedTuple

from unisched.enforce.nvclasses import NV_ERR_NO_MEMORY
from unisched.enforce.seccomp.abi import (
    FD_SYNC_WAKE_UP,
    FLAG_CONTINUE,
    NOTIF_FORMAT,
    NOTIF_ID_VALID,
    NOTIF_ID_VALID_OLD,
    NOTIF_RECV,
    NOTIF_SEND,
    NOTIF_SET_FLAGS,
    NOTIF_SIZE,
    RESP_FORMAT,
)

__all__ = ["Listener", "Notification"]

_NOTIF: Final = struct.Struct(NOTIF_FORMAT)
_RESP: Final = struct.Struct(RESP_FORMAT)
_ID: Final = struct.Struct("=Q")
_STATUS: Final = struct.Struct("=I").pack(NV_ERR_NO_MEMORY)


class Notification(NamedTuple):
    """One notified call: its id, the caller's tid, the syscall number, the audit arch and the six arguments.
    (A named tuple: immutable, and made in one step for every notification.)"""

    nid: int
    pid: int
    nr: int
    arch: int
    args: list[int]


class Listener:
    """ONE seccomp listener fd (owned by the supervisor, which closes it). `warn(key, message)` is told once per
    kind of unexpected failure; the calls themselves never raise for a caller that went away."""

    def __init__(self, fd: int, warn: Callable[[str, str], None]) -> None:
        self.fd = fd
        self._warn = warn
        self._id_valid_cmd = NOTIF_ID_VALID_OLD
        self.send_ns = 0
        """How long the last `answer` spent in its SEND call. In sync wake-up mode the answered caller resumes on
        this thread's CPU and may run there before the call returns: that time is the caller's, not the daemon's."""

    def set_sync_wake_up(self) -> bool:
        """SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (Linux >= 6.6): the kernel wakes the supervisor on the caller's CPU
        and the caller on the supervisor's, as the caller only waits meanwhile (no idle CPU to wake, no IPI).
        False where the kernel does not offer it."""
        try:
            fcntl.ioctl(self.fd, NOTIF_SET_FLAGS, FD_SYNC_WAKE_UP)
        except OSError:
            return False
        return True

    def hung_up(self) -> bool:
        """Whether every process of the filter has exited (the listener polls POLLHUP): nobody will call again."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in poller.poll(0))

    def receive(self) -> Notification | None:
        """The next notification; None when there is none after all (the caller went away meanwhile)."""
        buf = bytearray(NOTIF_SIZE)  # zeroed, as the kernel requires
        try:
            fcntl.ioctl(self.fd, NOTIF_RECV, buf, True)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.EINTR, errno.EAGAIN):  # ENOENT: the caller went away meanwhile
                self._warn("recv", f"seccomp receive failed: {e.strerror}")
            return None
        nid, pid, _flags, nr, arch, _ip, *args = _NOTIF.unpack(buf)
        return Notification(nid, pid, nr, arch, args)

    def answer(self, nid: int, error: int, *, run: bool = True) -> bool:
        """SEND: "continue" (error 0), fail the call with `error` (-errno), or (`run` False, error 0) return 0
        from it without running it. False when the call is gone."""
        resp = _RESP.pack(nid, 0, error, FLAG_CONTINUE if run and not error else 0)
        t0 = time.perf_counter_ns()
        try:
            fcntl.ioctl(self.fd, NOTIF_SEND, resp)
        except OSError as e:
            if e.errno != errno.ENOENT:
                self._warn("send", f"seccomp answer failed: {e.strerror}")
            return False
        finally:
            self.send_ns = time.perf_counter_ns() - t0
        return True

    def id_valid(self, nid: int) -> bool:
        arg = _ID.pack(nid)
        while True:
            try:
                fcntl.ioctl(self.fd, self._id_valid_cmd, arg)
                return True
            except OSError as e:
                if e.errno == errno.ENOENT:
                    return False
                if e.errno in (errno.EINVAL, errno.ENOTTY) and self._id_valid_cmd == NOTIF_ID_VALID_OLD:
                    self._id_valid_cmd = NOTIF_ID_VALID
                    continue
                raise

    def write_status(self, nid: int, pid: int, status_at: int) -> bool:
        """Write NV_ERR_NO_MEMORY into the caller's status field. The fd is opened, then the notification checked
        still valid, so the fd is the caller's memory and not a reused pid's."""
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if not self.id_valid(nid):
                return False
            return os.pwrite(fd, _STATUS, status_at) == 4
        except (OSError, ValueError, OverflowError):
            self._warn("mem_write", "cannot write tenants' memory; refused allocations fail with ENOMEM")
            return False
        finally:
            os.close(fd)
