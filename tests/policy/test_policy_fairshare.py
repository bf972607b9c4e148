"""WeightedFairShare: convergence, work conservation, lag clamp, engines, priorities, modes (injected time)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unisched.policy import (
    SEPARATE_GRAPHICS,
    SHARED_SM,
    Decision,
    Engine,
    FairShareConfig,
    Mode,
    PolicyError,
    Priority,
    Resource,
    TenantSpec,
    WeightedFairShare,
)

SLICE = 0.05
SM0 = Resource(0, "sm")
GFX0 = Resource(0, "gfx")
DEC0 = Resource(0, "nvdec")
SM1 = Resource(1, "sm")

weights = st.integers(min_value=1, max_value=10_000)


def scheduler(
    tenants: Mapping[str, tuple[int, Iterable[Resource]]],
    mode: Mode = Mode.SHARED,
    priorities: Mapping[str, Priority] | None = None,
    **config: Any,
) -> WeightedFairShare:
    p = WeightedFairShare(FairShareConfig(mode=mode, slice_s=SLICE, **config))
    for name, (weight, demand) in tenants.items():
        p.upsert(TenantSpec(name, weight, (priorities or {}).get(name, Priority.OFFLINE)))
        p.set_demand(name, demand)
    return p


def run(p: WeightedFairShare, slices: int, now: float = 0.0) -> tuple[float, dict[str, dict[Resource, float]]]:
    """Decide, charge every holder the slice it was given, advance; returns the new time and the GPU time used."""
    used: dict[str, dict[Resource, float]] = {}
    for _ in range(slices):
        d = p.decide(now)
        for r, name in d.holders.items():
            p.charge(name, r, d.slice_s, now + d.slice_s)
            per = used.setdefault(name, {})
            per[r] = per.get(r, 0.0) + d.slice_s
        now += d.slice_s
    return now, used


# --- convergence ------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.lists(weights, min_size=2, max_size=16))
def test_charged_time_converges_to_weights(ws: list[int]) -> None:
    """n saturating tenants on one resource: each share is within n/K of its weight share after K slices.

    Every tenant runs only while its vtime is the lowest, so no vtime is ever more than one slice/w_i ahead
    of the lowest: time_i = w_i * vtime_i is within one slice of w_i * V, hence the n/K bound.
    """
    n = len(ws)
    p = scheduler({f"t{i}": (w, [SM0]) for i, w in enumerate(ws)})
    slices = 100 * n
    _, used = run(p, slices)
    total = sum(u[SM0] for u in used.values())
    assert total == pytest.approx(slices * SLICE)
    errors = [abs(used.get(f"t{i}", {}).get(SM0, 0.0) / total - w / sum(ws)) for i, w in enumerate(ws)]
    assert max(errors) <= n / slices + 1e-9  # <= 1 point
    # the policy's own accounting agrees with what was charged
    stats = {s.name: s for s in p.stats(slices * SLICE)}
    for i in range(n):
        assert stats[f"t{i}"].gpu_seconds == pytest.approx(used.get(f"t{i}", {}).get(SM0, 0.0))


@pytest.mark.parametrize(
    ("ws", "expected"),
    [
        ((300, 100), (0.75, 0.25)),
        ((100, 100, 200), (0.25, 0.25, 0.5)),
        ((1, 9999), (0.0001, 0.9999)),
    ],
)
def test_measured_shares_table(ws: tuple[int, ...], expected: tuple[float, ...]) -> None:
    p = scheduler({f"t{i}": (w, [SM0]) for i, w in enumerate(ws)}, share_window_s=1e6)
    now, _ = run(p, 20_000)
    stats = {s.name: s for s in p.stats(now)}
    for i, share in enumerate(expected):
        assert stats[f"t{i}"].measured_share[SM0] == pytest.approx(share, abs=2e-4)
        assert stats[f"t{i}"].target_share[SM0] == pytest.approx(share)


def test_shares_converge_whatever_was_really_charged() -> None:
    """Closed loop: one tenant's slices really cost 3x (drain, overrun); shares still follow the weights."""
    p = scheduler({"a": (100, [SM0]), "b": (100, [SM0])})
    used = {"a": 0.0, "b": 0.0}
    now = 0.0
    for _ in range(4000):
        d = p.decide(now)
        for r, name in d.holders.items():
            cost = 3 * SLICE if name == "a" else SLICE
            p.charge(name, r, cost, now)
            used[name] += cost
        now += SLICE
    assert used["a"] / (used["a"] + used["b"]) == pytest.approx(0.5, abs=0.005)


