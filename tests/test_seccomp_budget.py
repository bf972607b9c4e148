"""The hooks' notification budget (enforce/seccomp/budget.py): the listeners of one owner (a non-root user's, all its
tenants together; one of root's tenants) handle one notification at a time, first come first served, and each takes
a notification only in its turn of its own rate and its owner's. So one owner's floods of notified calls (RM_FREE on
fd -1 through a hundred listeners) no longer keep a hundred threads at the interpreter lock the event loop needs, and
answer at a bounded rate. The clocks are the tests'."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import pipe_listeners
from test_seccomp import ENOSYS, ENOTTY, GRAPHICS, OTHER, needs_notify, serve, start_tenant, wait_for

from unisched.enforce.nvclasses import SessionKind
from unisched.enforce.seccomp.accounting import SessionLedger
from unisched.enforce.seccomp.budget import OWNER_BURST, OWNER_RATE, Pace, Rate, Turnstile
from unisched.enforce.seccomp.hooks import SupervisedHooks, pace_owner
from unisched.enforce.seccomp.supervisor import SessionSupervisor

NEVER_TAKEN = 3600.0
"""A turnstile's held_max_s where a test holds the turn itself and no waiter may take it from the test."""


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- the turns --------------------------------------------------------------------------------------------------------
def test_a_rate_lets_its_burst_through_at_once_then_one_turn_per_interval() -> None:
    rate = Rate(10.0, 3)
    assert [rate.reserve(0.0) for _ in range(5)] == pytest.approx([0.0, 0.0, 0.0, 0.1, 0.2])
    assert rate.reserve(0.15) == pytest.approx(0.3)  # still queued behind the turns already taken
    assert not rate.full(0.59) and rate.full(0.6)
    assert [rate.reserve(10.0) for _ in range(4)] == pytest.approx([10.0, 10.0, 10.0, 10.1])  # a rest refills it
    with pytest.raises(ValueError):
        Rate(0.0, 1)
    with pytest.raises(ValueError):
        Rate(1.0, 0)


def test_a_steady_caller_below_the_rate_never_waits() -> None:
    rate = Rate(100.0, 1)
    assert all(rate.reserve(t / 50) == t / 50 for t in range(1000))


def test_an_owner_s_listeners_share_its_rate_and_take_turns() -> None:
    """128 listeners of one owner, each under its own rate, flooding at once: together they get the owner's rate
    beyond its burst, whatever their number, and their turns interleave (each takes one at a time)."""
    clock, lock = Clock(0.0), threading.Lock()
    owner = Rate(1000.0, 10)
    paces = [Pace(Rate(500.0, 4), owner, lock, clock) for _ in range(128)]
    turns = [(pace.turn(), i) for _ in range(4) for i, pace in enumerate(paces)]  # each takes 4 turns, in rounds
    assert sum(1 for t, _ in turns if t == 0.0) == 10  # the owner's burst, at once
    last = max(t for t, _ in turns)
    assert last == pytest.approx((len(turns) - 10) / 1000.0)  # the rest at the owner's rate
    firsts = sorted(t for t, i in turns[:128])
    assert firsts[-1] < sorted(t for t, _ in turns)[129]  # every listener's first turn comes before any third


def test_a_listener_s_own_rate_holds_when_its_owner_has_room() -> None:
    clock = Clock(0.0)
    pace = Pace(Rate(100.0, 2), Rate(10_000.0, 1000), threading.Lock(), clock)
    assert [pace.turn() for _ in range(4)] == pytest.approx([0.0, 0.0, 0.01, 0.02])


def test_a_turnstile_hands_the_turn_to_its_waiters_in_the_order_they_came() -> None:
    turnstile = Turnstile(held_max_s=NEVER_TAKEN)
    first = turnstile.enter(lambda: False)
    assert first is not None
    order: list[int] = []

    def wait_turn(i: int) -> None:
        ticket = turnstile.enter(lambda: False)
        assert ticket is not None
        order.append(i)
        turnstile.leave(ticket)

    threads = []
    for i in range(5):
        threads.append(threading.Thread(target=wait_turn, args=(i,)))
        threads[-1].start()
        wait_for(lambda i=i: turnstile.waiting == i + 1, f"waiter {i} to queue")  # type: ignore[misc]
    turnstile.leave(first)
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3, 4] and turnstile.waiting == 0
    assert turnstile.enter(lambda: True) is not None  # free again: entered at once, whatever give_up says


