"""The seccomp agent sockets: where `unisched run` children and OCI runtimes (seccomp `listenerPath`) hand over
the notification listener of a tenant's GPU session filter. Each listener goes to the session hooks (by default a
SessionSupervisor each: its own thread answers every call that is not a new session at once, and asks the engine,
on the daemon's event loop, to admit or refuse each new render/compute/codec session).

Two sockets share the hooks and the hand-over slots. Every tenant process must reach the shared one
(`agent_socket`, 0666), and so does root in a pod where /run/unisched is mounted: a peer there is who `peer_of`
says (root outside the host's namespaces, or gone before they were read, is an ordinary user) and must still run
when its tenant is read. The runtime one (`runtime_agent_socket`) is root's alone (0600 in a 0700 directory, which
keeps out the host's other users; that directory is never mounted into a pod, which keeps pods out: root there
passes the modes), so only root on the host reaches it and the connection itself proves a host runtime: it may
name the tenant and hand over another process's listener, and is believed after it exited (runc sends the
listener and goes on without reading an answer)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
from dataclasses import dataclass
from typing import Final

import structlog

from unisched.enforce.seccomp.abi import SeccompError
from unisched.enforce.seccomp.accounting import EventAction, SessionEvent
from unisched.enforce.seccomp.agent import AgentHello, AgentMessageReader, ack_agent, recv_agent_chunk
from unisched.enforce.seccomp.hooks import SessionHooks, SupervisedHooks
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.logs import Throttle
from unisched.policy.callers import Caller, Pod, named
from unisched.scheduler.config import ConfigError
from unisched.scheduler.core import Scheduler
from unisched.transport.carry import Carried, ListenerCarry
from unisched.transport.claim import make_private_directory, replace_stale_socket
from unisched.transport.identity import PeerCred, kernel_cred, peer_of, pin
from unisched.transport.options import CONTAINED_SHARE

__all__ = [
    "HANDOVER_DEADLINE_S",
    "MAX_HANDOVERS_PER_UID",
    "MAX_HANDOVERS_ROOT",
    "MAX_HANDOVERS_USERS",
    "HandOverLimits",
    "HandOverSlots",
    "SeccompAgentServer",
]

log = structlog.get_logger("unisched.agent")
_GIVE_BACK = (EventAction.ABORTED, EventAction.FREED, EventAction.EXITED, EventAction.DETACHED)

HANDOVER_DEADLINE_S: Final = 2.0
"""How long one hand-over (fd and message) may take from accept. runc, crun and `unisched run`'s trampoline send
it all in one sendmsg right after connecting, so it is there at once; 2 s leaves room for a loaded host and
bounds how long a slow peer holds one of its caller's slots."""
MAX_HANDOVERS_PER_UID: Final = 4
"""Hand-overs in progress per non-root uid, and per pod whatever uids its processes take (PeerCred.caller). Each
takes milliseconds, so a user's burst of runs rarely has more than a few at once (and `hand_over` retries a "busy"
reply); a user who stalls their own only waits on them."""
MAX_HANDOVERS_USERS: Final = 64
"""Hand-overs in progress from all non-root uids and pods together: bounds the fds and buffers (up to
MAX_AGENT_MESSAGE_BYTES each) that many callers at once can pin. Pods together hold at most CONTAINED_SHARE of
them, as of the front door's connections, so pods never lock host users out."""
MAX_HANDOVERS_ROOT: Final = 64
"""Hand-overs in progress from root (runc/containerd starting containers, on either socket; root's runs): root's
own room, which no other uid's connections can take."""
REFUSAL_LOG_INTERVAL_S: Final = 10.0
"""At most one warning per kind and caller (a uid, or a pod) this often: a flood must not flood the journal too."""
_ACCEPT_RETRY_S: Final = 0.1
"""Pause after accept fails (out of fds or memory) before trying again, instead of spinning or giving up."""


@dataclass(frozen=True)
class HandOverLimits:
    """The agent socket's bounds (one place per knob: the constants above)."""

    per_uid: int = MAX_HANDOVERS_PER_UID
    users: int = MAX_HANDOVERS_USERS
    root: int = MAX_HANDOVERS_ROOT
    deadline_s: float = HANDOVER_DEADLINE_S
    contained_share: float = CONTAINED_SHARE
    """The part of `users` that pods may hold together."""


