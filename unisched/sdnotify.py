"""sd_notify without libsystemd: tell systemd (Type=notify) when the daemon serves, what it is doing, and
that its slice loop is alive (WatchdogSec); keep file descriptors in its store across a restart (FDSTORE), and take
them back at the next start (LISTEN_FDS). One datagram per message to $NOTIFY_SOCKET; a name starting with '@' is in
the abstract namespace. Without $NOTIFY_SOCKET every call does nothing, so the daemon run by hand, in a test or in a
container behaves the same."""

from __future__ import annotations

import array
import os
import socket
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Notifier", "Watchdog", "passed_fds", "watchdog_interval_s"]

READY_WAIT_S = 1.0
"""How long READY and STOPPING may wait for room in systemd's queue. Every other message is sent without waiting
(dropped when the queue is full): any local process can fill PID 1's notify socket, and the watchdog's pings are
sent from the event loop."""
WATCHDOG_FRACTION = 0.5
"""Ping at half of WATCHDOG_USEC, as sd_watchdog_enabled(3) advises: one late slice never trips systemd."""


def _address(name: str) -> str | bytes:
    return b"\0" + name[1:].encode() if name.startswith("@") else name


@dataclass
class Notifier:
    """Sends sd_notify messages; a no-op when systemd did not ask for them (no NOTIFY_SOCKET)."""

    path: str | None
    _sock: socket.socket | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        return cls(env.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def send(self, wait_s: float = 0.0, fds: Sequence[int] = (), **fields: str | int) -> bool:
        """Send KEY=VALUE lines in one datagram (with `fds` attached), waiting at most `wait_s` for room; False (never
        an exception) when systemd cannot be reached or its queue stays full: a lost notification must not take the
        daemon down."""
        if self.path is None:
            return False
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.settimeout(wait_s)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            self._sock.sendmsg([message], rights, 0, _address(self.path))  # (socket.send_fds drops the address)
        except OSError:
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY_WAIT_S, READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def stopping(self, status: str) -> bool:
        return self.send(READY_WAIT_S, STOPPING=1, STATUS=status)

    def store_fd(self, fd: int, name: str, wait_s: float = READY_WAIT_S) -> bool:
        """FDSTORE=1: systemd keeps a copy of `fd` under `name` and passes it to the service's next start
        (`passed_fds`) as long as the unit is restarting rather than stopped, and drops it when the fd hangs up. True
        says the message was sent, not that it was kept: systemd drops it where the unit lacks
        FileDescriptorStoreMax=, when the store is full, or when it takes the fd for one it holds already."""
        return self.send(wait_s, [fd], FDSTORE=1, FDNAME=name)

    def remove_stored(self, name: str, wait_s: float = READY_WAIT_S) -> bool:
        """FDSTOREREMOVE=1: systemd closes its copies of the fds stored under `name`."""
        return self.send(wait_s, FDSTOREREMOVE=1, FDNAME=name)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


MAX_PASSED_FDS = 65536
"""The most fds `passed_fds` believes LISTEN_FDS about (the unit's LimitNOFILE): a larger count is not systemd's."""


def passed_fds(env: MutableMapping[str, str] | None = None, pid: int | None = None) -> list[tuple[int, str]]:
    """sd_listen_fds_with_names: the fds systemd passed this process at its start (3 on, LISTEN_FDS of them) with
    their names (LISTEN_FDNAMES; "unknown" where none), each close-on-exec from now on. None unless LISTEN_PID names
    this process: variables inherited from a parent started by systemd are not ours. The variables are removed
    either way, so no child takes them for its own."""
    env = os.environ if env is None else env
    owner, count, names = (env.pop(k, "") for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"))
    try:
        mine, n = int(owner) == (os.getpid() if pid is None else pid), int(count)
    except ValueError:
        return []
    if not mine or not 0 < n <= MAX_PASSED_FDS:
        return []
    labels = names.split(":") if names else []
    labels = labels if len(labels) == n else ["unknown"] * n
    passed = []
    for i, label in enumerate(labels):
        fd = 3 + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue  # not open after all
        passed.append((fd, label))
    return passed


def watchdog_interval_s(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """How often to ping, from WATCHDOG_USEC (and WATCHDOG_PID, when systemd names another process); None
    when no watchdog is configured."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    owner = env.get("WATCHDOG_PID")
    if usec <= 0 or (owner and owner != str(os.getpid() if pid is None else pid)):
        return None
    return usec / 1e6 * WATCHDOG_FRACTION


@dataclass
class Watchdog:
    """Called after every slice that ran; pings at most once per interval. A loop that stops running
    slices stops the pings, and systemd restarts the daemon (whose start thaws every tenant first)."""

    notifier: Notifier
    interval_s: float
    status: Callable[[], str] = lambda: ""
    clock: Callable[[], float] = time.monotonic
    _last: float | None = field(default=None, init=False)

    def alive(self) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            return
        self._last = now
        text = self.status()
        if text:
            self.notifier.send(WATCHDOG=1, STATUS=text)
        else:
            self.notifier.send(WATCHDOG=1)
