#!/usr/bin/env python3
"""Score committed gpu_pairs runs again from their raw reports, with the scoring as it is now.

Why: results committed before gpu_pairs scored a pair over the seconds both tenants ran (scoring.common_window)
scored a pair whose tenant started late over the nominal window, crediting the partner that ran alone meanwhile
with its solo rate for that part. This applies the scoring of the checkout to such results, without a GPU.

For each folder (a gpu_pairs --out, or one with round-K/ folders) it reads results.json, rebuilds the runs,
derives every pair again, recomputes the contention calibration where the runs allow, and writes rescored.md and
rescored.json beside results.json (which it leaves as it is):

  python3 bench/rescore_pairs.py bench/results/2026-12-01-h200-e/call-d/mix-user [more folders]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs_calibration
import pairs_plan
from pairs_report import fmt
from pairs_runs import GroupResult

from unisched.scheduler.contention_file import ContentionFileError

SECTIONS = ("solo", "solo_after", "no_scheduler", "unisched")


def rescore(results: dict[str, Any]) -> dict[str, Any]:
    runs = {s: {k: GroupResult.from_json(v) for k, v in (results.get(s) or {}).items()} for s in SECTIONS}
    pairs = [pairs_plan.Pair.from_key(p["pair"]) for p in results.get("pairs", [])]
    new = [pairs_plan.derive_pair(p, runs["solo"], runs["no_scheduler"], runs["unisched"], runs["solo_after"]) for p in pairs]
    out: dict[str, Any] = {"pairs": new, "common_windows": {}, "kept": None}
    for s in ("no_scheduler", "unisched"):
        for key, g in runs[s].items():
            if (w := g.common_window()) is not None:
                out["common_windows"][f"{s} {key}"] = [round(w[0], 3), round(w[1], 3)]
    solo, together = runs["solo"], runs["no_scheduler"].get("cuda+render")
    if together is not None and "cuda" in solo and "render" in solo:
        try:
            out["kept"] = [round(k, 4) for k in pairs_calibration.kept_fractions(solo["cuda"], solo["render"], together)]
        except ContentionFileError as e:
            out["kept_error"] = str(e)
    return out


def fmt_setup(d: dict[str, Any] | None) -> str:
    if not d:
        return "n/a"
    n = d["normalized"]
    label = (d.get("verdict") or {}).get("label", "")
    return f"{fmt(n[0])} / {fmt(n[1])}, sum {fmt(d['efficiency'])}" + (f", {label}" if label else "")


def markdown(folder: Path, files: list[tuple[Path, dict[str, Any], dict[str, Any]]]) -> str:
    lines = [f"# {folder}: rescored over the seconds both tenants ran", "",
             "`python3 bench/rescore_pairs.py " + str(folder) + "` (results.json left as measured; bench/scoring.py "
             "common_window). A row changes only where a tenant started late.", ""]
    for path, old, new in files:
        rel = path.relative_to(folder)
        lines += [f"## {rel}", ""]
        if new["common_windows"]:
            lines.append("Scored over: " + "; ".join(f"{k} {w[0]:g}-{w[1]:g} s" for k, w in new["common_windows"].items()))
            lines.append("")
        entry = (old.get("contention") or {}).get("entry") or {}
        if new["kept"] is not None:
            was = f"{fmt(entry.get('compute_kept'))} / {fmt(entry.get('graphics_kept'))}" if entry else "n/a"
            lines += [f"Calibration (compute / graphics kept): as measured {was}; rescored "
                      f"{fmt(new['kept'][0])} / {fmt(new['kept'][1])}", ""]
        lines += ["| pair | setup | as measured | rescored |", "|---|---|---|---|"]
        for before, after in zip(old.get("pairs", []), new["pairs"], strict=False):
            for setup in ("no_scheduler", "unisched"):
                lines.append(f"| {after['pair']} | {setup.replace('_', ' ')} | {fmt_setup(before.get(setup))} | "
                             f"{fmt_setup(after.get(setup))} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path, help="gpu_pairs --out folders")
    args = ap.parse_args(argv)
    status = 0
    for folder in args.folders:
        paths = sorted(folder.glob("round-*/results.json")) or [folder / "results.json"]
        files = []
        for path in paths:
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                print(f"rescore_pairs: {path}: {e}", file=sys.stderr)
                status = 2
                continue
            files.append((path, old, rescore(old)))
        if not files:
            continue
        md = markdown(folder, files)
        (folder / "rescored.md").write_text(md + "\n")
        (folder / "rescored.json").write_text(json.dumps(
            {str(p.relative_to(folder)): new for p, _, new in files}, indent=1, default=str) + "\n")
        print(md)
    return status


if __name__ == "__main__":
    sys.exit(main())
