"""Processes as the daemon reads them through /proc: a tenant's memory, and who a pid names over time (the
session supervisor and the front door both tell a reused pid apart by its start time)."""

from __future__ import annotations

import os


def read_mem(fd: int, addr: int, size: int) -> bytes:
    """`size` bytes at user address `addr` of the process whose /proc/PID/mem `fd` is; ValueError when short."""
    if not 0 < addr < 1 << 63:
        raise ValueError(f"bad user address {addr:#x}")
    data = os.pread(fd, size, addr)
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
