"""Start and stop: thaw what a previous run left frozen, restore tenants (saved, declared, live cgroups), MPS."""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from unisched.enforce.cgroups import CgroupError
from unisched.enforce.mps import MpsStatus
from unisched.policy import (
    DEFAULT_WEIGHT,
    Mode,
    PolicyError,
    Priority,
    validate_tenant_name,
)
from unisched.scheduler.admission import check_reserve
from unisched.scheduler.config import DeclaredTenant
from unisched.scheduler.context import WRITER_STOP_S, Context, save
from unisched.scheduler.registration import MAX_TENANTS, refusal_to_adopt
from unisched.scheduler.roster import (
    add,
)
from unisched.scheduler.state import SavedTenant
from unisched.scheduler.tenant import (
    Tenant,
    parse_engines,
)

__all__ = ["mps_status", "shutdown", "start", "thaw_all"]

log = structlog.get_logger("unisched.scheduler")


def start(c: Context) -> None:
    """Thaw everything we may have left frozen, start (or join) MPS where configured, then restore tenants
    (saved state, then config, then live cgroups of the subtree that neither names). Raises MpsError before
    restoring any tenant when MPS does not start; the thaw comes first so that a daemon which cannot start
    leaves no cgroup frozen. The state file is read once: reading it moves a damaged one aside."""
    saved = c.store.load()
    thawed = thaw_all(c, extra=[t.cgroup for t in saved])
    if thawed:
        log.warning("thawed cgroups left frozen by a previous run", cgroups=thawed)
    if c.mps is not None:
        mps = c.mps.start()
        capped = c.config.mode is Mode.PREEMPTIVE and c.config.mps_offline_sm_percent < 100
        log.info("MPS joined" if mps.joined else "MPS started", pipe_dir=mps.pipe_dir, servers=list(mps.servers),
                 offline_sm_percent=c.config.mps_offline_sm_percent if capped else None)
    for s in saved:
        _restore(c, s)
    for declared in c.config.tenants:
        if declared.name not in c.tenants:
            _add_declared(c, declared)
    _readopt_live(c)
    save(c)  # before the first call is served: nothing to wait for yet, and the file matches what is served


def _restore(c: Context, saved: SavedTenant) -> None:
    missing = False
    if saved.adopted and (why := refusal_to_adopt(c, saved.cgroup)) is not None:
        # as an adoption now would be (a hand-edited state file, the daemon moved into that cgroup since)
        log.error("saved adopted cgroup not restored", tenant=saved.name, cgroup=saved.cgroup, why=why)
        return
    if not c.driver.exists(saved.cgroup):
        if saved.adopted:
            log.warning("adopted cgroup is gone; forgetting tenant", tenant=saved.name, cgroup=saved.cgroup)
            return
        try:
            c.driver.create(saved.cgroup)
        except (CgroupError, OSError) as e:
            # keep the tenant (and its weight); it is recreated when it registers again
            log.error("could not recreate a saved tenant's cgroup", tenant=saved.name, cgroup=saved.cgroup, error=str(e))
            missing = True
    add(c,
        Tenant(saved.name, saved.weight, saved.priority, saved.engines, saved.gpus, saved.cgroup, saved.adopted,
                saved.owner_uid, missing=missing, limits=saved.limits,
                ephemeral=saved.ephemeral and saved.name not in c.declared, labels=saved.labels),
        reason="restored",
    )


def _readopt_live(c: Context) -> None:
    """A cgroup of our subtree with processes in it that no tenant names (its entry was lost with a damaged
    state file or a crash before it was saved, or its tenant was removed while they ran) is governed again, not
    left to run unscheduled: a tenant named after it, default weight, owned by root, and ephemeral: it goes when its
    processes have ended, and its name is free again for whoever makes it then."""
    named = {t.cgroup for t in c.tenants.values()}
    for cg in c.driver.managed():
        if cg in named:
            continue
        name = cg.rsplit("/", 1)[-1]
        try:
            pids = c.driver.pids(cg)
        except (CgroupError, OSError, ValueError):
            continue
        if not pids:
            continue
        why = _cannot_readopt(c, name)
        if why is not None:
            log.error("live cgroup in the subtree not governed", cgroup=cg, pids=len(pids), why=why)
            continue
        add(c, Tenant(name, DEFAULT_WEIGHT, Priority.OFFLINE, parse_engines(()), None, cg, False, 0, ephemeral=True),
            reason="re-adopted")
        log.warning("re-adopted a live cgroup the state file did not name", tenant=name, cgroup=cg,
                    pids=len(pids), weight=DEFAULT_WEIGHT)


