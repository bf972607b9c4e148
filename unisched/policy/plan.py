"""One scheduling model: who runs on each resource in the next slice, and the rule that decided it.

A slice goes: measure -> `observe` (the saturation gates read the measurements) -> the fair-share core decides
(policy.fairshare) -> `plan` (what the freezer and the leases do with that decision). Both steps are pure: they
take frozen values (time and measurements passed in) and the previous `PlanState`, and return a new state. The
fair-share core sits between them because a resource the gate starts slicing has its virtual clocks levelled
(`GateOutcome.level`) before the decision that slices it.

Each rule is a named function below, in the order it applies; docs/design/scheduling.md says why each exists
and what measurement motivated it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import NamedTuple, Protocol

from unisched.policy.contention import ContentionMap
from unisched.policy.fairshare import Decision
from unisched.policy.model import Engine, Priority, Resource
from unisched.policy.overlap import MixClock, OverlapMix, PairWeights, SliceKind, mix_contenders, overlap_mix
from unisched.policy.rationing import Rationed, SitOutCap, out_runs, sit_out_budget, step_schedule
from unisched.policy.saturation import GateMemory, SaturationConfig, fresh_gate, gate_step, rationing
from unisched.policy.tuning import TUNING

__all__ = [
    "MIX_DOMAIN",
    "GateOutcome",
    "GateReading",
    "FreezerUse",
    "MixSlice",
    "Plan",
    "PlanConfig",
    "PlanInputs",
    "PlanState",
    "Rule",
    "TenantView",
    "UtilSample",
    "Verdict",
    "cpu_busy",
    "demand_rule",
    "freeze_rule",
    "gate_reading",
    "lease_contended",
    "lease_jump",
    "observe",
    "online_jumps",
    "plan",
    "turn_used",
]

MIX_DOMAIN = "sm+gfx"
"""The gate's key for a GPU's partly overlapping compute + graphics pair: mixed slices only while it is saturated."""


class Rule(StrEnum):
    """The rule that decided a reading, a demand, or a tenant's freeze (logs and tests name it)."""

    # what the gate reads for a resource
    SIGNAL = "signal"
    """The GPU's busy fraction, as measured."""
    NO_SIGNAL = "no-signal"
    """No GPU sample (no GPU, NVML failed): nothing is known about saturation, so the resource is sliced."""
    CPU_STAND_IN = "cpu-stand-in"
    """The GPU reads idle under a compute tenant busy launching work: read as no signal (sliced)."""
    # how a freezer-governed tenant is charged (also SIGNAL: the GPU's busy time, split by CPU activity)
    CPU_TIME = "cpu-time"
    """No GPU signal: each tenant's CPU time stands in for its GPU time."""
    PROCESS_RATE = "process-rate"
    """The GPU's busy time split by CPU activity scaled by each tenant's GPU seconds per CPU second, as NVML's
    per-process samples showed them (`policy.charging.gpu_per_cpu`)."""
    REPORT = "report"
    """A cooperative tenant's report of the GPU time its units took (scheduler.lease_charges): its own work, and the
    drain of a freezer-governed tenant frozen for its turn that its first units waited behind."""
    # a freezer-governed tenant's demand
    LOST = "lost"
    """Its cgroup is gone: no demand."""
    OFF_GPU = "off-gpu"
    """No GPU context anywhere in it: no demand, never frozen."""
    FROZEN_KEEPS = "frozen-keeps"
    """Frozen, it cannot show work: it keeps the demand it had."""
    BUSY = "busy"
    """It used the GPU alone, or its CPUs past the activity threshold."""
    IDLE = "idle"
    """It showed no work: demand ends after idle_slices such slices."""
    # a tenant's freeze
    RUNS = "runs"
    """The fair-share core let it run (it holds its resources, or has no demand)."""
    WAITS = "waits"
    """The fair-share core made it wait for its turn."""
    COOPERATIVE = "cooperative"
    """Leases, not the freezer, gate a cooperative tenant."""
    UNSATURATED = "unsaturated"
    """Every resource it waits for is open (unsaturated, or held open after slicing left turns unused)."""
    MIX_PAUSED = "mix-paused"
    """Its side of a partly overlapping compute + graphics pair sits this slice out."""
    AHEAD = "ahead"
    """A resource it uses is held open while saturated (rationing), and it is ahead of its weight share there: it
    sits out until the others catch up."""


