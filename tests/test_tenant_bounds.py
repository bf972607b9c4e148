"""The hooks' books bounded per TENANT (enforce/seccomp/allowance.py, hooks.TENANT_BOUNDS), all its listeners together.

A tenant may have many listeners (hooked process groups), each with books bounded on their own, so a user starting
hooked runs could otherwise multiply what the root daemon holds by their number. Two listeners of one tenant must
together stop at the tenant's bound while each is under its own, refused as past a listener's own bound; another
tenant goes on; a listener that ends gives back all it held; hostile frees and exits never make the count drift.
Driven like test_memory_bounds.py (MemoryCalls, a fake listener) and test_session_bounds.py (the supervisor's own
handling of decoded calls), with their helpers.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
from collections.abc import Mapping

import pytest
import structlog.testing
from conftest import pipe_listeners
from test_memory_bounds import DEV, HONEST, HOSTILE, ROOT, SMALL, alloc, device, flood, served
from test_session_bounds import CHANNEL, COMPUTE, FLOOD, GRAPHICS, TID, Served, no_caps

from unisched.enforce.nvclasses import NV01_DEVICE_0, NV20_SUBDEVICE_0, RM_ALLOC, RM_FREE, SessionKind
from unisched.enforce.seccomp.accounting import (
    EventAction,
    SessionBook,
    SessionBounds,
    SessionLedger,
    SessionUnbooked,
)
from unisched.enforce.seccomp.allowance import Allowance, Entry, Share
from unisched.enforce.seccomp.calls import Call
from unisched.enforce.seccomp.handles import RS_UNIQUE_HANDLE_BASE
from unisched.enforce.seccomp.hooks import TENANT_BOUNDS, USER_BOUNDS, SupervisedHooks, listener_refusal
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.memory import BookBounds, MemoryBook, Unbooked
from unisched.enforce.seccomp.proc import owner


def tenant(name: str, **bounds: int) -> Allowance:
    """A tenant's allowance: TENANT_BOUNDS with some made small (keyword: the Entry's name, lower case)."""
    return Allowance(name, {kind: bounds.get(kind.name.lower(), n) for kind, n in TENANT_BOUNDS.items()})


def mirrors(allowance: Allowance, memory: list[MemoryBook], sessions: list[SessionBook]) -> dict[Entry, int]:
    """What the tenant's books hold together, by Entry; asserted equal to what the allowance counts."""
    mem = [b.size() for b in memory]
    ses = [b.size() for b in sessions]
    held = {
        Entry.MEMORY_CLIENTS: sum(s.clients for s in mem), Entry.DEVICES: sum(s.devices for s in mem),
        Entry.ALLOCATIONS: sum(s.objects for s in mem), Entry.HANDLES: sum(s.live for s in mem),
        Entry.SESSION_CLIENTS: sum(s.clients for s in ses), Entry.NODES: sum(s.nodes for s in ses),
        Entry.SESSION_OBJECTS: sum(s.objects for s in ses),
    }
    held = {k: n for k, n in held.items() if n}
    assert allowance.used() == held
    return held


