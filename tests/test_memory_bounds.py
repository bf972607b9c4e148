"""The memory book's bounds (enforce/seccomp/memory.py) against a tenant that makes up RM calls without end.

Every field of an RM call is the caller's to write and the driver's refusal of a made-up one is never seen, so a
flood of fake RM_ALLOCs (any hRoot, handle, device class or memory class) must leave the root daemon's book at its
bounds, refuse what it cannot record instead of admitting it uncounted, keep caps exact for the honest, and drop
everything a process booked when it exits. Driven through MemoryCalls (what the supervisor calls) with a fake
listener standing in for the kernel's answers: these are tests of the book-keeping, the real path is test_memory.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

import structlog
import structlog.testing

from unisched.enforce.nvclasses import (
    NV0080_MAX_DEVICES,
    NV01_DEVICE_0,
    NV20_SUBDEVICE_0,
    RM_ALLOC,
    RM_DUP_OBJECT,
    RM_FREE,
)
from unisched.enforce.seccomp.allowance import Allowance, Share
from unisched.enforce.seccomp.calls import Call
from unisched.enforce.seccomp.handles import RS_UNIQUE_HANDLE_BASE, Budget, HandleReplay
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.listener import Listener
from unisched.enforce.seccomp.memory import (
    MAX_CLIENTS,
    MAX_DEVICES,
    MAX_LIVE,
    MAX_OBJECTS,
    UNKNOWN_GPU,
    BookBounds,
    BookSize,
    MemoryBook,
    Unbooked,
)
from unisched.enforce.seccomp.memory_calls import REFUSAL_LOG_INTERVAL_S, MemoryCalls
from unisched.logs import Throttle
from unisched.policy.memory import MemoryTerms

MIB = 1 << 20
HOSTILE, HONEST = (666, "1"), (777, "2")
ROOT = 0xC1D00001  # the honest process's RM client
DEV = 0xD0
SMALL = BookBounds(clients=8, devices=16, objects=32, live=64)


@dataclass
class FakeListener:
    """The kernel's side of the answers: every caller is still there; what was refused (ran False) is kept."""

    refused: list[int] = field(default_factory=list)

    def answer(self, nid: int, error: int, *, run: bool = True) -> bool:
        if not run:
            self.refused.append(nid)
        return True

    def write_status(self, nid: int, pid: int, status_at: int) -> bool:
        return True


def served(tenant: str, ledger: MemoryLedger, bounds: BookBounds = SMALL,
           allowance: Allowance | None = None) -> tuple[MemoryCalls, FakeListener]:
    """One listener's memory side; `allowance`: its tenant's, shared with the tenant's other listeners."""
    listener = FakeListener()
    calls = MemoryCalls(tenant, ledger, cast(Listener, listener), lambda key, message: None)
    calls.book = MemoryBook(bounds, Share(allowance))
    return calls, listener


def alloc(calls: MemoryCalls, root: int, handle: int, nbytes: int, owner: tuple[int, str], parent: int = DEV) -> bool:
    """A video memory allocation; whether it was admitted (every refusal is counted in the ledger)."""
    assert calls.ledger is not None
    before = sum(calls.ledger.of(calls.tenant).refused.values())
    calls.conclude(1, 1, Call(RM_ALLOC, root, parent, handle, 0x40, owner=owner, mem_bytes=nbytes))
    return sum(calls.ledger.of(calls.tenant).refused.values()) == before


def device(calls: MemoryCalls, root: int, handle: int, owner: tuple[int, str], gpu: int = 0) -> None:
    calls.book_call(Call(RM_ALLOC, root, root, handle, NV01_DEVICE_0, owner=owner, device_id=gpu), refused=False)


def flood(calls: MemoryCalls, n: int) -> None:
    """A process's made-up calls: new clients, devices, subdevices, driver-range handles and memory, n of each."""
    for i in range(n):
        root = 0x9000_0000 + i
        device(calls, root, DEV, HOSTILE, gpu=i)  # deviceIds the driver refuses too
        calls.book_call(Call(RM_ALLOC, ROOT + 1, DEV, 0x5000 + i, NV20_SUBDEVICE_0, owner=HOSTILE), refused=False)
        calls.book_call(Call(RM_ALLOC, ROOT + 1, 0x77, RS_UNIQUE_HANDLE_BASE + i, 0x3E, owner=HOSTILE), refused=False)
        calls.book_call(Call(RM_ALLOC, ROOT + 1, 0x77, 0, 0x3E, owner=HOSTILE), refused=False)
        alloc(calls, root, 0x100 + i, 1, HOSTILE)
        alloc(calls, ROOT + 1, 0x10_0000 + i, 1, HOSTILE)
        alloc(calls, ROOT + 1, 0, 1, HOSTILE)


