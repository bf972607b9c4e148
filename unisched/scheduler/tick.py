"""The slice: sample -> charge -> update demand -> observe the gates -> decide -> plan -> freeze/thaw,
grant/revoke. The rules are policy.plan's (docs/design/scheduling.md): this module measures and applies."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import structlog

from unisched.enforce.cgroups import CgroupError
from unisched.policy import (
    ChargeKind,
    ChargeSource,
    Decision,
    Engine,
    Mode,
    Resource,
)
from unisched.policy.charging import ReportMatch, charge_rule, cooperative_part, sources
from unisched.policy.overlap import PairMember, PairWeights, pair_weights
from unisched.policy.plan import (
    FreezerUse,
    GateOutcome,
    Plan,
    PlanInputs,
    Rule,
    TenantView,
    demand_rule,
    observe,
    plan,
)
from unisched.scheduler.context import SAVE_DELAY_S, Context, save_off_loop
from unisched.scheduler.readings import Readings, read, reader
from unisched.scheduler.reporting import log_shares
from unisched.scheduler.roster import (
    apply_tidal,
    lost,
)
from unisched.scheduler.tenant import (
    Tenant,
    off_gpu,
)
from unisched.scheduler.upkeep import memory_due, update_memory
from unisched.telemetry import GpuSample

__all__ = ["advance", "apply", "readings_reader", "reschedule", "tick", "tick_due"]

log = structlog.get_logger("unisched.scheduler")


def tick(c: Context, readings: Readings | None = None) -> float:
    """One slice boundary. Returns the seconds until the next one. `readings`: what the engine's loop read for it
    off the loop (readings_reader), just before; None: read here."""
    now = c.clock.monotonic()
    dt = max(now - c.last_tick, 1e-6)
    c.last_tick = now
    if readings is None:
        readings = read(c.telemetry, c.driver, charged_cgroups(c))
    samples = {s.index: s for s in _samples(c, readings)}
    c.last_samples = tuple(samples.values())
    update_memory(c, samples, now, readings.pids)
    cpu = _cpu_deltas(c, readings)
    thawed_on: dict[Resource, list[Tenant]] = {}
    how: dict[str, ChargeSource] = {}
    leases = c.leases
    for t in c.tenants.values():
        # thawed tenants, and frozen ones that still ran: a freeze takes effect a few ms late, and an
        # uncharged tail favours the tenant frozen most often per unit of its share (the low weight); and one
        # frozen at the interval's start: its queued GPU work drains in it (a render's frame in flight)
        ran = _ran_as(t, cpu.get(t.name, 0.0))
        t.froze = False
        if ran is not None and not t.missing and not leases.cooperative(t.name) and not off_gpu(t):
            # (cooperative ones report their GPU time; one with no GPU context used none)
            how[t.name] = ran
            for r in t.resources:
                thawed_on.setdefault(r, []).append(t)
    gpu_active: set[str] = set()
    c.charged = {}
    reports = leases.take_reported()
    for r, ts in thawed_on.items():
        _charge_resource(c, r, ts, samples.get(r.gpu), cpu, dt, now, gpu_active, reports.pop(r, ()),
                         [how[t.name] for t in ts])
    for r in set(reports) | (set(c.matches) - set(thawed_on)):  # late reports of intervals already charged
        _, c.matches[r] = cooperative_part(0.0, now - dt, now, reports.get(r, ()),
                                           c.matches.get(r, ReportMatch()), leases.valid_s, False)
    _update_demand(c, cpu, dt, gpu_active)
    pairs = _mix_weights(c) if c.plan_config.mixing else {}
    _observe_saturation(c, samples, cpu, dt, pairs)
    tenants = c.tenants
    leases.expire(now, lambda name: tenants[name].frozen)
    if c.config.mode is Mode.TIDAL:
        for t in c.tenants.values():
            apply_tidal(c, t)
    decision = c.policy.decide(now)
    c.next_tick = now + decision.slice_s
    c.step = 0
    apply(c, decision, now, tick=True, pairs=pairs, dt=dt)
    if c.writer.take_failure():  # the writer thread could not write the last snapshot: save again
        c.unsaved = True
    if c.unsaved and now - c.saved_at >= SAVE_DELAY_S:
        c.saved_at = now
        save_off_loop(c)
    active = frozenset(n for n, t in c.tenants.items() if t.active)
    if active != c.last_active:
        c.last_active = active
        log_shares(c, reason="demand")
    return decision.slice_s


STEP_EARLY_S = 0.001
"""A step due this close to the slice's end is left to the tick."""


