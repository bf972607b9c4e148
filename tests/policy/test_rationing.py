"""Rationing a resource held open while saturated: paced tenants that fill the GPU only together, where a turn held
by one of them leaves the GPU mostly idle. Every tenant may run, and one ahead of its weight share sits out until
the others catch up (FairShare.lead, plan.ahead_rule). Pure: the GPU is a model here, the charges passed in."""

from __future__ import annotations

import random

import pytest
from test_policy_fairshare import SLICE, SM0, SM1, scheduler

from unisched.policy.rationing import Rationed, out_runs, sit_out_budget, step_schedule
from unisched.policy.tuning import TUNING

GATE = TUNING.gate(0.98, SLICE * 1000)
"""The daemon's gate at its defaults: how its cap on those sitting out settles and releases."""


def test_lead_is_the_gpu_time_had_beyond_the_weight_share() -> None:
    p = scheduler({"light": (100, [SM0]), "heavy": (400, [SM0])})
    p.charge("light", SM0, 0.1, 1.0)
    p.charge("heavy", SM0, 0.1, 1.0)  # the same GPU time: the light one had 4x its share's worth
    assert p.lead("heavy", SM0) == 0.0  # it sets the clock (the lowest virtual time)
    assert p.lead("light", SM0) == pytest.approx((0.1 / 100 - 0.1 / 400) * 100)
    assert p.lead("light", SM0) == pytest.approx(0.075)
    p.charge("heavy", SM0, 0.3, 2.0)  # now both had their weight's worth
    assert p.lead("light", SM0) == pytest.approx(0.0) and p.lead("heavy", SM0) == pytest.approx(0.0)
    assert p.lead("light", SM1) == 0.0  # a resource it never used: no lead


def model_gpu(weights: tuple[int, ...], need: float, noise: float, steps: int, slices: int = 4000,
              charge_cv: float = 0.0, run_steps: int = TUNING.ration_run_steps,
              ) -> tuple[dict[str, float], float, dict[str, int]]:
    """A model GPU: each step the tenants that run share it equally, none above what it needs (its pace). Charged
    what they used at the end of each slice, the ones ahead of their share sit out of the next slice's steps
    (step_schedule), as many a step as the budget allows (sit_out_budget). Returns each tenant's GPU time, the
    GPU's busy fraction, and each tenant's longest stretch out in the second half, in steps. `charge_cv`: each
    slice's charges are uneven, each tenant's use times a lognormal factor of that spread (seeded), the busy time
    they add up to kept, as CPU-split charges are on a GPU."""
    pick = random.Random(1)
    names = [f"t{i}" for i in range(len(weights))]
    weight = dict(zip(names, weights, strict=True))
    p = scheduler({n: (w, [SM0]) for n, w in weight.items()})
    used = dict.fromkeys(names, 0.0)
    schedule: tuple[frozenset[str], ...] = (frozenset(),) * steps
    budget, cap, now, step_s = 0, None, 0.0, SLICE / steps
    stretch, longest = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for i in range(slices):
        slice_used, ran = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        for out in schedule:
            running = [n for n in names if n not in out]
            left = 1.0
            for j, n in enumerate(running):  # equal shares, none above its need
                share = min(need, left / (len(running) - j))
                left -= share
                slice_used[n] += share * step_s
                ran[n] += 1
            for n in names:
                stretch[n] = stretch[n] + 1 if n in out else 0
                if i >= slices // 2:  # once settled: the first slices catch up on the lead all ran up
                    longest[n] = max(longest[n], stretch[n])
        now += SLICE
        uneven = {n: pick.lognormvariate(0.0, charge_cv) if charge_cv else 1.0 for n in names}
        scale = sum(slice_used.values()) / (sum(x * uneven[n] for n, x in slice_used.items()) or 1.0)
        for n, x in slice_used.items():
            p.charge(n, SM0, x * uneven[n] * scale, now)
            used[n] += x
        budget, cap = sit_out_budget(max(map(len, schedule)), cap,
                                     sum(slice_used.values()) / SLICE - noise * (i % 3) / 2, high=0.98, low=0.68,
                                     settle=GATE.cap_settle_slices, release=GATE.cap_release_slices)
        runs = {n: stretch[n] for n in names if stretch[n]}
        schedule = step_schedule([Rationed(n, p.lead(n, SM0), weight[n], slice_used[n], ran[n], runs.get(n, 0))
                                  for n in names], budget, steps, SLICE, run_steps)
    return used, sum(used.values()) / (slices * SLICE), longest


