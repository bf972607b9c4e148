"""Session hooks carried across a graceful restart, through systemd's file descriptor store.

A hooked process group's GPU session calls wait on its seccomp listener, which the daemon holds; once the last copy
of the listener closes, every one of those calls fails with ENOSYS for good. So at a graceful stop under systemd the
daemon answers every call it received, writes which tenant (and uid) each listener serves to the state directory
under a name of this stop's own, and hands each listener to systemd's store under that name (FDSTORE=1;
FileDescriptorStoreMax= in the unit). Calls made meanwhile wait in the kernel. The next start takes the list (removing
it), serves again each stored listener the list names whose tenant still exists, and closes every other one; then
it has systemd drop every stored copy (FDSTOREREMOVE=1), so that the daemon's copy is again the last: a later crash
or stop fails its calls as before, and none ever waits for good.

After a crash no list is written: a listener stored by no graceful stop cannot be known to have every received call
answered (a caller would wait for an answer nobody can give), so it is closed. `systemctl stop` releases the store,
which closes every listener in it (ENOSYS, as without the store). Without systemd (`NOTIFY_SOCKET` unset: by hand,
the Kubernetes DaemonSet) nothing is carried.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

import structlog

from unisched.enforce.seccomp.hooks import KeptListener
from unisched.policy import PolicyError, validate_tenant_name
from unisched.scheduler.durable import replace_durably
from unisched.sdnotify import Notifier, passed_fds

__all__ = ["CARRIED_FILE", "FD_NAME_PREFIX", "Carried", "ListenerCarry", "is_seccomp_listener"]

log = structlog.get_logger("unisched.carry")

CARRIED_FILE: Final = "hooks-carried.json"
"""In the state directory: the listeners the last graceful stop handed to systemd's store, by name."""
FD_NAME_PREFIX: Final = "unisched-hook-"
"""Every stored listener's name starts so: `unisched-hook-<this stop's token>-<n>`."""
MAX_FILE_BYTES: Final = 4 << 20
"""The most of the list file read: far past the store's FileDescriptorStoreMax= entries of about 100 bytes each."""


@dataclass(frozen=True)
class Carried:
    """One listener the last graceful stop stored: its name in the store, its tenant, and who handed it over."""

    name: str
    tenant: str
    uid: int


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
        name, tenant, uid = e.get("name"), e.get("tenant"), e.get("uid")
        if not (isinstance(name, str) and name.startswith(FD_NAME_PREFIX) and isinstance(tenant, str)
                and isinstance(uid, int) and not isinstance(uid, bool)):
            continue
        try:
            validate_tenant_name(tenant)
        except PolicyError:
            continue
        found[name] = Carried(name, tenant, uid)
    return found


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

    def keep(self, listeners: Sequence[KeptListener]) -> int:
        """At a graceful stop: list, then store, each listener (up to the store's room); every fd here is closed
        afterwards, whether stored or not (one not stored: its calls fail with ENOSYS). The number stored."""
        room = self._room()
        offered = list(listeners) if room is None else list(listeners)[:room]
        token = secrets.token_hex(6)
        entries = [Carried(f"{FD_NAME_PREFIX}{token}-{i}", k.tenant, k.uid) for i, k in enumerate(offered)]
        stored = 0
        try:
            if entries:
                body = json.dumps({"listeners": [asdict(e) for e in entries]}, separators=(",", ":")).encode()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                replace_durably(self.path, body)  # before the fds: a stored listener the list does not name is closed
                for entry, kept in zip(entries, offered, strict=True):
                    if not self.notifier.store_fd(kept.fd, entry.name):
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
                     tenants=sorted({k.tenant for k in offered[:stored]}))
        return stored

    def take(self) -> list[tuple[int, Carried]]:
        """At start: the stored listeners the last graceful stop listed, each an fd that is now the caller's; every
        other stored listener closed; every stored copy dropped from systemd's store; the list removed."""
        listed = self._take_list()
        ours = [(fd, name) for fd, name in self._passed() if name.startswith(FD_NAME_PREFIX)]
        taken: list[tuple[int, Carried]] = []
        for fd, name in ours:
            entry = listed.get(name)
            if entry is not None and is_seccomp_listener(fd):
                taken.append((fd, entry))
                continue
            log.warning("a stored session hook no graceful stop listed is closed (its calls fail with ENOSYS)",
                        name=name)
            os.close(fd)
        for name in dict.fromkeys(n for _, n in ours):
            self.notifier.remove_stored(name)
        return taken

    def _take_list(self) -> Mapping[str, Carried]:
        """The list the last graceful stop wrote, removed as it is read: a later start never reads it again."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.error("cannot read the list of carried session hooks", path=str(self.path), error=str(e))
            return {}
        try:
            with os.fdopen(fd, "rb") as f:
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

