"""bench/gpu_pairs.py's output: results.md's tables from results.json's content, one round or several, and the files.

Apart from the runs, so that a results folder can be rendered again (rescore_pairs.py, plot_pairs.py) without the
machinery that measured it.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scoring
from _results import save_json, write_atomic


def fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def fmt_tp(x: float | None, unit: str) -> str:
    return "n/a" if x is None else f"{x:.1f} {unit}"


def table_rows(d: dict[str, Any], unisched_ran: bool) -> list[list[str]]:
    w = f"{d['weights'][0]:g}:{d['weights'][1]:g}"
    name = d["kinds"][0] + " + " + d["kinds"][1]
    ua, ub = d["units"]
    rows = [[name, w, "alone", fmt_tp(d["solo"][0], ua), fmt_tp(d["solo"][1], ub),
             "1.00 / 1.00" if all(d["solo"]) else "n/a", "", "", ""]]
    ns = d["no_scheduler"]
    if ns is None:
        rows.append([name, w, "no scheduler", "n/a", "n/a", "n/a", "", "", "run failed or missing"])
    else:
        cls = (f"contends (sum {ns['efficiency']:.2f} < {scoring.CONTENTION_THRESHOLD:g})"
               if d["contending"] else f"overlaps (sum {ns['efficiency']:.2f})")
        rows.append([name, w, "no scheduler", fmt_tp(ns["throughput"][0], ua),
                     fmt_tp(ns["throughput"][1], ub),
                     f"{fmt(ns['normalized'][0])} / {fmt(ns['normalized'][1])}",
                     fmt(ns["error_pts"], 1), fmt(ns["efficiency"]), cls])
    if unisched_ran:
        us = d["unisched"]
        if us is None:
            rows.append([name, w, "unisched", "n/a", "n/a", "n/a", "", "", "run failed or missing"])
        else:
            rows.append([name, w, "unisched", fmt_tp(us["throughput"][0], ua),
                         fmt_tp(us["throughput"][1], ub),
                         f"{fmt(us['normalized'][0])} / {fmt(us['normalized'][1])}",
                         fmt(us["error_pts"], 1), fmt(us["efficiency"]),
                         ("**PASS**" if us["verdict"]["passed"] else us["verdict"]["label"])])
    return rows


def render_markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    head = ["pair", "weights", "setup", "throughput A", "throughput B", "normalized A / B",
            "error pts", "sum", "verdict"]
    lines = [
        f"Command: `{meta['command']}` | date (UTC): {meta['date_utc']} | GPU: {meta['gpu']} | "
        f"host: {meta['hostname']}",
        "",
        f"Window {meta['seconds']:g} s after {meta['warmup']:g} s warm-up"
        + (f" ({meta['unisched_warmup']:g} s under unisched)" if meta["unisched"] and "unisched_warmup" in meta
           else "")
        + f"; unisched slice {meta['slice_ms']:g} ms; render iterations: "
        f"{meta.get('render_iterations') or 'default'}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for d in results["pairs"]:
        for row in table_rows(d, meta["unisched"]):
            lines.append("| " + " | ".join(row) + " |")
    if results.get("overhead"):
        lines += ["", f"One tenant alone under unisched ({meta.get('engine', 'kernel')} engine) against alone without it:", "",
                  "| kind | alone | under unisched | loss |", "|---|---|---|---|"]
        for kind, o in results["overhead"].items():
            loss = o.get("loss")
            lines.append(f"| {kind} | {fmt(o['alone'], 1)} | {fmt(o['alone_under_unisched'], 1)} | "
                         f"{'n/a' if loss is None else f'{100 * loss:.1f}%'} |")
    cont = results.get("contention")
    if cont and cont.get("entry"):
        e = cont["entry"]
        lines += ["", f"Contention calibration (no-scheduler cuda + render): compute kept {e['compute_kept']:.2f}, "
                      f"graphics kept {e['graphics_kept']:.2f} -> **{cont['verdict']}**; written for "
                      f"`{cont['gpu']}` to `{cont['path']}`"
                      + ("; the unisched runs started their daemons with it." if meta["unisched"] else ".")]
    lines += [
        "",
        "normalized = shared / alone; error = max |n_i/sum(n) - w_i/sum(w)| in points; sum = sum of "
        "normalized. Each run is judged by what every round must meet (bench/README.md): contending pairs "
        f"(no-scheduler sum < {scoring.CONTENTION_THRESHOLD:g}) need every n_i >= w_i/sum(w) - "
        f"{scoring.GUARANTEE_SLACK:g}, error <= {scoring.MAX_ERROR_POINTS:g} pts and sum >= "
        f"{scoring.MIN_CONTENDING_EFFICIENCY:g}; overlapping pairs need the same guarantee and a sum no more than "
        f"{scoring.OVERLAP_EFFICIENCY_TOLERANCE:g} below the no-scheduler sum. The median round's error <= "
        f"{scoring.MAX_MEDIAN_ERROR_POINTS:g} pt is judged over the rounds (bench/run.py).",
    ]
    for title, key in (("Warnings", "warnings"), ("Errors", "errors")):
        if results.get(key):
            lines += ["", f"{title}:", *["- " + " / ".join(str(x).split("\n")).strip(" /")
                                          for x in results[key]]]
    return "\n".join(lines) + "\n"


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def combine_rounds(rounds: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """Each pair's figures over the rounds (each round scored against its own solo runs): medians, ranges and
    how many rounds passed; the solo runs of every round, so a reference that drifts shows."""
    summary: dict[str, Any] = {"meta": {**rounds[0]["meta"], "command": command, "rounds": len(rounds)},
                               "pairs": [], "solo": {}, "warnings": [], "errors": []}
    for k, r in enumerate(rounds, 1):
        summary["warnings"] += [f"round {k}: {w}" for w in r["warnings"]]
        summary["errors"] += [f"round {k}: {e}" for e in r["errors"]]
        for kind, group in r["solo"].items():
            summary["solo"].setdefault(kind, []).append(group_throughput(group))
        for kind, group in r.get("solo_after", {}).items():
            summary["solo"].setdefault(f"{kind} (after)", []).append(group_throughput(group))
    for i, first in enumerate(rounds[0]["pairs"]):
        per = [r["pairs"][i] for r in rounds if i < len(r["pairs"])]
        out: dict[str, Any] = {"pair": first["pair"], "kinds": first["kinds"], "weights": first["weights"]}
        for setup in ("no_scheduler", "unisched"):
            got = [d[setup] for d in per if d.get(setup)]
            out[setup] = {
                "rounds": len(got),
                "normalized": [_spread([g["normalized"][j] for g in got]) for j in (0, 1)],
                "error_pts": _spread([g["error_pts"] for g in got]),
                "efficiency": _spread([g["efficiency"] for g in got]),
                "passed": sum(bool(g.get("verdict", {}).get("passed")) for g in got),
            }
        summary["pairs"].append(out)
    losses: dict[str, list[float]] = {}
    for r in rounds:
        for kind, o in r.get("overhead", {}).items():
            if o.get("loss") is not None:
                losses.setdefault(kind, []).append(o["loss"])
    summary["overhead"] = {kind: _spread(v) for kind, v in losses.items()}
    return summary


def group_throughput(group: dict[str, Any]) -> float | None:
    """The first tenant's throughput in a run's JSON (results["solo"][kind])."""
    tenants = group.get("tenants") or [{}]
    report = tenants[0].get("report") or {}
    return float(report["throughput"]) if "throughput" in report else None


def render_rounds_markdown(summary: dict[str, Any]) -> str:
    meta = summary["meta"]
    n = meta["rounds"]

    def cell(x: dict[str, float] | None, digits: int = 2) -> str:
        return "n/a" if x is None else f"{x['median']:.{digits}f} [{x['min']:.{digits}f}-{x['max']:.{digits}f}]"

    lines = [f"Command: `{meta['command']}` | date (UTC): {meta['date_utc']} | GPU: {meta['gpu']} | "
             f"host: {meta['hostname']}", "",
             f"{n} rounds, each scored against its own solo runs"
             + (" (the mean of those before and after the shared ones)" if meta.get("solo_after") else "")
             + f"; window {meta['seconds']:g} s; slice {meta['slice_ms']:g} ms; engine {meta.get('engine', 'kernel')}. "
             "Medians [min-max] over the rounds; the rounds' own tables are in round-K/results.md.", "",
             "| pair | weights | setup | normalized A / B | error pts | sum | passed |", "|---|---|---|---|---|---|---|"]
    for d in summary["pairs"]:
        w = f"{d['weights'][0]:g}:{d['weights'][1]:g}"
        name = d["kinds"][0] + " + " + d["kinds"][1]
        for setup, label in (("no_scheduler", "no scheduler"), ("unisched", "unisched")):
            x = d[setup]
            if not x["rounds"]:
                continue
            passed = f"{x['passed']} of {x['rounds']}" if setup == "unisched" else ""
            lines.append(f"| {name} | {w} | {label} | {cell(x['normalized'][0])} / {cell(x['normalized'][1])} | "
                         f"{cell(x['error_pts'], 1)} | {cell(x['efficiency'])} | {passed} |")
    if summary.get("overhead"):
        lines += ["", "One tenant alone under unisched against alone without it, loss per round: " + "; ".join(
            f"{kind} {100 * x['median']:.1f}% [{100 * x['min']:.1f}-{100 * x['max']:.1f}%]"
            for kind, x in summary["overhead"].items() if x)]
    lines += ["", "Alone, per round: " + "; ".join(
        f"{kind} " + ", ".join(fmt(t, 1) for t in tps) for kind, tps in summary["solo"].items())]
    for title, key in (("Warnings", "warnings"), ("Errors", "errors")):
        if summary.get(key):
            lines += ["", f"{title}:", *["- " + " / ".join(str(x).split("\n")).strip(" /") for x in summary[key]]]
    return "\n".join(lines) + "\n"


def save(out: Path, results: dict[str, Any]) -> None:
    """Rewritten after every step, so a run cut short still leaves what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    save_json(out / "results.json", results)
    write_atomic(out / "results.md", render_markdown(results))
