"""The tenant side of the GPU session hooks: build and install the seccomp filter, hand its listener to the daemon.

What `unisched run`'s trampoline (hooked_exec) runs in each new tenant process, kept apart from the daemon's
supervisor (seccomp.py) so that process imports only the standard library it needs: no structlog, asyncio or grpc.
Every run starts a Python interpreter, and a burst of runs is paid in CPU time per import.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import socket
import struct
import time
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from unisched.enforce.nvclasses import IOCTL_TYPE, RM_ALLOC, RM_FREE, XFER

# --- seccomp ABI -----------------------------------------------------------------------------------------------------
AUDIT_ARCH_X86_64: Final = 0xC000003E
AUDIT_ARCH_AARCH64: Final = 0xC00000B7
AUDIT_ARCH_I386: Final = 0x40000003  # 32-bit x86 processes (and int 0x80) on an x86_64 kernel
IOCTL_SYSCALL: Final = MappingProxyType({AUDIT_ARCH_X86_64: 16, AUDIT_ARCH_AARCH64: 29, AUDIT_ARCH_I386: 54})
_SECCOMP_SYSCALL: Final = MappingProxyType({"x86_64": 317, "aarch64": 277})

SECCOMP_RET_ALLOW: Final = 0x7FFF0000
SECCOMP_RET_USER_NOTIF: Final = 0x7FC00000
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_GET_ACTION_AVAIL = 2
_SECCOMP_GET_NOTIF_SIZES = 3
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
_SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV = 1 << 5
_PR_SET_NO_NEW_PRIVS = 38

# seccomp_data offsets (little endian: the low 32 bits of args[1] sit at 16 + 8)
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG1_LO = 24

# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_ALU_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_SOCK_FILTER = "=HBBI"  # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}

DEFAULT_LISTENER_PATH: Final = "/run/unisched/seccomp-agent.sock"
"""Where the daemon's agent socket listens (the path deploy/seccomp/unisched-gpu.json names)."""


class SeccompError(RuntimeError):
    """A seccomp operation that failed; the message says what and why."""


class SeccompUnavailable(SeccompError):
    """The kernel refuses seccomp user notification here: keep time slicing and device admission only."""


# --- the filter ------------------------------------------------------------------------------------------------------
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


def build_filter(*, notify_free: bool = True, match_type: bool = True) -> bytes:
    """The seccomp program (an array of struct sock_filter) that notifies NVIDIA's allocation escapes.

    Notified: ioctl(fd, req, arg) whose request's low 32 bits carry nr RM_ALLOC (0x2B) or XFER (0xD3), and
    RM_FREE (0x29) when `notify_free` (so counts follow frees). With `match_type` the type byte must be 'F'
    too (what NVIDIA's libraries always send; other drivers' 'F' ioctls stay fast); without it any type
    matches, like the driver's own dispatch. Known arches: x86_64, i386 (compat), aarch64; anything else and
    every other syscall: ALLOW.
    """
    mask = 0xFFFF if match_type else 0xFF
    base = (IOCTL_TYPE << 8) if match_type else 0
    wanted = [base | RM_ALLOC, base | XFER] + ([base | RM_FREE] if notify_free else [])
    prog: list[_Insn | str] = [_Insn(_LD_W_ABS, _OFF_ARCH)]
    arches = list(IOCTL_SYSCALL.items())
    for arch, _ in arches:
        prog.append(_Insn(_JEQ_K, arch, jt=f"arch_{arch:x}"))
    prog.append(_Insn(_RET_K, SECCOMP_RET_ALLOW))
    for arch, nr in arches:
        prog += [f"arch_{arch:x}", _Insn(_LD_W_ABS, _OFF_NR), _Insn(_JEQ_K, nr, jt="ioctl", jf="allow")]
    prog += ["ioctl", _Insn(_LD_W_ABS, _OFF_ARG1_LO), _Insn(_ALU_AND_K, mask)]
    for i, value in enumerate(wanted):
        prog.append(_Insn(_JEQ_K, value, jt="notify", jf="allow" if i == len(wanted) - 1 else None))
    prog += ["allow", _Insn(_RET_K, SECCOMP_RET_ALLOW), "notify", _Insn(_RET_K, SECCOMP_RET_USER_NOTIF)]
    return _assemble(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _seccomp_nr() -> int:
    machine = platform.machine()
    nr = _SECCOMP_SYSCALL.get(machine)
    if nr is None:
        raise SeccompUnavailable(f"seccomp session hooks support x86_64 and aarch64, not {machine}")
    return nr


def _seccomp(op: int, flags: int, arg: Any) -> int:
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    ret = int(libc.syscall(ctypes.c_long(_seccomp_nr()), ctypes.c_ulong(op), ctypes.c_ulong(flags), arg))
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


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
    if not prog or len(prog) % 8 or len(prog) // 8 > 4096:
        raise SeccompError(f"malformed seccomp program of {len(prog)} bytes")
    libc = _libc()
    zero = ctypes.c_ulong(0)
    if no_new_privs and libc.prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), zero, zero, zero):
        e = ctypes.get_errno()
        raise SeccompError(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(e)}")
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    flags = _SECCOMP_FILTER_FLAG_NEW_LISTENER | (_SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV if wait_killable_recv else 0)
    try:
        return _seccomp(_SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(fprog))
    except OSError as e:
        reasons = {
            errno.EBUSY: "this process already has a seccomp filter with a listener (already governed, e.g. by "
            "a container runtime's notify profile); a second listener is not allowed",
            errno.EINVAL: "the kernel rejected the filter flags (seccomp user notification needs Linux >= 5.0, "
            "WAIT_KILLABLE_RECV >= 5.19)",
            errno.ENOSYS: "seccomp(2) is not available in this kernel",
            errno.EACCES: "no_new_privs is not set and the caller lacks CAP_SYS_ADMIN",
            errno.ENOMEM: "the kernel's seccomp program limit was reached",
        }
        reason = reasons.get(e.errno or 0, e.strerror)
        cls = SeccompUnavailable if e.errno in (errno.EINVAL, errno.ENOSYS) else SeccompError
        raise cls(f"cannot install the GPU session filter: {reason}") from None