def _cannot_readopt(c: Context, name: str) -> str | None:
    try:
        validate_tenant_name(name)
    except PolicyError as e:
        return str(e)
    if name in c.tenants:
        return f"tenant {name!r} exists with another cgroup"
    if len(c.tenants) >= MAX_TENANTS:
        return f"this daemon already has {len(c.tenants)} tenants, the most it keeps"
    return None


def _add_declared(c: Context, d: DeclaredTenant) -> None:
    try:
        check_reserve(c, d.name, d.limits, d.gpus)
    except PolicyError as e:
        log.error("declared tenant refused", tenant=d.name, error=str(e))
        return
    if d.cgroup is not None:
        try:
            cgroup = c.driver.normalize(d.cgroup)
        except CgroupError as e:
            log.error("declared tenant's cgroup not adopted", tenant=d.name, error=str(e))
            return
        why = refusal_to_adopt(c, cgroup)
        if why is not None:
            log.error("declared tenant's cgroup not adopted", tenant=d.name, error=why)
            return
        adopted = True
    else:
        cgroup = c.driver.tenant_cgroup(d.name)
        try:
            c.driver.create(cgroup)
        except (CgroupError, OSError) as e:
            log.error("declared tenant's cgroup could not be created", tenant=d.name, cgroup=cgroup, error=str(e))
            return
        adopted = False
    add(c, Tenant(d.name, d.weight, d.priority, d.engines, d.gpus, cgroup, adopted, 0, limits=d.limits),
              reason="declared")


def thaw_all(c: Context, extra: Iterable[str] = ()) -> list[str]:
    """Thaw every cgroup we manage or know of; returns those that were frozen. One that cannot be thawed is logged
    and marks the context `left_frozen`."""
    cgroups = set(c.driver.managed()) | {t.cgroup for t in c.tenants.values()} | set(extra)
    was_frozen = []
    for cg in sorted(cgroups):
        try:
            if c.driver.exists(cg) and c.driver.is_frozen(cg):
                was_frozen.append(cg)
            if c.driver.exists(cg):
                c.driver.set_frozen(cg, False)
        except CgroupError as e:
            c.left_frozen = True
            log.error("could not thaw", cgroup=cg, error=str(e))
    for t in c.tenants.values():
        t.frozen = False
    return was_frozen


def shutdown(c: Context) -> None:
    """Thaw everything, save the last state and stop the state file's writer thread. Lease requests still come
    until the sockets close, and a decision folded into the turn's end may be pending: `stopped` keeps them from
    freezing a tenant after this thaw."""
    c.stopped = True
    c.mover.close()  # registrations from now on are refused; a move in flight finishes on its own
    c.left_frozen = False
    thaw_all(c)
    try:
        save(c)  # the last state, on disk before the daemon exits: also what save_soon left for the tick
    finally:
        if not c.writer.close(WRITER_STOP_S):
            log.error("the state file's writer thread did not end", waited_s=WRITER_STOP_S)
    if not c.left_frozen:
        log.info("all managed cgroups thawed")
    if c.charged_by_rule:  # how the GPU's busy time was split over the run (unisched_gpu_charged_seconds)
        by_resource: dict[str, dict[str, float]] = {}
        for (r, rule), seconds in c.charged_by_rule.items():
            by_resource.setdefault(str(r), {})[rule.value] = round(seconds, 3)
        log.info("busy time charged, by the rule that split it", charged=by_resource)
    if c.mps is not None:
        c.mps.stop()
        log.info("MPS asked to quit once its clients are done", pipe_dir=c.mps.pipe_dir)


def mps_status(c: Context) -> MpsStatus | None:
    """None while the daemon runs without MPS."""
    return None if c.mps is None else c.mps.status()
