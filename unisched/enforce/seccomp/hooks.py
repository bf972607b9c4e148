"""What the daemon needs from the GPU session hooks, the real hooks (one supervisor per listener) and a fake.

The agent socket resolves which tenant a hand-over governs; `SessionHooks` is everything after that: serve the
listener for the tenant, stop serving, say how it goes. Logic tests of the agent put `FakeSessionHooks` there.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Protocol

from unisched.enforce.nvclasses import SessionKind
from unisched.enforce.seccomp import accounting, memory
from unisched.enforce.seccomp.abi import SeccompError
from unisched.enforce.seccomp.accounting import SessionEvent
from unisched.enforce.seccomp.allowance import Allowance, Entry
from unisched.enforce.seccomp.budget import (
    LISTENER_BURST,
    LISTENER_RATE,
    OWNER_BURST,
    OWNER_RATE,
    Pace,
    Rate,
    Turnstile,
)
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.stats import HookCounts, SupervisorStats
from unisched.enforce.seccomp.supervisor import JOIN_TIMEOUT_S, SessionSupervisor
from unisched.policy.callers import Caller, named

MAX_LISTENERS_PER_TENANT: Final = 256
"""Listeners (hooked process groups: a container, a `unisched run`) served at once per tenant. Each is a supervisor
thread and books bounded on their own (memory.py, accounting.py), so a user starting hooked runs without end would
otherwise multiply both; 256 is more containers or runs than one tenant shares a host's GPUs between. Past it the
hand-over is refused with the reason, and the run or container does not start."""

TENANT_BOUNDS: Final[Mapping[Entry, int]] = MappingProxyType({
    Entry.MEMORY_CLIENTS: memory.MAX_CLIENTS,
    Entry.DEVICES: memory.MAX_DEVICES,
    Entry.ALLOCATIONS: memory.MAX_OBJECTS,
    Entry.HANDLES: memory.MAX_LIVE,
    Entry.SESSION_CLIENTS: memory.MAX_CLIENTS,  # the session book's bound of clients too (accounting.py)
    Entry.NODES: accounting.MAX_NODES,
    Entry.SESSION_OBJECTS: accounting.MAX_SESSION_OBJECTS,
})
"""Book entries one tenant's listeners may hold together (allowance.py). Each equals one listener's own bound, so a
tenant's books together never hold more than one listener's may, however many listeners it has: about 155 MB of the
daemon's memory at all seven (90 the memory books, 65 the session books; tests/measure_tenant_books.py, tracemalloc,
every entry a distinct object as a hostile tenant makes them). A user's worst case is then its tenants times that,
not times MAX_LISTENERS_PER_TENANT too. One listener alone may still fill each of its bounds, as before; past the
tenant's, a call is refused or followed less closely exactly as past the listener's own (the reason says it is the
tenant's). Smaller would cut a listener's own bounds for every tenant; an honest tenant's listeners share what one
GPU-filling process group needs at most (memory.MAX_OBJECTS: more 2 MiB allocations than an H200 holds)."""


MAX_LISTENERS: Final = 2048
"""Listeners served at once, every tenant's and user's together. Each is a thread with three fds: the container
runtime's hand-overs (root's) are bounded per tenant only, so pods could otherwise have the daemon start threads
until its task limit (a systemd service's default TasksMax is 15% of pid_max: 4,915 at 32,768), and then it could
start none for anyone. Past it a hand-over is refused with the reason, and the daemon serves on."""

MAX_LISTENERS_PER_USER: Final = 256
"""Listeners one non-root user (the caller that hands them over: `unisched run`'s uid, or a pod whatever uids its
processes take) has served at once, all its tenants together. Each listener is a supervisor thread: a user with
MAX_USER_TENANTS tenants could otherwise start 8,192, past a systemd service's default task limit, and the daemon
could then start no thread for anyone. Root's (the container runtime's) are bounded per tenant, and by
MAX_LISTENERS with everyone's."""

