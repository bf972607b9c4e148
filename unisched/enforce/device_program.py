"""The device rule twice: `device_allowed` in plain Python and `assemble_device_program`, the same rule as a
cgroup-device eBPF program (assembled here, so neither LLVM nor libbpf is needed). enforce.devices states the rule."""

from __future__ import annotations

import struct
from collections.abc import Iterable

from unisched.enforce.bpf import BPF_DEVCG_DEV_CHAR

__all__ = ["NVIDIA_MAJOR", "assemble_device_program", "check_gpus", "device_allowed"]

NVIDIA_MAJOR = 195
NVIDIA_GPU_MINOR_MAX = 247
NVIDIA_MODESET_MINOR = 254
NVIDIA_CTL_MINOR = 255


def check_gpus(gpus: frozenset[int] | None) -> frozenset[int] | None:
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
    gpus = check_gpus(gpus)
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
