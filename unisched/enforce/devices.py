"""Device admission: which NVIDIA device nodes a tenant cgroup may open, enforced by cgroup v2 eBPF.

One Protocol, `DeviceAdmission`, with the real `BpfDeviceAdmission` and `FakeDeviceAdmission` for engine
logic tests. The real one loads a BPF_PROG_TYPE_CGROUP_DEVICE program through raw bpf(2) (ctypes; the eBPF
instructions are assembled here, so neither LLVM nor libbpf is needed) and attaches it to the tenant's
cgroup v2 directory.

The rule (`device_allowed` is the same rule in plain Python):
- char major 195, minor N <= 247 (/dev/nvidiaN): allowed iff the tenant is admitted to GPU N;
- char 195:255 (/dev/nvidiactl), 195:254 (/dev/nvidia-modeset) and the dynamic nvidia-uvm / nvidia-uvm-tools
  majors (read from /proc/devices at each `admit`): allowed iff the tenant is admitted to at least one GPU;
- any other minor of major 195 (248-253, above 255): allowed only with gpus=None (unknown NVIDIA nodes fail closed);
- everything else (block devices, every other char device): allowed by this program.
gpus=None admits every GPU (the program then allows everything); gpus=frozenset() admits none.

Other device rules stay in force: the program is attached with BPF_F_ALLOW_MULTI, and the kernel runs every
program attached to the cgroup and to its ancestors (container runtimes, systemd); an access goes through only
if all of them allow it. Re-admitting replaces our previous program atomically with BPF_F_REPLACE (Linux >= 5.6),
else attaches the new one and then detaches the old one (for that instant both apply: the stricter of the two).

Lifetime: an attached program belongs to the cgroup, not to this process. It stays in force after the daemon
exits (or crashes) until it is detached or the cgroup is removed. Our programs carry the name `unisched_dev`
(PROG_NAME); a restarted daemon finds them with BPF_PROG_QUERY on the cgroup and BPF_PROG_GET_FD_BY_ID +
BPF_OBJ_GET_INFO_BY_FD, so `admit` replaces and `revoke` detaches what an earlier daemon attached. Any
cgroup-device program with that name attached to the cgroup is treated as ours.

Limits: the nvidia-uvm major is read when `admit` runs; if nvidia-uvm is loaded later, re-admit to cover it.
The device check runs at open(2) and mknod(2): a file descriptor opened before `admit` keeps working.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import resource
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

__all__ = [
    "NVIDIA_MAJOR",
    "PROG_NAME",
    "BpfDeviceAdmission",
    "DeviceAdmission",
    "DeviceAdmissionError",
    "FakeDeviceAdmission",
    "ProgInfo",
    "assemble_device_program",
    "bpf_prog_attach",
    "bpf_prog_detach",
    "bpf_prog_get_fd_by_id",
    "bpf_prog_info",
    "bpf_prog_load",
    "bpf_prog_query",
    "cgroup2_mount",
    "device_admission_unavailable_reason",
    "device_allowed",
    "nvidia_uvm_majors",
]

NVIDIA_MAJOR = 195
NVIDIA_GPU_MINOR_MAX = 247
NVIDIA_MODESET_MINOR = 254
NVIDIA_CTL_MINOR = 255
UVM_NAMES = ("nvidia-uvm", "nvidia-uvm-tools")
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


class DeviceAdmission(Protocol):
    def admit(self, cgroup_dir: Path, gpus: frozenset[int] | None) -> None:
        """Attach (or replace ours with) a program letting the cgroup open only the NVIDIA nodes of `gpus`
        (None: all GPUs; empty: no NVIDIA node at all). Every other device rule of the cgroup stays."""
        ...

    def revoke(self, cgroup_dir: Path) -> None:
        """Detach our program (also one an earlier daemon attached); no-op if none or the cgroup is gone."""
        ...

    def describe(self, cgroup_dir: Path) -> str | None:
        """One line for status output, or None when no program of ours is attached there."""
        ...

    def close(self) -> None:
        """Release our file descriptors. Attached programs stay in force (they belong to the cgroup)."""
        ...


# --- the rule, as plain Python and as eBPF -------------------------------------------------------------


def _check_gpus(gpus: frozenset[int] | None) -> frozenset[int] | None:
    if gpus is None:
        return None
    gpus = frozenset(gpus)
    bad = sorted(repr(g) for g in gpus if not isinstance(g, int) or not 0 <= g <= NVIDIA_GPU_MINOR_MAX)
    if bad:
        raise ValueError(f"GPU indices must be 0..{NVIDIA_GPU_MINOR_MAX} (/dev/nvidiaN minors); got {', '.join(bad)}")
    return gpus


def device_allowed(gpus: frozenset[int] | None, dev_type: int, major: int, minor: int, uvm_majors: Iterable[int] = ()) -> bool:
    """What our program answers for one access (dev_type BPF_DEVCG_DEV_CHAR or BPF_DEVCG_DEV_BLOCK)."""
    if dev_type != BPF_DEVCG_DEV_CHAR or gpus is None:
        return True
    if major == NVIDIA_MAJOR:
        return bool(gpus) and (minor in gpus or minor in (NVIDIA_CTL_MINOR, NVIDIA_MODESET_MINOR))
    if major in set(uvm_majors):
        return bool(gpus)
    return True


def _gpu_text(gpus: frozenset[int] | None) -> str:
    if gpus is None:
        return "all GPUs"
    if not gpus:
        return "no GPU (every NVIDIA node denied)"
    return "GPU " + ",".join(str(g) for g in sorted(gpus))


class _Asm:
    """A few eBPF instructions with forward labels: struct bpf_insn {u8 code; u8 dst:4, src:4; s16 off; s32 imm}."""

    LDXW = 0x61  # BPF_LDX | BPF_MEM | BPF_W:  dst = *(u32 *)(src + off)
    AND64_K = 0x57  # BPF_ALU64 | BPF_AND | BPF_K
    MOV64_K = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K
    JA = 0x05  # BPF_JMP | BPF_JA
    JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
    JNE_K = 0x55  # BPF_JMP | BPF_JNE | BPF_K
    EXIT = 0x95  # BPF_JMP | BPF_EXIT

    def __init__(self) -> None:
        self.insns: list[tuple[int, int, int, int | str, int]] = []
        self.labels: dict[str, int] = {}

    def emit(self, code: int, dst: int = 0, src: int = 0, off: int | str = 0, imm: int = 0) -> None:
        self.insns.append((code, dst, src, off, imm))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.insns)

    def assemble(self) -> bytes:
        out = bytearray()
        for i, (code, dst, src, off, imm) in enumerate(self.insns):
            rel = self.labels[off] - i - 1 if isinstance(off, str) else off
            out += struct.pack("<BBhi", code, (src << 4) | dst, rel, imm)
        return bytes(out)


def assemble_device_program(gpus: frozenset[int] | None, uvm_majors: Iterable[int] = ()) -> bytes:
    """The cgroup-device program answering `device_allowed(gpus, ...)`. Its context (r1) is struct
    bpf_cgroup_dev_ctx {u32 access_type (low 16 bits: type, high 16: access); u32 major; u32 minor};
    it returns 1 to allow, 0 to deny."""
    gpus = _check_gpus(gpus)
    a = _Asm()
    if gpus is None:
        a.emit(a.MOV64_K, dst=0, imm=1)
        a.emit(a.EXIT)
        return a.assemble()
    a.emit(a.LDXW, dst=2, src=1, off=0)  # r2 = access_type
    a.emit(a.AND64_K, dst=2, imm=0xFFFF)  # r2 = device type
    a.emit(a.JNE_K, dst=2, off="allow", imm=BPF_DEVCG_DEV_CHAR)  # block devices are never NVIDIA nodes
    a.emit(a.LDXW, dst=3, src=1, off=4)  # r3 = major
    a.emit(a.LDXW, dst=4, src=1, off=8)  # r4 = minor
    a.emit(a.JEQ_K, dst=3, off="nvidia", imm=NVIDIA_MAJOR)
    if not gpus:  # with a GPU admitted, nvidia-uvm is allowed like any other device
        for major in sorted(set(uvm_majors)):
            a.emit(a.JEQ_K, dst=3, off="deny", imm=major)
    a.emit(a.JA, off="allow")
    a.label("nvidia")
    if gpus:
        for minor in (NVIDIA_CTL_MINOR, NVIDIA_MODESET_MINOR, *sorted(gpus)):
            a.emit(a.JEQ_K, dst=4, off="allow", imm=minor)
    a.label("deny")
    a.emit(a.MOV64_K, dst=0, imm=0)
    a.emit(a.EXIT)
    a.label("allow")
    a.emit(a.MOV64_K, dst=0, imm=1)
    a.emit(a.EXIT)
    return a.assemble()


# --- raw bpf(2) ------------------------------------------------------------------------------------------


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_ulong]


def _bpf_nr() -> int | None:
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
    nr = _bpf_nr()
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


# --- host facts --------------------------------------------------------------------------------------------


def _unescape_mount(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def cgroup2_mount(mounts: Path = Path("/proc/self/mounts")) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup; /sys/fs/cgroup/unified on hybrid hosts)."""
    try:
        text = mounts.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 3 and f[2] == "cgroup2":
            return Path(_unescape_mount(f[1]))
    return None


