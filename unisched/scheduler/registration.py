"""Registration and adoption: a caller's process joins a tenant's cgroup (creating the tenant when allowed; from
the event loop the move itself runs on the move thread, moves.py), an admin adopts an existing cgroup; who may do
what, and how many tenants one uid may make."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import posixpath
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import structlog

from unisched.enforce.cgroups import CgroupDriver, CgroupError, adopt_refusal, within
from unisched.policy import (
    DEFAULT_WEIGHT,
    Engine,
    PolicyError,
    Priority,
    TenantSpec,
    validate_tenant_name,
    validate_weight,
)
from unisched.policy.callers import Caller
from unisched.policy.caps import SessionLimits
from unisched.scheduler.admission import apply_devices, update_memory_terms
from unisched.scheduler.context import Context, check_gpus, save, save_soon
from unisched.scheduler.labels import LabelError, validate_labels
from unisched.scheduler.limits import NO_MEMORY_ASK, MemoryAsk, memory_limits
from unisched.scheduler.moves import STOPPING, Move, move_back, move_caller
from unisched.scheduler.reporting import snapshot
from unisched.scheduler.roster import add, apply_weight
from unisched.scheduler.tenant import (
    SchedulerError,
    Tenant,
    TenantSnapshot,
    need_alive,
    parse_engines,
)

__all__ = [
    "MAX_TENANTS", "MAX_USER_TENANTS", "RegisterAsk", "adopt", "enroll", "refusal_to_adopt", "start_enroll",
]

log = structlog.get_logger("unisched.scheduler")
MAX_TENANTS = 10_000
"""Tenants one daemon keeps (each is a cgroup, a state entry and a policy entry)."""
MAX_USER_TENANTS = 32
"""Tenants one non-admin uid may create: creating tenants must not be a way to exhaust the daemon."""
T = TypeVar("T")


@dataclass(frozen=True)
class RegisterAsk:
    """A registering caller (`unisched run`'s Register, a lease hello): who it is and what it asks for.

    `alive` says whether the process that connected still runs (the transport pins it; None: not checked).
    keep=False (`unisched run` without --keep): a tenant this call creates is removed once its last process
    has exited, so tenants made for one run do not pile up against MAX_USER_TENANTS. keep=True: the owner
    keeps it (also one made that way before). None (lease sessions): a new tenant is kept, a known one unchanged.

    session_hooks (`unisched run`): the caller's children get the session hooks before they exec, so a tenant
    this call creates is hooked from its first process on and holds no GPU context until the hooks count one.
    Without it the CPU of its start-up (a torch import takes seconds) would be charged as GPU time, through the
    CPU stand-in, until the hand-over and NVML's next process list caught up.

    memory: GPU memory terms (limits.memory_limits); a reserve that does not fit is refused before anything is
    made or moved, so `unisched run` fails before it starts its command."""

    name: str
    weight: int | None
    priority: Priority | None
    engines: tuple[str, ...]
    gpus: tuple[int, ...]
    pid: int
    uid: int
    is_admin: bool
    alive: Callable[[], bool] | None = None
    keep: bool | None = None
    session_hooks: bool = False
    memory: MemoryAsk = NO_MEMORY_ASK
    contained: bool = False
    """The caller is outside the daemon's user or pid namespace (a container's process): it may only join the tenant
    whose cgroup it is in, as it is. Moved into a tenant, it would leave its container's cgroup (its device rules
    and limits) through the daemon; and a uid inside a container, which root there can take, owns nothing."""
    caller: Caller | None = None
    """Whom the books kept per caller count it as (the transport's PeerCred.caller: a pod for a pod's process,
    whatever uid it runs as); None: its uid."""

    @property
    def counted_as(self) -> Caller:
        """Whose turn its cgroup move waits for (moves.MoveThread), and whose record its lease overruns go to."""
        return self.uid if self.caller is None else self.caller


@dataclass(frozen=True)
class _Enrolment:
    """A registration decided on the loop: the tenant as it now is, and the caller's move still to make (None:
    the caller is a member already). While `move` is made the tenant counts it (`Tenant.moving`)."""

    tenant: Tenant
    move: Move | None


def enroll(c: Context, ask: RegisterAsk) -> Tenant:
    """Register the caller at once, its move included: where no event loop runs (`Scheduler.register`)."""
    e = _begin(c, ask, _where(c.driver, ask.pid) if ask.name in c.tenants else None)
    if e.move is not None:
        try:
            move_caller(e.move)
        finally:
            e.tenant.moving -= 1
    return e.tenant


def start_enroll(c: Context, ask: RegisterAsk, then: Callable[[Tenant], T]) -> asyncio.Future[T]:
    """Register the caller from the event loop: decide and create on the loop, read and move the caller on the
    move thread (moves.MoveThread), and once it is in, on the loop, `then(tenant)` (in the same turn as the checks
    after the move). Refusals of a new tenant raise here; the future holds every other refusal and what the move or
    `then` raised.

    For a known tenant, where the caller sits (whether it is a member already) is read on the move thread first:
    reading /proc/<pid>/cgroup waits for the kernel's cgroup lock while a move holds it, so on the loop it would
    wait for other users' moves. The loop serves others during both. A tenant removed meanwhile stays removed:
    the caller, if it got in, is moved back, and the registration fails (not_found)."""
    if c.mover.closed:
        raise SchedulerError("failed", STOPPING)
    result: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    if ask.name not in c.tenants:
        _go_on(c, _begin(c, ask, None), then, result)
        return result
    located = c.mover.submit(functools.partial(_where, c.driver, ask.pid), ask.counted_as)

    def decide(done: asyncio.Future[str | None]) -> None:
        try:
            _go_on(c, _begin(c, ask, done.result()), then, result)
        except Exception as err:  # a refusal, or the move thread stopping: the caller hears it
            _fail(result, err)
    located.add_done_callback(decide)
    return result


def _go_on(c: Context, e: _Enrolment, then: Callable[[Tenant], T], result: asyncio.Future[T]) -> None:
    """A registration decided: the caller's move on the move thread (none for a member), then `_settle`."""
    if e.move is None:
        _settle(c, e, None, then, result)
        return
    try:
        moved = c.mover.submit(functools.partial(move_caller, e.move), e.move.turn)
    except BaseException:
        e.tenant.moving -= 1
        raise
    moved.add_done_callback(lambda done: _settle(c, e, done, then, result))


