#!/usr/bin/env python3
"""Pairs of saturating GPU tenants: alone, together with no scheduler, and together under unisched.

Why one script: sharing is always measured alone, with no scheduler, and with
unisched in one run on one machine, and scored by normalized throughput (shared / alone). This runs
the pairs the daemon is judged on, in one invocation that fits one device call:

  cuda+cuda 3:1, render+render 1:1 and 3:1, cuda+render 1:1 and 1:3.

Each workload kind is measured alone once and each pair of kinds once with no scheduler (neither
depends on weights); every weighted pair then runs under a fresh `unisched serve`. The two tenants
of a run are launched together and given the same absolute measurement window (`--start-at`), so
neither measures while the other is still starting. Scoring lives in bench/scoring.py.

Outputs in --out: results.json (raw reports, daemon snapshots, derived numbers), results.md (the
table) and daemon-logs/ (each daemon's log, its start and end where it is long). Worker logs, reports
and daemon state go to --work-dir (a temp folder by default); the tail of every log is copied into
results.json. Each pair under unisched also keeps what the daemon charged each tenant, by rule and
source, at its window's start and end (bench/charges.py).

With --calibrate-out DIR the no-scheduler cuda+render run doubles as the daemon's contention
calibration (DIR/contention.json, as `unisched calibrate` writes it, with its fit and writer), and the
unisched runs use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scoring
from _daemon import ROOT
from _results import save_json, utc_now, write_atomic
from charges import DAEMON_LOGS, log_name
from pairs_args import TIME_BUDGET_S, parse_args
from pairs_calibration import (
    check_contention_dir,
    device_warnings,
    gpu0_name,
    kept_fractions,
    prepare_clip,
    prepare_render,
    render_calibration_wanted,
    render_iterations_used,
    write_contention_file,
)
from pairs_plan import (
    WORKLOADS,
    Pair,
    derive_pair,
    estimate_seconds,
    kind_pairs,
    run_seconds,
    solo_drift,
    solo_kinds,
)
from pairs_report import combine_rounds, fmt, fmt_tp, render_markdown, render_rounds_markdown, save
from pairs_runs import (
    Config,
    Daemon,
    DaemonError,
    GroupResult,
    Progress,
    TenantSpec,
    run_group,
)

from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.contention_file import (
    CONTENTION_FILE,
    ContentionFileError,
    make_entry,
)

SOLO_DRIFT_WARN = 0.10  # a solo run after the shared ones this far from the one before is reported


def gpu_name() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__}: nvidia-smi)"
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return "; ".join(lines) if done.returncode == 0 and lines else f"unknown (nvidia-smi rc {done.returncode})"


def check_group(group: GroupResult, warnings: list[str], errors: list[str]) -> None:
    """Turn what a run reported into warnings (late windows, software rendering) and errors."""
    for t in group.tenants:
        where = f"{group.setup} {group.label} / {t.name}"
        if t.error:
            errors.append(f"{where}: {t.error}")
        short = t.short_window()
        if short:
            errors.append(f"{where}: {short}")
        rep = t.report or {}
        late = (rep.get("window") or {}).get("late_s", 0.0)
        if late > 1.0 and not short:
            option = "--unisched-warmup" if group.setup == "unisched" else "--warmup"
            common = group.common_window()
            scored = "" if common is None else f"; the pair is scored over the {common[1] - common[0]:.1f} s both ran"
            warnings.append(f"{where}: window started {late:.1f} s late (slow start-up; raise {option}){scored}")
        renderer = str(rep.get("gl_renderer", "")) + str(rep.get("egl_display", ""))
        if "llvmpipe" in renderer or "software" in renderer:
            warnings.append(f"{where}: rendered on a software renderer ({rep.get('gl_renderer')})")
    snap = group.extra.get("tenants_snapshot")
    if snap is not None and snap.get("rc") != 0:
        warnings.append(f"{group.setup} {group.label}: `unisched tenants --json` failed (rc {snap.get('rc')})")


def check_daemon_contention(daemon: Daemon, verdict: str, key: str, warnings: list[str]) -> None:
    """Warn when the daemon did not take the contention map the calibration implies (or did not say)."""
    used = daemon.gpu_contention()
    status = daemon.info.get("status") or {}
    if used is None and status.get("rc") == 0 and (status.get("parsed") or {}).get("gpus") == []:
        warnings.append(f"unisched: {key}: the daemon reports no GPU (no NVML?): its contention map is unchecked")
    elif used is None:
        warnings.append(f"unisched: {key}: could not read the daemon's contention map from `status --json`")
    elif used != verdict:
        warnings.append(f"unisched: {key}: the daemon uses contention {used!r}, the calibration implies "
                        f"{verdict!r} (did it read contention.json from its state dir?)")


# --------------------------------------------------------------------------------------------- main


def new_config(*, seconds: float, warmup: float, grace_s: float, work_dir: Path | None, dry_run: bool,
               workload_cmd_cuda: str | None, workload_cmd_render: str | None,
               workload_cmd_nvdec: str | None = None, unisched_warmup: float | None = None,
               slice_ms: float = DaemonConfig().slice_ms,
               unisched_module: str = "unisched", prefix: str = "gpu_pairs-") -> Config:
    """A Config from option values (gpu_pairs' own, or another script's)."""
    if work_dir is None:
        work_dir = (Path(tempfile.gettempdir()) / f"{prefix}XXXXXXXX" if dry_run
                    else Path(tempfile.mkdtemp(prefix=prefix)))
    work_dir = work_dir.absolute()  # the daemons' sockets and state go below it: `serve` takes absolute paths only
    if not dry_run:
        work_dir.mkdir(parents=True, exist_ok=True)
    custom = {"cuda": workload_cmd_cuda, "render": workload_cmd_render, "nvdec": workload_cmd_nvdec}
    cmds = {k: shlex.split(c) if c else [sys.executable, str(WORKLOADS[k])] for k, c in custom.items()}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYOPENGL_PLATFORM", "egl")
    return Config(python=sys.executable, seconds=seconds, warmup=warmup,
                  unisched_warmup=warmup if unisched_warmup is None else unisched_warmup,
                  slice_ms=slice_ms, grace_s=grace_s, work_dir=work_dir, workload_cmd=cmds,
                  custom_cmd={k: bool(c) for k, c in custom.items()},
                  unisched_module=unisched_module, env=env)


def make_config(args: argparse.Namespace) -> Config:
    cfg = new_config(seconds=args.seconds, warmup=args.warmup, unisched_warmup=args.unisched_warmup,
                     grace_s=args.grace, work_dir=args.work_dir, dry_run=args.dry_run,
                     workload_cmd_cuda=args.workload_cmd_cuda, workload_cmd_render=args.workload_cmd_render,
                     workload_cmd_nvdec=args.workload_cmd_nvdec, slice_ms=args.slice_ms, unisched_module=args.unisched_module)
    return dataclasses.replace(cfg, engine=args.engine, serve_args=tuple(args.serve_arg))


def print_plan(cfg: Config, pairs: list[Pair], unisched: bool, calibrate: bool, progress: Progress,
               repeat: int = 1, solo_after: bool = False) -> None:
    est = estimate_seconds(cfg, pairs, unisched, calibrate, repeat, solo_after)
    progress.note(f"plan: alone {solo_kinds(pairs)}{' (before and after)' if solo_after else ''}; no scheduler "
                  f"{[a + '+' + b for a, b in kind_pairs(pairs)]}; "
                  f"unisched {[p.key for p in pairs] if unisched else 'skipped'}; "
                  f"calibration {'yes' if calibrate else 'no'}{f'; {repeat} rounds' if repeat > 1 else ''}")
    progress.note(f"estimated {est:.0f} s ({est / 60:.1f} min); warm-up {cfg.warmup:g} s"
                  f"{f' ({cfg.unisched_warmup:g} s under unisched)' if unisched else ''}, window "
                  f"{cfg.seconds:g} s; work dir {cfg.work_dir}")
    if est > TIME_BUDGET_S:
        progress.note(f"WARNING: the estimate exceeds {TIME_BUDGET_S:.0f} s: lower --seconds/--warmup "
                      "or select fewer --pairs to fit the time budget")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pairs: list[Pair] = args.pair_list
    cfg = make_config(args)
    unisched_on = not args.no_unisched
    needs_render = "render" in solo_kinds(pairs)
    calibrate = render_calibration_wanted(cfg, args.render_fps, args.render_iterations) and needs_render
    per_round = (len(solo_kinds(pairs)) * (2 if args.solo_after else 1) + len(kind_pairs(pairs))
                 + (len(pairs) if unisched_on else 0))
    progress = Progress(int(calibrate) + args.repeat * per_round)
    print_plan(cfg, pairs, unisched_on, calibrate, progress, args.repeat, args.solo_after)
    if args.calibrate_out is not None:
        progress.note(f"contention calibration: from the no-scheduler cuda+render run to "
                      f"{args.calibrate_out / CONTENTION_FILE}"
                      f"{'; the unisched daemons start with it' if unisched_on else ''}"
                      f"{' (each round its own)' if args.repeat > 1 else ''}")
    if args.dry_run:
        return 0
    clip_error = prepare_clip(cfg, pairs, progress)
    if clip_error is not None:
        print(f"gpu_pairs: error: {clip_error}", file=sys.stderr)
        return 2
    calibrate_gpu: str | None = None
    if args.calibrate_out is not None:  # fail now rather than after minutes of measuring
        calibrate_gpu = args.gpu_name or gpu0_name()
        try:
            if not calibrate_gpu:
                raise ContentionFileError("cannot name GPU 0 (nvidia-smi failed): pass --gpu-name")
            check_contention_dir(args.calibrate_out)
        except ContentionFileError as exc:
            print(f"gpu_pairs: error: --calibrate-out: {exc}", file=sys.stderr)
            return 2
    command = "python3 bench/gpu_pairs.py" + ("" if not sys.argv[1:] else " " + shlex.join(sys.argv[1:]))
    rounds: list[dict[str, Any]] = []
    for k in range(args.repeat):
        if args.repeat == 1:
            rounds.append(run_round(args, cfg, progress, command, calibrate, calibrate_gpu, args.out, ""))
            continue
        work = cfg.work_dir / f"round-{k + 1}"
        work.mkdir(parents=True, exist_ok=True)
        rounds.append(run_round(args, dataclasses.replace(cfg, work_dir=work), progress, command, calibrate and k == 0,
                                calibrate_gpu, args.out / f"round-{k + 1}", f", round {k + 1}/{args.repeat}"))
    if args.repeat == 1:
        progress.note(f"done in {progress.elapsed():.0f} s: {args.out / 'results.md'}")
        sys.stdout.write(render_markdown(rounds[0]))
    else:
        summary = combine_rounds(rounds, command)
        save_json(args.out / "results.json", summary)
        write_atomic(args.out / "results.md", render_rounds_markdown(summary))
        progress.note(f"done in {progress.elapsed():.0f} s: {args.out / 'results.md'} (rounds in round-N/)")
        sys.stdout.write(render_rounds_markdown(summary))
    return 1 if any(r["errors"] for r in rounds) else 0


def run_round(args: argparse.Namespace, cfg: Config, progress: Progress, command: str, calibrate: bool,
              calibrate_gpu: str | None, out: Path, tag: str) -> dict[str, Any]:
    """One round: the solo runs, the no-scheduler pairs (the calibration), the pairs under unisched, the overhead
    runs and (--solo-after) the solo runs again; results under `out`. `tag` names the round in progress lines."""
    pairs: list[Pair] = args.pair_list
    unisched_on = not args.no_unisched
    results: dict[str, Any] = {
        "meta": {"command": command, "date_utc": utc_now(),
                 "gpu": gpu_name(), "hostname": socket.gethostname(), "python": sys.version.split()[0],
                 "seconds": cfg.seconds, "warmup": cfg.warmup, "unisched_warmup": cfg.unisched_warmup,
                 "slice_ms": cfg.slice_ms, "engine": cfg.engine,
                 "unisched": unisched_on, "pairs": [p.key for p in pairs], "work_dir": str(cfg.work_dir),
                 "workload_cmd": cfg.workload_cmd, "render_iterations": args.render_iterations,
                 "calibrate_out": None if args.calibrate_out is None else str(args.calibrate_out),
                 "solo_after": args.solo_after, "round": tag.strip(", ") or None},
        "calibration": None, "solo": {}, "solo_after": {}, "no_scheduler": {}, "unisched": {}, "pairs": [],
        "overhead": {},
        "warnings": [], "errors": [],
    }
    if args.calibrate_out is not None:
        results["contention"] = None
    solo: dict[str, GroupResult] = {}
    solo_after: dict[str, GroupResult] = {}
    nosched: dict[str, GroupResult] = {}
    shared: dict[str, GroupResult] = {}
    failed_kinds: set[str] = set()
    daemon_failures = 0
    contention_path: Path | None = None  # the file written by --calibrate-out, once written

    def record(section: str, key: str, group: GroupResult, store: dict[str, GroupResult]) -> None:
        store[key] = group
        results[section][key] = group.to_json()
        check_group(group, results["warnings"], results["errors"])
        results["pairs"] = [derive_pair(p, solo, nosched, shared, solo_after) for p in pairs]
        save(out, results)
        summary = ", ".join(f"{t.name} {fmt_tp(t.throughput, (t.report or {}).get('unit', ''))}"
                            for t in group.tenants)
        progress.note(f"  -> {summary} ({group.wall_s:.0f} s{'' if group.ok else ', FAILED'})")

    def skip(what: str, kinds: tuple[str, ...], daemon: bool = False) -> bool:
        """Whether to skip a step (a kind it needs failed, or it would overrun --max-total)."""
        bad = failed_kinds.intersection(kinds)
        need = run_seconds(cfg, daemon)
        if bad:
            reason = f"{', '.join(sorted(bad))} failed earlier"
        elif progress.elapsed() + need > args.max_total:
            reason = f"would end after --max-total {args.max_total:g} s"
        elif daemon and daemon_failures >= 2:
            reason = "unisched serve failed to start twice"
        else:
            return False
        progress.step(f"{what}: skipped ({reason})")
        results["errors"].append(f"{what}: skipped ({reason})")
        save(out, results)
        return True

    save(out, results)
    if calibrate:
        cal, iters = prepare_render(cfg, args.render_fps, progress)
        results["calibration"] = cal
        if iters is not None:
            results["meta"]["render_iterations"] = iters
        else:
            failed_kinds.add("render")
            results["errors"].append(str(cal["error"]))
        save(out, results)

    for kind in solo_kinds(pairs):
        if skip(f"alone: {kind}", (kind,)):
            continue
        progress.step(f"alone: {kind}{tag}")
        group = run_group(cfg, kind, "alone", [TenantSpec(f"a-{kind}", kind, None)])
        record("solo", kind, group, solo)
        if not group.ok:
            failed_kinds.add(kind)

    for kinds in [] if args.overhead_only else kind_pairs(pairs):
        key = "+".join(kinds)
        if skip(f"no scheduler: {key}", kinds):
            continue
        progress.step(f"no scheduler: {key}{tag}")
        specs = [TenantSpec(f"{tag}-{k}", k, None) for tag, k in zip("ab", kinds, strict=True)]
        record("no_scheduler", key, run_group(cfg, key, "no scheduler", specs), nosched)
        if args.calibrate_out is not None and kinds == ("cuda", "render"):
            assert calibrate_gpu is not None
            try:
                if not all(k in solo and solo[k].ok for k in kinds) or not nosched[key].ok:
                    raise ContentionFileError("a run it needs failed")
                compute_kept, graphics_kept = kept_fractions(solo["cuda"], solo["render"], nosched[key])
                entry = make_entry(compute_kept, graphics_kept, command, render_iterations_used(cfg))
                contention_path = write_contention_file(args.calibrate_out, calibrate_gpu, entry)
            except (ContentionFileError, OSError) as exc:
                results["errors"].append(f"contention calibration not written: {exc}")
                progress.note(f"  -> contention calibration NOT written: {exc}")
            else:
                results["warnings"] += device_warnings(calibrate_gpu, [solo["cuda"], solo["render"], nosched[key]])
                verdict = scoring.contention_verdict(entry["compute_kept"], entry["graphics_kept"])
                results["contention"] = {"gpu": calibrate_gpu, "path": str(contention_path),
                                         "entry": entry, "verdict": verdict}
                progress.note(f"  -> contention: compute kept {entry['compute_kept']:.2f}, graphics kept "
                              f"{entry['graphics_kept']:.2f}: {verdict}; wrote {contention_path}")
            save(out, results)
    if args.calibrate_out is not None and "cuda+render" not in nosched:
        results["errors"].append("contention calibration not written: the no-scheduler cuda+render run did not run")
        save(out, results)

    if unisched_on and not args.overhead_only:
        for n, pair in enumerate(pairs):
            if skip(f"unisched: {pair.key}", pair.kinds, daemon=True):
                continue
            progress.step(f"unisched: {pair.key} (slice {cfg.slice_ms:g} ms){tag}")
            specs = [TenantSpec(f"{tag}-{k}", k, w) for tag, k, w in zip("ab", pair.kinds, pair.weights, strict=True)]
            daemon = Daemon(cfg, str(n), contention_path)
            outcome: GroupResult | None = None
            try:
                daemon.start()
                if contention_path is not None:
                    check_daemon_contention(daemon, results["contention"]["verdict"], pair.key,
                                            results["warnings"])
                outcome = run_group(cfg, pair.key, "unisched", specs, daemon, warmup=cfg.unisched_warmup,
                                    charges=True)
            except DaemonError as exc:
                daemon_failures += 1
                results["errors"].append(f"unisched: {pair.key}: {exc}")
                progress.note(f"  -> daemon FAILED: {str(exc).splitlines()[0]}")
            finally:
                daemon.stop()
                daemon.keep_log(out / DAEMON_LOGS / log_name(pair.key))
            if daemon.info.get("killed") or daemon.info.get("rc") not in (0, None):
                killed = " (killed after SIGTERM was ignored)" if daemon.info.get("killed") else ""
                results["warnings"].append(f"unisched: {pair.key}: daemon exit status "
                                           f"{daemon.info.get('rc')}{killed}")
            if outcome is None:
                results["unisched"][pair.key] = {"label": pair.key, "setup": "unisched", "ok": False,
                                                 "daemon": daemon.info}
                save(out, results)
                continue
            outcome.extra["daemon"] = daemon.info
            record("unisched", pair.key, outcome, shared)

    if unisched_on and args.overhead:
        for kind in solo_kinds(pairs):
            if kind not in solo or skip(f"unisched alone: {kind}", (kind,), daemon=True):
                continue
            progress.step(f"unisched alone: {kind} ({cfg.engine} engine)")
            daemon = Daemon(cfg, f"alone-{kind}", contention_path)
            try:
                daemon.start()
                group = run_group(cfg, kind, "unisched alone", [TenantSpec(f"o-{kind}", kind, 100)], daemon,
                                  warmup=cfg.warmup)
            except DaemonError as exc:
                results["errors"].append(f"unisched alone: {kind}: {exc}")
                continue
            finally:
                daemon.stop()
                daemon.keep_log(out / DAEMON_LOGS / log_name(f"alone-{kind}"))
            base, under = solo[kind].throughputs()[0], group.throughputs()[0]
            results["overhead"][kind] = {
                "alone": base, "alone_under_unisched": under,
                "loss": None if not base or under is None else 1.0 - under / base, "run": group.to_json(),
            }
            save(out, results)
            loss = results["overhead"][kind]["loss"]
            progress.note(f"  -> {kind}: alone {fmt(base, 1)}, under unisched {fmt(under, 1)}"
                          f" (loss {'n/a' if loss is None else f'{100 * loss:.1f}%'})")

    if args.solo_after:
        for kind in solo_kinds(pairs):
            if kind not in solo or skip(f"alone again: {kind}{tag}", (kind,)):
                continue
            progress.step(f"alone again: {kind}{tag}")
            record("solo_after", kind, run_group(cfg, f"{kind}-after", "alone after",
                                                 [TenantSpec(f"z-{kind}", kind, None)]), solo_after)
            drift = solo_drift(kind, solo, solo_after)
            if drift is not None and abs(drift) > SOLO_DRIFT_WARN:
                results["warnings"].append(f"alone {kind}: {100 * drift:+.0f}% from the run before to the run after "
                                           "the shared ones; normalized against their mean")
    save(out, results)
    return results


if __name__ == "__main__":
    sys.exit(main())