def nvidia_uvm_majors(proc_devices: Path = Path("/proc/devices")) -> tuple[int, ...]:
    """The char majors of nvidia-uvm and nvidia-uvm-tools (dynamic); () when the module is not loaded."""
    try:
        text = proc_devices.read_text()
    except OSError:
        return ()
    majors: set[int] = set()
    in_char = False
    for line in text.splitlines():
        s = line.strip()
        if s.endswith(":"):
            in_char = s == "Character devices:"
            continue
        parts = s.split()
        if in_char and len(parts) == 2 and parts[1] in UVM_NAMES and parts[0].isdigit():
            majors.add(int(parts[0]))
    return tuple(sorted(majors))


def device_admission_unavailable_reason() -> str | None:
    """Why cgroup-device eBPF admission cannot work on this host, or None when it can."""
    if _bpf_nr() is None:
        return f"device admission: bpf(2) syscall number unknown for machine {platform.machine()!r}"
    if os.geteuid() != 0:
        return "device admission needs root (CAP_SYS_ADMIN and CAP_BPF) to load and attach cgroup eBPF programs"
    if cgroup2_mount() is None:
        return "device admission needs a cgroup v2 hierarchy (none is mounted): programs attach to cgroup v2 directories"
    try:
        fd = bpf_prog_load(assemble_device_program(None), name="unisched_probe")  # never attached
    except DeviceAdmissionError as e:
        return f"the kernel refused a cgroup-device eBPF program: {e}"
    os.close(fd)
    return None