def _begin(c: Context, ask: RegisterAsk, where: str | None) -> _Enrolment:
    """Everything a registration decides and creates before the caller moves (on the loop): who may join or
    create, the tenant made or changed, and the move to make. A caller that is gone is never acted on: a pid
    outlives its process, and once the caller exits another process may take the number.

    What changed is saved by the tick within SAVE_DELAY_S, written off the event loop (saves.py), not here:
    rewriting and fsync'ing the whole state file once per call, on the loop, would queue a burst of `unisched run`
    (each a new tenant) and every other reply behind the disk. A graceful stop saves at once; a crash within that
    half second can lose only the entries of the registrations made in it.

    `where`: the caller's cgroup (`_where`; None: not known, or not read because the tenant was new)."""
    name, alive = ask.name, ask.alive
    need_alive(alive)
    _check_name_and_weight(name, ask.weight)
    engine_set = parse_engines(ask.engines)
    gpu_tuple = check_gpus(c, ask.gpus)
    t = c.tenants.get(name)
    # a caller already inside the tenant's cgroup (a container of an adopted pod, whose pod-level cgroup may hold
    # no process of its own under cgroup v2) is the tenant: it joins without being moved, whoever owns it
    member = t is not None and where is not None and within(where, t.cgroup)
    need_alive(alive)  # what was read from /proc/<pid> was the caller's
    if ask.contained and not member:
        raise SchedulerError("permission", "a process in a container (outside the daemon's namespaces) may only "
                             "join the tenant whose cgroup holds it: an admin adopts its container's cgroup (or its "
                             "pod); the daemon neither moves it nor makes it a tenant")
    if t is None:
        t = _create(c, name, ask.weight, ask.priority, engine_set, gpu_tuple, ask.uid, ask.is_admin, ask.keep,
                    ask.session_hooks, ask.memory)
        changed = True
    else:
        changed = _rejoin(c, t, ask.weight, ask.priority, engine_set if ask.engines else None, gpu_tuple, ask.uid,
                          ask.is_admin, member, ask.keep, ask.memory, ask.contained)
    if changed:  # the state file holds every tenant: rewrite it only when what it keeps changed
        save_soon(c)
    if member:
        return _Enrolment(t, None)
    t.moving += 1
    return _Enrolment(t, Move(c.driver, t.cgroup, ask.pid, alive, ask.counted_as))