class UtilSample(Protocol):
    """One GPU's busy fractions over the interval (telemetry.GpuSample is one)."""

    @property
    def ok(self) -> bool: ...

    def util(self, engine: Engine) -> float: ...


@dataclass(frozen=True)
class PlanConfig:
    contention: ContentionMap
    gpus: tuple[int, ...]
    gate: SaturationConfig
    activity_threshold: float
    """A busy fraction (or CPU cores) above this is activity; at or below it the GPU reads idle."""
    idle_slices: int
    slice_s: float
    """The slice length: a lead of `ration_lead_slices` of it makes a tenant ahead of its share."""
    mix_period_s: float = 1.0
    turn_cpu_cores: float = TUNING.turn_cpu_cores
    ration: bool = True
    """Ration resources held open while saturated (policy.rationing); without it they stay open to all."""
    ration_steps: int = TUNING.ration_steps
    """Steps of a rationed slice, each with its own tenants sitting out (policy.rationing.step_schedule)."""

    @property
    def mixing(self) -> bool:
        """Compute and graphics overlap partly on these GPUs: they take mixed slices (policy.overlap)."""
        return self.contention.kept is not None


# --- values in ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FreezerUse:
    """A freezer-governed tenant's last interval as measured (cooperative and lost tenants are left out)."""

    resources: frozenset[Resource]
    engines: frozenset[Engine]
    """The engines it shows demand on: those it declared and those its open sessions show."""
    declared: frozenset[Engine]
    """The engines it declared. A CUDA context does not make a decoder a compute tenant: PyAV's hardware decode opens
    one beside its NVDEC session, and its CPU then feeds the decoder (cpu_busy)."""
    frozen: bool
    cpu_cores: float
    """CPU time over the interval, per second of it."""


class TenantView(NamedTuple):
    """A tenant as the freeze rules see it (a named tuple, not a dataclass: one is built per tenant per decision,
    and decisions also come between slices, at every cooperative client's request)."""

    name: str
    resources: frozenset[Resource]
    active: bool
    cooperative: bool = False
    enforced: bool = False
    """Cooperative, and it kept overrunning its leases: the freezer backs them."""
    leads: tuple[tuple[Resource, float, float], ...] = ()
    """Per rationed resource it uses (PlanState.rationed): the GPU seconds it had there beyond its weight share, and
    those it was charged there over the last slice."""
    weight: int = 1
    """Its weight: those ahead are ranked by their lead over it (policy.rationing.step_schedule)."""


@dataclass(frozen=True)
class PlanInputs:
    decision: Decision
    """The fair-share core's holders for the next slice."""
    tenants: tuple[TenantView, ...]
    pairs: Mapping[int, PairWeights] | None = None
    """Per GPU, the mix weights measured this tick; None between ticks (the mix of the tick stays)."""
    dt: float = 0.0
    """The interval that just ended (the running mixed slice is counted for it)."""
    step: int = 0
    """Between ticks, the step of a rationed slice this decision falls in (PlanState.steps)."""