def tick_due(c: Context) -> bool:
    """Whether advance() would tick now (else it takes a rationed slice's next step)."""
    return not _step_due(c, c.clock.monotonic())


def _step_due(c: Context, now: float) -> bool:
    steps = len(c.plan.steps)
    return steps > 1 and c.step + 1 < steps and now < c.next_tick - STEP_EARLY_S


def readings_reader(c: Context) -> Callable[[], Readings]:
    """The next tick's reads as one call that touches only the telemetry and the cgroup files (never the
    engine's state), for the loop to make on a worker thread: the tenants whose CPU time (and, where the tick will
    check memory, whose process lists) are read are listed now."""
    listed = [t.cgroup for t in c.tenants.values() if not t.missing] if memory_due(c, c.clock.monotonic()) else []
    return reader(c.telemetry, c.driver, charged_cgroups(c), listed)


def advance(c: Context, readings: Readings | None = None) -> float:
    """What the engine's loop calls: a tick at each slice boundary, and between ticks the next step of a rationed
    slice (PlanState.steps: who sits out changes, nothing is measured). Returns the seconds until the next call.
    With `readings` it ticks: the loop found a tick due and read for it (what was read is consumed: NVML's
    samples since the last read are not read again)."""
    now = c.clock.monotonic()
    if readings is None and _step_due(c, now):
        c.step += 1
        apply(c, c.policy.decide(now), now, tick=False)
    else:
        tick(c, readings)
    steps = len(c.plan.steps)
    if steps <= 1:
        return max(0.0, c.next_tick - now)
    due = c.last_tick + (c.step + 1) * (c.next_tick - c.last_tick) / steps
    return max(0.0, min(due, c.next_tick) - now)


def _observe_saturation(c: Context, samples: Mapping[int, GpuSample], cpu: Mapping[str, float], dt: float,
                        pairs: Mapping[int, PairWeights]) -> None:
    """Measure what the saturation gates read (policy.plan.observe), level the fair share of resources that
    slicing starts on, and log the gates' changes."""
    cooperative = c.leases.cooperative
    use = [FreezerUse(t.resources, t.all_engines(), t.engines, t.frozen, cpu.get(t.name, 0.0) / dt)
           for t in c.tenants.values() if not t.missing and not cooperative(t.name)]
    contenders = {r: c.policy.contenders(r) for u in use for r in u.resources}
    rationed = c.plan.rationed
    outcome, c.plan = observe(c.plan_config, use, samples, contenders, pairs, c.plan)
    for r in outcome.level:
        c.policy.level(r)
    _log_gates(c, outcome)
    for r in rationed ^ c.plan.rationed:
        log.info("rationing", gpu=r.gpu, domain=r.domain, on=r in c.plan.rationed,
                 reason="held open and saturated: a tenant ahead of its weight share sits out" if r in c.plan.rationed
                 else "no longer held open and saturated")


