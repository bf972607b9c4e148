#!/usr/bin/env python3
"""One runner for every benchmark suite: rounds, every round kept, verdicts computed by code.

  python3 bench/run.py --list                          what each suite measures, its targets, about how long
  python3 bench/run.py SUITE [--rounds N] [--out DIR]  run it; results in DIR/SUITE/ (summary.json, report.md)
  python3 bench/run.py SUITE --dry-run                 the commands of a round, nothing run
  python3 bench/run.py SUITE --cpu-standin             where the suite has them: CPU stand-ins, no GPU
  python3 bench/run.py SUITE -- --seconds 20           words after `--` go to every command of a round
  python3 bench/run.py SUITE --serve-arg=--slice-ms=10  every daemon the runner starts gets that setting: a variant,
                                                       kept out of the generated tables (where a suite's scripts
                                                       start their daemons, their own flags go after `--`)
  python3 bench/run.py A B --budget 540                several suites one after another, one time budget for all
  python3 bench/run.py SUITE --rescore --out DIR      judge DIR/SUITE's rounds again by the current targets
  python3 bench/run.py SUITE --out DIR --add-rounds OTHER --why TEXT   OTHER/SUITE's rounds (another run of the same
                                                       command, machine and commit) appended to DIR/SUITE's, said so
  python3 bench/run.py SUITE --compare DIR DIR...      one suite's runs side by side (variants): every target's value
                                                       and verdict, and every metric's median, per run (its
                                                       links are relative to where it runs)
  python3 bench/run.py --table                         the README's results table, from the latest summaries
  python3 bench/run.py --update-readme README.md       write that table between the README's markers
  python3 bench/run.py --update-results docs/results.md  write the results page (the table and every verdict of
                                                       each suite's latest run) between that page's markers

DIR defaults to bench/results/<date>-<gpu>-<commit>/. A round runs the suite's command(s) once, each with its own
alone / no-scheduler references where the suite has them; rounds already in DIR/SUITE/summary.json (an earlier call
with the same --out, on the same commit) are kept and count towards --rounds, so a suite longer than one device call
runs as several calls. --budget S stops before a round that would end more than S seconds after the start (a round
as long as the longest one already in DIR/SUITE, else the longest of the newest earlier run of the suite on the same
GPUs and drivers, else the suite's estimate); with several suites it is one budget:
each suite runs its rounds in turn while they fit, so a fixed slot of GPU time is filled by one command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance as pv
import summary as sm
from _daemon import ROOT, bench_env, start_daemon, stop_daemon
from _results import utc_now
from records import add_rounds, cut_short, publish, rescore, unlike
from suites import BY_NAME, SUITES, Step, Suite


def list_suites() -> str:
    out = []
    for s in SUITES:
        need = "needs an NVIDIA GPU" + ("; --cpu-standin runs CPU stand-ins" if s.standin else "") if s.needs_gpu \
            else "CPU only"
        out += [f"{s.name}: {s.measures}", f"  about {s.round_minutes:g} min a round on the H200, at least "
                f"{s.rounds} rounds; {need}"]
        out += [f"  target: {t.text}" for t in s.targets] or ["  target: none (reported as measured)"]
        out.append("")
    return "\n".join(out)


class Stopped(Exception):
    """SIGTERM or SIGINT (a time limit ran out): the step running is ended, what is done is written, then exit."""


_held: list[str] | None = None
"""While held_stops holds: the stop signals that came meanwhile."""


def _stop(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    if _held is not None:
        _held.append(name)
        return
    raise Stopped(name)


@contextlib.contextmanager
def held_stops() -> Iterator[None]:
    """A stop that comes while a child is being started is raised once the runner holds the child: raised inside
    Popen (after the fork, before it returns) or inside a daemon's start-up, it would leave the child, and all it
    starts, running on after the runner has gone."""
    global _held
    _held = []
    try:
        yield
    finally:
        came, _held = _held, None
    if came:
        raise Stopped(came[0])


def has_gpu() -> bool:
    return bool(pv.gpus())


def expand(step: Step, out: Path, sock: str | None, extra: list[str]) -> list[str]:
    """A step's words with {py}, {out} and {socket} filled in, and the words after `--` appended."""
    fill = {"{py}": sys.executable, "{out}": str(out), "{socket}": sock or "{socket}"}
    argv = []
    for word in step.argv:
        for key, value in fill.items():
            word = word.replace(key, value)
        argv.append(word)
    return [*argv, *extra]


