"""Session hooks carried across a graceful restart, through systemd's file descriptor store.

A hooked process group's GPU session calls wait on its seccomp listener, which the daemon holds; once the last copy
of the listener closes, every one of those calls fails with ENOSYS for good. So at a graceful stop under systemd the
daemon answers every call it received, writes which tenant each listener serves (with that tenant's cgroup and the
user that handed it over: a uid, or a pod by its pid namespace) to the state directory under a name of this stop's
own, and hands each listener to systemd's store under that name (FDSTORE=1; FileDescriptorStoreMax= in the unit).
Calls made meanwhile wait in the kernel. The next start takes the list (removing it), serves again each stored
listener the list names whose tenant still exists over the same cgroup (a tenant of that name over another cgroup,
after a change of the configuration, is not the one whose processes hold the listener), and closes every other one;
then it has systemd drop every stored copy (FDSTOREREMOVE=1), so that the daemon's copy is again the last: a later
crash or stop fails its calls as before, and none ever waits for good.

After a crash no list is written: a listener stored by no graceful stop cannot be known to have every received call
answered (a caller would wait for an answer nobody can give), so it is closed. The stored listeners are taken first
thing at start, before anything that can fail: a start that fails closes them (ENOSYS), so a start failing over and
over never keeps a call waiting. Only a stop asked for (SIGTERM) of a daemon that was serving stores them.
`systemctl stop` releases the store, which closes every listener in it (ENOSYS, as without the store). Without
systemd (`NOTIFY_SOCKET` unset: by hand, the Kubernetes DaemonSet) nothing is carried.

A carried listener's books start empty: sessions its processes opened before the restart are not counted against
caps, and memory they allocate under GPU devices opened before it is refused (memory.MemoryBook's carried_before).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from unisched.enforce.seccomp.hooks import KeptListener
from unisched.policy import PolicyError, validate_tenant_name
from unisched.policy.callers import Caller, Pod
from unisched.scheduler.durable import replace_durably
from unisched.sdnotify import Notifier, passed_fds
from unisched.transport.identity import CONTAINED_ROOT

__all__ = ["CARRIED_FILE", "FD_NAME_PREFIX", "Carried", "ListenerCarry", "is_seccomp_listener"]

log = structlog.get_logger("unisched.carry")

CARRIED_FILE: Final = "hooks-carried.json"
"""In the state directory: the listeners the last graceful stop handed to systemd's store, by name."""
FD_NAME_PREFIX: Final = "unisched-hook-"
"""Every stored listener's name starts so: `unisched-hook-<this stop's token>-<n>`."""
MAX_FILE_BYTES: Final = 4 << 20
"""The most of the list file read: far past the store's FileDescriptorStoreMax= entries of about 100 bytes each."""
STORE_DEADLINE_S: Final = 5.0
"""How long a stop may spend handing listeners to systemd, all together (TimeoutStopSec is 30 s): any local process
can fill PID 1's notify queue, and each message may wait for room. Those not sent by then fail as without a store."""
REMOVE_DEADLINE_S: Final = 2.0
"""How long a start may spend asking systemd to drop its stored copies, all together (the same queue); a copy not
dropped is closed when the unit stops, and lists nothing the next start would serve."""
MAX_UID: Final = (1 << 32) - 2
MAX_INODE: Final = (1 << 64) - 1


@dataclass(frozen=True)
class Carried:
    """One listener the last graceful stop stored: its name in the store, its tenant and that tenant's cgroup then,
    and who handed it over (its per-user bounds hold again after the restart: a pod's pid namespace outlives it)."""

    name: str
    tenant: str
    user: Caller
    cgroup: str

    def listed(self) -> dict[str, object]:
        """Its entry in the list: the user as "uid" (a number) or "pod" (its pid namespace's inode)."""
        who = {"pod": self.user.pidns} if isinstance(self.user, Pod) else {"uid": self.user}
        return {"name": self.name, "tenant": self.tenant, **who, "cgroup": self.cgroup}


def is_seccomp_listener(fd: int) -> bool:
    """Whether `fd` is a seccomp notification listener (what systemd passes under our names must be one)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:seccomp notify"
    except OSError:
        return False


def _parse(body: bytes) -> dict[str, Carried]:
    """The list's entries; malformed ones dropped (their listeners are then closed: never worse than no list)."""
    data = json.loads(body)
    entries = data.get("listeners") if isinstance(data, dict) else None
    found: dict[str, Carried] = {}
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, dict):
            continue
        name, tenant, cgroup = e.get("name"), e.get("tenant"), e.get("cgroup")
        user = _user(e.get("uid"), e.get("pod"))
        if not (isinstance(name, str) and name.startswith(FD_NAME_PREFIX) and isinstance(tenant, str)
                and isinstance(cgroup, str) and cgroup and user is not None):
            continue
        try:
            validate_tenant_name(tenant)
        except PolicyError:
            continue
        found[name] = Carried(name, tenant, user, cgroup)
    return found


def _user(uid: object, pod: object) -> Caller | None:
    """Who an entry says handed its listener over: a uid, or a pod (one of the two); None when it says neither
    well."""
    if pod is None and isinstance(uid, int) and not isinstance(uid, bool) and (0 <= uid <= MAX_UID or uid == CONTAINED_ROOT):
        return uid
    if uid is None and isinstance(pod, int) and not isinstance(pod, bool) and 0 < pod <= MAX_INODE:
        return Pod(pod)
    return None


