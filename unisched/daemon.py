"""The composition root: from a parsed config, build every real part of the daemon and run it.

The cli parses flags and the config file and calls `check_host` (`serve --check-config`) or `run` (`serve`);
this module alone knows which concrete parts make a daemon (NVML or no GPU signal, the cgroup driver, the record
of governed cgroups, eBPF device admission, MPS, the state store, the engine, the gRPC server) and the order
they start in:

1. what a dead daemon left frozen was thawed before this runs (the cli's first step, `thaw_orphans`);
2. host checks against the config (freezer, GPUs, declared cgroups), touching nothing;
3. the sockets' locks (gRPC and lease stream), so a second daemon stops here while the first serves;
4. logging, then the daemon's nice value (before any thread starts: threads inherit it);
5. `--delegated`: move into systemd's delegated leaf, tenants below `<unit>/tenants`;
6. the record of what this daemon may freeze, written before it freezes anything;
7. the cgroup driver, devices, MPS, the state store, the engine, and the server, until a signal stops it.

A failure raises StartError with the exit code the cli returns: 2 for a bad value in the config, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import structlog

from unisched.enforce.cgroups import CgroupDriver, CgroupError, detect_driver
from unisched.enforce.delegate import DelegationError, enter_delegated_leaf
from unisched.enforce.devices import BpfDeviceAdmission, DeviceAdmission, device_admission_unavailable_reason
from unisched.enforce.governed import GovernedRecord, Orphans, RecordError, governed_dir
from unisched.enforce.mps import MpsControl, MpsError, NvidiaMpsControl, mps_unavailable_reason
from unisched.logs import configure_logging
from unisched.scheduler.clock import SystemClock
from unisched.scheduler.config import ConfigError, DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.hostcheck import check_declared_cgroups, check_gpus
from unisched.scheduler.state import StateStore
from unisched.sdnotify import Notifier
from unisched.telemetry import GpuTelemetry, NoGpuTelemetry
from unisched.telemetry.standin import CpuStandIn
from unisched.transport.carry import Carried, ListenerCarry
from unisched.transport.claim import LockSquatted, SocketClaim, SocketInUse, claim_socket, claim_state_dir
from unisched.transport.server import serve

__all__ = ["EXIT_BAD_CONFIG", "EXIT_FAILED", "StartError", "check_host", "log_orphans", "run", "say_orphans"]

EXIT_BAD_CONFIG = 2
"""A value in the config or flags is wrong for this host: the operator fixes the config, not the host."""
EXIT_FAILED = 1
"""Anything else that stopped the daemon (a busy socket, a missing kernel feature, an I/O error)."""


class StartError(Exception):
    """The daemon did not start, or stopped on a fault; the message says why (the cli prefixes `unisched serve: `)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _log() -> structlog.stdlib.BoundLogger:
    return structlog.get_logger("unisched")  # type: ignore[no-any-return]


def say_orphans(orphans: Orphans | None) -> None:
    """Before logging is configured (an early error exit): what the first step thawed, on stderr."""
    if orphans is not None and orphans.thawed:
        print(f"unisched serve: thawed cgroups left frozen by a daemon that is gone: {', '.join(orphans.thawed)}",
              file=sys.stderr)
    for problem in orphans.problems if orphans is not None else ():
        print(f"unisched serve: {problem}", file=sys.stderr)


def log_orphans(orphans: Orphans | None) -> None:
    """Once logging is configured: what the first step thawed, in the daemon's log."""
    if orphans is not None and orphans.thawed:
        _log().warning("thawed cgroups left frozen by a previous run", cgroups=list(orphans.thawed),
                       records=orphans.records)
    for problem in orphans.problems if orphans is not None else ():
        _log().error("record of governed cgroups", problem=problem)


def _open_telemetry(config: DaemonConfig) -> tuple[GpuTelemetry, bool]:
    """NVML where configured and present (True), else no GPU signal (False); a CPU core when asked to stand in."""
    if config.cpu_stand_in:
        driver = detect_driver(config.cgroup_driver, config.cgroup_subtree, create=False)
        return CpuStandIn(lambda: driver.cpu_usage_s("/" + driver.subtree), SystemClock().monotonic), False
    if config.nvml:
        from unisched.telemetry.nvml import open_nvml

        opened = open_nvml()
        if opened is not None:
            return opened, True
    return NoGpuTelemetry(), False


def _check_host(config: DaemonConfig, telemetry: GpuTelemetry) -> None:
    """What the config names on this host (the cgroup freezer, GPUs, declared cgroups), touching nothing."""
    try:
        driver = detect_driver(config.cgroup_driver, config.cgroup_subtree, create=False)
        check_gpus(config, [g.index for g in telemetry.gpus()])
        check_declared_cgroups(config, driver, os.getpid())
    except CgroupError as e:
        raise StartError(str(e)) from e
    except ConfigError as e:
        raise StartError(str(e), EXIT_BAD_CONFIG) from e


def _preflight(config: DaemonConfig) -> tuple[GpuTelemetry, bool]:
    """The GPU signal, opened, once the host holds what the config names (closed again when it does not)."""
    if config.mps and (why := mps_unavailable_reason()) is not None:
        raise StartError(f"--mps: {why}")  # before NVML opens: MPS alone decides this
    telemetry, nvml = _open_telemetry(config)
    try:
        _check_host(config, telemetry)
    except StartError:
        telemetry.close()
        raise
    return telemetry, nvml


def check_host(config: DaemonConfig) -> list[int]:
    """`serve --check-config`: the host checks alone, starting and changing nothing; the GPU indices seen."""
    telemetry, _ = _preflight(config)
    try:
        return [g.index for g in telemetry.gpus()]
    finally:
        telemetry.close()