# --- memory ------------------------------------------------------------------------------------------------------------
def test_two_listeners_of_a_tenant_stop_at_its_bound_of_allocations_and_another_tenant_goes_on() -> None:
    ledger = MemoryLedger(lambda: {})
    t, other = tenant("t", allocations=40), tenant("other", allocations=40)
    (a, _), (b, refused) = served("t", ledger, allowance=t), served("t", ledger, allowance=t)
    c, _ = served("other", ledger, allowance=other)
    for calls, root, who in ((a, ROOT, HONEST), (b, ROOT + 1, HOSTILE), (c, ROOT, HONEST)):
        device(calls, root, DEV, who)
    assert all(alloc(a, ROOT, 0x100 + i, 1, HONEST) for i in range(25))  # its own bound is 32
    assert all(alloc(b, ROOT + 1, 0x100 + i, 1, HOSTILE) for i in range(15))
    assert b.book.unbooked(ROOT + 1, 0x200, DEV, HOSTILE) is Unbooked.TENANT_OBJECTS
    with structlog.testing.capture_logs() as logs:
        assert not alloc(b, ROOT + 1, 0x200, 1, HOSTILE)  # 16 in b, 41 in the tenant: refused as past its own bound
    assert [e["why"] for e in logs if e["event"] == "gpu memory allocation refused"] == [Unbooked.TENANT_OBJECTS.value]
    assert refused and ledger.of("t").refused == {0: 1} and ledger.of("t").held == {0: 40}
    assert all(alloc(c, ROOT, 0x100 + i, 1, HONEST) for i in range(30))  # another tenant's are its own
    assert a.book.size().objects + b.book.size().objects == 40
    a.book_call(Call(RM_FREE, ROOT, ROOT, 0x100), refused=False)
    assert alloc(b, ROOT + 1, 0x200, 1, HOSTILE)  # a free in one listener makes room in the other
    mirrors(t, [a.book, b.book], [])


def test_two_listeners_flooding_hold_together_no_more_clients_devices_or_allocations_than_the_tenant() -> None:
    ledger = MemoryLedger(lambda: {})
    t = tenant("t", memory_clients=12, devices=20, allocations=40, handles=80)  # each listener's: SMALL (8, 16, 32, 64)
    (a, _), (b, _) = served("t", ledger, allowance=t), served("t", ledger, allowance=t)
    for calls in (a, b):
        device(calls, ROOT + 1, DEV, HOSTILE)
        flood(calls, 1000)
    held = mirrors(t, [a.book, b.book], [])
    assert (held[Entry.MEMORY_CLIENTS], held[Entry.DEVICES], held[Entry.ALLOCATIONS]) == (12, 20, 40)
    assert held.get(Entry.HANDLES, 0) <= 80
    assert a.book.size().clients == SMALL.clients and b.book.size().clients == 4  # a came first, b got the rest
    assert sum(ledger.of("t").held.values()) == 40  # everything booked is charged, nothing more
    assert b.book.unbooked(0x7000_0000, 0x10, DEV, HOSTILE) is Unbooked.TENANT_CLIENT


def test_two_listeners_replaying_handles_stop_at_the_tenant_s_bound_and_the_one_past_it_is_lost() -> None:
    t = tenant("t", handles=80)
    a, b = MemoryBook(SMALL, Share(t)), MemoryBook(SMALL, Share(t))  # 64 handles each
    for book, n in ((a, 50), (b, 30)):
        for _ in range(n):
            book.handle_for(ROOT, 0, DEV, HONEST)
    assert (a.size().live, b.size().live) == (50, 30) and not b.lost(ROOT)
    b.handle_for(ROOT, 0, DEV, HONEST)  # the tenant's 81st: b's replay is lost, as past its own budget
    assert b.lost(ROOT) and b.size().live == 0 and t.used() == {Entry.MEMORY_CLIENTS: 2, Entry.HANDLES: 50}
    assert a.free(ROOT, RS_UNIQUE_HANDLE_BASE) == [] and not a.lost(ROOT)  # a's replay goes on
    mirrors(t, [a, b], [])


def test_memory_under_a_device_the_tenant_had_no_room_for_is_refused_with_the_tenant_s_reason() -> None:
    ledger = MemoryLedger(lambda: {})
    t = tenant("t", devices=1)
    (a, _), (b, _) = served("t", ledger, allowance=t), served("t", ledger, allowance=t)
    device(a, ROOT, DEV, HONEST)
    device(b, ROOT, DEV, HONEST, gpu=1)  # the tenant's one device is a's
    assert b.book.unbooked(ROOT, 0x10, DEV, HONEST) is Unbooked.TENANT_DEVICE
    assert not alloc(b, ROOT, 0x10, 1, HONEST) and alloc(a, ROOT, 0x10, 1, HONEST)


