"""What callers and logs see of the tenants: snapshots, share logs, mixes and gates."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import structlog

from unisched.policy import ChargeKind, Resource, saturation
from unisched.policy.caps import CapKind
from unisched.policy.overlap import OverlapMix, SliceKind
from unisched.policy.saturation import GateState
from unisched.scheduler.admission import (
    cap_of,
    client_env,
    gpu_memory_totals,
    v2_dir,
)
from unisched.scheduler.context import Context
from unisched.scheduler.memory import gpu_memory
from unisched.scheduler.tenant import (
    ResourceShare,
    SchedulerError,
    TenantSnapshot,
    tenant_state,
)
from unisched.telemetry import GpuSample

__all__ = ["charged_line", "charges_by_resource", "gate_states", "gpu_samples", "log_shares", "mixed_slices", "snapshot",
           "snapshots"]

log = structlog.get_logger("unisched.scheduler")


def log_shares(c: Context, reason: str) -> None:
    """One line per tenant whose share or state changed materially (a tenth of its share, or a point);
    from the policy alone (no cgroup reads on the slice path). With a thousand equal tenants, one that
    wakes changes everyone's share by a thousandth: that one is logged, not the other 999."""
    targets = c.policy.target_shares()
    logged = c.logged_shares
    for name, t in sorted(c.tenants.items()):
        shares = [targets.get(name, {}).get(r, 0.0) for r in t.resources]
        share = round(max(shares, default=0.0), 4)
        state = tenant_state(t)
        last = logged.get(name)
        if last is not None and last[1] == state and abs(share - last[0]) <= max(0.01, 0.1 * max(share, last[0])):
            continue
        logged[name] = (share, state)
        log.info("share", tenant=name, weight=c.policy.weight(name), share=share, state=state, reason=reason)


def snapshots(c: Context, names: Iterable[str] | None = None) -> list[TenantSnapshot]:
    """Every tenant's snapshot, or those of `names` (a registration answers with one: O(1), not O(tenants))."""
    wanted = sorted(c.tenants) if names is None else sorted(names)
    stats = {s.name: s for s in c.policy.stats(c.clock.monotonic(), wanted)}
    out = []
    for name in wanted:
        t = c.tenants[name]
        st = stats[name]
        charges = charges_by_resource(st.charged_as)
        shares = tuple(
            ResourceShare(r, st.target_share.get(r, 0.0), st.measured_share.get(r, 0.0), st.seconds_by.get(r, 0.0),
                          charges.get(r, ()))
            for r in sorted(t.resources)
        )
        main = max(shares, key=lambda s: (s.target, s.measured), default=None)
        coop = c.leases.cooperative(name)
        state = tenant_state(t, c.leases.holds(name) if coop else None)
        pids = () if t.missing else tuple(sorted(c.driver.pids(t.cgroup)))
        out.append(
            TenantSnapshot(
                name=name,
                weight=st.weight,
                base_weight=t.base_weight,
                priority=t.priority,
                pids=pids,
                state=state,
                target_share=main.target if main else 0.0,
                measured_share=main.measured if main else 0.0,
                gpu_seconds=st.gpu_seconds,
                cgroup=t.cgroup,
                engines=t.all_engines(),
                shares=shares,
                slices=st.slices,
                owner_uid=t.owner_uid,
                adopted=t.adopted,
                sessions=dict(t.sessions),
                refusals=dict(t.refusals),
                caps={k.value: cap_of(c, t, k) for k in CapKind},
                memory_cap=t.limits.memory_bytes,
                memory_reserve=t.limits.memory_reserve,
                memory_bytes=t.memory_bytes,
                over_memory=t.over_memory,
                devices=c.devices.describe(v2_dir(c, t)) if t.devices_admitted and c.devices else None,
                cooperative=coop,
                overrun_s=c.leases.overrun_s(name),
                enforced=c.leases.enforced(name),
                unit_s=c.leases.unit_s(name),
                turn_s=c.leases.min_run_s(name),
                env=client_env(c, t),
                labels=t.labels,
                gpu_memory=gpu_memory(c.memory_ledger, name, t.limits, t.gpus, gpu_memory_totals(c)),
            )
        )
    return out


def charges_by_resource(charged_as: Mapping[tuple[Resource, ChargeKind], float]
                        ) -> dict[Resource, tuple[tuple[ChargeKind, float], ...]]:
    """A tenant's charges (TenantStats.charged_as) per resource, each resource's in the kinds' order."""
    out: dict[Resource, list[tuple[ChargeKind, float]]] = {}
    for (r, kind), seconds in sorted(charged_as.items(), key=lambda x: x[0][1]):
        out.setdefault(r, []).append((kind, seconds))
    return {r: tuple(xs) for r, xs in out.items()}


def charged_line(c: Context, name: str) -> dict[str, dict[str, float]]:
    """What a tenant was charged since it was added, per resource and `rule/source` (ChargeKind), for a log line:
    what it paid stays in the log once it is gone (`tenant removed`)."""
    (st,) = c.policy.stats(c.clock.monotonic(), [name])
    return {str(r): {str(k): round(s, 4) for k, s in xs} for r, xs in charges_by_resource(st.charged_as).items()}


def snapshot(c: Context, name: str) -> TenantSnapshot:
    if name not in c.tenants:
        raise SchedulerError("not_found", f"unknown tenant {name!r}")
    return snapshots(c, [name])[0]


def gpu_samples(c: Context) -> tuple[GpuSample, ...]:
    return c.last_samples


def mixed_slices(c: Context, gpu: int) -> tuple[OverlapMix, SliceKind] | None:
    """The mix a GPU's partly overlapping compute + graphics get now, and the kind of slice running; None
    while it is not mixing (no such pair with work, or an unsaturated GPU)."""
    kind = c.plan.running.get(gpu)
    mix = c.mix_shown.get(gpu)
    return None if kind is None or mix is None else (mix, kind)


def charged_by_rule(c: Context) -> tuple[tuple[Resource, str, float], ...]:
    """GPU seconds charged to freezer-governed tenants since the start, per resource and the charge rule that split
    them (its name, policy.plan.Rule)."""
    return tuple((r, rule.value, seconds) for (r, rule), seconds in c.charged_by_rule.items())


def gate_states(c: Context) -> tuple[GateState, ...]:
    """Per contended resource: sliced (tenants take turns) or open, and how long it is held open."""
    return saturation.gate_states(c.plan.gates)