# --- work conservation ------------------------------------------------------------------------------
demand_sets = st.sampled_from([(), (SM0,), (SM0,), (GFX0,), (SM1,), (DEC0,), (SM0, GFX0), (SM1, DEC0)])


@st.composite
def scripts(draw: st.DrawFn, single_only: bool = False) -> list[tuple[str, Any]]:
    names = [f"t{i}" for i in range(draw(st.integers(1, 7)))]
    ops: list[tuple[str, Any]] = [("add", (n, draw(weights), draw(st.sampled_from(list(Priority))))) for n in names]
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["demand", "demand", "decide", "decide", "decide", "weight", "remove", "min_run"]))
        name = draw(st.sampled_from(names))
        if kind == "demand":
            ds = draw(demand_sets)
            if single_only and len(ds) > 1:
                ds = ds[:1]
            ops.append(("demand", (name, ds)))
        elif kind == "weight":
            ops.append(("weight", (name, draw(weights))))
        elif kind == "remove":
            ops.append(("remove", name))
        elif kind == "min_run":
            ops.append(("min_run", (name, draw(st.sampled_from([0.0, 0.1, 0.5, 2.0])))))
        else:
            ops.append(("decide", draw(st.floats(0.0, 0.2))))
    return ops


Check = Callable[[WeightedFairShare, Decision], None]


def play(p: WeightedFairShare, ops: list[tuple[str, Any]], check: Check) -> None:
    now = 0.0
    for kind, arg in ops:
        if kind == "add":
            name, w, prio = arg
            p.upsert(TenantSpec(name, w, prio))
        elif kind == "demand":
            name, ds = arg
            if name in p.names():
                p.set_demand(name, ds)
        elif kind == "weight":
            name, w = arg
            if name in p.names():
                p.set_weight(name, w)
        elif kind == "remove":
            if arg in p.names():
                p.remove(arg)
                p.upsert(TenantSpec(arg))
        elif kind == "min_run":
            name, seconds = arg
            if name in p.names():
                p.set_min_run(name, seconds)
        else:
            d = p.decide(now)
            check(p, d)
            for r, holder in d.holders.items():
                p.charge(holder, r, arg, now)
            now += d.slice_s


def demands(p: WeightedFairShare) -> dict[str, frozenset[Resource]]:
    return {s.name: s.demand for s in p.stats(0.0)}


def check_decision_shape(p: WeightedFairShare, d: Decision) -> None:
    dem = demands(p)
    active = {n for n, ds in dem.items() if ds}
    assert d.running | d.waiting == active  # idle tenants are neither running nor waiting
    assert not d.running & d.waiting
    assert set(d.holders.values()) == d.running
    for name in d.running:  # a running tenant holds everything it asked for, and nothing else
        assert {r for r, h in d.holders.items() if h == name} == dem[name]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts(), st.sampled_from([Mode.SHARED, Mode.PREEMPTIVE, Mode.TIDAL]))
def test_work_conservation(ops: list[tuple[str, Any]], mode: Mode) -> None:
    """(Timeshare is not here: a blocked multi-engine tenant keeps its free engines for its turn.)"""
    def check(p: WeightedFairShare, d: Decision) -> None:
        check_decision_shape(p, d)
        dem = demands(p)
        for name, ds in dem.items():
            if len(ds) == 1:
                # a resource a single-engine tenant wants is never left idle
                (r,) = ds
                assert r in d.holders, (name, r, d)

    play(WeightedFairShare(FairShareConfig(mode=mode, slice_s=SLICE)), ops, check)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts(single_only=True), st.sampled_from(list(Mode)))
def test_every_wanted_resource_is_held_when_tenants_use_one_engine(ops: list[tuple[str, Any]], mode: Mode) -> None:
    def check(p: WeightedFairShare, d: Decision) -> None:
        check_decision_shape(p, d)
        wanted = {r for ds in demands(p).values() for r in ds}
        assert set(d.holders) == wanted

    play(WeightedFairShare(FairShareConfig(mode=mode, slice_s=SLICE)), ops, check)


