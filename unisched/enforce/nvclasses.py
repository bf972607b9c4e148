"""NVIDIA RM ioctl numbers and the object classes that open a session on a GPU engine.

Pure data and arithmetic, no I/O. The numbers come from NVIDIA's open kernel modules and were checked
against what the driver really allocates on the H200 (tests/test_gpu_hooks.py):
an EGL context allocates HOPPER_A 0xCB97 once, a CUDA context HOPPER_COMPUTE_A 0xCBC0, an NVDEC
session 0xB8B0. Everything else a driver allocates (channels, copy engines, TSGs, memory) is not a
session and is never refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

__all__ = [
    "NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED",
    "ROOT_CLASSES",
    "NV50_MEMORY_VIRTUAL",
    "NV01_MEMORY_SYSTEM",
    "NV01_MEMORY_LOCAL_USER",
    "NVOS32_STATUS_AT",
    "NVOS32_SIZE",
    "NVOS32_FUNCTION_HW_FREE",
    "NVOS32_FUNCTION_FREE",
    "NVOS32_ATTR_LOCATION_SHIFT",
    "NVOS32_ALLOC_FLAGS_VIRTUAL",
    "NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED",
    "NVOS32_ALLOCS",
    "HeapAlloc",
    "CHANNEL_CLASSES",
    "CHANNEL_CONTEXT_SHARE_AT",
    "CHANNEL_GROUP",
    "DEVICE_CLASSES",
    "IOCTL_TYPE",
    "MEMORY_SIZE_AT",
    "NV01_DEVICE_0",
    "NV0080_MAX_DEVICES",
    "NV20_SUBDEVICE_0",
    "NV_ERR_NO_MEMORY",
    "NVOS21_STATUS_AT",
    "NVOS64_STATUS_AT",
    "NVOS00_FORMAT",
    "NVOS00_SIZE",
    "NVOS21_SIZE",
    "NVOS55_FORMAT",
    "NVOS55_SIZE",
    "NVOS55_STATUS_AT",
    "NVOS64_SIZE",
    "NVOS02_FD_SIZE",
    "NVOS02_FORMAT",
    "NVOS02_STATUS_AT",
    "NVOS05_SIZE",
    "NVOS05_STATUS_AT",
    "RM_ALLOC",
    "RM_ALLOC_MEMORY",
    "RM_ALLOC_OBJECT",
    "RM_ALLOC_SIZES",
    "RM_CONTROL",
    "RM_DUP_OBJECT",
    "RM_FREE",
    "RM_MAP_MEMORY",
    "RM_VID_HEAP_CONTROL",
    "SESSION_CLASSES",
    "XFER",
    "XFER_FORMAT",
    "XFER_SIZE",
    "SessionKind",
    "classify",
    "decode_ioctl",
    "ioc",
    "iowr",
]

IOCTL_TYPE: Final = ord("F")  # 0x46, NV_IOCTL_MAGIC

# Escape numbers (the ioctl "nr" byte). The driver dispatches on nr and size only, never on type or direction.
RM_ALLOC_MEMORY: Final = 0x27  # NVOS02 (with an fd): the older memory allocation path, video memory included
RM_ALLOC_OBJECT: Final = 0x28  # NVOS05: the older object allocation, without parameters
RM_FREE: Final = 0x29
RM_CONTROL: Final = 0x2A
RM_ALLOC: Final = 0x2B
RM_DUP_OBJECT: Final = 0x34  # NVOS55: a new handle for an existing object; the driver picks it when hObject is 0
RM_MAP_MEMORY: Final = 0x4E
XFER: Final = 0xD3  # NV_ESC_IOCTL_XFER_CMD: {u32 cmd; u32 size; u64 ptr} wrapping another escape
RM_VID_HEAP_CONTROL: Final = 0x4A  # NVOS32: the heap path EGL/OpenGL allocates through (rmapi_deprecated_vidheapctrl.c)

# RM_ALLOC arguments: NVOS21 or NVOS64; both start hRoot@0 hObjectParent@4 hObjectNew@8 hClass@12 pAllocParms@16.
NVOS21_SIZE: Final = 32
NVOS64_SIZE: Final = 48
RM_ALLOC_SIZES: Final = frozenset({NVOS21_SIZE, NVOS64_SIZE})
RM_ALLOC_HEAD_FORMAT: Final = "=IIII"  # hRoot, hObjectParent, hObjectNew, hClass
# Where the driver writes an RM_ALLOC's result (NvV32 status): NVOS21 {..., pAllocParms@16, paramsSize@24,
# status@28}, NVOS64 {..., pAllocParms@16, pRightsRequested@24, paramsSize@32, flags@36, status@40}
# (src/common/sdk/nvidia/inc/nvos.h). The ioctl itself returns 0 whenever the escape was carried out.
NVOS21_STATUS_AT: Final = 28
NVOS64_STATUS_AT: Final = 40
# RM_ALLOC_OBJECT argument NVOS05 {hRoot@0, hObjectParent@4, hObjectNew@8, hClass@12, status@16}: RmAlloc without
# parameters. RM_ALLOC_MEMORY argument nv_ioctl_nvos02_parameters_with_fd: NVOS02 {hRoot@0, hObjectParent@4,
# hObjectNew@8, hClass@12, flags@16, pMemory@24, limit@32 (bytes - 1), status@40} then an fd@48 (escape.c).
NVOS05_SIZE: Final = 20
NVOS05_STATUS_AT: Final = 16
NVOS02_FD_SIZE: Final = 56
NVOS02_FORMAT: Final = "=IIIII4xQQ"
NVOS02_STATUS_AT: Final = 40
NV_ERR_NO_MEMORY: Final = 0x51  # "Out of memory" (src/common/sdk/nvidia/inc/nvstatuscodes.h)

# Objects whose allocation parameters say which GPU their children live on: NV01_DEVICE_0 0x80 with
# NV0080_ALLOC_PARAMETERS {deviceId@0, ...} (class/cl0080.h), and NV20_SUBDEVICE_0 0x2080 (class/cl2080.h),
# a child of a device.
NV01_DEVICE_0: Final = 0x80
NV20_SUBDEVICE_0: Final = 0x2080
DEVICE_CLASSES: Final = frozenset({NV01_DEVICE_0, NV20_SUBDEVICE_0})
NV0080_MAX_DEVICES: Final = 32
"""deviceId is below it (cl0080.h: NV_MAX_DEVICES, nvlimits.h); the driver refuses a device allocation naming another."""

MEMORY_SIZE_AT: Final = MappingProxyType(
    {
        # NV01_MEMORY_LOCAL_USER (class/cl0040.h): video memory; NV_MEMORY_ALLOCATION_PARAMS (nvos.h) {owner@0
        # type@4 flags@8 width@12 height@16 pitch@20 attr@24 attr2@28 format@32 comprCovg@36 zcullCovg@40,
        # rangeLo@48 rangeHi@56 (8-aligned), size@64 (NvU64, [IN/OUT]) ...}
        0x40: 64,
        # NV_MEMORY_FABRIC (class/cl00f8.h): video memory exported over NVLink fabric;
        # NV00F8_ALLOCATION_PARAMETERS {alignment@0, allocSize@8, pageSize@16, ...}
        0xF8: 8,
    }
)
"""hClass -> offset of the NvU64 byte count in its allocation parameters, for the classes that take video memory.
Not counted: NV01_MEMORY_SYSTEM 0x3E and NV01_MEMORY_SYSTEM_OS_DESCRIPTOR 0x71 (host memory),
NV01_MEMORY_VIRTUAL 0x70 and NV50_MEMORY_VIRTUAL 0x50A0 (address space, no backing), NV01_MEMORY_LOCAL_PHYSICAL
0xC2 (privileged; its size is an output)."""

# RM_VID_HEAP_CONTROL argument NVOS32_PARAMETERS (nvos.h), 184 bytes on 64-bit: hRoot@0 hObjectParent@4 (the
# device) function@8 hVASpace@12 ivcHeapNumber@16 status@20 total@24 free@32, then the function's union at 40.
# rmapi_deprecated_vidheapctrl.c turns an allocation into RM_ALLOC of NV50_MEMORY_VIRTUAL when
# NVOS32_ALLOC_FLAGS_VIRTUAL is set, else NV01_MEMORY_LOCAL_USER when attr's LOCATION (bits 26:25) is VIDMEM (0),
# else NV01_MEMORY_SYSTEM; the handle is hMemory when NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED is set, else the
# driver picks one.
NVOS32_SIZE: Final = 184
NVOS32_STATUS_AT: Final = 20


@dataclass(frozen=True)
class HeapAlloc:
    """Where one NVOS32 allocation function keeps its fields (offsets in NVOS32_PARAMETERS; None: not there)."""

    h_memory: int
    flags: int
    attr: int | None
    size: int | None


NVOS32_ALLOCS: Final = MappingProxyType(
    {
        2: HeapAlloc(h_memory=44, flags=52, attr=56, size=88),  # NVOS32_FUNCTION_ALLOC_SIZE
        6: HeapAlloc(h_memory=44, flags=52, attr=64, size=88),  # NVOS32_FUNCTION_ALLOC_TILED_PITCH_HEIGHT
        14: HeapAlloc(h_memory=44, flags=52, attr=56, size=80),  # NVOS32_FUNCTION_ALLOC_SIZE_RANGE
        19: HeapAlloc(h_memory=44, flags=48, attr=None, size=None),  # NVOS32_FUNCTION_HW_ALLOC (no memory)
        27: HeapAlloc(h_memory=40, flags=48, attr=None, size=None),  # NVOS32_FUNCTION_ALLOC_OS_DESCRIPTOR (host)
    }
)
"""NVOS32 function -> its allocation fields. Every one of them takes a handle (the driver's when not provided)."""
NVOS32_FUNCTION_FREE: Final = 3  # Free {owner@40, hMemory@44, flags@48}; the driver needs the flag below
NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED: Final = 0x00000001
NVOS32_FUNCTION_HW_FREE: Final = 20  # HwFree {hResourceHandle@40, flags@44}
NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED: Final = 0x00004000
NVOS32_ALLOC_FLAGS_VIRTUAL: Final = 0x00080000
NVOS32_ATTR_LOCATION_SHIFT: Final = 25  # NVOS32_ATTR_LOCATION 26:25; _VIDMEM 0, _PCI 1, _ANY 3
NV01_MEMORY_LOCAL_USER: Final = 0x40
NV01_MEMORY_SYSTEM: Final = 0x3E
NV50_MEMORY_VIRTUAL: Final = 0x50A0
# Objects the driver makes children of inside their allocation, in the caller's RM client with handles from its
# counter (handles.py): KEPLER_CHANNEL_GROUP_A (a TSG) makes a KERNEL_GRAPHICS_CONTEXT
# (kernel_channel_group_api.c); a GPFIFO channel under the device is wrapped in a TSG the driver makes; a channel
# without a context share puts its TSG in legacy mode once, which makes two FERMI_CONTEXT_SHARE_A (SYNC and ASYNC,
# Volta and newer) (kernel_channel.c). NV_CHANNEL_ALLOC_PARAMS (alloc/alloc_channel.h): hObjectError@0
# hObjectBuffer@4 gpFifoOffset@8 gpFifoEntries@16 flags@20 hContextShare@24 hVASpace@28 ...
CHANNEL_GROUP: Final = 0xA06C
CHANNEL_CLASSES: Final = frozenset({0x906F, 0xA06F, 0xA16F, 0xB06F, 0xC06F, 0xC36F, 0xC46F, 0xC56F, 0xC86F, 0xC96F,
                                    0xCA6F})
"""GF100, KEPLER A/B, MAXWELL, PASCAL, VOLTA, TURING, AMPERE, HOPPER, BLACKWELL A/B _CHANNEL_GPFIFO."""
CHANNEL_CONTEXT_SHARE_AT: Final = 24
ROOT_CLASSES: Final = frozenset({0x0, 0x1, 0x41})
"""NV01_ROOT, NV01_ROOT_NON_PRIV, NV01_ROOT_CLIENT: an RM client, whose handle comes from a global generator."""

# RM_FREE argument NVOS00: hRoot@0, hObjectParent@4, hObjectOld@8, status@12.
NVOS00_FORMAT: Final = "=IIII"
NVOS00_SIZE: Final = struct.calcsize(NVOS00_FORMAT)
# RM_DUP_OBJECT argument NVOS55: hClient@0 (where the new handle goes), hParent@4, hObject@8 (0: the driver
# picks it from hClient's counter, rs_server.c serverCopyResource), hClientSrc@12, hObjectSrc@16, flags@20, status@24.
NVOS55_FORMAT: Final = "=IIIIIII"
NVOS55_SIZE: Final = struct.calcsize(NVOS55_FORMAT)
NVOS55_STATUS_AT: Final = 24
# XFER argument nv_ioctl_xfer_t: cmd (the inner escape number itself, e.g. 0x2B), size, ptr (NvP64, 8-aligned).
XFER_FORMAT: Final = "=IIQ"
XFER_SIZE: Final = struct.calcsize(XFER_FORMAT)

_IOC_WRITE = 1
_IOC_READ = 2


class SessionKind(StrEnum):
    """An engine session a tenant can hold; caps and counts are kept per kind."""

    GRAPHICS = "graphics"
    COMPUTE = "compute"
    NVDEC = "nvdec"
    NVENC = "nvenc"
    NVENC_SW_SESSION = "nvenc_sw_session"
    NVJPG = "nvjpg"
    OFA = "ofa"


def _kinds(kind: SessionKind, *classes: int) -> dict[int, SessionKind]:
    return dict.fromkeys(classes, kind)


SESSION_CLASSES: Final = MappingProxyType(
    {
        # 3D/graphics: VOLTA_A TURING_A AMPERE_A AMPERE_B ADA_A HOPPER_A BLACKWELL_A BLACKWELL_B
        **_kinds(SessionKind.GRAPHICS, 0xC397, 0xC597, 0xC697, 0xC797, 0xC997, 0xCB97, 0xCD97, 0xCE97),
        **_kinds(SessionKind.COMPUTE, 0xC3C0, 0xC4C0, 0xC5C0, 0xC6C0, 0xC7C0, 0xC9C0, 0xCBC0, 0xCDC0, 0xCEC0),
        **_kinds(SessionKind.NVDEC, 0xB8B0, 0xC4B0, 0xC6B0, 0xC7B0, 0xC9B0, 0xCDB0, 0xCEB0, 0xCFB0, 0xD1B0),
        **_kinds(SessionKind.NVENC, 0xB4B7, 0xC4B7, 0xC7B7, 0xC9B7, 0xCEB7, 0xCFB7, 0xD1B7),
        **_kinds(SessionKind.NVENC, 0xC0B7, 0xC1B7, 0xC2B7, 0xC3B7, 0xD0B7, 0xD5B7),  # also in the headers
        **_kinds(SessionKind.NVENC_SW_SESSION, 0xA0BC),
        **_kinds(SessionKind.NVJPG, 0xB8D1, 0xC4D1, 0xC9D1, 0xCDD1, 0xCED0, 0xCFD1),
        **_kinds(SessionKind.OFA, 0xB8FA, 0xC6FA, 0xC7FA, 0xC9FA, 0xCDFA, 0xCEFA, 0xCFFA, 0xD1FA),
    }
)
"""hClass -> the session it opens. Classes not listed here are never counted nor refused."""


def classify(h_class: int) -> SessionKind | None:
    """The session kind an RM_ALLOC of `h_class` opens, or None when it is not an engine session."""
    return SESSION_CLASSES.get(h_class & 0xFFFFFFFF)


def ioc(direction: int, type_: int, nr: int, size: int) -> int:
    """Linux _IOC(dir, type, nr, size) for the common (x86, arm) encoding."""
    if not (0 <= type_ <= 0xFF and 0 <= nr <= 0xFF and 0 <= size <= 0x3FFF and 0 <= direction <= 3):
        raise ValueError(f"ioctl field out of range: dir={direction} type={type_:#x} nr={nr:#x} size={size}")
    return (direction << 30) | (size << 16) | (type_ << 8) | nr


def iowr(type_: int, nr: int, size: int) -> int:
    """_IOWR(type, nr, size): how NVIDIA's user-space driver encodes every escape."""
    return ioc(_IOC_READ | _IOC_WRITE, type_, nr, size)


def decode_ioctl(cmd: int) -> tuple[int, int, int]:
    """(type, nr, size) of an ioctl request, from its low 32 bits only (musl sign-extends the request)."""
    low = cmd & 0xFFFFFFFF
    return (low >> 8) & 0xFF, low & 0xFF, (low >> 16) & 0x3FFF
