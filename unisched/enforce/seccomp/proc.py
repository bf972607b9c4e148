"""A tenant's process as the supervisor reads it through /proc: its memory and its identity over time."""

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


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a reused pid apart. None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None
