"""WeightedFairShare's turns longer than a slice: minimum runs for cooperative tenants with long units, and the
timeshare mode's windows in turn (injected time)."""

from __future__ import annotations

import math

import pytest
from test_policy_fairshare import GFX0, SLICE, SM0, run, scheduler

from unisched.policy import (
    Mode,
    PolicyError,
    Priority,
    TenantSpec,
    WeightedFairShare,
)


# --- minimum runs (cooperative tenants with long units) ----------------------------------------------------
def turns(p: WeightedFairShare, slices: int, now: float = 0.0) -> tuple[float, list[tuple[str, int]]]:
    """`run`, returning the holders of SM0 as runs: (name, slices in a row)."""
    out: list[tuple[str, int]] = []
    for _ in range(slices):
        now, used = run(p, 1, now)
        (name,) = used
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + 1)
        else:
            out.append((name, 1))
    return now, out


@pytest.mark.parametrize(("wa", "wb"), [(300, 100), (100, 100), (100, 300)])
def test_min_run_makes_turns_longer_and_keeps_the_weights(wa: int, wb: int) -> None:
    p = scheduler({"a": (wa, [SM0]), "b": (wb, [SM0])})
    _, plain = turns(p, 400)
    assert min(n for _, n in plain[1:-1]) <= 2  # without it: a slice or two (the holder wins ties)
    for name in ("a", "b"):
        p.set_min_run(name, 10 * SLICE)
    now, runs = turns(p, 40)  # the runs in progress end
    now, runs = turns(p, 1200, now)
    inner = runs[1:-1]
    assert min(n for _, n in inner) >= 10, inner
    used = {name: sum(n for who, n in runs if who == name) for name in ("a", "b")}
    assert used["a"] / 1200 == pytest.approx(wa / (wa + wb), abs=0.02)
    assert len(runs) < len(plain) / 4


def test_min_run_ends_when_the_holder_has_no_more_work() -> None:
    p = scheduler({"a": (100, [SM0]), "b": (100, [SM0])})
    p.set_min_run("a", 1.0)
    p.set_min_run("b", 1.0)
    now, _ = run(p, 2)
    holder = p.decide(now).holders[SM0]
    assert p.min_run_left(holder, now) == pytest.approx(0.9)
    p.set_demand(holder, [])
    assert p.decide(now).holders[SM0] != holder
    assert p.min_run_left(holder, now) == 0.0


def test_online_preempts_an_offline_tenant_within_its_min_run() -> None:
    prios = {"serve": Priority.ONLINE, "train": Priority.OFFLINE, "other": Priority.OFFLINE}
    p = scheduler({"train": (100, [SM0]), "other": (100, [SM0])}, mode=Mode.PREEMPTIVE, priorities=prios)
    p.set_min_run("train", 5.0)
    p.set_min_run("other", 5.0)
    now, _ = run(p, 1)
    holder = p.decide(now).holders[SM0]
    assert p.min_run_left(holder, now) == pytest.approx(5.0 - SLICE)
    now, used = run(p, 20, now)
    assert set(used) == {holder}  # its own class waits out the run
    p.upsert(TenantSpec("serve", 1, Priority.ONLINE))
    p.set_demand("serve", [SM0])
    assert p.decide(now).holders[SM0] == "serve"


def test_a_tenant_that_wakes_takes_its_share_back_within_a_min_run() -> None:
    """Min runs space out hand-overs between tenants that keep waiting; a tenant whose share was lent while it
    idled takes it back at the next decision, whatever is left of the holder's run."""
    p = scheduler({"busy": (100, [SM0]), "sleeper": (100, [])})
    for name in ("busy", "sleeper"):
        p.set_min_run(name, 1.0)
    now, used = run(p, 4)
    assert set(used) == {"busy"}  # alone: it holds the GPU, its turn began at the first decision
    p.set_demand("sleeper", [SM0])  # wakes 0.2 s into the busy tenant's 1 s run, level with it (the lag clamp)
    now, used = run(p, 1, now)
    assert set(used) == {"busy"}  # a tie: the holder wins it, as without min runs
    assert p.decide(now).holders[SM0] == "sleeper"  # the second decision after waking, not 0.8 s later
    now, used = run(p, 10, now)
    assert set(used) == {"sleeper"}  # and now the sleeper's own run holds off the tenant that was waiting


def test_a_waiting_tenant_is_held_off_for_the_min_run() -> None:
    p = scheduler({"a": (100, [SM0]), "b": (100, [SM0])})
    for name in "ab":
        p.set_min_run(name, 0.5)
    now, _ = run(p, 1)
    holder = p.decide(now).holders[SM0]
    now, used = run(p, 9, now)  # 0.5 s of turn: nine more slices
    assert set(used) == {holder}
    assert p.decide(now).holders[SM0] != holder


@pytest.mark.parametrize("bad", [-0.1, 10.5, math.nan])
def test_bad_min_runs_are_refused(bad: float) -> None:
    p = scheduler({"a": (100, [SM0])})
    with pytest.raises(PolicyError, match="minimum run"):
        p.set_min_run("a", bad)


# --- timeshare ------------------------------------------------------------------------------------------
def test_timeshare_windows_in_turn_proportional_to_weight() -> None:
    p = scheduler({"a": (100, [SM0]), "b": (200, [SM0]), "c": (300, [SM0])}, mode=Mode.TIMESHARE)
    now = 0.0
    turns: list[tuple[str, float]] = []
    while now < 6.0 - 1e-9:
        d = p.decide(now)
        holder = d.holders[SM0]
        if turns and turns[-1][0] == holder:
            turns[-1] = (holder, turns[-1][1] + d.slice_s)
        else:
            turns.append((holder, d.slice_s))
        p.charge(holder, SM0, d.slice_s, now)
        now += d.slice_s
    assert [n for n, _ in turns] == ["a", "b", "c"] * 10  # 0.1 + 0.2 + 0.3 s a round, for 6 s
    for name, length in turns:
        assert length == pytest.approx({"a": 0.1, "b": 0.2, "c": 0.3}[name])


def test_timeshare_lone_tenant_keeps_running_in_full_slices() -> None:
    p = scheduler({"a": (100, [SM0])}, mode=Mode.TIMESHARE)
    now = 0.0
    for _ in range(20):
        d = p.decide(now)
        assert d.running == {"a"}
        assert d.slice_s >= 0.1 - 1e-9
        now += d.slice_s


def test_timeshare_newcomer_waits_for_the_turn_to_end_then_runs() -> None:
    p = scheduler({"a": (100, [SM0])}, mode=Mode.TIMESHARE)
    d = p.decide(0.0)
    p.upsert(TenantSpec("b"))
    p.set_demand("b", [SM0])
    d = p.decide(0.05)
    assert d.holders[SM0] == "a" and d.slice_s == pytest.approx(0.05)
    d = p.decide(0.1)
    assert d.holders[SM0] == "b"


def test_timeshare_multi_engine_tenant_is_not_overtaken_forever() -> None:
    p = scheduler(
        {"cuda": (100, [SM0]), "render": (300, [GFX0]), "both": (100, [SM0, GFX0])}, mode=Mode.TIMESHARE
    )
    now = 0.0
    ran = 0
    for _ in range(100):
        d = p.decide(now)
        ran += "both" in d.running
        now += d.slice_s
    assert ran >= 5
