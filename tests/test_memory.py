"""GPU memory caps and reserves enforced at the allocation, without a GPU.

Pure parts are table-tested (policy.memory, the memory book, decoding). End to end, a real child process installs
the real filter and makes NVIDIA RM calls against /dev/null standing in for /dev/nvidiactl, served by the real
SessionSupervisor with a MemoryLedger: a call let through fails there with ENOTTY (the "driver's" own answer);
a refused allocation returns 0 with NV_ERR_NO_MEMORY (0x51) in its status field, as the driver answers when
video memory is out.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from test_engine import Rig
from test_seccomp import ENOTTY, Proc, needs_notify, serve, start_tenant, wait_for

from unisched.enforce.nvclasses import (
    NV_ERR_NO_MEMORY,
    RM_ALLOC,
    RM_ALLOC_MEMORY,
    RM_ALLOC_OBJECT,
    RM_DUP_OBJECT,
    RM_FREE,
    XFER,
    SessionKind,
)
from unisched.enforce.seccomp.calls import decode_call
from unisched.enforce.seccomp.handles import RS_UNIQUE_HANDLE_BASE
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.memory import UNKNOWN_GPU, BookBounds, Held, MemoryBook, Unbooked
from unisched.enforce.seccomp.supervisor import SessionSupervisor
from unisched.policy import Engine, Priority
from unisched.policy.caps import SessionLimits
from unisched.policy.memory import MemoryTerms, Verdict, admit_allocation, check_reserve
from unisched.policy.model import PolicyError
from unisched.scheduler.config import DaemonConfig, DeclaredTenant
from unisched.scheduler.core import SchedulerError
from unisched.scheduler.limits import CLEAR, MemoryAsk
from unisched.scheduler.memory import GpuMemory
from unisched.telemetry import FakeTelemetry, GpuInfo

GIB = 1 << 30
ROOT = 0xC1D00001
DEV = 0xD0  # the device handle the tests allocate
GROUP, AMPERE_CHANNEL = 0xA06C, 0xC56F  # KEPLER_CHANNEL_GROUP_A, AMPERE_CHANNEL_GPFIFO_A (cl*.h)
OWNER = (4242, "123")


# --- policy ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nbytes", "held", "terms", "total", "verdict"),
    [
        (GIB, {}, {}, None, Verdict.ADMIT),  # no terms: anything
        (GIB, {"a": 3 * GIB}, {"a": MemoryTerms(cap=4 * GIB)}, None, Verdict.ADMIT),  # exactly at the cap
        (GIB + 1, {"a": 3 * GIB}, {"a": MemoryTerms(cap=4 * GIB)}, None, Verdict.CAP),
        # b reserves 6 of 10 GiB and holds 1: a (no cap) may take 4 GiB, not 5
        (4 * GIB, {"b": GIB}, {"b": MemoryTerms(reserve=6 * GIB)}, 10 * GIB, Verdict.ADMIT),
        (5 * GIB, {"b": GIB}, {"b": MemoryTerms(reserve=6 * GIB)}, 10 * GIB, Verdict.RESERVES),
        # b holds more than its reserve: what it holds counts
        (3 * GIB, {"b": 8 * GIB}, {"b": MemoryTerms(reserve=6 * GIB)}, 10 * GIB, Verdict.RESERVES),
        # unknown GPU size: reserves cannot be protected, caps still apply
        (9 * GIB, {"b": GIB}, {"b": MemoryTerms(reserve=6 * GIB)}, None, Verdict.ADMIT),
        # within its own reserve a tenant is never refused by these rules, even when others hold much
        (2 * GIB, {"b": 9 * GIB}, {"a": MemoryTerms(reserve=2 * GIB)}, 10 * GIB, Verdict.ADMIT),
        # what tenants without terms hold counts too (they have no entry in `terms`)
        (3 * GIB, {"b": 8 * GIB}, {}, 10 * GIB, Verdict.RESERVES),
        (2 * GIB, {"a": GIB, "b": 5 * GIB, "c": 2 * GIB}, {}, 10 * GIB, Verdict.ADMIT),
        (2 * GIB, {"a": GIB, "b": 5 * GIB, "c": 2 * GIB}, {"c": MemoryTerms(reserve=3 * GIB)}, 10 * GIB,
         Verdict.RESERVES),
        # b's reserve is on GPU 1 only: on GPU 0 it does not count
        (9 * GIB, {}, {"b": MemoryTerms(reserve=6 * GIB, gpus=frozenset({1}))}, 10 * GIB, Verdict.ADMIT),
    ],
)
def test_admit_allocation(nbytes: int, held: dict[str, int], terms: dict[str, MemoryTerms], total: int | None,
                          verdict: Verdict) -> None:
    assert admit_allocation("a", 0, nbytes, held, terms, total) is verdict


@pytest.mark.parametrize(
    ("own", "others", "totals", "fits"),
    [
        (MemoryTerms(reserve=4 * GIB), {"b": MemoryTerms(reserve=6 * GIB)}, {0: 10 * GIB}, True),
        (MemoryTerms(reserve=5 * GIB), {"b": MemoryTerms(reserve=6 * GIB)}, {0: 10 * GIB}, False),
        (MemoryTerms(reserve=5 * GIB), {"b": MemoryTerms(reserve=6 * GIB)}, {}, True),  # no GPU size known
        # pinned to different GPUs: they do not compete
        (MemoryTerms(reserve=8 * GIB, gpus=frozenset({0})), {"b": MemoryTerms(reserve=8 * GIB, gpus=frozenset({1}))},
         {0: 10 * GIB, 1: 10 * GIB}, True),
        (MemoryTerms(reserve=8 * GIB), {"b": MemoryTerms(reserve=8 * GIB, gpus=frozenset({1}))},
         {0: 10 * GIB, 1: 10 * GIB}, False),
        (MemoryTerms(reserve=5 * GIB), {"a": MemoryTerms(reserve=9 * GIB)}, {0: 10 * GIB}, True),  # its old terms
    ],
)
def test_check_reserve(own: MemoryTerms, others: dict[str, MemoryTerms], totals: dict[int, int], fits: bool) -> None:
    why = check_reserve("a", own, others, totals)
    assert (why is None) is fits
    if why is not None:
        assert "'a'" in why and "does not fit on GPU" in why and "b " in why


def test_terms_are_validated() -> None:
    with pytest.raises(PolicyError, match="exceeds the tenant's own cap"):
        MemoryTerms(cap=GIB, reserve=2 * GIB)
    with pytest.raises(PolicyError):
        MemoryTerms(reserve=-1)


# --- the book --------------------------------------------------------------------------------------------------------
def test_book_follows_devices_frees_and_clients() -> None:
    book = MemoryBook()
    book.add_device(ROOT, DEV, 0x80, ROOT, 1, OWNER)
    book.add_device(ROOT, 0xD1, 0x2080, DEV, None, OWNER)  # a subdevice: its device's GPU
    assert book.add(ROOT, 0x10, DEV, GIB, OWNER)[:2] == (1, 0x10)
    assert book.add(ROOT, 0x11, 0xD1, 2 * GIB, OWNER)[0] == 1
    assert book.add(ROOT, 0x12, 0x99, 3, OWNER)[0] == UNKNOWN_GPU  # parent never seen as a device
    assert book.held() == {1: 3 * GIB, UNKNOWN_GPU: 3}
    assert book.free(ROOT, 0x10) == [Held(1, GIB)]
    assert book.free(ROOT, 0x10) == []  # freed twice: nothing more
    _, _, stale = book.add(ROOT, 0x11, DEV, 5, OWNER)  # same handle again: the old one's free was missed
    assert stale == [Held(1, 2 * GIB)]
    book.add(ROOT, 0x13, 0xD1, 7, OWNER)
    assert sorted(h.nbytes for h in book.free(ROOT, DEV)) == [5, 7]  # a device takes its memory and subdevices'
    assert book.held() == {UNKNOWN_GPU: 3}
    assert book.free(ROOT, ROOT) == [Held(UNKNOWN_GPU, 3)]  # the client takes everything
    assert book.held() == {} and book.owners() == {}


def test_a_carried_book_refuses_memory_on_devices_it_never_saw_made_by_processes_from_before() -> None:
    """A listener kept over a restart: a process that started before it (start time 123 < 200) made its clients and
    devices unseen. Its memory under such a device is refused (not counted on UNKNOWN_GPU, past every GPU's caps
    and reserves) and the handles the driver picks for it are not replayed; under a device made since, it is
    followed as ever, and a process started since is followed in full."""
    book = MemoryBook(carried_before=200)
    assert book.unbooked(ROOT, 0x10, DEV, OWNER) is Unbooked.CARRIED
    book.add_device(ROOT, 0xD5, 0x80, ROOT, 1, OWNER)  # a device it makes after the restart: seen
    assert book.unbooked(ROOT, 0x11, 0xD5, OWNER) is None and book.add(ROOT, 0x11, 0xD5, GIB, OWNER)[0] == 1
    assert book.unbooked(ROOT, 0x12, DEV, OWNER) is Unbooked.CARRIED  # still not the old one
    assert book.lost(ROOT)  # its driver-picked handles: keys of their own, counted until it ends
    new, fresh = ROOT + 1, (4343, "300")
    assert book.unbooked(new, 0x10, DEV, fresh) is None  # started since: an unknown parent is as it always was
    book.add_device(new, DEV, 0x80, new, 0, fresh)
    assert book.add(new, 0, DEV, 5, fresh)[1] == RS_UNIQUE_HANDLE_BASE and not book.lost(new)
    assert MemoryBook().unbooked(ROOT, 0x10, DEV, OWNER) is None  # not carried: no such rule


def test_book_keeps_clients_apart_and_releases_exited_ones() -> None:
    book = MemoryBook()
    other = ROOT + 1
    for root in (ROOT, other):
        book.add_device(root, DEV, 0x80, root, 0, (root, "1"))
        book.add(root, 0x10, DEV, GIB, (root, "1"))
    assert book.free(other, 0x11) == [] and book.held() == {0: 2 * GIB}
    assert book.release([other]) == [Held(0, GIB)]
    assert book.owners() == {ROOT: (ROOT, "1")}
    _, key, _ = book.add(ROOT, 0, DEV, 5, OWNER)  # handle 0: the driver picks it, replayed
    assert key == RS_UNIQUE_HANDLE_BASE and book.undo(ROOT, key, driver_chosen=True) == [Held(0, 5)]
    assert book.add(ROOT, 0, DEV, 5, OWNER)[1] == RS_UNIQUE_HANDLE_BASE  # the undone call never took it
    assert sorted(h.nbytes for h in book.release_all()) == [5, GIB]


def test_book_keeps_memory_charged_while_any_copy_of_its_handle_lives() -> None:
    book = MemoryBook()
    other = ROOT + 1
    book.add_device(ROOT, DEV, 0x80, ROOT, 1, OWNER)
    book.add(ROOT, 0x10, DEV, GIB, OWNER)
    book.handle_for(other, 0x30, other, OWNER)  # the copy's client, booked as its first call books it
    assert book.dup(ROOT, 0x20, DEV, (ROOT, 0x10), OWNER)
    assert book.dup(other, 0x30, other, (ROOT, 0x10), OWNER)  # into another client of the same process
    assert book.free(ROOT, 0x10) == [Held(1, 0)] and book.held() == {1: GIB}  # two copies left
    assert book.free(ROOT, 0x20) == [Held(1, 0)] and book.held() == {1: GIB}
    assert book.release([other]) == [Held(1, GIB)] and book.held() == {}  # the last copy goes with its client
    assert not book.dup(ROOT, 0x21, DEV, (ROOT, 0x99), OWNER)  # a source not booked: nothing followed
    book.add_device(ROOT, 0xD1, 0x2080, DEV, None, OWNER)
    assert book.dup(other, 0xD2, other, (ROOT, DEV), OWNER)  # a copy of a device stands for its GPU
    assert book.gpu_of(other, 0xD2) == 1


def test_a_copy_onto_a_handle_in_use_changes_nothing_and_an_undone_copy_only_itself() -> None:
    """The driver refuses a copy onto a live handle: what that handle holds stays charged, and a copy whose
    caller was gone before the answer takes away only what it recorded."""
    book = MemoryBook()
    book.add_device(ROOT, DEV, 0x80, ROOT, 3, OWNER)
    book.add(ROOT, 0x10, DEV, GIB, OWNER)
    book.add(ROOT, 0x11, DEV, 4096, OWNER)
    assert not book.dup(ROOT, 0x10, DEV, (ROOT, 0x11), OWNER) and book.held() == {3: GIB + 4096}
    assert not book.dup(ROOT, DEV, ROOT, (ROOT, 0x10), OWNER)  # onto the device's handle
    assert book.gpu_of(ROOT, DEV) == 3
    assert book.dup(ROOT, 0x12, DEV, (ROOT, 0x10), OWNER)
    assert book.undo_copy(ROOT, 0x12) == [] and book.free(ROOT, 0x10) == [Held(3, GIB)]


def test_a_copy_of_booked_memory_the_book_has_no_room_for_is_refused() -> None:
    book = MemoryBook(BookBounds(objects=1))
    book.add_device(ROOT, DEV, 0x80, ROOT, 0, OWNER)
    book.add(ROOT, 0x10, DEV, GIB, OWNER)
    assert book.copy_refusal(ROOT, 0x20, DEV, (ROOT, 0x10), OWNER) is Unbooked.OBJECTS
    assert book.copy_refusal(ROOT, 0x20, DEV, (ROOT, 0x99), OWNER) is None  # not booked memory: not followed
    assert book.copy_refusal(ROOT + 5, 0x20, DEV, (ROOT, 0x10), (0, "")) is Unbooked.CLIENT  # process not known


def test_ledger_charges_and_credits_per_tenant_and_gpu() -> None:
    terms = {"a": MemoryTerms(cap=2 * GIB), "b": MemoryTerms(reserve=4 * GIB)}
    ledger = MemoryLedger(lambda: terms, lambda: {0: 8 * GIB})
    assert ledger.charge("a", 0, 2 * GIB) is Verdict.ADMIT
    assert ledger.charge("a", 0, 1) is Verdict.CAP
    assert ledger.charge("a", 1, 2 * GIB) is Verdict.ADMIT  # the cap is per GPU
    assert ledger.charge("c", 0, 2 * GIB) is Verdict.ADMIT
    assert ledger.charge("c", 0, 1) is Verdict.RESERVES  # 2 (a) + 4 (b's reserve) + 2 (c) = 8
    ledger.credit("a", [Held(0, GIB)])
    assert ledger.charge("c", 0, GIB) is Verdict.ADMIT
    assert ledger.of("a").held == {0: GIB, 1: 2 * GIB} and ledger.of("a").refused == {0: 1}
    assert ledger.held_on(0) == {"a": GIB, "c": 3 * GIB}


# --- decoding --------------------------------------------------------------------------------------------------------
def _memory(addr_of: dict[int, bytes]) -> Callable[[int, int], bytes]:
    def read(addr: int, size: int) -> bytes:
        for base, data in addr_of.items():
            if base <= addr and addr + size <= base + len(data):
                return data[addr - base:addr - base + size]
        raise OSError("unmapped")
    return read


def test_memory_allocations_are_decoded() -> None:
    params = bytearray(120)
    struct.pack_into("=Q", params, 64, 3 * GIB)
    nvos21 = struct.pack("=IIIIQII", ROOT, DEV, 0x10, 0x40, 0x5000, len(params), 0)
    nvos64 = struct.pack("=IIIIQQIII4x", ROOT, DEV, 0x10, 0x40, 0x5000, 0, len(params), 0, 0)
    xfer = struct.pack("=IIQ", RM_ALLOC, 48, 0x1000)
    read = _memory({0x1000: nvos64, 0x2000: nvos21, 0x3000: xfer, 0x5000: bytes(params)})
    for enr, size, addr, status_at in ((RM_ALLOC, 32, 0x2000, 0x2000 + 28), (RM_ALLOC, 48, 0x1000, 0x1000 + 40),
                                       (XFER, 16, 0x3000, 0x1000 + 40)):
        call = decode_call(enr, size, addr, read)
        assert (call.op, call.h_parent, call.handle, call.mem_bytes, call.status_at) == (RM_ALLOC, DEV, 0x10, 3 * GIB, status_at)
    # paramsSize that does not reach size@64 (or is 1): the driver copies the class's struct whole all the same
    # (serverAllocApiCopyIn), so the size is read all the same: a short paramsSize hid 40 GiB from the cap
    for psize in (64, 1):
        short = struct.pack("=IIIIQII", ROOT, DEV, 0x10, 0x40, 0x5000, psize, 0)
        assert decode_call(RM_ALLOC, 32, 0x7000, _memory({0x7000: short, 0x5000: bytes(params)})).mem_bytes == 3 * GIB
    # paramsSize 0: the class's own struct, copied whole by the driver (what libcuda passes on the H200)
    unsized = struct.pack("=IIIIQQIII4x", ROOT, DEV, 0x10, 0x40, 0x5000, 0, 0, 0, 0)
    assert decode_call(RM_ALLOC, 48, 0x7000, _memory({0x7000: unsized, 0x5000: bytes(params)})).mem_bytes == 3 * GIB
    system = struct.pack("=IIIIQII", ROOT, DEV, 0x10, 0x3E, 0x5000, len(params), 0)  # host memory: not counted
    assert decode_call(RM_ALLOC, 32, 0x7000, _memory({0x7000: system, 0x5000: bytes(params)})).mem_bytes is None
    no_params = struct.pack("=IIIIQII", ROOT, ROOT, DEV, 0x80, 0, 0, 0)  # the driver takes GPU 0 (deviceConstruct)
    assert decode_call(RM_ALLOC, 32, 0x7000, _memory({0x7000: no_params})).device_id == 0
    device = struct.pack("=IIIIQII", ROOT, ROOT, DEV, 0x80, 0x5000, 16, 0)
    assert decode_call(RM_ALLOC, 32, 0x7000, _memory({0x7000: device, 0x5000: struct.pack("=I", 3) + bytes(12)})).device_id == 3
    channel = struct.pack("=IIIIQII", ROOT, 0x20, 0x21, AMPERE_CHANNEL, 0x5000, 0, 0)  # NV_CHANNEL_ALLOC_PARAMS
    chan_params = bytes(24) + struct.pack("=I", 0x30) + bytes(100)  # hContextShare@24
    assert decode_call(RM_ALLOC, 32, 0x7000, _memory({0x7000: channel, 0x5000: chan_params})).context_share == 0x30
    short_chan = struct.pack("=IIIIQII", ROOT, 0x20, 0x21, AMPERE_CHANNEL, 0x5000, 24, 0)  # read whole all the same
    assert decode_call(RM_ALLOC, 32, 0x7000, _memory({0x7000: short_chan, 0x5000: chan_params})).context_share == 0x30
    group = struct.pack("=IIIIQII", ROOT, DEV, 0x20, GROUP, 0x5000, 0, 0)
    assert decode_call(RM_ALLOC, 32, 0x7000, _memory({0x7000: group, 0x5000: chan_params})).context_share == 0
    assert decode_call(RM_ALLOC, 32, 0x7000, _memory({0x7000: group[:16] + bytes(16)})).context_share is None
    free = decode_call(RM_FREE, 16, 0x7000, _memory({0x7000: struct.pack("=IIII", ROOT, DEV, 0x10, 0)}))
    assert (free.op, free.handle, free.mem_bytes) == (RM_FREE, 0x10, None)
    nvos05 = struct.pack("=IIIII", ROOT, ROOT, 0x30, 0xC597, 0)  # RM_ALLOC_OBJECT: no parameters
    obj = decode_call(RM_ALLOC_OBJECT, 20, 0x7000, _memory({0x7000: nvos05}))
    assert (obj.op, obj.handle, obj.h_class, obj.kind, obj.status_at) == (RM_ALLOC, 0x30, 0xC597, SessionKind.GRAPHICS, 0x7010)
    nvos02 = struct.pack("=IIIII4xQQII4x", ROOT, DEV, 0x31, 0x40, 0, 0, GIB - 1, 0, 3)  # RM_ALLOC_MEMORY, fd 3
    amem = decode_call(RM_ALLOC_MEMORY, 56, 0x7000, _memory({0x7000: nvos02}))  # its handle only: no heap bytes
    assert (amem.op, amem.h_parent, amem.handle, amem.mem_bytes, amem.status_at) == (RM_ALLOC, DEV, 0x31, None, 0x7028)
    assert decode_call(RM_ALLOC_MEMORY, 48, 0x7000, _memory({0x7000: nvos02})).op == 0  # not the driver's size
    nvos55 = struct.pack("=IIIIIII", ROOT, DEV, 0, ROOT + 1, 0x20, 0, 0)  # a dup into ROOT, the driver picking
    dup = decode_call(RM_DUP_OBJECT, 28, 0x7000, _memory({0x7000: nvos55}))
    assert (dup.op, dup.h_root, dup.h_parent, dup.handle, dup.kind) == (RM_DUP_OBJECT, ROOT, DEV, 0, None)
    assert dup.source == (ROOT + 1, 0x20) and dup.status_at == 0x7000 + 24
    assert decode_call(RM_DUP_OBJECT, 32, 0x7000, _memory({0x7000: nvos55 + bytes(4)})).op == 0  # not NVOS55


def _nvos32(function: int, handle: int = 0, flags: int = 0, attr: int = 0, nbytes: int = 0,
            at: tuple[int, int, int, int] = (44, 52, 56, 88)) -> bytes:
    buf = bytearray(184)
    struct.pack_into("=III", buf, 0, ROOT, DEV, function)
    h_at, flags_at, attr_at, size_at = at
    struct.pack_into("=I", buf, h_at, handle)
    struct.pack_into("=I", buf, flags_at, flags)
    struct.pack_into("=I", buf, attr_at, attr)
    struct.pack_into("=Q", buf, size_at, nbytes)
    return bytes(buf)


PROVIDED, VIRTUAL, PCI = 0x4000, 0x80000, 1 << 25


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        # ALLOC_SIZE in video memory (attr LOCATION 0), the driver picking the handle: counted, status at 20
        (_nvos32(2, handle=0x77, nbytes=GIB), (RM_ALLOC, 0, 0x40, GIB, 0x1000 + 20)),
        (_nvos32(2, handle=0x77, flags=PROVIDED, nbytes=GIB), (RM_ALLOC, 0x77, 0x40, GIB, 0x1000 + 20)),
        (_nvos32(2, attr=PCI, nbytes=GIB), (RM_ALLOC, 0, 0x3E, None, 0x1000 + 20)),  # host memory
        (_nvos32(2, flags=VIRTUAL, nbytes=GIB), (RM_ALLOC, 0, 0x50A0, None, 0x1000 + 20)),  # address space only
        # ALLOC_TILED_PITCH_HEIGHT: attr@64; ALLOC_SIZE_RANGE: size@80
        (_nvos32(6, nbytes=5, at=(44, 52, 64, 88)), (RM_ALLOC, 0, 0x40, 5, 0x1000 + 20)),
        (_nvos32(14, nbytes=7, at=(44, 52, 56, 80)), (RM_ALLOC, 0, 0x40, 7, 0x1000 + 20)),
        (_nvos32(27, at=(40, 48, 52, 64)), (RM_ALLOC, 0, 0x3E, None, 0x1000 + 20)),  # OS descriptor: a handle only
        (_nvos32(3, handle=0x77, flags=0, at=(44, 48, 52, 64)), (0, 0, 0, None, 0)),  # FREE without the flag: fails
        (_nvos32(3, handle=0x77, flags=1, at=(44, 48, 52, 64)), (RM_FREE, 0x77, 0, None, 0)),
        (_nvos32(20, handle=0x78, at=(40, 48, 52, 64)), (RM_FREE, 0x78, 0, None, 0)),  # HW_FREE
        (_nvos32(5), (0, 0, 0, None, 0)),  # INFO: nothing to track
    ],
)
def test_heap_calls_are_decoded_as_the_allocations_the_driver_makes_of_them(
        args: bytes, expect: tuple[int, int, int, int | None, int]) -> None:
    call = decode_call(0x4A, 184, 0x1000, _memory({0x1000: args}))
    assert (call.op, call.handle, call.h_class, call.mem_bytes, call.status_at) == expect
    assert decode_call(0x4A, 180, 0x1000, _memory({0x1000: args})).op == 0  # not NVOS32's size: the driver refuses it


# --- end to end ------------------------------------------------------------------------------------------------------
def mem(proc: Proc, handle: int, nbytes: int, *, parent: int = DEV, op: str = "mem", size: int = 32) -> tuple[int, int]:
    """(errno, status) of one allocation from the child."""
    tail = f" {ROOT:#x} {size}" if op == "mem" else ""
    proc.send(f"{op} {parent:#x} {handle:#x} {nbytes}{tail}")
    _, err, status = proc.line().split()
    return int(err), int(status)


def amem(proc: Proc, handle: int, nbytes: int, h_class: int = 0x40) -> tuple[int, int]:
    """(errno, status) of one RM_ALLOC_MEMORY from the child."""
    proc.send(f"amem {DEV:#x} {handle:#x} {nbytes} {h_class:#x}")
    _, err, status = proc.line().split()
    return int(err), int(status)


LET_THROUGH = (ENOTTY, 0)
REFUSED = (0, NV_ERR_NO_MEMORY)


class Served:
    """A tenant child, its supervisor with a ledger of `terms`, and the supervisor's thread."""

    def __init__(self, terms: Mapping[str, MemoryTerms], totals: Mapping[int, int] | None = None,
                 ledger: MemoryLedger | None = None) -> None:
        self.ledger = ledger or MemoryLedger(lambda: terms, lambda: totals or {})
        self.proc, fd = start_tenant()
        self.sup = SessionSupervisor(fd, "t", lambda *_: True, None, reconcile_interval_s=0.05, memory=self.ledger)
        self.thread = serve(self.sup)
        assert self.proc.call(f"dev {DEV:#x} 0") == ENOTTY

    def held(self) -> dict[int, int]:
        return dict(self.ledger.of("t").held)

    def close(self) -> None:
        self.proc.kill()
        self.sup.close()


