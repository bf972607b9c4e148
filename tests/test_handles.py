"""The driver's handle choice, replayed per RM client (enforce/seccomp/handles.py): table tests, and the replay
of every RM call an EGL app made on the H200 (driver 580), whose frees must each meet the allocation they free."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from unisched.enforce.seccomp.calls import Call, decode_call
from unisched.enforce.seccomp.handles import RS_UNIQUE_HANDLE_BASE, Budget, HandleReplay, Made, in_driver_range
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.memory import MAX_CLIENTS, UNKNOWN_GPU, MemoryBook, Unbooked
from unisched.enforce.seccomp.memory_calls import MemoryCalls
from unisched.policy.memory import MemoryTerms

BASE = RS_UNIQUE_HANDLE_BASE
TRACE = Path(__file__).parent / "data" / "h200_egl_rm_calls.jsonl"
"""The egl workload of bench/gpu_memory_probe.py on the H200: every RM_ALLOC (0x2b), NVOS32 heap call (0x4a) and
RM_FREE (0x29) it made, in order (root, parent, new handle, class; heap function and bytes; freed handle)."""


def test_the_driver_counts_up_from_its_base_per_client() -> None:
    replay = HandleReplay()
    assert [replay.take(parent=1) for _ in range(3)] == [BASE, BASE + 1, BASE + 2]
    assert HandleReplay().take(parent=1) == BASE  # another client starts again


def test_handles_in_use_are_skipped_as_the_driver_skips_them() -> None:
    replay = HandleReplay()
    replay.note(BASE + 1, parent=1)  # the caller chose a handle in the driver's range
    replay.note(0x1234, parent=1)  # outside it: no effect
    assert [replay.take(1), replay.take(1)] == [BASE, BASE + 2]


def test_a_call_that_never_ran_gives_its_handle_back() -> None:
    replay = HandleReplay()
    first = replay.take(1)
    assert first is not None
    replay.untake(first)
    assert replay.take(1) == BASE


def test_a_free_of_a_handle_never_given_out_means_the_replay_is_lost() -> None:
    replay = HandleReplay()
    assert replay.take(1) == BASE
    replay.free(BASE)
    replay.free(0x1234)  # a caller's own handle: no say
    assert not replay.lost
    replay.free(BASE)  # freed twice, or made by a call the hooks did not see
    assert replay.lost and replay.take(1) is None


def test_children_go_with_their_parent_at_any_depth() -> None:
    replay = HandleReplay()
    a = replay.take(parent=0xD0)
    b = replay.take(parent=BASE)  # under a
    c = replay.take(parent=0xD1)
    replay.drop_under({0xD0})
    assert (a, b, c) == (BASE, BASE + 1, BASE + 2)
    replay.free(BASE + 2)
    assert not replay.lost
    replay.free(BASE + 1)  # went with its grandparent's device: freeing it again is a replay gone wrong
    assert replay.lost


def test_tracking_is_bounded_by_a_budget_the_replays_share() -> None:
    """A caller names any handle: past the budget its replays share, the one that finds it spent is lost, and gives its
    handles back (so do a closed replay's)."""
    budget = Budget(3)
    a, b = HandleReplay(budget), HandleReplay(budget)
    a.take(1)
    a.note(BASE + 100, 1)
    assert b.take(1) == BASE and budget.left == 0
    assert a.take(1) is None and a.lost and budget.left == 2
    assert b.take(1) == BASE + 1 and not b.lost
    b.close()
    assert budget.left == 3


def test_the_clients_booked_are_bounded() -> None:
    """Any call names an hRoot: past MAX_CLIENTS a new client is not booked (neither replayed nor given memory), and
    the clients already booked go on."""
    book, owner = MemoryBook(), (1, "1")
    for root in range(MAX_CLIENTS):
        assert book.add(root + 1, 0, 0xD0, 1, owner)[1] == BASE
    assert book.unbooked(MAX_CLIENTS + 1, 0, 0xD0, owner) is Unbooked.CLIENT
    assert book.handle_for(MAX_CLIENTS + 1, 0, 0xD0, owner) < 0
    assert book.add(1, 0, 0xD0, 1, owner)[1] == BASE + 1


def test_every_driver_range_free_of_the_h200_egl_trace_meets_its_allocation() -> None:
    book, owner = MemoryBook(), (1, "1")
    matched, heap_allocs, frees_in_range, given_back = 0, 0, 0, 0
    for line in TRACE.read_text().splitlines():
        call = json.loads(line)
        root = int(call["root"], 16)
        if call["esc"] == "0x2b" and int(call["cls"], 16) not in (0x0, 0x1, 0x41):
            book.handle_for(root, int(call["new"], 16), int(call["parent"], 16), owner)
        elif call["esc"] == "0x4a" and call["function"] == 2:
            heap_allocs += 1
            book.add(root, 0, 0xD0, call["bytes"], owner)
        elif call["esc"] == "0x29":
            handle = int(call["free"], 16)
            freed = book.free(root, handle)
            given_back += len(freed)
            if in_driver_range(handle):
                frees_in_range += 1
                matched += freed != []
            assert not book.lost(root), f"replay lost at the free of {handle:#x} in client {root:#x}"
    assert heap_allocs == 85 and frees_in_range == matched == 38
    assert given_back == heap_allocs  # the rest went with their RM clients' frees at the end


class _NotWalked(dict[int, int]):
    """Live handles that fail a test when walked whole (a free must walk its own subtree only)."""

    def items(self):  # type: ignore[no-untyped-def,override]
        raise AssertionError("walked every live handle")

    __iter__ = keys = values = items  # type: ignore[assignment]


def test_freeing_a_parent_walks_its_subtree_not_every_live_handle() -> None:
    """A tenant may hold ~200,000 live handles and free a device beside them in a loop: each free must cost what
    was under it, not all the book holds (that held the daemon's interpreter ~9 ms a free)."""
    replay = HandleReplay()
    for _ in range(1000):
        replay.take(0x1)
    device = replay.take(0x1)
    assert device is not None
    below = [replay.take(device) for _ in range(3)]
    deeper = replay.take(below[0])  # type: ignore[arg-type]
    replay._live = _NotWalked(replay._live)
    replay.drop_under({device})
    assert all(h not in replay._live for h in (*below, deeper)) and device in replay._live
    assert dict.__len__(replay._live) == 1001


GROUP, CHANNEL, DEVICE = 0xA06C, 0xC86F, 0xD0  # KEPLER_CHANNEL_GROUP_A, HOPPER_CHANNEL_GPFIFO_A


def test_the_children_the_driver_makes_inside_channel_allocations_take_handles() -> None:
    """kernel_channel_group_api.c and kernel_channel.c: a group makes its graphics context; a channel under the device
    is wrapped in a group of the driver's (its context, two legacy context shares); the first channel of a group
    without a context share makes the group's two legacy shares; a channel with one makes nothing."""
    replay = HandleReplay()
    assert replay.made(GROUP, 0x100, DEVICE, 0, True).taken == (BASE,)
    assert replay.made(GROUP, 0x110, DEVICE, 0, True).taken == (BASE + 1,)
    assert replay.made(CHANNEL, 0x101, 0x100, 0x200, False).taken == ()  # its own context share
    assert replay.made(CHANNEL, 0x111, 0x110, 0, False).taken == (BASE + 2, BASE + 3)  # the group goes legacy
    assert replay.made(CHANNEL, 0x112, 0x110, 0, False).taken == ()  # once
    assert replay.made(CHANNEL, 0x104, DEVICE, 0, True).taken == (BASE + 4, BASE + 5, BASE + 6, BASE + 7)
    assert replay.made(0x40, 0x107, DEVICE, 0, True).taken == ()  # not a channel nor a group
    # 0x100's channel with its own share gone, one without makes the legacy shares: the driver's rule against mixing
    # holds only while the group has channels (kernel_channel.c), and legacy is for good (no share, no more shares)
    assert replay.made(CHANNEL, 0x102, 0x100, 0, False).taken == (BASE + 8, BASE + 9)
    assert replay.made(CHANNEL, 0x103, 0x100, 0x200, False).taken == ()
    assert replay.take(DEVICE) == BASE + 10


@pytest.mark.parametrize(("h_class", "handle", "parent", "context_share", "why"), [
    (GROUP, 0x120, 0xBAD, 0, "a group under no device seen made"),
    (GROUP, 0x100, DEVICE, 0, "a group handle in use"),
    (CHANNEL, 0x121, 0xBAD, 0, "a channel under neither a device nor a group"),
    (CHANNEL, 0x122, DEVICE, 0x200, "a context share outside a group"),
    (CHANNEL, 0x123, DEVICE, None, "no parameters"),
    (CHANNEL, 0x125, 0x110, 0x200, "a context share in a legacy group"),
])
def test_what_the_driver_refuses_before_it_makes_anything_takes_nothing(
        h_class: int, handle: int, parent: int, context_share: int | None, why: str) -> None:
    """Taken anyway, the replay would run ahead of the driver: each later texture booked above the handle the
    driver gave it, and a free of the booked one (never the driver's) would give its bytes back."""
    replay = HandleReplay()
    replay.made(GROUP, 0x100, DEVICE, 0, True)
    replay.made(CHANNEL, 0x101, 0x100, 0x200, False)  # 0x100's channels have their own context shares
    replay.made(GROUP, 0x110, DEVICE, 0, True)
    replay.made(CHANNEL, 0x111, 0x110, 0, False)  # 0x110 is legacy
    assert replay.made(h_class, handle, parent, context_share, parent == DEVICE) == Made(), why
    assert replay.take(DEVICE) == BASE + 4, why


def test_a_channel_group_made_by_a_driver_picked_allocation_follows_its_own_handle() -> None:
    replay = HandleReplay()
    group = replay.take(DEVICE)
    assert group == BASE and replay.made(GROUP, group, DEVICE, 0, True).taken == (BASE + 1,)
    channel = replay.take(group)
    assert channel == BASE + 2 and replay.made(CHANNEL, channel, group, 0, False).taken == (BASE + 3, BASE + 4)


def test_an_allocation_that_never_ran_gives_its_children_back() -> None:
    replay = HandleReplay()
    group = replay.made(GROUP, 0x100, DEVICE, 0, True)
    legacy = replay.made(CHANNEL, 0x101, 0x100, 0, False)
    replay.unmade(legacy)
    assert replay.made(CHANNEL, 0x101, 0x100, 0, False) == legacy  # the group is not legacy yet: the same handles again
    replay.unmade(legacy)
    replay.unmade(group)
    assert replay.made(CHANNEL, 0x102, 0x100, 0, False) == Made()  # no group of that handle any more: refused
    bare = replay.made(CHANNEL, 0x102, DEVICE, 0, True)
    assert bare.taken == (BASE, BASE + 1, BASE + 2, BASE + 3)  # every handle the undone calls took, given back


def test_a_free_takes_the_children_the_driver_made_with_it() -> None:
    budget = Budget(100)
    replay = HandleReplay(budget)
    replay.made(GROUP, 0x100, DEVICE, 0, True)
    replay.made(CHANNEL, 0x101, 0x100, 0, False)
    replay.made(CHANNEL, 0x102, DEVICE, 0, True)
    assert budget.left == 100 - 7 - 2 - 2  # seven handles, two groups, and the caller's group and channel recorded
    replay.free(0x102)  # the channel: its group, and that group's context and shares
    replay.free(0x100)  # a caller's group: its context and legacy shares
    assert budget.left == 100 and not replay.lost
    replay.free(BASE + 3)  # went with its channel
    assert replay.lost


def test_groups_are_bounded_by_the_budget_even_when_their_children_are_freed() -> None:
    """A caller can free a group's context by its handle and make groups on and on: each recorded group (and the
    caller's handle it is recorded under) takes from the budget itself, so the book of groups stays bounded."""
    budget = Budget(10)
    replay = HandleReplay(budget)
    for i in range(4):
        replay.free(replay.made(GROUP, 0x100 + i, DEVICE, 0, True).taken[0])
    assert not replay.lost and budget.left == 2  # four groups, each with its record and no child left
    assert replay.made(GROUP, 0x200, DEVICE, 0, True) == Made() and replay.lost and budget.left == 10


def test_freeing_the_device_gives_back_what_its_channels_and_groups_took() -> None:
    """The driver frees a device's groups and channels with it, and their children: the replay walks from the device
    through the caller's own group and channel handles to the handles the driver made under them."""
    budget = Budget(100)
    replay = HandleReplay(budget)
    replay.made(GROUP, 0x100, DEVICE, 0, True)
    replay.made(CHANNEL, 0x101, 0x100, 0, False)
    replay.made(CHANNEL, 0x102, DEVICE, 0, True)
    assert budget.left < 100
    replay.drop_under({DEVICE})
    assert budget.left == 100 and not replay.lost


def test_a_channel_call_that_never_reached_the_driver_gives_its_children_back() -> None:
    """MemoryCalls.unbook_call (the caller was gone before the answer): the channel's own handle and the handles the
    driver would have given its group, context and shares go back, so the next allocation gets the right one."""
    calls = MemoryCalls("t", MemoryLedger(lambda: {"t": MemoryTerms()}), _Answered(), lambda *_: None)  # type: ignore[arg-type]
    root = 0xC1D00001

    def book(esc: int, size: int, args: bytes, params: bytes = b"") -> Call:
        call = decode_call(esc, size, ARGS, _reader(args, params))
        call.owner = (1, "1")
        calls.book_call(call, refused=False)
        return call

    book(0x2B, 48, struct.pack("=IIIIQQIII4x", root, root, DEVICE, 0x80, 0, 0, 0, 0, 0))
    channel = struct.pack("=IIIIQQIII4x", root, DEVICE, 0, CHANNEL, PARAMS, 0, 0, 0, 0)
    gone = book(0x2B, 48, channel, bytes(64))
    assert gone.replayed == BASE and gone.made.taken == (BASE + 1, BASE + 2, BASE + 3, BASE + 4)
    calls.unbook_call(gone)
    again = book(0x2B, 48, channel, bytes(64))
    assert again.replayed == BASE and again.made == gone.made


H100_PLAYER = Path(__file__).parent / "data" / "h100_egl_player_rm_calls.jsonl"
"""One cloud-gaming player (examples/cloud_gaming.py, 640x360: EGL render, read-back, libx264) for 30 s on an H100
(driver 580), its NVIDIA escapes logged by an LD_PRELOAD shim around ioctl: every call the memory hooks follow, in
order, with the handle the driver gave (`got`) where it picked one, and the channels' hContextShare (`ctx`)."""


ARGS, PARAMS = 0x1000, 0x8000  # where the recorded call's argument and its parameters sit in the fake memory


class _Answered:
    def answer(self, nid: int, value: int) -> bool:
        return True


def _as_bytes(call: dict[str, Any]) -> tuple[int, int, bytes, bytes]:
    """(escape, size, argument, parameters) of one recorded call, as the tenant's memory held them."""
    h = {k: int(v, 16) for k, v in call.items() if isinstance(v, str) and k != "esc"}
    esc = int(call["esc"], 16)
    if esc == 0x2B:
        params = bytearray(128)
        struct.pack_into("=I", params, 24, h.get("ctx", 0))
        head = struct.pack("=IIIIQQIII4x", h["root"], h["parent"], h["new"], h["cls"], PARAMS, 0, 0, 0, 0)
        return esc, 48, head, bytes(params)
    if esc == 0x28:
        return esc, 20, struct.pack("=IIIII", h["root"], h["parent"], h["new"], h["cls"], 0), b""
    if esc == 0x27:
        return esc, 56, struct.pack("=IIIII4xQQII4x", h["root"], h["parent"], h["new"], h["cls"], 0, 0, 0, 0, 3), b""
    if esc == 0x29:
        return esc, 16, struct.pack("=IIII", h["root"], h["root"], h["free"], 0), b""
    if esc == 0x34:
        return esc, 28, struct.pack("=IIIIIII", h["root"], h["parent"], h["new"], h["src_root"], h["src"], 0, 0), b""
    args = bytearray(184)
    struct.pack_into("=III", args, 0, h["root"], h["parent"], call["function"])
    if call["function"] == 2:
        struct.pack_into("=II", args, 44, h["handle"], 0)
        struct.pack_into("=II", args, 52, h["flags"], h["attr"])
        struct.pack_into("=Q", args, 88, call["bytes"])
    else:
        struct.pack_into("=IIII", args, 40, *(int(w, 16) for w in call["words"]))
    return esc, 184, bytes(args), b""


def _reader(args: bytes, params: bytes) -> Callable[[int, int], bytes]:
    def read(addr: int, n: int) -> bytes:
        for base, data in ((ARGS, args), (PARAMS, params)):
            if base <= addr and addr + n <= base + len(data):
                return data[addr - base:addr - base + n]
        raise OSError("unmapped")
    return read


def test_every_handle_the_driver_picked_for_an_h100_egl_player_is_the_one_replayed() -> None:
    """Through the hooks' own decoding and booking (calls.decode_call, MemoryCalls): each driver-picked handle is
    the one the driver gave, each free meets its allocation, and no client is lost. Without the channels' children
    replayed, its textures were booked ten handles low and its EGL client was lost at its first free above them."""
    ledger = MemoryLedger(lambda: {"t": MemoryTerms()})
    calls = MemoryCalls("t", ledger, _Answered(), lambda *_: None)  # type: ignore[arg-type]
    checked = lost = 0
    for line in H100_PLAYER.read_text().splitlines():
        recorded = json.loads(line)
        esc, size, args, params = _as_bytes(recorded)
        call = decode_call(esc, size, ARGS, _reader(args, params))
        call.owner = (1, "1")
        if call.mem_bytes is not None:
            calls.conclude(1, 1, call)
        else:
            calls.book_call(call, refused=False)
        if "got" in recorded:
            got = int(recorded["got"], 16)
            booked = calls.book.gpu_held((call.h_root, got)) != UNKNOWN_GPU
            assert booked or call.replayed == got, f"{recorded}: replayed {call.replayed:#x}"
            checked += 1
        lost += any(calls.book.lost(root) for root in calls.book.owners())
    assert checked == 45 and lost == 0
    calls.release_all()
    assert ledger.of("t").held == {}