def run_step(step: Step, folder: Path, extra: list[str], log_to: Path, serve_args: tuple[str, ...] = ()
             ) -> dict[str, Any]:
    """One command, with a fresh daemon when it asks for one (`serve_args` added to its own); its output to
    folder/step.log."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    daemon: subprocess.Popen[bytes] | None = None
    proc: subprocess.Popen[bytes] | None = None
    work, sock, rc = None, None, None
    try:
        if step.serve is not None:
            work = Path(tempfile.mkdtemp(prefix=f"run-{step.name}-"))
            with held_stops():
                daemon, sock = start_daemon(work, *step.serve, *serve_args)
        argv = expand(step, folder, sock, extra)
        with (log_to / f"{step.name}.log").open("wb") as log:
            try:
                # a session of its own: the step and everything it starts end together (end_group), on its time
                # limit or when the runner is stopped, and no workload is left running into the next step
                with held_stops():
                    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=bench_env(),
                                            start_new_session=True)
                rc = proc.wait(timeout=step.timeout_s)
            except subprocess.TimeoutExpired:
                rc = None  # over its time limit: recorded as such, and ended below
            finally:
                if proc is not None:
                    end_group(proc)
    finally:
        if daemon is not None and work is not None:
            stop_daemon(daemon, work)
            shutil.copy(work / "daemon.log", log_to / f"{step.name}-daemon.log")
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return {"name": step.name, "argv": argv, "rc": rc, "wall_s": round(time.monotonic() - t0, 1)}


def end_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """End a step's process group: SIGTERM (a daemon thaws what it froze), then SIGKILL to what is left after
    `grace_s`. Waits until the group is gone or the grace ran out, reaping the leader on the way."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is gone: nothing of the step runs
        deadline = time.monotonic() + grace_s
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_round(suite: Suite, steps: tuple[Step, ...], k: int, folder: Path, extra: list[str],
              serve_args: tuple[str, ...] = ()) -> dict[str, Any]:
    raw = folder / sm.RAW / f"round-{k}"
    if raw.exists():
        shutil.rmtree(raw)  # a round cut short earlier: it is run again whole
    raw.mkdir(parents=True)
    date = utc_now()
    ran = []
    for step in steps:
        print(f"run {suite.name}: round {k}: {step.name}", file=sys.stderr, flush=True)
        ran.append(run_step(step, raw / step.name, extra, raw, serve_args))
    cases, notes = suite.read(raw)
    return {"round": k, "date_utc": date, "steps": ran, "cases": cases, "notes": notes}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", nargs="*", help="the suites to run, one after another (see --list)")
    ap.add_argument("--list", action="store_true", help="what each suite measures, its targets, how long it takes")
    ap.add_argument("--rounds", type=int, default=None, help="rounds in the folder at the end (default: the suite's least)")
    ap.add_argument("--out", type=Path, default=None, help="the run folder (default bench/results/<date>-<gpu>-<commit>)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of a round and the time, run nothing")
    ap.add_argument("--cpu-standin", action="store_true", help="run the suite's CPU stand-ins (no GPU; not a result)")
    ap.add_argument("--commit", default=None, metavar="SHA",
                    help="the commit measured, where the tree has no git metadata (a copy on the GPU machine)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="WORD",
                    help="one more `unisched serve` argument for every daemon the runner starts (repeatable, e.g. "
                         "--serve-arg=--slice-ms=10): a variant of the suite, recorded in its summary, kept out of the "
                         "generated tables, and in a folder of its own by default. Suites whose scripts start their "
                         "own daemons take their scripts' flags after `--` instead")
    ap.add_argument("--budget", type=float, default=None, metavar="S",
                    help="start no round that would end after S seconds from the start (a round as long as the longest "
                         "one already in --out, else the longest of the newest earlier run of the suite on the same "
                         "GPUs and drivers, else the suite's estimate; with several suites, one budget for all)")
    ap.add_argument("--rescore", action="store_true",
                    help="judge the rounds already in --out/SUITE again by the current targets, running nothing: each "
                         "round's outputs are read again by the suite's current reader where the raw archive holds "
                         "them, and the summary says when and at which commit it was rescored")
    ap.add_argument("--add-rounds", type=Path, default=None, metavar="OTHER",
                    help="append OTHER/SUITE's rounds to --out/SUITE's, running nothing: another run of the same command "
                         "on the same machine and commit (e.g. a call that started without the folder's earlier rounds); "
                         "every round of both is kept and the report says which rounds came from where and --why")
    ap.add_argument("--why", default=None, help="with --add-rounds: why the rounds were measured by another run")
    ap.add_argument("--compare", type=Path, nargs="+", default=None, metavar="DIR",
                    help="print the named suite's runs in these run folders side by side (each DIR/SUITE/summary.json): "
                         "every target's value and verdict, and every metric's median, per run; runs nothing")
    ap.add_argument("--table", action="store_true", help="print the README's results table")
    ap.add_argument("--stale", action="store_true",
                    help="for each suite's run in the table, whether the code it measured is this checkout's, and "
                         "if not, which code files changed since its commit; runs nothing")
    ap.add_argument("--update-readme", type=Path, default=None, metavar="FILE",
                    help="write the results table between FILE's markers")
    ap.add_argument("--update-results", type=Path, default=None, metavar="FILE",
                    help="write the results page (the table, then every verdict of each suite's latest run) between "
                         "FILE's markers")
    args = ap.parse_args(argv)
    unknown = [x for x in args.suite if x not in BY_NAME]
    if unknown:
        ap.error(f"no suite {', '.join(unknown)} (the suites: {', '.join(s.name for s in SUITES)})")
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.compare and len(args.suite) != 1:
        ap.error("--compare needs one suite: the runs of which to set side by side")
    if args.rescore and (args.out is None or not args.suite):
        ap.error("--rescore needs the suites and the --out folder that holds their rounds")
    if args.add_rounds is not None and (args.out is None or len(args.suite) != 1 or not args.why):
        ap.error("--add-rounds needs one suite, the --out folder to add to, and --why")
    if not (args.list or args.table or args.stale or args.update_readme or args.update_results or args.suite):
        ap.error("name a suite, or --list, --table, --stale, --update-readme or --update-results")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parse_args(argv)
    args.argv = argv
    if args.list:
        print(list_suites(), end="")
        return 0
    if args.table:
        print(sm.results_table(), end="")
        return 0
    if args.stale:
        print(stale(sm.latest(), pv.code_changed_since), end="")
        return 0
    if args.compare:
        return compare(args.suite[0], args.compare)
    for path, make in ((args.update_readme, sm.results_table), (args.update_results, sm.results_page)):
        if path is None:
            continue
        text = path.read_text()
        if sm.readme_table(text) is None:
            print(f"run.py: {path} has no {sm.README_BEGIN} ... {sm.README_END} markers", file=sys.stderr)
            return 2
        path.write_text(sm.with_table(text, make(link_from=path.resolve().parent)))
    if args.update_readme is not None or args.update_results is not None:
        return 0
    args.t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        return max(run_suite(BY_NAME[name], args, extra) for name in args.suite)
    except Stopped:
        return 128 + signal.SIGTERM


