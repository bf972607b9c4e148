"""Engine records to their protobuf form, for the gRPC calls and the lease stream alike, and back."""

from __future__ import annotations

from unisched.policy import Priority
from unisched.scheduler.core import TenantSnapshot
from unisched.scheduler.limits import MemoryAsk
from unisched_wire import unisched_pb2 as pb

__all__ = ["PRIORITY", "memory_ask", "public_summary", "snapshot_to_pb"]

PRIORITY = {pb.PRIORITY_ONLINE: Priority.ONLINE, pb.PRIORITY_OFFLINE: Priority.OFFLINE}
_PRIORITY_PB = {v: k for k, v in PRIORITY.items()}


def memory_ask(request: pb.RegisterRequest | pb.AdoptRequest) -> MemoryAsk:
    """The GPU memory terms a register or adopt request asks for (a field left unset: not asked)."""
    return MemoryAsk(cap=request.memory_bytes if request.HasField("memory_bytes") else None,
                     reserve=request.memory_reserve if request.HasField("memory_reserve") else None)


def snapshot_to_pb(s: TenantSnapshot) -> pb.Tenant:
    return pb.Tenant(
        name=s.name,
        weight=s.weight,
        base_weight=s.base_weight,
        priority=_PRIORITY_PB[s.priority],
        pids=list(s.pids),
        state=s.state,
        target_share=s.target_share,
        measured_share=s.measured_share,
        gpu_seconds=s.gpu_seconds,
        cgroup=s.cgroup,
        engines=sorted(e.value for e in s.engines),
        shares=[
            pb.ResourceShare(
                gpu=x.resource.gpu, domain=x.resource.domain, target_share=x.target, measured_share=x.measured,
                charges=[pb.Charge(rule=k.rule, source=k.source, seconds=seconds) for k, seconds in x.charges],
            )
            for x in s.shares
        ],
        slices=s.slices,
        owner_uid=s.owner_uid,
        adopted=s.adopted,
        sessions=dict(s.sessions),
        refusals=dict(s.refusals),
        caps=pb.Limits(
            render=_cap(s.caps.get("render")), decode=_cap(s.caps.get("decode")),
            encode=_cap(s.caps.get("encode")), memory_bytes=_cap(s.memory_cap),
            memory_reserve=_cap(s.memory_reserve),
        ),
        memory_bytes=s.memory_bytes,
        over_memory=s.over_memory,
        devices=s.devices or "",
        cooperative=s.cooperative,
        overrun_s=s.overrun_s,
        enforced=s.enforced,
        unit_ms=1000.0 * (s.unit_s or 0.0),
        turn_ms=1000.0 * s.turn_s,
        env=dict(s.env),
        gpu_memory=[
            pb.GpuMemory(gpu=m.gpu, used_bytes=m.used, cap_bytes=_cap(m.cap), reserve_bytes=m.reserve, refused=m.refused)
            for m in s.gpu_memory
        ],
    )


def public_summary(t: pb.Tenant) -> None:
    """What others may see of a tenant: name, owner, weight, priority, state, engines, limits and target
    shares stay; processes, cgroup and every measure of its usage go."""
    del t.pids[:]
    t.gpu_seconds = 0.0
    t.measured_share = 0.0
    for share in t.shares:
        share.measured_share = 0.0
        del share.charges[:]
    t.slices = 0
    t.overrun_s = 0.0
    t.unit_ms = 0.0  # its mean GPU step, and the turn sized from it: measures of its work too
    t.turn_ms = 0.0
    t.over_memory = False
    t.cgroup = ""
    t.sessions.clear()
    t.refusals.clear()
    t.memory_bytes = 0
    for m in t.gpu_memory:
        m.used_bytes = 0
        m.refused = 0
    t.devices = ""
    t.env.clear()


def _cap(value: int | None) -> int:
    return -1 if value is None else value
