"""Raw bpf(2) through ctypes: load, attach, detach, query and inspect cgroup-device programs, with errors that say
what was attempted and a likely cause."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import resource
import struct
from dataclasses import dataclass

__all__ = [
    "PROG_NAME",
    "DeviceAdmissionError",
    "ProgInfo",
    "bpf_prog_attach",
    "bpf_prog_detach",
    "bpf_prog_get_fd_by_id",
    "bpf_prog_info",
    "bpf_prog_load",
    "bpf_prog_query",
    "bpf_syscall_nr",
]

PROG_NAME = "unisched_dev"
"""The name our programs are loaded with; how a restarted daemon recognises them."""

# uapi/linux/bpf.h
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_OVERRIDE = 1 << 0
BPF_F_ALLOW_MULTI = 1 << 1
BPF_F_REPLACE = 1 << 2
BPF_DEVCG_DEV_BLOCK = 1
BPF_DEVCG_DEV_CHAR = 2

_CMD_NAMES = {
    BPF_PROG_LOAD: "BPF_PROG_LOAD",
    BPF_PROG_ATTACH: "BPF_PROG_ATTACH",
    BPF_PROG_DETACH: "BPF_PROG_DETACH",
    BPF_PROG_GET_FD_BY_ID: "BPF_PROG_GET_FD_BY_ID",
    BPF_OBJ_GET_INFO_BY_FD: "BPF_OBJ_GET_INFO_BY_FD",
    BPF_PROG_QUERY: "BPF_PROG_QUERY",
}
_BPF_SYSCALL = {
    "x86_64": 321, "amd64": 321, "aarch64": 280, "arm64": 280, "riscv64": 280, "loongarch64": 280,
    "ppc64le": 361, "ppc64": 361, "s390x": 351, "i386": 357, "i686": 357, "armv7l": 386,
}
_ATTR_SIZE = 128  # covers every field used here; the kernel zero-fills the rest, or checks our tail is zero
_PROG_INFO_SIZE = 96  # struct bpf_prog_info through name[16] (offset 64) and a little beyond


class DeviceAdmissionError(RuntimeError):
    """A device admission step the kernel refused: what was attempted, the errno and a likely cause."""

    def __init__(self, message: str, err: int | None = None) -> None:
        super().__init__(message)
        self.errno = err


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_ulong]


def bpf_syscall_nr() -> int | None:
    return _BPF_SYSCALL.get(platform.machine().lower())


def _hint(cmd: int, err: int) -> str:
    if err == errno.ENOSYS:
        return "kernel built without CONFIG_BPF_SYSCALL"
    if cmd == BPF_PROG_LOAD:
        return {
            errno.EPERM: "not root / no CAP_BPF+CAP_SYS_ADMIN, kernel lockdown, or RLIMIT_MEMLOCK on kernels < 5.11",
            errno.EINVAL: "kernel without CONFIG_CGROUP_BPF, or the verifier refused the program",
            errno.EACCES: "the verifier refused the program",
        }.get(err, "")
    if cmd == BPF_PROG_ATTACH:
        return {
            errno.EPERM: "the cgroup or an ancestor already has a device program attached without BPF_F_ALLOW_MULTI "
            "(an old container runtime?), or not root",
            errno.EBADF: "not a cgroup v2 directory",
            errno.EINVAL: "kernel without BPF_F_ALLOW_MULTI / BPF_F_REPLACE for cgroup-device programs",
            errno.E2BIG: "64 programs already attached to this cgroup",
        }.get(err, "")
    if cmd == BPF_PROG_QUERY and err == errno.EBADF:
        return "not a cgroup v2 directory"
    if err == errno.EPERM:
        return "needs root (CAP_SYS_ADMIN)"
    return ""


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char], what: str = "") -> int:
    nr = bpf_syscall_nr()
    if nr is None:
        raise DeviceAdmissionError(f"bpf(2) syscall number unknown for machine {platform.machine()!r}", errno.ENOSYS)
    ret = int(_syscall(nr, cmd, ctypes.addressof(attr), len(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        hint = _hint(cmd, err)
        name = errno.errorcode.get(err, str(err))
        where = f" {what}" if what else ""
        raise DeviceAdmissionError(f"bpf({_CMD_NAMES.get(cmd, cmd)}){where} failed: {name}{f' ({hint})' if hint else ''}", err)
    return ret


def _attr() -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(_ATTR_SIZE)


def bpf_prog_load(insns: bytes, name: str = PROG_NAME, prog_type: int = BPF_PROG_TYPE_CGROUP_DEVICE) -> int:
    """Load a program; returns its fd (close-on-exec). A verifier refusal carries the verifier's log."""
    if len(insns) % 8:
        raise ValueError("eBPF instructions are 8 bytes each")
    code = ctypes.create_string_buffer(insns, len(insns))
    license_ = ctypes.create_string_buffer(b"Apache-2.0")  # no GPL-only helpers are called
    pname = name.encode()[:15]

    def load(log: ctypes.Array[ctypes.c_char] | None) -> int:
        attr = _attr()
        struct.pack_into("<IIQQ", attr, 0, prog_type, len(insns) // 8, ctypes.addressof(code), ctypes.addressof(license_))
        if log is not None:
            struct.pack_into("<IIQ", attr, 24, 1, len(log), ctypes.addressof(log))
        struct.pack_into("16s", attr, 48, pname)
        return _bpf(BPF_PROG_LOAD, attr, f"of {name!r}")

    try:
        return load(None)
    except DeviceAdmissionError as e:
        if e.errno == errno.EPERM and os.geteuid() == 0:
            # kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK: lift it and try once more
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                return load(None)
            raise
        if e.errno not in (errno.EINVAL, errno.EACCES):
            raise
        log = ctypes.create_string_buffer(1 << 16)
        try:
            return load(log)
        except DeviceAdmissionError as e2:
            text = log.value.decode(errors="replace").strip()
            raise DeviceAdmissionError(f"{e2}{': verifier log: ' + text[-2000:] if text else ''}", e2.errno) from None


def bpf_prog_attach(cgroup_fd: int, prog_fd: int, flags: int = BPF_F_ALLOW_MULTI, replace_fd: int | None = None,
                    attach_type: int = BPF_CGROUP_DEVICE, what: str = "") -> None:
    """BPF_PROG_ATTACH to a cgroup v2 directory fd; replace_fd adds BPF_F_REPLACE (swap that program in place)."""
    attr = _attr()
    if replace_fd is not None:
        flags |= BPF_F_REPLACE
    struct.pack_into("<IIIII", attr, 0, cgroup_fd, prog_fd, attach_type, flags, replace_fd or 0)
    _bpf(BPF_PROG_ATTACH, attr, what)


def bpf_prog_detach(cgroup_fd: int, prog_fd: int, attach_type: int = BPF_CGROUP_DEVICE, what: str = "") -> None:
    attr = _attr()
    struct.pack_into("<III", attr, 0, cgroup_fd, prog_fd, attach_type)
    _bpf(BPF_PROG_DETACH, attr, what)


def bpf_prog_query(cgroup_fd: int, attach_type: int = BPF_CGROUP_DEVICE, effective: bool = False, what: str = "") -> list[int]:
    """Ids of the programs attached to the cgroup itself (effective=True: also those inherited from ancestors)."""
    count = 64  # BPF_CGROUP_MAX_PROGS per cgroup
    while True:
        ids = (ctypes.c_uint32 * count)()
        attr = _attr()
        struct.pack_into("<IIIIQI", attr, 0, cgroup_fd, attach_type, 1 if effective else 0, 0, ctypes.addressof(ids), count)
        try:
            _bpf(BPF_PROG_QUERY, attr, what)
        except DeviceAdmissionError as e:
            if e.errno != errno.ENOSPC:
                raise
            count = max(count * 2, struct.unpack_from("<I", attr, 24)[0])
            continue
        n = struct.unpack_from("<I", attr, 24)[0]
        return [int(ids[i]) for i in range(min(n, count))]


def bpf_prog_get_fd_by_id(prog_id: int) -> int:
    attr = _attr()
    struct.pack_into("<I", attr, 0, prog_id)
    return _bpf(BPF_PROG_GET_FD_BY_ID, attr, f"of prog id {prog_id}")


@dataclass(frozen=True)
class ProgInfo:
    prog_type: int
    prog_id: int
    tag: str
    name: str


def bpf_prog_info(prog_fd: int) -> ProgInfo:
    info = ctypes.create_string_buffer(_PROG_INFO_SIZE)
    attr = _attr()
    struct.pack_into("<IIQ", attr, 0, prog_fd, _PROG_INFO_SIZE, ctypes.addressof(info))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    prog_type, prog_id, tag = struct.unpack_from("<II8s", info, 0)
    name = struct.unpack_from("16s", info, 64)[0].split(b"\0", 1)[0].decode(errors="replace")
    return ProgInfo(prog_type, prog_id, tag.hex(), name)