def test_alone_a_tenant_runs_every_slice_and_idle_ones_never() -> None:
    p = scheduler({"busy": (100, [SM0]), "idle": (5000, [])})
    for i in range(10):
        d = p.decide(i * SLICE)
        assert d.running == {"busy"} and d.waiting == frozenset()
        p.charge("busy", SM0, SLICE, i * SLICE)
    assert {s.name: s.slices for s in p.stats(1.0)} == {"busy": 10, "idle": 0}


def test_idle_share_goes_to_the_others_and_comes_back() -> None:
    p = scheduler({"a": (100, [SM0]), "b": (100, [SM0]), "c": (200, [SM0])})
    now, _ = run(p, 400)
    p.set_demand("c", [])
    now, used = run(p, 400, now)
    assert "c" not in used
    assert used["a"][SM0] == pytest.approx(used["b"][SM0], abs=SLICE)
    assert used["a"][SM0] + used["b"][SM0] == pytest.approx(400 * SLICE)
    p.set_demand("c", [SM0])
    now, used = run(p, 400, now)
    assert used["c"][SM0] / (400 * SLICE) == pytest.approx(0.5, abs=3 * SLICE / (400 * SLICE) + 1e-9)


# --- lag clamp ---------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]), weights, weights, st.integers(100, 2000))
def test_lag_clamp_bounds_catch_up_after_a_long_idle(lag_limit: float, wa: int, wb: int, idle_slices: int) -> None:
    p = scheduler({"a": (wa, [SM0]), "b": (wb, [SM0])}, lag_limit_slices=lag_limit)
    now, _ = run(p, 20)
    p.set_demand("b", [])
    # long enough for a to pay back any slice b got ahead with (wa / wb slices); then it idles on
    now, used = run(p, math.ceil(wa / wb) + 1 + idle_slices, now)
    assert set(used) == {"a"}
    p.set_demand("b", [SM0])
    horizon = int(4 * (lag_limit + 2))
    holders = []
    for _ in range(horizon):
        d = p.decide(now)
        holders.append(d.holders[SM0])
        p.charge(d.holders[SM0], SM0, SLICE, now)
        now += SLICE
    # it gets the GPU within 2 decisions of waking ...
    assert "b" in holders[:2]
    # ... and its catch-up (GPU time beyond its weight share) is at most lag_limit slices, plus one slice
    # of granularity and one for the tie the holder wins; without the clamp it would be the whole idle time
    got = SLICE * holders.count("b")
    fair = horizon * SLICE * wb / (wa + wb)
    assert got - fair <= (lag_limit + 2) * SLICE + 1e-9


def test_lag_clamp_exact_catch_up_with_equal_weights() -> None:
    """Equal weights, lag limit 2: the waking tenant runs its 2 slices of catch-up, plus the tie it holds;
    then the two alternate in pairs (the holder wins ties)."""
    p = scheduler({"a": (100, [SM0]), "b": (100, [SM0])}, lag_limit_slices=2.0)
    now, _ = run(p, 10)
    p.set_demand("b", [])
    now, _ = run(p, 500, now)
    p.set_demand("b", [SM0])
    holders = []
    for _ in range(9):
        d = p.decide(now)
        holders.append(d.holders[SM0])
        p.charge(d.holders[SM0], SM0, SLICE, now)
        now += SLICE
    assert holders == ["b", "b", "b", "a", "a", "b", "b", "a", "a"]


def test_a_new_tenant_gets_no_credit() -> None:
    p = scheduler({"a": (100, [SM0])})
    run(p, 1000)
    p.upsert(TenantSpec("new"))
    p.set_demand("new", [SM0])
    vt = p.vtimes()
    assert vt["new"][SM0] == pytest.approx(vt["a"][SM0])


def test_a_tenant_that_overused_does_not_get_credit_back_by_idling_briefly() -> None:
    p = scheduler({"a": (100, [SM0]), "b": (100, [SM0])})
    now, _ = run(p, 10)
    p.charge("b", SM0, 20 * SLICE, now)  # b's drain ran long: it is 20 slices ahead
    p.set_demand("b", [])
    now, _ = run(p, 5, now)
    p.set_demand("b", [SM0])
    now, used = run(p, 10, now)
    assert "b" not in used  # it waits until a has caught up


