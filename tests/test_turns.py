"""scheduler.turns: the units' usual length a cooperative tenant's reports teach, parts of units included."""

from __future__ import annotations

import pytest

from unisched.policy import FairShareConfig, TenantSpec, WeightedFairShare
from unisched.scheduler.turns import Turns


def turns() -> Turns:
    policy = WeightedFairShare(FairShareConfig())
    policy.upsert(TenantSpec("c", 100))
    return Turns(policy, slice_s=0.05, max_run_s=0.5)


def no_gap() -> float:
    return 0.0


def test_parts_of_a_unit_count_toward_the_unit_a_later_report_completes() -> None:
    t = turns()
    t.report("c", 0.01, 0, no_gap)
    t.report("c", 0.015, 1, no_gap)
    assert t.unit_s("c") == pytest.approx(0.025)


def test_a_part_left_out_leaves_its_unit_unlearnt() -> None:
    """Counted without its part beside the app, the step would read 15 ms of its 25."""
    t = turns()
    t.report("c", 0.025, 1, no_gap)
    t.skip("c", 0)
    t.report("c", 0.015, 1, no_gap)
    assert t.unit_s("c") == pytest.approx(0.025)
    t.report("c", 0.035, 1, no_gap)  # the next whole unit is learnt again
    assert t.unit_s("c") == pytest.approx(0.025 + 0.25 * 0.01)


def test_whole_units_left_out_end_the_unit_in_progress() -> None:
    """The next report starts clean: parts before the skipped report are not added to it."""
    t = turns()
    t.report("c", 0.025, 1, no_gap)
    t.report("c", 0.01, 0, no_gap)
    t.skip("c", 2)
    t.report("c", 0.025, 1, no_gap)
    assert t.unit_s("c") == pytest.approx(0.025)