# --- sessions ----------------------------------------------------------------------------------------------------------
def test_two_listeners_of_a_tenant_stop_at_its_bound_of_session_objects_and_another_tenant_goes_on() -> None:
    honest = owner(os.getpid())  # a process that lives on: its clients are recorded
    ledger = SessionLedger(no_caps)
    small = SessionBounds(clients=4, nodes=64, objects=8)
    t, other = tenant("t", session_objects=12), tenant("other", session_objects=12)
    a, b = Served("t", ledger, small, t), Served("t", ledger, small, t)
    c = Served("other", ledger, small, other)
    assert [a.alloc(ROOT, 0x10 + i, GRAPHICS, honest) for i in range(7)] == [0] * 7  # its own bound is 8
    assert [b.alloc(ROOT, 0x10 + i, GRAPHICS, honest) for i in range(5)] == [0] * 5
    assert b.book.unbooked(Call(RM_ALLOC, ROOT, ROOT, 0x20, GRAPHICS, SessionKind.GRAPHICS)) \
        is SessionUnbooked.TENANT_OBJECTS
    with structlog.testing.capture_logs() as logs:
        assert b.alloc(ROOT, 0x20, GRAPHICS, honest) == -errno.EPERM  # as past its own bound: EPERM, counted refused
    assert [e["why"] for e in logs if e["event"] == "gpu session refused"] == [SessionUnbooked.TENANT_OBJECTS.value]
    assert ledger.refused("t") == {SessionKind.GRAPHICS: 1} == b.sup.stats().refused
    assert ledger.live("t") == {SessionKind.GRAPHICS: 12}
    assert [c.alloc(ROOT, 0x10 + i, GRAPHICS, honest) for i in range(7)] == [0] * 7
    assert a.free(ROOT, 0x10) == 0
    assert b.alloc(ROOT, 0x20, GRAPHICS, honest) == 0
    mirrors(t, [], [a.book, b.book])
    for s in (a, b, c):
        s.sup.close()


def test_two_listeners_of_a_tenant_stop_at_its_bound_of_clients_and_nodes() -> None:
    honest = owner(os.getpid())  # a process that lives on: its clients are recorded
    ledger = SessionLedger(no_caps)
    t = tenant("t", session_clients=5, nodes=6)
    small = SessionBounds(clients=4, nodes=5, objects=8)
    a, b = Served("t", ledger, small, t), Served("t", ledger, small, t)
    assert [a.alloc(ROOT + i, 1, CHANNEL, honest) for i in range(3)] == [0] * 3
    assert [b.alloc(ROOT + i, 1, CHANNEL, honest) for i in range(3)] == [0] * 3  # the third client goes unfollowed
    assert b.book.size().clients == 2 and b.book.untracked == 1
    assert b.alloc(ROOT + 2, 2, GRAPHICS, honest) == -errno.EPERM  # its sessions are refused: the tenant's bound
    assert b.book.unbooked(Call(RM_ALLOC, ROOT + 2, ROOT + 2, 2, GRAPHICS, SessionKind.GRAPHICS, owner=honest)) \
        is SessionUnbooked.TENANT_CLIENT
    for i in range(4):  # channels under a's clients: nodes, 5 in all (each book under its own 5)
        a.alloc(ROOT, 0x100 + i, CHANNEL, honest)
    assert a.book.size().nodes + b.book.size().nodes == 6 and a.book.untracked == 3
    mirrors(t, [], [a.book, b.book])
    a.sup.close()
    b.sup.close()


# --- release on close, and no drift ------------------------------------------------------------------------------------
def fill_memory(book: MemoryBook, allocations: int, handles: int) -> None:
    """A client of this process, a device, allocations (as far as there is room) and driver-picked handles."""
    book.add_device(ROOT, DEV, NV01_DEVICE_0, ROOT, 0, HONEST)
    for i in range(allocations):
        if book.unbooked(ROOT, 0x1000 + i, DEV, HONEST) is None:
            book.add(ROOT, 0x1000 + i, DEV, 1, HONEST)
    for _ in range(handles):  # one past the tenant's bound would lose the client's replay, giving them all back
        book.handle_for(ROOT, 0, 0x77, HONEST)


