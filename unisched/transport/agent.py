"""The seccomp agent socket: where `unisched run` children and OCI runtimes (seccomp `listenerPath`) hand
over the notification listener of a tenant's GPU session filter. Each listener gets a SessionSupervisor: its
own thread answers every call that is not a new session at once, and asks the engine, on the daemon's event
loop, to admit or refuse each new render/compute/codec session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
from pathlib import Path

import structlog

from unisched.enforce.seccomp import (
    EventAction,
    SeccompError,
    SessionEvent,
    SessionSupervisor,
    ack_agent,
    recv_agent_message,
)
from unisched.engine.core import KernelEngine

__all__ = ["SeccompAgentServer"]

log = structlog.get_logger("unisched.agent")
_CRED = struct.Struct("3i")
_GIVE_BACK = (EventAction.ABORTED, EventAction.FREED, EventAction.EXITED, EventAction.DETACHED)


class SeccompAgentServer:
    def __init__(self, path: str, engine: KernelEngine) -> None:
        self.path = path
        self.engine = engine
        self.supervisors: dict[int, SessionSupervisor] = {}
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._next = 0
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        p = Path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            if not stat.S_ISSOCK(p.lstat().st_mode):
                raise OSError(f"{self.path} exists and is not a socket")
            p.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        # tenants' children hand over their listener as themselves (any uid); identity is checked per connection
        os.chmod(self.path, 0o666)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.create_task(self._accept_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for sup in list(self.supervisors.values()):
            sup.close()
        self.supervisors.clear()

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            task = asyncio.create_task(self._handle(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _handle(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        fd = -1
        try:
            pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            conn.setblocking(True)
            try:
                fd, hello = await loop.run_in_executor(None, recv_agent_message, conn)
            except (SeccompError, OSError) as e:
                log.warning("seccomp hand-over failed", peer_pid=pid, error=str(e))
                await loop.run_in_executor(None, ack_agent, conn, str(e))
                return
            tenant, reason = self._tenant_for(pid, uid, hello.pid, hello.metadata)
            if reason is not None or tenant is None:
                log.warning("seccomp hand-over refused", peer_pid=pid, pid=hello.pid, reason=reason)
                os.close(fd)
                fd = -1
                await loop.run_in_executor(None, ack_agent, conn, reason)
                return
            sup = SessionSupervisor(fd, tenant, self._decide, self._on_event)
            fd = -1  # the supervisor owns it now
            self._next += 1
            key = self._next
            self.supervisors[key] = sup
            sup.attach(loop)
            self.engine.note_session_hooks(tenant)
            log.info("session hooks attached", tenant=tenant, pid=hello.pid, container=hello.container_id or None)
            await loop.run_in_executor(None, ack_agent, conn, None)
            self._reap()
        except Exception:
            log.exception("seccomp agent connection failed")
        finally:
            if fd >= 0:
                os.close(fd)
            conn.close()

    def _tenant_for(self, peer_pid: int, peer_uid: int, pid: int, metadata: str) -> tuple[str | None, str | None]:
        """Which tenant a hand-over governs: `tenant=NAME` in the profile's listenerMetadata when a root runtime
        (runc, crun) sends it; else the tenant whose cgroup holds the process. A non-root peer may only hand
        over its own listener (`unisched run`'s trampoline)."""
        if peer_uid != 0 and peer_pid != pid:
            return None, f"peer pid {peer_pid} may only hand over its own listener (message says pid {pid})"
        named = dict(kv.split("=", 1) for kv in metadata.split(",") if "=" in kv).get("tenant")
        if named is not None:
            if peer_uid != 0:
                return None, "only a root runtime may name the tenant in listenerMetadata"
            if not self.engine.has_tenant(named):
                return None, f"listenerMetadata names unknown tenant {named!r} (declare or adopt it first)"
            return named, None
        tenant = self.engine.tenant_of_pid(pid)
        if tenant is None:
            hint = "adopt the container's cgroup, or set listenerMetadata tenant=NAME"
            return None, f"pid {pid} is not in any tenant's cgroup ({hint})"
        return tenant, None

    def _decide(self, tenant: str, kind: str, h_class: int) -> bool:
        return self.engine.admit_session(tenant, str(kind), h_class)

    def _on_event(self, event: SessionEvent) -> None:
        if event.action in _GIVE_BACK:
            self.engine.session_freed(event.tenant, str(event.kind))

    def _reap(self) -> None:
        for key, sup in list(self.supervisors.items()):
            if sup.closed:
                del self.supervisors[key]
