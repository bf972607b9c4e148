"""Registration and adoption: a caller's process joins a tenant's cgroup (creating the tenant when allowed),
an admin adopts an existing cgroup; who may do what, and how many tenants one uid may make."""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable, Iterable, Mapping

import structlog

from unisched.enforce.cgroups import CgroupError, adopt_refusal, within
from unisched.policy import (
    DEFAULT_WEIGHT,
    Engine,
    PolicyError,
    Priority,
    TenantSpec,
    validate_tenant_name,
    validate_weight,
)
from unisched.policy.caps import SessionLimits
from unisched.scheduler.admission import apply_devices
from unisched.scheduler.context import Context, check_gpus, save, save_soon
from unisched.scheduler.labels import LabelError, validate_labels
from unisched.scheduler.limits import NO_MEMORY_ASK, MemoryAsk, memory_limits
from unisched.scheduler.reporting import snapshot
from unisched.scheduler.roster import add, apply_weight
from unisched.scheduler.tenant import (
    CALLER_GONE,
    SchedulerError,
    Tenant,
    TenantSnapshot,
    need_alive,
    parse_engines,
)

__all__ = ["MAX_TENANTS", "MAX_USER_TENANTS", "adopt", "enroll", "refusal_to_adopt"]

log = structlog.get_logger("unisched.scheduler")
MAX_TENANTS = 10_000
"""Tenants one daemon keeps (each is a cgroup, a state entry and a policy entry)."""
MAX_USER_TENANTS = 32
"""Tenants one non-admin uid may create: creating tenants must not be a way to exhaust the daemon."""


def enroll(
    c: Context,
    name: str,
    weight: int | None,
    priority: Priority | None,
    engines: Iterable[str],
    gpus: Iterable[int],
    pid: int,
    uid: int,
    is_admin: bool,
    alive: Callable[[], bool] | None = None,
    keep: bool | None = None,
    session_hooks: bool = False,
    memory: MemoryAsk = NO_MEMORY_ASK,
) -> Tenant:
    """Move the caller's own process into the tenant's cgroup, creating the tenant if needed.

    `alive` says whether the process that connected still runs (the transport pins it; None: not checked).
    A pid outlives its process: once the caller exits another process may take the number, so a caller
    that is gone is never acted on, before anything changes and again after the move.

    keep=False (`unisched run` without --keep): a tenant this call creates is removed once its last process
    has exited, so tenants made for one run do not pile up against MAX_USER_TENANTS. keep=True: the owner
    keeps it (also one made that way before). None (lease sessions): a new tenant is kept, a known one unchanged.

    What changed is saved by the tick within SAVE_DELAY_S, not here: a burst of `unisched run` (each a new
    tenant) rewrote and fsync'ed the whole state file once per call, on the event loop, so replies queued
    behind the disk. A graceful stop saves at once; a crash within that half second can lose only the
    entries of the registrations made in it.

    session_hooks (`unisched run`): the caller's children get the session hooks before they exec, so a tenant
    this call creates is hooked from its first process on and holds no GPU context until the hooks count one.
    Without it the CPU of its start-up (a torch import takes seconds) would be charged as GPU time, through the
    CPU stand-in, until the hand-over and NVML's next process list caught up.

    memory: GPU memory terms (limits.memory_limits); a reserve that does not fit is refused before anything is
    made or moved, so `unisched run` fails before it starts its command."""
    need_alive(alive)
    _check_name_and_weight(name, weight)
    engine_set = parse_engines(engines)
    gpu_tuple = check_gpus(c, gpus)
    t = c.tenants.get(name)
    # a caller already inside the tenant's cgroup (a container of an adopted pod, whose pod-level cgroup may hold
    # no process of its own under cgroup v2) is the tenant: it joins without being moved, whoever owns it
    member = t is not None and _is_member(c, t, pid)
    need_alive(alive)  # what was read from /proc/<pid> was the caller's
    if t is None:
        t = _create(c, name, weight, priority, engine_set, gpu_tuple, uid, is_admin, keep, session_hooks, memory)
        changed = True
    else:
        changed = _rejoin(c, t, weight, priority, engine_set if list(engines) else None, gpu_tuple, uid, is_admin,
                          member, keep, memory)
    if not member:
        _attach_caller(c, t.cgroup, pid, alive)
    if changed:  # the state file holds every tenant: rewrite it only when what it keeps changed
        save_soon(c)
    return t


def _check_name_and_weight(name: str, weight: int | None) -> None:
    try:
        validate_tenant_name(name)
        if weight is not None:
            validate_weight(weight)
    except PolicyError as e:
        raise SchedulerError("invalid", str(e)) from None