class ListenerCarry:
    """Stores the hooks' listeners at a graceful stop and takes them back at the next start (the module docstring)."""

    def __init__(self, notifier: Notifier, state_dir: str | Path, env: MutableMapping[str, str] | None = None,
                 passed: Callable[[], list[tuple[int, str]]] | None = None) -> None:
        """`passed`: the fds systemd passed this start, with their names (tests stand in for LISTEN_FDS)."""
        self.notifier = notifier
        self.path = Path(state_dir) / CARRIED_FILE
        self._env = os.environ if env is None else env
        self._passed = passed or (lambda: passed_fds(self._env))

    @property
    def enabled(self) -> bool:
        """Under systemd (NOTIFY_SOCKET): only there is there a store to keep listeners in."""
        return self.notifier.enabled

    def _room(self) -> int | None:
        """How many fds the store takes ($FDSTORE, systemd >= 254; None: not said, so as many as are offered)."""
        try:
            return max(0, int(self._env.get("FDSTORE", "")))
        except ValueError:
            return None

    def keep(self, listeners: Sequence[KeptListener], cgroup_of: Callable[[str], str | None]) -> int:
        """At a graceful stop: list, then store, each listener (up to the store's room; a runtime's, uid 0, before
        users' runs), within STORE_DEADLINE_S; every fd here is closed afterwards, whether stored or not (one not
        stored: its calls fail with ENOSYS). `cgroup_of(tenant)`: the tenant's cgroup now (None: it is gone, and its
        listeners are not kept). The number sent to the store."""
        room = self._room()
        known = [(k, cgroup) for k in listeners if (cgroup := cgroup_of(k.tenant))]
        ordered = sorted(known, key=lambda kc: kc[0].user != 0)
        offered = ordered if room is None else ordered[:room]
        token = secrets.token_hex(6)
        entries = [Carried(f"{FD_NAME_PREFIX}{token}-{i}", k.tenant, k.user, cgroup) for i, (k, cgroup) in enumerate(offered)]
        stored = 0
        try:
            if entries:
                body = json.dumps({"listeners": [e.listed() for e in entries]}, separators=(",", ":")).encode()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                replace_durably(self.path, body)  # before the fds: a stored listener the list does not name is closed
                deadline = time.monotonic() + STORE_DEADLINE_S
                for entry, (kept, _) in zip(entries, offered, strict=True):
                    if not self.notifier.store_fd(kept.fd, entry.name, max(0.0, deadline - time.monotonic())):
                        break  # systemd's queue stayed full: the rest fail as without the store
                    stored += 1
        except OSError as e:
            log.error("cannot carry the session hooks over the restart; their calls fail until their processes are "
                      "restarted", error=str(e))
        finally:
            for k in listeners:
                with contextlib.suppress(OSError):
                    os.close(k.fd)
        if listeners:
            log.info("session hooks handed to systemd for the next start", stored=stored, listeners=len(listeners),
                     tenants=sorted({k.tenant for k, _ in offered[:stored]}))
        return stored

    def take(self) -> list[tuple[int, Carried]]:
        """At start, before anything that can fail: the stored listeners the last graceful stop listed, each an fd
        that is now the caller's; every other seccomp listener passed, and every other fd passed under our names,
        closed; every stored copy dropped from systemd's store (within REMOVE_DEADLINE_S); the list removed."""
        listed = self._take_list()
        taken: list[tuple[int, Carried]] = []
        dropped: list[str] = []
        for fd, name in self._passed():
            entry = listed.get(name)
            listener = is_seccomp_listener(fd)
            if entry is not None and listener:
                taken.append((fd, entry))
                dropped.append(name)
            elif listener or name.startswith(FD_NAME_PREFIX):  # (a listener under a name not ours: a store's leftover)
                os.close(fd)
                dropped.append(name)
        if len(taken) < len(listed):
            log.warning("fewer session hooks came back from systemd than the last stop handed over; the others' calls "
                        "fail with ENOSYS", listed=len(listed), back=len(taken))
        if len(dropped) > len(taken):
            log.warning("stored session hooks no graceful stop listed were closed (their calls fail with ENOSYS)",
                        closed=len(dropped) - len(taken))
        deadline = time.monotonic() + REMOVE_DEADLINE_S
        for name in dict.fromkeys(dropped):
            self.notifier.remove_stored(name, max(0.0, deadline - time.monotonic()))
        return taken

    def _take_list(self) -> Mapping[str, Carried]:
        """The list the last graceful stop wrote, removed as it is read: a later start never reads it again. Only a
        regular file of the daemon's own user that no other may write counts."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.error("cannot read the list of carried session hooks", path=str(self.path), error=str(e))
            return {}
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or not stat.S_ISREG(st.st_mode):
                    log.error("the list of carried session hooks is not the daemon's own file; none is carried",
                              path=str(self.path))
                    return {}
                body = f.read(MAX_FILE_BYTES + 1)
        finally:
            with contextlib.suppress(OSError):
                self.path.unlink()
        if len(body) > MAX_FILE_BYTES:
            log.error("the list of carried session hooks is too large; none is carried", path=str(self.path))
            return {}
        try:
            return _parse(body)
        except (ValueError, RecursionError) as e:
            log.error("the list of carried session hooks is damaged; none is carried", path=str(self.path),
                      error=str(e))
            return {}