@pytest.fixture
def capped() -> Iterator[Served]:
    served = Served({"t": MemoryTerms(cap=4 * GIB)})
    yield served
    served.close()


@needs_notify
def test_the_allocation_crossing_the_cap_fails_as_out_of_memory_and_a_free_gives_it_back(capped: Served) -> None:
    proc = capped.proc
    assert [mem(proc, 0x10 + i, GIB) for i in range(4)] == [LET_THROUGH] * 4
    assert mem(proc, 0x14, GIB) == REFUSED  # the 5th GiB: the ioctl returns 0 with NV_ERR_NO_MEMORY
    assert mem(proc, 0x15, 1) == REFUSED
    assert capped.held() == {0: 4 * GIB}
    assert proc.call(f"free {0x11:#x}") == ENOTTY
    assert capped.held() == {0: 3 * GIB}  # exact by the time the free returns
    assert mem(proc, 0x14, GIB) == LET_THROUGH  # the app goes on: allocate again after a free
    assert mem(proc, 0x16, GIB, op="xmem") == REFUSED  # through XFER too
    assert mem(proc, 0x16, GIB, size=48) == REFUSED  # NVOS64: status at 40
    assert capped.ledger.of("t").refused == {0: 4}
    assert proc.call(f"free {DEV:#x}") == ENOTTY  # the device takes its memory with it
    assert capped.held() == {}


