"""How a round's raw outputs become its cases and metrics, one reader a suite (bench/suites.py declares which):
each gets the round's raw folder (one sub-folder per step, by its name) and returns {case: {metric: value}} and
notes."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from charges import DAEMON_LOGS, log_name, pair_rows
from daemon_log import charged_by_rule, gate_over, removed_charges
from scoring import overlap_bound

Cases = dict[str, dict[str, Any]]
Reader = Callable[[Path], tuple[Cases, list[str]]]

CLOUD_SATURATED = 0.95
"""A cloud run with no scheduler saturates when its players' mean FPS is below this fraction of their pace."""
CLOUD_HOST_BOUND = 0.95
"""...and it is the host's CPU that saturated, not the GPU, when the players could use every core of the host and
used at least this fraction of them (on the H200, which has no NVENC, each player encodes on the CPU). The daemon
shares the GPU, not the CPU, so the targets do not apply there. Players pinned to some cores (--player-cpus: the CPU
stand-ins, whose pinned core is the GPU) are never host-bound, and neither is a run whose GPU NVML read busy for
CLOUD_GPU_BUSY of the window: a player waiting for a saturated GPU spins in the driver's wait, so there the cores
fill because the GPU ran out."""
CLOUD_GPU_BUSY = 0.95


def step_folder(folder: Path) -> Path:
    """The raw folder of a one-command round (its only sub-folder), for the readers of such suites."""
    subs = [p for p in sorted(folder.iterdir()) if p.is_dir()] if folder.is_dir() else []
    return subs[0] if len(subs) == 1 else folder


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_gpu_pairs(folder: Path) -> tuple[Cases, list[str]]:
    """bench/gpu_pairs.py's results.json: per pair under unisched, its normalized rates, error, sum, guarantee and
    the no-scheduler sum beside it (and, for a pair that overlaps, the most a mix that keeps the guarantee could
    sum: scoring.overlap_bound), and what the daemon charged each tenant over the window, by rule and source, beside
    what it measured (`charges`: charges.pair_rows; each tenant's part of the charges as charged_part_a and _b); per
    kind alone under unisched (--overhead), the throughput lost."""
    step = step_folder(folder)
    data = _json(step / "results.json")
    cases: Cases = {}
    notes: list[str] = []
    for d in data.get("pairs", []):
        us, ns = d.get("unisched") or {}, d.get("no_scheduler") or {}
        if not us and not ns:
            continue
        m: dict[str, Any] = {"contending": d.get("contending"), "alone_a": d["solo"][0], "alone_b": d["solo"][1],
                             "no_scheduler_sum": ns.get("efficiency")}
        if us:
            m.update(normalized_a=us["normalized"][0], normalized_b=us["normalized"][1], error_pts=us["error_pts"],
                     sum=us["efficiency"], guarantee=us["guarantee"])
            if ns:
                m["sum_vs_no_scheduler"] = us["efficiency"] - ns["efficiency"]
        if not d.get("contending") and ns.get("normalized") and d.get("weights"):  # what any scheduler could keep
            m["best_sum_with_guarantee"] = overlap_bound(ns["normalized"], d["weights"])
        group = (data.get("unisched") or {}).get(d["pair"]) or {}
        if us and group.get("charges"):
            rows, why = pair_rows(group, d, removed_charges(step / DAEMON_LOGS / log_name(d["pair"])))
            if rows:
                m.update({f"charged_part_{side}": row["charged_part"] for side, row in zip("ab", rows, strict=False)})
                m["charges"] = rows
            if why:
                notes.append(f"{d['pair']}: {why}")
        cases[d["pair"]] = m
    for kind, o in (data.get("overhead") or {}).items():
        cases[f"{kind} alone"] = {"alone": o.get("alone"), "under_daemon": o.get("alone_under_unisched"),
                                  "loss": o.get("loss")}
    return cases, [*data.get("errors", []), *data.get("warnings", []), *notes]


