"""The scheduling model (policy.plan): each rule as a table, then the two steps over a few slices."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from unisched.policy import SEPARATE_GRAPHICS, SHARED_SM, ContentionMap, Decision, Engine, Priority, Resource
from unisched.policy.charging import ReportMatch, Unmatched, charge_rule, cooperative_part, gpu_per_cpu, kept_rate
from unisched.policy.overlap import PairMember, PairWeights, SliceKind, mix_contenders, pair_weights
from unisched.policy.plan import (
    MIX_DOMAIN,
    FreezerUse,
    PlanConfig,
    PlanInputs,
    PlanState,
    Rule,
    TenantView,
    cpu_busy,
    demand_rule,
    freeze_rule,
    gate_reading,
    lease_contended,
    lease_jump,
    observe,
    online_jumps,
    plan,
    turn_used,
)
from unisched.policy.rationing import Rationed, SitOutCap, ahead_rule, sit_out_budget, step_schedule
from unisched.policy.saturation import GateMemory, SaturationConfig
from unisched.policy.tuning import TUNING

SM = Resource(0, "sm")
GFX = Resource(0, "gfx")
DEC = Resource(0, "nvdec")
JOINT = Resource(0, MIX_DOMAIN)
C, G, D = Engine.COMPUTE, Engine.GRAPHICS, Engine.DECODE
GATE = SaturationConfig(high=0.9, low=0.6, enter_slices=2, leave_slices=2, hold_slices=4, max_hold_slices=8,
                        reset_slices=4, cap_settle_slices=1, cap_release_slices=0)
PARTIAL = ContentionMap.partial(0.22, 0.92)


@dataclass(frozen=True)
class Sample:
    sm: float
    dec: float = 0.0
    ok: bool = True

    def util(self, engine: Engine) -> float:
        return self.dec if engine is Engine.DECODE else self.sm


def config(contention: ContentionMap = SHARED_SM, gate: SaturationConfig = GATE) -> PlanConfig:
    return PlanConfig(contention, (0,), gate, activity_threshold=0.05, idle_slices=3, slice_s=0.05, mix_period_s=0.2)


def opened(*rs: Resource) -> dict[Resource, GateMemory]:
    return {r: GateMemory() for r in rs}


def sliced(*rs: Resource) -> dict[Resource, GateMemory]:
    return {r: GateMemory(sliced=True) for r in rs}


# --- what the gate reads ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sample", "engines", "busy", "util", "rule"), [
    (None, {C}, False, None, Rule.NO_SIGNAL),  # no GPU: sliced, as the engine did before the gate
    (Sample(1.0, ok=False), {C}, False, None, Rule.NO_SIGNAL),  # NVML failed: stale zeros are no reading
    (Sample(0.02), {C}, True, None, Rule.CPU_STAND_IN),  # PyTorch on the H200 reads 0-5%: not idle
    (Sample(0.02), {C}, False, 0.02, Rule.SIGNAL),  # idle, and nobody busy launching: idle
    (Sample(0.05), {C}, True, None, Rule.CPU_STAND_IN),  # at the threshold still reads idle
    (Sample(0.86), {C}, True, 0.86, Rule.SIGNAL),  # a reading that shows the work wins over the stand-in
    (Sample(0.3, dec=0.9), {C, D}, False, 0.9, Rule.SIGNAL),  # the busiest of its engines
    (Sample(0.3), set(), False, 0.0, Rule.SIGNAL),
])
def test_gate_reading(sample: Sample | None, engines: set[Engine], busy: bool, util: float | None, rule: Rule) -> None:
    assert gate_reading(sample, engines, busy, 0.05) == (util, rule)


@pytest.mark.parametrize(("use", "busy"), [
    (FreezerUse(frozenset({SM}), frozenset({C}), frozenset({C}), False, 0.9), True),
    (FreezerUse(frozenset({SM}), frozenset({C}), frozenset({C}), False, 0.7), True),  # Tuning.turn_cpu_cores is inclusive
    (FreezerUse(frozenset({SM}), frozenset({C}), frozenset({C}), False, 0.69), False),
    (FreezerUse(frozenset({SM}), frozenset({C}), frozenset({C}), True, 1.0), False),  # frozen: its CPU time is a freeze's tail
    (FreezerUse(frozenset({SM}), frozenset({G}), frozenset({G}), False, 1.0), False),  # a render's CPU (libx264) is no GPU turn
    (FreezerUse(frozenset({SM}), frozenset({C, G}), frozenset({C, G}), False, 1.0), True),
    (FreezerUse(frozenset({SM}), frozenset({C}), frozenset({G}), False, 1.0), False),  # a GL app's CUDA context
    # a decoder: PyAV's hardware decode opens a CUDA context beside its NVDEC session; its CPU feeds the decoder
    (FreezerUse(frozenset({SM, DEC}), frozenset({C, D}), frozenset({D}), False, 1.0), False),
    (FreezerUse(frozenset({SM, DEC}), frozenset({C, D}), frozenset({C, D}), False, 1.0), True),  # decode + infer
])
def test_cpu_busy(use: FreezerUse, busy: bool) -> None:
    assert cpu_busy(use, config()) is busy


@pytest.mark.parametrize(("util", "busy", "used"), [
    (None, False, False), (None, True, True), (0.59, False, False), (0.6, False, True), (0.1, True, True),
])
def test_turn_used(util: float | None, busy: bool, used: bool) -> None:
    assert turn_used(util, busy, 0.6) is used


@pytest.mark.parametrize(("pair", "n"), [
    (None, 0), (PairWeights(0, 0, False), 0), (PairWeights(100, 0, False), 1), (PairWeights(0, 100, True), 1),
    (PairWeights(100, 300, False), 2),
])
def test_mix_contenders(pair: PairWeights | None, n: int) -> None:
    assert mix_contenders(pair) == n


@pytest.mark.parametrize(("members", "expected"), [
    ([], {}),
    ([PairMember(100, frozenset({SM}), False), PairMember(300, frozenset({GFX}), True)],
     {0: PairWeights(100, 300, True)}),
    ([PairMember(100, frozenset({SM, GFX}), False)], {0: PairWeights(100, 0, False)}),  # both sides: compute
    ([PairMember(100, frozenset({DEC}), False)], {}),  # a decoder is on neither side
    ([PairMember(50, frozenset({GFX, Resource(1, "sm")}), False)],
     {0: PairWeights(0, 50, False), 1: PairWeights(50, 0, False)}),
])
def test_pair_weights(members: list[PairMember], expected: dict[int, PairWeights]) -> None:
    assert pair_weights(members, SEPARATE_GRAPHICS) == expected


# --- charging the tenants that ran on a resource ------------------------------------------------------------------
@pytest.mark.parametrize(("util", "cpu", "charged", "rule"), [
    (0.5, [0.03, 0.01], [0.01875, 0.00625], Rule.SIGNAL),  # 0.025 s busy, split 3:1 by CPU activity
    (0.5, [0.0, 0.0], [0.0125, 0.0125], Rule.SIGNAL),  # no CPU shown: evenly
    (0.5, [0.0, 0.02], [0.0, 0.025], Rule.SIGNAL),  # the drain of the frozen one's queue is the runner's
    (0.02, [0.03, 0.0], [0.03, 0.0], Rule.CPU_TIME),  # GPU idle (or no GPU): CPU time stands in
    (0.0, [], [], Rule.CPU_TIME),
])
def test_charge_rule(util: float, cpu: list[float], charged: list[float], rule: Rule) -> None:
    amounts, why = charge_rule(util, 0.05, cpu, 0.02)
    assert amounts == pytest.approx(charged) and why is rule


@pytest.mark.parametrize(("cpu", "rates", "charged", "rule"), [
    # players that spin while they wait: the heavy one's CPU a frame is higher; its GPU per CPU second lower
    ([0.01, 0.04], [0.5, 0.25], [0.05 / 3, 0.1 / 3], Rule.PROCESS_RATE),  # 0.05 s busy split 1:2 (0.005:0.01), not 1:4
    ([0.01, 0.04], [0.5, None], [0.01, 0.04], Rule.SIGNAL),  # one not shown by NVML: CPU activity for all
    ([0.01, 0.04], [0.5], [0.01, 0.04], Rule.SIGNAL),  # rates that do not match the tenants: ignored
    ([0.01, 0.04], [0.0, 0.0], [0.01, 0.04], Rule.SIGNAL),  # NVML shows none of them busy: CPU activity
    ([0.02, 0.02], [0.0, 0.3], [0.0, 0.05], Rule.PROCESS_RATE),  # shown idle on the GPU: pays nothing
])
def test_charge_rule_weighs_cpu_by_each_tenants_gpu_rate(cpu: list[float], rates: list[float | None],
                                                          charged: list[float], rule: Rule) -> None:
    amounts, why = charge_rule(1.0, 0.05, cpu, 0.02, rates=rates)
    assert amounts == pytest.approx(charged) and why is rule


def test_charge_rule_without_a_gpu_signal_ignores_rates() -> None:
    assert charge_rule(0.0, 0.05, [0.01, 0.04], 0.02, rates=[0.5, 0.25]) == ([0.01, 0.04], Rule.CPU_TIME)


@pytest.mark.parametrize(("gpu", "cores", "rate"), [
    (0.2, 0.5, 0.4),  # 0.2 of the GPU on half a core
    (0.0, 0.5, 0.0),  # shown, and idle on the GPU
    (None, 0.5, None),  # NVML showed none of its processes
    (0.2, 0.01, None),  # too little CPU for a ratio
    (-0.1, 0.5, 0.0),  # never below nothing
])
def test_gpu_per_cpu(gpu: float | None, cores: float, rate: float | None) -> None:
    assert gpu_per_cpu(gpu, cores) == (None if rate is None else pytest.approx(rate))


@pytest.mark.parametrize(("fresh", "kept", "now", "out"), [
    (0.4, None, 10.0, (0.4, 10.0)),  # a new rate
    (0.4, (0.9, 8.0), 10.0, (0.4, 10.0)),  # a new rate replaces the kept one
    (None, (0.9, 8.0), 10.0, (0.9, 8.0)),  # no new one: the kept one stands
    (None, (0.9, 7.0), 10.0, (0.9, 7.0)),  # ... up to keep_s after it was taken
    (None, (0.9, 6.9), 10.0, None),  # then none
    (None, None, 10.0, None),
])
def test_kept_rate(fresh: float | None, kept: tuple[float, float] | None, now: float,
                   out: tuple[float, float] | None) -> None:
    assert kept_rate(fresh, kept, now, keep_s=3.0) == out


def test_charge_rule_takes_off_what_cooperative_tenants_did() -> None:
    amounts, rule = charge_rule(1.0, 0.05, [0.002], 0.02, cooperative_s=0.048)
    assert amounts == [pytest.approx(0.002)] and rule is Rule.SIGNAL
    assert charge_rule(1.0, 0.05, [0.002], 0.02, cooperative_s=0.07)[0] == [0.0]  # never below nothing


@pytest.mark.parametrize(("busy", "reports", "state", "charged", "part", "after"), [
    # a report of work inside the interval: that much is the client's
    (0.05, [(1.05, 0.04)], ReportMatch(), True, 0.04, ReportMatch(Unmatched(1.0, 1.05, 0.01))),
    # no report yet: all busy time is the freezer-governed tenants', kept as unmatched for a late report
    (0.05, [], ReportMatch(), True, 0.0, ReportMatch(Unmatched(1.0, 1.05, 0.05))),
    # never more than the busy time
    (0.02, [(1.05, 0.05)], ReportMatch(), True, 0.02, ReportMatch()),
    # a late report of the previous interval's work, with no freezer-governed tenant now: credited for later
    # (work over 0.98 .. 1.01: 0.02 s of it in the earlier interval)
    (0.0, [(1.01, 0.03)], ReportMatch(Unmatched(0.95, 1.0, 0.05)), False, 0.0,
     ReportMatch(Unmatched(0.95, 1.0, 0.03), 0.02)),
    # the credit comes off the next charge, up to its busy time
    (0.05, [], ReportMatch(None, 0.02), True, 0.02, ReportMatch(Unmatched(1.0, 1.05, 0.05))),
    # unmatched time older than keep_s (0.25) is no longer credited
    (0.0, [(1.05, 0.05)], ReportMatch(Unmatched(0.5, 0.6, 0.05)), False, 0.0, ReportMatch()),
])
def test_cooperative_part(busy: float, reports: list[tuple[float, float]], state: ReportMatch, charged: bool,
                          part: float, after: ReportMatch) -> None:
    got, new = cooperative_part(busy, 1.0, 1.05, reports, state, 0.25, charged)
    assert got == pytest.approx(part)
    assert (new.unmatched is None) == (after.unmatched is None)
    if new.unmatched is not None and after.unmatched is not None:
        assert (new.unmatched.start, new.unmatched.end) == (after.unmatched.start, after.unmatched.end)
        assert new.unmatched.seconds == pytest.approx(after.unmatched.seconds)
    assert new.credit_s == pytest.approx(after.credit_s)


# --- a freezer-governed tenant's demand -------------------------------------------------------------------------------
@pytest.mark.parametrize(("case", "expected"), [
    (dict(lost=True, was_active=True), (False, 1, Rule.LOST)),
    (dict(off_gpu=True, was_active=True, cpu_cores=1.0), (False, 1, Rule.OFF_GPU)),  # CPU start-up: no GPU demand
    (dict(frozen=True, was_active=True), (True, 1, Rule.FROZEN_KEEPS)),
    (dict(frozen=True, was_active=False), (False, 1, Rule.FROZEN_KEEPS)),
    (dict(cpu_cores=0.5), (True, 0, Rule.BUSY)),
    (dict(gpu_alone=True), (True, 0, Rule.BUSY)),
    (dict(was_active=True), (True, 2, Rule.IDLE)),  # one idle slice more: still within idle_slices
    (dict(was_active=True, idle_run=2), (False, 3, Rule.IDLE)),  # the third: demand ends
    (dict(cpu_cores=0.05), (False, 2, Rule.IDLE)),  # at the threshold is no activity
])
def test_demand_rule(case: dict[str, object], expected: tuple[bool, int, Rule]) -> None:
    args: dict[str, object] = dict(was_active=False, lost=False, frozen=False, off_gpu=False, gpu_alone=False,
                                   cpu_cores=0.0, idle_run=1, activity_threshold=0.05, idle_slices=3)
    args.update(case)
    assert demand_rule(**args) == expected  # type: ignore[arg-type]


# --- a tenant's freeze --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tenant", "waits", "state", "frozen", "rule"), [
    (TenantView("k", frozenset({SM}), True), False, PlanState(), False, Rule.RUNS),
    (TenantView("k", frozenset({SM}), True), True, PlanState(), True, Rule.WAITS),
    (TenantView("k", frozenset({SM}), True), True, PlanState(gates=sliced(SM)), True, Rule.WAITS),
    (TenantView("k", frozenset({SM}), True), True, PlanState(gates=opened(SM)), False, Rule.UNSATURATED),
    (TenantView("k", frozenset({SM, DEC}), True), True, PlanState(gates=opened(SM)), True, Rule.WAITS),  # DEC sliced
    (TenantView("k", frozenset(), True), True, PlanState(), True, Rule.WAITS),
    (TenantView("c", frozenset({SM}), True, cooperative=True), True, PlanState(), False, Rule.COOPERATIVE),
    (TenantView("c", frozenset({SM}), True, cooperative=True, enforced=True), True, PlanState(gates=opened(SM)),
     True, Rule.WAITS),  # an overrunner is frozen when it must wait, open gate or not
    (TenantView("c", frozenset({SM}), True, cooperative=True, enforced=True), False, PlanState(paused=frozenset({SM})),
     False, Rule.RUNS),  # its lease is revoked instead (Plan.revoked)
    (TenantView("k", frozenset({SM}), True), False, PlanState(paused=frozenset({SM})), True, Rule.MIX_PAUSED),
    (TenantView("k", frozenset({SM}), True), True, PlanState(gates=opened(SM), paused=frozenset({SM})),
     True, Rule.MIX_PAUSED),  # open for the fair share, but its side sits out
    (TenantView("k", frozenset({SM}), False), False, PlanState(paused=frozenset({SM})), False, Rule.RUNS),  # idle
    (TenantView("k", frozenset({GFX}), True), False, PlanState(paused=frozenset({SM})), False, Rule.RUNS),
    # rationing: held open while saturated, a tenant that sits out (sit_out_rule) is frozen
    (TenantView("k", frozenset({SM}), True), True, PlanState(gates=opened(SM), rationed=frozenset({SM})),
     False, Rule.UNSATURATED),  # does not sit out: runs
])
def test_freeze_rule(tenant: TenantView, waits: bool, state: PlanState, frozen: bool, rule: Rule) -> None:
    verdict = freeze_rule(tenant, waits, state)
    assert (verdict.frozen, verdict.rule) == (frozen, rule)


@pytest.mark.parametrize(("waits", "state", "frozen", "rule"), [
    (True, PlanState(gates=opened(SM), rationed=frozenset({SM})), True, Rule.AHEAD),
    (False, PlanState(gates=opened(SM), rationed=frozenset({SM})), False, Rule.RUNS),  # the fair share's holder
    (True, PlanState(gates=sliced(SM)), True, Rule.WAITS),  # sliced: its turn decides
])
def test_freeze_rule_for_a_tenant_that_sits_out(waits: bool, state: PlanState, frozen: bool, rule: Rule) -> None:
    verdict = freeze_rule(TenantView("k", frozenset({SM}), True), waits, state, sits_out=True)
    assert (verdict.frozen, verdict.rule) == (frozen, rule)


Cap = SitOutCap


@pytest.mark.parametrize(("out", "cap", "util", "expected"), [
    (0, None, 1.0, (1, None)), (3, None, 0.9, (4, None)),  # saturated (at high): one more
    (0, None, 0.5, (0, None)), (0, Cap(2), None, (0, Cap(2, 1))),  # room (or no reading) with nobody out: no cap
    (3, None, 0.89, (2, None)),  # room with 3 out, the GPU still busy: one fewer
    (3, None, 0.5, (2, Cap(2))),  # their absence left it idle (under low): not 3 again for a while
    (1, None, 0.2, (0, Cap(0))),  # two that fill the GPU only together: no rationing for a while
    (3, Cap(1), 0.89, (1, Cap(1, 1))), (1, Cap(1), 1.0, (1, Cap(1, 1))),  # at its cap
])
def test_sit_out_budget(out: int, cap: SitOutCap | None, util: float | None,
                        expected: tuple[int, SitOutCap | None]) -> None:
    assert sit_out_budget(out, cap, util, high=0.9, low=0.6) == expected


@pytest.mark.parametrize(("out", "cap", "util", "expected"), [
    (3, Cap(3, 1), 0.5, (2, Cap(3, 2))),  # lowered a slice ago: the same GPU reading, not lowered again
    (3, Cap(3, 3), 0.5, (2, Cap(2))),  # lowered four slices ago: a new reading, lowered
    (2, Cap(2, 38), 1.0, (2, Cap(2, 39))),  # not lowered for 39 slices: as it was
    (2, Cap(2, 39), 1.0, (3, Cap(3))),  # for 40: one more may sit out
    (2, Cap(2, 39), 0.5, (1, Cap(1))),  # lowered at the same slice: lowered wins
])
def test_sit_out_cap_settles_and_releases(out: int, cap: SitOutCap, util: float,
                                          expected: tuple[int, SitOutCap | None]) -> None:
    assert sit_out_budget(out, cap, util, high=0.9, low=0.6, settle=4, release=40) == expected


def R(name: str, lead: float, used: float = 0.004, ran: int = 4, weight: int = 100) -> Rationed:
    return Rationed(name, lead, weight, used, ran)


@pytest.mark.parametrize(("rows", "budget", "steps", "out"), [
    ([R("a", 0.05), R("b", 0.02), R("c", 0.0)], 5, 1, [{"a", "b"}]),  # only those ahead (lead > 0.0125 s here)
    ([R("a", 0.05), R("b", 0.02), R("c", 0.0)], 1, 1, [{"a"}]),  # the furthest ahead first
    # furthest by virtual time: the light one, though the heavy one had more GPU seconds beyond its share
    ([R("light", 0.03, weight=100), R("heavy", 0.05, weight=400)], 1, 1, [{"light"}]),
    ([R("a", 0.05), R("b", 0.02)], 0, 2, [set(), set()]),
    ([R("a", 0.01)], 3, 2, [set(), set()]),  # within the allowed lead: nobody
    # one far ahead sits out every step; two a little ahead take turns, step by step, while they stay ahead
    ([R("far", 0.2), R("x", 0.016), R("y", 0.016), R("z", 0.0)], 2, 4, [{"far", "y"}, {"far", "x"}, {"far"}, {"far"}]),
    ([R("x", 0.016), R("y", 0.016), R("z", 0.0)], 1, 4, [{"y"}, {"x"}, set(), set()]),
    # one that sat the whole last slice out is taken to use what the others did: back in after two steps
    ([R("x", 0.02, used=0.0, ran=0), R("z", 0.0)], 1, 4, [{"x"}, {"x"}, set(), set()]),
])
def test_step_schedule(rows: list[Rationed], budget: int, steps: int, out: list[set[str]]) -> None:
    got = step_schedule(rows, budget, steps, slice_s=0.05)  # TUNING.ration_lead_slices = 0.25 of the slice
    assert got == tuple(map(frozenset, out))


@pytest.mark.parametrize(("lead_s", "slice_s", "lead_slices", "ahead"), [
    (0.0, 0.05, 0.25, False),
    (0.0125, 0.05, 0.25, False),  # exactly the allowed lead
    (0.0126, 0.05, 0.25, True),
    (0.04, 0.05, 1.0, False),
    (0.06, 0.05, 1.0, True),
])
def test_ahead_rule(lead_s: float, slice_s: float, lead_slices: float, ahead: bool) -> None:
    assert ahead_rule(lead_s, slice_s, lead_slices) is ahead


def test_observe_rations_a_resource_held_open_while_saturated_and_stops_when_it_has_room() -> None:
    """Paced tenants: saturated, sliced, turns unused (opened with a hold), still saturated open: rationed. Once
    rationing, a window whose mean busy fraction falls under `low` ends it, though the hold goes on. Slicing and
    rationing start with the resource levelled."""
    gate = SaturationConfig(high=0.9, low=0.6, enter_slices=2, leave_slices=1, hold_slices=10, max_hold_slices=40,
                            reset_slices=10, cap_settle_slices=1, cap_release_slices=0)
    cfg = config(gate=gate)
    use = [FreezerUse(frozenset({SM}), frozenset({G}), frozenset({G}), False, 0.1)]
    state = PlanState()
    seen, levelled = [], []
    for util in (1.0, 1.0, 0.2, 1.0, 1.0, 1.0, 0.5, 1.0, 0.2, 0.2):
        outcome, state = observe(cfg, use, {0: Sample(util)}, {SM: 3}, {}, state)
        seen.append((state.is_open(SM), SM in state.rationed, state.sit_out.get(SM)))
        levelled.append(SM in outcome.level)
    # levelled where slicing starts and where rationing does: nobody is owed catch-up, nor pays back a lead
    assert [i for i, x in enumerate(levelled) if x] == [1, 4]
    assert seen == [(True, False, None), (False, False, None),  # saturated over two slices: sliced
                    (True, False, None),  # the turn went unused: open, held
                    (True, False, None), (True, True, 1), (True, True, 2),  # saturated while held: rationed,
                    # one more may sit out after each saturated slice
                    (True, True, 1),  # those out left it idle (0.5 < low): one fewer, and at most 1 from now on
                    (True, True, 1),  # saturated, but capped
                    (True, True, 0),  # idle again with one out: none may sit out
                    (True, False, None)]  # the window's mean under low: room, not rationed


# --- a lease grant ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("contenders", "mixed", "beside", "contended"), [
    (1, False, False, False),  # alone: it may keep its queue full
    (2, False, False, True),
    (1, True, False, True),  # its side of a mixed pair sits out at the next switch
    (1, False, True, True),  # an online tenant may preempt it any moment
    (0, False, False, False),
])
def test_lease_contended(contenders: int, mixed: bool, beside: bool, contended: bool) -> None:
    assert lease_contended(contenders, mixed, beside) is contended


ON, OFF = Priority.ONLINE, Priority.OFFLINE


@pytest.mark.parametrize(("preemptive", "tenant", "draining", "jumps"), [
    (True, ON, OFF, True),  # an online request does not wait on an offline tail
    (True, ON, ON, False), (True, OFF, OFF, False), (True, OFF, ON, False),
    (False, ON, OFF, False),  # shared, timeshare, tidal: the next holder waits for the yield
])
def test_online_jumps(preemptive: bool, tenant: Priority, draining: Priority, jumps: bool) -> None:
    assert online_jumps(preemptive, tenant, draining) is jumps


@pytest.mark.parametrize(("preemptive", "prio", "online", "jump"), [
    (True, ON, frozenset({"a"}), True),
    (True, ON, frozenset({"a", "b"}), False),  # another online tenant may be behind it
    (True, OFF, frozenset(), False),
    (False, ON, frozenset({"a"}), False),
])
def test_lease_jump(preemptive: bool, prio: Priority, online: frozenset[str], jump: bool) -> None:
    assert lease_jump(preemptive, prio, online, "a") is jump


# --- the two steps over slices ---------------------------------------------------------------------------------
def _observe(state: PlanState, util: float | None, cpu: float = 0.0, contenders: int = 2,
             cfg: PlanConfig | None = None) -> tuple[list[bool], tuple[Resource, ...], PlanState]:
    cfg = cfg or config()
    use = [FreezerUse(frozenset({SM}), frozenset({C}), frozenset({C}), False, cpu),
           FreezerUse(frozenset({SM}), frozenset({C}), frozenset({C}), True, 0.0)]
    samples = {} if util is None else {0: Sample(util)}
    outcome, state = observe(cfg, use, samples, {SM: contenders}, {}, state)
    return [g.now_open for g in outcome.readings], outcome.level, state


def test_observe_slices_a_saturated_resource_and_levels_it_once() -> None:
    state = PlanState()
    opens, level, state = _observe(state, 1.0)
    assert opens == [True] and level == ()
    opens, level, state = _observe(state, 1.0)
    assert opens == [False] and level == (SM,)  # the fair share starts with nobody owed
    opens, level, state = _observe(state, 1.0)
    assert opens == [False] and level == ()


def test_observe_reads_no_signal_and_the_cpu_stand_in_as_sliced() -> None:
    _, _, state = _observe(PlanState(), None)
    assert not state.is_open(SM)
    _, _, state = _observe(PlanState(gates=opened(SM)), 0.02, cpu=0.9)
    assert not state.is_open(SM)


def test_observe_leaves_the_input_state_alone() -> None:
    before = PlanState(gates=opened(SM))
    _observe(before, None)
    assert before.is_open(SM)


def test_observe_keys_a_partly_overlapping_pair_by_its_joint_resource() -> None:
    cfg = config(PARTIAL)
    use = [FreezerUse(frozenset({SM}), frozenset({C}), frozenset({C}), False, 1.0),
           FreezerUse(frozenset({GFX}), frozenset({G}), frozenset({G}), False, 0.2)]
    pairs = {0: PairWeights(100, 100, False)}
    state = PlanState()
    for _ in range(2):
        outcome, state = observe(cfg, use, {0: Sample(1.0)}, {SM: 1, GFX: 1}, pairs, state)
    by = {g.resource: g for g in outcome.readings}
    assert by[SM].now_open and by[GFX].now_open  # alone on its side
    assert not by[JOINT].now_open and by[JOINT].contenders == 2  # the pair contends: mixed slices
    assert JOINT not in outcome.level  # no fair-share clock behind the joint key


def test_plan_revokes_the_side_that_sits_out_and_marks_the_pair_mixed() -> None:
    cfg = config(PARTIAL)
    decision = Decision(0.0, 0.05, frozenset({"cuda", "render"}), frozenset({"cuda", "render"}),
                        {SM: "cuda", GFX: "render"})
    tenants = (TenantView("cuda", frozenset({SM}), True), TenantView("render", frozenset({GFX}), True, cooperative=True))
    state = PlanState(gates=sliced(JOINT))
    kinds = []
    for _ in range(8):
        p, state = plan(cfg, PlanInputs(decision, tenants, {0: PairWeights(300, 100, True)}, 0.05), state)
        kinds.append(p.mixes[0].kind)
        assert p.mixed == frozenset({SM, GFX})
        if p.mixes[0].kind is SliceKind.COMPUTE:  # the render's side sits out: its lease is revoked
            assert p.holders == {SM: "cuda"} and p.revoked == {GFX: Rule.MIX_PAUSED}
        else:
            assert p.holders == decision.holders and p.revoked == {}
        assert p.freeze[0].frozen is (p.mixes[0].kind is SliceKind.GRAPHICS)
    assert SliceKind.COMPUTE in kinds and SliceKind.BOTH in kinds  # 3:1 with kept 0.22/0.92: together 32%
    between, same = plan(cfg, PlanInputs(decision, tenants), state)  # between ticks the tick's mix stays
    assert between.mixes == {} and same == state and between.mixed == p.mixed


def test_plan_on_an_open_pair_without_cooperative_tenants_does_not_mix() -> None:
    cfg = config(PARTIAL)
    decision = Decision(0.0, 0.05, frozenset({"cuda", "render"}), frozenset({"cuda", "render"}),
                        {SM: "cuda", GFX: "render"})
    tenants = (TenantView("cuda", frozenset({SM}), True), TenantView("render", frozenset({GFX}), True))
    p, _ = plan(cfg, PlanInputs(decision, tenants, {0: PairWeights(100, 100, False)}, 0.05),
                PlanState(gates=opened(JOINT)))
    assert p.mixes == {} and p.mixed == frozenset() and not any(v.frozen for v in p.freeze)


def test_plan_rations_only_tenants_whose_sitting_out_takes_effect() -> None:
    """Of the tenants ahead on a rationed resource, the fair share's holder (it runs) and a cooperative tenant (its
    leases, not the freezer, gate it) do not sit out and do not use up the budget: the next furthest ahead do."""
    decision = Decision(0.0, 0.05, frozenset({"holder"}), frozenset({"holder", "coop", "a", "b", "c"}),
                        {SM: "holder"})
    lead = {"holder": 0.5, "coop": 0.4, "a": 0.3, "b": 0.2, "c": 0.1}  # all past a quarter slice (0.0125 s)
    tenants = tuple(TenantView(n, frozenset({SM}), True, cooperative=n == "coop", leads=((SM, x, 0.0),))
                    for n, x in lead.items())
    state = PlanState(gates=opened(SM), rationed=frozenset({SM}), sit_out={SM: 2})
    p, state = plan(config(), PlanInputs(decision, tenants, {}), state)
    assert [(v.frozen, v.rule) for v in p.freeze] == [
        (False, Rule.RUNS), (False, Rule.COOPERATIVE), (True, Rule.AHEAD), (True, Rule.AHEAD), (False, Rule.UNSATURATED)]
    assert state.sit_out == {SM: 2}


def test_a_tick_carries_each_tenants_stretch_out_across_slices() -> None:
    """PlanState.out_run: how many steps in a row each tenant had sat out when the slice's steps began, carried
    through the last slice's steps, so that one that sat out ration_run_steps in a row (across slices) yields its
    place to another ahead (`step_schedule`)."""
    decision = Decision(0.0, 0.05, frozenset(), frozenset({"far", "near"}), {})
    tenants = (TenantView("far", frozenset({SM}), True, leads=((SM, 0.5, 0.0),)),
               TenantView("near", frozenset({SM}), True, leads=((SM, 0.1, 0.0),)))
    limit = TUNING.ration_run_steps
    last = (frozenset({"far"}),) * 4
    state = PlanState(gates=opened(SM), rationed=frozenset({SM}), sit_out={SM: 1}, steps=last, out_run={"far": limit - 4})
    _, state = plan(config(), PlanInputs(decision, tenants, {}), state)
    assert state.out_run == {"far": limit}
    assert state.steps[0] == frozenset({"near"}) and state.steps[1] == frozenset({"far"})


def test_between_ticks_the_step_of_the_slice_says_who_sits_out() -> None:
    """A tick chooses who sits out of each step of the slice (PlanState.steps); the decisions between ticks, at
    each step (scheduler.tick.advance) or at a client's request, freeze those of the step they fall in. No
    resource rationed: nobody sits out and the steps are dropped."""
    decision = Decision(0.0, 0.05, frozenset(), frozenset({"a", "b", "c"}), {})
    tenants = tuple(TenantView(n, frozenset({SM}), True) for n in "abc")
    steps = (frozenset({"a"}), frozenset({"b"}), frozenset(), frozenset({"a", "b"}))
    state = PlanState(gates=opened(SM), rationed=frozenset({SM}), sit_out={SM: 2}, steps=steps)
    for step, out in enumerate(steps):
        p, after = plan(config(), PlanInputs(decision, tenants, None, step=step), state)
        assert after.steps == steps
        assert {t.name for t, v in zip(tenants, p.freeze, strict=True) if v.rule is Rule.AHEAD} == out
    p, after = plan(config(), PlanInputs(decision, tenants, None), replace(state, rationed=frozenset()))
    assert after.steps == () and not any(v.frozen for v in p.freeze)


def test_observe_with_no_freezer_use_keeps_the_state_as_it_is_and_ends_rationing_as_before() -> None:
    """Cooperative tenants alone (no FreezerUse): nothing to read, and the state comes back as it was, the same object
    (no copy a tick); the gates remembered stay. A state that still rations or caps a resource goes the whole way,
    which ends them as it always did."""
    cfg = config()
    kept = PlanState(gates=sliced(SM))
    outcome, state = observe(cfg, [], {0: Sample(1.0)}, {}, {}, kept)
    assert state is kept and outcome.readings == () and outcome.level == ()
    rationing = PlanState(gates=opened(SM), rationed=frozenset({SM}), sit_out={SM: 1},
                          sit_out_cap={SM: SitOutCap(1, 0)})
    outcome, state = observe(cfg, [], {0: Sample(1.0)}, {}, {}, rationing)
    assert outcome.readings == () and outcome.level == ()
    assert state == replace(rationing, rationed=frozenset(), sit_out={}, sit_out_cap={})