def heap(proc: Proc, nbytes: int, *, function: int = 2, handle: int = 0, flags: int = 0, attr: int = 0) -> tuple[int, int]:
    """(errno, status) of one NVOS32 heap call from the child."""
    proc.send(f"heap {function} {DEV:#x} {handle:#x} {nbytes} {flags:#x} {attr:#x}")
    _, err, status = proc.line().split()
    return int(err), int(status)


@needs_notify
def test_heap_allocations_with_driver_chosen_handles_are_capped_and_given_back_by_their_free(capped: Served) -> None:
    """EGL/OpenGL's path: NVOS32 ALLOC_SIZE leaving the handle to the driver, freed by RM_FREE of that handle."""
    proc = capped.proc
    assert [heap(proc, GIB) for _ in range(3)] == [LET_THROUGH] * 3  # replayed as 0xcaf00000, 0xcaf00001, ...2
    assert heap(proc, GIB, attr=PCI) == LET_THROUGH  # host memory: not counted, but it takes 0xcaf00003
    assert heap(proc, GIB, flags=PROVIDED, handle=0x99) == LET_THROUGH
    assert heap(proc, GIB) == REFUSED  # the 5th GiB fails as out of memory (status at 20), taking no handle
    assert capped.held() == {0: 4 * GIB}
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE + 1:#x}") == ENOTTY
    assert capped.held() == {0: 3 * GIB}
    assert heap(proc, GIB) == LET_THROUGH  # 0xcaf00004
    assert heap(proc, 0, function=3, handle=RS_UNIQUE_HANDLE_BASE + 4, flags=1) == LET_THROUGH  # NVOS32 FREE
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE + 3:#x}") == ENOTTY  # the host memory: nothing to give back
    assert proc.call("free 0x99") == ENOTTY
    assert capped.held() == {0: 2 * GIB}
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE:#x}") == ENOTTY
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE + 2:#x}") == ENOTTY
    assert capped.held() == {}
    assert capped.ledger.of("t").refused == {0: 1}