def unread_repeats(runs: dict[str, int], script: str, unit: str, kept: str) -> list[str]:
    """A note where a script repeated runs internally (`runs`: how many each of its pairs or batches, the `unit`,
    had) and the reader keeps one of each (`kept`): the round's verdicts rest on that one, the others are only in
    the raw outputs."""
    many = {case: n for case, n in runs.items() if n > 1}
    if not many:
        return []
    return [f"{script} ran {len(many)} of {len(runs)} {unit} more than once in its own rounds (up to "
            f"{max(many.values())} runs each): only the {kept} run of each is read"]


def read_mixed_engines(folder: Path) -> tuple[Cases, list[str]]:
    """bench/mixed_engines.py's results.json: per pair at its weights, its last run (a note says so where its own
    --rounds ran more), and every round's alone rates."""
    data = _json(step_folder(folder) / "results.json")
    cases: Cases = {}
    for key, runs in (data.get("runs") or {}).items():
        r = runs[-1]
        cases[key] = {"normalized_a": r["normalized"][0], "normalized_b": r["normalized"][1],
                      "error_pts": r["error_pts"], "sum": r["sum"], "guarantee": r["guarantee"]}
    for k, solo in enumerate(data.get("solo") or []):
        cases.setdefault("alone", {}).update({f"{m} (round {k + 1})": v for m, v in solo.items()})
    counts = {key: len(runs) for key, runs in (data.get("runs") or {}).items()}
    return cases, unread_repeats(counts, "mixed_engines.py (--rounds)", "pairs", "last")


def read_online(folder: Path) -> tuple[Cases, list[str]]:
    """scenarios.py's online results: per batch and setup, p99 / alone, the top of that run's distribution-free
    90% interval of it (shown, not judged: see ONLINE_TARGETS) and the trainer's rate kept against its own alone
    run; of its own rounds (--repeat) the first only, and a note says so where there were more."""
    online = ((_json(step_folder(folder) / "results.json").get("scenarios") or {}).get("online") or {})
    cases: Cases = {}
    for batch, runs in (online.get("batches") or {}).items():
        for rnd in ((runs.get("derived") or {}).get("per_round") or [])[:1]:
            for setup, s in (rnd.get("setups") or {}).items():
                bounds = s.get("p99_x_bounds") or [None, None]
                cases[f"b{batch} {setup}"] = {"p99_ms": s.get("p99_ms"), "alone_p99_ms": rnd.get("alone_p99_ms"),
                                              "p99_x_alone": s.get("p99_x_alone"), "p99_x_top": bounds[1],
                                              "trainer_kept": s.get("offline_kept")}
    errors = [f"{b} {k}: {v['error']}" for b, runs in (online.get("batches") or {}).items()
              for k, v in runs.items() if isinstance(v, dict) and v.get("error")]
    counts = {f"b{batch}": len((runs.get("derived") or {}).get("per_round") or [])
              for batch, runs in (online.get("batches") or {}).items()}
    return cases, [*errors, *unread_repeats(counts, "scenarios.py (--repeat)", "batches", "first")]


def weighted_shares(total: float, weights: list[float], cap: float) -> list[float]:
    """`total` divided in proportion to `weights`, none above `cap` (a player cannot run past its pace), what a
    capped player cannot take going to the others by weight: where no cap binds, plain proportions."""
    owed = [0.0] * len(weights)
    left, free = total, set(range(len(weights)))
    while free and left > 1e-12:
        k = left / sum(weights[i] for i in free)
        capped = {i for i in free if weights[i] * k >= cap}
        if not capped:
            for i in free:
                owed[i] = weights[i] * k
            break
        for i in capped:
            owed[i] = cap
        left -= cap * len(capped)
        free -= capped
    return owed


