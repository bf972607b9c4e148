"""Decoding one notified call: which RM escape it is, and what it asks for, read from the tenant's memory.

Pure: the reader of the caller's memory is passed in (examine.read_call's). Malformed calls decode as Call(0),
nothing to track: the driver fails them itself; unreadable ones as Call(0) marked so. The NVOS32 heap call is
decoded as the RM_ALLOC or RM_FREE the driver makes of it, so the books follow one shape of call.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from unisched.enforce.nvclasses import (
    CHANNEL_CLASSES,
    CHANNEL_CONTEXT_SHARE_AT,
    CHANNEL_GROUP,
    DEVICE_CLASSES,
    MEMORY_SIZE_AT,
    NV01_DEVICE_0,
    NV01_MEMORY_LOCAL_USER,
    NV01_MEMORY_SYSTEM,
    NV50_MEMORY_VIRTUAL,
    NVOS00_SIZE,
    NVOS02_FD_SIZE,
    NVOS02_FORMAT,
    NVOS02_STATUS_AT,
    NVOS05_SIZE,
    NVOS05_STATUS_AT,
    NVOS21_SIZE,
    NVOS21_STATUS_AT,
    NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED,
    NVOS32_ALLOC_FLAGS_VIRTUAL,
    NVOS32_ALLOCS,
    NVOS32_ATTR_LOCATION_SHIFT,
    NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED,
    NVOS32_FUNCTION_FREE,
    NVOS32_FUNCTION_HW_FREE,
    NVOS32_SIZE,
    NVOS32_STATUS_AT,
    NVOS55_SIZE,
    NVOS55_STATUS_AT,
    NVOS64_STATUS_AT,
    RM_ALLOC,
    RM_ALLOC_MEMORY,
    RM_ALLOC_OBJECT,
    RM_ALLOC_SIZES,
    RM_DUP_OBJECT,
    RM_FREE,
    RM_VID_HEAP_CONTROL,
    XFER,
    XFER_FORMAT,
    XFER_SIZE,
    SessionKind,
    classify,
    decode_ioctl,
)
from unisched.enforce.seccomp.abi import IOCTL_SYSCALL
from unisched.enforce.seccomp.handles import Made

__all__ = ["ENGINE_INSTANCES", "ENGINE_KINDS", "Call", "Session", "decode_call", "escape_of"]

ENGINE_KINDS: Final = frozenset({SessionKind.NVDEC, SessionKind.NVENC, SessionKind.NVJPG, SessionKind.OFA})
"""Video engine kinds: one object per engine instance, joined into one session."""
ENGINE_INSTANCES: Final = 16
"""engineInstance is below it on any GPU (an H100 or H200 has 7 NVDEC and 7 NVJPG). The value is the tenant's to
write: one at or above it is taken as no instance, so its object opens a session of its own (decided and capped)
instead of joining one, and a session's instances stay few."""


@dataclass(eq=False)
class Session:
    """One engine session: one or more RM objects of one kind."""

    kind: SessionKind
    h_class: int
    pid: int  # the thread that opened it
    handle: int  # its first object's handle
    objects: set[int] = field(default_factory=set)
    instances: dict[int, int] = field(default_factory=dict)
    """Object (node) -> its engine instance, for the live objects that named one: a freed object's instance is
    dropped with it, so a session keeps no more than its live objects' (at most ENGINE_INSTANCES)."""
    last_ns: int = 0


_NOTHING_MADE: Final = Made()
"""(frozen: one for every Call, rather than a new one each)"""


@dataclass(slots=True)
class Call:
    """What one notification asks for, decoded from the tenant's memory."""

    op: int  # RM_ALLOC, RM_DUP_OBJECT (a new handle for an existing object) or RM_FREE; 0 = nothing to track
    h_root: int = 0
    h_parent: int = 0
    handle: int = 0  # hObjectNew (alloc), hObject (dup) or hObjectOld (free)
    h_class: int = 0
    kind: SessionKind | None = None
    owner: tuple[int, str] | None = None  # (tgid, start time) when this client is new
    instance: int | None = None  # engineInstance from the allocation parameters (video engines)
    join: Session | None = None  # the open session this object joins (no decision needed)
    node: int = 0  # where an admitted object was recorded
    status_at: int = 0  # the caller's address of the call's status field (RM_ALLOC)
    mem_bytes: int | None = None  # video memory the allocation asks for (nvclasses.MEMORY_SIZE_AT)
    device_id: int | None = None  # deviceId of an NV01_DEVICE_0 allocation
    replayed: int = 0  # the handle the driver will pick for it (handle 0), as the memory book replays it
    source: tuple[int, int] = (0, 0)  # (hClientSrc, hObjectSrc) of RM_DUP_OBJECT: what the new handle names
    copied: bool = False  # the memory book recorded this RM_DUP_OBJECT's new handle (MemoryBook.dup)
    context_share: int | None = None
    """A channel's hContextShare, 0 for a channel group (nvclasses.CHANNEL_CLASSES, CHANNEL_GROUP); None without
    parameters (the driver refuses it): what the driver makes inside the allocation (handles.HandleReplay.made)."""
    made: Made = _NOTHING_MADE  # the handles the driver's children of it took, as the memory book replays them
    unreadable: bool = False
    """(Call(0) only) its argument, or parameters the driver copies whole, could not be read from the caller: the
    supervisor fails it with EFAULT rather than let the driver read what the books never saw."""