def chan(proc: Proc, h_class: int, parent: int, handle: int, context_share: int = 0) -> int:
    """errno of one channel group or channel allocation from the child."""
    return proc.call(f"chan {h_class:#x} {parent:#x} {handle:#x} {context_share:#x}")


@needs_notify
def test_the_children_the_driver_makes_for_channels_take_their_turns_in_the_replay(capped: Served) -> None:
    """What an EGL player did on the H100 (driver 580): channel groups, textures under driver-picked handles, a
    channel with a context share in a group, two channels under the device, more textures. Each group's graphics
    context, and each bare channel's group with its context and two context shares, take handles from the client's
    counter inside those allocations. Without them replayed, the later textures were booked ten handles low, the
    first free above them named a handle never given out, and the client's memory stayed counted until it ended."""
    proc, base = capped.proc, RS_UNIQUE_HANDLE_BASE
    assert chan(proc, GROUP, DEV, 0xCEF80000) == chan(proc, GROUP, DEV, 0xCEF80001) == ENOTTY  # base, base + 1
    assert heap(proc, GIB) == LET_THROUGH  # base + 2
    assert chan(proc, AMPERE_CHANNEL, 0xCEF80000, 0xBEEF0100, context_share=0xCEF00000) == ENOTTY  # nothing more
    assert chan(proc, AMPERE_CHANNEL, DEV, 0xBEEF0101) == chan(proc, AMPERE_CHANNEL, DEV, 0xBEEF0102) == ENOTTY  # +8
    assert heap(proc, GIB) == LET_THROUGH  # base + 11
    assert chan(proc, AMPERE_CHANNEL, 0xCEF80001, 0xBEEF0103) == ENOTTY  # the group's legacy context shares: +2
    assert chan(proc, AMPERE_CHANNEL, 0xCEF80001, 0xBEEF0104) == ENOTTY  # once per group
    assert heap(proc, GIB) == LET_THROUGH  # base + 14
    assert capped.held() == {0: 3 * GIB}
    for handle in (base + 11, base + 14, base + 2):
        assert proc.call(f"free {handle:#x}") == ENOTTY
    assert capped.held() == {}
    assert proc.call("free 0xbeef0101") == ENOTTY  # the channel takes its group (and that group's children) with it
    assert heap(proc, GIB) == LET_THROUGH  # base + 15: the driver never reuses a handle before the counter wraps
    assert proc.call(f"free {base + 15:#x}") == ENOTTY
    assert capped.held() == {}