def _log_gates(c: Context, outcome: GateOutcome) -> None:
    """Why a sliced GPU stays sliced or opens (--log-level debug), and each change of a contended gate."""
    for g in outcome.readings:
        r = g.resource
        if not g.was_open and g.contenders >= 2:
            log.debug("turn", gpu=r.gpu, domain=r.domain, util=g.util, cpu_busy=g.cpu_busy, used=g.used)
        if g.now_open != g.was_open and g.contenders >= 2:
            held_s = g.held * c.config.slice_ms / 1000.0
            reason = ("saturated" if not g.now_open else
                      f"turns left unused (paced tenants): every tenant runs for {held_s:.1f} s"
                      if g.held else "unsaturated: every tenant runs")
            log.info("slicing" if not g.now_open else "lending", gpu=r.gpu, domain=r.domain,
                     util=None if g.util is None else round(g.util, 3), reason=reason)


def _log_ration(c: Context, views: Sequence[TenantView]) -> None:
    """Who sits out of each step of the new rationed slice, how many may, and the leads that chose them
    (--log-level debug): what a share that misses its weight is read from."""
    log.debug("rationed slice", sit_out={str(r): n for r, n in c.plan.sit_out.items()},
              cap={str(r): n.most for r, n in c.plan.sit_out_cap.items()}, steps=[sorted(s) for s in c.plan.steps],
              leads={v.name: [round(lead, 5) for _, lead, _ in v.leads] for v in views if v.leads},
              charged={v.name: [round(used, 5) for _, _, used in v.leads] for v in views if v.leads})


def _mix_weights(c: Context) -> dict[int, PairWeights]:
    """Per GPU, the weights of the tenants with demand on its compute and on its graphics side."""
    cooperative, weight = c.leases.cooperative, c.policy.weight
    return pair_weights((PairMember(weight(t.name), t.resources, cooperative(t.name))
                         for t in c.tenants.values() if t.active and not t.missing), c.contention)


def apply(c: Context, decision: Decision, now: float, tick: bool, pairs: Mapping[int, PairWeights] | None = None,
           dt: float = 0.0) -> None:
    """Ask the scheduling model (policy.plan) what the decision means for each tenant and lease, then freeze or
    thaw freezer-governed tenants (and cooperative ones the freezer backs) and grant or revoke leases as it says."""
    leases = c.leases
    tenants = tuple(c.tenants.values())
    coop, enforced = leases.cooperative_names(), leases.enforced_names()
    # leads and weights only where a tick chooses who sits out (policy.plan._ration); between ticks the steps it
    # chose stand, and a lead costs a look at the resource's virtual clock per tenant
    rationed = c.plan.rationed if tick else frozenset()
    lead, weight, charged = c.policy.lead, c.policy.weight, c.charged
    views = tuple([TenantView(t.name, t.resources, t.active, t.name in coop, t.name in enforced,
                              tuple((r, lead(t.name, r), charged.get((t.name, r), 0.0)) for r in t.resources & rationed),
                              weight(t.name)) if rationed else
                   TenantView(t.name, t.resources, t.active, t.name in coop, t.name in enforced)
                   for t in tenants])
    p, c.plan = plan(c.plan_config, PlanInputs(decision, views, pairs, dt, c.step), c.plan)
    if rationed and log.is_enabled_for(logging.DEBUG):  # (its fields cost a pass over every rationed tenant)
        _log_ration(c, views)
    _log_mixes(c, p)
    for t, verdict in zip(tenants, p.freeze, strict=True):
        if verdict.frozen != t.frozen and not t.missing:
            try:
                c.driver.set_frozen(t.cgroup, verdict.frozen)
                t.frozen = t.froze = verdict.frozen
                if not verdict.frozen:
                    leases.touch(t.name, now)
            except CgroupError as e:
                lost(c, t, str(e))
    if p.revoked:
        decision = replace(decision, holders=p.holders)
    leases.apply(decision, now, max(0.0, c.next_tick - now), tick, p.mixed)