def test_a_waiter_whose_supervisor_closes_gives_up_and_the_others_wait_on() -> None:
    turnstile = Turnstile(held_max_s=NEVER_TAKEN)
    first = turnstile.enter(lambda: False)
    assert first is not None
    closing = threading.Event()
    got: dict[str, bool] = {}

    def wait_turn(name: str, give_up: threading.Event) -> None:
        ticket = turnstile.enter(give_up.is_set)
        got[name] = ticket is not None
        if ticket is not None:
            turnstile.leave(ticket)

    leaving = threading.Thread(target=wait_turn, args=("closing", closing))
    staying = threading.Thread(target=wait_turn, args=("staying", threading.Event()))
    leaving.start()
    wait_for(lambda: turnstile.waiting == 1, "the first waiter")
    staying.start()
    wait_for(lambda: turnstile.waiting == 2, "the second waiter")
    closing.set()
    turnstile.wake_all()
    leaving.join(10)
    assert got == {"closing": False}
    wait_for(lambda: turnstile.waiting == 1, "the other waiter to wait again")
    turnstile.leave(first)
    staying.join(10)
    assert got == {"closing": False, "staying": True} and turnstile.waiting == 0


def test_a_turn_held_past_its_limit_is_taken_by_the_first_waiter_and_its_old_holder_s_leave_does_nothing() -> None:
    """A listener's thread blocked in its turn (its caller's memory behind a FUSE mount that never answers) must not
    stop its owner's other listeners: past held_max_s (the clock's) the first waiter takes the turn; the others keep
    their order; the blocked thread's late leave hands nothing on."""
    clock = Clock(0.0)
    turnstile = Turnstile(held_max_s=0.01, clock=clock)
    stuck = turnstile.enter(lambda: False)
    assert stuck is not None
    got: dict[str, int | None] = {}

    def wait_turn(name: str) -> None:
        got[name] = turnstile.enter(lambda: False)

    first = threading.Thread(target=wait_turn, args=("first",))
    first.start()
    wait_for(lambda: turnstile.waiting == 1, "the first waiter")
    second = threading.Thread(target=wait_turn, args=("second",))
    second.start()
    wait_for(lambda: turnstile.waiting == 2, "the second waiter")
    assert got == {}  # held, by the clock, for less than its limit: both wait, however long in real time
    clock.now = 0.5
    first.join(10)
    assert not first.is_alive() and got["first"] is not None and "second" not in got
    turnstile.leave(stuck)  # the blocked thread comes back: its turn was taken, nothing is handed on
    assert turnstile.waiting == 1 and "second" not in got
    turnstile.leave(got["first"])
    second.join(10)
    assert got["second"] is not None and turnstile.waiting == 0


@pytest.mark.parametrize(("tenant", "uid", "owner"), [
    ("a", 1000, "uid 1000"), ("b", 1000, "uid 1000"), ("a", 0, "tenant a"), ("b", 0, "tenant b"),
    ("a", -1, "root in a container"),
])
def test_whose_budget_a_listener_draws_on(tenant: str, uid: int, owner: str) -> None:
    assert pace_owner(tenant, uid) == owner


def test_the_real_hooks_give_a_user_s_listeners_one_budget_and_root_s_tenants_one_each() -> None:
    """Pipes stand in for the listeners (conftest.pipe_listeners)."""
    clock = Clock()

    async def run() -> None:
        hooks = SupervisedHooks(lambda tenant, kind, pid: True, lambda event: None, clock=clock)
        with pipe_listeners() as listener:
            try:
                for name, uid in (("a", 1000), ("b", 1000), ("c", 1001), ("d", 0), ("d", 0), ("e", 0)):
                    hooks.attach(listener(), name, uid)
                a, b, c, d1, d2, e = (sup._pace for sup, _ in hooks._supervisors)
                assert a is not None and b is not None and c is not None and d1 is not None and d2 is not None
                assert e is not None
                assert a._owner is b._owner and c._owner is not a._owner
                assert d1._owner is d2._owner and e._owner is not d1._owner and d1._owner is not a._owner
                assert a.turnstile is not None and a.turnstile is b.turnstile and c.turnstile is not a.turnstile
                assert d1.turnstile is d2.turnstile and e.turnstile is not d1.turnstile
                assert a._own is not b._own and a.clock is clock
                shared = a._owner
                assert shared is not None
                for _ in range(OWNER_BURST + 1):
                    shared.reserve(clock())  # uid 1000's budget spent
                for sup, _ in hooks._supervisors[:2]:
                    sup.close()  # all of uid 1000's runs ended, its budget not full again yet
                hooks.attach(listener(), "a", 1000)
                again = hooks._supervisors[-1][0]._pace
                assert again is not None and again._owner is shared  # no fresh burst by ending and starting again
                for sup, _ in hooks._supervisors[-1:]:
                    sup.close()
                clock.now += (OWNER_BURST + 1) / OWNER_RATE + 1.0
                hooks.attach(listener(), "a", 1000)
                last = hooks._supervisors[-1][0]._pace
                assert last is not None and last._owner is not shared  # full again: forgotten, nothing given away
            finally:
                hooks.close()

    asyncio.run(run())