def send_fd(sock: socket.socket, fd: int, payload: bytes) -> None:
    """Send `payload` with `fd` attached (SCM_RIGHTS on the first sendmsg, as the OCI runtimes do)."""
    if not payload:
        raise ValueError("send_fd needs a non-empty payload (an fd cannot travel alone)")
    sent = socket.send_fds(sock, [payload], [fd])
    if sent < len(payload):
        sock.sendall(payload[sent:])



def make_agent_message(pid: int, *, metadata: str = "", container_id: str = "", status: str = "running") -> bytes:
    """The same message shape for `unisched run`'s child, so one agent socket serves runs and containers."""
    return json.dumps(
        {
            "ociVersion": "1.1.0",
            "fds": ["seccompFd"],
            "pid": pid,
            "metadata": metadata,
            "state": {"ociVersion": "1.1.0", "id": container_id, "status": status, "pid": pid, "bundle": "", "annotations": {}},
        },
        separators=(",", ":"),
    ).encode()



HAND_OVER_TIMEOUT_S: Final = 30.0
"""How long `hand_over` keeps trying. The trampoline runs in its tenant's cgroup, which the daemon's time slicing
may freeze between its connect and its send: with a hundred tenants in demand its turn comes round every few
seconds, the daemon drops the late attempt at its own deadline and answers "busy", and the next attempt, once
thawed, takes microseconds. A dead daemon still fails at once (the connect is refused)."""
_BUSY_RETRY_S: Final = (0.02, 0.5)
"""`hand_over`'s pause after a "busy" reply: first, and the most it doubles to (a burst of runs by one user
clears in milliseconds; a flood by that user lasts until the deadline)."""


def hand_over(
    listener_fd: int, path: str = DEFAULT_LISTENER_PATH, *, metadata: str = "", timeout: float = HAND_OVER_TIMEOUT_S,
    close: bool = True,
) -> None:
    """`unisched run`'s child side: give the listener to the daemon's agent socket and wait for its "ok".

    Sends the OCI-shaped message (pid = this process) with the fd, then closes the fd here (`close`): the
    tenant must not keep its own listener, or a notified call would wait for itself, and the daemon's death
    would no longer fail calls with ENOSYS. A "busy" reply (too many of this uid's hand-overs in progress, or this
    one was not complete by the daemon's deadline: frozen or preempted in between) is tried again within
    `timeout`. Raises SeccompError when the daemon is unreachable or says no; the caller should then exit rather
    than exec (the tenant's GPU session calls would all fail with ENOSYS).
    """
    deadline = time.monotonic() + timeout
    pause = _BUSY_RETRY_S[0]
    try:
        while True:
            answer = _hand_over_once(listener_fd, path, metadata, max(0.01, deadline - time.monotonic()))
            if not answer.startswith("busy ") or time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, _BUSY_RETRY_S[1])
    finally:
        if close:
            os.close(listener_fd)
    if answer != "ok":
        raise SeccompError(f"the unisched daemon refused the GPU session hook: {answer or 'connection closed'}")


def _hand_over_once(listener_fd: int, path: str, metadata: str, timeout: float) -> str:
    message = make_agent_message(os.getpid(), metadata=metadata)  # before connecting: the daemon's deadline runs
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(path)
            except OSError as e:
                raise SeccompError(f"cannot reach the unisched agent socket {path}: {e.strerror}") from None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused at once: read its reply
                send_fd(sock, listener_fd, message)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except TimeoutError:
        raise SeccompError(f"the unisched daemon did not answer on {path} within {timeout:.3g}s") from None
    except OSError as e:
        raise SeccompError(f"handing the GPU session hook to {path} failed: {e.strerror or e}") from None
    return reply.decode(errors="replace").strip()
