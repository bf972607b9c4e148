#!/usr/bin/env python3
"""The online scenario on the real GPU: ResNet-50 requests beside ResNet-50 training, under every setup that applies.

ResNet-50 fp16 inference at --rate req/s with Poisson arrivals (online, examples/online_offline.py) next to
ResNet-50 training (offline, examples/02_pytorch_training.py): each alone, then side by side with no scheduler, MPS
(the trainer at 30% of the SMs), and unisched in preemptive mode under `unisched run` (kernel) and as clients (user);
batch 1, and batch 8 where contention bites harder. The online suite of bench/run.py runs it (kernel and user) once
per round. Results go to one folder: results.json (raw reports and derived numbers), results.md (the tables) and
plots/*.png (latencies). Batch sizes run in separate invocations into the same --out add up in results.json.

  python3 bench/scenarios.py --out /tmp/s --scenarios online --seconds 10 --dry-run
  python3 bench/scenarios.py --out DIR --scenarios online --online-batches 1,8 --online-setups kernel,user
  python3 bench/scenarios.py --out DIR --replot          # rebuild results.md and plots from results.json

Online rounds (--repeat): medians of each round's ratios (each against its own solo runs), and each setup's
requests pooled over the rounds into one p99 with its 90% interval (results.md: "Pooled").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "workloads"))
import gpu_pairs as gp
from _daemon import ROOT
from _results import save_json, utc_now
from online_report import online_line, summary, write_outputs
from online_scoring import INTERLEAVE_GUARD_S, ONLINE_SETUPS, derive_batch
from pairs_runs import Config, Daemon, DaemonError, Progress, TenantSpec, run_group

from unisched.enforce.mps import NvidiaMpsControl
from unisched.policy.mps import MPS_BELOW_NORMAL
from unisched.scheduler.config import DaemonConfig

EX = ROOT / "examples"

SCENARIOS = ("online",)
TRAIN_CMD = f"python3 {EX / '02_pytorch_training.py'} --model resnet50"  # batch 32: the example's default
DEFAULT_ONLINE_SETUPS = ("no-scheduler", "mps", "kernel", "user")
"""The setups beyond DEFAULT_ONLINE_SETUPS are probes, run only when named. They exist because a request that meets
a trainer step shares the GPU with it under time slicing and leases alike (a b32 step is ~25 ms of queued work, a
request ~6 ms): only MPS's SM dispatcher can put a request's kernels first.
  mps-priority       the trainer an MPS client of priority below normal (CUDA_MPS_CLIENT_PRIORITY=1), no thread cap;
                     drivers without client priorities ignore it (the MPS server's log is kept with the run)
  user-points        lease enforcement with the trainer pausing inside its steps (examples/02 --pause-every
                     PAUSE_EVERY), so a revoked step leaves a part of it, not its rest, beside the request
  user-mps           lease enforcement with both tenants MPS clients and the trainer below normal
  user-mps-cap       user-mps with the trainer also capped at USER_MPS_TRAINER_PERCENT of the SMs
  user-mps-daemon    the same made by the product: `unisched serve --mps`, offline tenants on 30% of the SMs
  user-mps-points    `serve --mps --mps-offline-sm-percent 100` with the trainer pausing inside its steps
  user-mps-daemon-N  serve --mps with offline tenants on N% of the SMs (N = 50, 60, 70, 80, 90)
  mps-alone          a reference: the online tenant alone as the only client of an MPS server, what MPS itself adds"""
PAUSE_EVERY = 8  # weight layers: ResNet-50 has 54, so ~7 points forward and ~7 backward, parts of ~2 ms at b32
MPS_TRAINER_PERCENT = 30
USER_MPS_TRAINER_PERCENT = 50


@dataclasses.dataclass(frozen=True)
class Options:
    out: Path
    seconds: float
    warmup: float
    unisched_warmup: float
    slice_ms: float
    rate: float
    online_batches: tuple[int, ...]
    work_dir: Path
    max_total: float
    dry_run: bool
    repeat: int = 1
    """Online scenario: rounds of all its setups (each with its own solo runs); medians and ranges are reported."""
    online_setups: tuple[str, ...] = tuple(ONLINE_SETUPS[n] for n in DEFAULT_ONLINE_SETUPS)
    offline_batch: int = 32
    """Online scenario: the trainer's batch (32, the examples'; 128 keeps the GPU busy: steps of GPU work, not launches)."""
    solo_seconds: float = 0.0
    """Online scenario: the two solo runs' window (0: --seconds). Interleaved runs are their own reference for the
    latency; the solo trainer run only gives the kept fraction, which needs far fewer seconds than a p99."""
    interleave_s: float = 0.0
    """Online scenario: > 0 pauses the offline tenant in every other period of this length in each shared run,
    and scores the requests that met it against those of the same run that did not (interleave.py)."""


# ----------------------------------------------------------------------------------------- helpers


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def mps_daemon(work: Path) -> Iterator[dict[str, str]]:
    """An MPS control daemon private to this run (the daemon's own control, unisched.enforce.mps); yields the
    environment its clients need. Always stopped; a start that fails raises MpsError (a RuntimeError)."""
    pipe, logs = work / "mps-pipe", work / "mps-log"
    control = NvidiaMpsControl(pipe, logs)
    control.start()
    try:
        yield {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    finally:
        control.stop()


def mps_log_tail(work: Path, limit: int = 4000) -> dict[str, str]:
    """The MPS control and server logs' ends: whether the server took the clients and their priorities."""
    logs = work / "mps-log"
    return {f.name: f.read_text(errors="replace")[-limit:] for f in sorted(logs.glob("*.log"))} if logs.is_dir() else {}


class Harness:
    """Runs the scenario, keeps results.json current after every step, and shows progress."""

    def __init__(self, opts: Options, scenarios: list[str]) -> None:
        self.opts = opts
        self.scenarios = scenarios
        self.progress = Progress(self.step_count(), name="scenarios")
        self.results = read_json(opts.out / "results.json") or {"scenarios": {}}
        self.results.setdefault("scenarios", {})
        self.results["meta"] = {
            "command": "python3 bench/scenarios.py " + shlex.join(sys.argv[1:]),
            "date_utc": utc_now(), "gpu": gp.gpu_name(),
            "seconds": opts.seconds, "warmup": opts.warmup, "unisched_warmup": opts.unisched_warmup,
            "slice_ms": opts.slice_ms,
        }

    def step_count(self) -> int:
        online = (2 + len(self.opts.online_setups)) * len(self.opts.online_batches) * self.opts.repeat
        return online if "online" in self.scenarios else 0

    def config(self, engine: str = "kernel") -> Config:
        o = self.opts
        cfg = gp.new_config(seconds=o.seconds, warmup=o.warmup, unisched_warmup=o.unisched_warmup, grace_s=20.0,
                            work_dir=o.work_dir, dry_run=o.dry_run, workload_cmd_cuda=None, workload_cmd_render=None,
                            slice_ms=o.slice_ms, prefix="scenarios-")
        return dataclasses.replace(cfg, engine=engine)

    def time_left(self) -> float:
        return self.opts.max_total - self.progress.elapsed()

    def save(self, scenario: str, data: dict[str, Any]) -> None:
        prev = self.results["scenarios"].get(scenario)
        if scenario == "online" and prev is not None:  # batch sizes run in separate invocations add up
            data["batches"] = {**prev.get("batches", {}), **data["batches"]}
        self.results["scenarios"][scenario] = data
        data["date_utc"] = self.results["meta"]["date_utc"]
        data["command"] = self.results["meta"]["command"]
        self.opts.out.mkdir(parents=True, exist_ok=True)
        save_json(self.opts.out / "results.json", self.results)

    # ----------------------------------------------------------------------------------- online

    def online(self) -> dict[str, Any]:
        data: dict[str, Any] = {"rate": self.opts.rate, "batches": {}}
        repeat = self.opts.repeat
        for batch in self.opts.online_batches:
            # round 1's runs at the top (as without --repeat), the others under "more_rounds"
            runs: dict[str, Any] = {}
            data["batches"][str(batch)] = runs
            rounds: list[dict[str, Any]] = [runs]
            for k in range(repeat):
                if k:
                    rounds.append({})
                    runs["more_rounds"] = rounds[1:]
                for setup in ("alone-online", "alone-offline", *self.opts.online_setups):
                    self.progress.step(f"online: batch {batch}, {setup}" + (f", round {k + 1}/{repeat}" if repeat > 1 else ""))
                    if self.opts.dry_run:
                        continue
                    if self.time_left() < self.opts.seconds + self.opts.unisched_warmup + 20:
                        rounds[k][setup] = {"error": "skipped: would overrun --max-total"}
                        continue
                    try:
                        rounds[k][setup] = self.online_run(batch, setup)
                    except (RuntimeError, DaemonError, OSError) as e:
                        rounds[k][setup] = {"error": str(e)}
                    self.save("online", data)
                    self.progress.note(f"  -> {online_line(rounds[k][setup])}")
            derive_batch(runs)
            self.save("online", data)
        return data

    def online_run(self, batch: int, setup: str) -> dict[str, Any]:
        engine = "user" if setup.startswith("unisched user") else "kernel"
        cfg = self.config(engine)
        if setup in ("alone-online", "alone-offline") and self.opts.solo_seconds > 0:
            cfg = dataclasses.replace(cfg, seconds=self.opts.solo_seconds)
        pausers = (ONLINE_SETUPS["user-points"], ONLINE_SETUPS["user-mps-points"])
        pausing = ["--pause-every", str(PAUSE_EVERY)] if setup in pausers else []
        cfg = dataclasses.replace(cfg, workload_cmd={
            "online": [sys.executable, str(EX / "online_offline.py"), "--batch", str(batch), "--rate", f"{self.opts.rate:g}"],
            "offline": [*shlex.split(TRAIN_CMD), "--batch", str(self.opts.offline_batch), *pausing,
                        *(["--pausable"] if self.opts.interleave_s > 0 else [])],
        })
        under = setup.startswith("unisched")
        weight = 100.0 if under else None
        online = TenantSpec("online", "online", weight, "online" if under else None)
        offline = TenantSpec("offline", "offline", weight, "offline" if under else None)
        label = f"b{batch}-{re.sub(r'[^A-Za-z0-9]+', '-', setup)}"
        alternate = ("offline", self.opts.interleave_s, INTERLEAVE_GUARD_S) if self.opts.interleave_s > 0 else None
        if setup == "alone-online":
            group = run_group(cfg, label, "alone", [online])
        elif setup == "alone-offline":
            group = run_group(cfg, label, "alone", [offline])
        elif setup == "no scheduler":
            group = run_group(cfg, label, "no scheduler", [online, offline], alternate=alternate)
        elif setup == ONLINE_SETUPS["mps-alone"]:
            with mps_daemon(cfg.work_dir / label) as client_env:
                group = run_group(cfg, label, setup, [dataclasses.replace(online, env=tuple(client_env.items()))])
            group.extra["mps_log"] = mps_log_tail(cfg.work_dir / label)
        else:
            mps = "MPS" in setup  # the harness's own MPS control daemon and client settings
            serve_args = serve_args_for(setup)
            with contextlib.ExitStack() as stack:
                if mps:  # the trainer capped (MPS) or below normal priority (the others)
                    pairs = tuple(stack.enter_context(mps_daemon(cfg.work_dir / label)).items())
                    capped = {"MPS": MPS_TRAINER_PERCENT, ONLINE_SETUPS["user-mps-cap"]: USER_MPS_TRAINER_PERCENT}
                    below = () if setup == "MPS" else (("CUDA_MPS_CLIENT_PRIORITY", str(MPS_BELOW_NORMAL)),)
                    cap = (("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(capped[setup])),) if setup in capped else ()
                    trainer_env = (*pairs, *below, *cap)
                    online = dataclasses.replace(online, env=pairs)
                    offline = dataclasses.replace(offline, env=trainer_env)
                if under:
                    daemon = Daemon(cfg, label, serve_args=serve_args)
                    try:
                        daemon.start()
                        group = run_group(cfg, label, setup, [online, offline], daemon, warmup=cfg.unisched_warmup,
                                             alternate=alternate)
                    finally:
                        daemon.stop()
                    group.extra["daemon"] = daemon.info
                    if "--mps" in serve_args:
                        group.extra["mps_log"] = mps_log_tail(daemon.state_dir)
                else:
                    group = run_group(cfg, label, setup, [online, offline], alternate=alternate)
            if mps:
                group.extra["mps_log"] = mps_log_tail(cfg.work_dir / label)
        return group.to_json()

# ------------------------------------------------------------------------------------ derived numbers


DAEMON_SM_PERCENT = {ONLINE_SETUPS["user-mps-daemon"]: 30, ONLINE_SETUPS["user-mps-points"]: 100,
                     **{label: int(name.rsplit("-", 1)[1]) for name, label in ONLINE_SETUPS.items()
                        if re.fullmatch(r"user-mps-daemon-\d+", name)}}
"""The setups that run `unisched serve --mps`, each with its --mps-offline-sm-percent, always given: user-mps-daemon
keeps 30% of the SMs for offline tenants, so that its runs compare with those made so (the daemon's default is 70)."""


def serve_args_for(setup: str) -> tuple[str, ...]:
    """The daemon's arguments for a unisched setup: preemptive mode, and its own MPS for the --mps setups."""
    if setup not in DAEMON_SM_PERCENT:
        return ("--mode", "preemptive")
    return ("--mode", "preemptive", "--mps", "--mps-offline-sm-percent", str(DAEMON_SM_PERCENT[setup]))


# ------------------------------------------------------------------------------------------- output


# -------------------------------------------------------------------------------------------- plots


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results folder (results.json is merged into)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help="online, the one scenario (the option stays so that recorded command lines run as they are)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window per run (default 15)")
    ap.add_argument("--warmup", type=float, default=8.0, help="warm-up before the window, no scheduler (default 8)")
    ap.add_argument("--unisched-warmup", type=float, default=15.0, help="warm-up under unisched (default 15)")
    ap.add_argument("--slice-ms", type=float, default=DaemonConfig().slice_ms,
                    help="unisched serve --slice-ms (default: the daemon's, %(default)g)")
    ap.add_argument("--rate", type=float, default=20.0, help="online requests per second (default 20)")
    ap.add_argument("--online-batches", default="1,8", help="online request batch sizes (default 1,8)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="online scenario: run all its setups (solo runs included) this many rounds and report "
                         "medians with ranges (default 1)")
    ap.add_argument("--online-setups", default=",".join(DEFAULT_ONLINE_SETUPS),
                    help=f"online scenario: which of {', '.join(ONLINE_SETUPS)} run beside the two solo runs (default "
                         f"{','.join(DEFAULT_ONLINE_SETUPS)}; mps-priority: the trainer an MPS client of priority below "
                         "normal, no thread cap; user-points: lease enforcement, the trainer pausing inside steps; "
                         "user-mps: lease enforcement with mps-priority's MPS; user-mps-cap: user-mps with the trainer capped at "
                         f"{USER_MPS_TRAINER_PERCENT}%% of the SMs; user-mps-daemon: unisched serve --mps, "
                         "offline tenants on 30%% of the SMs; "
                         "user-mps-points: serve --mps with no cap and the trainer pausing inside steps; "
                         "user-mps-daemon-N: serve --mps with offline tenants on N%% of the SMs; mps-alone: "
                         "the online tenant alone as an MPS client, a reference); "
                         "fewer setups leave time for longer "
                         "windows, which a p99 needs")
    ap.add_argument("--interleave", type=float, default=0.0, metavar="S",
                    help="online scenario: stop the offline tenant in every other period of S seconds of each shared "
                         "run (it idles between steps, examples/02 --pausable) and score the requests that met it against those "
                         "of the same run "
                         "that did not, so the host's drift between runs falls on both sides (default 0: off)")
    ap.add_argument("--offline-batch", type=int, default=32, metavar="N",
                    help="online scenario: the trainer's batch (default 32; 128 keeps the GPU busier, where contention "
                         "bites harder)")
    ap.add_argument("--solo-seconds", type=float, default=0.0, metavar="S",
                    help="online scenario: the solo runs' window (default 0: --seconds); with --interleave the shared "
                         "runs carry their own latency reference, and the solo trainer needs less time for its rate")
    ap.add_argument("--max-total", type=float, default=570.0,
                    help="skip steps that would end later than this many seconds after the start (default 570: one "
                         "device call)")
    ap.add_argument("--work-dir", type=Path, default=None, help="logs and raw reports (default: a temp folder)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--replot", action="store_true", help="only rebuild results.md and plots from --out/results.json")
    args = ap.parse_args(argv)
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenario_list if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenario {', '.join(bad)}: choose from {', '.join(SCENARIOS)}")
    if args.seconds <= 0 or args.warmup < 0 or args.unisched_warmup < 0 or args.rate <= 0:
        ap.error("--seconds and --rate must be positive, warm-ups not negative")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.interleave < 0 or 0 < args.interleave <= 2 * INTERLEAVE_GUARD_S:
        ap.error(f"--interleave: a period over {2 * INTERLEAVE_GUARD_S:g} s (the guards at its ends), or 0 for off")
    if args.offline_batch < 1:
        ap.error("--offline-batch must be at least 1")
    if args.solo_seconds < 0:
        ap.error("--solo-seconds must be positive, or 0 for --seconds")
    names = [n.strip() for n in args.online_setups.split(",") if n.strip()]
    bad = [n for n in names if n not in ONLINE_SETUPS]
    if bad or not names:
        ap.error(f"--online-setups: choose from {', '.join(ONLINE_SETUPS)}; got {args.online_setups!r}")
    args.online_setup_list = tuple(ONLINE_SETUPS[n] for n in ONLINE_SETUPS if n in names)
    try:
        args.batch_list = tuple(int(b) for b in args.online_batches.split(","))
    except ValueError:
        ap.error("--online-batches: comma-separated integers, e.g. 1,8")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        results = read_json(args.out / "results.json")
        if results is None:
            print(f"scenarios: error: no readable {args.out / 'results.json'}", file=sys.stderr)
            return 2
        for runs in ((results.get("scenarios") or {}).get("online") or {}).get("batches", {}).values():
            derive_batch(runs)
        made = write_outputs(results, args.out)
        print(summary(results))
        print(f"wrote {args.out / 'results.md'} and {len(made)} plots")
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="scenarios-"))
    opts = Options(out=args.out, seconds=args.seconds, warmup=args.warmup, unisched_warmup=args.unisched_warmup,
                   slice_ms=args.slice_ms, rate=args.rate, online_batches=args.batch_list,
                   work_dir=work,
                   max_total=args.max_total, dry_run=args.dry_run, repeat=args.repeat,
                   online_setups=args.online_setup_list, interleave_s=args.interleave, solo_seconds=args.solo_seconds,
                   offline_batch=args.offline_batch)
    h = Harness(opts, args.scenario_list)
    h.progress.note(f"plan: {', '.join(args.scenario_list)}; window {args.seconds:g} s; work dir {work}")
    for name in args.scenario_list:
        data = getattr(h, name)()
        if not args.dry_run:
            h.save(name, data)
    if args.dry_run:
        return 0
    made = write_outputs(h.results, args.out)
    print(summary(h.results))
    h.progress.note(f"done: {args.out / 'results.md'}, {len(made)} plots in {args.out / 'plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