@pytest.mark.parametrize(("weights", "need", "noise"), [
    ((100, 200, 400) * 4, 0.2, 0.0),  # twelve players in groups 1:2:4, each wanting a fifth of the GPU: 2.4x
    ((100, 200, 400) * 8, 0.08, 0.0),  # 24 wanting 8% each (60 FPS at 1.35 ms a frame): 1.9x
    ((100, 200, 400) * 16, 0.08, 0.0),  # 48: 3.8x
    ((100, 200, 400) * 2, 0.3, 0.0),  # six wanting 30%: 1.8x
    ((100, 200, 400) * 4, 0.2, 0.03),  # the busy fraction reading up to 3% low: small tenants still ration
    ((100, 200, 400) * 8, 0.08, 0.03),
    ((100, 200, 400) * 16, 0.08, 0.03),
])
def test_paced_tenants_get_gpu_time_by_weight_and_the_gpu_stays_full(weights: tuple[int, ...], need: float,
                                                                     noise: float) -> None:
    """Charged what they used, the ones furthest ahead of their share sit out: their GPU time follows the weights
    and the GPU stays full. With nobody sitting out they would all get the same. (Six tenants of 30% each with a
    noisy reading do not: each sitting out moves the GPU's busy fraction by as much as the noise, and the budget
    cannot tell the two apart.)"""
    used, busy, _ = model_gpu(weights, need, noise, TUNING.ration_steps)
    total_w, total = sum(weights), sum(used.values())
    assert busy >= 0.95  # the GPU kept full
    for (n, x), w in zip(used.items(), weights, strict=True):
        assert x / total == pytest.approx(w / total_w, rel=0.02), (n, w)


@pytest.mark.parametrize(("weights", "need"), [((100, 200, 400) * 4, 0.2), ((100, 200, 400) * 8, 0.08)])
def test_a_tenant_sits_out_in_short_stretches(weights: tuple[int, ...], need: float) -> None:
    """The weight-1 tenants here must sit out most of the time. Chosen step by step, no stretch out lasts two slices
    (here 3 and 7 steps of a quarter slice at most: a 60 FPS player misses a few frames at a time); chosen once a
    slice, they sat out three slices and more in a row (150 ms and more: the frames due then, felt as stutter)."""
    *_, longest = model_gpu(weights, need, 0.0, TUNING.ration_steps, slices=1000)
    assert max(longest.values()) < 2 * TUNING.ration_steps
    *_, whole = model_gpu(weights, need, 0.0, 1, slices=1000)
    assert max(whole.values()) >= 3


def test_players_paced_below_their_share_leave_the_rest_to_the_others_by_weight() -> None:
    """Six players 1:2:4 each wanting a fifth of the GPU (1.2x): the weight-4 ones, at their pace, use less than
    their share (2/7), which holds the clock back; what they leave goes to the others 1:2. Ranked by GPU seconds
    ahead, the light ones got 0.10 of the GPU each and the middle ones 0.15 (1:1.5); by virtual time, 1:2."""
    weights = (100, 200, 400) * 2
    slices = 4000
    used, _, _ = model_gpu(weights, 0.2, 0.0, TUNING.ration_steps, slices=slices)
    heavy = 0.2 * slices * SLICE  # each weight-4 player at its pace
    rest = sum(used.values()) - 2 * heavy
    owed = {100: rest / 6, 200: rest / 3, 400: heavy}
    for (n, x), w in zip(used.items(), weights, strict=True):
        assert x == pytest.approx(owed[w], rel=0.03), (n, w)


