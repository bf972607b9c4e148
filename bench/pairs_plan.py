"""The pairs gpu_pairs.py measures: which (parse_pairs), how long a run of them takes (estimate_seconds), and what
each pair's runs derive (derive_pair: normalized rates against alone, error, sum, guarantee and the verdict, with the
no-scheduler run as an overlapping pair's yardstick). Pure but for the run results it is given; rescore_pairs.py
derives committed results again with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import scoring
from _daemon import ROOT
from pairs_runs import Config, GroupResult

WORKLOADS = {
    "cuda": ROOT / "examples" / "workloads" / "cuda_matmul.py",
    "render": ROOT / "examples" / "workloads" / "egl_render.py",
    "nvdec": ROOT / "examples" / "04_nvdec_decode.py",  # H.264 decode on NVDEC (PyAV), the same window contract
}


PAIR_KINDS = {
    "cuda": ("cuda", "cuda"), "cuda+cuda": ("cuda", "cuda"),
    "render": ("render", "render"), "render+render": ("render", "render"),
    "mixed": ("cuda", "render"), "cuda+render": ("cuda", "render"),
    "nvdec": ("nvdec", "nvdec"), "nvdec+nvdec": ("nvdec", "nvdec"),
}


RUN_OVERHEAD_S = 3.0  # per run, beyond warmup + seconds: process exit, reading reports


DAEMON_OVERHEAD_S = 3.0  # per unisched run: daemon start-up and SIGTERM


CALIBRATION_S = 10.0


@dataclass(frozen=True)
class Pair:
    """Two tenants and the weights they should share the GPU by."""

    kinds: tuple[str, str]
    weights: tuple[float, float]

    @property
    def kinds_key(self) -> str:
        return "+".join(self.kinds)

    @property
    def key(self) -> str:
        return f"{self.kinds_key} {self.weights[0]:g}:{self.weights[1]:g}"

    @classmethod
    def from_key(cls, key: str) -> Pair:
        """The inverse of `key` ('cuda+render 1:1'), as results.json names its pairs."""
        kinds, weights = key.rsplit(" ", 1)
        ka, kb = kinds.split("+")
        a, b = (float(w) for w in weights.split(":"))
        return cls((ka, kb), (a, b))


def parse_pairs(text: str) -> list[Pair]:
    """'cuda3:1,render1:1,mixed1:3' -> pairs; kinds cuda, render, mixed (= cuda+render)."""
    pairs: list[Pair] = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        m = re.fullmatch(r"([a-z+]+?)(\d+):(\d+)", token)
        if not m or m.group(1) not in PAIR_KINDS:
            raise ValueError(f"bad pair {token!r}: expected KINDSa:b (integer weights, as unisched "
                             f"takes) with KINDS one of "
                             f"{', '.join(PAIR_KINDS)} (e.g. cuda3:1, mixed1:3)")
        a, b = int(m.group(2)), int(m.group(3))
        if a <= 0 or b <= 0:
            raise ValueError(f"bad pair {token!r}: weights must be positive")
        pair = Pair(PAIR_KINDS[m.group(1)], (a, b))
        if pair not in pairs:
            pairs.append(pair)
    if not pairs:
        raise ValueError("no pairs selected")
    return pairs


def solo_kinds(pairs: list[Pair]) -> list[str]:
    return sorted({k for p in pairs for k in p.kinds})


def kind_pairs(pairs: list[Pair]) -> list[tuple[str, str]]:
    """Distinct pairs of kinds, in first-seen order: each runs once with no scheduler."""
    seen: list[tuple[str, str]] = []
    for p in pairs:
        if p.kinds not in seen:
            seen.append(p.kinds)
    return seen


def run_seconds(cfg: Config, daemon: bool = False) -> float:
    """What one run is budgeted: its warm-up and window, overheads, and a daemon's start and stop."""
    if daemon:
        return cfg.unisched_warmup + cfg.seconds + RUN_OVERHEAD_S + DAEMON_OVERHEAD_S
    return cfg.warmup + cfg.seconds + RUN_OVERHEAD_S