class HandOverSlots:
    """Hand-overs in progress per caller (a uid, or a pod: PeerCred.caller), taken at accept and given back when
    the connection ends: a caller at its limit is refused at once, so a flood costs only the caller that sends it
    (root always keeps its room, and host users the part of theirs that pods may not take)."""

    def __init__(self, limits: HandOverLimits) -> None:
        self.limits = limits
        self._by_caller: dict[Caller, int] = {}
        self._users = 0
        """Slots held by non-root callers, pods' included."""
        self._pods = 0
        """Slots held by pods."""

    def take(self, caller: Caller) -> str | None:
        """None when a slot was taken; else why not."""
        n = self._by_caller.get(caller, 0)
        pod = isinstance(caller, Pod)
        if caller == 0:
            if n >= self.limits.root:
                return f"{n} hand-overs from root in progress (at most {self.limits.root})"
        elif n >= self.limits.per_uid:
            return f"{named(caller)} has {n} hand-overs in progress (at most {self.limits.per_uid})"
        elif self._users >= self.limits.users:
            return f"{self._users} hand-overs from users in progress (at most {self.limits.users})"
        elif pod and self._pods >= self._pods_cap():
            return f"{self._pods} hand-overs from pods in progress (at most {self._pods_cap()})"
        else:
            self._users += 1
            self._pods += pod
        self._by_caller[caller] = n + 1
        return None

    def give_back(self, caller: Caller) -> None:
        n = self._by_caller.get(caller, 0) - 1
        if n < 0:
            return
        if n:
            self._by_caller[caller] = n
        else:
            del self._by_caller[caller]
        if caller != 0:
            self._users -= 1
            self._pods -= isinstance(caller, Pod)

    def in_progress(self, caller: Caller) -> int:
        return self._by_caller.get(caller, 0)

    def _pods_cap(self) -> int:
        return int(self.limits.users * self.limits.contained_share)


