"""Rationing a resource held open while saturated: paced tenants that fill the GPU only together, where a turn held
by one of them leaves the GPU mostly idle. Every tenant may run, and one ahead of its weight share sits out until
the others catch up (FairShare.lead, plan.ahead_rule). Pure: the GPU is a model here, the charges passed in."""

from __future__ import annotations

import pytest
from test_policy_fairshare import SLICE, SM0, SM1, scheduler

from unisched.policy.rationing import sit_out_budget, sit_out_rule


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
    """A model GPU: each slice the tenants that run share it equally, none above what it needs (its pace). Charged
    what they used, the ones furthest ahead of their share sit the next slice out, as many as the budget allows
    (policy.plan.sit_out_budget): their GPU time follows the weights and the GPU stays full. With nobody sitting out
    they would all get the same. (Six tenants of 30% each with a noisy reading do not: each sitting out moves the
    GPU's busy fraction by as much as the noise, and the budget cannot tell the two apart.)"""
    names = [f"t{i}" for i in range(len(weights))]
    p = scheduler({n: (w, [SM0]) for n, w in zip(names, weights, strict=True)})
    used = dict.fromkeys(names, 0.0)
    out: frozenset[str] = frozenset()
    budget, cap, now, slices = 0, None, 0.0, 4000
    for step in range(slices):
        running = [n for n in names if n not in out]
        left, share = 1.0, {}
        for i, n in enumerate(running):  # equal shares, none above its need
            share[n] = min(need, left / (len(running) - i))
            left -= share[n]
        now += SLICE
        for n, s in share.items():
            p.charge(n, SM0, s * SLICE, now)
            used[n] += s * SLICE
        budget, cap = sit_out_budget(len(out), cap, sum(share.values()) - noise * (step % 3) / 2, high=0.98, low=0.68)
        out = sit_out_rule(((p.lead(n, SM0), n) for n in names), budget, SLICE)
    total_w, total = sum(weights), sum(used.values())
    assert total >= 0.95 * slices * SLICE  # the GPU kept full
    for n, w in zip(names, weights, strict=True):
        assert used[n] / total == pytest.approx(w / total_w, rel=0.02), (n, w)
