"""From measured runs to the two kept fractions the daemon files per GPU model (pure: no I/O, no clock).

A run reports each workload's items over a measured window and a timeline of (seconds into the window, items so
far). Alone, a workload's rate is its throughput over the whole window. Together, both are scored over the seconds
in which both ran: a workload that starts late (PyTorch's first step can come seconds after a render's first frame)
would otherwise be compared with a partner that ran alone part of the window, and the partner's kept fraction would
read high.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from unisched.policy.contention import PARTIAL_OVERLAP, SEPARATE_GRAPHICS, ContentionMap
from unisched.policy.tuning import TUNING

__all__ = ["COMMON_WINDOW_LATE_S", "CalibrationError", "Measured", "common_window", "items_at", "kept_fractions",
           "rates_over", "verdict_line"]

COMMON_WINDOW_LATE_S = 0.5
"""Workloads whose first items came within this of each other share the nominal window; a later start is scored
over the common seconds. Half a second is a few of the workloads' items (frames of ~28 ms, groups of matmuls of a
few ms), so within it the nominal window's error is a few percent at most."""


class CalibrationError(RuntimeError):
    """A measurement that cannot give a kept fraction (a failed or empty run); nothing is written."""


@dataclass(frozen=True)
class Measured:
    """One workload's report from one run."""

    kind: str
    """"cuda" (compute) or "render" (graphics)."""
    throughput: float
    """Items per second over the whole window."""
    timeline: tuple[tuple[float, float], ...] = ()
    """(seconds since the window's start, items so far)."""


def items_at(timeline: Sequence[Sequence[float]], t: float) -> float:
    """Items completed `t` seconds into the window, linear between the timeline's points; held at the ends."""
    if t <= timeline[0][0]:
        return float(timeline[0][1])
    for (t0, n0), (t1, n1) in itertools.pairwise(timeline):
        if t <= t1:
            return float(n0) if t1 <= t0 else n0 + (n1 - n0) * (t - t0) / (t1 - t0)
    return float(timeline[-1][1])


def common_window(timelines: Sequence[Sequence[Sequence[float]]],
                  late_s: float = COMMON_WINDOW_LATE_S) -> tuple[float, float] | None:
    """(from, to), seconds into the window, where every workload was running: from the latest first completion to
    the earliest last one. None when they all started within `late_s` of each other (the shared nominal window
    stands) or share no time."""
    if len(timelines) < 2 or any(len(tl) < 2 for tl in timelines):
        return None
    starts = [tl[0][0] for tl in timelines]
    if max(starts) - min(starts) < late_s:
        return None
    lo, hi = max(starts), min(tl[-1][0] for tl in timelines)
    return (lo, hi) if hi > lo else None


def rates_over(timelines: Sequence[Sequence[Sequence[float]]], window: tuple[float, float]) -> list[float]:
    """Each workload's items per second over `window`."""
    lo, hi = window
    return [(items_at(tl, hi) - items_at(tl, lo)) / (hi - lo) for tl in timelines]


def together_rates(together: Sequence[Measured]) -> list[float]:
    """The rates of a shared run: over the common window where one started late, else each over the whole."""
    window = common_window([m.timeline for m in together])
    if window is None:
        return [m.throughput for m in together]
    return rates_over([m.timeline for m in together], window)


def kept_fractions(alone_cuda: Measured, alone_render: Measured, together: Sequence[Measured]) -> tuple[float, float]:
    """(compute_kept, graphics_kept): each workload's rate together over its rate alone."""
    rates = dict(zip((m.kind for m in together), together_rates(together), strict=True))
    kept = []
    for alone in (alone_cuda, alone_render):
        if not alone.throughput > 0:  # NaN too
            raise CalibrationError(f"{alone.kind} alone: throughput {alone.throughput!r} is not positive")
        if alone.kind not in rates:
            raise CalibrationError(f"no {alone.kind} rate from the run together")
        kept.append(rates[alone.kind] / alone.throughput)
    return kept[0], kept[1]


def verdict_line(compute_kept: float, graphics_kept: float) -> str:
    """What the daemon will do with these fractions, in words (the map is policy.contention's)."""
    chosen = ContentionMap.from_kept(compute_kept, graphics_kept)
    if chosen.name == SEPARATE_GRAPHICS.name:
        return (f"{chosen.name}: compute and graphics overlap (both kept >= {TUNING.overlap_kept:g}); the daemon will not "
                "slice them against each other")
    if chosen.name == PARTIAL_OVERLAP:
        return (f"{chosen.name}: compute and graphics overlap partly (kept sum >= {TUNING.mix_sum:g}); the daemon will mix "
                "slices: together part of the time, each alone as its weight share needs")
    return (f"{chosen.name}: compute and graphics contend (kept sum < {TUNING.mix_sum:g}); the daemon will slice them "
            "against each other as one domain")
