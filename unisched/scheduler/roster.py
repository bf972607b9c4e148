"""The tenant table: adding and dropping tenants, their weights and limits, and a lost cgroup."""

from __future__ import annotations

from typing import Final

import structlog

from unisched.enforce.bpf import DeviceAdmissionError
from unisched.enforce.cgroups import CgroupError
from unisched.policy import (
    Mode,
    PolicyError,
    TenantSpec,
    validate_weight,
)
from unisched.scheduler.admission import (
    apply_devices,
    update_memory_terms,
    v2_dir,
)
from unisched.scheduler.context import Context, get, save, save_soon
from unisched.scheduler.limits import changed_limits
from unisched.scheduler.reporting import charged_line, log_shares, snapshot
from unisched.scheduler.tenant import (
    SchedulerError,
    Tenant,
    TenantSnapshot,
)

__all__ = [
    "add", "apply_tidal", "apply_weight", "drop", "has_tenant", "lost", "note_session_hooks", "remove", "remove_as",
    "set_limits", "set_weight", "tenant_of_pid",
]

log = structlog.get_logger("unisched.scheduler")


def add(c: Context, t: Tenant, reason: str) -> None:
    if t.adopted and c.driver.before_freeze is not None:
        # recorded now, where a damaged state file cannot lose it (enforce.governed); a freeze retries it
        try:
            c.driver.before_freeze(t.cgroup)
        except OSError as e:
            log.error("could not record the adopted cgroup; it is not frozen until it can be", tenant=t.name,
                      cgroup=t.cgroup, error=str(e))
    t.resources = c.contention.resources(t.gpus or c.gpu_indices, t.all_engines())
    c.tenants[t.name] = t
    c.tenant_of_cgroup[_cgroup_key(t.cgroup)] = t.name
    update_memory_terms(c, t.name)
    apply_devices(c, t)
    c.policy.upsert(TenantSpec(t.name, t.base_weight, t.priority))
    log.info(
        "tenant added",
        tenant=t.name,
        weight=t.base_weight,
        priority=t.priority.value,
        engines=sorted(e.value for e in t.engines),
        cgroup=t.cgroup,
        reason=reason,
    )


def has_tenant(c: Context, name: str) -> bool:
    return name in c.tenants


def note_session_hooks(c: Context, tenant: str) -> None:
    """The seccomp hooks now see the tenant's GPU session allocations (see `_off_gpu`)."""
    t = c.tenants.get(tenant)
    if t is not None:
        t.hooked = True


def tenant_of_pid(c: Context, pid: int) -> str | None:
    """The tenant whose cgroup holds the process: a lookup of its cgroup and of each one above it (every Status
    call asks, so not a walk over every tenant)."""
    cg = c.driver.cgroup_of(pid)
    if cg is None:
        return None
    path = _cgroup_key(cg)
    while True:
        name = c.tenant_of_cgroup.get(path)
        if name is not None or path == "/" or "/" not in path:
            return name
        path = path.rsplit("/", 1)[0] or "/"


def _cgroup_key(cgroup: str) -> str:
    return cgroup.rstrip("/") or "/"


def set_weight(c: Context, name: str, weight: int) -> TenantSnapshot:
    t = get(c, name)
    try:
        validate_weight(weight)
    except PolicyError as e:
        raise SchedulerError("invalid", str(e)) from None
    apply_weight(c, t, weight, reason="set-weight")
    save(c)  # on disk when the admin is answered: a restart keeps the weight it was told was set
    return snapshot(c, name)


def apply_weight(c: Context, t: Tenant, weight: int, reason: str) -> None:
    t.base_weight = weight
    c.policy.upsert(TenantSpec(t.name, weight, t.priority))
    apply_tidal(c, t)
    log_shares(c, reason=reason)


def remove_as(c: Context, name: str, uid: int, is_admin: bool) -> None:
    """Remove a tenant for a caller: an admin any, others only tenants they own."""
    t = get(c, name)
    if not is_admin and uid != t.owner_uid:
        raise SchedulerError("permission", f"tenant {name!r} belongs to uid {t.owner_uid}; only its owner or an "
                                        f"admin may remove it (you are uid {uid})")
    remove(c, name, durable=is_admin)