# --- state -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanState:
    gates: Mapping[Resource, GateMemory] = field(default_factory=dict)
    clocks: Mapping[int, MixClock] = field(default_factory=dict)
    running: Mapping[int, SliceKind] = field(default_factory=dict)
    """Per GPU, the kind of mixed slice running now."""
    paused: frozenset[Resource] = frozenset()
    """Resources whose tenants sit this slice out: the other side of a partly overlapping pair runs alone."""
    mixed: frozenset[Resource] = frozenset()
    """Both sides of every GPU whose compute and graphics take mixed slices now (their leases are contended)."""
    rationed: frozenset[Resource] = frozenset()
    """Resources held open while saturated (policy.saturation.rationing): tenants ahead of their share sit out."""
    sit_out: Mapping[Resource, int] = field(default_factory=dict)
    """Per rationed resource, how many of the tenants ahead of their share sit out of a step (`sit_out_budget`)."""
    steps: tuple[frozenset[str], ...] = ()
    """Who sits out of each step of this slice, over every rationed resource (`step_schedule`); () when none is."""
    sit_out_cap: Mapping[Resource, SitOutCap] = field(default_factory=dict)
    """Per resource held open, the most that may sit out: fewer than lately left the GPU idle (`sit_out_budget`)."""
    out_run: Mapping[str, int] = field(default_factory=dict)
    """Steps in a row each tenant had sat out when `steps` began (`out_runs`)."""

    def is_open(self, r: Resource) -> bool:
        s = self.gates.get(r)
        return s is not None and s.open


# --- values out --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateReading:
    """What the gate read for one resource this slice, and what it decided (for logs and tests)."""

    resource: Resource
    util: float | None
    rule: Rule
    cpu_busy: bool
    used: bool
    contenders: int
    was_open: bool
    now_open: bool
    held: int


@dataclass(frozen=True)
class GateOutcome:
    readings: tuple[GateReading, ...]
    level: tuple[Resource, ...]
    """Resources slicing or rationing starts on (in reading order): everyone ran as much as it wanted until now, so
    nobody is owed catch-up time (nor sits out for long to pay back a lead run up meanwhile)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    frozen: bool
    rule: Rule


@dataclass(frozen=True)
class MixSlice:
    """One GPU's mix this slice: the weights it follows, the proportions, the kind of slice now and the one before."""

    weights: PairWeights
    mix: OverlapMix
    kind: SliceKind
    previous: SliceKind | None


@dataclass(frozen=True)
class Plan:
    freeze: tuple[Verdict, ...]
    """Per tenant, in the order passed in: frozen or not, and why."""
    holders: Mapping[Resource, str]
    """Who may hold a lease on each resource (the fair share's holders, less the sides that sit out)."""
    revoked: Mapping[Resource, Rule]
    """Resources whose fair-share holder is revoked all the same, and why."""
    mixed: frozenset[Resource]
    mixes: Mapping[int, MixSlice]


# --- the rules: what the gate reads ---------------------------------------------------------------------------
def cpu_busy(u: FreezerUse, config: PlanConfig) -> bool:
    """A thawed tenant that declared compute and kept its CPUs busy used its turn, whatever the GPU reads
    (Tuning.turn_cpu_cores). Declared, not seen: a decoder's CUDA context is no compute work, and its busy CPU
    (the decode loop) would hold two decoders that the GPU runs side by side in turns."""
    return not u.frozen and Engine.COMPUTE in u.declared and u.cpu_cores >= config.turn_cpu_cores


def gate_reading(sample: UtilSample | None, engines: Iterable[Engine], busy_cpu: bool,
                 activity_threshold: float) -> tuple[float | None, Rule]:
    """The busy fraction the gate reads for a resource: the highest of its engines'; None (sliced) without a
    sample, or when the GPU looks idle under compute tenants busy launching work (NVML does not see them)."""
    if sample is None or not sample.ok:
        return None, Rule.NO_SIGNAL
    util = max((sample.util(e) for e in engines), default=0.0)
    if util <= activity_threshold and busy_cpu:
        return None, Rule.CPU_STAND_IN
    return util, Rule.SIGNAL


def turn_used(util: float | None, busy_cpu: bool, low: float) -> bool:
    """The tenants that ran used their turn: a compute one kept its CPUs busy, or the GPU read busier than `low`."""
    return busy_cpu or (util is not None and util >= low)


def _mix_pair(config: PlanConfig, gpu: int) -> tuple[Resource, Resource]:
    c = config.contention
    return Resource(gpu, c.domain(Engine.COMPUTE)), Resource(gpu, c.domain(Engine.GRAPHICS))


