"""Mixed slices for compute + graphics that overlap partly (pure)."""

from __future__ import annotations

from itertools import groupby, pairwise

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from unisched.policy import PolicyError
from unisched.policy.overlap import MixTurns, OverlapMix, SliceKind, overlap_mix

H200 = (0.22, 0.92)  # ResNet-50 training and a 1080p shader render together, of their solo rates (2026-12-01)


def slices(turns: MixTurns, mix: OverlapMix, n: int) -> list[SliceKind]:
    """The kinds of `n` 50 ms slices, each chosen and then run, as the engine does every tick."""
    kinds = []
    for _ in range(n):
        kinds.append(turns.choose(mix))
        turns.ran(kinds[-1], 0.05)
    return kinds


@pytest.mark.parametrize(("share", "both", "total"), [(0.5, 0.641, 1.09), (0.75, 0.321, 1.045), (0.25, 0.962, 1.135)])
def test_the_h200_pair_keeps_each_share_with_the_most_time_together(share: float, both: float, total: float) -> None:
    mix = overlap_mix(*H200, share)
    c, g = mix.kept(*H200)
    assert mix.both == pytest.approx(both, abs=1e-3)
    assert c == pytest.approx(share) and g >= 1 - share - 1e-9
    assert c + g == pytest.approx(total, abs=1e-3)


def test_no_gain_from_overlap_means_plain_slicing() -> None:
    assert overlap_mix(0.3, 0.5, 0.5) == OverlapMix(0.0, 0.5, 0.5)


def test_full_overlap_runs_together_all_the_time() -> None:
    assert overlap_mix(0.9, 0.95, 0.75) == OverlapMix(1.0, 0.0, 0.0)


def test_bad_rates_are_refused() -> None:
    with pytest.raises(PolicyError):
        overlap_mix(1.2, 0.5, 0.5)


@given(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
@example(5.913461571733032e-264, 0.0, 4.893100459390145e-278)  # the interpolated root rounded below 0
def test_every_mix_is_a_split_of_the_time_that_keeps_both_guarantees(kc: float, kg: float, share: float) -> None:
    mix = overlap_mix(kc, kg, share)
    assert min(mix.both, mix.compute_only, mix.graphics_only) >= 0
    assert mix.both + mix.compute_only + mix.graphics_only == pytest.approx(1.0)
    c, g = mix.kept(kc, kg)
    assert c >= share - 1e-9 and g >= 1 - share - 1e-9
    assert c + g >= 1.0 - 1e-9 or kc + kg < 1.0  # never less work than slicing, where overlapping helps


def test_turns_follow_the_mix_and_then_a_new_one() -> None:
    turns = MixTurns(period_s=1.0, horizon_s=2.0)
    mix = overlap_mix(*H200, 0.5)
    kinds = slices(turns, mix, 400)
    assert kinds.count(SliceKind.BOTH) / 400 == pytest.approx(mix.both, abs=0.02)
    assert SliceKind.GRAPHICS not in kinds
    mix = overlap_mix(*H200, 0.75)  # the trainer's weight went up
    recent = slices(turns, mix, 400)[80:]  # within 4 s (two horizons)
    assert recent.count(SliceKind.BOTH) / 320 == pytest.approx(mix.both, abs=0.03)


@pytest.mark.parametrize("period_s", [0.5, 1.0, 2.0])
def test_each_kind_runs_at_a_stretch_once_a_period(period_s: float) -> None:
    """A paused render finishes its frame beside the compute after it: few switches, few such frames."""
    turns = MixTurns(period_s=period_s)
    mix = overlap_mix(*H200, 0.5)
    kinds = slices(turns, mix, 1000)  # 50 s of 50 ms slices
    switches = sum(a is not b for a, b in pairwise(kinds))
    assert switches <= 2 * 50 / period_s + 2  # one run of each kind a period (50 ms slices alternating: ~430)
    assert kinds.count(SliceKind.BOTH) / 1000 == pytest.approx(mix.both, abs=0.01)  # whole slices, still the mix


def test_a_kind_back_in_the_mix_gets_its_whole_run() -> None:
    turns = MixTurns(period_s=1.0)
    for mix, n in ((OverlapMix(0.5, 0.5, 0.0), 15), (OverlapMix(1.0, 0.0, 0.0), 40)):  # compute cut off mid-run
        slices(turns, mix, n)
    kinds = slices(turns, OverlapMix(0.5, 0.5, 0.0), 40)
    runs = [len(list(g)) for _, g in groupby(kinds)]
    # 0.5 s each (the first began in the lone kind's last slice): nothing carried over from the cut-off run, or
    # from the lone kind's stretch
    assert runs[:3] == [9, 10, 10]


def test_a_kind_that_left_for_another_gets_its_whole_run_back() -> None:
    turns = MixTurns(period_s=1.0)
    for mix, n in ((OverlapMix(0.5, 0.5, 0.0), 13), (OverlapMix(0.5, 0.0, 0.5), 40)):  # compute cut off 3 slices in
        slices(turns, mix, n)
    kinds = slices(turns, OverlapMix(0.5, 0.5, 0.0), 60)
    runs = [(k, len(list(g))) for k, g in groupby(kinds)]
    assert next(r for r in runs if r[0] is SliceKind.COMPUTE) == (SliceKind.COMPUTE, 10)  # not 17 (owed 7 slices)


@pytest.mark.parametrize("period_s", [0.001, 0.05])
def test_a_period_shorter_than_a_slice_still_keeps_the_mix(period_s: float) -> None:
    turns = MixTurns(period_s=period_s)
    mix = overlap_mix(*H200, 0.5)
    kinds = slices(turns, mix, 1000)
    assert kinds.count(SliceKind.BOTH) / 1000 == pytest.approx(mix.both, abs=0.02)  # not 1:1 alternation
