"""Processes as the daemon reads them: a tenant's memory (process_vm_readv(2), or /proc/PID/mem where that is
refused), and who a pid names over time through /proc (the session supervisor and the front door both tell a reused
pid apart by its start time)."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Callable
from typing import Final

__all__ = ["VmRefused", "forgo_vm_readv", "owner", "owner_or_none", "parent", "read_mem", "read_vm", "start_time",
           "state_and_start", "vm_readv_usable"]

_IOVEC: Final = struct.Struct("@PN")
"""struct iovec {void *iov_base; size_t iov_len;}"""
_ONE: Final = ctypes.c_ulong(1)
_NO_FLAGS: Final = ctypes.c_ulong(0)
_CHAR: Final = ctypes.c_char


def _libc_vm_readv() -> Callable[..., int] | None:
    """libc's process_vm_readv, returning ssize_t; None where libc has none. Called without argtypes (each call
    spends less converting): the pid goes as an int, the iovecs as bytes (char *), the counts as c_ulong."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    return fn


_vm_readv: Callable[..., int] | None = _libc_vm_readv()
"""None once process_vm_readv is known not to serve (`forgo_vm_readv`): every read goes through /proc/PID/mem."""


class VmRefused(Exception):
    """process_vm_readv failed with EPERM (a seccomp or LSM policy on the daemon, or no right to the process) or
    ENOSYS (a kernel without it): read through /proc/PID/mem instead. Not an OSError, so that decoding, which takes
    an OSError for memory that cannot be read, does not swallow it."""

    def __init__(self, err: int) -> None:
        super().__init__(err, os.strerror(err))
        self.errno = err


def vm_readv_usable() -> bool:
    """Whether `read_vm` may be tried (it has not been forgone)."""
    return _vm_readv is not None


def forgo_vm_readv() -> None:
    """Read every tenant's memory through /proc/PID/mem from now on (process_vm_readv does not serve here)."""
    global _vm_readv
    _vm_readv = None


def read_vm(pid: int, addr: int, size: int) -> bytes:
    """`size` bytes at user address `addr` of thread `pid` in one process_vm_readv(2): the pid is looked up for each
    read, so several reads may name several processes if it is reused meanwhile (the caller checks the notification
    still valid after its reads). OSError (ESRCH: gone, EFAULT: not mapped) or ValueError (a bad address, a partial
    read) when the memory cannot be read; VmRefused when /proc/PID/mem should be tried instead (ENOSYS: forgone)."""
    _check_address(addr)
    vm_readv = _vm_readv
    if vm_readv is None:
        raise VmRefused(errno.ENOSYS)
    buf = (_CHAR * size)()  # (ctypes.create_string_buffer's, without its checks; ctypes keeps the array types)
    got = vm_readv(pid, _IOVEC.pack(ctypes.addressof(buf), size), _ONE, _IOVEC.pack(addr, size), _ONE, _NO_FLAGS)
    if got == size:
        return buf.raw
    if got >= 0:
        return _whole(buf.raw[:got], size, addr)
    err = ctypes.get_errno()
    if err == errno.ENOSYS:
        forgo_vm_readv()
    if err in (errno.EPERM, errno.ENOSYS):
        raise VmRefused(err)
    raise OSError(err, os.strerror(err))


def read_mem(fd: int, addr: int, size: int) -> bytes:
    """`size` bytes at user address `addr` of the process whose /proc/PID/mem `fd` is; ValueError when short."""
    _check_address(addr)
    return _whole(os.pread(fd, size, addr), size, addr)


def _check_address(addr: int) -> None:
    """ValueError unless `addr` can be a user address (what neither reader, nor the driver, reads)."""
    if not 0 < addr < 1 << 63:
        raise ValueError(f"bad user address {addr:#x}")


def _whole(data: bytes, size: int, addr: int) -> bytes:
    """`data` when it is all `size` bytes read at `addr`; ValueError for a partial read (memory that ends there)."""
    if len(data) != size:
        raise ValueError(f"short read of {size} bytes at {addr:#x}")
    return data


def owner(tid: int) -> tuple[int, str]:
    """(tgid, start time) of the process that thread `tid` belongs to."""
    tgid = tid
    with open(f"/proc/{tid}/status") as f:
        for line in f:
            if line.startswith("Tgid:"):
                tgid = int(line.split()[1])
                break
    return tgid, start_time(tgid) or ""


def owner_or_none(tid: int) -> tuple[int, str]:
    """`owner`, or (0, "") when it cannot be read (the thread is gone): no process the books may record a client of."""
    try:
        return owner(tid)
    except (OSError, ValueError):
        return 0, ""


def _stat_after_comm(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the 3rd on (after "(comm)", which may hold spaces and parentheses); None when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def state_and_start(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks): fields 3 and 22 of /proc/PID/stat. The start time tells a reused
    pid apart; None when the process is gone."""
    fields = _stat_after_comm(pid)
    return (fields[0], fields[19]) if fields is not None and len(fields) > 19 else None


def parent(pid: int) -> int | None:
    """Field 4 of /proc/PID/stat (the parent's pid); None when the process is gone."""
    fields = _stat_after_comm(pid)
    return int(fields[1]) if fields is not None and len(fields) > 1 and fields[1].isdigit() else None


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks); None when the process is gone."""
    stat = state_and_start(pid)
    return None if stat is None else stat[1]
