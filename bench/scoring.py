"""How sharing is scored (bench/README.md says what each target means), as pure functions.

Kept apart from the orchestrator so the arithmetic that decides PASS/FAIL is unit-tested on hand
computed numbers (tests/test_bench_scoring.py) and cannot drift between benchmarks.

Terms, for tenants i with weights w_i that all saturate the GPU alone:
- normalized n_i = throughput shared / throughput alone (same GPU, same run);
- share s_i = w_i / sum(w);
- error = max_i |n_i / sum(n) - s_i|, in percentage points;
- efficiency = sum(n) (exclusive time slicing of saturating loads gives at most about 1.0);
- guarantee: every n_i >= s_i - 0.02;
- a pair contends when its no-scheduler efficiency is below ~1.1; above, the hardware overlaps it.
Targets (the one copy: bench/suites.py and mixed_engines.py take them from here): contending pairs need the
guarantee, error <= 1 point in the median round and <= 2 in every round, and efficiency >= 0.98 in every round;
overlapping pairs need the guarantee and an efficiency no more than 0.02 below the no-scheduler run's (keeping the
overlap is the point; beating the no-scheduler run is not a failure). `verdict` judges one run by what every round
must meet; the median is judged over the rounds (bench/run.py).

Contention calibration (`unisched calibrate`, and gpu_pairs.py --calibrate-out): CUDA and rendering run together with no
scheduler; each keeps a fraction of its solo rate; `contention_verdict` says which contention map the
daemon derives from the two fractions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from unisched.calibrate.fit import COMMON_WINDOW_LATE_S, common_window, items_at, rates_over  # the same window as calibration
from unisched.policy.tuning import TUNING

__all__ = [
    "COMMON_WINDOW_LATE_S",
    "CONTENTION_THRESHOLD",
    "GUARANTEE_SLACK",
    "MAX_ERROR_POINTS",
    "MAX_MEDIAN_ERROR_POINTS",
    "MIN_CONTENDING_EFFICIENCY",
    "OVERLAP_EFFICIENCY_TOLERANCE",
    "OVERLAP_KEPT",
    "SEPARATE_GRAPHICS",
    "SHARED_SM",
    "Verdict",
    "common_window",
    "contends",
    "contention_verdict",
    "efficiency",
    "error_points",
    "guarantee_ok",
    "items_at",
    "normalized",
    "overlap_bound",
    "rates_over",
    "shares",
    "short_window",
    "verdict",
]

GUARANTEE_SLACK = 0.02
MIN_WINDOW_PART = 0.5
"""A workload that measured less of its window than this (its start-up overran the warm-up) gives no rate: a rate
over a fraction of a second is no measurement, and as a reference alone it would skew every pair it scores."""
CONTENTION_THRESHOLD = 1.1
MAX_MEDIAN_ERROR_POINTS = 1.0  # contending pairs: error in the median round
MAX_ERROR_POINTS = 2.0  # contending pairs: error in every round
MIN_CONTENDING_EFFICIENCY = 0.98  # contending pairs: sum of normalized rates in every round
OVERLAP_EFFICIENCY_TOLERANCE = 0.02  # overlapping pairs: sum at most this below the no-scheduler run's
OVERLAP_KEPT = TUNING.overlap_kept  # the daemon's thresholds (unisched.policy.tuning), never a copy
MIX_SUM = TUNING.mix_sum
"""A tenant of a shared run whose first completion came this much after its partner's first: the pair is scored
over the part of the window where both ran (common_window). Otherwise the partner that ran alone meanwhile is
credited with its solo rate for that part: a ResNet-50 trainer can start seconds into a short window on the H200,
which lifts a render's 'kept' by several points."""
SEPARATE_GRAPHICS = "separate-graphics"
PARTIAL_OVERLAP = "partial-overlap"
SHARED_SM = "shared-sm"


