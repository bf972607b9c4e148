"""The answer path's syscalls in plain Python, nothing else: poll, receive, open/pread/close of /proc/PID/mem,
id-valid, send "continue". Serves the listener fd given until every caller has gone.

    python3 pysup.py FD
"""

import contextlib
import fcntl
import os
import select
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
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


def main(fd: int) -> None:
    fcntl.ioctl(fd, NOTIF_SET_FLAGS, FD_SYNC_WAKE_UP)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    id_valid, n = NOTIF_ID_VALID_OLD, 0
    print("serving", flush=True)
    while poller.poll()[0][1] & select.POLLIN:
        buf = bytearray(NOTIF_SIZE)
        try:
            fcntl.ioctl(fd, NOTIF_RECV, buf, True)
        except OSError:
            continue
        nid, pid, _flags, _nr, _arch, _ip, *args = struct.unpack(NOTIF_FORMAT, buf)
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            os.pread(mem, 24, args[2])
        os.close(mem)
        try:
            fcntl.ioctl(fd, id_valid, struct.pack("=Q", nid))
        except OSError:
            id_valid = NOTIF_ID_VALID
        fcntl.ioctl(fd, NOTIF_SEND, struct.pack(RESP_FORMAT, nid, 0, 0, FLAG_CONTINUE))
        n += 1
    print(f"pysup: {n} notifications", file=sys.stderr)


if __name__ == "__main__":
    main(int(sys.argv[1]))