@needs_notify
@pytest.mark.parametrize("op", ["dup", "xdup"])
def test_a_dup_that_leaves_its_handle_to_the_driver_takes_its_turn_in_the_replay(capped: Served, op: str) -> None:
    """RM_DUP_OBJECT with hObject 0 takes the next handle of its client's counter (rs_server.c serverCopyResource):
    the allocation after it gets the one after that, and each free gives back what its own handle holds. Without
    the dup followed, the replay gave that allocation the dup's handle, and its free was of a handle never given
    out: the client was lost and its memory counted until it ended."""
    proc = capped.proc
    assert heap(proc, GIB) == LET_THROUGH  # 0xcaf00000
    assert proc.call(f"{op} {DEV:#x} 0 {RS_UNIQUE_HANDLE_BASE:#x}") == ENOTTY  # 0xcaf00001: the same GiB, again
    assert heap(proc, GIB) == LET_THROUGH  # 0xcaf00002
    assert capped.held() == {0: 2 * GIB}
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE + 2:#x}") == ENOTTY
    assert capped.held() == {0: GIB}
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE + 1:#x}") == ENOTTY  # the dup's handle: nothing to give back
    assert capped.held() == {0: GIB}
    assert proc.call(f"{op} {DEV:#x} {RS_UNIQUE_HANDLE_BASE + 3:#x} {RS_UNIQUE_HANDLE_BASE:#x}") == ENOTTY  # chosen
    assert heap(proc, GIB) == LET_THROUGH  # 0xcaf00004: the driver skips the handle in use
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE + 4:#x}") == ENOTTY
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE:#x}") == ENOTTY
    assert capped.held() == {0: GIB}  # the original freed, but its copy keeps the memory: still charged
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE + 3:#x}") == ENOTTY
    assert capped.held() == {}