def run_suite(suite: Suite, args: argparse.Namespace, extra: list[str]) -> int:
    if args.cpu_standin and suite.standin is None:
        print(f"run.py: suite {suite.name} has no CPU stand-ins", file=sys.stderr)
        return 2
    if args.rescore:
        return rescore(suite, args.out / suite.name, args.argv)
    if args.add_rounds is not None:
        return add_rounds(suite, args.out / suite.name, args.add_rounds / suite.name, args.why)
    steps = suite.standin if args.cpu_standin and suite.standin else suite.steps
    serve_args = tuple(args.serve_arg)
    if serve_args and all(step.serve is None for step in steps):
        print(f"run.py: suite {suite.name}'s scripts start their own daemons, so --serve-arg would change nothing: "
              "give their flags after `--` (bench/README.md)", file=sys.stderr)
        return 2
    rounds = args.rounds or suite.rounds
    if args.dry_run:
        print(f"{suite.name}: {rounds} rounds, about {rounds * suite.round_minutes:g} min on the H200"
              + (" (CPU stand-ins)" if args.cpu_standin else "") + "; each round runs:")
        for step in steps:
            daemon = "" if step.serve is None else \
                f" (under a fresh `{shlex.join(['unisched', 'serve', *step.serve, *serve_args])}`)"
            print(f"  {shlex.join(expand(step, Path('RAW') / step.name, 'SOCKET', extra))}{daemon}")
        return 0
    if suite.needs_gpu and not args.cpu_standin and not has_gpu():
        hint = "; `--cpu-standin` runs its CPU stand-ins" if suite.standin else ""
        print(f"run.py: suite {suite.name} needs an NVIDIA GPU (nvidia-smi lists none){hint}", file=sys.stderr)
        return 2
    mach, head = pv.machine(), pv.commit()
    if args.commit:
        head = {"commit": args.commit, "dirty": None}
    elif head["commit"] == "unknown":
        print("run.py: no git metadata here: name the commit measured with --commit SHA", file=sys.stderr)
        return 2
    folder = (args.out or sm.run_folder(mach, head, args.cpu_standin, serve_args=serve_args)) / suite.name
    before = sm.load(folder)
    command = shlex.join(["python3", "bench/run.py", *args.argv])
    call = {"command": command, "date_utc": utc_now(), "host": mach["host"], "cpu": mach["cpu"],
            "kernel": mach["kernel"]}
    meta = {"command": command, "machine": mach, **head, "code": pv.code_hash(), "standin": args.cpu_standin,
            "serve_args": list(serve_args), "date_utc": call["date_utc"]}
    if before is not None and (why := unlike(before, meta)):
        print(f"run.py: {folder} holds rounds {why}: give another --out (bench/README.md)", file=sys.stderr)
        return 2
    done: list[dict[str, Any]] = list(before["rounds"]) if before else []
    sm.unpack_raw(folder)
    if before is not None:  # the first call's command and date stand for the run; each round names its own call
        meta.update({k: before[k] for k in ("command", "date_utc", "merged", "rescored", "aborted") if before.get(k)})
        meta.update(cut_short(before))
    cut: int | None = None  # the round under way, while one is
    try:
        while len(done) < rounds:
            if args.budget is not None and (time.monotonic() - args.t0
                                            + round_seconds(suite, done, mach, args.cpu_standin) > args.budget):
                print(f"run {suite.name}: round {len(done) + 1} would end after --budget {args.budget:g} s: stopping "
                      f"({len(done)} of {rounds} rounds; run again with the same --out to go on)", file=sys.stderr)
                break
            k = len(done) + 1
            # written before the round starts: a call killed in it leaves this behind, and the next call records it
            sm.write(folder, sm.build(suite, done, {**meta, "in_progress": {"round": k, "date_utc": utc_now(),
                                                                              "call": call}}))
            cut = k
            measured = {**run_round(suite, steps, k, folder, extra, serve_args), "call": call}
            cut = None
            done.append(measured)
            sm.write(folder, sm.build(suite, done, meta))
    except Stopped:  # the round cut short is not in the record (run again, it runs whole), but the attempt is
        if cut is None:  # between two rounds: none was cut short
            print(f"run {suite.name}: stopped by a signal after round {len(done)}", file=sys.stderr)
        else:
            print(f"run {suite.name}: stopped by a signal in round {cut}", file=sys.stderr)
            meta["aborted"] = [*meta.get("aborted", []), {"round": cut, "call": call,
                                                          "why": "stopped by a signal while it ran"}]
        finish(suite, folder, done, meta)
        raise
    if not done and before is None:  # nothing ran, and nothing was written
        return 0
    return finish(suite, folder, done, meta)


