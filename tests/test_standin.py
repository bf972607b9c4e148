"""The CPU stand-in for a GPU: its busy fraction is the tenants' CPU time over the interval (injected clocks)."""

from __future__ import annotations

import pytest

from unisched.telemetry.standin import STAND_IN_NAME, CpuStandIn


class Readings:
    def __init__(self) -> None:
        self.now = 100.0
        self.used: float | None = 5.0

    def usage(self) -> float | None:
        return self.used

    def clock(self) -> float:
        return self.now


def test_busy_fraction_is_cpu_seconds_over_wall_seconds() -> None:
    r = Readings()
    t = CpuStandIn(r.usage, r.clock)
    assert [g.name for g in t.gpus()] == [STAND_IN_NAME]
    (first,) = t.sample()
    assert not first.ok  # nothing to compare with yet
    r.now, r.used = 100.05, 5.04
    (s,) = t.sample()
    assert s.ok and s.sm_util == pytest.approx(0.8) and s.dec_util == s.sm_util
    r.now, r.used = 100.10, 5.20  # two cores' worth on one stand-in GPU: full, not more
    assert t.sample()[0].sm_util == 1.0


def test_a_subtree_not_there_reads_as_no_sample() -> None:
    r = Readings()
    t = CpuStandIn(r.usage, r.clock)
    t.sample()
    r.now, r.used = 100.05, None
    assert not t.sample()[0].ok
    r.now, r.used = 100.10, 6.0  # back: compared from here on
    assert not t.sample()[0].ok
    r.now, r.used = 100.15, 6.025
    assert t.sample()[0].sm_util == pytest.approx(0.5)
