"""Where a cooperative report's work lies in time (scheduler.workends): where the client says it ended, else back
to back from the grant; never after the arrival, at most half a slice before it."""

from __future__ import annotations

import pytest

from unisched.policy import Resource
from unisched.scheduler.workends import WorkEnds

R = Resource(0, "sm")
SLICE_S = 0.05


@pytest.mark.parametrize(("reports", "ends"), [
    # (wall_s, arrival, ended_ago_s) per report after a grant at 0; the end each is placed at
    pytest.param([(0.028, 0.030, 0.0)], [0.028], id="back-to-back-from-the-grant"),
    pytest.param([(0.028, 0.030, 0.0), (0.028, 0.080, 0.0)], [0.028, 0.056], id="the-next-follows-the-last"),
    pytest.param([(0.028, 0.100, 0.0)], [0.075], id="at-most-half-a-slice-before-its-arrival"),
    pytest.param([(0.028, 0.060, 0.004)], [0.056], id="where-the-client-says"),
    pytest.param([(0.028, 0.060, 0.004), (0.028, 0.090, 0.0)], [0.056, 0.084], id="and-the-next-follows-that"),
    pytest.param([(0.028, 0.100, 0.5)], [0.075], id="said-too-long-ago-half-a-slice"),
    pytest.param([(0.0, 0.030, 0.004)], [0.030], id="no-work-the-arrival"),
])
def test_work_ends(reports: list[tuple[float, float, float]], ends: list[float]) -> None:
    w = WorkEnds(SLICE_S)
    w.granted("c", R, 0.0)
    assert [w.end("c", R, wall, at, ago) for wall, at, ago in reports] == pytest.approx(ends)


def test_a_tenant_never_granted_is_placed_where_it_says_or_at_the_arrival() -> None:
    w = WorkEnds(SLICE_S)
    assert w.end("c", R, 0.01, 1.0) == 1.0
    assert w.end("d", R, 0.01, 1.0, 0.003) == pytest.approx(0.997)