@needs_notify
def test_rm_alloc_memory_is_followed_for_its_handle_and_charges_nothing(capped: Served) -> None:
    """RM_ALLOC_MEMORY (0x27), the older allocation path: for NV01_MEMORY_LOCAL_USER the driver ignores the size
    asked and allocates nothing from the heap, so nothing is charged; its driver-picked handle takes its turn in
    the replay (without it followed, the heap allocation after it got its handle)."""
    proc = capped.proc
    assert amem(proc, 0x10, 64 * GIB) == LET_THROUGH
    assert capped.held() == {}
    assert heap(proc, GIB) == LET_THROUGH  # 0xcaf00000
    assert amem(proc, 0, GIB) == LET_THROUGH  # 0xcaf00001
    assert heap(proc, GIB) == LET_THROUGH  # 0xcaf00002
    assert proc.call(f"free {RS_UNIQUE_HANDLE_BASE + 2:#x}") == ENOTTY
    assert capped.held() == {0: GIB}


@needs_notify
def test_dup_then_free_of_the_original_does_not_escape_the_cap(capped: Served) -> None:
    """Allocate, RM_DUP_OBJECT it, free the original, again and again: the driver keeps each allocation's memory
    for its copy, so the cap must too (without the copies followed, each free gave its GiB back and the loop held
    any amount under a 4 GiB cap)."""
    proc = capped.proc
    for i in range(4):
        assert mem(proc, 0x10 + i, GIB) == LET_THROUGH
        assert proc.call(f"dup {DEV:#x} {0x40 + i:#x} {0x10 + i:#x}") == ENOTTY
        assert proc.call(f"free {0x10 + i:#x}") == ENOTTY
    assert capped.held() == {0: 4 * GIB}
    assert mem(proc, 0x20, GIB) == REFUSED
    assert proc.call(f"free {0x41:#x}") == ENOTTY  # a copy's free, the last handle of its memory: given back
    assert capped.held() == {0: 3 * GIB}