def test_a_listener_that_ends_gives_its_tenant_back_all_it_held_and_the_next_fills_again() -> None:
    honest = owner(os.getpid())  # a process that lives on: its clients are recorded
    ledger = SessionLedger(no_caps)
    bounds = {"allocations": 10, "handles": 10, "session_objects": 10, "session_clients": 3, "nodes": 20}
    t = tenant("t", **bounds)
    first = Served("t", ledger, allowance=t)
    fill_memory(first.sup._mem.book, 50, 10)
    for i in range(50):
        first.alloc(ROOT + i % 5, 0x10 + i, GRAPHICS, honest)
    for i in range(50):
        first.alloc(ROOT, 0x1000 + i, CHANNEL, honest)
    held = mirrors(t, [first.sup._mem.book], [first.book])
    full: Mapping[Entry, int] = {Entry.MEMORY_CLIENTS: 1, Entry.DEVICES: 1, Entry.ALLOCATIONS: 10, Entry.HANDLES: 10,
                                 Entry.SESSION_CLIENTS: 3, Entry.NODES: 20, Entry.SESSION_OBJECTS: 10}
    assert held == full
    second = Served("t", ledger, allowance=t)
    assert second.alloc(ROOT, 1, GRAPHICS, honest) == -errno.EPERM  # the tenant is full
    first.sup.close()  # its process group ended
    assert t.used() == {} and ledger.live("t") == {}
    fill_memory(second.sup._mem.book, 50, 10)
    assert [second.alloc(ROOT + i % 3, 0x10 + i, GRAPHICS, honest) for i in range(10)] == [0] * 10
    for i in range(50):
        second.alloc(ROOT, 0x1000 + i, CHANNEL, honest)
    assert mirrors(t, [second.sup._mem.book], [second.book]) == full  # all of it, again
    second.sup.close()
    assert t.used() == {}


def test_hostile_frees_and_exits_never_make_the_tenant_s_count_drift_or_go_negative() -> None:
    """Frees of unknown handles and clients, double frees, exits of processes never seen, calls taken back, in a
    random order over few handles (so they collide): after each, the tenant counts exactly what its books hold."""
    t = tenant("t", memory_clients=3, devices=5, allocations=12, handles=9, session_clients=3, nodes=10,
               session_objects=7)
    rng = random.Random(26)
    memory = [MemoryBook(BookBounds(clients=2, devices=4, objects=8, live=6), Share(t)) for _ in range(2)]
    sessions = [SessionBook("t", 1_000_000_000, SessionBounds(clients=2, nodes=6, objects=5), Share(t)) for _ in range(2)]
    roots, handles = [ROOT + i for i in range(4)], [0, 1, 2, 3, 0x10, 0x11, RS_UNIQUE_HANDLE_BASE, RS_UNIQUE_HANDLE_BASE + 1]
    seen: set[Entry] = set()
    for _ in range(4000):
        m, s = rng.choice(memory), rng.choice(sessions)
        root, handle, parent = rng.choice(roots), rng.choice(handles), rng.choice(handles + roots)
        op = rng.randrange(9)
        if op == 0:
            m.add_device(root, handle, rng.choice((NV01_DEVICE_0, NV20_SUBDEVICE_0)), parent, rng.randrange(3), HONEST)
        elif op == 1 and m.unbooked(root, handle, parent, HONEST) is None:
            m.add(root, handle, parent, 1, HONEST)
        elif op == 2:
            m.free(root, rng.choice([*handles, root]))
        elif op == 3:
            m.release(rng.sample(roots, 2))
        elif op == 4:
            m.undo(root, rng.choice(handles), driver_chosen=rng.random() < 0.5)
        elif op == 5:
            m.handle_for(root, handle, parent, HONEST)
        elif op == 6:
            kind = rng.choice((None, SessionKind.GRAPHICS, SessionKind.COMPUTE))
            h_class = {None: CHANNEL, SessionKind.GRAPHICS: GRAPHICS, SessionKind.COMPUTE: COMPUTE}[kind]
            call = Call(RM_ALLOC, root, parent, handle, h_class, kind, owner=HONEST)
            s.needs_decision(call, TID, 0)
            refused = s.unbooked(call) is not None
            events = s.commit(call, TID, refused, 0)
            if rng.random() < 0.2:
                s.undo(call, events)  # its caller was gone
        elif op == 7:
            s.commit(Call(RM_FREE, root, root, rng.choice([*handles, root])), TID, False, 0)
        else:
            s.release([rng.choice([*roots, FLOOD])], EventAction.EXITED)
        seen |= set(mirrors(t, memory, sessions))
    assert seen == set(Entry)  # every kind was held at some point, so all were followed
    for book in memory:
        book.release_all()
    for sbook in sessions:
        sbook.release_all(EventAction.DETACHED)
    assert t.used() == {}