# --- the real admission ------------------------------------------------------------------------------------


@dataclass
class _Attached:
    fd: int
    prog_id: int
    gpus: frozenset[int] | None
    uvm_majors: tuple[int, ...]


def _key(cgroup_dir: Path) -> Path:
    return Path(os.path.abspath(cgroup_dir))


def _open_cgroup(cgroup_dir: Path) -> int:
    """An O_DIRECTORY fd on the cgroup; FileNotFoundError passes through (a cgroup that is gone)."""
    try:
        return os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise DeviceAdmissionError(f"cannot open cgroup directory {cgroup_dir}: {e.strerror}", e.errno) from None


class BpfDeviceAdmission:
    """cgroup-device eBPF programs attached with BPF_F_ALLOW_MULTI; needs root and cgroup v2.

    Programs outlive this object and this process (see the module docstring); `close` only drops our fds.
    """

    def __init__(self, proc_devices: Path = Path("/proc/devices")) -> None:
        self._proc_devices = proc_devices
        self._attached: dict[Path, _Attached] = {}
        self._lock = threading.Lock()

    def admit(self, cgroup_dir: Path, gpus: frozenset[int] | None) -> None:
        gpus = _check_gpus(gpus)
        key = _key(cgroup_dir)
        uvm = nvidia_uvm_majors(self._proc_devices)
        code = assemble_device_program(gpus, uvm)
        with self._lock:
            try:
                cg_fd = _open_cgroup(key)
            except FileNotFoundError:
                raise DeviceAdmissionError(f"cannot admit devices for {key}: no such cgroup", errno.ENOENT) from None
            try:
                new_fd = bpf_prog_load(code)
                kept = False
                try:
                    new_id = bpf_prog_info(new_fd).prog_id
                    olds = self._ours(cg_fd, key)
                    try:
                        leftovers = self._attach(cg_fd, new_fd, olds, key)
                        prev = self._attached.pop(key, None)
                        if prev is not None:
                            os.close(prev.fd)
                        self._attached[key] = _Attached(new_fd, new_id, gpus, uvm)
                        kept = True
                        for old_id, old_fd in leftovers:  # the first old one was swapped in place where the kernel can
                            self._detach(cg_fd, old_fd, old_id, key)
                    finally:
                        for _, fd in olds:
                            os.close(fd)
                finally:
                    if not kept:
                        os.close(new_fd)
            finally:
                os.close(cg_fd)

    def revoke(self, cgroup_dir: Path) -> None:
        key = _key(cgroup_dir)
        with self._lock:
            prev = self._attached.pop(key, None)
            if prev is not None:
                os.close(prev.fd)
            try:
                cg_fd = _open_cgroup(key)
            except FileNotFoundError:
                return  # the cgroup is gone, and its programs with it
            try:
                olds = self._ours(cg_fd, key)
                try:
                    for prog_id, fd in olds:
                        self._detach(cg_fd, fd, prog_id, key)
                finally:
                    for _, fd in olds:
                        os.close(fd)
            finally:
                os.close(cg_fd)

    def describe(self, cgroup_dir: Path) -> str | None:
        key = _key(cgroup_dir)
        with self._lock:
            try:
                cg_fd = _open_cgroup(key)
            except FileNotFoundError:
                return None
            except DeviceAdmissionError as e:
                return f"device admission unknown: {e}"
            try:
                olds = self._ours(cg_fd, key)
            except DeviceAdmissionError as e:
                return f"device admission unknown: {e}"
            finally:
                os.close(cg_fd)
            ids = [prog_id for prog_id, _ in olds]
            for _, fd in olds:
                os.close(fd)
            known = self._attached.get(key)
        if not ids:
            return None
        extra = f" (+{len(ids) - 1} more of ours: ids {ids})" if len(ids) > 1 else ""
        if known is not None and known.prog_id in ids:
            uvm = f"; nvidia-uvm majors {','.join(map(str, known.uvm_majors))}" if known.uvm_majors else ""
            return f"eBPF device filter {PROG_NAME} id {known.prog_id}: {_gpu_text(known.gpus)}{uvm}{extra}"
        return f"eBPF device filter {PROG_NAME} id {ids[0]}, attached by an earlier unisched (policy not known here){extra}"

    def close(self) -> None:
        with self._lock:
            for a in self._attached.values():
                os.close(a.fd)
            self._attached.clear()

    # helpers, called with the lock held

    def _ours(self, cg_fd: int, key: Path) -> list[tuple[int, int]]:
        """(prog id, fd) of every program of ours attached directly to the cgroup; the caller closes the fds."""
        found: list[tuple[int, int]] = []
        try:
            for prog_id in bpf_prog_query(cg_fd, what=f"on {key}"):
                try:
                    fd = bpf_prog_get_fd_by_id(prog_id)
                except DeviceAdmissionError as e:
                    if e.errno == errno.ENOENT:
                        continue  # detached and freed since the query
                    raise
                try:
                    info = bpf_prog_info(fd)
                except BaseException:
                    os.close(fd)
                    raise
                if info.prog_type == BPF_PROG_TYPE_CGROUP_DEVICE and info.name.startswith(PROG_NAME):
                    found.append((prog_id, fd))
                else:
                    os.close(fd)
        except BaseException:
            for _, fd in found:
                os.close(fd)
            raise
        return found

    def _attach(self, cg_fd: int, new_fd: int, olds: list[tuple[int, int]], key: Path) -> list[tuple[int, int]]:
        """Attach new_fd, swapping out the first of ours atomically where the kernel can; returns what is left to detach."""
        what = f"of {PROG_NAME} to {key}"
        if olds:
            try:
                bpf_prog_attach(cg_fd, new_fd, BPF_F_ALLOW_MULTI, replace_fd=olds[0][1], what=what + " (replacing)")
                return olds[1:]
            except DeviceAdmissionError as e:
                if e.errno not in (errno.EINVAL, errno.ENOENT):  # no BPF_F_REPLACE (< 5.6), or the old one just went
                    raise
        bpf_prog_attach(cg_fd, new_fd, BPF_F_ALLOW_MULTI, what=what)
        return olds

    def _detach(self, cg_fd: int, prog_fd: int, prog_id: int, key: Path) -> None:
        try:
            bpf_prog_detach(cg_fd, prog_fd, what=f"of {PROG_NAME} id {prog_id} from {key}")
        except DeviceAdmissionError as e:
            if e.errno != errno.ENOENT:  # ENOENT: already detached
                raise