# --- with the kernel ----------------------------------------------------------------------------------------------------
@needs_notify
def test_a_listener_past_its_budget_takes_its_next_call_only_in_its_turn() -> None:
    """Burst 3 at 1000 a second, the clock stopped: three calls are answered at once, the fourth waits in the kernel
    (the supervisor does not take it) until the clock reaches its turn, and is then served as any other (counted)."""
    proc, fd = start_tenant()
    clock = Clock()
    ledger = SessionLedger(lambda t, kind: None)
    sup = SessionSupervisor(fd, "t", ledger.decide, ledger.on_event, pace=Pace(Rate(1000.0, 3), clock=clock))
    thread = serve(sup)
    try:
        for h in range(3):
            assert proc.call(f"alloc {OTHER:#x} {0x100 + h:#x}") == ENOTTY
        assert sup.stats().paced == 0
        proc.send(f"alloc {GRAPHICS:#x} 0x200")
        wait_for(lambda: sup.stats().paced == 1, "the fourth call's turn to be taken")
        assert not proc.answered()  # its turn is 1 ms of the stopped clock away: not taken off the kernel's queue
        assert sup.stats().notifications == 3
        clock.now += 0.001
        assert proc.line() == f"ok {ENOTTY}"
        assert dict(sup.stats().live) == {SessionKind.GRAPHICS: 1} and sup.stats().notifications == 4
        c = sup.counts()
        assert c.paced == 1 and c.paced_s == pytest.approx(0.001)
    finally:
        sup.close()
        thread.join(10)
        proc.kill()
    assert not thread.is_alive()


@needs_notify
def test_a_listener_waiting_for_its_turn_still_stops_at_once() -> None:
    proc, fd = start_tenant()
    clock = Clock()
    sup = SessionSupervisor(fd, "t", lambda *a: True, pace=Pace(Rate(0.001, 1), clock=clock))  # next turn: 1000 s
    thread = serve(sup)
    try:
        assert proc.call(f"alloc {OTHER:#x} 0x100") == ENOTTY
        proc.send(f"alloc {OTHER:#x} 0x101")
        wait_for(lambda: sup.stats().paced == 1, "the second call's turn to be taken")
        sup.close(join_s=0)
        thread.join(10)
        assert not thread.is_alive() and sup.closed
        assert proc.line() == f"ok {ENOSYS}"  # the listener closed under the waiting call
    finally:
        proc.kill()


@needs_notify
def test_a_listener_handles_its_calls_only_in_its_owner_s_turn() -> None:
    """Another listener of the same owner holds the turnstile (the test does): the call waits in the kernel until the
    turn is its listener's; a listener closing meanwhile stops waiting at once."""
    proc, fd = start_tenant()
    turnstile = Turnstile(held_max_s=NEVER_TAKEN)
    sup = SessionSupervisor(fd, "t", lambda *a: True, pace=Pace(Rate(1e6, 1000), turnstile=turnstile))
    thread = serve(sup)
    try:
        assert proc.call(f"alloc {OTHER:#x} 0x100") == ENOTTY  # nobody else's turn: at once
        ticket = turnstile.enter(lambda: False)
        assert ticket is not None
        proc.send(f"alloc {OTHER:#x} 0x101")
        wait_for(lambda: turnstile.waiting == 1, "the supervisor to wait at the turnstile")
        assert not proc.answered() and sup.stats().notifications == 1
        turnstile.leave(ticket)
        assert proc.line() == f"ok {ENOTTY}"
        ticket = turnstile.enter(lambda: False)
        assert ticket is not None
        proc.send(f"alloc {OTHER:#x} 0x102")
        wait_for(lambda: turnstile.waiting == 1, "the supervisor to wait again")
        sup.close(join_s=0)
        thread.join(10)
        assert not thread.is_alive() and turnstile.waiting == 0
        assert proc.line() == f"ok {ENOSYS}"
        turnstile.leave(ticket)
    finally:
        sup.close()
        proc.kill()