def remove(c: Context, name: str, durable: bool = True) -> None:
    """`durable`: on disk when the caller is answered (an admin's, so a removed tenant does not come back at a
    restart); else written by the tick within SAVE_DELAY_S, off the loop, as registrations are: a user removing and
    re-making its tenant in a loop must not put two fsyncs on the event loop each time."""
    charged = drop(c, get(c, name))
    if durable:
        save(c)
    else:
        save_soon(c)
    log.info("tenant removed", tenant=name, charged=charged)
    log_shares(c, reason="removed")


MAX_LEFT_BEHIND: Final = 1024
"""Removed tenants' cgroups that still held processes, remembered with their owners (Context.left_behind); past
it the oldest is forgotten, and its name is then refused to everyone but admins until its processes end."""


def leave_behind(c: Context, cgroup: str, owner_uid: int) -> None:
    """A removed tenant's cgroup still holds processes: remember whose they were (Context.left_behind)."""
    c.left_behind.pop(cgroup, None)
    c.left_behind[cgroup] = owner_uid
    while len(c.left_behind) > MAX_LEFT_BEHIND:
        del c.left_behind[next(iter(c.left_behind))]


def drop(c: Context, t: Tenant) -> dict[str, dict[str, float]]:
    """Forget a tenant and thaw (and, when it made it and it is empty, delete) its cgroup; the caller saves. Returns
    what it was charged (`charged_line`), for the caller's log line."""
    name = t.name
    charged = charged_line(c, name)
    if t.devices_admitted and c.devices is not None:
        try:
            c.devices.revoke(v2_dir(c, t))
        except DeviceAdmissionError as e:
            log.error("could not revoke device admission", tenant=name, error=str(e))
    try:
        if c.driver.exists(t.cgroup):
            c.driver.set_frozen(t.cgroup, False)
            if not t.adopted and not c.driver.pids(t.cgroup):
                c.driver.remove(t.cgroup)
            elif not t.adopted:
                leave_behind(c, t.cgroup, t.owner_uid)
    except CgroupError as e:
        log.error("cleanup of removed tenant failed", tenant=name, error=str(e))
    del c.tenants[name]
    key = _cgroup_key(t.cgroup)
    if c.tenant_of_cgroup.get(key) == name:
        del c.tenant_of_cgroup[key]
    update_memory_terms(c, name)
    c.logged_shares.pop(name, None)
    c.leases.forget_tenant(name)
    c.policy.remove(name)
    return charged


def set_limits(c: Context, name: str, render: int | None, decode: int | None, encode: int | None,
               memory_bytes: int | None, memory_reserve: int | None = None) -> TenantSnapshot:
    """Change caps; None keeps a value, -1 clears it back to the default."""
    t = get(c, name)
    t.limits = changed_limits(c, name, t.limits, t.gpus, render=render, decode=decode, encode=encode,
                              memory_bytes=memory_bytes, memory_reserve=memory_reserve)
    update_memory_terms(c, name)
    log.info("limits", tenant=name, render=t.limits.render, decode=t.limits.decode, encode=t.limits.encode,
             memory_bytes=t.limits.memory_bytes, memory_reserve=t.limits.memory_reserve)
    save(c)  # on disk when the caller is answered, as a weight
    return snapshot(c, name)


def apply_tidal(c: Context, t: Tenant) -> None:
    """The tenant's weight now: its [[tidal]] window's, if one is open. A window names a tenant, not who made it:
    a tenant a non-root user made under that name is held to max_user_weight, as its own weight is."""
    w = t.base_weight
    if c.config.mode is Mode.TIDAL:
        w = c.config.tidal.weight_at(t.name, t.base_weight, c.clock.seconds_of_day())
        if t.owner_uid != 0 and not t.adopted:
            w = min(w, max(t.base_weight, c.config.max_user_weight))
    if w != c.policy.weight(t.name):
        c.policy.set_weight(t.name, w)
        log.info("tidal weight", tenant=t.name, weight=w, base_weight=t.base_weight)
        log_shares(c, reason="tidal")


def lost(c: Context, t: Tenant, why: str) -> None:
    if not t.missing:
        log.error("tenant cgroup lost; tenant kept idle until it registers again", tenant=t.name, cgroup=t.cgroup, error=why)
    t.missing = True
    t.frozen = False
    t.active = False
    t.last_cpu = None
    c.policy.set_demand(t.name, ())