# --- engines and contention ---------------------------------------------------------------------------
def test_tenants_on_different_resources_run_together() -> None:
    p = scheduler({"gpu0": (100, [SM0]), "gpu1": (1, [SM1]), "decode": (5, [DEC0])})
    for i in range(20):
        d = p.decide(i * SLICE)
        assert d.running == {"gpu0", "gpu1", "decode"} and not d.waiting
        for r, name in d.holders.items():
            p.charge(name, r, SLICE, i * SLICE)


@pytest.mark.parametrize(("cmap", "together"), [(SEPARATE_GRAPHICS, True), (SHARED_SM, False)])
def test_compute_and_graphics_contend_only_where_measured(cmap: object, together: bool) -> None:
    compute = cmap.resources([0], [Engine.COMPUTE])  # type: ignore[attr-defined]
    graphics = cmap.resources([0], [Engine.GRAPHICS])  # type: ignore[attr-defined]
    p = scheduler({"cuda": (100, compute), "render": (100, graphics)})
    for i in range(10):
        d = p.decide(i * SLICE)
        assert (d.running == {"cuda", "render"}) is together
        assert len(d.running) == (2 if together else 1)
        for r, name in d.holders.items():
            p.charge(name, r, SLICE, i * SLICE)


@settings(max_examples=40, deadline=None)
@given(weights, weights, weights)
def test_multi_engine_tenant_is_not_starved(wm: int, wc: int, wr: int) -> None:
    """A tenant on compute + graphics (separate graphics) gets the lower of its two weight shares on both;
    the single-engine tenants keep at least their weight shares."""
    p = scheduler({"both": (wm, [SM0, GFX0]), "cuda": (wc, [SM0]), "render": (wr, [GFX0])})
    slices = 3000
    _, used = run(p, slices)
    total = slices * SLICE
    granularity = 3 / slices
    both = used.get("both", {})
    assert both.get(SM0, 0.0) == pytest.approx(both.get(GFX0, 0.0))  # it always holds both
    assert both.get(SM0, 0.0) / total >= min(wm / (wm + wc), wm / (wm + wr)) - granularity
    assert used["cuda"][SM0] / total >= wc / (wm + wc) - granularity
    assert used["render"][GFX0] / total >= wr / (wm + wr) - granularity
    # every slice, both engines are busy (nobody else is blocked by the coupling here)
    assert used["cuda"][SM0] + both.get(SM0, 0.0) == pytest.approx(total)
    assert used["render"][GFX0] + both.get(GFX0, 0.0) == pytest.approx(total)


def test_multi_engine_tenant_runs_soon_after_it_asks() -> None:
    p = scheduler({"cuda": (100, [SM0]), "render": (100, [GFX0])})
    now, _ = run(p, 50)
    p.upsert(TenantSpec("both"))
    p.set_demand("both", [SM0, GFX0])
    seen = []
    for _ in range(3):
        d = p.decide(now)
        seen.append("both" in d.running)
        for r, name in d.holders.items():
            p.charge(name, r, SLICE, now)
        now += SLICE
    assert any(seen)


# --- priorities (preemptive mode) --------------------------------------------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts(single_only=True))
def test_online_preempts_offline_on_the_same_resource(ops: list[tuple[str, Any]]) -> None:
    def check(p: WeightedFairShare, d: Decision) -> None:
        check_decision_shape(p, d)
        stats = {s.name: s for s in p.stats(0.0)}
        for r, holder in d.holders.items():
            online_wants = any(s.priority is Priority.ONLINE and r in s.demand for s in stats.values())
            assert stats[holder].priority is Priority.ONLINE or not online_wants, (r, holder)

    play(WeightedFairShare(FairShareConfig(mode=Mode.PREEMPTIVE, slice_s=SLICE)), ops, check)