_FOLLOWED: Final = frozenset({RM_ALLOC, RM_ALLOC_OBJECT, RM_ALLOC_MEMORY, RM_FREE, RM_VID_HEAP_CONTROL, RM_DUP_OBJECT,
                               XFER})
# The arguments' layouts, compiled once (every notification decodes one or more)
_XFER: Final = struct.Struct(XFER_FORMAT)
_ALLOC: Final = struct.Struct("=IIIIQ")  # NVOS21/NVOS64: hRoot, hObjectParent, hObjectNew, hClass, pAllocParms
_ALLOC_OBJECT: Final = struct.Struct("=IIII")  # NVOS05
_NVOS02: Final = struct.Struct(NVOS02_FORMAT)
_THREE: Final = struct.Struct("=III")  # NVOS00; also the first words of NVOS32, and engine parameters
_DUP: Final = struct.Struct("=IIIII")  # NVOS55
_TWO: Final = struct.Struct("=II")
_U32: Final = struct.Struct("=I")
_U64: Final = struct.Struct("=Q")


def escape_of(nr: int, arch: int, request: int) -> tuple[int, int] | None:
    """(escape nr, argument size) when the syscall is an RM escape the books follow, else None."""
    if nr not in IOCTL_SYSCALL.get(arch, ()):
        return None
    _type, enr, size = decode_ioctl(request)
    return (enr, size) if enr in _FOLLOWED else None


def decode_call(enr: int, size: int, addr: int, read: Callable[[int, int], bytes]) -> Call:
    """The call behind escape `enr` with its argument at `addr`; `read(addr, size)` reads the caller's memory and
    raises OSError or ValueError when it cannot. Malformed calls are Call(0) (nothing to track: the driver fails them
    itself, EINVAL); unreadable ones Call(0, unreadable=True)."""
    try:
        if enr == XFER:
            if size != XFER_SIZE:
                return Call(0)
            enr, size, addr = _XFER.unpack(read(addr, XFER_SIZE))
        if enr == RM_ALLOC and size in RM_ALLOC_SIZES:
            h_root, h_parent, h_new, h_class, params = _ALLOC.unpack(read(addr, 24))
            call = Call(RM_ALLOC, h_root, h_parent, h_new, h_class, classify(h_class))
            call.status_at = addr + (NVOS21_STATUS_AT if size == NVOS21_SIZE else NVOS64_STATUS_AT)
            if call.kind in ENGINE_KINDS and params:
                call.instance = _engine_instance(params, read)
            elif params and (h_class in MEMORY_SIZE_AT or h_class in DEVICE_CLASSES):
                _memory_params(call, params, read)
            elif h_class == NV01_DEVICE_0:
                call.device_id = 0  # no parameters: the driver takes GPU 0 (deviceConstruct)
            elif params and (h_class == CHANNEL_GROUP or h_class in CHANNEL_CLASSES):
                call.context_share = _context_share(h_class, params, read)
            return call
        if enr == RM_ALLOC_OBJECT and size == NVOS05_SIZE:  # RM_ALLOC without parameters
            h_root, h_parent, h_new, h_class = _ALLOC_OBJECT.unpack(read(addr, 16))
            call = Call(RM_ALLOC, h_root, h_parent, h_new, h_class, classify(h_class), status_at=addr + NVOS05_STATUS_AT)
            if h_class == NV01_DEVICE_0:
                call.device_id = 0  # no parameters: the driver takes GPU 0 (deviceConstruct)
            return call
        if enr == RM_ALLOC_MEMORY and size == NVOS02_FD_SIZE:
            h_root, h_parent, h_new, h_class, _flags, _p_memory, _limit = _NVOS02.unpack(read(addr, _NVOS02.size))
            # Followed for its handle only: for NV01_MEMORY_LOCAL_USER the driver ignores `limit` and makes a view
            # of the framebuffer (root) or a placeholder (rmapi_deprecated_allocmemory.c), no heap allocation.
            return Call(RM_ALLOC, h_root, h_parent, h_new, h_class, classify(h_class), status_at=addr + NVOS02_STATUS_AT)
        if enr == RM_FREE and size == NVOS00_SIZE:
            h_root, h_parent, h_old = _THREE.unpack(read(addr, 12))
            return Call(RM_FREE, h_root, h_parent, h_old)
        if enr == RM_DUP_OBJECT and size == NVOS55_SIZE:  # hClient, hParent, hObject (0: the driver picks), source
            h_client, h_parent, h_object, src_root, src_handle = _DUP.unpack(read(addr, 20))
            call = Call(RM_DUP_OBJECT, h_client, h_parent, h_object, status_at=addr + NVOS55_STATUS_AT)
            call.source = (src_root, src_handle)
            return call
        if enr == RM_VID_HEAP_CONTROL and size == NVOS32_SIZE:
            return _heap_call(addr, read(addr, NVOS32_SIZE))
    except (OSError, ValueError):
        return Call(0, unreadable=True)
    except struct.error:
        pass
    return Call(0)


