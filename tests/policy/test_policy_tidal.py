"""Tidal schedules: weights by time of day, windows that wrap midnight, clock parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unisched.policy import (
    FairShareConfig,
    Mode,
    PolicyError,
    Resource,
    TenantSpec,
    TidalSchedule,
    TidalWindow,
    WeightedFairShare,
    parse_clock,
)

DAY = 24 * 3600


def at(hh: int, mm: int, ss: float = 0.0) -> float:
    return hh * 3600 + mm * 60 + ss


SCHEDULE = TidalSchedule(
    (
        TidalWindow("serve", parse_clock("08:00"), parse_clock("20:00"), 800),
        TidalWindow("train", parse_clock("22:00"), parse_clock("06:00"), 900),  # wraps midnight
        TidalWindow("train", parse_clock("05:00"), parse_clock("07:00"), 50),  # overlaps: the first wins
    )
)


@pytest.mark.parametrize(
    ("tenant", "seconds", "expected"),
    [
        ("serve", at(7, 59, 59.9), 100),
        ("serve", at(8, 0), 800),  # start is inclusive
        ("serve", at(13, 30), 800),
        ("serve", at(19, 59, 59), 800),
        ("serve", at(20, 0), 100),  # end is exclusive
        ("train", at(21, 59), 100),
        ("train", at(22, 0), 900),
        ("train", at(23, 59, 59), 900),
        ("train", at(0, 0), 900),
        ("train", at(5, 30), 900),  # both train windows cover it: the first listed wins
        ("train", at(6, 0), 50),
        ("train", at(6, 59), 50),
        ("train", at(7, 0), 100),
        ("train", at(22, 0) + DAY, 900),  # seconds past one day wrap
        ("other", at(12, 0), 100),
    ],
)
def test_weight_at(tenant: str, seconds: float, expected: int) -> None:
    assert SCHEDULE.weight_at(tenant, 100, seconds) == expected


@given(st.integers(0, 1439), st.integers(0, 1439), st.integers(0, 1439))
def test_window_contains_matches_a_walk_around_the_clock(start: int, end: int, minute: int) -> None:
    if start == end:
        with pytest.raises(PolicyError):
            TidalWindow("t", start, end, 100)
        return
    w = TidalWindow("t", start, end, 100)
    inside, m = set(), start
    while m != end:
        inside.add(m)
        m = (m + 1) % 1440
    assert w.contains(minute) == (minute in inside)


@pytest.mark.parametrize(
    ("text", "minutes"), [("00:00", 0), ("0:05", 5), ("07:30", 450), ("12:00", 720), ("23:59", 1439)]
)
def test_parse_clock(text: str, minutes: int) -> None:
    assert parse_clock(text) == minutes


@pytest.mark.parametrize("bad", ["24:00", "12:60", "7", "07:3", "07:300", "-1:00", "ab:cd", "", " 07:30", None, 730])
def test_parse_clock_refuses(bad: object) -> None:
    with pytest.raises(PolicyError, match="HH:MM"):
        parse_clock(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tenant", "start", "end", "weight"),
    [
        ("t", 0, 0, 100),  # empty
        ("t", -1, 10, 100),
        ("t", 0, 1440, 100),
        ("t", 0, 10, 0),
        ("t", 0, 10, 10**9),
        ("bad name", 0, 10, 100),
    ],
)
def test_bad_windows_are_refused(tenant: str, start: int, end: int, weight: int) -> None:
    with pytest.raises(PolicyError):
        TidalWindow(tenant, start, end, weight)


def test_tidal_switch_moves_the_shares() -> None:
    """Applied through set_weight (as the engine does), a switch moves the measured shares to the new weights."""
    sm = Resource(0, "sm")
    p = WeightedFairShare(FairShareConfig(mode=Mode.TIDAL, slice_s=0.05, share_window_s=20.0))
    for name in ("serve", "train"):
        p.upsert(TenantSpec(name, 100))
        p.set_demand(name, [sm])
    now = at(19, 0)
    while now < at(20, 0) + 60:
        for name in ("serve", "train"):
            p.set_weight(name, SCHEDULE.weight_at(name, 100, now))
        d = p.decide(now)
        p.charge(d.holders[sm], sm, 0.05, now)
        now += 0.05
        if abs(now - (at(20, 0) - 1)) < 0.025:
            before = {s.name: s.measured_share[sm] for s in p.stats(now)}
    after = {s.name: s.measured_share[sm] for s in p.stats(now)}
    assert before["serve"] == pytest.approx(800 / 900, abs=0.01)
    assert after["serve"] == pytest.approx(0.5, abs=0.01)
    assert p.weight("serve") == 100