def test_a_book_s_share_gives_back_no_more_than_it_took_and_all_it_still_held_when_closed() -> None:
    """The books give back only what they drop; the share holds them to it whatever a bug or a caller does, so one
    listener can never lower what the tenant's others are counted for, nor keep any after it ends."""
    t = tenant("t", allocations=3)
    a, b = Share(t), Share(t)
    assert a.take(Entry.ALLOCATIONS) and b.take(Entry.ALLOCATIONS) and b.take(Entry.ALLOCATIONS)
    assert not a.take(Entry.ALLOCATIONS) and not a.room(Entry.ALLOCATIONS)
    a.give(Entry.ALLOCATIONS, 5)
    a.give(Entry.DEVICES)
    assert t.used() == {Entry.ALLOCATIONS: 2} and a.held() == {}
    b.give_all()
    assert t.used() == {} and b.held() == {}
    assert a.take(Entry.ALLOCATIONS)


def test_the_real_hooks_give_a_tenant_s_listeners_one_allowance_and_another_tenant_its_own() -> None:
    """Pipes stand in for the listeners (conftest.pipe_listeners)."""

    async def run() -> None:
        hooks = SupervisedHooks(lambda tenant, kind, pid: True, lambda event: None)
        with pipe_listeners() as listener:
            try:
                for name in ("a", "a", "b"):
                    hooks.attach(listener(), name, 0)
                a1, a2, b = (sup for sup, _ in hooks._supervisors)
                assert a1.allowance is not None and a1.allowance is a2.allowance and b.allowance is not a1.allowance
                assert a1._mem.book.share._allowances == (a1.allowance,) == a1._book.share._allowances  # root's: no user
                first = a1.allowance
                a1.close()
                a2.close()  # all of a's process groups ended
                hooks.attach(listener(), "a", 0)
                assert hooks._supervisors[-1][0].allowance is not first and set(hooks._allowances) == {"a", "b"}
            finally:
                hooks.close()

    asyncio.run(run())


# --- per user -----------------------------------------------------------------------------------------------------------
def test_a_share_draws_on_its_tenant_and_its_user_and_stops_at_the_first_bound_reached() -> None:
    """Two tenants of one user, each under its own bound, stop together at the user's; giving back returns to both."""
    lock = threading.Lock()
    user = Allowance("uid 1000", {kind: 3 for kind in Entry}, lock)
    a, b = (Allowance(n, TENANT_BOUNDS, lock) for n in ("a", "b"))
    in_a, in_b = Share(a, user), Share(b, user)
    assert in_a.take(Entry.ALLOCATIONS) and in_a.take(Entry.ALLOCATIONS) and in_b.take(Entry.ALLOCATIONS)
    assert not in_b.take(Entry.ALLOCATIONS) and not in_a.room(Entry.ALLOCATIONS)
    assert a.used() == {Entry.ALLOCATIONS: 2} and b.used() == {Entry.ALLOCATIONS: 1}
    assert user.used() == {Entry.ALLOCATIONS: 3}
    in_a.give_all()
    assert a.used() == {} and user.used() == {Entry.ALLOCATIONS: 1} and in_b.take(Entry.ALLOCATIONS)
    with pytest.raises(ValueError, match="one lock"):
        Share(Allowance("c", TENANT_BOUNDS), user)