# --- the fake ----------------------------------------------------------------------------------------------


@dataclass
class FakeDeviceAdmission:
    """In-memory admission for engine logic tests: records calls; `allows` answers like the real program."""

    uvm_majors: tuple[int, ...] = ()
    current: dict[Path, frozenset[int] | None] = field(default_factory=dict)
    admits: list[tuple[Path, frozenset[int] | None]] = field(default_factory=list)
    revokes: list[Path] = field(default_factory=list)
    fail_next: DeviceAdmissionError | None = None
    """Raised once, by the next admit or revoke, to test error handling."""
    closed: bool = False

    def _maybe_fail(self) -> None:
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e

    def admit(self, cgroup_dir: Path, gpus: frozenset[int] | None) -> None:
        gpus = _check_gpus(gpus)
        self._maybe_fail()
        self.admits.append((Path(cgroup_dir), gpus))
        self.current[Path(cgroup_dir)] = gpus

    def revoke(self, cgroup_dir: Path) -> None:
        self._maybe_fail()
        self.revokes.append(Path(cgroup_dir))
        self.current.pop(Path(cgroup_dir), None)

    def describe(self, cgroup_dir: Path) -> str | None:
        if Path(cgroup_dir) not in self.current:
            return None
        return f"fake device filter: {_gpu_text(self.current[Path(cgroup_dir)])}"

    def close(self) -> None:
        self.closed = True

    def allows(self, cgroup_dir: Path, major: int, minor: int, dev_type: int = BPF_DEVCG_DEV_CHAR) -> bool:
        if Path(cgroup_dir) not in self.current:
            return True
        return device_allowed(self.current[Path(cgroup_dir)], dev_type, major, minor, self.uvm_majors)