def test_offline_runs_when_online_is_idle_and_not_before() -> None:
    prios = {"serve": Priority.ONLINE, "train": Priority.OFFLINE}
    p = scheduler({"serve": (1, [SM0]), "train": (10_000, [SM0])}, mode=Mode.PREEMPTIVE, priorities=prios)
    now, used = run(p, 100)
    assert set(used) == {"serve"}  # weight 1 against 10000, and still every slice
    p.set_demand("serve", [])
    now, used = run(p, 100, now)
    assert set(used) == {"train"}
    p.set_demand("serve", [SM0])
    d = p.decide(now)
    assert d.running == {"serve"} and d.waiting == {"train"}


def test_shared_mode_ignores_priority() -> None:
    prios = {"serve": Priority.ONLINE, "train": Priority.OFFLINE}
    p = scheduler({"serve": (100, [SM0]), "train": (300, [SM0])}, priorities=prios)
    _, used = run(p, 400)
    assert used["train"][SM0] / (400 * SLICE) == pytest.approx(0.75, abs=0.01)


# --- reporting ------------------------------------------------------------------------------------------
def test_target_shares_count_only_tenants_with_demand() -> None:
    p = scheduler({"a": (100, [SM0]), "b": (300, [SM0]), "idle": (400, [])})
    p.charge("idle", SM0, 1.0, 0.0)
    t = p.target_shares()
    assert t["a"][SM0] == pytest.approx(0.25) and t["b"][SM0] == pytest.approx(0.75)
    assert t["idle"][SM0] == pytest.approx(0.5)  # what it would get on waking


def test_measured_share_is_over_the_trailing_window() -> None:
    p = scheduler({"a": (100, [SM0]), "b": (100, [SM0])}, share_window_s=10.0)
    p.charge("a", SM0, 3.0, 0.0)
    p.charge("b", SM0, 1.0, 5.0)
    p.charge("a", SM0, 1.0, 12.0)
    stats = {s.name: s for s in p.stats(12.0)}
    assert stats["a"].measured_share[SM0] == pytest.approx(0.5)
    assert stats["a"].gpu_seconds == pytest.approx(4.0)
    stats = {s.name: s for s in p.stats(30.0)}
    assert stats["a"].measured_share == {}


# --- validation -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 10_001, 10**9, True, False, 1.5, "100", None])
def test_bad_weights_are_refused(bad: object) -> None:
    with pytest.raises(PolicyError):
        TenantSpec("a", bad)  # type: ignore[arg-type]
    p = scheduler({"a": (100, [])})
    with pytest.raises(PolicyError):
        p.set_weight("a", bad)  # type: ignore[arg-type]
    assert p.weight("a") == 100


@pytest.mark.parametrize("bad", [-1e-9, math.nan, math.inf, -math.inf])
def test_bad_charges_are_refused(bad: float) -> None:
    p = scheduler({"a": (100, [SM0])})
    before = p.vtimes()
    with pytest.raises(PolicyError):
        p.charge("a", SM0, bad, 0.0)
    assert p.vtimes() == before


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.set_demand("ghost", [SM0]),
        lambda p: p.charge("ghost", SM0, 1.0, 0.0),
        lambda p: p.remove("ghost"),
        lambda p: p.weight("ghost"),
        lambda p: p.set_weight("ghost", 10),
    ],
)
def test_unknown_tenants_are_refused(call: object) -> None:
    p = scheduler({"a": (100, [SM0])})
    with pytest.raises(PolicyError, match="unknown tenant 'ghost'"):
        call(p)  # type: ignore[operator]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slice_s": 0.0},
        {"slice_s": 0.0009},
        {"slice_s": 10.5},
        {"slice_s": math.nan},
        {"lag_limit_slices": -1.0},
        {"lag_limit_slices": math.nan},
        {"timeshare_window_s": 0.0},
        {"share_window_s": -1.0},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(PolicyError):
        FairShareConfig(**kwargs)  # type: ignore[arg-type]


def test_policy_error_is_a_value_error() -> None:
    assert issubclass(PolicyError, ValueError)


def test_remove_forgets_the_tenant_everywhere() -> None:
    p = scheduler({"a": (100, [SM0]), "b": (100, [SM0])})
    d = p.decide(0.0)
    p.remove(d.holders[SM0])
    d2 = p.decide(SLICE)
    assert d2.holders == {SM0: ({"a", "b"} - d.running).pop()}
    assert p.names() == sorted({"a", "b"} - d.running)