def _check_user_weight(c: Context, weight: int, is_admin: bool) -> None:
    if not is_admin and weight > c.config.max_user_weight:
        raise SchedulerError(
            "permission",
            f"weight {weight} is above max_user_weight {c.config.max_user_weight} for non-admin callers",
        )


def _create(
    c: Context, name: str, weight: int | None, priority: Priority | None, engines: frozenset[Engine],
    gpus: tuple[int, ...] | None, uid: int, is_admin: bool, keep: bool | None, session_hooks: bool, memory: MemoryAsk,
) -> Tenant:
    """A new tenant for a registering caller, in a cgroup made for it."""
    if not is_admin and not c.config.user_tenants:
        raise SchedulerError("permission", "only admins may create tenants on this daemon (user_tenants = false)")
    w = weight if weight is not None else DEFAULT_WEIGHT
    _check_user_weight(c, w, is_admin)
    _check_room(c, uid, is_admin)
    limits = memory_limits(c, name, SessionLimits(), gpus, memory, is_admin, creating=True)
    cgroup = c.driver.tenant_cgroup(name)
    _check_not_governed(c, name, cgroup)
    _create_cgroup(c, name, cgroup)
    t = Tenant(name, w, priority or Priority.OFFLINE, engines, gpus, cgroup, False, uid,
               ephemeral=keep is False and name not in c.declared, limits=limits)
    if session_hooks:
        # its only process now is the CLI, which holds no context; where NVML lists the GPUs' processes
        # that list says when one appears (without it, CPU time is the GPU's stand-in: on the GPU as before)
        t.hooked = True
        t.nvml_on_gpu = not _nvml_lists_processes(c)
    add(c, t, reason="registered")
    return t


def _rejoin(
    c: Context, t: Tenant, weight: int | None, priority: Priority | None, engines: frozenset[Engine] | None,
    gpus: tuple[int, ...] | None, uid: int, is_admin: bool, member: bool, keep: bool | None, memory: MemoryAsk,
) -> bool:
    """A caller registering with a known tenant: its owner (or an admin) may change it, a member joins it as it
    is; a lost cgroup is made again. Returns whether what the state file keeps changed."""
    name = t.name
    owner = is_admin or uid == t.owner_uid
    if not owner and not member:
        raise SchedulerError("permission", f"tenant {name!r} belongs to uid {t.owner_uid}; you are uid {uid}")
    before = t.saved()
    # checked before anything changes (a refused reserve leaves the tenant as it was), against the GPUs it will have;
    # a plain rejoin is not checked again (a reserve kept while the GPU's size was unknown must not lock it out)
    new_gpus = gpus if owner and gpus is not None else t.gpus
    if memory != NO_MEMORY_ASK or new_gpus != t.gpus:
        t.limits = memory_limits(c, name, t.limits, new_gpus, memory, is_admin, creating=False)
    if weight is not None and weight != t.base_weight:
        if not owner:
            raise SchedulerError("permission", f"only uid {t.owner_uid} or an admin may change the weight of "
                                            f"tenant {name!r} ({t.base_weight}); you are uid {uid}")
        _check_user_weight(c, weight, is_admin)
        apply_weight(c, t, weight, reason="registered")
    # a member that is not the owner joins as it is: engines, GPUs and priority stay as the owner set them
    if owner and priority is not None and priority != t.priority:
        t.priority = priority
        c.policy.upsert(TenantSpec(t.name, t.base_weight, t.priority))
    if owner and engines is not None:
        t.engines = engines
    if owner and gpus is not None:
        t.gpus = gpus
    if owner and keep is True:
        t.ephemeral = False
    t.resources = c.contention.resources(t.gpus or c.gpu_indices, t.all_engines())
    apply_devices(c, t)
    if t.missing or not c.driver.exists(t.cgroup):
        _create_cgroup(c, name, t.cgroup)
        if t.missing:
            log.info("tenant cgroup recreated", tenant=name, cgroup=t.cgroup)
        t.missing = False
        t.last_cpu = None
    return t.saved() != before


def _attach_caller(c: Context, cgroup: str, pid: int, alive: Callable[[], bool] | None) -> None:
    """Move the caller into `cgroup`; if it exited meanwhile, the pid may name another process by now:
    whatever process holds the pid in `cgroup` goes back where the caller was, and the call fails."""
    try:
        origin = c.driver.cgroup_of(pid)
    except OSError:
        origin = None
    need_alive(alive)
    try:
        c.driver.attach(cgroup, pid)
    except CgroupError as e:
        raise SchedulerError("failed", f"cannot move pid {pid} into {cgroup}: {e}") from None
    if alive is None or alive():
        return
    with contextlib.suppress(OSError, CgroupError):
        if origin is not None and c.driver.cgroup_of(pid) == cgroup:
            c.driver.attach(origin, pid)
            log.warning("moved a reused pid back", pid=pid, cgroup=origin)
    raise SchedulerError("failed", CALLER_GONE)