def _heap_call(addr: int, args: bytes) -> Call:
    """An NVOS32 heap call as the RM_ALLOC or RM_FREE the driver turns it into (rmapi_deprecated_vidheapctrl.c):
    an allocation of NV50_MEMORY_VIRTUAL, NV01_MEMORY_LOCAL_USER (video memory: its size counted) or
    NV01_MEMORY_SYSTEM under the device hObjectParent, with hMemory as its handle when the caller provided one
    (else 0: the driver picks); a free of hMemory. Other functions (info, compression) are Call(0)."""
    h_root, h_parent, function = _THREE.unpack_from(args, 0)
    at = NVOS32_ALLOCS.get(function)
    if at is not None:
        (h_memory,) = _U32.unpack_from(args, at.h_memory)
        (flags,) = _U32.unpack_from(args, at.flags)
        handle = h_memory if flags & NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED else 0
        call = Call(RM_ALLOC, h_root, h_parent, handle, NV01_MEMORY_SYSTEM, status_at=addr + NVOS32_STATUS_AT)
        if at.attr is None or at.size is None:
            return call
        (attr,) = _U32.unpack_from(args, at.attr)
        if flags & NVOS32_ALLOC_FLAGS_VIRTUAL:
            call.h_class = NV50_MEMORY_VIRTUAL
        elif (attr >> NVOS32_ATTR_LOCATION_SHIFT) & 0x3 == 0:
            call.h_class = NV01_MEMORY_LOCAL_USER
            (call.mem_bytes,) = _U64.unpack_from(args, at.size)
        return call
    if function == NVOS32_FUNCTION_FREE:
        h_memory, flags = _TWO.unpack_from(args, 44)
        return Call(RM_FREE, h_root, h_parent, h_memory) if flags & NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED else Call(0)
    if function == NVOS32_FUNCTION_HW_FREE:
        (h_resource,) = _U32.unpack_from(args, 40)
        return Call(RM_FREE, h_root, h_parent, h_resource)
    return Call(0)


def _memory_params(call: Call, params: int, read: Callable[[int, int], bytes]) -> None:
    """The byte count of a video memory allocation, or a device's deviceId. The driver copies the class's own
    parameter struct whole whatever paramsSize says (serverAllocApiCopyIn, rmapiParamsCopyInit), so neither is
    the caller's to hide by a short paramsSize."""
    at = MEMORY_SIZE_AT.get(call.h_class)
    if at is not None:
        (call.mem_bytes,) = _U64.unpack(read(params + at, 8))
    elif call.h_class == NV01_DEVICE_0:
        (call.device_id,) = _U32.unpack(read(params, 4))


def _context_share(h_class: int, params: int, read: Callable[[int, int], bytes]) -> int:
    """A channel's hContextShare (NV_CHANNEL_ALLOC_PARAMS, copied whole as `_memory_params` says), 0 for a group."""
    if h_class == CHANNEL_GROUP:
        return 0
    (handle,) = _U32.unpack(read(params + CHANNEL_CONTEXT_SHARE_AT, 4))
    return int(handle)


def _engine_instance(params: int, read: Callable[[int, int], bytes]) -> int | None:
    """engineInstance of NV_BSP/MSENC/NVJPG/OFA_ALLOCATION_PARAMETERS {size, prohibitMultipleInstances, instance};
    None past ENGINE_INSTANCES."""
    try:
        p_size, _prohibit, instance = _THREE.unpack(read(params, 12))
    except (OSError, ValueError):
        return None
    return instance if p_size >= 12 and instance < ENGINE_INSTANCES else None