@needs_notify
def test_counts_are_exact_across_threads() -> None:
    served = Served({"t": MemoryTerms(cap=5 * GIB)})
    try:
        served.proc.send(f"threads_mem 8 {DEV:#x} {GIB} 0x100")
        assert served.proc.line().split()[2] == "5"  # exactly 5 of 8 concurrent 1 GiB allocations fit
        assert served.held() == {0: 5 * GIB}
    finally:
        served.close()


@needs_notify
def test_a_forked_child_s_memory_goes_with_it_and_the_tenant_s_with_the_last_process() -> None:
    served = Served({"t": MemoryTerms(cap=8 * GIB)})
    try:
        assert mem(served.proc, 0x10, GIB) == LET_THROUGH
        served.proc.send(f"fork_mem 0 {2 * GIB} {ROOT + 1:#x}")
        _, err, _child = served.proc.line().split()
        assert int(err) == ENOTTY  # let through to the "driver" in the child, counted, then the child exited
        wait_for(lambda: served.held() == {0: GIB}, "the exited child's 2 GiB to be given back")
        served.proc.send("exit")
        assert served.proc.popen.wait(10) == 0
        served.thread.join(10)
        assert served.held() == {}
    finally:
        served.close()


@needs_notify
@pytest.mark.parametrize("how", [0, 1, 2])  # (seccomp_child.unreadable_call)
def test_a_call_whose_memory_the_daemon_cannot_read_fails_with_efault(how: int) -> None:
    """An RM call whose argument, or whose video memory parameters, the daemon cannot read is failed with EFAULT,
    not let through: the driver may read what the daemon cannot (memfd_secret's memory, mapped in the caller) and
    hold bytes the book never saw. An unmapped page stands in where the driver could not read it either."""
    served = Served({"t": MemoryTerms(cap=GIB)})
    try:
        served.proc.send(f"unreadable {how}")
        err = int(served.proc.line().split()[1])
        if how == 2 and err == errno.ENOSYS:
            pytest.skip("no memfd_secret here (CONFIG_SECRETMEM)")
        assert err == errno.EFAULT  # (let through, /dev/null answers ENOTTY)
        assert mem(served.proc, 0x10, GIB) == LET_THROUGH  # and the tenant goes on, its 1 GiB not taken
        assert served.held() == {0: GIB}
    finally:
        served.close()


@needs_notify
def test_two_listeners_of_one_tenant_share_its_cap() -> None:
    ledger = MemoryLedger(lambda: {"t": MemoryTerms(cap=3 * GIB)})
    first, second = Served({}, ledger=ledger), Served({}, ledger=ledger)
    try:
        assert mem(first.proc, 0x10, 2 * GIB) == LET_THROUGH
        assert mem(second.proc, 0x10, 2 * GIB) == REFUSED  # same handle, other process: a separate object
        assert mem(second.proc, 0x11, GIB) == LET_THROUGH
        assert ledger.of("t").held == {0: 3 * GIB}
    finally:
        first.close()
        second.close()


@needs_notify
def test_reserves_of_others_are_kept() -> None:
    ledger = MemoryLedger(lambda: {"t": MemoryTerms(), "gamer": MemoryTerms(reserve=6 * GIB)}, lambda: {0: 10 * GIB})
    served = Served({}, ledger=ledger)
    try:
        assert mem(served.proc, 0x10, 4 * GIB) == LET_THROUGH
        assert mem(served.proc, 0x11, 1) == REFUSED  # the other 6 GiB are the gamer's, used or not
        assert ledger.charge("gamer", 0, 6 * GIB) is Verdict.ADMIT
    finally:
        served.close()