def _log_mixes(c: Context, p: Plan) -> None:
    for g, m in p.mixes.items():
        if c.mix_shown.get(g) != m.mix:
            c.mix_shown[g] = m.mix
            log.info("mixed slices", gpu=g, together=round(m.mix.both, 3),
                     compute_alone=round(m.mix.compute_only, 3), graphics_alone=round(m.mix.graphics_only, 3),
                     period_ms=c.config.mix_period_ms, compute_weight=m.weights.compute,
                     graphics_weight=m.weights.graphics)
        if m.kind is not m.previous:
            log.debug("mixed slice", gpu=g, kind=m.kind.value)


DECISIONS_PER_TURN = 4
"""Decisions between ticks made at once in one turn of the daemon's event loop; later ones of the turn fold into one
at its end. A few at once leave ordinary traffic (a hand-over is a release and a want) as it was."""


def reschedule(c: Context) -> None:
    """Decide now, between ticks: a cooperative tenant's new demand is served (and a released engine
    handed on) at once, not at the next slice boundary.

    In the daemon's event loop (`c.defer` set) only the first DECISIONS_PER_TURN decisions of a loop turn are made
    at once; later ones of that turn fold into one when the turn ends. A decision walks every tenant, and wants and
    releases can come in bursts (one read can hold thousands): one decision per request would hold the loop, and
    every renewal, for seconds. After shutdown (`c.stopped`) nothing is decided: it could freeze a tenant again."""
    if c.stopped:
        return
    if c.defer is None:
        _decide(c)
    elif c.decisions_this_turn >= DECISIONS_PER_TURN:
        c.decision_due = True
    else:
        if not c.decisions_this_turn:
            c.defer(lambda: _turn_ended(c))
        c.decisions_this_turn += 1
        _decide(c)


def _decide(c: Context) -> None:
    now = c.clock.monotonic()
    apply(c, c.policy.decide(now), now, tick=False)


def _turn_ended(c: Context) -> None:
    c.decisions_this_turn = 0
    if c.decision_due:
        c.decision_due = False
        reschedule(c)


def _samples(c: Context, readings: Readings) -> Sequence[GpuSample]:
    """The telemetry's samples; a telemetry that raised (it must not) counts as no GPU signal this slice,
    so the slice goes on with CPU signals instead of failing (and thawing everything) every slice."""
    if readings.failure is not None:
        if not c.telemetry_failing:
            log.error("telemetry failed; slicing on CPU signals until it recovers", error=readings.failure)
        c.telemetry_failing = True
        return ()
    if c.telemetry_failing:
        log.info("telemetry recovered")
        c.telemetry_failing = False
    return readings.samples


def charged_cgroups(c: Context) -> list[tuple[str, str]]:
    """The (tenant, cgroup) pairs whose CPU time a tick reads; cooperative tenants report GPU time instead."""
    cooperative = c.leases.cooperative
    return [(t.name, t.cgroup) for t in c.tenants.values() if not t.missing and not cooperative(t.name)]


def _cpu_deltas(c: Context, readings: Readings) -> dict[str, float]:
    """CPU seconds per tenant since the last tick, from `readings`; a tenant that came (or whose cgroup changed)
    after they were read is read here."""
    out = {}
    cooperative = c.leases.cooperative
    for t in c.tenants.values():
        if t.missing or cooperative(t.name):  # cooperative tenants report GPU time: no cgroup reads
            continue
        key = (t.name, t.cgroup)
        usage = readings.cpu_usage_s[key] if key in readings.cpu_usage_s else c.driver.cpu_usage_s(t.cgroup)
        if usage is None:
            lost(c, t, "cgroup removed")
            continue
        out[t.name] = 0.0 if t.last_cpu is None else max(0.0, usage - t.last_cpu)
        t.last_cpu = usage
    return out


def _ran_as(t: Tenant, cpu_s: float) -> ChargeSource | None:
    """What a tenant did in the interval, as policy.charging.sources reads it: thawed (SHARED), frozen in it (DRAIN:
    its queued work drains in it), frozen before it but still using CPU (FROZEN_TAIL); None: frozen and idle (not
    charged)."""
    if not t.frozen:
        return ChargeSource.SHARED
    if t.froze:
        return ChargeSource.DRAIN
    return ChargeSource.FROZEN_TAIL if cpu_s > 0.0 else None


