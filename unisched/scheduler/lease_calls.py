"""Lease sessions of cooperative clients: open, want, report, codec sessions and close, as the transport calls them."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import structlog

from unisched.enforce.cgroups import CgroupError
from unisched.enforce.leases import LeaseChannel
from unisched.policy import Engine
from unisched.scheduler.admission import (
    admit,
    session_freed,
)
from unisched.scheduler.context import Context
from unisched.scheduler.leases import LeaseError
from unisched.scheduler.registration import RegisterAsk, enroll, start_enroll
from unisched.scheduler.reporting import snapshot
from unisched.scheduler.roster import (
    lost,
)
from unisched.scheduler.tenant import (
    LeaseAck,
    SchedulerError,
    Tenant,
    TenantSnapshot,
    parse_engine,
)
from unisched.scheduler.tick import reschedule

__all__ = ["lease_close", "lease_codec", "lease_open", "lease_report", "lease_want", "start_lease_open"]

log = structlog.get_logger("unisched.scheduler")


def lease_open(c: Context, ask: RegisterAsk, gpu: int, channel: LeaseChannel) -> tuple[int, TenantSnapshot]:
    """Register the caller (as `registration.enroll`: its process joins the tenant's cgroup) and open a lease
    session, at once (no event loop)."""
    return _session(c, enroll(c, _lease_ask(c, ask, gpu)), gpu, channel, ask)


def start_lease_open(c: Context, ask: RegisterAsk, gpu: int,
                     channel: LeaseChannel) -> asyncio.Future[tuple[int, TenantSnapshot]]:
    """`lease_open` from the event loop: the caller moves in off the loop (`registration.start_enroll`), and the
    session opens once it is in."""
    return start_enroll(c, _lease_ask(c, ask, gpu), lambda t: _session(c, t, gpu, channel, ask))


def _lease_ask(c: Context, ask: RegisterAsk, gpu: int) -> RegisterAsk:
    """The registration a hello for `gpu` makes: a new tenant (or one bound to GPUs) is bound to that GPU."""
    if not ask.is_admin and not c.config.user_leases:
        raise SchedulerError("permission", "only admins may open lease sessions on this daemon (user_leases = false): "
                             "run the app under `unisched run` without the client library, where the freezer holds it "
                             "to its weight")
    if gpu not in c.gpu_indices:
        raise SchedulerError("invalid", f"no GPU {gpu}; this host has GPUs {list(c.gpu_indices)}")
    t = c.tenants.get(ask.name)
    # a member joins as it is: its owner set the GPUs, and its weight is theirs; a caller in a container owns nothing
    # (RegisterAsk.contained: its uid is one root there may take)
    owner = t is not None and ask.uid == t.owner_uid and not ask.contained
    if t is not None and t.gpus is not None and gpu not in t.gpus and not ask.is_admin and not owner:
        raise SchedulerError("permission", f"tenant {t.name!r} is bound to GPUs {list(t.gpus)}; only its owner or an "
                             f"admin may move it to GPU {gpu}")
    return replace(ask, gpus=(gpu,) if t is None or t.gpus is not None else ())


def _session(c: Context, t: Tenant, gpu: int, channel: LeaseChannel, ask: RegisterAsk) -> tuple[int, TenantSnapshot]:
    if t.frozen:  # was a freezer-governed tenant: leases gate it from now on
        _thaw(c, t)
    name = t.name
    sid = c.leases.open(name, gpu, channel, user=None if ask.is_admin else ask.counted_as)
    t.active = bool(c.leases.demand(name))
    c.policy.set_demand(name, c.leases.demand(name))
    return sid, snapshot(c, name)


def _thaw(c: Context, t: Tenant) -> None:
    try:
        c.driver.set_frozen(t.cgroup, False)
        t.frozen = False
    except CgroupError as e:
        lost(c, t, str(e))


def _lease_call(c: Context, sid: int) -> Tenant:
    try:
        name = c.leases.session_tenant(sid)
    except LeaseError as e:
        raise SchedulerError("invalid", str(e)) from None
    t = c.tenants.get(name)
    if t is None:
        raise SchedulerError("not_found", f"tenant {name!r} was removed")
    return t


def _ack(c: Context, sid: int, t: Tenant, engine: Engine) -> LeaseAck:
    lease = c.leases.lease_of(t.name, sid, engine)
    return LeaseAck(engine, lease is not None, lease or 0)


def lease_want(c: Context, sid: int, engine: str) -> LeaseAck:
    t = _lease_call(c, sid)
    e = parse_engine(engine)
    if c.leases.want(sid, e, c.clock.monotonic()):
        t.active = bool(c.leases.demand(t.name))
        reschedule(c)
    return _ack(c, sid, t, e)


def lease_report(c: Context, sid: int, engine: str, gpu_seconds: float, release: bool, yielded: bool = False,
                 units: int = 0, ended_ago_s: float = 0.0) -> LeaseAck:
    t = _lease_call(c, sid)
    e = parse_engine(engine)
    try:
        changed, _ = c.leases.report(sid, e, gpu_seconds, release, c.clock.monotonic(), yielded, units, ended_ago_s)
    except LeaseError as err:
        raise SchedulerError("invalid", str(err)) from None
    if changed:
        t.active = bool(c.leases.demand(t.name))
    # (or just enforced: freeze it now if it must wait)
    if changed or (c.leases.enforced(t.name) and not t.frozen and not c.leases.holds(t.name) and t.active):
        reschedule(c)
    return _ack(c, sid, t, e)


def lease_codec(c: Context, sid: int, kind: str, open_: bool) -> tuple[bool, str]:
    """A client asks to open (or closes) a hardware codec session: the same caps as the kernel hooks."""
    t = _lease_call(c, sid)
    if kind not in ("nvdec", "nvenc"):
        raise SchedulerError("invalid", f"codec session kind must be nvdec or nvenc, got {kind!r}")
    if not open_:
        if c.leases.codec_open(sid, kind) > 0:
            c.leases.note_codec(sid, kind, -1)
            session_freed(c, t.name, kind)
        return True, ""
    if kind == "nvenc" and c.video is not None and c.video.nvenc == 0:
        gpu = c.telemetry.gpus()[0].name if c.telemetry.gpus() else "this GPU"
        return False, f"{gpu} has no NVENC encoder; encode on the CPU (e.g. libx264) or on another GPU"
    why = admit(c, t, kind, 0)
    if why is not None:
        return False, f"tenant {t.name!r}: {why}"
    c.leases.note_codec(sid, kind, +1)
    return True, ""


def lease_close(c: Context, sid: int) -> None:
    closed = c.leases.close(sid, c.clock.monotonic())
    if closed is None:
        return
    name, codec, affected = closed
    t = c.tenants.get(name)
    if t is None:
        return
    for kind, n in codec.items():
        if n:
            session_freed(c, name, kind, n)
    t.active = bool(c.leases.demand(name)) if c.leases.cooperative(name) else False
    if not c.leases.cooperative(name):
        t.idle_run = 0
        t.last_cpu = None
    if affected:
        reschedule(c)