def normalized(shared: float, solo: float) -> float:
    """Throughput shared as a fraction of the same tenant's throughput alone."""
    if solo <= 0:
        raise ValueError(f"solo throughput must be positive, got {solo}")
    return shared / solo


def shares(weights: Sequence[float]) -> list[float]:
    """Each tenant's entitled fraction w_i / sum(w)."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"weights must be a non-empty list of positive numbers, got {list(weights)}")
    total = float(sum(weights))
    return [w / total for w in weights]


def _check(norm: Sequence[float], weights: Sequence[float]) -> None:
    if len(norm) != len(weights):
        raise ValueError(f"{len(norm)} normalized values for {len(weights)} weights")


def error_points(norm: Sequence[float], weights: Sequence[float]) -> float:
    """max_i |n_i / sum(n) - w_i / sum(w)| in points (0-100); NaN when no tenant made progress."""
    _check(norm, weights)
    want = shares(weights)
    total = float(sum(norm))
    if total <= 0:
        return math.nan
    return 100.0 * max(abs(n / total - s) for n, s in zip(norm, want, strict=True))


def efficiency(norm: Sequence[float]) -> float:
    """Sum of normalized throughputs."""
    return float(sum(norm))


def guarantee_ok(norm: Sequence[float], weights: Sequence[float],
                 slack: float = GUARANTEE_SLACK) -> bool:
    """Every tenant got at least its weight share of its solo throughput, minus `slack`."""
    _check(norm, weights)
    return all(n >= s - slack for n, s in zip(norm, shares(weights), strict=True))


def contends(no_scheduler_efficiency: float, threshold: float = CONTENTION_THRESHOLD) -> bool:
    """Whether the pair fights over one engine (True) or the hardware overlaps it (False)."""
    return no_scheduler_efficiency < threshold


def contention_verdict(compute_kept: float, graphics_kept: float) -> str:
    """The contention map the daemon derives from a calibration of CUDA + rendering with no scheduler.

    compute_kept / graphics_kept: throughput together / throughput alone of the CUDA and the render load.
    "separate-graphics" (compute and graphics overlap in hardware and are not sliced against each other)
    when both kept >= OVERLAP_KEPT (0.75: left unsliced, each still gets its weight share for weights up to
    3:1); "partial-overlap" (mixed slices: together part of the time, each alone as its share needs) when the
    two kept rates sum to >= MIX_SUM; otherwise "shared-sm" (they contend and are sliced as one domain).
    NaN never counts as overlap.

    MUST AGREE with the daemon's own copy of this rule, unisched/policy/contention.py
    (ContentionMap.from_kept, OVERLAP_KEPT, MIX_SUM); tests/test_bench_scoring.py checks that they do.
    """
    if compute_kept >= OVERLAP_KEPT and graphics_kept >= OVERLAP_KEPT:
        return SEPARATE_GRAPHICS
    if compute_kept + graphics_kept >= MIX_SUM and min(compute_kept, graphics_kept) >= 0.0:
        return PARTIAL_OVERLAP
    return SHARED_SM


@dataclass(frozen=True)
class Verdict:
    """The judgement of one shared run against the targets for its kind of pair."""

    contending: bool
    guarantee: bool
    error_pts: float
    efficiency: float
    passed: bool
    reasons: tuple[str, ...]  # why it failed; empty when it passed

    def label(self) -> str:
        return "PASS" if self.passed else "FAIL: " + "; ".join(self.reasons)


def overlap_bound(kept: Sequence[float], weights: Sequence[float], steps: int = 10000) -> float:
    """The most efficiency a two-tenant pair can keep while each gets its guarantee, by mixing the time between
    running together (each keeps `kept[i]` of its solo rate: the no-scheduler run's normalized throughputs) and
    each alone (at worst each alone in turn, for its guarantee: so there always is one).

    Why: where running together gives one tenant much less than its share (a ResNet-50 trainer keeps ~0.3 beside
    the render on the H200, which keeps 0.88), its guarantee at 3:1 needs it alone most of the time, and the
    no-scheduler efficiency is out of reach for any scheduler. Reported beside the verdict, which stays the targets'.
    A scan over the time together (its fraction b; each alone for what its guarantee still lacks, and any time
    left alone too) rather than the policy's exact solver (unisched.policy.overlap), which the tests compare it
    with."""
    if len(kept) != 2 or len(weights) != 2:
        raise ValueError("a pair: two kept rates and two weights")
    need = [max(0.0, s - GUARANTEE_SLACK) for s in shares(weights)]
    best = 0.0
    for i in range(steps + 1):
        b = i / steps
        alone = [max(0.0, n - k * b) for n, k in zip(need, kept, strict=True)]
        spare = 1.0 - b - sum(alone)  # time left: to either alone (together it is a larger b, scanned too)
        if spare >= -1e-12:
            best = max(best, sum(k * b for k in kept) + sum(alone) + spare)
    return best


def verdict(norm: Sequence[float], weights: Sequence[float], contending: bool,
            no_scheduler_efficiency: float | None = None, bound: float | None = None) -> Verdict:
    """Judge a shared run: contending pairs by guarantee, error and efficiency; overlapping pairs
    by guarantee and efficiency relative to the no-scheduler run (which must then be given). `bound`
    (overlap_bound) is only said beside a missed efficiency: it does not change the verdict."""
    err = error_points(norm, weights)
    eff = efficiency(norm)
    guarantee = guarantee_ok(norm, weights)
    reasons: list[str] = []
    if not guarantee:
        digits = [3 if f"{n:.2f}" == f"{s - GUARANTEE_SLACK:.2f}" else 2 for n, s in zip(norm, shares(weights), strict=True)]
        low = [f"{n:.{d}f} < {s - GUARANTEE_SLACK:.{d}f}" for n, s, d in zip(norm, shares(weights), digits, strict=True)
               if n < s - GUARANTEE_SLACK]  # (three digits where two would read "0.73 < 0.73")
        reasons.append("guarantee missed (" + ", ".join(low) + ")")
    if contending:
        if not err <= MAX_ERROR_POINTS:  # also catches NaN
            reasons.append(f"error {err:.1f} pts > {MAX_ERROR_POINTS:g}")
        if eff < MIN_CONTENDING_EFFICIENCY:
            reasons.append(f"sum {eff:.2f} < {MIN_CONTENDING_EFFICIENCY:g}")
    elif no_scheduler_efficiency is None:
        reasons.append("no no-scheduler efficiency to compare with")
    elif eff < no_scheduler_efficiency - OVERLAP_EFFICIENCY_TOLERANCE:
        reasons.append(f"sum {eff:.2f} < no-scheduler {no_scheduler_efficiency:.2f} - "
                       f"{OVERLAP_EFFICIENCY_TOLERANCE:g}"
                       + (f" (no mix that keeps the guarantee sums more than {bound:.2f})"
                          if bound is not None and bound < no_scheduler_efficiency - OVERLAP_EFFICIENCY_TOLERANCE else ""))
    return Verdict(contending=contending, guarantee=guarantee, error_pts=err, efficiency=eff,
                   passed=not reasons, reasons=tuple(reasons))


def short_window(report: dict[str, object] | None) -> str | None:
    """Why a workload's report measured too little of its window to give a rate (MIN_WINDOW_PART); None: enough, or
    a report that does not say its window."""
    w = (report or {}).get("window")
    if not isinstance(w, dict):
        return None
    planned = float(w.get("end_at", 0.0)) - float(w.get("start_at", 0.0))
    measured = float(w.get("seconds", planned))
    if planned <= 0 or measured >= MIN_WINDOW_PART * planned:
        return None
    return (f"measured {measured:.1f} s of its {planned:g} s window (started {float(w.get('late_s', 0.0)):.1f} s "
            "late): no rate is taken from this run")