def _claim(config: DaemonConfig) -> list[SocketClaim]:
    """Each socket the daemon serves on (gRPC, lease stream), and its state directory, locked for its life. A socket's
    lock that only processes that cannot be a daemon hold (a pod's: the sockets' directory is mounted into pods) is
    taken from them once the state directory's lock is held, so that two daemons starting at once do not both."""
    claims: list[SocketClaim] = []
    squatted: list[str] = []
    try:
        for path in (config.socket, config.lease_socket):
            try:
                claims.append(claim_socket(path, replace=False))
            except LockSquatted:
                squatted.append(path)
        claims.append(claim_state_dir(config.state_dir))
        claims += [claim_socket(path) for path in squatted]
    except (SocketInUse, OSError) as e:
        for claim in claims:
            claim.release()
        raise StartError(str(e)) from e
    return claims


def set_own_nice(nice: int) -> str | None:
    """Give every thread of this process the nice value (Linux nice is per thread: threads started later inherit
    it from their creator). Called before the engine's and gRPC's threads start. None, or why it failed."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as e:
            return f"{e.strerror} (lowering nice needs root or CAP_SYS_NICE)"
    return None


def _enter_delegated(config: DaemonConfig) -> DaemonConfig:
    """systemd's Delegate=yes: the daemon moves into the leaf <unit>/daemon and governs <unit>/tenants."""
    try:
        probe = detect_driver(config.cgroup_driver, config.cgroup_subtree, create=False)
        return config.with_overrides(cgroup_subtree=enter_delegated_leaf(probe.kind, probe.mount))
    except (DelegationError, CgroupError, ConfigError) as e:
        raise StartError(f"--delegated: {e}") from e


def _open_record(config: DaemonConfig) -> GovernedRecord:
    try:
        return GovernedRecord(governed_dir(), config.cgroup_subtree)
    except RecordError as e:
        raise StartError(str(e)) from e


def _open_driver(config: DaemonConfig, record: GovernedRecord) -> CgroupDriver:
    """The cgroup driver, noting each cgroup in the record before it first freezes it."""
    try:
        driver = detect_driver(config.cgroup_driver, config.cgroup_subtree)
    except CgroupError as e:
        raise StartError(str(e)) from e
    driver.before_freeze = record.note
    return driver


def _device_admission() -> DeviceAdmission | None:
    """cgroup eBPF device admission where the kernel has it; the daemon runs without it otherwise."""
    reason = device_admission_unavailable_reason()
    if reason is None:
        return BpfDeviceAdmission()
    _log().warning("device admission (cgroup eBPF) unavailable", reason=reason)
    return None


def _mps_control(config: DaemonConfig) -> MpsControl | None:
    if not config.mps:
        return None
    return NvidiaMpsControl(Path(config.socket).parent / "mps", Path(config.state_dir) / "mps-log")


def _serve(config: DaemonConfig, telemetry: GpuTelemetry, nvml: bool, delegated: bool,
           carried: list[tuple[int, Carried]]) -> None:
    """Steps 5 to 7, with the socket claimed and logging configured; returns when a signal stopped the daemon."""
    if delegated:
        config = _enter_delegated(config)
    record = _open_record(config)
    driver = _open_driver(config, record)
    if delegated:
        _log().info("delegated", daemon_cgroup=driver.cgroup_of(os.getpid()), tenants_subtree=config.cgroup_subtree)
    devices = _device_admission()
    mps = _mps_control(config)
    try:
        store = StateStore(config.state_dir, config.cgroup_subtree)
        engine = Scheduler(config, driver, telemetry, store, SystemClock(), devices, mps)
        serve(config, engine, nvml, carried)
    except ConfigError as e:
        raise StartError(str(e), EXIT_BAD_CONFIG) from e
    except MpsError as e:
        raise StartError(f"--mps: {e}") from e
    except (CgroupError, OSError) as e:
        raise StartError(str(e)) from e
    if engine.left_frozen:
        _log().error("some cgroups could not be thawed; the record of what this daemon governs is kept, and the next "
                     "start thaws them", record=str(record.path))
    record.close(keep=engine.left_frozen)  # removed only when everything it froze was thawed


def run(config: DaemonConfig, *, delegated: bool = False, orphans: Orphans | None = None) -> None:
    """Start the daemon in the order of this module's docstring and serve until a signal stops it.
    `orphans`: what the cli's first step thawed, reported on stderr on an early failure, else in the log.

    Before any of it, the session hooks systemd kept over a restart are taken (transport/carry.py), so that a start
    that fails closes them as it exits, and their calls fail at once rather than wait through restart after
    restart. From there they are the seccomp agent's."""
    _run(config, delegated, orphans, ListenerCarry(Notifier.from_env(), config.state_dir).take())


def _run(config: DaemonConfig, delegated: bool, orphans: Orphans | None, carried: list[tuple[int, Carried]]) -> None:
    try:
        telemetry, nvml = _preflight(config)
    except StartError:
        say_orphans(orphans)
        raise
    try:
        try:
            claims = _claim(config)
        except StartError:
            say_orphans(orphans)
            raise
        try:
            configure_logging(config.log_format, config.log_level)
            log_orphans(orphans)
            if (why := set_own_nice(config.nice)) is not None:
                _log().warning("cannot set the daemon's nice value", nice=config.nice, reason=why)
            _serve(config, telemetry, nvml, delegated, carried)
        finally:
            for claim in claims:
                claim.release()
    finally:
        telemetry.close()
