"""policy.reports: what a cooperative report says about a freezer-governed tenant's work beside it, as tables."""

from __future__ import annotations

import pytest

from unisched.policy.reports import EVEN_SLICING, beside_excess, learnable_tail, report_pieces


@pytest.mark.parametrize(("gpu_s", "units", "unit_s", "most_s", "unknown", "want"), [
    # a 50 ms step revoked with 25 ms left, the rest time-sliced evenly beside the app: it reads 75 ms
    (0.075, 1, 0.05, 0.05, EVEN_SLICING, 0.025),
    # that step and the one queued behind it (one unit in flight while contended): 150 ms of 100 ms of work
    (0.15, 2, 0.05, 0.15, EVEN_SLICING, 0.05),
    (0.05, 1, 0.05, 0.04, EVEN_SLICING, 0.0),  # a step that read its usual length: all its own
    (0.048, 1, 0.05, 0.04, EVEN_SLICING, 0.0),  # shorter than usual: nothing to take off
    (0.2, 1, 0.05, 0.03, EVEN_SLICING, 0.03),  # never more than the time it was beside the other's work
    (0.02, 0, 0.05, 0.02, EVEN_SLICING, 0.01),  # a part of a step (no whole unit): time-sliced evenly
    (0.02, 1, None, 0.02, EVEN_SLICING, 0.01),  # no usual length measured yet: the same
    (0.02, 0, None, 0.05, 0.0, 0.0),  # the frozen-drain caller assumes nothing without a usual length
    (0.012, 1, 0.005, 0.05, 0.0, 0.007),  # a frozen tenant's 7 ms queued before a 5 ms step
    (0.05, 1, 0.05, 0.0, EVEN_SLICING, 0.0),  # nothing beside it
    (0.0, 1, 0.05, 0.05, EVEN_SLICING, 0.0),
])
def test_beside_excess(gpu_s: float, units: int, unit_s: float | None, most_s: float, unknown: float,
                       want: float) -> None:
    assert beside_excess(gpu_s, units, unit_s, most_s, unknown) == pytest.approx(want)


@pytest.mark.parametrize(("at", "gpu_s", "excess", "since", "want"), [
    # thawed at 10.0; a step of 50 ms that had 25 ms left reads 75 ms at 10.05: 25 ms alone before the thaw,
    # 25 ms of its own among the 50 ms after it
    (10.05, 0.075, 0.025, 10.0, ((10.0, 0.025), (10.05, 0.025))),
    # a report's span is taken to end at its arrival: a step a renewal reports 20 ms late counts 20 ms as beside
    (10.02, 0.05, 0.0, 10.0, ((10.0, 0.03), (10.02, 0.02))),
    (10.1, 0.05, 0.025, 10.0, ((10.1, 0.025),)),  # all of it after the thaw
    (10.0, 0.05, 0.0, 10.0, ((10.0, 0.05),)),  # all of it before
])
def test_report_pieces(at: float, gpu_s: float, excess: float, since: float,
                       want: tuple[tuple[float, float], ...]) -> None:
    got = report_pieces(at, gpu_s, excess, since)
    assert [(a, round(s, 9)) for a, s in got] == [(a, round(s, 9)) for a, s in want]
    assert sum(s for _, s in got) == pytest.approx(gpu_s - min(excess, max(0.0, min(gpu_s, at - since))))


@pytest.mark.parametrize(("gpu_s", "beside_s", "unit_s", "sliced", "want"), [
    (0.056, 0.045, 0.028, True, 0.0335),  # a frame beside a thawed render (time-sliced): half its time beside
    (0.056, 0.045, None, True, 0.0335),  # the same with no usual length yet
    (0.0034, 0.003, 0.0017, False, 0.0),  # CUDA steps, which may have run first: left out once a length is known
    (0.0034, 0.003, None, False, 0.0019),  # with none yet: half the time beside, as a start
    (0.02, 0.0, 0.0017, True, 0.02),  # nothing beside: all of it
])
def test_learnable_tail(gpu_s: float, beside_s: float, unit_s: float | None, sliced: bool, want: float) -> None:
    assert learnable_tail(gpu_s, beside_s, unit_s, sliced) == pytest.approx(want)