USER_TENANT_BOOKS: Final = 4
"""How many tenants' worth of books (TENANT_BOUNDS) the listeners one non-root user handed over may hold together."""

USER_BOUNDS: Final[Mapping[Entry, int]] = MappingProxyType({k: n * USER_TENANT_BOOKS for k, n in TENANT_BOUNDS.items()})
"""Book entries the listeners one non-root user handed over may hold together, all its tenants' (allowance.py): four
times a tenant's ~155 MB at all seven, ~620 MB, where TENANT_BOUNDS alone let one user's MAX_USER_TENANTS tenants hold
~5 GB. A user's honest runs fill a few GPUs at most, each within one tenant's bounds; past the user's, a call is
refused or followed less closely exactly as past the tenant's."""


def listener_refusal(tenant: str, user: Caller, served: list[tuple[str, Caller]], most: int,
                     most_per_user: int = MAX_LISTENERS_PER_USER, most_all: int = MAX_LISTENERS) -> str | None:
    """Why one more listener of `tenant`, handed over by `user`, is not served (None: it is), `served` the tenants
    and users of those served now."""
    if len(served) >= most_all:
        return (f"the daemon already serves {len(served)} hooked process groups (containers or runs), the most at "
                "once for all tenants together; end some")
    n = sum(1 for t, _ in served if t == tenant)
    if n >= most:
        return (f"tenant {tenant!r} already has {n} hooked process groups (containers or runs), the most served at "
                "once; end some, or run this one as another tenant")
    if user != 0:
        mine = sum(1 for _, u in served if u == user)
        if mine >= most_per_user:
            return (f"{named(user)} already has {mine} hooked process groups (runs), the most served at once for a "
                    "non-root user; end some")
    return None


def pace_owner(tenant: str, user: Caller) -> str:
    """Whose budget (budget.OWNER_RATE) and turnstile a listener shares: the non-root user's or the pod's that handed
    it over, all its tenants' together; root's (a container runtime's) per tenant."""
    return f"tenant {tenant}" if user == 0 else named(user)


ENDED_TENANTS_KEPT: Final = 4096
"""Tenants whose ended listeners' totals are kept (the oldest forgotten first), so that a tenant's counts in the
metrics never fall when one of its runs or containers ends. A forgotten tenant's counts start again from 0 at its
next listener, which Prometheus's rate() reads as a counter reset."""


@dataclass(frozen=True)
class KeptListener:
    """A listener `hand_off` kept open for the next daemon: its fd (the caller's), the tenant it served and the user
    that handed it over (a uid, negative for root in a container, or a pod: policy.callers)."""

    fd: int
    tenant: str
    user: Caller


class SessionHooks(Protocol):
    def attach(self, listener_fd: int, tenant: str, user: Caller, carried: bool = False) -> None:
        """Serve the seccomp listener `listener_fd` for `tenant`, handed over by `user` (a uid, 0 for root on the
        host, or a pod whatever uids its processes take: policy.callers), from now on; `carried`: kept over a
        restart (SessionSupervisor's). Called on the daemon's event loop. The fd is the hooks' own from the call on,
        even when it raises (SeccompError)."""

    def close(self) -> None:
        """Stop serving every listener (their tenants' pending and later session calls fail with ENOSYS)."""

    def hand_off(self) -> list[KeptListener]:
        """Stop serving every listener as `close` does, but answer every call received first and keep each listener
        whose processes still run open, for a restarted daemon to serve (the caller's to close from now on)."""

    def stats(self) -> list[SupervisorStats]:
        """One entry per listener still served."""

    def counts(self) -> list[HookCounts]:
        """One entry per tenant with a listener served now or before (ENDED_TENANTS_KEPT): its calls' running
        totals, over every listener it has had. Called on the daemon's event loop."""


