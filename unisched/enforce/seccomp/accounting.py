"""Object and session accounting: which RM_ALLOC / RM_FREE calls open and close which engine sessions.

Pure: no I/O and no clock of its own (times come in as arguments), so every rule is table-tested. The
supervisor reads the calls from the tenant's memory (`calls.decode_call` takes the reader), asks for decisions and
answers the kernel; this module only keeps the books.

Sessions: the driver allocates several objects for one session of some kinds (on the H200 a CUDA context made 8
compute objects, one PyAV decoder 7 NVDEC objects, one per engine), so counts and caps are kept per session,
and a decision is asked once, for the first object. A later object of a video engine kind joins the same
client's latest session of that kind when the same thread allocates it within the join window of the previous
one and on an engine instance that session's live objects do not use (engineInstance from the allocation
parameters, below calls.ENGINE_INSTANCES); a second decoder, which needs engine 0 again, opens a new session.
Compute objects join on the same thread and window; graphics and NVENC_SW_SESSION objects are one session each. A
session ends when its last object is freed (directly or with an ancestor) or its process exits.

The book is bounded (SessionBounds): the calls are the tenant's to make up, and the driver's refusal of a made-up one
is never seen. Past a bound a session call the book cannot record is refused like one over its cap (`unbooked`),
never admitted uncounted; other calls go on unfollowed.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from unisched.enforce.nvclasses import RM_FREE, SessionKind
from unisched.enforce.seccomp.allowance import Entry, Share
from unisched.enforce.seccomp.calls import ENGINE_KINDS, Call, Session
from unisched.enforce.seccomp.memory import MAX_CLIENTS

# The book's bounds, per supervisor (one listener: one hooked process group of one tenant); clients, nodes and session
# objects are each also drawn from the tenant's allowance (hooks.TENANT_BOUNDS), all its listeners together, and
# from its user's (hooks.USER_BOUNDS), all the listeners a non-root user handed over together. Each recorded entry
# belongs to a recorded client, and so to the process that made it: its exit (SessionSupervisor.reconcile) drops
# them all. RM clients are bounded by memory.MAX_CLIENTS, the memory book's bound of the same meaning: past it a new
# client is not recorded, nor one whose process is not known (reconcile could never drop it); its session calls are
# refused (an uncounted session would escape the caps), its other calls go on unfollowed. At MAX_CLIENTS and
# MAX_SESSION_OBJECTS the book takes about 50 MB of the daemon's memory (measured with tracemalloc: ~1 KB a client,
# ~700 B a session object that opens a session of its own).
MAX_NODES: Final = 200_000
"""RM objects tracked per supervisor beyond sessions' own: bounds a tenant's memory in the daemon (a CUDA
context allocates a hundred-odd); past it, frees of untracked ancestors are missed until the process exits."""
MAX_SESSION_OBJECTS: Final = 65_536
"""Live session objects recorded (graphics, compute and video engine objects, each one node of the tree and one entry
of its session). Without it they would grow without end even under caps: objects joining an open session (a compute
object of the same thread within the join window, a video object on an engine instance the session does not use
yet, and engineInstance is the caller's to write) open no new session, and a tenant without a cap is never refused.
A CUDA context makes 8 on the H200 and a decoder 7, so this is thousands of contexts, more than an 8-GPU host's
memory holds. Past it a session call, opening or joining, is refused until frees or exits bring the book below it:
an object not recorded could end its session early (its last recorded object freed), uncounting a live session."""
GROUPED_KINDS: Final = ENGINE_KINDS | {SessionKind.COMPUTE}
"""Kinds whose later objects may join an open session."""


class EventAction(StrEnum):
    ADMITTED = "admitted"
    """An engine session's allocation was let through and is counted (+1)."""
    REFUSED = "refused"
    """Refused with EPERM; not counted."""
    ABORTED = "aborted"
    """decide() said yes but the call was gone (killed or interrupted) before the answer; not counted."""
    FREED = "freed"
    """RM_FREE of the session object or of one of its ancestors (-1)."""
    EXITED = "exited"
    """The owning process exited, or every process of the filter did (-1)."""
    DETACHED = "detached"
    """The supervisor was closed while the session was still counted (-1: nobody follows it any more)."""


_ENDS: Final = frozenset({EventAction.FREED, EventAction.EXITED, EventAction.DETACHED})


@dataclass(frozen=True)
class SessionEvent:
    tenant: str
    action: EventAction
    kind: SessionKind
    h_class: int
    pid: int
    """Thread id that made the call (0 when not known)."""
    handle: int
    """hObjectNew (0 when the RM chose the handle)."""
    live: int
    """This supervisor's live count of `kind` after the event."""

    @property
    def delta(self) -> int:
        if self.action is EventAction.ADMITTED:
            return 1
        return -1 if self.action in _ENDS else 0


class SessionLedger:
    """Per-tenant live session counts against caps, shared by several supervisors (thread-safe).

    `decide` reserves a slot when it says yes; the supervisor then reports ADMITTED (the reservation becomes
    a live session) or ABORTED (released), and FREED / EXITED / DETACHED give slots back. `cap(tenant, kind)`
    returns the cap, or None for no cap. Pass `ledger.decide` and `ledger.on_event` to each supervisor.
    """

    def __init__(self, cap: Callable[[str, SessionKind], int | None]) -> None:
        self._cap = cap
        self._lock = threading.Lock()
        self._live: collections.Counter[tuple[str, SessionKind]] = collections.Counter()
        self._pending: collections.Counter[tuple[str, SessionKind]] = collections.Counter()
        self._refused: collections.Counter[tuple[str, SessionKind]] = collections.Counter()

    def decide(self, tenant: str, kind: SessionKind, h_class: int) -> bool:
        cap = self._cap(tenant, kind)
        with self._lock:
            key = (tenant, kind)
            if cap is not None and self._live[key] + self._pending[key] >= cap:
                return False
            self._pending[key] += 1
            return True

    def on_event(self, event: SessionEvent) -> None:
        key = (event.tenant, event.kind)
        with self._lock:
            if event.action in (EventAction.ADMITTED, EventAction.ABORTED) and self._pending[key] > 0:
                self._pending[key] -= 1
            if event.action is EventAction.REFUSED:
                self._refused[key] += 1
            elif event.delta:
                self._live[key] = max(0, self._live[key] + event.delta)

    def live(self, tenant: str) -> dict[SessionKind, int]:
        with self._lock:
            return {k: n for (t, k), n in self._live.items() if t == tenant and n}

    def refused(self, tenant: str) -> dict[SessionKind, int]:
        with self._lock:
            return {k: n for (t, k), n in self._refused.items() if t == tenant and n}


# --- the books ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionBounds:
    """A book's bounds (the constants above; smaller ones for tests)."""

    clients: int = MAX_CLIENTS
    nodes: int = MAX_NODES
    objects: int = MAX_SESSION_OBJECTS


@dataclass(frozen=True)
class SessionBookSize:
    """Entries a book holds, against its bounds."""

    clients: int
    nodes: int
    """Objects in the trees, session objects included."""
    objects: int
    """Live session objects."""


class SessionUnbooked(StrEnum):
    """Why a session call cannot be recorded, and so is refused (MAX_CLIENTS, MAX_SESSION_OBJECTS; the TENANT_ ones:
    the bounds its book shares with the tenant's other listeners, hooks.TENANT_BOUNDS, or with the other listeners its
    non-root user handed over, hooks.USER_BOUNDS)."""

    CLIENT = "client not recorded"
    OBJECTS = "too many session objects"
    TENANT_CLIENT = "client not recorded: the tenant's or its user's bound"
    TENANT_OBJECTS = "too many session objects for the tenant or its user"


@dataclass
class Client:
    """One RM client (hRoot) and the part of its object tree seen through RM_ALLOC."""

    tgid: int
    start_time: str
    parent: dict[int, int] = field(default_factory=dict)
    children: dict[int, set[int]] = field(default_factory=dict)
    sessions: dict[int, Session] = field(default_factory=dict)  # object handle -> its session
    latest: dict[SessionKind, Session] = field(default_factory=dict)  # the session new objects may join


@dataclass(frozen=True)
class Counts:
    live: Mapping[SessionKind, int]
    """Live sessions per kind (what caps count)."""
    objects: Mapping[SessionKind, int]
    """Live RM objects per kind behind those sessions."""
    admitted: Mapping[SessionKind, int]
    refused: Mapping[SessionKind, int]


class SessionBook:
    """One tenant's RM clients, object trees and sessions, and the counts that follow from them.

    The tree is changed by one thread (the supervisor's); `counts()` may be read from any (the counters are
    under a lock). Every client, node and session object it records is taken from `share`, its part of the tenant's
    (and its user's) allowances, and given back when dropped.
    """

    def __init__(self, tenant: str, join_window_ns: int, bounds: SessionBounds = SessionBounds(),
                 share: Share | None = None) -> None:
        self.tenant = tenant
        self._join_window_ns = join_window_ns
        self._bounds = bounds
        self.share = Share() if share is None else share
        self._clients: dict[int, Client] = {}
        self._nodes = 0
        self._synthetic = itertools.count(-1, -1)
        self.untracked = 0
        """Non-session objects not recorded because MAX_NODES was reached, or their client was not."""
        self._lock = threading.Lock()
        self._live: collections.Counter[SessionKind] = collections.Counter()
        self._objects: collections.Counter[SessionKind] = collections.Counter()
        self._admitted: collections.Counter[SessionKind] = collections.Counter()
        self._refused: collections.Counter[SessionKind] = collections.Counter()

    def knows(self, h_root: int) -> bool:
        """Whether RM client `h_root` was seen (a new one needs its owner recorded on the call)."""
        return h_root in self._clients

    def holds_sessions(self, h_root: int) -> bool:
        """Whether a free in client `h_root` may uncount something (check the caller is still there first)."""
        client = self._clients.get(h_root)
        return client is not None and bool(client.sessions)

    def owners(self) -> dict[int, tuple[int, str]]:
        """hRoot -> (tgid, start time) of each client's process, for finding the exited."""
        return {h: (c.tgid, c.start_time) for h, c in self._clients.items()}

    def size(self) -> SessionBookSize:
        with self._lock:
            objects = sum(self._objects.values())
        return SessionBookSize(len(self._clients), self._nodes, objects)

    def unbooked(self, call: Call) -> SessionUnbooked | None:
        """Why session call `call` (after `needs_decision`) could not be recorded, so must be refused before any
        decision (None: `commit` may record it, or it is no session call). A call already waiting for its decision
        is recorded past the bounds, so they are overshot by at most one call per thread waiting."""
        if call.kind is None:
            return None
        if call.h_root not in self._clients:
            why = self._client_refusal(call)
            if why is not None:
                return why
        with self._lock:
            objects = sum(self._objects.values())
        if objects >= self._bounds.objects:
            return SessionUnbooked.OBJECTS
        return None if self.share.room(Entry.SESSION_OBJECTS) else SessionUnbooked.TENANT_OBJECTS

    def _client_refusal(self, call: Call) -> SessionUnbooked | None:
        """Why a new client of `call` may not be recorded (None: it may): its process is not known, or MAX_CLIENTS
        is reached, the book's or the tenant's."""
        if not (call.owner or (0, ""))[0] or len(self._clients) >= self._bounds.clients:
            return SessionUnbooked.CLIENT
        return None if self.share.room(Entry.SESSION_CLIENTS) else SessionUnbooked.TENANT_CLIENT

    def needs_decision(self, call: Call, tid: int, now_ns: int) -> bool:
        """For a session call: whether it opens a new session. Otherwise it is marked: a handle seen again
        (the driver refuses it, or a free was missed) loses its kind, so it is counted once; an object that
        joins an open session gets `join`."""
        if call.kind is None:
            return False
        client = self._clients.get(call.h_root)
        if client is None:
            return True
        if call.handle and call.handle in client.sessions:
            call.kind = None
            return False
        call.join = self._joinable(client, call, tid, now_ns)
        return call.join is None

    def _joinable(self, client: Client, call: Call, tid: int, now_ns: int) -> Session | None:
        kind = call.kind
        if kind not in GROUPED_KINDS:
            return None
        session = client.latest.get(kind)
        if session is None or not session.objects or session.pid != tid:
            return None
        if now_ns - session.last_ns > self._join_window_ns:
            return None
        if kind in ENGINE_KINDS and (call.instance is None or call.instance in session.instances.values()):
            return None
        return session

    def commit(self, call: Call, pid: int, refused: bool, now_ns: int) -> list[SessionEvent]:
        """Apply an answered call to the counts and the object tree; the events to report."""
        kind = call.kind
        if call.op == 0:
            return []
        if refused and kind is not None:
            with self._lock:
                self._refused[kind] += 1
                live = self._live[kind]
            return [SessionEvent(self.tenant, EventAction.REFUSED, kind, call.h_class, pid, call.handle, live)]
        if call.op == RM_FREE:
            return self._free(call)
        client = self._clients.get(call.h_root)
        if client is None:
            if kind is None and self._client_refusal(call) is not None:
                self.untracked += bool(call.owner and call.owner[0])  # MAX_CLIENTS, not an unknown process
                return []
            tgid, start = call.owner or (0, "")  # a session call here was let through by `unbooked` or a decision
            if not tgid and kind is not None:  # its client freed while the call waited, its process gone since
                return self._unrecorded(call, kind, pid)
            self.share.take(Entry.SESSION_CLIENTS, force=True)  # its room was asked just now, or before the decision
            client = self._clients[call.h_root] = Client(tgid, start)
        node = self._record(client, call)
        if kind is None:
            return []
        call.node = node
        return self._add_object(client, call, kind, node, pid, now_ns)

    def _unrecorded(self, call: Call, kind: SessionKind, pid: int) -> list[SessionEvent]:
        """A decided session call whose client cannot be recorded: a client of no known process would never be
        dropped (`owners`: no exit to find), and its session counted until the listener ends. Given back instead."""
        with self._lock:
            live = self._live[kind]
        return [SessionEvent(self.tenant, EventAction.ABORTED, kind, call.h_class, pid, call.handle, live)]

    def _record(self, client: Client, call: Call) -> int:
        """Put the new object in its client's tree (session objects always; others up to MAX_NODES)."""
        node = call.handle or next(self._synthetic)
        if node == call.h_parent:
            return node
        if node not in client.parent:  # session objects are always recorded (`unbooked` asked for their room)
            if call.kind is None and not (self._nodes < self._bounds.nodes and self.share.take(Entry.NODES)):
                self.untracked += 1
                return node
            if call.kind is not None:
                self.share.take(Entry.NODES, force=True)
            self._nodes += 1
        else:  # a handle named again moves: out of its old parent's children, or they would grow by one a call
            self._leave_parent(client, node, client.parent[node])
        client.parent[node] = call.h_parent
        siblings = client.children.get(call.h_parent)
        if siblings is None:  # (not setdefault: it would make a set for every object recorded)
            siblings = client.children[call.h_parent] = set()
        siblings.add(node)
        return node

    def _add_object(
        self, client: Client, call: Call, kind: SessionKind, node: int, pid: int, now_ns: int
    ) -> list[SessionEvent]:
        session = call.join
        opened = session is None
        if session is None:
            session = Session(kind, call.h_class, pid, call.handle)
            client.latest[kind] = session
        session.objects.add(node)
        if call.instance is not None:
            session.instances[node] = call.instance
        session.last_ns = now_ns
        client.sessions[node] = session
        self.share.take(Entry.SESSION_OBJECTS, force=True)  # `unbooked` asked for room, before any decision
        with self._lock:
            self._objects[kind] += 1
            if not opened:
                return []
            self._live[kind] += 1
            self._admitted[kind] += 1
            live = self._live[kind]
        return [SessionEvent(self.tenant, EventAction.ADMITTED, kind, call.h_class, pid, call.handle, live)]

    def undo(self, call: Call | None, events: list[SessionEvent]) -> list[SessionEvent]:
        """The answer found the call gone: take back an admission or a refusal that did not happen."""
        out = []
        client = self._clients.get(call.h_root) if call is not None else None
        if call is not None and call.kind is not None and call.node and client is not None:
            session = client.sessions.pop(call.node, None)
            if session is not None:  # the object was recorded: take it back (its session stays if it has others)
                self._unlink(client, call.node)
                self._drop_object(session, call.node)
        for e in events:
            if e.action is EventAction.ADMITTED:
                with self._lock:
                    self._live[e.kind] -= 1
                    self._admitted[e.kind] -= 1
                    live = self._live[e.kind]
                out.append(SessionEvent(e.tenant, EventAction.ABORTED, e.kind, e.h_class, e.pid, e.handle, live))
            elif e.action is EventAction.REFUSED:
                with self._lock:
                    self._refused[e.kind] -= 1
            else:
                out.append(e)
        return out

    def _free(self, call: Call) -> list[SessionEvent]:
        client = self._clients.get(call.h_root)
        if client is None:
            return []
        if call.handle == call.h_root:  # freeing the client frees everything it holds
            return self.release([call.h_root], EventAction.FREED)
        ended: list[Session] = []
        stack, seen = [call.handle], set()
        while stack:
            h = stack.pop()
            if h in seen:
                continue
            seen.add(h)
            stack.extend(client.children.pop(h, ()))
            self._unlink(client, h)
            session = client.sessions.pop(h, None)
            if session is not None and h in session.objects and self._drop_object(session, h):
                ended.append(session)
                if client.latest.get(session.kind) is session:
                    del client.latest[session.kind]
        return self._uncount(ended, EventAction.FREED)

    def _unlink(self, client: Client, h: int) -> None:
        parent = client.parent.pop(h, None)
        if parent is not None:
            self._nodes -= 1
            self.share.give(Entry.NODES)
            self._leave_parent(client, h, parent)

    @staticmethod
    def _leave_parent(client: Client, h: int, parent: int) -> None:
        siblings = client.children.get(parent)
        if siblings is not None:
            siblings.discard(h)
            if not siblings:  # else parents named once each, their children freed, would pile up
                del client.children[parent]

    def _drop_object(self, session: Session, h: int) -> bool:
        """Take object `h` out of its session, and its engine instance; True when that was the session's last."""
        session.objects.discard(h)
        session.instances.pop(h, None)
        self.share.give(Entry.SESSION_OBJECTS)
        with self._lock:
            self._objects[session.kind] -= 1
        return not session.objects

    def release(self, roots: list[int], action: EventAction) -> list[SessionEvent]:
        """Forget RM clients (freed, their process exited, or nobody follows them any more) and end their sessions."""
        events: list[SessionEvent] = []
        for h_root in roots:
            client = self._clients.pop(h_root, None)
            if client is not None:
                self._nodes -= len(client.parent)
                sessions = list({id(x): x for x in client.sessions.values()}.values())
                self.share.give(Entry.SESSION_CLIENTS)
                self.share.give(Entry.NODES, len(client.parent))
                self.share.give(Entry.SESSION_OBJECTS, sum(len(x.objects) for x in sessions))
                with self._lock:
                    for x in sessions:
                        self._objects[x.kind] -= len(x.objects)
                events += self._uncount(sessions, action)
        return events

    def release_all(self, action: EventAction) -> list[SessionEvent]:
        """Forget every client (the listener ended), and give its tenant back all the book took."""
        events = self.release(list(self._clients), action)
        self.share.give_all()
        return events

    def _uncount(self, sessions: list[Session], action: EventAction) -> list[SessionEvent]:
        events = []
        for s in sessions:
            with self._lock:
                self._live[s.kind] -= 1
                live = self._live[s.kind]
            events.append(SessionEvent(self.tenant, action, s.kind, s.h_class, s.pid, max(s.handle, 0), live))
        return events

    def counts(self) -> Counts:
        with self._lock:
            return Counts(
                live=MappingProxyType({k: n for k, n in self._live.items() if n}),
                objects=MappingProxyType({k: n for k, n in self._objects.items() if n}),
                admitted=MappingProxyType(dict(self._admitted)),
                refused=MappingProxyType(dict(self._refused)),
            )
