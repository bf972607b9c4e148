"""The tenant's seccomp filter: a classic-BPF program that notifies NVIDIA's allocation escapes, and installing it.

Only ioctls whose request is 'F'/RM_ALLOC (0x2B), its older forms RM_ALLOC_OBJECT (0x28) and RM_ALLOC_MEMORY
(0x27), 'F'/RM_VID_HEAP_CONTROL (0x4A), 'F'/RM_DUP_OBJECT (0x34), 'F'/XFER (0xD3, which wraps another escape)
and, by default, 'F'/RM_FREE (0x29) go to the supervisor; every other
syscall runs at kernel speed. Children and threads inherit the filter. Standard library only: `unisched run`'s
trampoline (hooked_exec) runs it in each new tenant process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterable
from typing import Final, NamedTuple

from unisched.enforce.nvclasses import (
    IOCTL_TYPE,
    RM_ALLOC,
    RM_ALLOC_MEMORY,
    RM_ALLOC_OBJECT,
    RM_DUP_OBJECT,
    RM_FREE,
    RM_VID_HEAP_CONTROL,
    XFER,
)
from unisched.enforce.seccomp.abi import (
    DATA_OFF_ARCH,
    DATA_OFF_ARG1_LO,
    DATA_OFF_NR,
    IOCTL_SYSCALL,
    PR_SET_NO_NEW_PRIVS,
    SECCOMP_FILTER_FLAG_NEW_LISTENER,
    SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_USER_NOTIF,
    SECCOMP_SET_MODE_FILTER,
    SeccompError,
    SeccompUnavailable,
    libc,
    seccomp,
)

# classic BPF opcodes
_LD_W_ABS: Final = 0x20  # BPF_LD | BPF_W | BPF_ABS
_ALU_AND_K: Final = 0x54  # BPF_ALU | BPF_AND | BPF_K
_JEQ_K: Final = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K: Final = 0x06  # BPF_RET | BPF_K
_SOCK_FILTER: Final = "=HBBI"  # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}
MAX_INSNS: Final = 4096
"""BPF_MAXINSNS: the kernel refuses a longer program."""


class _Insn(NamedTuple):
    code: int
    k: int
    jt: str | None = None  # label; None = the next instruction
    jf: str | None = None


def _assemble(items: Iterable[_Insn | str]) -> bytes:
    insns: list[_Insn] = []
    labels: dict[str, int] = {}
    for item in items:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)
    out = bytearray()
    for i, ins in enumerate(insns):
        offsets = []
        for label in (ins.jt, ins.jf):
            off = 0 if label is None else labels[label] - (i + 1)
            if not 0 <= off <= 0xFF:
                raise AssertionError(f"BPF jump to {label} out of range at {i}")
            offsets.append(off)
        out += struct.pack(_SOCK_FILTER, ins.code, offsets[0], offsets[1], ins.k)
    return bytes(out)


NOTIFIED: Final = (RM_ALLOC, RM_ALLOC_OBJECT, RM_ALLOC_MEMORY, RM_VID_HEAP_CONTROL, RM_DUP_OBJECT, XFER, RM_FREE)
"""The escapes the filter notifies by default (RM_FREE only with `notify_free`); the OCI profiles under
deploy/seccomp notify the same (a test holds them to this)."""


def build_filter(*, notify_free: bool = True, match_type: bool = True, extra: tuple[int, ...] = ()) -> bytes:
    """The seccomp program (an array of struct sock_filter) that notifies NVIDIA's allocation escapes.

    Notified: ioctl(fd, req, arg) whose request's low 32 bits carry nr RM_ALLOC (0x2B), RM_VID_HEAP_CONTROL
    (0x4A, the heap allocations EGL/OpenGL make, followed for memory caps), RM_DUP_OBJECT (0x34, which may take a
    handle the driver picks: the memory book replays those) or XFER (0xD3), and
    RM_FREE (0x29) when `notify_free` (so counts follow frees). With `match_type` the type byte must be 'F'
    too (what NVIDIA's libraries always send; other drivers' 'F' ioctls stay fast); without it any type
    matches, like the driver's own dispatch. `extra` adds escape numbers (for a probe of which calls carry
    memory). Known arches: x86_64 (x32 too), i386 (compat), aarch64, arm (compat); anything else and
    every other syscall: ALLOW.
    """
    mask = 0xFFFF if match_type else 0xFF
    base = (IOCTL_TYPE << 8) if match_type else 0
    wanted = [base | e for e in NOTIFIED if notify_free or e != RM_FREE] + [base | e for e in extra]
    prog: list[_Insn | str] = [_Insn(_LD_W_ABS, DATA_OFF_ARCH)]
    arches = list(IOCTL_SYSCALL.items())
    for arch, _ in arches:
        prog.append(_Insn(_JEQ_K, arch, jt=f"arch_{arch:x}"))
    prog.append(_Insn(_RET_K, SECCOMP_RET_ALLOW))
    for arch, nrs in arches:
        prog += [f"arch_{arch:x}", _Insn(_LD_W_ABS, DATA_OFF_NR)]
        prog += [_Insn(_JEQ_K, nr, jt="ioctl", jf="allow" if i == len(nrs) - 1 else None) for i, nr in enumerate(nrs)]
    prog += ["ioctl", _Insn(_LD_W_ABS, DATA_OFF_ARG1_LO), _Insn(_ALU_AND_K, mask)]
    for i, value in enumerate(wanted):
        prog.append(_Insn(_JEQ_K, value, jt="notify", jf="allow" if i == len(wanted) - 1 else None))
    prog += ["allow", _Insn(_RET_K, SECCOMP_RET_ALLOW), "notify", _Insn(_RET_K, SECCOMP_RET_USER_NOTIF)]
    return _assemble(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_INSTALL_ERRORS: Final = {
    errno.EBUSY: "this process already has a seccomp filter with a listener (already governed, e.g. by "
    "a container runtime's notify profile); a second listener is not allowed",
    errno.EINVAL: "the kernel rejected the filter flags (seccomp user notification needs Linux >= 5.0, "
    "WAIT_KILLABLE_RECV >= 5.19)",
    errno.ENOSYS: "seccomp(2) is not available in this kernel",
    errno.EACCES: "no_new_privs is not set and the caller lacks CAP_SYS_ADMIN",
    errno.ENOMEM: "the kernel's seccomp program limit was reached",
}
"""Why seccomp(SET_MODE_FILTER) failed, by errno, in words a user can act on."""


def install_filter(program: bytes | None = None, *, wait_killable_recv: bool = False, no_new_privs: bool = True) -> int:
    """Install the filter in the CURRENT process and return the listener fd (O_CLOEXEC).

    Meant for a child between fork and exec. Hand the fd to the daemon and close it here before the first
    notified call: a process that holds its own listener blocks in that call until someone answers.
    `wait_killable_recv` (kernel >= 5.19) makes a received call wait killably only, so signals (Go's SIGURG
    preemption) do not restart it; Ctrl-C then waits for the answer too. `no_new_privs` (the default) means
    setuid binaries and file capabilities no longer raise privileges in the tenant; without it the caller
    needs CAP_SYS_ADMIN.
    """
    prog = build_filter() if program is None else program
    if not prog or len(prog) % 8 or len(prog) // 8 > MAX_INSNS:
        raise SeccompError(f"malformed seccomp program of {len(prog)} bytes")
    zero = ctypes.c_ulong(0)
    if no_new_privs and libc().prctl(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), zero, zero, zero):
        e = ctypes.get_errno()
        raise SeccompError(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(e)}")
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    flags = SECCOMP_FILTER_FLAG_NEW_LISTENER | (SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV if wait_killable_recv else 0)
    try:
        return seccomp(SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(fprog))
    except OSError as e:
        reason = _INSTALL_ERRORS.get(e.errno or 0, e.strerror)
        cls = SeccompUnavailable if e.errno in (errno.EINVAL, errno.ENOSYS) else SeccompError
        raise cls(f"cannot install the GPU session filter: {reason}") from None
