"""The fast WeightedFairShare against a plain reference: a full sort of every active tenant, each decision.

The reference is the policy as specified (the first, O(N log N)-per-decision implementation, with the
timeshare fixes): the indexed one must make the same decisions and keep the same virtual times. Weights are
powers of two and charges multiples of 1/64 s, so the arithmetic is exact and any difference is a real one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unisched.policy import (
    DEFAULT_WEIGHT,
    FairShareConfig,
    Mode,
    Priority,
    Resource,
    TenantSpec,
    WeightedFairShare,
)

EPS = 1e-6


@dataclass
class _T:
    spec: TenantSpec
    weight: int
    vtime: dict[Resource, float] = field(default_factory=dict)
    demand: frozenset[Resource] = frozenset()
    slices: int = 0
    last_run_end: float = float("-inf")
    turn_started: float | None = None


class Reference:
    def __init__(self, config: FairShareConfig) -> None:
        self.config = config
        self.tenants: dict[str, _T] = {}
        self.vclock: dict[Resource, float] = {}
        self.holders: dict[Resource, str] = {}

    def upsert(self, spec: TenantSpec) -> None:
        t = self.tenants.get(spec.name)
        if t is None:
            self.tenants[spec.name] = _T(spec, spec.weight)
        else:
            t.spec, t.weight = spec, spec.weight

    def remove(self, name: str) -> None:
        del self.tenants[name]
        self.holders = {r: h for r, h in self.holders.items() if h != name}

    def set_weight(self, name: str, weight: int) -> None:
        self.tenants[name].weight = weight

    def clock(self, r: Resource) -> float:
        active = [t.vtime[r] for t in self.tenants.values() if r in t.demand]
        c = max(self.vclock.get(r, 0.0), min(active)) if active else self.vclock.get(r, 0.0)
        self.vclock[r] = c
        return c

    def set_demand(self, name: str, resources: frozenset[Resource]) -> None:
        t = self.tenants[name]
        limit = self.config.lag_limit_slices * self.config.slice_s / t.weight
        for r in resources - t.demand:
            c = self.clock(r)
            t.vtime[r] = c if r not in t.vtime else max(t.vtime[r], c - limit)
        t.demand = resources

    def charge(self, name: str, r: Resource, seconds: float) -> None:
        if seconds == 0:
            return
        t = self.tenants[name]
        if r not in t.vtime:
            t.vtime[r] = self.clock(r)
        t.vtime[r] += seconds / t.weight

    def window(self, t: _T) -> float:
        return self.config.timeshare_window_s * t.weight / DEFAULT_WEIGHT

    def decide(self, now: float) -> tuple[frozenset[str], frozenset[str], dict[Resource, str], float]:
        mode = self.config.mode
        timeshare, preemptive = mode is Mode.TIMESHARE, mode is Mode.PREEMPTIVE
        active = {n: t for n, t in self.tenants.items() if t.demand}
        clocks = {r: self.clock(r) for t in active.values() for r in t.demand}

        def held(n: str, t: _T) -> bool:
            return any(self.holders.get(r) == n for r in t.demand)

        def rank(item: tuple[str, _T]) -> tuple[float, float, float, str]:
            n, t = item
            cls = 0.0 if preemptive and t.spec.priority is Priority.ONLINE else 1.0
            if timeshare:
                if t.turn_started is None:
                    return (cls, 1.0, t.last_run_end, n)
                if held(n, t) and now - t.turn_started < self.window(t) - EPS:
                    return (cls, 0.0, t.last_run_end, n)
                return (cls, 1.0, now, n)
            lag = max(t.vtime[r] - clocks[r] for r in t.demand)
            return (cls, lag, 0.0 if held(n, t) else 1.0, n)

        taken: set[Resource] = set()
        running: set[str] = set()
        holders: dict[Resource, str] = {}
        for n, t in sorted(active.items(), key=rank):
            if t.demand & taken:
                if timeshare and len(t.demand) > 1:
                    taken |= t.demand
                continue
            running.add(n)
            taken |= t.demand
            holders.update(dict.fromkeys(t.demand, n))
        for n, t in self.tenants.items():
            if n in running:
                t.slices += 1
                expired = timeshare and t.turn_started is not None and now - t.turn_started >= self.window(t) - EPS
                if t.turn_started is None or not held(n, t) or expired:
                    t.turn_started = now
            elif t.turn_started is not None:
                t.turn_started, t.last_run_end = None, now
        self.holders = holders
        slice_s = self.config.slice_s
        if timeshare and running:
            left = [self.window(self.tenants[n]) - (now - (self.tenants[n].turn_started or 0.0)) for n in running]
            slice_s = max(0.001, min(max(left), slice_s * 4))
        return frozenset(running), frozenset(active) - running, holders, slice_s


RESOURCES = [Resource(g, d) for g in (0, 1) for d in ("sm", "gfx")]
pow2_weights = st.integers(0, 10).map(lambda k: 2**k)
demands = st.lists(st.sampled_from(RESOURCES), max_size=3, unique=True).map(frozenset)
charges = st.integers(0, 16).map(lambda k: k / 64)


@st.composite
def ops(draw: st.DrawFn) -> list[tuple[object, ...]]:
    names = [f"t{i}" for i in range(draw(st.integers(2, 8)))]
    out: list[tuple[object, ...]] = [
        ("add", n, draw(pow2_weights), draw(st.sampled_from(list(Priority)))) for n in names
    ]
    for _ in range(draw(st.integers(5, 80))):
        kind = draw(st.sampled_from(["demand", "decide", "decide", "decide", "weight", "prio", "remove", "drain"]))
        n = draw(st.sampled_from(names))
        if kind == "demand":
            out.append(("demand", n, draw(demands)))
        elif kind == "weight":
            out.append(("weight", n, draw(pow2_weights)))
        elif kind == "prio":
            out.append(("prio", n, draw(st.sampled_from(list(Priority)))))
        elif kind == "remove":
            out.append(("remove", n))
        elif kind == "drain":
            out.append(("drain", n, draw(st.sampled_from(RESOURCES)), draw(charges)))
        else:
            out.append(("decide", draw(charges)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops(), st.sampled_from(list(Mode)), st.sampled_from([0.0, 1.0, 2.0]))
def test_fast_policy_decides_like_the_reference(script: list[tuple[object, ...]], mode: Mode, lag: float) -> None:
    config = FairShareConfig(mode=mode, slice_s=0.0625, lag_limit_slices=lag, timeshare_window_s=0.125)
    fast, ref = WeightedFairShare(config), Reference(config)
    now = 0.0
    for op in script:
        kind = op[0]
        if kind == "add":
            _, n, w, prio = op
            spec = TenantSpec(n, w, prio)  # type: ignore[arg-type]
            fast.upsert(spec)
            ref.upsert(spec)
        elif kind == "demand":
            _, n, ds = op
            fast.set_demand(n, ds)  # type: ignore[arg-type]
            ref.set_demand(n, ds)  # type: ignore[arg-type]
        elif kind == "weight":
            _, n, w = op
            fast.set_weight(n, w)  # type: ignore[arg-type]
            ref.set_weight(n, w)  # type: ignore[arg-type]
        elif kind == "prio":
            _, n, prio = op
            spec = TenantSpec(n, fast.weight(n), prio)  # type: ignore[arg-type]
            fast.upsert(spec)
            ref.upsert(spec)
        elif kind == "remove":
            _, n = op
            fast.remove(n)  # type: ignore[arg-type]
            ref.remove(n)  # type: ignore[arg-type]
            fast.upsert(TenantSpec(n))  # type: ignore[arg-type]
            ref.upsert(TenantSpec(n))  # type: ignore[arg-type]
        elif kind == "drain":
            _, n, r, s = op
            fast.charge(n, r, s, now)  # type: ignore[arg-type]
            ref.charge(n, r, s)  # type: ignore[arg-type]
        else:
            d = fast.decide(now)
            running, waiting, holders, slice_s = ref.decide(now)
            assert (d.running, d.waiting, dict(d.holders), d.slice_s) == (running, waiting, holders, slice_s)
            for r, n in d.holders.items():
                fast.charge(n, r, op[1], now)  # type: ignore[arg-type]
                ref.charge(n, r, op[1])  # type: ignore[arg-type]
            now += d.slice_s
        assert fast.vtimes() == {n: t.vtime for n, t in ref.tenants.items()}
    assert {s.name: s.slices for s in fast.stats(now)} == {n: t.slices for n, t in ref.tenants.items()}