def _check_not_governed(c: Context, name: str, cgroup: str) -> None:
    """A new tenant's cgroup must not be (or nest with) an adopted one: two tenants would freeze one cgroup."""
    for o in c.tenants.values():
        if o.adopted and (within(cgroup, o.cgroup) or within(o.cgroup, cgroup)):
            raise SchedulerError("invalid", f"tenant {name!r} would live in {cgroup}, which is nested with adopted "
                                         f"tenant {o.name!r}'s cgroup {o.cgroup}; choose another name")


def _nvml_lists_processes(c: Context) -> bool:
    """Whether the last samples listed every GPU's processes (NVML on a GPU that reports them)."""
    samples = c.last_samples
    return bool(samples) and all(s.ok and s.gpu_pids is not None for s in samples)


def _is_member(c: Context, t: Tenant, pid: int) -> bool:
    """Whether `pid` already sits in the tenant's cgroup or below it."""
    try:
        where = c.driver.cgroup_of(pid)
    except OSError:  # gone, or /proc unreadable: not a member
        return False
    root = t.cgroup.rstrip("/")
    return where is not None and (where == t.cgroup or where.startswith(root + "/"))


def _create_cgroup(c: Context, name: str, cgroup: str) -> None:
    try:
        c.driver.create(cgroup)
    except FileExistsError:
        raise SchedulerError("invalid", f"tenant name {name!r} is taken by a cgroup interface file; choose another") from None
    except CgroupError as e:
        raise SchedulerError("failed", str(e)) from None
    except OSError as e:
        raise SchedulerError("failed", f"cannot create cgroup {cgroup}: {e.strerror}") from None


def _check_room(c: Context, uid: int, is_admin: bool) -> None:
    if len(c.tenants) >= MAX_TENANTS:
        raise SchedulerError("failed", f"this daemon already has {len(c.tenants)} tenants, the most it keeps")
    if not is_admin:
        owned = sum(1 for t in c.tenants.values() if t.owner_uid == uid and not t.adopted)
        if owned >= MAX_USER_TENANTS:
            raise SchedulerError(
                "permission", f"uid {uid} already created {owned} tenants, the most a non-admin may (remove some first)"
            )


def adopt(
    c: Context,
    name: str,
    weight: int | None,
    priority: Priority | None,
    cgroup: str,
    engines: Iterable[str],
    gpus: Iterable[int],
    labels: Mapping[str, str] | None = None,
    memory: MemoryAsk = NO_MEMORY_ASK,
) -> TenantSnapshot:
    """`labels`: where an orchestrator runs it (scheduler.labels), kept for metrics. `memory`: its GPU memory terms
    (limits.memory_limits; adopt is for admins); a reserve that does not fit refuses the adoption."""
    _check_name_and_weight(name, weight)
    try:
        kept = validate_labels(labels or {})
    except LabelError as e:
        raise SchedulerError("invalid", str(e)) from None
    if name in c.tenants:
        raise SchedulerError("invalid", f"tenant {name!r} already exists; remove it first")
    _check_room(c, 0, True)
    try:
        path = c.driver.normalize(cgroup)
    except CgroupError as e:
        raise SchedulerError("invalid", str(e)) from None
    why = refusal_to_adopt(c, path)
    if why is not None:
        raise SchedulerError("invalid", why)
    gpu_tuple = check_gpus(c, gpus)
    limits = memory_limits(c, name, SessionLimits(), gpu_tuple, memory, is_admin=True, creating=True)
    t = Tenant(
        name,
        weight if weight is not None else DEFAULT_WEIGHT,
        priority or Priority.OFFLINE,
        parse_engines(engines),
        gpu_tuple,
        path,
        True,
        0,
        labels=kept,
        limits=limits,
    )
    add(c, t, reason="adopted")
    save(c)
    return snapshot(c, name)


def refusal_to_adopt(c: Context, path: str) -> str | None:
    """Why this canonical cgroup path cannot be adopted here (see `adopt_refusal`), or None."""
    subtree = posixpath.dirname(c.driver.tenant_cgroup("x"))
    return adopt_refusal(path, subtree, c.driver.cgroup_of(os.getpid()),
                         ((t.name, t.cgroup) for t in c.tenants.values()))