def test_a_flood_of_made_up_calls_leaves_the_book_at_its_bounds() -> None:
    ledger = MemoryLedger(lambda: {})
    calls, _ = served("t", ledger, BookBounds())
    device(calls, ROOT + 1, DEV, HOSTILE)
    flood(calls, MAX_CLIENTS + 50)
    assert calls.book.size().clients == MAX_CLIENTS
    for i in range(MAX_DEVICES):  # subdevices of a booked client
        calls.book_call(Call(RM_ALLOC, ROOT + 1, DEV, 0x6000 + i, NV20_SUBDEVICE_0, owner=HOSTILE), refused=False)
    for i in range(MAX_OBJECTS + 10):
        alloc(calls, ROOT + 1, 0x20_0000 + i, 1, HOSTILE)
    i = 0
    while calls.book.size().live < MAX_LIVE:  # the handles of booked clients, together
        calls.book.handle_for(ROOT + 1, RS_UNIQUE_HANDLE_BASE + 0x10000 + i, 0x77, HOSTILE)
        i += 1
    calls.book.handle_for(0x9000_0000, RS_UNIQUE_HANDLE_BASE, 0x77, HOSTILE)
    assert calls.book.lost(0x9000_0000)  # found the budget spent
    assert calls.book.size() == BookSize(MAX_CLIENTS, MAX_DEVICES, MAX_OBJECTS, MAX_LIVE)
    held = ledger.of("t").held
    assert sum(held.values()) == MAX_OBJECTS  # everything booked is charged, nothing more
    assert set(held) <= set(range(UNKNOWN_GPU, NV0080_MAX_DEVICES))  # made-up deviceIds added no GPUs


def test_an_honest_tenant_s_cap_holds_beside_a_flood_and_the_flooder_s_own_cap_too() -> None:
    terms = {"honest": MemoryTerms(cap=4 * MIB), "hostile": MemoryTerms(cap=4 * MIB)}
    ledger = MemoryLedger(lambda: terms)
    honest, _ = served("honest", ledger)
    hostile, refused = served("hostile", ledger)
    device(honest, ROOT, DEV, HONEST)
    device(hostile, ROOT + 1, DEV, HOSTILE)
    flood(hostile, 1000)
    size = hostile.book.size()
    assert (size.clients, size.devices, size.objects) == (SMALL.clients, SMALL.devices, SMALL.objects)
    assert size.live <= SMALL.live
    assert refused and sum(hostile.book.held().values()) == sum(ledger.of("hostile").held.values()) <= 4 * MIB
    assert not alloc(hostile, ROOT + 1, 0x7777, 1, HOSTILE)  # cannot be recorded: refused, not admitted uncounted
    assert ledger.of("hostile").refused[0] > 0
    for i in range(4):
        assert alloc(honest, ROOT, 0x10 + i, MIB, HONEST)
    assert not alloc(honest, ROOT, 0x20, 1, HONEST)  # its cap, exactly
    honest.book_call(Call(RM_FREE, ROOT, ROOT, 0x10), refused=False)
    assert ledger.of("honest").held == {0: 3 * MIB}
    assert alloc(honest, ROOT, 0x21, MIB, HONEST)


def test_a_process_s_exit_drops_all_it_booked_and_its_tenant_allocates_again() -> None:
    """What a flooding process booked goes with it (reconcile releases the clients of exited processes), so the
    same tenant's next process is booked and capped as if nothing happened."""
    ledger = MemoryLedger(lambda: {"t": MemoryTerms(cap=4 * MIB)})
    calls, _ = served("t", ledger)
    device(calls, ROOT + 1, DEV, HOSTILE)
    flood(calls, 1000)
    assert not alloc(calls, ROOT, 0x10, MIB, HONEST)  # book full: the honest process's first allocation waits
    gone = [root for root, owner in calls.book.owners().items() if owner == HOSTILE]
    calls.release(gone)
    assert calls.book.size() == BookSize(0, 0, 0, 0) and ledger.of("t").held == {}
    assert not calls.book._under and not calls.book._of_root  # its index went too
    device(calls, ROOT, DEV, HONEST)
    for _ in range(4):
        assert alloc(calls, ROOT, 0, MIB, HONEST)  # driver-picked handles, replayed again
    assert not alloc(calls, ROOT, 0, 1, HONEST)
    assert calls.book.free(ROOT, RS_UNIQUE_HANDLE_BASE)[0].nbytes == MIB  # matched to its free


