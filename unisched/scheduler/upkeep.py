"""Once a second, from the tenants' process lists: GPU memory against caps, whether NVML lists a hooked tenant
on a GPU, NVENC session counts against NVML's, each tenant's GPU seconds per CPU second (scheduler.rates), and
`unisched run` tenants whose last process exited."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import structlog

from unisched.scheduler.admission import (
    apply_devices,
    engines_changed,
)
from unisched.scheduler.context import Context, save_soon
from unisched.scheduler.rates import update_rates
from unisched.scheduler.reporting import log_shares
from unisched.scheduler.roster import (
    drop,
)
from unisched.scheduler.tenant import (
    Tenant,
)
from unisched.telemetry import GpuSample

__all__ = ["MEMORY_CHECK_S", "memory_due", "update_memory"]

log = structlog.get_logger("unisched.scheduler")
MEMORY_CHECK_S = 1.0


def memory_due(c: Context, now: float) -> bool:
    """Whether a tick at `now` checks memory (and so reads the tenants' process lists)."""
    return now - c.memory_at >= MEMORY_CHECK_S


def update_memory(c: Context, samples: Mapping[int, GpuSample], now: float,
                  read_pids: Mapping[str, list[int]] | None = None) -> None:
    """Per-tenant GPU memory against caps, whether NVML lists a hooked tenant on a GPU (see `_off_gpu`), and
    which `unisched run` tenants have emptied, at most once a second: it reads tenants' process lists (`read_pids`:
    those read off the loop for this tick, by cgroup; a cgroup not there is read here)."""
    if not memory_due(c, now):
        return
    c.memory_at = now
    read: dict[str, list[int]] = dict(read_pids or {})

    def pids_of(t: Tenant) -> list[int]:  # each cgroup's process list read once for all three checks
        got = read.get(t.cgroup)
        if got is None:
            got = read[t.cgroup] = c.driver.pids(t.cgroup)
        return got

    _reconcile_encoders(c, samples, pids_of)
    update_rates(c, samples, now, pids_of)
    by_pid: dict[int, int] = {}
    for s in samples.values():
        for pid, used in s.process_memory.items():
            by_pid[pid] = by_pid.get(pid, 0) + used
    lists = [s.gpu_pids for s in samples.values() if s.ok and s.gpu_pids is not None]
    # a GPU NVML cannot list processes for: every hooked tenant may be on it
    listed = frozenset().union(*lists) if lists and len(lists) == len(samples) else None
    for t in c.tenants.values():
        if t.missing or not (by_pid or t.hooked):
            continue
        pids = pids_of(t) if by_pid or listed is not None else []
        if t.hooked:
            t.nvml_on_gpu = listed is None or any(pid in listed for pid in pids)
        if not by_pid:
            continue
        t.memory_bytes = sum(by_pid.get(pid, 0) for pid in pids)
        cap = t.limits.memory_bytes
        over = cap is not None and not t.hooked and t.memory_bytes > cap  # hooked: capped at each allocation
        if over != t.over_memory:
            t.over_memory = over
            if over:
                t.refusals["memory"] = t.refusals.get("memory", 0) + 1
            log.warning("memory cap", tenant=t.name, memory_bytes=t.memory_bytes, cap=cap, over=over)
            apply_devices(c, t)
    _reap_emptied(c, pids_of)


def _reap_emptied(c: Context, pids_of: Callable[[Tenant], list[int]]) -> None:
    """Remove tenants `unisched run` made whose last process has exited (once a second, from the same process
    lists as the memory checks). Never one with a lease session open: its client talks to it even while its
    cgroup shows no process (a client outside the cgroup cannot hold one, but the session is its claim). Nor one
    whose registering caller is still being moved in (`Tenant.moving`). The lists may have been read off the loop
    before the tick, and a caller moved in since: a tenant is removed only when its cgroup is empty read here."""
    gone = [t for t in c.tenants.values()
            if t.ephemeral and not t.moving and not c.leases.cooperative(t.name)
            and (t.missing or (not pids_of(t) and not c.driver.pids(t.cgroup)))]
    for t in gone:
        charged = drop(c, t)
        log.info("tenant removed", tenant=t.name, reason="its last process exited", charged=charged)
    if gone:
        # no caller waits on it, and one a crash loses is reaped again at the next start: off the loop
        save_soon(c)
        log_shares(c, reason="removed")


def _reconcile_encoders(c: Context, samples: Mapping[int, GpuSample], pids_of: Callable[[Tenant], list[int]]) -> None:
    """Live NVENC session counts against NVML's encoder session list (once a second). The hooks count
    allocations and frees; a free they never saw leaves a count too high (and a cap refusing), a session
    opened where no hook runs leaves it too low. NVML lists the sessions that exist: when it disagrees with
    the count twice in a row (not a session caught between its allocation and NVML's list), it wins."""
    lists = [s.encoder_sessions for s in samples.values() if s.ok and s.encoder_sessions is not None]
    if not lists:
        return
    by_pid: dict[int, int] = {}
    for sessions in lists:
        for pid, n in sessions.items():
            by_pid[pid] = by_pid.get(pid, 0) + n
    for t in c.tenants.values():
        if t.missing:
            continue
        seen = sum(by_pid.get(pid, 0) for pid in pids_of(t)) if by_pid else 0
        counted = t.sessions.get("nvenc", 0)
        if seen == counted:
            t.encoder_mismatch = 0
            continue
        t.encoder_mismatch += 1
        if t.encoder_mismatch >= 2:
            log.warning("encoder sessions reconciled with NVML", tenant=t.name, counted=counted, nvml=seen)
            before = t.all_engines()
            t.sessions["nvenc"] = seen
            t.encoder_mismatch = 0
            if t.all_engines() != before:
                engines_changed(c, t)