def _settle(c: Context, e: _Enrolment, moved: asyncio.Future[str | None] | None, then: Callable[[Tenant], T],
            result: asyncio.Future[T]) -> None:
    """On the loop once the move is done (`moved`; None: no move): the tenant no longer counts it, and the
    registration ends as the move did, unless the tenant was removed meanwhile (then it fails once its caller,
    if it got in, is back where it came from)."""
    t = e.tenant
    if e.move is not None:
        t.moving -= 1
    if c.tenants.get(t.name) is not t:
        gone = SchedulerError("not_found", f"tenant {t.name!r} was removed while its caller was being moved in")
        if e.move is not None and moved is not None and moved.exception() is None:
            _undo(c, e.move, moved.result(), lambda: _fail(result, gone))
        else:
            _fail(result, gone)
        return
    try:
        if moved is not None:
            moved.result()  # the move's own refusal
        value = then(t)
    except Exception as err:  # (whatever it is, the caller waiting on `result` hears it)
        _fail(result, err)
        return
    if not result.done():  # (done: the caller stopped waiting)
        result.set_result(value)


def _fail(result: asyncio.Future[T], err: Exception) -> None:
    if not result.done():
        result.set_exception(err)


def _undo(c: Context, m: Move, origin: str | None, then: Callable[[], None]) -> None:
    """The tenant went while its caller moved in: the caller goes back (on the move thread), and the cgroup it
    leaves, when no tenant has it by then, goes too (removal left it because the caller was in it); then `then`."""

    def tidy(_: asyncio.Future[bool]) -> None:
        if not any(t.cgroup == m.cgroup for t in c.tenants.values()):
            with contextlib.suppress(CgroupError, OSError):
                if c.driver.exists(m.cgroup) and not c.driver.pids(m.cgroup):
                    c.driver.remove(m.cgroup)
        then()

    try:
        back = c.mover.submit(functools.partial(move_back, m, origin), m.turn)
    except SchedulerError:  # stopping: it stays where it is
        then()
        return
    back.add_done_callback(tidy)


def _check_name_and_weight(name: str, weight: int | None) -> None:
    try:
        validate_tenant_name(name)
        if weight is not None:
            validate_weight(weight)
    except PolicyError as e:
        raise SchedulerError("invalid", str(e)) from None


def _check_priority(priority: Priority | None, is_admin: bool) -> None:
    """Online priority puts a tenant ahead of every offline one (in preemptive mode, strictly): an admin's to give,
    as weights above max_user_weight are."""
    if priority is Priority.ONLINE and not is_admin:
        raise SchedulerError("permission", "only admins may give a tenant online priority (it runs ahead of every "
                             "offline tenant); ask an admin, or run it offline")


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
    if uid < 0:  # (transport's CONTAINED_ROOT: root in a container, no user of this host to own a tenant)
        raise SchedulerError("permission", "root in a container may not create tenants: an admin adopts its "
                             "container's cgroup (or its pod), and its processes join that tenant")
    w = weight if weight is not None else DEFAULT_WEIGHT
    _check_user_weight(c, w, is_admin)
    _check_priority(priority, is_admin)
    _check_room(c, uid, is_admin)
    limits = memory_limits(c, name, SessionLimits(), gpus, memory, is_admin, creating=True)
    cgroup = c.driver.tenant_cgroup(name)
    _check_not_governed(c, name, cgroup)
    _check_unoccupied(c, name, cgroup, uid, is_admin)
    _create_cgroup(c, name, cgroup)
    t = Tenant(name, w, priority or Priority.OFFLINE, engines, gpus, cgroup, False, uid,
               ephemeral=keep is False and name not in c.declared, limits=limits)
    if session_hooks:
        # its only process now is the CLI, which holds no context; where NVML lists the GPUs' processes
        # that list says when one appears (without it, CPU time is the GPU's stand-in: on the GPU as before)
        t.hooked = True
        t.nvml_on_gpu = not _nvml_lists_processes(c)
    add(c, t, reason="registered")
    c.left_behind.pop(cgroup, None)  # a tenant's again
    return t