def test_memory_under_a_device_the_book_could_not_record_is_refused_not_counted_on_no_gpu() -> None:
    """Counted on UNKNOWN_GPU it would escape its real GPU's cap and the other tenants' reserves there."""
    ledger = MemoryLedger(lambda: {})
    calls, _ = served("t", ledger, BookBounds(devices=1))
    device(calls, ROOT, DEV, HONEST)
    device(calls, ROOT, DEV + 1, HONEST, gpu=1)  # no room
    assert alloc(calls, ROOT, 0x10, MIB, HONEST, parent=DEV)
    assert calls.book.unbooked(ROOT, 0x11, DEV + 1, HONEST) is Unbooked.DEVICE
    assert not alloc(calls, ROOT, 0x11, MIB, HONEST, parent=DEV + 1)
    assert ledger.of("t").held == {0: MIB} and ledger.of("t").refused == {UNKNOWN_GPU: 1}


def test_a_copy_of_booked_memory_past_the_bounds_is_refused_as_out_of_memory() -> None:
    """Admitted unbooked, a copy would keep the memory its original's free gives back: allocate, copy into a client
    the book has no room for, free the original, again and again, and no cap would hold."""
    ledger = MemoryLedger(lambda: {"t": MemoryTerms(cap=4 * MIB)})
    calls, listener = served("t", ledger, BookBounds(clients=1))
    device(calls, ROOT, DEV, HONEST)
    assert alloc(calls, ROOT, 0x10, 4 * MIB, HONEST)
    copy = Call(RM_DUP_OBJECT, ROOT + 1, ROOT + 1, 0x20, owner=HONEST, status_at=0x1000)
    copy.source = (ROOT, 0x10)
    assert calls.copy_refusal(copy) is Unbooked.CLIENT  # no room for a second client
    assert calls.refuse_copy(7, 1, copy, Unbooked.CLIENT) and listener.refused == [7]
    assert ledger.of("t").refused == {0: 1} and ledger.of("t").held == {0: 4 * MIB}
    inside = Call(RM_DUP_OBJECT, ROOT, DEV, 0x21, owner=HONEST)
    inside.source = (ROOT, 0x10)
    assert calls.copy_refusal(inside) is None  # room in its own client: recorded, sharing the bytes
    calls.book_call(inside, refused=False)
    calls.book_call(Call(RM_FREE, ROOT, DEV, 0x10), refused=False)
    assert ledger.of("t").held == {0: 4 * MIB}


def test_device_ids_the_driver_refuses_stand_for_no_gpu() -> None:
    """deviceId is below NV0080_MAX_DEVICES (32): made-up ones must not add GPUs to the ledger's keys."""
    calls, _ = served("t", MemoryLedger(lambda: {}))
    device(calls, ROOT, DEV, HONEST, gpu=31)
    device(calls, ROOT, DEV + 1, HONEST, gpu=1 << 31)
    assert calls.book.gpu_of(ROOT, DEV) == 31 and calls.book.gpu_of(ROOT, DEV + 1) == UNKNOWN_GPU


def test_a_client_whose_process_is_not_known_is_not_booked() -> None:
    """Its entries could never be dropped at an exit (owner (0, "") is what a failed /proc read gives)."""
    calls, _ = served("t", MemoryLedger(lambda: {}))
    device(calls, ROOT, DEV, (0, ""))
    assert calls.book.size().clients == 0
    assert not alloc(calls, ROOT, 0x10, MIB, (0, ""))


def test_a_deep_chain_of_driver_range_handles_is_dropped_in_one_pass() -> None:
    """A caller may chain its handles (each the parent of the next): freeing the top must not take a pass per level
    (50,000 levels took half a minute so)."""
    replay = HandleReplay(Budget(60_000))
    parent = DEV
    for i in range(50_000):
        replay.note(RS_UNIQUE_HANDLE_BASE + i, parent)
        parent = RS_UNIQUE_HANDLE_BASE + i
    t0 = time.monotonic()
    replay.drop_under({DEV})
    assert time.monotonic() - t0 < 5.0
    replay.free(RS_UNIQUE_HANDLE_BASE + 49_999)  # went with the chain: never given out now
    assert replay.lost


