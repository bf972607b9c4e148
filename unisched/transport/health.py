"""/healthz and /readyz, served beside /metrics: what a kubelet's probes (and a person with curl) ask.

Live (/healthz): the engine's loop finished a slice within LIVE_SLICES slices' time. The loop calls
`Heartbeat.beat()` after every slice that ran (as it feeds systemd's watchdog), and the HTTP thread compares the
last beat with the clock, so a loop that hangs, or whose slices keep failing, turns /healthz to 503 while the
HTTP server itself still answers. Ready (/readyz): the daemon's socket is served, its cgroup hierarchy is
mounted, and the GPU signal is known (NVML open, or off by the config: "nvml: unavailable" is then ready).
Each answer is plain text, one line per check, 200 when all pass and 503 naming what failed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from unisched.enforce.cgroups import cgroup_mount_problem
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import Scheduler

__all__ = ["LIVE_SLICES", "Check", "Health", "Heartbeat", "Result", "beats", "cgroups_check", "nvml_check", "probes",
           "socket_check"]

LIVE_SLICES = 100
"""A loop is stalled once this many slices' time passed without a slice (5 s at the default 50 ms): a busy host
delays a slice by a few of them, not by a hundred, and the kubelet probes every 10 s anyway."""

Check = Callable[[], tuple[bool, str]]
"""One readiness check: (passed, its line: what it looked at and, on failure, why)."""


@dataclass(frozen=True)
class Result:
    ok: bool
    body: str

    @property
    def status(self) -> int:
        return 200 if self.ok else 503


class Heartbeat:
    """When the engine's loop last finished a slice, on an injected monotonic clock."""

    def __init__(self, clock: Callable[[], float], slice_s: float) -> None:
        self._clock = clock
        self.limit_s = LIVE_SLICES * slice_s
        self._last: float | None = None

    def beat(self) -> None:
        self._last = self._clock()  # one float assignment: read whole from the HTTP thread

    def live(self) -> Result:
        last = self._last
        if last is None:
            return Result(False, "loop: no slice has run yet\n")
        age = self._clock() - last
        if age > self.limit_s:
            return Result(False, f"loop: stalled: last slice {age:.1f} s ago (limit {self.limit_s:.1f} s)\n")
        return Result(True, f"loop: ok (last slice {age:.2f} s ago)\n")


class Health:
    """Liveness from the heartbeat, readiness from a list of checks (each answers in microseconds)."""

    def __init__(self, heartbeat: Heartbeat, checks: Sequence[Check]) -> None:
        self.heartbeat = heartbeat
        self.checks = tuple(checks)

    def live(self) -> Result:
        return self.heartbeat.live()

    def ready(self) -> Result:
        results = [_run(check) for check in self.checks]
        return Result(all(ok for ok, _ in results), "".join(f"{line}\n" for _, line in results))


def _run(check: Check) -> tuple[bool, str]:
    try:
        return check()
    except Exception as e:  # a check that raises is a failed check, not a failed probe server
        return False, f"check failed: {type(e).__name__}: {e}"


def socket_check(path: str, serving: Callable[[], bool]) -> Check:
    """The daemon's socket: being served, and still in place (a cleaner that removed it cuts every client off)."""

    def check() -> tuple[bool, str]:
        if not serving():
            return False, f"socket: {path} not served yet"
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            return False, f"socket: {path}: {e.strerror or e}"
        if not stat.S_ISSOCK(mode):
            return False, f"socket: {path} is not a socket"
        return True, f"socket: ok ({path})"

    return check


def cgroups_check(kind: str, mount: Path) -> Check:
    """The cgroup hierarchy the daemon freezes in is (still) a mounted cgroup filesystem."""

    def check() -> tuple[bool, str]:
        why = cgroup_mount_problem(mount)
        return why is None, f"cgroups: ok ({kind} at {mount})" if why is None else f"cgroups: {why}"

    return check


def nvml_check(wanted: bool, opened: bool, gpus: Callable[[], int]) -> Check:
    """The GPU signal is known: NVML open, or off by the config (ready, without a GPU signal)."""

    def check() -> tuple[bool, str]:
        if opened:
            return True, f"nvml: ok ({gpus()} GPUs)"
        if not wanted:
            return True, "nvml: unavailable (off by the config: nvml = false)"
        return False, "nvml: unavailable, and the config wants it (nvml = true): is the NVIDIA driver loaded?"

    return check


def probes(config: DaemonConfig, engine: Scheduler, nvml: bool, serving: Callable[[], bool]) -> Health:
    """The daemon's probes: its loop on the engine's clock, its socket, cgroup hierarchy and GPU signal."""
    driver = engine.driver
    return Health(
        Heartbeat(engine.clock.monotonic, config.slice_ms / 1000.0),
        [
            socket_check(config.socket, serving),
            cgroups_check(driver.kind, Path(driver.mount)),
            nvml_check(config.nvml, nvml, lambda: len(engine.telemetry.gpus())),
        ],
    )


def beats(heartbeat: Heartbeat, then: Callable[[], None] | None) -> Callable[[], None]:
    """What the engine's loop calls after each slice that ran: the heartbeat, then `then` (systemd's watchdog)."""
    if then is None:
        return heartbeat.beat

    def alive() -> None:
        heartbeat.beat()
        then()

    return alive
