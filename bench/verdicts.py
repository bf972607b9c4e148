"""Targets and their verdicts over a suite's rounds, as pure functions (no I/O).

Why apart from the runner: the arithmetic that says PASS or FAIL is the part a reader must be able to trust, so it
is small, tested on hand-computed numbers (tests/test_bench_runner.py) and the same for every suite. A verdict is
computed from every round; nothing is dropped, and a missed target says by how much.

A round's data is {case: {metric: value}} (a case is e.g. a pair at its weights); a target names one metric and
how the rounds are reduced:
- median       the median round;
- worst        the worst round (the highest value for an upper bound, the lowest for a lower bound);
- every        a yes/no metric that must hold in every round (the value is how many rounds missed it);
- interval     the top (upper bound) or bottom (lower bound) of the mean's 90% interval over the rounds;
- inside       both ends of the mean's 90% interval within +-limit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

Metrics = Mapping[str, Any]
Round = Mapping[str, Metrics]  # case -> metric -> value

INTERVAL = 0.90
"""The interval's coverage: the issue's targets speak of 90% intervals."""
T_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
        1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725)
"""Student's t at 0.95 (two-sided 90%) for 1..20 degrees of freedom; 1.645 (normal) beyond. A copy of the table
rather than scipy, which the GPU machine's slim environment does not have."""
NORMAL_95 = 1.645
STATS = ("median", "worst", "every", "interval", "inside")


def t_quantile(df: int) -> float:
    """Two-sided 90% Student-t quantile for `df` degrees of freedom."""
    if df < 1:
        raise ValueError("an interval needs two rounds at least")
    return T_95[df - 1] if df <= len(T_95) else NORMAL_95


def mean_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """The 90% interval of the mean over rounds (Student t); None with fewer than two rounds."""
    if len(values) < 2:
        return None
    m = statistics.fmean(values)
    half = t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return (m - half, m + half)


def describe(values: Sequence[float]) -> dict[str, Any]:
    """Median, lowest, highest, mean and the mean's 90% interval of one metric over the rounds."""
    if not values:
        return {"n": 0}
    iv = mean_interval(values)
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values), "interval90": None if iv is None else [iv[0], iv[1]]}


@dataclass(frozen=True)
class Target:
    """One target of a suite: `metric` of every case that `applies`, reduced over the rounds by `stat`, against
    `limit` (`op` '<=' or '>=' or '<'; for 'inside', |ends| <= limit). `text` is the target as the issue says it."""

    name: str
    metric: str
    stat: str
    op: str
    limit: float
    text: str
    unit: str = ""
    scale: float = 1.0  # shown values are value * scale (e.g. 100 for a fraction shown in %)
    applies: Callable[[Metrics], bool] | None = None  # of a case's metrics in one round; None: every case with it

    def __post_init__(self) -> None:
        if self.stat not in STATS or self.op not in ("<=", ">=", "<"):
            raise ValueError(f"target {self.name}: stat {self.stat!r}, op {self.op!r}")


@dataclass(frozen=True)
class Verdict:
    """A target judged for one case: passed None when the rounds cannot say (a missing metric, one round where an
    interval needs two)."""

    case: str
    target: str
    text: str
    value: float | None
    passed: bool | None
    detail: str

    def label(self) -> str:
        return {True: "PASS", False: "FAIL", None: "n/a"}[self.passed] + (f": {self.detail}" if self.detail else "")

    def to_json(self) -> dict[str, Any]:
        return {"case": self.case, "target": self.target, "text": self.text, "value": self.value,
                "passed": self.passed, "detail": self.detail}


def _fmt(x: float, t: Target) -> str:
    return f"{x * t.scale:.3g}{t.unit}"


def _holds(value: float, t: Target) -> bool:
    if t.op == "<=":
        return value <= t.limit
    if t.op == "<":
        return value < t.limit
    return value >= t.limit