def test_the_real_hooks_give_a_non_root_user_s_listeners_one_allowance_across_its_tenants() -> None:
    """Pipes stand in for the listeners (conftest.pipe_listeners)."""

    async def run() -> None:
        hooks = SupervisedHooks(lambda tenant, kind, pid: True, lambda event: None)
        with pipe_listeners() as listener:
            try:
                for name, uid in (("a", 1000), ("b", 1000), ("c", 1001), ("d", 0)):
                    hooks.attach(listener(), name, uid)
                a, b, c, d = (sup for sup, _ in hooks._supervisors)
                assert a.user_allowance is not None and a.user_allowance is b.user_allowance
                assert c.user_allowance is not None and c.user_allowance is not a.user_allowance
                assert d.user_allowance is None  # root's (a container runtime's): bounded per tenant only
                assert a._mem.book.share._allowances == (a.allowance, a.user_allowance) == a._book.share._allowances
                assert a.user_allowance._bounds == dict(USER_BOUNDS)
                first = a.user_allowance
                a.close()
                b.close()  # all of uid 1000's runs ended
                hooks.attach(listener(), "a", 1000)
                assert hooks._supervisors[-1][0].user_allowance is not first and set(hooks._users) == {1000, 1001}
            finally:
                hooks.close()

    asyncio.run(run())


@pytest.mark.parametrize(("served", "tenant", "uid", "refused"), [
    ([("a", 0)] * 2, "a", 0, "tenant 'a' already has 2"),
    ([("a", 1000)] * 2, "a", 1000, "tenant 'a' already has 2"),
    ([("a", 1000), ("b", 1000), ("c", 1000)], "d", 1000, "uid 1000 already has 3"),
    ([("a", 1000), ("b", 1000), ("c", 1000)], "d", 1001, None),
    ([("a", 0), ("b", 0), ("c", 0)], "d", 0, None),  # root: per tenant and for all together only
    ([("a", 0), ("b", 0), ("c", 0), ("d", 0)], "e", 0, "the daemon already serves 4"),  # pods' runtimes' hand-overs
    ([("a", 0), ("b", 0), ("c", 1000), ("d", 1001)], "e", 1002, "the daemon already serves 4"),
])
def test_listener_refusal(served: list[tuple[str, int]], tenant: str, uid: int, refused: str | None) -> None:
    why = listener_refusal(tenant, uid, served, most=2, most_per_user=3, most_all=4)
    assert (why is None) if refused is None else (why is not None and refused in why)


def test_stopping_with_supervisors_held_by_their_tenants_waits_one_deadline_not_one_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant can hold its supervisor's thread (a read of its memory that its own FUSE mount never answers): a stop
    tells every supervisor first, then waits JOIN_TIMEOUT_S in all, not that much once per held supervisor."""
    from unisched.enforce.seccomp import hooks as hooks_module
    from unisched.enforce.seccomp.supervisor import JOIN_TIMEOUT_S

    now = [0.0]
    told: list[str] = []

    class Held:
        """A supervisor whose thread never ends: each join takes its whole timeout."""

        def __init__(self, name: str) -> None:
            self.tenant = name

        def close(self, join_s: float = JOIN_TIMEOUT_S, *, keep: bool = False) -> None:
            told.append(self.tenant)
            now[0] += join_s

        def join(self, timeout_s: float) -> None:
            assert told == ["a", "b", "c"], "joined before every supervisor was told to stop"
            now[0] += timeout_s

    monkeypatch.setattr(hooks_module.time, "monotonic", lambda: now[0])
    hooks = SupervisedHooks(lambda *a: True, lambda e: None)
    hooks._supervisors = [(Held(n), 0) for n in "abc"]  # type: ignore[misc]
    hooks.close()
    assert told == ["a", "b", "c"] and now[0] == pytest.approx(JOIN_TIMEOUT_S)