def _charge_resource(
    c: Context,
    r: Resource,
    ts: list[Tenant],
    sample: GpuSample | None,
    cpu: dict[str, float],
    dt: float,
    now: float,
    gpu_active: set[str],
    reports: Sequence[tuple[float, float]],
    ran_as: Sequence[ChargeSource],
) -> None:
    """Charge the measured use of `r` over the interval to the tenants that were thawed on it.

    `util` is the highest busy fraction of the engines they use there (0 without a sample); how it is split is
    policy.charging.charge_rule. `ran_as`: what each tenant did in the interval (`_ran_as`), from which its charge's
    source (policy.charging.sources) is kept with it (`ChargeKind`). A tenant alone on a busy resource that no
    client held showed GPU activity (`gpu_active`)."""
    util = 0.0
    if sample is not None and sample.ok:
        util = max(
            (sample.util(e) for t in ts for e in t.all_engines() if c.contention.domain(e) == r.domain),
            default=0.0,
        )
    threshold = c.config.activity_threshold
    busy = util * dt if util > threshold else 0.0
    matched, c.matches[r] = cooperative_part(busy, now - dt, now, reports, c.matches.get(r, ReportMatch()),
                                             c.leases.valid_s, True)
    sm = r.domain in (c.contention.domain(Engine.COMPUTE), c.contention.domain(Engine.GRAPHICS))
    # NVML's per-process samples are of the SMs; each rate is (GPU seconds per CPU second, when taken)
    rates = [rate[0] if (rate := t.gpu_rates.get(r.gpu)) else None for t in ts] if sm else []
    amounts, rule = charge_rule(util, dt, [cpu.get(t.name, 0.0) for t in ts], threshold, matched, rates)
    came = sources(ran_as, amounts)
    if log.is_enabled_for(logging.DEBUG):  # (its fields cost a pass over the tenants, per resource per tick)
        log.debug("charged", resource=str(r), now=round(now, 4), util=round(util, 3), busy_s=round(busy, 5),
                  cooperative_s=round(matched, 5), rule=rule.value,
                  charged={t.name: round(s, 5) for t, s in zip(ts, amounts, strict=True)},
                  sources={t.name: a.value for t, a in zip(ts, came, strict=True)})
    if (total := sum(amounts)) > 0:
        c.charged_by_rule[(r, rule)] = c.charged_by_rule.get((r, rule), 0.0) + total
    for t, seconds, source in zip(ts, amounts, came, strict=True):
        if seconds > 0:
            c.policy.charge(t.name, r, seconds, now, ChargeKind(rule, source))
            c.charged[(t.name, r)] = seconds
    if rule is Rule.SIGNAL and len(ts) == 1 and not c.leases.client_held(r):
        gpu_active.add(ts[0].name)  # alone on a busy GPU: unless a client held it, that busy time is its own


def _update_demand(c: Context, cpu: dict[str, float], dt: float, gpu_active: set[str]) -> None:
    threshold = c.config.activity_threshold
    leases = c.leases
    for t in c.tenants.values():
        if leases.cooperative(t.name):
            t.active = bool(leases.demand(t.name))  # from its lease session (LeaseBook sets the demand)
            continue
        active, t.idle_run, _ = demand_rule(
            was_active=t.active, lost=t.missing, frozen=t.frozen, off_gpu=off_gpu(t),
            gpu_alone=t.name in gpu_active, cpu_cores=cpu.get(t.name, 0.0) / dt, idle_run=t.idle_run,
            activity_threshold=threshold, idle_slices=c.config.idle_slices)
        if active != t.active or not active:
            c.policy.set_demand(t.name, t.resources if active else ())
        t.active = active
    c.weights_on.clear()  # the default caps' shares (admission._weights_on) follow the demand just updated
