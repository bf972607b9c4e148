"""The kernel's seccomp ABI, as this package uses it (no libseccomp): numbers, struct layouts, the syscall itself.

seccomp(2) and prctl(2) go through ctypes. The listener's ioctls: RECV 0xC0502100 (struct seccomp_notif, 80
bytes), SEND 0xC0182101 (struct seccomp_notif_resp, 24 bytes), ID_VALID (0x80082102, the number every kernel
accepts; 0x40082102 on kernels that fixed its direction) and, where the kernel has it (>= 6.6), SET_FLAGS
0x40082104 with SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP. NVIDIA's side of the ABI is in ..nvclasses.

Standard library only: the tenant's trampoline imports it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from types import MappingProxyType
from typing import Any, Final

AUDIT_ARCH_X86_64: Final = 0xC000003E
AUDIT_ARCH_AARCH64: Final = 0xC00000B7
AUDIT_ARCH_I386: Final = 0x40000003  # 32-bit x86 processes (and int 0x80) on an x86_64 kernel
AUDIT_ARCH_ARM: Final = 0x40000028  # 32-bit ARM processes on an aarch64 kernel
X32_SYSCALL_BIT: Final = 0x40000000
IOCTL_SYSCALL: Final = MappingProxyType({
    AUDIT_ARCH_X86_64: (16, X32_SYSCALL_BIT | 514),  # x32 processes share x86_64's arch, with their own numbers
    AUDIT_ARCH_AARCH64: (29,), AUDIT_ARCH_I386: (54,), AUDIT_ARCH_ARM: (54,),
})
"""ioctl's syscall numbers per audit arch (what a filter and a notification name the call by): every ABI a process
of that arch may call ioctl through, so none reaches the driver unseen."""
_SECCOMP_SYSCALL: Final = MappingProxyType({"x86_64": 317, "aarch64": 277})

SECCOMP_RET_ALLOW: Final = 0x7FFF0000
SECCOMP_RET_USER_NOTIF: Final = 0x7FC00000
SECCOMP_SET_MODE_FILTER: Final = 1
SECCOMP_GET_ACTION_AVAIL: Final = 2
SECCOMP_GET_NOTIF_SIZES: Final = 3
SECCOMP_FILTER_FLAG_NEW_LISTENER: Final = 1 << 3
SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV: Final = 1 << 5
PR_SET_NO_NEW_PRIVS: Final = 38

# seccomp_data offsets (little endian: the low 32 bits of args[1] sit at 16 + 8)
DATA_OFF_NR: Final = 0
DATA_OFF_ARCH: Final = 4
DATA_OFF_ARG1_LO: Final = 24
DATA_SIZE: Final = 64

# the listener's ioctls and structs
NOTIF_RECV: Final = 0xC0502100
NOTIF_SEND: Final = 0xC0182101
NOTIF_ID_VALID_OLD: Final = 0x80082102
NOTIF_ID_VALID: Final = 0x40082102
NOTIF_SET_FLAGS: Final = 0x40082104  # SECCOMP_IOW(4, __u64), Linux >= 6.6; the flags are the argument itself
FD_SYNC_WAKE_UP: Final = 1  # SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP
FLAG_CONTINUE: Final = 1  # SECCOMP_USER_NOTIF_FLAG_CONTINUE
NOTIF_FORMAT: Final = "=QIIiIQ6Q"  # id, pid, flags, data{nr, arch, instruction_pointer, args[6]}
NOTIF_SIZE: Final = struct.calcsize(NOTIF_FORMAT)  # 80
RESP_FORMAT: Final = "=QqiI"  # id, val, error (-errno), flags
RESP_SIZE: Final = struct.calcsize(RESP_FORMAT)  # 24


class SeccompError(RuntimeError):
    """A seccomp operation that failed; the message says what and why."""


class SeccompUnavailable(SeccompError):
    """The kernel refuses seccomp user notification here: keep time slicing and device admission only."""


class _NotifSizes(ctypes.Structure):
    _fields_ = [("seccomp_notif", ctypes.c_ushort), ("seccomp_notif_resp", ctypes.c_ushort), ("seccomp_data", ctypes.c_ushort)]


def libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _seccomp_nr() -> int:
    machine = platform.machine()
    nr = _SECCOMP_SYSCALL.get(machine)
    if nr is None:
        raise SeccompUnavailable(f"seccomp session hooks support x86_64 and aarch64, not {machine}")
    return nr


def seccomp(op: int, flags: int, arg: Any) -> int:
    """seccomp(2); OSError with the errno on failure."""
    c = libc()
    c.syscall.restype = ctypes.c_long
    ret = int(c.syscall(ctypes.c_long(_seccomp_nr()), ctypes.c_ulong(op), ctypes.c_ulong(flags), arg))
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def probe() -> str | None:
    """Why seccomp user notification cannot be used here, or None when it can. Installs nothing."""
    try:
        release = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    except ValueError:
        release = (99, 0)
    if release < (5, 5):
        return f"kernel {platform.release()} is older than 5.5 (no SECCOMP_USER_NOTIF_FLAG_CONTINUE)"
    try:
        action = ctypes.c_uint32(SECCOMP_RET_USER_NOTIF)
        seccomp(SECCOMP_GET_ACTION_AVAIL, 0, ctypes.byref(action))
        sizes = _NotifSizes()
        seccomp(SECCOMP_GET_NOTIF_SIZES, 0, ctypes.byref(sizes))
    except SeccompUnavailable as e:
        return str(e)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            return "the kernel does not offer SECCOMP_RET_USER_NOTIF"
        return f"seccomp(2) refused: {e.strerror} (kernel without CONFIG_SECCOMP_FILTER, or seccomp blocked)"
    if (sizes.seccomp_notif, sizes.seccomp_notif_resp, sizes.seccomp_data) != (NOTIF_SIZE, RESP_SIZE, DATA_SIZE):
        return (
            f"unexpected seccomp struct sizes notif={sizes.seccomp_notif} resp={sizes.seccomp_notif_resp} "
            f"data={sizes.seccomp_data} (expected {NOTIF_SIZE}/{RESP_SIZE}/{DATA_SIZE})"
        )
    return None