def _rejoin(
    c: Context, t: Tenant, weight: int | None, priority: Priority | None, engines: frozenset[Engine] | None,
    gpus: tuple[int, ...] | None, uid: int, is_admin: bool, member: bool, keep: bool | None, memory: MemoryAsk,
    contained: bool = False,
) -> bool:
    """A caller registering with a known tenant: its owner (or an admin) may change it, a member joins it as it
    is; a lost cgroup is made again. Returns whether what the state file keeps changed. A `contained` caller
    (RegisterAsk) owns nothing: its uid is one root in its container can take."""
    name = t.name
    owner = is_admin or (uid == t.owner_uid and not contained)
    if not owner and not member:
        raise SchedulerError("permission", f"tenant {name!r} belongs to uid {t.owner_uid}; you are uid {uid}")
    before = t.saved()
    if owner and priority is not None and priority != t.priority:
        _check_priority(priority, is_admin)  # before anything changes
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
    update_memory_terms(c, name)
    apply_devices(c, t)
    if t.missing or not c.driver.exists(t.cgroup):
        _create_cgroup(c, name, t.cgroup)
        if t.missing:
            log.info("tenant cgroup recreated", tenant=name, cgroup=t.cgroup)
        t.missing = False
        t.last_cpu = None
    return t.saved() != before


def _check_not_governed(c: Context, name: str, cgroup: str) -> None:
    """A new tenant's cgroup must not be (or nest with) an adopted one: two tenants would freeze one cgroup."""
    for o in c.tenants.values():
        if o.adopted and (within(cgroup, o.cgroup) or within(o.cgroup, cgroup)):
            raise SchedulerError("invalid", f"tenant {name!r} would live in {cgroup}, which is nested with adopted "
                                         f"tenant {o.name!r}'s cgroup {o.cgroup}; choose another name")


def _check_unoccupied(c: Context, name: str, cgroup: str, uid: int, is_admin: bool) -> None:
    """A new tenant's cgroup must hold no processes, unless the caller is an admin or owned the removed tenant that
    left them (Context.left_behind). A tenant removed while its processes ran leaves them in its cgroup
    (`roster.drop` deletes only an empty one): another user's tenant of the same name would take them in, and they
    could join it (a process in a tenant's cgroup is its member) and be counted against its caps."""
    try:
        occupied = c.driver.exists(cgroup) and bool(c.driver.pids(cgroup))
    except (CgroupError, OSError) as e:
        raise SchedulerError("failed", f"cannot read cgroup {cgroup}: {e}") from None
    if occupied and not is_admin and c.left_behind.get(cgroup) != uid:
        raise SchedulerError("permission", f"cgroup {cgroup} still holds processes of a removed tenant {name!r} "
                                           "(or ones put there outside the daemon) that are not yours; choose "
                                           "another name, or wait until they end")


def _nvml_lists_processes(c: Context) -> bool:
    """Whether the last samples listed every GPU's processes (NVML on a GPU that reports them)."""
    samples = c.last_samples
    return bool(samples) and all(s.ok and s.gpu_pids is not None for s in samples)


def _where(driver: CgroupDriver, pid: int) -> str | None:
    """The cgroup `pid` sits in (None: gone, or /proc unreadable)."""
    try:
        return driver.cgroup_of(pid)
    except OSError:
        return None


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
    save(c)  # on disk when the admin is answered: the adopted cgroup's path lives only in the state file
    return snapshot(c, name)


def refusal_to_adopt(c: Context, path: str) -> str | None:
    """Why this canonical cgroup path cannot be adopted here (see `adopt_refusal`), or None."""
    subtree = posixpath.dirname(c.driver.tenant_cgroup("x"))
    return adopt_refusal(path, subtree, c.driver.cgroup_of(os.getpid()),
                         ((t.name, t.cgroup) for t in c.tenants.values()))