class SupervisedHooks:
    """The real hooks: a SessionSupervisor per listener, its thread answering, `decide` and `on_event` on the loop."""

    def __init__(
        self, decide: Callable[[str, SessionKind, int], bool], on_event: Callable[[SessionEvent], None],
        memory: MemoryLedger | None = None, max_per_tenant: int = MAX_LISTENERS_PER_TENANT,
        tenant_bounds: Mapping[Entry, int] = TENANT_BOUNDS, max_per_user: int = MAX_LISTENERS_PER_USER,
        user_bounds: Mapping[Entry, int] = USER_BOUNDS,
        rates: tuple[tuple[float, int], tuple[float, int]] = ((LISTENER_RATE, LISTENER_BURST), (OWNER_RATE, OWNER_BURST)),
        clock: Callable[[], float] = time.monotonic, max_all: int = MAX_LISTENERS,
    ) -> None:
        """`rates`: (per second, burst) of each listener's budget and of each owner's (budget.py); `clock` theirs."""
        self._max_all = max_all
        self._max_per_tenant = max_per_tenant
        self._max_per_user = max_per_user
        self._tenant_bounds = tenant_bounds
        self._user_bounds = user_bounds
        self._decide = decide
        self._on_event = on_event
        self.memory = memory
        """Video memory held per tenant and GPU, and the caps and reserves decided on it (None: not followed)."""
        self._supervisors: list[tuple[SessionSupervisor, Caller]] = []
        """Each listener served, with the user that handed it over."""
        self._lock = threading.Lock()
        """The one lock of every allowance below: a book draws on its tenant's and its user's at once."""
        self._allowances: dict[str, Allowance] = {}
        """Per tenant with a listener served: what all its books hold together (TENANT_BOUNDS)."""
        self._users: dict[Caller, Allowance] = {}
        """Per non-root user (a uid, or a pod) with a listener served: what all the books of the listeners it handed
        over hold together (USER_BOUNDS)."""
        self._ended: dict[str, HookCounts] = {}
        """Per tenant, the totals of its listeners that have ended (ENDED_TENANTS_KEPT, oldest first)."""
        self._rates, self._clock = rates, clock
        self._paces: dict[str, tuple[Rate, Turnstile]] = {}
        """Per owner with a listener served (`pace_owner`): the budget its listeners share (under `_pace_lock`), and
        their turnstile."""
        self._pace_lock = threading.Lock()

    def _forget_ended(self) -> None:
        """Drop the supervisors that have ended, their totals kept in `_ended`."""
        for sup, _ in self._supervisors:
            if sup.closed:
                c, was = sup.counts(), self._ended.pop(sup.tenant, None)
                self._ended[c.tenant] = c if was is None else c.plus(was)  # now the newest
                while len(self._ended) > ENDED_TENANTS_KEPT:
                    del self._ended[next(iter(self._ended))]
        self._supervisors = [(s, u) for s, u in self._supervisors if not s.closed]

    def attach(self, listener_fd: int, tenant: str, user: Caller, carried: bool = False) -> None:
        self._forget_ended()
        served = [(s.tenant, u) for s, u in self._supervisors]
        tenants, users = {t for t, _ in served}, {u for _, u in served}
        self._allowances = {t: a for t, a in self._allowances.items() if t in tenants}  # the ended gave all back
        self._users = {u: a for u, a in self._users.items() if u in users}
        owners = {pace_owner(t, u) for t, u in served}
        with self._pace_lock:  # an owner's budget outlives its listeners until it is full again (no fresh burst)
            self._paces = {o: p for o, p in self._paces.items() if o in owners or not p[0].full(self._clock())}
        why = listener_refusal(tenant, user, served, self._max_per_tenant, self._max_per_user, self._max_all)
        if why is not None:
            os.close(listener_fd)
            raise SeccompError(why)
        allowance = self._allowances.setdefault(tenant, Allowance(tenant, self._tenant_bounds, self._lock))
        mine = None if user == 0 else self._users.setdefault(user, Allowance(named(user), self._user_bounds, self._lock))
        (own, own_burst), (shared, shared_burst) = self._rates
        owner, turnstile = self._paces.setdefault(pace_owner(tenant, user), (Rate(shared, shared_burst), Turnstile()))
        pace = Pace(Rate(own, own_burst), owner, self._pace_lock, self._clock, turnstile)
        try:
            sup = SessionSupervisor(listener_fd, tenant, self._decide, self._on_event, memory=self.memory,
                                    allowance=allowance, user_allowance=mine, carried=carried, pace=pace)
        except BaseException:
            os.close(listener_fd)
            raise
        self._supervisors.append((sup, user))
        sup.attach(asyncio.get_running_loop())

    def close(self) -> None:
        self._stop_all(keep=False)

    def hand_off(self) -> list[KeptListener]:
        """A supervisor whose thread has not ended by the deadline keeps its listener, closed when the daemon exits."""
        kept = []
        for sup, user in self._stop_all(keep=True):
            fd = sup.take_kept() if sup.closed else None
            if fd is not None:
                kept.append(KeptListener(fd, sup.tenant, user))
        return kept

    def _stop_all(self, keep: bool) -> list[tuple[SessionSupervisor, Caller]]:
        """Every supervisor told to stop at once, then joined against one deadline: a thread held by its tenant (a
        read of its memory that a FUSE mount never answers) costs the stop JOIN_TIMEOUT_S once, not once each.
        Returns them, no longer served."""
        stopped, self._supervisors = self._supervisors, []
        for sup, _ in stopped:
            sup.close(join_s=0, keep=keep)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for sup, _ in stopped:
            sup.join(max(0.0, deadline - time.monotonic()))
        return stopped

    def stats(self) -> list[SupervisorStats]:
        return [sup.stats() for sup, _ in self._supervisors if not sup.closed]

    def counts(self) -> list[HookCounts]:
        self._forget_ended()
        totals = dict(self._ended)
        for sup, _ in self._supervisors:
            c, was = sup.counts(), totals.get(sup.tenant)
            totals[c.tenant] = c if was is None else c.plus(was)
        return list(totals.values())


