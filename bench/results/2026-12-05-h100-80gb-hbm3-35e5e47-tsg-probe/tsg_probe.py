#!/usr/bin/env python3
"""Probe: do channel-group (TSG) timeslices split a contended GPU by their ratio?

Each run starts its tenants on one shared window (--start-at), each under LD_PRELOAD=tsgshim.so with its own
TSGSLICE_US (empty: the driver's default), and reads their reports. Alone runs give the references."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).resolve().parent / "tsgshim.so"
WL = {"cuda": ROOT / "examples/workloads/cuda_matmul.py", "render": ROOT / "examples/workloads/egl_render.py"}
OUT = Path(sys.argv[1])
SECONDS = float(os.environ.get("PROBE_SECONDS", "10"))
LEAD = float(os.environ.get("PROBE_LEAD", "12"))


def run(name: str, tenants: list[tuple[str, str]]) -> list[dict]:
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    start = time.time() + LEAD
    procs = []
    for i, (kind, slice_us) in enumerate(tenants):
        env = dict(os.environ, LD_PRELOAD=str(SHIM), TSGLOG=str(d / f"tsg{i}.log"), TSGSLICE_US=slice_us)
        cmd = [sys.executable, str(WL[kind]), "--seconds", str(SECONDS), "--start-at", str(start),
               "--report", str(d / f"r{i}.json")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(d / f"out{i}.log", "w"),  # noqa: SIM115
                                      stderr=subprocess.STDOUT))
    for p in procs:
        p.wait(timeout=LEAD + SECONDS + 60)
    res = []
    for i, (kind, slice_us) in enumerate(tenants):
        try:
            r = json.loads((d / f"r{i}.json").read_text())
        except (OSError, ValueError):
            r = {"throughput": float("nan")}
        log = (d / f"tsg{i}.log").read_text() if (d / f"tsg{i}.log").exists() else ""
        res.append({"kind": kind, "slice": slice_us or "default", "rate": r.get("throughput"),
                    "tsgs": log.count("\n"), "log": log.strip().splitlines()[:3]})
    return res


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    alone: dict[str, float] = {}
    rows = []
    plan = [("alone-cuda", [("cuda", "")]), ("alone-render", [("render", "")])]
    for a, b in (("cuda", "cuda"), ("render", "render"), ("cuda", "render")):
        for sa, sb in (("", ""), ("1024", "4096"), ("4096", "1024"), ("1024", "8192")):
            if a != b and sa == "1024" and sb == "8192":
                sa, sb = "8192", "1024"
            plan.append((f"{a}-{sa or 'd'}+{b}-{sb or 'd'}", [(a, sa), (b, sb)]))
    if os.environ.get("PROBE_ONLY"):
        plan = [p for p in plan if p[0].startswith("alone") or p[0] in os.environ["PROBE_ONLY"].split(",")]
    for name, tenants in plan:
        t0 = time.time()
        res = run(name, tenants)
        if name.startswith("alone"):
            alone[tenants[0][0]] = res[0]["rate"]
        for r in res:
            ref = alone.get(r["kind"])
            r["norm"] = r["rate"] / ref if ref and r["rate"] == r["rate"] else None
        total = sum(r["norm"] or 0 for r in res)
        line = {"run": name, "seconds": round(time.time() - t0, 1), "sum": round(total, 3), "tenants": res}
        rows.append(line)
        shares = " ".join(f"{r['kind']}@{r['slice']}: {r['rate']:.2f} norm {r['norm'] or 0:.3f} share "
                          f"{(r['norm'] or 0) / total if total else 0:.3f} tsgs {r['tsgs']}" for r in res)
        print(f"{name:28s} sum {total:.3f}  {shares}", flush=True)
        for r in res:
            for ln in r["log"][:2]:
                print("    ", ln, flush=True)
    (OUT / "probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