def judge(t: Target, case: str, values: Sequence[Any]) -> Verdict:
    """One target over one case's values in every round (None where a round lacks the metric)."""
    got = [v for v in values if not _missing(v)]
    missing = len(values) - len(got)
    if not got:
        return Verdict(case, t.name, t.text, None, None, "not measured")
    if t.stat == "every":
        bad = sum(1 for v in got if not v) + missing
        return Verdict(case, t.name, t.text, float(bad), bad == 0,
                       "" if bad == 0 else f"missed in {bad} of {len(values)} rounds")
    nums = [float(v) for v in got]
    if t.stat in ("interval", "inside"):
        iv = mean_interval(nums)
        if iv is None:
            return Verdict(case, t.name, t.text, None, None, "an interval needs 2 rounds or more")
        if t.stat == "inside":
            worst = max(abs(iv[0]), abs(iv[1]))
            ok = worst <= t.limit
            span = f"interval {_fmt(iv[0], t)} to {_fmt(iv[1], t)}"
            return Verdict(case, t.name, t.text, worst, ok,
                           span if ok else f"{span}, outside +-{_fmt(t.limit, t)} by {_fmt(worst - t.limit, t)}")
        value = iv[1] if t.op in ("<=", "<") else iv[0]
    elif t.stat == "median":
        value = statistics.median(nums)
    else:
        value = max(nums) if t.op in ("<=", "<") else min(nums)
    ok = _holds(value, t) and missing == 0
    if ok:
        return Verdict(case, t.name, t.text, value, True, "")
    if not _holds(value, t):
        detail = f"{_fmt(value, t)} {'>' if t.op in ('<=', '<') else '<'} {_fmt(t.limit, t)}, by {_fmt(abs(value - t.limit), t)}"
    else:
        detail = f"{missing} of {len(values)} rounds did not measure it"
    return Verdict(case, t.name, t.text, value, False, detail)


def cases_of(rounds: Sequence[Round]) -> list[str]:
    """Every case seen in any round, in first-seen order."""
    seen: dict[str, None] = {}
    for r in rounds:
        seen.update(dict.fromkeys(r))
    return list(seen)


def _missing(value: Any) -> bool:
    """A value a round did not measure (as `judge` counts it)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _applies(t: Target, metrics: Metrics) -> bool:
    return t.applies is None or t.applies(metrics)


def round_values(t: Target, case: str, rounds: Sequence[Round]) -> list[Any] | None:
    """The case's values of `t` in the rounds that judge it; None when `t` applies in no round that has the metric.
    Each round decides for itself (a pair may contend in one round and not the next): a round where the case has the
    metric but `t` does not apply is left out, as the other targets judge it; a round without the case or its metric
    counts as missing (None), which fails the target, whatever the other rounds say."""
    if not any(t.metric in r[case] and _applies(t, r[case]) for r in rounds if case in r):
        return None
    values = []
    for r in rounds:
        value = r[case].get(t.metric) if case in r else None
        if _missing(value) or _applies(t, r[case]):
            values.append(value)
    return values


def _judged_on(v: Verdict, judged: int, total: int) -> Verdict:
    """`v`, its detail saying on how many rounds it was judged where the target did not apply in every one."""
    if judged == total:
        return v
    note = f"judged on {judged} of {total} rounds (the target did not apply in the others)"
    return replace(v, detail=f"{v.detail}; {note}" if v.detail else note)


def judge_all(targets: Sequence[Target], rounds: Sequence[Round]) -> list[Verdict]:
    """Every target for every case it applies to in any round (round_values: judged on every round it applies in,
    missing where a round lacks the case or the metric)."""
    out: list[Verdict] = []
    for case in cases_of(rounds):
        for t in targets:
            values = round_values(t, case, rounds)
            if values is not None:
                out.append(_judged_on(judge(t, case, values), len(values), len(rounds)))
    return out


MEASURED = "measured"
"""The target name of unmeasured's verdicts."""


def unmeasured(expected: Sequence[str], rounds: Sequence[Round]) -> list[Verdict]:
    """A failing verdict per `expected` case that no round has: judge_all judges only the cases the rounds hold, so
    without these a suite that measured 8 of its 9 pairs would read as PASS."""
    seen = set(cases_of(rounds))
    return [Verdict(case, MEASURED, "every case of the suite measured", None, False, "not measured in any round")
            for case in expected if case not in seen]


def stats_of(rounds: Sequence[Round]) -> dict[str, dict[str, dict[str, Any]]]:
    """describe() of every numeric metric of every case over the rounds."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for case in cases_of(rounds):
        metrics: dict[str, None] = {}
        for r in rounds:
            metrics.update(dict.fromkeys(r.get(case, {})))
        for m in metrics:
            vals = [r.get(case, {}).get(m) for r in rounds]
            nums = [float(v) for v in vals if isinstance(v, int | float) and not isinstance(v, bool)
                    and math.isfinite(float(v))]
            if nums:
                out.setdefault(case, {})[m] = describe(nums)
    return out


def overall(verdicts: Sequence[Verdict]) -> bool | None:
    """False when any target missed; None when none missed but some could not be judged; else True."""
    if any(v.passed is False for v in verdicts):
        return False
    if not verdicts or any(v.passed is None for v in verdicts):
        return None
    return True
