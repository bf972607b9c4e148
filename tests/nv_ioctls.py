"""Issue NVIDIA RM_ALLOC / RM_FREE ioctls against /dev/null (standing in for /dev/nvidiactl) and print the
errno of each: 25 (ENOTTY) = let through to the 'driver', 1 (EPERM) = refused by the session hook.

    nv_ioctls.py alloc:0xCB97:1 alloc:0xCB97:2 free:1 alloc:0xB8B0:3 ...   (CLASS:HANDLE, free:HANDLE)

control:HANDLE makes an RM_CONTROL on the handle, a call the hooks are never notified of.
"""

import ctypes
import os
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
ROOT = 0xC1D00001


def iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


fd = os.open("/dev/null", os.O_RDWR)
out = []
for arg in sys.argv[1:]:
    op, *rest = arg.split(":")
    if op == "alloc":
        cls, handle = int(rest[0], 0), int(rest[1], 0)
        buf = ctypes.create_string_buffer(struct.pack("=IIIIQII", ROOT, ROOT, handle, cls, 0, 0, 0), 32)
        cmd = iowr(0x2B, 32)
    elif op == "control":
        buf = ctypes.create_string_buffer(struct.pack("=IIIIQII", ROOT, int(rest[0], 0), 0, 0, 0, 0, 0), 32)
        cmd = iowr(0x2A, 32)
    else:
        handle = int(rest[0], 0)
        buf = ctypes.create_string_buffer(struct.pack("=IIII", ROOT, ROOT, handle, 0), 16)
        cmd = iowr(0x29, 16)
    rc = libc.ioctl(fd, ctypes.c_ulong(cmd), buf)
    out.append(str(ctypes.get_errno() if rc < 0 else 0))
print(" ".join(out), flush=True)