_NOTHING_OBSERVED = GateOutcome((), ())


def observe(config: PlanConfig, use: Iterable[FreezerUse], samples: Mapping[int, UtilSample],
            contenders: Mapping[Resource, int], pairs: Mapping[int, PairWeights],
            state: PlanState) -> tuple[GateOutcome, PlanState]:
    """Feed each freezer enforcement resource's reading, and whether the tenants that ran on it used the slice, to its
    saturation gate (policy.saturation). `contenders`: the fair share's count of tenants with demand, per resource
    the freezer-governed tenants use; `pairs`: the mix weights (where compute and graphics overlap partly)."""
    engines_on: dict[Resource, set[Engine]] = {}
    busy: set[Resource] = set()
    domain = config.contention.domain
    for u in use:
        b = cpu_busy(u, config)
        for r in u.resources:
            engines_on.setdefault(r, set()).update(e for e in u.engines if domain(e) == r.domain)
            if b:
                busy.add(r)
    if config.mixing:  # the pair's joint resource: mixed slices only while it is saturated
        for g in config.gpus:
            rc, rg = _mix_pair(config, g)
            if rc in engines_on or rg in engines_on:
                joint = Resource(g, MIX_DOMAIN)
                engines_on[joint] = engines_on.get(rc, set()) | engines_on.get(rg, set())
                if rc in busy or rg in busy:
                    busy.add(joint)
    if not engines_on and not (state.rationed or state.sit_out or state.sit_out_cap):
        return _NOTHING_OBSERVED, state  # no freezer-governed use: what the rest would give (gates kept, none rationed)
    gates = dict(state.gates)
    readings = []
    level = []
    for r, engines in engines_on.items():
        util, rule = gate_reading(samples.get(r.gpu), engines, r in busy, config.activity_threshold)
        n = mix_contenders(pairs.get(r.gpu)) if r.domain == MIX_DOMAIN else contenders.get(r, 0)
        used = turn_used(util, r in busy, config.gate.low)
        before = gates.get(r)
        was_open = before is not None and before.open
        after = gates[r] = gate_step(config.gate, before or fresh_gate(config.gate), util, n, used,
                                     r in state.rationed)
        if was_open and not after.open and r.domain != MIX_DOMAIN:
            level.append(r)
        readings.append(GateReading(r, util, rule, r in busy, used, n, was_open, after.open, after.held))
    rationed = frozenset(x.resource for x in readings if config.ration and x.resource.domain != MIX_DOMAIN
                         and rationing(config.gate, gates[x.resource], x.resource in state.rationed))
    level += [r for r in rationed - state.rationed if r not in level]  # as for slicing: everyone ran as it wanted
    sit_out: dict[Resource, int] = {}
    caps: dict[Resource, SitOutCap] = {}
    for x in readings:
        r = x.resource
        if not gates[r].held:  # caps last while the resource is held open
            continue
        budget, cap = sit_out_budget(state.sit_out.get(r, 0), state.sit_out_cap.get(r), x.util, config.gate.high,
                                     config.gate.low, config.gate.cap_settle_slices, config.gate.cap_release_slices)
        if cap is not None:
            caps[r] = cap
        if r in rationed:
            sit_out[r] = budget
    return GateOutcome(tuple(readings), tuple(level)), replace(state, gates=gates, rationed=rationed, sit_out=sit_out,
                                                               sit_out_cap=caps)


# --- the rules: a freezer-governed tenant's demand ------------------------------------------------------------------------
def demand_rule(*, was_active: bool, lost: bool, frozen: bool, off_gpu: bool, gpu_alone: bool, cpu_cores: float,
                idle_run: int, activity_threshold: float, idle_slices: int) -> tuple[bool, int, Rule]:
    """Whether a freezer-governed tenant has demand after this interval, its run of idle slices, and why. `gpu_alone`: it
    was the only tenant on a resource whose GPU read busy (that busy time is its own)."""
    if lost:
        return False, idle_run, Rule.LOST
    if off_gpu:
        return False, idle_run, Rule.OFF_GPU
    if frozen:
        return was_active, idle_run, Rule.FROZEN_KEEPS
    if gpu_alone or cpu_cores > activity_threshold:
        return True, 0, Rule.BUSY
    return was_active and idle_run + 1 < idle_slices, idle_run + 1, Rule.IDLE