def stale(runs: dict[str, tuple[Path, dict[str, Any]]], changed: Callable[[str], list[str] | None],
          shown: int = 5) -> str:
    """Per suite, whether the run the table shows measured this checkout's code: the table names each run's commit,
    not whether the code has moved on since (`changed`: the code files that differ from a commit, None: unknown)."""
    out = []
    for suite in SUITES:
        if suite.name not in runs:
            out.append(f"{suite.name}: no run")
            continue
        folder, s = runs[suite.name]
        files = changed(str(s.get("commit") or "")) if s.get("commit") else None
        head = f"{suite.name}: {folder.parent.name} ({len(s['rounds'])} rounds)"
        if files is None:
            out.append(f"{head}: its commit is not in this checkout's git history, so whether its code is this one's "
                       "is unknown")
        elif not files:
            out.append(f"{head}: the code it measured is this checkout's")
        else:
            by_dir = {d: [f for f in files if f.startswith(f"{d}/")] for d in pv.CODE_DIRS}
            counts = ", ".join(f"{d}/ {len(fs)}" for d, fs in by_dir.items() if fs)
            first = sorted(files, key=lambda f: (not f.startswith("unisched/"), f))[:shown]
            more = f" and {len(files) - shown} more" if len(files) > shown else ""
            out.append(f"{head}: code files changed since ({counts}): {', '.join(first)}{more}")
    return "\n".join(out) + "\n"