def test_allocations_refused_over_a_cap_log_one_info_line_a_second() -> None:
    """An app retrying past its cap in a loop must not fill the host's log; the ledger counts every refusal."""
    calls, _ = served("t", MemoryLedger(lambda: {"t": MemoryTerms(cap=MIB)}))
    now = [0.0]
    calls.refusal_log = Throttle(REFUSAL_LOG_INTERVAL_S, clock=lambda: now[0])
    device(calls, ROOT, DEV, HONEST)
    assert alloc(calls, ROOT, 0x10, MIB, HONEST)
    with structlog.testing.capture_logs() as logs:
        assert not any(alloc(calls, ROOT, 0x11 + i, MIB, HONEST) for i in range(20))
        now[0] += REFUSAL_LOG_INTERVAL_S
        assert not alloc(calls, ROOT, 0x40, MIB, HONEST)
    lines = [(e["log_level"], e["held_back"]) for e in logs if e["event"] == "gpu memory allocation refused"]
    assert [e for e in lines if e[0] == "info"] == [("info", 0), ("info", 19)] and len(lines) == 21
    assert calls.ledger is not None and calls.ledger.of("t").refused == {0: 21}


def test_freeing_devices_and_clients_in_a_loop_costs_what_they_held_not_the_book() -> None:
    """A device free or a client's exit touches only what it drops: found by scanning the book, each of these 400
    frees beside a full book (200,000 allocations) cost a pass over it, seconds in all, holding the interpreter and
    so the daemon's event loop."""
    book = MemoryBook(BookBounds())
    book.add_device(ROOT, DEV, NV01_DEVICE_0, ROOT, 0, HONEST)
    for i in range(MAX_OBJECTS - 1):  # room for one more
        book.add(ROOT, 0x10_0000 + i, DEV, 1, HONEST)
    t0 = time.monotonic()
    for i in range(200):
        root = 0x9000_0000 + i
        book.add_device(root, DEV, NV01_DEVICE_0, root, 0, HOSTILE)
        book.add(root, 0x42, DEV, 1, HOSTILE)
        assert [h.nbytes for h in book.free(root, DEV)] == [1]  # the device, and the memory under it
        book.add_device(root, DEV, NV01_DEVICE_0, root, 0, HOSTILE)
        assert book.free(root, root) == []  # the client itself
    assert time.monotonic() - t0 < 1.0
    size = book.size()
    assert (size.clients, size.devices, size.objects) == (1, 1, MAX_OBJECTS - 1)
    assert sum(h.nbytes for h in book.free(ROOT, DEV)) == MAX_OBJECTS - 1  # the honest device's memory, all of it


def test_the_last_room_taken_by_another_listener_during_a_charge_leaves_nothing_charged_for_ever() -> None:
    """Two listeners of one tenant share its allowance: while one charges an allocation whose room it asked for,
    the other books the last entry. The charge is booked all the same (the bound overshot by that one entry), so
    the listeners' end credits it; a charge booked nowhere would hold the GPU's memory in the ledger for ever."""
    from unisched.enforce.seccomp.allowance import Entry
    from unisched.enforce.seccomp.hooks import TENANT_BOUNDS

    ledger = MemoryLedger(lambda: {"t": MemoryTerms()}, lambda: {0: 100 << 30})
    allowance = Allowance("t", {**TENANT_BOUNDS, Entry.ALLOCATIONS: 2})
    (first, _), (second, _) = served("t", ledger, allowance=allowance), served("t", ledger, allowance=allowance)
    assert alloc(first, ROOT, 0x10, 0, HONEST)  # 1 of the tenant's 2 allocations
    charge = ledger.charge

    def another_listener_takes_the_last_room(tenant: str, gpu: int, nbytes: int) -> object:
        ledger.charge = charge  # type: ignore[method-assign]
        assert alloc(second, ROOT + 1, 0x20, 0, HONEST)  # 2 of 2
        return charge(tenant, gpu, nbytes)

    ledger.charge = another_listener_takes_the_last_room  # type: ignore[method-assign,assignment]
    assert alloc(first, ROOT, 0x30, 90 << 30, HONEST)
    assert ledger.of("t").held == {-1: 90 << 30} and allowance.used()[Entry.ALLOCATIONS] == 3
    first.release_all()
    second.release_all()
    assert ledger.of("t").held == {} and Entry.ALLOCATIONS not in allowance.used()