# --- the rules: a tenant's freeze ---------------------------------------------------------------------------
_RUNS = Verdict(False, Rule.RUNS)
_WAITS = Verdict(True, Rule.WAITS)
_COOPERATIVE = Verdict(False, Rule.COOPERATIVE)
_UNSATURATED = Verdict(False, Rule.UNSATURATED)
_AHEAD = Verdict(True, Rule.AHEAD)
_PAUSED = Verdict(True, Rule.MIX_PAUSED)


def _waits_only_for_open(t: TenantView, waits: bool, state: PlanState) -> bool:
    """A freezer-governed tenant the fair share makes wait, on resources that are all open: it runs, unless it sits
    out of a rationed one (the only tenants whose sitting out takes effect)."""
    return not t.cooperative and waits and bool(t.resources) and all(state.is_open(r) for r in t.resources)


def freeze_rule(t: TenantView, waits: bool, state: PlanState, sits_out: bool = False) -> Verdict:
    """Frozen or not for the next slice, in order: the fair share's turn; a cooperative tenant is not frozen
    unless the freezer backs its leases; a freezer-governed tenant waiting only for open resources runs, unless
    it `sits_out` of a rationed one (`step_schedule`); a freezer-governed tenant with demand on a side that sits out
    is frozen."""
    if t.cooperative:
        if not t.enforced:
            return _COOPERATIVE
        return _WAITS if waits else _RUNS
    verdict = _WAITS if waits else _RUNS
    if _waits_only_for_open(t, waits, state):
        verdict = _AHEAD if sits_out else _UNSATURATED
    paused = state.paused
    if not verdict.frozen and paused and t.active and not paused.isdisjoint(t.resources):
        verdict = _PAUSED
    return verdict


# --- the rules: a lease grant (scheduler.leases.LeaseBook keeps the hand-overs in flight) ---------------------
def lease_contended(contenders: int, mixed: bool, online_beside: bool) -> bool:
    """A lease is granted as contended (the client keeps one unit in flight and stops soon after a revoke) where
    others want the resource, where it takes mixed slices, or where `online_beside`: an offline holder on a GPU
    with an online cooperative tenant, in preemptive mode (it may be preempted at any moment)."""
    return contenders > 1 or mixed or online_beside


def online_jumps(preemptive: bool, tenant: Priority, draining: Priority) -> bool:
    """Whether a tenant is granted at once while the revoked holder still finishes its unit in flight: only an
    online tenant after an offline one, in preemptive mode. Elsewhere the next holder waits for the yield, so
    neither pays for the other's tail."""
    return preemptive and tenant is Priority.ONLINE and draining is Priority.OFFLINE


def lease_jump(preemptive: bool, tenant: Priority, online_tenants: frozenset[str], name: str) -> bool:
    """The grant tells an online holder it may jump queued work (`LeaseGrant.jump`) when it is the only online
    tenant in preemptive mode: nobody of its class can be behind it."""
    return preemptive and tenant is Priority.ONLINE and online_tenants == {name}


