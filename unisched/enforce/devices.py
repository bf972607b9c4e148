"""Device admission: which NVIDIA device nodes a tenant cgroup may open, enforced by cgroup v2 eBPF.

One Protocol, `DeviceAdmission`, with the real `BpfDeviceAdmission` and `FakeDeviceAdmission` for engine
logic tests. The real one loads a BPF_PROG_TYPE_CGROUP_DEVICE program through raw bpf(2) (enforce.bpf, ctypes;
the eBPF instructions are assembled in enforce.device_program, so neither LLVM nor libbpf is needed) and attaches
it to the tenant's cgroup v2 directory.

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

import errno
import os
import platform
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from unisched.enforce.bpf import (
    BPF_DEVCG_DEV_CHAR,
    BPF_F_ALLOW_MULTI,
    BPF_PROG_TYPE_CGROUP_DEVICE,
    PROG_NAME,
    DeviceAdmissionError,
    bpf_prog_attach,
    bpf_prog_detach,
    bpf_prog_get_fd_by_id,
    bpf_prog_info,
    bpf_prog_load,
    bpf_prog_query,
    bpf_syscall_nr,
)
from unisched.enforce.device_program import assemble_device_program, check_gpus, device_allowed

__all__ = [
    "BpfDeviceAdmission",
    "DeviceAdmission",
    "FakeDeviceAdmission",
    "cgroup2_mount",
    "device_admission_unavailable_reason",
    "nvidia_uvm_majors",
]

UVM_NAMES = ("nvidia-uvm", "nvidia-uvm-tools")


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




def _gpu_text(gpus: frozenset[int] | None) -> str:
    if gpus is None:
        return "all GPUs"
    if not gpus:
        return "no GPU (every NVIDIA node denied)"
    return "GPU " + ",".join(str(g) for g in sorted(gpus))




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
    if bpf_syscall_nr() is None:
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
        gpus = check_gpus(gpus)
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
        gpus = check_gpus(gpus)
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