def compare(name: str, folders: list[Path]) -> int:
    runs = [(folder.resolve() / name, sm.load(folder / name)) for folder in folders]
    missing = [str(folder) for folder, s in runs if s is None]
    if missing:
        print(f"run.py: no {name} summary in {', '.join(missing)}", file=sys.stderr)
        return 2
    # links relative to where it is run: run it from the folder the table is pasted into
    print(sm.compare_table([(folder, s) for folder, s in runs if s is not None], link_from=Path.cwd()), end="")
    return 0


def round_seconds(suite: Suite, done: list[dict[str, Any]], machine: dict[str, Any] | None = None,
                  standin: bool = False, results: Path | None = None) -> float:
    """How long the next round should take: the longest round this folder holds, else the longest round of the
    newest earlier run of the suite on the same GPUs and drivers (`machine`; CPU stand-ins apart), else the suite's
    estimate (made on the H200).

    The estimate is for planning; a round measured on the machine at hand says more, so a budget fits every round
    it can."""
    measured = _longest_round(done)
    if measured is None and machine is not None:
        earlier = [s for s in map(sm.load, sorted((results or sm.RESULTS).glob(f"*/{suite.name}")))
                   if s is not None and bool(s.get("standin")) == standin
                   and sm.gpu_names(s.get("machine") or {}) == sm.gpu_names(machine)]
        if earlier:
            measured = _longest_round(max(earlier, key=lambda s: str(s.get("date_utc"))).get("rounds") or [])
    return measured if measured is not None else 60 * suite.round_minutes


def _longest_round(rounds: list[dict[str, Any]]) -> float | None:
    """The wall time of the longest of `rounds` (the sum of its steps'); None when none was measured."""
    walls = [sum(float(step.get("wall_s") or 0) for step in r.get("steps") or []) for r in rounds]
    return max(walls) if walls and max(walls) > 0 else None


def finish(suite: Suite, folder: Path, done: list[dict[str, Any]], meta: dict[str, Any]) -> int:
    """The summary of the rounds done, their raw outputs archived, the plots and the verdicts printed."""
    raw_round = folder / sm.RAW / f"round-{len(done) + 1}"
    if raw_round.exists():
        shutil.rmtree(raw_round)  # a round cut short: not part of the record
    result = sm.build(suite, done, meta)
    result["raw"] = sm.archive_raw(folder)
    return publish(suite, folder, result, "")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