class SeccompAgentServer:
    """Reads hand-overs on the event loop without blocking (non-blocking recvmsg when the socket is readable),
    never on a thread pool that other requests share; every hand-over has a deadline and each caller a bounded
    number in progress."""

    def __init__(
        self, path: str, engine: Scheduler, limits: HandOverLimits | None = None, hooks: SessionHooks | None = None,
        carry: ListenerCarry | None = None, carried: list[tuple[int, Carried]] | None = None,
        runtime_path: str | None = None,
    ) -> None:
        self.path = path
        self.runtime_path = runtime_path
        """The runtime agent socket (module docstring); None: the shared one alone."""
        self.carry = carry
        """Where the hooks' listeners are kept across a graceful restart (carry.py); None: never kept."""
        self.carried = carried or []
        """The listeners the last graceful stop kept, served again at `start` (ListenerCarry.take's)."""
        self.graceful = False
        """Set when the daemon was serving and a stop was asked for: only then does `close` keep the listeners (a
        start that failed, or an engine that died, closes them: a restart loop must not keep calls waiting)."""
        self.engine = engine
        self.limits = limits or HandOverLimits()
        if hooks is None:  # the real hooks also follow video memory: caps and reserves at each allocation
            engine.memory_ledger = MemoryLedger(engine.memory_terms, engine.gpu_memory_totals)
            hooks = SupervisedHooks(self._decide, self._on_event, engine.memory_ledger)
        self.hooks: SessionHooks = hooks
        self._bound: list[tuple[socket.socket, str, bool]] = []
        """Each listening socket, its path and whether it is the runtime one."""
        self._made_dir: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Task[None]] = set()
        self._slots = HandOverSlots(self.limits)
        self._root_given_back = asyncio.Event()
        """Set each time a hand-over from root ends: a runtime waiting for root's room may go on."""
        self._throttle = Throttle(REFUSAL_LOG_INTERVAL_S)

    async def start(self) -> None:
        # tenants' children hand over their listener as themselves (any uid); identity is checked per connection
        self._listen(self.path, 0o666, runtime=False)
        if self.runtime_path is not None:  # bound inside a directory root's alone: no one else ever reaches it
            directory, name = os.path.split(self.runtime_path)
            try:
                self._made_dir = directory if make_private_directory(directory, name) else None
            except OSError as e:
                raise _unusable_runtime_directory(directory, e) from None
            self._listen(self.runtime_path, 0o600, runtime=True)
        carried, self.carried = self.carried, []
        self._serve_carried(carried)
        self._tasks = [asyncio.create_task(self._accept_loop(sock, runtime)) for sock, _, runtime in self._bound]

    def _listen(self, path: str, mode: int, runtime: bool) -> None:
        replace_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
        except OSError:
            sock.close()
            raise
        self._bound.append((sock, path, runtime))
        os.chmod(path, mode)
        sock.listen(128)
        sock.setblocking(False)

    def _serve_carried(self, carried: list[tuple[int, Carried]]) -> None:
        """Serve again the listeners the last graceful stop kept, each for its tenant if that still exists over the
        same cgroup (its books start empty: what was opened before the restart is not counted); the others closed
        (ENOSYS)."""
        served: list[str] = []
        for fd, entry in carried:
            now = self._cgroup_of(entry.tenant)
            if now != entry.cgroup:
                os.close(fd)
                log.warning("a carried session hook's tenant is gone or now names another cgroup; its calls fail with "
                            "ENOSYS", tenant=entry.tenant, cgroup=entry.cgroup, now=now)
                continue
            try:
                self.hooks.attach(fd, entry.tenant, entry.user, carried=True)
            except SeccompError as e:
                log.warning("a carried session hook is not served; its calls fail with ENOSYS", tenant=entry.tenant,
                            reason=str(e))
                continue
            self.engine.note_session_hooks(entry.tenant)
            served.append(entry.tenant)
        if carried:
            log.info("session hooks carried over the restart", served=len(served), listeners=len(carried),
                     tenants=sorted(set(served)))

    def _cgroup_of(self, tenant: str) -> str | None:
        """The tenant's cgroup (None: no such tenant): what a carried listener is matched to besides its name."""
        return self.engine.snapshot(tenant).cgroup if self.engine.has_tenant(tenant) else None

    async def close(self) -> None:
        tasks = [*self._tasks, *self._pending]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock, path, _ in self._bound:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._bound = []
        if self._made_dir is not None:
            with contextlib.suppress(OSError):  # (not empty: something else was put there, left alone)
                os.rmdir(self._made_dir)
        for fd, _ in self.carried:  # never started: not served, so not kept either
            os.close(fd)
        self.carried = []
        if self.carry is not None and self.carry.enabled and self.graceful:
            # off the loop: the hooks wait for the loop's decisions on the sessions they had asked about
            self.carry.keep(await asyncio.to_thread(self.hooks.hand_off), self._cgroup_of)
        else:
            self.hooks.close()

    async def _accept_loop(self, sock: socket.socket, runtime: bool) -> None:
        """One connection at a time, the loop's other work let run after each: `sock_accept` returns at once, without
        yielding, while connections are queued, so a flood of them (the shared socket is anyone's) would otherwise
        hold the whole loop, the slices and systemd's watchdog included. On the runtime socket nothing is refused
        "busy" (runc never reads the answer: its container's GPU calls would fail with ENOSYS): while root's slots
        are all taken, the connection accepted waits for one, and the rest wait in the backlog."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: the pending connection waits in the backlog
                self._warn("seccomp agent cannot accept", None, error=str(e))
                await asyncio.sleep(_ACCEPT_RETRY_S)
                continue
            if runtime:
                try:
                    await self._root_room()
                except asyncio.CancelledError:
                    conn.close()
                    raise
            self._admit(conn, loop.time() + self.limits.deadline_s, runtime)
            await asyncio.sleep(0)

    async def _root_room(self) -> None:
        """Return once root may take a hand-over slot."""
        while self._slots.in_progress(0) >= self.limits.root:
            self._root_given_back.clear()
            await self._root_given_back.wait()

    def _admit(self, conn: socket.socket, deadline: float, runtime: bool) -> None:
        """Take a slot for the peer (its caller as `peer_of` knows it: its uid, or its pod; on the runtime socket its
        uid as the kernel recorded it at connect, which must be root's), or refuse at once ("busy", then close)."""
        try:
            cred = kernel_cred(conn) if runtime else peer_of(conn)
        except OSError:
            conn.close()
            return
        if runtime and cred.uid != 0:  # its modes keep everyone else out; should they ever not
            reason = "only root (a container runtime on the host) may hand over on the runtime agent socket"
            self._warn("seccomp hand-over refused", cred, reason=reason)
            ack_agent(conn, reason)
            self._close(conn, cred)
            return
        refusal = self._slots.take(cred.caller)  # root in a pod: its pod, as any uid there
        if refusal is not None:
            self._warn("seccomp hand-over refused: too many in progress", cred, reason=refusal)
            ack_agent(conn, refusal, busy=True)
            self._close(conn, cred)
            return
        conn.setblocking(False)
        task = asyncio.create_task(self._handle(conn, cred, deadline, runtime))
        self._pending.add(task)
        task.add_done_callback(lambda t: self._done(t, conn, cred))

    @staticmethod
    def _close(conn: socket.socket, cred: PeerCred) -> None:
        conn.close()
        if cred.process is not None:
            cred.process.close()

    def _done(self, task: asyncio.Task[None], conn: socket.socket, cred: PeerCred) -> None:
        """However the handler ended (even cancelled before it ran): the connection closes, the slot returns."""
        self._pending.discard(task)
        self._close(conn, cred)
        self._slots.give_back(cred.caller)
        if cred.caller == 0:
            self._root_given_back.set()

    async def _handle(self, conn: socket.socket, cred: PeerCred, deadline: float, runtime: bool) -> None:
        fd = -1
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    fd, hello = await _receive(conn, deadline)
            except TimeoutError:
                self._warn("seccomp hand-over incomplete at its deadline", cred, deadline_s=self.limits.deadline_s)
                # "busy": `hand_over` tries again. An honest peer sends all right after connecting, but its tenant
                # can be frozen by the time slicing (or preempted) in between for longer than this; a slow peer
                # still loses its slot at the deadline and only its own retries pay for it
                ack_agent(conn, f"the hand-over was not complete within {self.limits.deadline_s:g} s", busy=True)
                return
            except (SeccompError, OSError) as e:
                self._warn("seccomp hand-over failed", cred, error=str(e))
                ack_agent(conn, str(e))
                return
            tenant, reason = self._tenant_for(cred, runtime, hello)
            if reason is not None or tenant is None:
                self._warn("seccomp hand-over refused", cred, pid=hello.pid, reason=reason)
                ack_agent(conn, reason)
                return
            fd, listener = -1, fd  # the hooks own it now
            try:
                self.hooks.attach(listener, tenant, cred.caller)  # a pod's count as its pod's, whatever their uid
            except SeccompError as e:  # (MAX_LISTENERS, MAX_LISTENERS_PER_TENANT, MAX_LISTENERS_PER_USER)
                self._warn("seccomp hand-over refused", cred, pid=hello.pid, reason=str(e))
                ack_agent(conn, str(e))
                return
            self.engine.note_session_hooks(tenant)
            log.info("session hooks attached", tenant=tenant, pid=hello.pid, container=hello.container_id or None)
            ack_agent(conn, None)
        except Exception:  # a bug, but one a peer may trigger at will: its lines are throttled like its refusals
            self._warn("seccomp agent connection failed", cred, level="error", exc_info=True)
        finally:
            if fd >= 0:
                os.close(fd)

    def _warn(self, event: str, cred: PeerCred | None, level: str = "warning", **fields: object) -> None:
        """The runtime's (uid 0's) lines always; another peer's at most once per REFUSAL_LOG_INTERVAL_S per
        event and caller (its uid, or its pod: root in a pod taking uid after uid gets no more lines). `level`
        "error" for a failure that is a bug, not a refusal."""
        caller = None if cred is None else cred.caller
        held_back = 0 if caller == 0 else self._throttle.allow((event, caller))
        if held_back is not None:
            peer: dict[str, int] = {} if cred is None else {"peer_uid": cred.uid, "peer_pid": cred.pid}
            if isinstance(caller, Pod):
                peer["pod"] = caller.pidns
            emit = log.error if level == "error" else log.warning
            emit(event, **peer, **fields, **({"held_back": held_back} if held_back else {}))

    def _tenant_for(self, cred: PeerCred, on_runtime_socket: bool, hello: AgentHello) -> tuple[str | None, str | None]:
        """Which tenant a hand-over governs (tenant, None), or why none (None, reason): `tenant=NAME` in the
        profile's listenerMetadata when a runtime sends it (any peer of the runtime socket; root in the host's
        namespaces on the shared one, runc or crun); else the tenant whose cgroup holds the process. Any other
        peer (a user's `unisched run` trampoline; root inside a pod) may only hand over its own listener."""
        runtime = on_runtime_socket or cred.uid == 0  # (`peer_of` gives uid 0 to root in the host's namespaces only)
        pid = hello.pid
        if not runtime and cred.pid != pid:
            return None, f"peer pid {cred.pid} may only hand over its own listener (message says pid {pid})"
        named = dict(kv.split("=", 1) for kv in hello.metadata.split(",") if "=" in kv).get("tenant")
        if named is not None and not runtime:
            return None, "only a root runtime in the host's namespaces may name the tenant in listenerMetadata"
        if named is not None and not self.engine.has_tenant(named):
            return None, f"listenerMetadata names unknown tenant {named!r} (declare or adopt it first)"
        if named is not None and on_runtime_socket:
            return named, None  # a host runtime's word, whether it still runs or not
        # what must still run once the tenant is read, so that the pid read named it: on the shared socket the peer;
        # on the runtime one the process the message names (the runtime may be gone), pinned before the read
        pinned = pin(pid) if on_runtime_socket else None
        try:
            tenant = named or self.engine.tenant_of_pid(pid)
            if tenant is None:
                hint = "adopt the container's cgroup, or set listenerMetadata tenant=NAME"
                return None, f"pid {pid} is not in any tenant's cgroup ({hint})"
            if pinned is not None and not pinned.alive():
                return None, f"pid {pid} exited before its tenant was read"
            if pinned is None and not cred.alive():
                return None, "the peer exited before its hand-over was done"
            return tenant, None
        finally:
            if pinned is not None:
                pinned.close()

    def _decide(self, tenant: str, kind: str, h_class: int) -> bool:
        return self.engine.admit_session(tenant, str(kind), h_class)

    def _on_event(self, event: SessionEvent) -> None:
        if event.action in _GIVE_BACK:
            self.engine.session_freed(event.tenant, str(event.kind))


def _unusable_runtime_directory(directory: str, e: OSError) -> ConfigError:
    """A configuration error (exit 2: systemd does not restart into it again) saying what to change."""
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # an older unit: /run read-only but for its own directory
        why = (f"cannot make {directory}: {e.strerror}. Under systemd the unit makes it: this release's unit has "
               "RuntimeDirectory=unisched unisched-runtime, so re-run `python3 -m unisched install-service`, then "
               "`systemctl daemon-reload` (for another place, add it to the unit's RuntimeDirectory=); elsewhere, "
               "set runtime_agent_socket where the daemon can make its directory")
    else:
        why = f"cannot use {directory}: {e.strerror or e}"
    return ConfigError(f"config 'runtime_agent_socket': {why}")


async def _receive(conn: socket.socket, deadline: float) -> tuple[int, AgentHello]:
    """One hand-over from a non-blocking connection: one recvmsg per turn of the loop, the loop's other work let run
    between a peer's chunks (while the socket stays readable nothing else would yield), and no chunk read after the
    first past `deadline` (the loop's clock): TimeoutError. The first is read whenever the task runs, so a hand-over
    already whole in the socket (a runtime's: one sendmsg) is taken even when the loop came to it late."""
    loop = asyncio.get_running_loop()
    reader = AgentMessageReader()
    try:
        while True:
            try:
                data, fds = recv_agent_chunk(conn)
            except BlockingIOError:
                await _readable(conn)
                continue
            hello = reader.feed(data, fds)
            if hello is not None:
                return reader.take_fd(), hello
            await asyncio.sleep(0)
            if loop.time() >= deadline:
                raise TimeoutError
    finally:
        reader.close()


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _wake, ready)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)