# --- the plan ----------------------------------------------------------------------------------------------
def _mix_slices(config: PlanConfig, pairs: Mapping[int, PairWeights], dt: float,
                state: PlanState) -> tuple[dict[int, MixSlice], PlanState]:
    """On a saturated GPU with compute and graphics tenants that overlap partly, slices are together, compute
    alone or graphics alone in the proportions that give each side its weight share with the most overlap
    (policy.overlap; the kept rates are the calibration's). Cooperative tenants ask for leases only when they
    have work: the gate does not hold a pair with one of them open."""
    kept = config.contention.kept
    assert kept is not None
    clocks = dict(state.clocks)
    running = dict(state.running)
    paused: set[Resource] = set()
    mixed: set[Resource] = set()
    out: dict[int, MixSlice] = {}
    for g in config.gpus:
        clock = clocks.get(g) or MixClock(period_s=config.mix_period_s)
        last = running.pop(g, None)
        if last is not None:
            clock = clock.ran(last, dt)
        clocks[g] = clock
        pair = pairs.get(g)
        if pair is None or not (pair.compute and pair.graphics) \
                or (state.is_open(Resource(g, MIX_DOMAIN)) and not pair.cooperative):
            continue
        mix = overlap_mix(kept[0], kept[1], pair.compute / (pair.compute + pair.graphics))
        kind, clocks[g] = clock.choose(mix)
        running[g] = kind
        out[g] = MixSlice(pair, mix, kind, last)
        rc, rg = _mix_pair(config, g)
        mixed.update((rc, rg))
        if kind is SliceKind.COMPUTE:
            paused.add(rg)
        elif kind is SliceKind.GRAPHICS:
            paused.add(rc)
    return out, replace(state, clocks=clocks, running=running, paused=frozenset(paused), mixed=frozenset(mixed))


def _ration(config: PlanConfig, tenants: Iterable[TenantView], must_wait: Callable[[str], bool],
            state: PlanState) -> PlanState:
    """Who sits out of each step of the slice on each rationed resource (`step_schedule`), and each budget clamped to
    the most that do in a step. Only tenants whose sitting out takes effect are candidates (`_waits_only_for_open`)."""
    k = max(1, config.ration_steps)
    sat_out = Counter(n for step in state.steps for n in step)  # the last slice's steps: () or k of them
    runs = out_runs(state.out_run, state.steps)
    rows: dict[Resource, list[Rationed]] = {r: [] for r in state.rationed}
    for t in tenants:
        if not _waits_only_for_open(t, must_wait(t.name), state):
            continue
        for r, lead, used in t.leads:
            if r in rows:
                rows[r].append(Rationed(t.name, lead, t.weight, used, k - sat_out[t.name], runs.get(t.name, 0)))
    steps: list[frozenset[str]] = [frozenset()] * k
    budgets: dict[Resource, int] = {}
    for r, xs in rows.items():
        schedule = step_schedule(xs, state.sit_out.get(r, 0), k, config.slice_s)
        budgets[r] = max(map(len, schedule))
        steps = [a | b for a, b in zip(steps, schedule, strict=True)]
    return replace(state, sit_out=budgets, steps=tuple(steps) if any(steps) else (), out_run=runs)


def plan(config: PlanConfig, inputs: PlanInputs, state: PlanState) -> tuple[Plan, PlanState]:
    """What the freezer and the leases do until the next decision. On a tick (`inputs.pairs` given) the mixed
    slices move on; between ticks the tick's mix stays."""
    mixes: dict[int, MixSlice] = {}
    if inputs.pairs is not None and config.mixing:
        mixes, state = _mix_slices(config, inputs.pairs, inputs.dt, state)
    decision = inputs.decision
    must_wait = decision.must_wait
    if not state.rationed:
        state = replace(state, steps=()) if state.steps else state
    elif inputs.pairs is not None:  # a tick: the new slice's steps
        state = _ration(config, inputs.tenants, must_wait, state)
    out = state.steps[min(inputs.step, len(state.steps) - 1)] if state.steps else frozenset()
    freeze = tuple([freeze_rule(t, must_wait(t.name), state, t.name in out) for t in inputs.tenants])
    paused = state.paused
    holders: Mapping[Resource, str] = decision.holders
    revoked: dict[Resource, Rule] = {}
    if paused:  # cooperative holders of the side that sits out are revoked like freezer-governed tenants are frozen
        revoked = {r: Rule.MIX_PAUSED for r in holders if r in paused}
        holders = {r: n for r, n in holders.items() if r not in paused}
    return Plan(freeze, holders, revoked, state.mixed, mixes), state