def estimate_seconds(cfg: Config, pairs: list[Pair], unisched: bool, calibrate: bool, repeat: int = 1,
                     solo_after: bool = False) -> float:
    per_round = (len(solo_kinds(pairs)) * (2 if solo_after else 1) + len(kind_pairs(pairs))) * run_seconds(cfg)
    per_round += (len(pairs) * run_seconds(cfg, daemon=True)) if unisched else 0.0
    return repeat * per_round + (CALIBRATION_S if calibrate else 0.0)


def score_setup(throughput: list[float | None], solo: list[float | None], weights: tuple[float, float],
                contending: bool | None = None, no_sched: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Normalized numbers, error, sum, guarantee (and the verdict when `contending` is given; `no_sched`, the
    no-scheduler run's own scores, gives an overlapping pair its yardstick and the bound any mix could reach)."""
    if any(t is None for t in throughput) or any(not s for s in solo):
        return None
    norm = [scoring.normalized(t, s) for t, s in zip(throughput, solo, strict=True)]  # type: ignore[arg-type]
    out: dict[str, Any] = {
        "throughput": throughput, "normalized": norm,
        "error_pts": scoring.error_points(norm, weights), "efficiency": scoring.efficiency(norm),
        "guarantee": scoring.guarantee_ok(norm, weights),
    }
    if contending is not None:
        bound = None if contending or no_sched is None else scoring.overlap_bound(no_sched["normalized"], weights)
        if bound is not None:
            out["overlap_bound"] = bound
        v = scoring.verdict(norm, weights, contending, no_sched["efficiency"] if no_sched else None, bound)
        out["verdict"] = {"passed": v.passed, "label": v.label(), "reasons": list(v.reasons),
                          "contending": v.contending}
    return out


def solo_reference(kind: str, solo: dict[str, GroupResult], solo_after: dict[str, GroupResult]) -> float | None:
    """A kind's throughput alone: the mean of its solo runs before and after the shared ones (--solo-after), so
    that a reference which drifts while they run (the H200 VM's CPU-bound trainer: 1322-2109 img/s in one
    session) is met halfway; the run before alone without them."""
    got = [g.throughputs()[0] for g in (solo.get(kind), solo_after.get(kind)) if g is not None]
    ok = [t for t in got if t]
    return sum(ok) / len(ok) if ok else None


def solo_drift(kind: str, solo: dict[str, GroupResult], solo_after: dict[str, GroupResult]) -> float | None:
    """How far the solo run after the shared ones moved from the one before (after / before - 1)."""
    if kind not in solo or kind not in solo_after:
        return None
    before, after = solo[kind].throughputs()[0], solo_after[kind].throughputs()[0]
    return after / before - 1.0 if before and after is not None else None


def derive_pair(pair: Pair, solo: dict[str, GroupResult], nosched: dict[str, GroupResult],
                unisched: dict[str, GroupResult], solo_after: dict[str, GroupResult] | None = None) -> dict[str, Any]:
    """Everything the table shows for one pair, from the raw runs (None where a run is missing)."""
    solo_tp = [solo_reference(k, solo, solo_after or {}) for k in pair.kinds]
    units = [(solo[k].tenants[0].report or {}).get("unit", "") if k in solo else "" for k in pair.kinds]
    ns_run = nosched.get(pair.kinds_key)
    ns = score_setup(ns_run.throughputs(), solo_tp, pair.weights) if ns_run else None
    if ns is not None:
        contending, source = scoring.contends(ns["efficiency"]), "no-scheduler run"
    else:  # no reference run: same-kind pairs contend, by construction of the workloads
        contending, source = pair.kinds[0] == pair.kinds[1], "assumed from the kinds"
    us_run = unisched.get(pair.key)
    us = None
    if us_run is not None:
        us = score_setup(us_run.throughputs(), solo_tp, pair.weights, contending, ns)
    return {"pair": pair.key, "kinds": list(pair.kinds), "weights": list(pair.weights),
            "units": units, "solo": solo_tp, "contending": contending, "contending_from": source,
            "no_scheduler": ns, "unisched": us}