def test_two_that_fill_the_gpu_only_together_keep_it_nearly_full() -> None:
    """Two tenants 1:3 that each need 55% of the GPU: the light one ahead of its share cannot sit out without
    leaving the GPU idle, so the cap holds it in; each time the cap rises again (after `ration_cap_release_s`) one
    try costs about one NVML sample of a partly idle GPU. At the daemon's gate, 0.99 of the GPU stays busy."""
    _, busy, _ = model_gpu((100, 300), 0.55, 0.0, TUNING.ration_steps, slices=2000)
    assert busy >= 0.98


@pytest.mark.parametrize(("before", "steps", "after"), [
    ({}, (frozenset("a"), frozenset("ab"), frozenset("a"), frozenset("a")), {"a": 4}),
    ({"a": 6, "b": 2}, (frozenset("a"), frozenset("a"), frozenset("ab"), frozenset("ab")), {"a": 10, "b": 2}),
    ({"a": 6}, (frozenset("b"),) * 4, {"b": 4}),  # a ran: from 0 again
    ({"a": 6}, (), {}),  # nobody sat out of the slice
])
def test_out_runs(before: dict[str, int], steps: tuple[frozenset[str], ...], after: dict[str, int]) -> None:
    assert out_runs(before, steps) == after


def test_one_out_long_yields_its_place_to_another_ahead() -> None:
    """far is furthest ahead but has sat out ration_run_steps steps in a row: near, also ahead, sits out in its
    place, and far again the step after its run was broken. Alone ahead, it sits out on."""
    limit = TUNING.ration_run_steps
    lead = 0.2 * SLICE * 4  # well past ahead_rule's quarter slice
    far = Rationed("far", 4 * lead, 100, 0.0, 0, limit)
    near = Rationed("near", lead, 100, 0.0, 0, 0)
    behind = Rationed("behind", 0.0, 100, 0.01, 4, 0)
    assert step_schedule([far, near, behind], 1, 4, SLICE) == (
        frozenset({"near"}), frozenset({"far"}), frozenset({"far"}), frozenset({"far"}))
    assert step_schedule([far, behind], 1, 4, SLICE) == (frozenset({"far"}),) * 4
    assert step_schedule([far, near, behind], 1, 4, SLICE, run_steps=10**6) == (frozenset({"far"}),) * 4


def test_lumpy_charges_do_not_make_one_tenant_sit_out_for_long() -> None:
    """24 players 1:2:4 each wanting 8%, charged unevenly slice by slice (lognormal, cv 0.8: a tenant's charge for
    a slice several times its use, as splits by CPU activity are on a GPU). One charged a lump pays it back in one
    stretch out: the weight-1 players' longest ran to 93 steps (over a second). With ration_run_steps the longest
    stays under three times it, and the GPU time still follows the weights."""
    weights = (100, 200, 400) * 8
    used, busy, longest = model_gpu(weights, 0.08, 0.0, TUNING.ration_steps, slices=3000, charge_cv=0.8)
    assert max(v for n, v in longest.items() if weights[int(n[1:])] == 100) < 3 * TUNING.ration_run_steps
    by_weight = {w: sum(x for x, ww in zip(used.values(), weights, strict=True) if ww == w) for w in (100, 200, 400)}
    assert by_weight[200] / by_weight[100] == pytest.approx(2.0, rel=0.03)
    assert by_weight[400] / by_weight[100] == pytest.approx(4.0, rel=0.05)
    assert busy >= 0.97
    *_, unlimited = model_gpu(weights, 0.08, 0.0, TUNING.ration_steps, slices=3000, charge_cv=0.8, run_steps=10**6)
    assert max(v for n, v in unlimited.items() if weights[int(n[1:])] == 100) >= 5 * TUNING.ration_run_steps