# --- the engine: reserves at set-limit and at start, what tenants/metrics show ----------------------------------------
def _rig(tmp_path: Path, tenants: tuple[DeclaredTenant, ...] = ()) -> Rig:
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 10 * GIB)])
    return Rig(tmp_path, DaemonConfig(slice_ms=50, tenants=tenants), telemetry=tel)


def test_a_reserve_that_does_not_fit_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    rig = _rig(tmp_path)
    rig.add("game", 100)
    rig.add("train", 100)
    rig.engine.set_limits("game", None, None, None, None, 6 * GIB)
    with pytest.raises(SchedulerError, match=r"memory reserve 5.00 GiB of tenant 'train' does not fit on GPU 0: it has "
                                          r"10.00 GiB and other tenants reserve 6.00 GiB there \(game 6.00 GiB\)"):
        rig.engine.set_limits("train", None, None, None, None, 5 * GIB)
    assert rig.engine.snapshot("train").memory_reserve is None
    rig.engine.set_limits("train", None, None, None, None, 4 * GIB)  # fits exactly
    rig.engine.set_limits("game", None, None, None, None, 6 * GIB)  # a tenant's own old reserve is not counted twice
    assert rig.engine.memory_terms()["game"] == MemoryTerms(reserve=6 * GIB)
    with pytest.raises(SchedulerError, match="exceeds the tenant's memory cap"):
        rig.engine.set_limits("game", None, None, None, 4 * GIB)


def test_memory_terms_hold_the_tenants_with_terms_and_follow_every_change(tmp_path: Path) -> None:
    """The hooks read the terms on every allocation: they are kept, not gathered from every tenant each time, so
    each way a tenant's cap, reserve or GPUs change must show in them at once."""
    rig = _rig(tmp_path)
    terms = rig.engine.memory_terms
    rig.add("plain", 100)
    assert terms() == {}
    rig.engine.register("game", 100, None, (), (), 2001, 0, True, memory=MemoryAsk(cap=4 * GIB, reserve=2 * GIB))
    assert terms() == {"game": MemoryTerms(cap=4 * GIB, reserve=2 * GIB)}
    before = terms()
    rig.engine.set_weight("game", 300)  # no term changed: the same mapping
    rig.engine.register("game", None, None, (), (), 2002, 0, True)  # a plain rejoin
    assert terms() is before
    rig.engine.set_limits("plain", None, None, None, 3 * GIB)
    assert terms() == {"game": MemoryTerms(cap=4 * GIB, reserve=2 * GIB), "plain": MemoryTerms(cap=3 * GIB)}
    assert before == {"game": MemoryTerms(cap=4 * GIB, reserve=2 * GIB)}  # replaced, not changed under a reader
    rig.engine.register("game", None, None, (), (0,), 2003, 0, True)  # its owner pins it to GPU 0
    assert terms()["game"] == MemoryTerms(cap=4 * GIB, reserve=2 * GIB, gpus=frozenset({0}))
    rig.engine.set_limits("plain", None, None, None, CLEAR)
    assert set(terms()) == {"game"}
    rig.engine.remove("game")
    assert terms() == {}


def test_a_declared_tenant_whose_reserve_does_not_fit_is_not_created(tmp_path: Path) -> None:
    limits = (SessionLimits(memory_reserve=6 * GIB), SessionLimits(memory_reserve=5 * GIB))
    declared = tuple(DeclaredTenant(n, 100, Priority.OFFLINE, frozenset({Engine.COMPUTE}), limits=lim)
                     for n, lim in zip(("a", "b"), limits, strict=True))
    rig = _rig(tmp_path, declared)
    assert [s.name for s in rig.engine.snapshots()] == ["a"]


def test_tenants_and_metrics_show_exact_use_cap_and_reserve_per_gpu(tmp_path: Path) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from unisched.transport.convert import snapshot_to_pb
    from unisched.transport.metrics import _Families, _tenant_metrics

    rig = _rig(tmp_path)
    rig.add("game", 100)
    rig.engine.memory_ledger = MemoryLedger(rig.engine.memory_terms, rig.engine.gpu_memory_totals)
    rig.engine.set_limits("game", None, None, None, 4 * GIB, 2 * GIB)
    assert rig.engine.memory_ledger.charge("game", 0, 3 * GIB) is Verdict.ADMIT
    assert rig.engine.memory_ledger.charge("game", 0, 2 * GIB) is Verdict.CAP
    snap = rig.engine.snapshot("game")
    assert snap.gpu_memory == (GpuMemory(gpu=0, used=3 * GIB, cap=4 * GIB, reserve=2 * GIB, refused=1),)
    pb_t = snapshot_to_pb(snap)
    assert (pb_t.gpu_memory[0].used_bytes, pb_t.gpu_memory[0].cap_bytes, pb_t.caps.memory_reserve) == (3 * GIB, 4 * GIB, 2 * GIB)

    class One:
        def collect(self) -> object:
            out = _Families()
            _tenant_metrics(out, [snap], {0: "GPU-x"})
            return out.families()

    registry = CollectorRegistry()
    registry.register(One())  # type: ignore[arg-type]
    series = dict(line.rsplit(" ", 1) for line in generate_latest(registry).decode().splitlines() if line[0] != "#")
    labels = '{UUID="GPU-x",container="",gpu="0",namespace="",pod="",tenant="game"}'
    assert float(series["unisched_tenant_memory_used_bytes" + labels]) == 3 * GIB
    assert float(series["unisched_tenant_memory_reserve_bytes" + labels]) == 2 * GIB
    assert float(series["unisched_tenant_memory_refusals_total" + labels]) == 1
