"""Reading one notified call from its caller for the supervisor: which escape it is, and its argument from the
caller's memory (process_vm_readv, or /proc/PID/mem); what it asks for is calls.py's to decode. Also how a listener
the daemon's filter did not make shows itself: a notification of a call that filter never sends."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Final

import structlog

from unisched.enforce.seccomp.calls import Call, decode_call, escape_of
from unisched.enforce.seccomp.listener import Notification
from unisched.enforce.seccomp.proc import VmRefused, read_mem, read_vm, vm_readv_usable
from unisched.logs import Throttle

__all__ = ["FOREIGN_LOG_INTERVAL_S", "Foreign", "Gone", "escape", "foreign_log", "log_foreign", "read_call"]

log = structlog.get_logger("unisched.seccomp")

FOREIGN_LOG_INTERVAL_S: Final = 10.0
"""A tenant's 'not the daemon's filter' warnings: at most one this often (a user may hand over listener after
listener), each saying how many were held back."""

foreign_log = Throttle(FOREIGN_LOG_INTERVAL_S)
"""The warnings by tenant, over every supervisor of the daemon; tests give it a clock."""


class Gone(Exception):
    """The notification is no longer valid (the caller was killed or interrupted)."""


class Foreign(Exception):
    """The notification is of a call the daemon's filter (filter.py, or deploy/seccomp's profiles) never notifies:
    another syscall, an ioctl of another escape, an unknown arch. The listener is not the daemon's filter's, and
    each of its calls would cost the daemon an answer for nothing to count."""


def escape(notif: Notification) -> tuple[int, int]:
    """(escape nr, argument size) of the notified call; Foreign when the daemon's filter would not have sent it.
    Any type byte passes: the filter matches without it when built so, and the driver dispatches on nr alone."""
    found = escape_of(notif.nr, notif.arch, notif.args[1])
    if found is None:
        raise Foreign
    return found


def read_call(pid: int, esc: tuple[int, int], addr: int, warn: Callable[[str, str], None]) -> Call:
    """The call behind escape `esc` with its argument at `addr` of thread `pid`'s memory. Call(0, unreadable=True)
    when that memory cannot be read (the supervisor fails the call: the driver may read what the books never saw);
    Call(0), nothing to decide or track, when the caller is gone or the daemon may not read it (warned). The caller
    checks the notification is still valid before it relies on what was read (the pid may have been reused).

    Read with process_vm_readv, one system call a read, where /proc/PID/mem would take three (open, pread, close);
    through /proc/PID/mem where process_vm_readv is refused (EPERM: for this call only, the tenant may change its own
    dumpability between the two) or could not read it: its page pinning refuses memory that /proc/PID/mem reads
    through the mapping's own access (a device's VM_IO|VM_PFNMAP mapping, as the NVIDIA driver's of video memory)."""
    if pid == 0:
        warn("pid0", "a notified caller is outside the daemon's pid namespace; letting its calls continue")
        return Call(0)
    if vm_readv_usable():
        try:
            call = decode_call(esc[0], esc[1], addr, functools.partial(read_vm, pid))
        except VmRefused:
            call = None
        if call is not None and not call.unreadable:
            return call
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        warn("mem", "cannot read tenants' memory (/proc/PID/mem): run the daemon as root; letting calls continue")
        return Call(0)
    except OSError:
        return Call(0)  # gone already: the answer will fail harmlessly
    try:
        return decode_call(esc[0], esc[1], addr, lambda at, size: read_mem(mem, at, size))
    finally:
        os.close(mem)


def log_foreign(tenant: str, notif: Notification) -> None:
    """Say that `tenant`'s listener was let go of for `notif` (Foreign): at most once a FOREIGN_LOG_INTERVAL_S."""
    held = foreign_log.allow(tenant)
    if held is not None:
        log.warning("a seccomp listener handed over notified a call the daemon's filter never notifies: not the "
                    "daemon's filter, so no longer served (its processes' notified calls now fail with ENOSYS)",
                    tenant=tenant, pid=notif.pid, syscall=notif.nr, arch=f"{notif.arch:#x}", arg1=f"{notif.args[1]:#x}",
                    held_back=held)