def cloud_metrics(shared: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    """One size of the cloud sweep: whether the no-scheduler run saturated, and whether the host's CPU is what did
    (host_bound), how far the players under the daemon are from FPS proportional to weight (largest
    |fps_i / owed_i - 1|, owed_i the players' total FPS divided by weight, none owed more than the pace:
    `weighted_shares`), and the players' 1% low over their mean FPS (median) under the daemon
    less the same with no scheduler. Also shown: the players' CPU over the cores they may run on (the host's, unless
    pinned) and the GPU's NVML busy fraction (where measured) in each run, and under the daemon the CPU a frame of
    the lightest and heaviest weight groups (`cpu_a_frame`)."""
    per, base = shared.get("per_instance") or [], alone.get("per_instance") or []
    pace = float(alone.get("fps_target") or shared.get("fps_target") or 60.0)
    out: dict[str, Any] = {"fps_no_scheduler": alone.get("fps_mean_all"), "fps_unisched": shared.get("fps_mean_all"),
                           "saturated": bool(alone) and float(alone.get("fps_mean_all") or 0.0) < CLOUD_SATURATED * pace}
    fps = [float(e.get("fps_mean") or 0.0) for e in per]
    weights = [float(e.get("weight") or 1.0) for e in per]
    if fps and sum(fps) > 0:
        owed = weighted_shares(sum(fps), weights, pace)
        out["weight_error"] = max(abs(f / o - 1.0) for f, o in zip(fps, owed, strict=True))

    def lows(entries: list[dict[str, Any]]) -> float | None:
        got = [e["fps_1pct_low"] / e["fps_mean"] for e in entries if e.get("fps_1pct_low") and e.get("fps_mean")]
        return statistics.median(got) if got else None

    a, b = lows(per), lows(base)
    out["lows_vs_no_scheduler"] = None if a is None or b is None else a - b
    for key, run in (("cpu_of_host_no_scheduler", alone), ("cpu_of_host_unisched", shared)):
        total, cores = run.get("cpu_cores_total"), run.get("player_cores") or run.get("host_cores")
        out[key] = total / cores if isinstance(total, int | float) and cores else None
    unpinned = alone.get("player_cores") is not None and alone.get("player_cores") == alone.get("host_cores")
    used = out["cpu_of_host_no_scheduler"]
    out["gpu_busy_no_scheduler"], out["gpu_busy_unisched"] = alone.get("gpu_busy"), shared.get("gpu_busy")
    busy = out["gpu_busy_no_scheduler"]
    gpu_full = isinstance(busy, int | float) and busy >= CLOUD_GPU_BUSY
    out["host_bound"] = None if used is None else unpinned and used >= CLOUD_HOST_BOUND and not gpu_full
    out.update(cpu_a_frame(per))
    return out


def cpu_a_frame(per: list[dict[str, Any]]) -> dict[str, float]:
    """The CPU ms a frame of the lightest and the heaviest weight group under the daemon, all of it and its user-mode
    part where the players reported it: the busy time is split by CPU, so a group that spends more CPU a frame (a
    wait that costs CPU, spent in the kernel where it sleeps) pays more than its GPU time."""
    out: dict[str, float] = {}
    groups = sorted({float(e.get("weight") or 1.0) for e in per})
    for name, w in (("lightest", groups[0]), ("heaviest", groups[-1])) if len(groups) > 1 else ():
        members = [e for e in per if float(e.get("weight") or 1.0) == w]
        frames = sum(float(e.get("fps_mean") or 0.0) for e in members)
        for key, metric in (("cpu_cores", f"cpu_ms_a_frame_{name}"), ("cpu_user_cores", f"user_ms_a_frame_{name}")):
            cores = [c for e in members if isinstance(c := e.get(key), int | float)]
            if frames > 0 and len(cores) == len(members):
                out[metric] = round(1000 * sum(cores) / frames, 3)
    return out


def read_cloud(folder: Path) -> tuple[Cases, list[str]]:
    """Per size N of the round (its runs' folders: no-scheduler-N, unisched-N), cloud_metrics, and from the daemon's
    log how much of the window it sliced the GPU (sliced_of_window), how often it opened it again because the
    turns were left unused (unused_openings, and the highest GPU busy fraction it read then), and the part of the
    busy time it charged over the run that NVML's per-process samples split (process_rate_of_charged)."""
    cases: Cases = {}
    notes: list[str] = []
    runs = [re.fullmatch(r"(?:no-scheduler|unisched)-(\d+)", p.name) for p in folder.glob("*")]
    sizes = sorted({int(m.group(1)) for m in runs if m})
    for n in sizes:
        shared, alone = _json(folder / f"unisched-{n}" / "report.json"), _json(folder / f"no-scheduler-{n}" / "report.json")
        if shared or alone:
            cases[f"N={n}"] = m = cloud_metrics(shared, alone)
            start, seconds = shared.get("start_at"), shared.get("seconds")
            if isinstance(start, int | float) and isinstance(seconds, int | float) and seconds > 0:
                gate = gate_over(folder / f"unisched-{n}-daemon.log", start, start + seconds)
                if gate is not None:
                    m["sliced_of_window"] = round(gate.sliced_s / seconds, 4)
                    m["unused_openings"] = gate.unused_openings
                    m["util_at_unused_openings"] = gate.opening_util
            charged = charged_by_rule(folder / f"unisched-{n}-daemon.log")
            if charged and (total := sum(charged.values())) > 0:
                m["process_rate_of_charged"] = round(charged.get("process-rate", 0.0) / total, 4)
            notes += [str(e.get("error", e)) if isinstance(e, dict) else str(e)
                      for e in [*shared.get("errors", []), *alone.get("errors", [])]]
    return cases, notes


def read_ad_sim(folder: Path) -> tuple[Cases, list[str]]:
    cases: Cases = {}
    for step in ("sequential", "colocated", "unisched-1-1"):
        r = _json(folder / step / "report.json")
        if r:
            e2e = (r.get("latency_ms") or {}).get("end_to_end") or {}
            cases[step] = {"fps_end_to_end": r.get("fps_end_to_end"), "e2e_p50_ms": e2e.get("p50"),
                           "e2e_p99_ms": e2e.get("p99")}
    return cases, []


def read_hooks(folder: Path) -> tuple[Cases, list[str]]:
    cases: Cases = {}
    startup = _json(folder / "startup" / "results.json")
    for kind, a in (startup.get("added_ms") or {}).items():
        calls = (startup.get("hooked_calls") or {}).get(kind) or {}  # (the daemon's metrics; absent before they were)
        cases[f"{kind} start-up"] = {"added_ms": a.get("mean"), "added_ms_lo90": a.get("lo90"),
                                     "added_ms_hi90": a.get("hi90"), "pairs": a.get("n"),
                                     "added_ms_median": a.get("median"), "pair_sd_ms": a.get("stdev"),
                                     "calls_a_start": calls.get("calls_per_start"),
                                     "answer_us_in_daemon": calls.get("answer_us_mean"),
                                     "decisions_a_start": calls.get("decisions_per_start"),
                                     "decision_us_in_daemon": calls.get("decision_us_mean"),
                                     "other_us_in_daemon": calls.get("undecided_us_mean"),
                                     "send_us": calls.get("send_us_mean")}
    after = ((_json(folder / "answer" / "results.json").get("results") or {}).get("after") or {}).get("idle") or {}
    for kind, c in (after.get("contexts") or {}).items():
        cases[f"{kind} context, answer cost"] = {"added_ms_p50": c.get("added_ms_p50"),
                                                  "added_ms_p90": c.get("added_ms_p90")}
    return cases, []


def read_leases(folder: Path) -> tuple[Cases, list[str]]:
    cases: Cases = {}
    for step, case in (("rtt", "round trip, 1 tenant"), ("rtt-library", "round trip, 1 tenant, client library"),
                       ("load", "1000 tenants")):
        r = _json(folder / step / "results.json")
        if r:
            rtt = r.get("rtt_ms") or {}
            cases[case] = {"tenants": r.get("tenants"), "p50_ms": rtt.get("p50"), "p99_ms": rtt.get("p99"),
                           "daemon_cpu_cores": r.get("daemon_cpu_cores"), "streams_lost": r.get("streams_lost")}
            if r.get("tenants", 0) > 1 and "registration_s" in r:  # how long the burst of registrations took
                cases[case]["registration_s"] = r["registration_s"]
            if r.get("tenants", 0) > 1 and r.get("rtt_before_window_ms"):  # renewals answered during that burst
                cases[case]["max_ms_while_registering"] = r["rtt_before_window_ms"].get("max")
            if r.get("probe_rtt_ms"):  # the one tenant renewing beside the load, in a process of its own
                cases[case] |= {"probe_p50_ms": r["probe_rtt_ms"].get("p50"), "probe_p99_ms": r["probe_rtt_ms"].get("p99"),
                                "over_100ms": (r.get("slow") or {}).get("count")}
    flood = _json(folder / "flood" / "results.json")
    if flood:  # no target: what one connection's burst of demand changes costs another tenant's renewals
        cases[f"flood beside {flood['tenants']} tenants"] = {
            f"{phase}_{stat}_ms": flood[f"{phase}_ms"][stat] for phase in ("quiet", "flood") for stat in ("p99", "max")}
    reg = _json(folder / "registrations" / "results.json")
    if reg:  # no target: what one process's registrations, each a cgroup move, cost another caller's Status
        cases["Status while registering"] = {
            "registrations_per_s": reg["registrar"]["registrations"] / reg["registrar"]["seconds"],
            "register_p50_ms": reg["registrar"]["p50_ms"], "late_warnings": reg["late_warnings"],
            **{f"{phase}_{stat}_ms": reg[f"{phase}_ms"][stat] for phase in ("quiet", "registering")
               for stat in ("p99", "max")}}
        burst = reg.get("beside_burst")
        if burst:  # no target: another user's pile of registrations against one caller's own
            cases["Register beside another user's burst"] = {
                "asked_at_once": burst["procs"] * burst["calls"], "burst_registrations": burst["burst_registrations"],
                "registrations": burst["registrar"]["registrations"],
                **{f"register_{stat}_ms": burst["registrar"][f"{stat}_ms"] for stat in ("p50", "p99", "max")}}
    floor = _json(folder / "floor" / "results.json").get("rtt_ms")
    if floor:  # no tenant: the target does not apply to it
        cases["bare echo (the machine's floor)"] = {"p50_ms": floor.get("p50"), "p99_ms": floor.get("p99")}
        for one in (cases.get("round trip, 1 tenant"), cases.get("round trip, 1 tenant, client library")):
            if one and one.get("p99_ms") is not None and floor.get("p99") is not None:  # the daemon's and client's part
                one["p99_over_floor_ms"] = one["p99_ms"] - floor["p99"]
    return cases, []


PYTEST_SUMMARY = re.compile(r"\d+ [a-z]+(?:, \d+ [a-z]+)* in \d+(?:\.\d+)?s\b.*")
"""pytest's summary line, its ='s stripped: '4 passed, 1 skipped in 64.88s (0:01:04)' (-q prints it bare)."""
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?)\b")