class FakeSessionHooks:
    """Records what it is asked to serve and closes each listener at once (its tenant's session calls then fail
    with ENOSYS): for tests of the agent's logic, which need no supervisor thread."""

    def __init__(self, max_per_tenant: int = MAX_LISTENERS_PER_TENANT,
                 max_per_user: int = MAX_LISTENERS_PER_USER, max_all: int = MAX_LISTENERS) -> None:
        self.attached: list[str] = []
        """The tenants given a listener, in order (all counted as still served)."""
        self.users: list[Caller] = []
        """Who handed each of them over."""
        self.closed = False
        self.answered: dict[str, HookCounts] = {}
        """What `counts` says of a tenant (a test sets it; zeros for the others attached)."""
        self._max_per_tenant = max_per_tenant
        self._max_per_user = max_per_user
        self._max_all = max_all

    def attach(self, listener_fd: int, tenant: str, user: Caller, carried: bool = False) -> None:
        os.close(listener_fd)
        why = listener_refusal(tenant, user, list(zip(self.attached, self.users, strict=True)), self._max_per_tenant,
                               self._max_per_user, self._max_all)
        if why is not None:
            raise SeccompError(why)
        self.attached.append(tenant)
        self.users.append(user)

    def close(self) -> None:
        self.closed = True

    def hand_off(self) -> list[KeptListener]:
        self.closed = True
        return []  # every listener was closed at its attach

    def stats(self) -> list[SupervisorStats]:
        empty: MappingProxyType[SessionKind, int] = MappingProxyType({})
        return [
            SupervisorStats(live=empty, objects=empty, admitted=empty, refused=empty, tenant=tenant, notifications=0,
                            skipped=0, errors=0, latency_p50_us=None, latency_p99_us=None, latency_samples=0,
                            closed=self.closed)
            for tenant in self.attached
        ]

    def counts(self) -> list[HookCounts]:
        return [self.answered.get(tenant, HookCounts(tenant, 0, 0, 0.0)) for tenant in dict.fromkeys(self.attached)]