def pytest_counts(text: str) -> dict[str, int]:
    """pytest's counts from its last summary line (PYTEST_SUMMARY), wherever it is in the log: not simply the log's
    last line, which a line printed after pytest (a wrapper's own) would hide; zeros where pytest did not finish."""
    lines = [line.strip().strip("=").strip() for line in text.splitlines()]
    summary = ([line for line in lines if PYTEST_SUMMARY.fullmatch(line)] or [""])[-1]
    counts = {("errors" if k == "error" else k): int(n) for n, k in PYTEST_COUNTS.findall(summary)}
    return {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "errors")}


def tests_pass(counts: dict[str, int]) -> bool:
    """Every test ran and passed: a skipped test (no GPU seen, a missing library) did not show the behaviour."""
    return counts["passed"] > 0 and counts["failed"] == counts["errors"] == counts["skipped"] == 0


def read_memory(folder: Path) -> tuple[Cases, list[str]]:
    log = folder / "memory" / "test_gpu_memory.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    counts = pytest_counts(text)
    cost = _json(folder / "memory" / "memory_hook_cost.json")
    m: dict[str, Any] = {"passed": counts["passed"], "failed": counts["failed"], "skipped": counts["skipped"],
                         "tests_pass": bool(text) and tests_pass(counts)}
    m.update({k: v for k, v in cost.items() if isinstance(v, int | float)})
    for side in ("hooked", "plain"):  # what the hooks cost an allocation and a training step, and without them
        m.update({f"{side}_{k}": v for k, v in (cost.get(side) or {}).items() if isinstance(v, int | float)})
    return {"tests/test_gpu_memory.py": m}, []
