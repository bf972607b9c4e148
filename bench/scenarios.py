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
import os
import re
import shlex
import statistics
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "workloads"))
import gpu_pairs as gp
import scoring
from _results import save_json, save_plot, utc_now, write_atomic
from _window import latency_summary, percentile
from interleave import PAUSED, RUNNING, Alternation, Block, paired_bootstrap, period_pairs, running_rate, split_latencies
from pairs_report import fmt
from pairs_runs import Config, Daemon, DaemonError, Progress, TenantSpec, run_group

from unisched.enforce.mps import NvidiaMpsControl
from unisched.policy.mps import MPS_BELOW_NORMAL

ROOT = gp.ROOT
EX = ROOT / "examples"

SCENARIOS = ("online",)
TRAIN_CMD = f"python3 {EX / '02_pytorch_training.py'} --model resnet50"  # batch 32: the example's default
ONLINE_SETUPS = {"no-scheduler": "no scheduler", "mps": "MPS", "mps-priority": "MPS, trainer below normal",
                 "kernel": "unisched kernel", "user": "unisched user",
                 "user-points": "unisched user, trainer pausing", "user-mps": "unisched user, MPS, trainer below normal",
                 "user-mps-cap": "unisched user, MPS, trainer below normal and capped",
                 "user-mps-daemon": "unisched user, --mps",
                 "user-mps-points": "unisched user, --mps, trainer pausing, uncapped",
                 **{f"user-mps-daemon-{p}": f"unisched user, --mps, offline at {p}%" for p in (50, 60, 70, 80, 90)},
                 "mps-alone": "online alone, MPS client"}
"""--online-setups names -> the setups beside the two solo runs (alone-online, alone-offline), which always run."""
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
ONLINE_P99_TARGET = 1.05  # x alone
OFFLINE_KEPT_TARGET = 0.80  # of solo
MPS_TRAINER_PERCENT = 30
INTERLEAVE_GUARD_S = 0.1
"""With --interleave: requests this close to a switch count for neither phase (interleave.py)."""
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


def pair_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYOPENGL_PLATFORM", "egl")
    return env


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


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


def tenant(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    for t in run.get("tenants", []):
        if t.get("name") == name:
            report: dict[str, Any] | None = t.get("report")
            return report
    return None


def met_partner(run: dict[str, Any]) -> tuple[dict[str, Any], float | None, list[float] | None, list[float] | None]:
    """The online tenant's latency summary, the offline throughput, and the requests' latencies (ms), over the
    seconds both tenants ran, where one started late (scoring.common_window; the window used is returned last):
    requests answered before the trainer's first step met no trainer, and a trainer alone is faster. Otherwise the
    reports' own figures."""
    on, off = tenant(run, "online") or {}, tenant(run, "offline") or {}
    latencies = on.get("latencies_ms")
    tls = [(r.get("window") or {}).get("timeline") or [] for r in (on, off)]
    window = scoring.common_window(tls)
    if window is None:
        return on.get("latency_ms") or {}, off.get("throughput"), latencies, None
    (offline_tp,) = scoring.rates_over([tls[1]], window)
    arrivals = on.get("arrivals_s")
    if not latencies or not arrivals:
        return on.get("latency_ms") or {}, offline_tp, latencies, list(window)
    kept = [ms for at, ms in zip(arrivals, latencies, strict=False) if window[0] <= at <= window[1]]
    return latency_summary(kept), offline_tp, kept, list(window)


def derive_batch(runs: dict[str, Any]) -> None:
    """(Re)derive one online batch size's verdicts from its raw runs, every round: at the end of a run, and on
    --replot, so a scoring change reaches committed results."""
    rounds = [runs, *runs.get("more_rounds", [])]
    each = [derive_online(r) for r in rounds]
    runs["derived"] = {**combine_online(each), "pooled": pool_online(rounds), "per_round": each}


def derive_online(runs: dict[str, Any]) -> dict[str, Any]:
    """Online p99 against alone, offline throughput kept against solo, and the target verdict, per setup."""
    alone = tenant(runs.get("alone-online", {}), "online") or {}
    solo = tenant(runs.get("alone-offline", {}), "offline") or {}
    base_p99 = (alone.get("latency_ms") or {}).get("p99")
    base_tp = solo.get("throughput")
    base_lat = alone.get("latency_ms") or {}
    base_p50 = base_lat.get("p50")
    out: dict[str, Any] = {"alone_p99_ms": base_p99, "alone_p50_ms": base_p50, "offline_solo": base_tp, "setups": {}}
    for setup in (s for s in ONLINE_SETUPS.values() if s in runs):
        run = runs.get(setup) or {}
        on = tenant(run, "online") or {}
        lat, offline_tp, _, window = met_partner(run)
        ref, ref_p50, ref_p99 = base_lat, base_p50, base_p99
        inter = interleaved(run)
        if inter is not None:  # against the paused periods of the same run, the trainer over its running periods
            lat, ref, offline_tp = inter["running"], inter["paused"], inter["offline_running_tp"]
            ref_p50, ref_p99 = ref.get("p50"), ref.get("p99")
            inter["running_p99_x_alone_run"] = ratio(lat.get("p99"), base_p99)
            inter["paused_p99_x_alone_run"] = ratio(ref_p99, base_p99)
        p99x = ratio(lat.get("p99"), ref_p99)
        kept = ratio(offline_tp, base_tp)
        out["setups"][setup] = {"p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"), "p99_x_alone": p99x,
                                "p99_x_bounds": p99_ratio_bounds(lat, ref),
                                "p50_x_alone": ratio(lat.get("p50"), ref_p50), "offline_kept": kept,
                                "dropped": on.get("dropped"), "target_met": online_target_met(p99x, kept),
                                "lease_wait_ms": on.get("lease_wait_ms"), "error": run.get("error"),
                                "common_window": window, "interleaved": inter}
    return out


INTERLEAVED_STATS: dict[str, Callable[[Sequence[float]], float]] = {
    "p50": lambda v: percentile(v, 50), "mean": statistics.fmean, "p99": lambda v: percentile(v, 99)}
"""The statistics whose running / paused ratio an interleaved run reports with a paired-bootstrap interval."""


def interleave_inputs(run: dict[str, Any]) -> tuple[Alternation, list[float], list[float], float] | None:
    """An interleaved run's plan, its online requests' arrivals and latencies, and the second from which they
    count (the trainer's first step, where it started late); None for a run without pauses."""
    alt = run.get("alternation")
    if not alt:
        return None
    on = tenant(run, "online") or {}
    window = met_partner(run)[3]
    return (Alternation.from_json(alt), on.get("arrivals_s") or [], on.get("latencies_ms") or [],
            window[0] if window else 0.0)


def run_pairs(run: dict[str, Any]) -> list[Block]:
    """An interleaved run's requests by pair of periods (interleave.period_pairs); [] for a run without pauses."""
    inputs = interleave_inputs(run)
    if inputs is None:
        return []
    plan, arrivals, latencies, since = inputs
    return period_pairs(plan, arrivals, latencies, since_s=since)


def interleaved_ratios(shared: Sequence[float], ref: Sequence[float], blocks: Sequence[Block]) -> dict[str, Any]:
    """`<stat>_x` (shared / ref) and `<stat>_x_ci` (its 90% interval from resampling `blocks`, the pairs of periods)
    for each of INTERLEAVED_STATS: one run's (interleaved) or the pairs of many runs pooled (online_breakdown)."""
    out: dict[str, Any] = {}
    for name, stat in INTERLEAVED_STATS.items():
        ci = paired_bootstrap(blocks, stat)
        out[f"{name}_x"] = ratio(stat(shared), stat(ref)) if shared and ref else None
        out[f"{name}_x_ci"] = list(ci) if ci else None
    return out


def interleaved(run: dict[str, Any]) -> dict[str, Any] | None:
    """A run whose offline tenant was paused in every other period (--interleave): the online requests of its
    running periods and of its paused ones (the reference: same processes, seconds apart), running / paused of
    p50, mean and p99 each with a 90% interval from resampling pairs of periods, and the offline throughput over
    its running periods. None for a run without pauses."""
    inputs = interleave_inputs(run)
    if inputs is None:
        return None
    plan, arrivals, latencies, since = inputs
    alt = run["alternation"]
    split = split_latencies(plan, arrivals, latencies, since_s=since)
    shared, ref = split[RUNNING], split[PAUSED]
    w = (tenant(run, "offline") or {}).get("window") or {}
    rate = running_rate(plan, w["items"], since_s=w.get("late_s") or 0.0) if "items" in w else None
    ratios = interleaved_ratios(shared, ref, period_pairs(plan, arrivals, latencies, since_s=since))
    return {"running": latency_summary(shared), "paused": latency_summary(ref), **ratios,
            "offline_running_tp": rate, "period_s": plan.period_s,
            "guard_s": plan.guard_s, "switches": alt.get("switches"), "max_lag_ms": alt.get("max_lag_ms"),
            "alternation_error": alt.get("error")}


def setup_samples(run: dict[str, Any]) -> tuple[list[float], list[float] | None]:
    """The online latencies (ms) that met the trainer, and, for an interleaved run, those of its paused periods
    (the run's own reference); None for a run scored against the separate alone run."""
    inputs = interleave_inputs(run)
    if inputs is None:
        return met_partner(run)[2] or [], None
    plan, arrivals, latencies, since = inputs
    split = split_latencies(plan, arrivals, latencies, since_s=since)
    return split[RUNNING], split[PAUSED]


def p99_ratio_bounds(lat: dict[str, Any], base: dict[str, Any]) -> list[float] | None:
    """The p99 / alone ratio's bounds from both p99s' 90% intervals (examples/online_offline.py reports them):
    [shared low / alone high, shared high / alone low]. Where they straddle the target, these runs cannot say
    whether it was met: a p99 of a few hundred requests rests on its top few samples."""
    lo, hi, base_lo, base_hi = lat.get("p99_lo"), lat.get("p99_hi"), base.get("p99_lo"), base.get("p99_hi")
    if None in (lo, hi, base_lo, base_hi) or not base_lo or not base_hi:
        return None
    return [lo / base_hi, hi / base_lo]


def p99_resolution(bounds: list[float] | None) -> str:
    """Whether the p99 part of the target is settled by these runs."""
    if not bounds:
        return ""
    if bounds[1] <= ONLINE_P99_TARGET:
        return "below the target"
    return "above the target" if bounds[0] > ONLINE_P99_TARGET else "cannot tell"


def pooled_summary(ms: list[float]) -> dict[str, Any] | None:
    if not ms:
        return None
    lat = latency_summary(ms)
    return {"n": lat["n"], "p99_ms": lat["p99"], "p99_lo": lat["p99_lo"], "p99_hi": lat["p99_hi"]}


def pooled_latency(runs: list[dict[str, Any]], setup: str, reference: bool = False) -> dict[str, Any] | None:
    """The online tenant's requests of every round of a setup, as one sample: its p99 and that p99's 90% interval
    (`reference`: those of the runs' paused periods, for interleaved runs). Why: the median of a few rounds' p99s
    rests on each round's top few requests; pooled, a p99 rests on a few times more (3 rounds of 12 s: 720
    requests, the p99 between about the 3rd and 12th highest)."""
    ms: list[float] = []
    for r in runs:
        shared, ref = setup_samples(r.get(setup) or {})
        ms += (ref or []) if reference else shared
    return pooled_summary(ms)


def pool_online(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setup, its pooled p99 against the pooled p99 alone (for interleaved runs, against their own paused
    periods, pooled likewise), with bounds and whether they settle the target."""
    alone = pooled_latency(rounds, "alone-online")
    out: dict[str, Any] = {"alone": alone, "setups": {}}
    for setup in (s for s in ONLINE_SETUPS.values() if any(s in r for r in rounds)):
        pooled = pooled_latency(rounds, setup)
        ref = pooled_latency(rounds, setup, reference=True)
        against = ref or alone
        if pooled is None or against is None:
            continue
        bounds = p99_ratio_bounds(pooled, against)
        out["setups"][setup] = {**pooled, "p99_x_alone": ratio(pooled["p99_ms"], against["p99_ms"]),
                                "p99_x_bounds": bounds, "resolution": p99_resolution(bounds),
                                "reference": "paused periods" if ref else "alone runs",
                                **({"paused": ref, "p99_x_paired_ci": pooled_pairs_ci(rounds, setup)} if ref else {})}
    return out


def pooled_pairs_ci(rounds: list[dict[str, Any]], setup: str) -> list[float] | None:
    """The p99 running / paused interval from the pairs of periods of every round's interleaved run of a setup."""
    blocks = [b for r in rounds for b in run_pairs(r.get(setup) or {})]
    ci = paired_bootstrap(blocks, INTERLEAVED_STATS["p99"])
    return list(ci) if ci else None


def online_target_met(p99x: float | None, kept: float | None) -> bool | None:
    return None if p99x is None or kept is None else (p99x <= ONLINE_P99_TARGET and kept >= OFFLINE_KEPT_TARGET)


ONLINE_RANGED = ("p99_x_alone", "p50_x_alone", "offline_kept")


def combine_online(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of derive_online (each against its own solo runs) as medians, with each ratio's range: the solo
    references drift by up to 20% between runs on the lent H200 VM, so one round can read 'met' by chance."""
    if len(rounds) == 1:
        return rounds[0]

    def med(values: list[Any]) -> float | None:
        got = [v for v in values if v is not None]
        return statistics.median(got) if got else None

    out: dict[str, Any] = {k: med([r.get(k) for r in rounds]) for k in ("alone_p99_ms", "alone_p50_ms", "offline_solo")}
    out["rounds"] = len(rounds)
    out["setups"] = {}
    for setup in rounds[0].get("setups", {}):
        each = [r.get("setups", {}).get(setup) or {} for r in rounds]
        s: dict[str, Any] = {k: med([e.get(k) for e in each]) for k in ("p50_ms", "p99_ms", *ONLINE_RANGED)}
        for k in ONLINE_RANGED:
            got = [e[k] for e in each if e.get(k) is not None]
            s[f"{k}_range"] = [min(got), max(got)] if got else None
        bounds = [e["p99_x_bounds"] for e in each if e.get("p99_x_bounds")]
        s["p99_x_bounds"] = [med([b[0] for b in bounds]), med([b[1] for b in bounds])] if bounds else None
        s["dropped"] = sum(e.get("dropped") or 0 for e in each)
        s["target_met"] = online_target_met(s["p99_x_alone"], s["offline_kept"])
        s["target_met_rounds"] = sum(1 for e in each if e.get("target_met"))
        errors = [e.get("error") for e in each if e.get("error")]
        s["error"] = errors[0] if len(errors) == len(each) else None
        out["setups"][setup] = s
    return out


def online_line(run: dict[str, Any]) -> str:
    if run.get("error"):
        return f"FAILED: {run['error'][:200]}"
    parts = []
    for t in run.get("tenants", []):
        r = t.get("report") or {}
        if "latency_ms" in r:
            wait = r.get("lease_wait_ms") or {}
            parts.append(f"online p50 {fmt(r['latency_ms'].get('p50'))} ms p99 {fmt(r['latency_ms'].get('p99'))} ms"
                         + (f" (lease wait p50 {fmt(wait.get('p50'))} p99 {fmt(wait.get('p99'))} ms)" if wait else ""))
        elif r:
            parts.append(f"offline {fmt(r.get('throughput'), 1)} {r.get('unit', '')}")
        else:
            parts.append(f"{t.get('name')}: {t.get('error')}")
    inter = interleaved(run)
    if inter is not None:
        r, q = inter["running"], inter["paused"]
        parts.append(f"interleaved: p99 {fmt(r.get('p99'))} ms beside the trainer ({r.get('n', 0)}), {fmt(q.get('p99'))} "
                     f"ms while it idled ({q.get('n', 0)}); trainer {fmt(inter['offline_running_tp'], 1)} running")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------- output


def markdown(results: dict[str, Any]) -> str:
    """The tables for every scenario present, with the command and date each came from."""
    meta = results.get("meta", {})
    lines = [f"# Scenarios on {meta.get('gpu', '?')}", ""]
    sc = results.get("scenarios", {})
    if "online" in sc:
        lines += online_md(sc["online"])
    return "\n".join(lines) + "\n"


def provenance(data: dict[str, Any]) -> list[str]:
    return [f"`{data.get('command', '?')}` ({data.get('date_utc', '?')} UTC)", ""]


def online_md(data: dict[str, Any]) -> list[str]:
    lines = [f"## 4. Online + offline (ResNet-50 fp16 inference at {data.get('rate', '?')} req/s next to ResNet-50 "
             "training; preemptive mode)", "", *provenance(data),
             f"Target: online p99 <= {ONLINE_P99_TARGET:g}x alone while the offline tenant keeps >= "
             f"{OFFLINE_KEPT_TARGET:.0%} of its solo throughput.", "",
             "| batch | setup | online p50 ms | online p99 ms | p50 / alone | p99 / alone | p99 / alone, 90% bounds | "
             "offline kept | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch, runs in data.get("batches", {}).items():
        d = runs.get("derived") or {}
        n = d.get("rounds")
        lines.append(f"| {batch} | alone{f' (median of {n} rounds)' if n else ''} | {fmt(d.get('alone_p50_ms'))} | "
                     f"{fmt(d.get('alone_p99_ms'))} | 1.00 | 1.00 | | 1.00 ({fmt(d.get('offline_solo'), 1)} img/s) | |")
        for setup, s in (d.get("setups") or {}).items():
            met = {True: "**met**", False: "missed", None: s.get("error") or "n/a"}[s.get("target_met")]
            if n and s.get("target_met") is not None:
                met += f" ({s.get('target_met_rounds', 0)} of {n} rounds)"
            b = s.get("p99_x_bounds")
            bounds = f"{fmt(b[0])}-{fmt(b[1])}: {p99_resolution(b)}" if b else "n/a"
            cells = [fmt_ranged(s, k) for k in ("p50_x_alone", "p99_x_alone")] + [bounds, fmt_ranged(s, "offline_kept")]
            name = f"{setup} (interleaved)" if s.get("interleaved") else setup
            lines.append(f"| {batch} | {name} | {fmt(s.get('p50_ms'))} | {fmt(s.get('p99_ms'))} | "
                         f"{' | '.join(cells)} | {met} |")
    lines += interleaved_md(data)
    if any((runs.get("derived") or {}).get("rounds") for runs in data.get("batches", {}).values()):
        lines += ["", "Medians over the rounds, each ratio against its own round's solo runs; [min-max] across rounds."]
        lines += ["", "Pooled: every round's requests of a setup as one sample, against every round's requests alone.", "",
                  "| batch | setup | requests | p99 ms (90% interval) | p99 / alone | 90% bounds | p99 target |",
                  "|---|---|---|---|---|---|---|"]
        for batch, runs in data.get("batches", {}).items():
            pooled = (runs.get("derived") or {}).get("pooled") or {}
            rows = [("alone", pooled.get("alone")), *(pooled.get("setups") or {}).items()]
            for setup, q in rows:
                if not q:
                    continue
                b = q.get("p99_x_bounds")
                paired = q.get("p99_x_paired_ci")
                lines.append(f"| {batch} | {setup}{' (vs its paused periods)' if q.get('paused') else ''} | {q['n']} | "
                             f"{fmt(q['p99_ms'])} ({fmt(q['p99_lo'])}-{fmt(q['p99_hi'])}) | "
                             f"{fmt(q.get('p99_x_alone', 1.0))} | {f'{fmt(b[0])}-{fmt(b[1])}' if b else ''}"
                             f"{f'; paired {fmt(paired[0])}-{fmt(paired[1])}' if paired else ''} | "
                             f"{q.get('resolution', '')} |")
    lines += ["", f"90% bounds: from each p99's distribution-free 90% interval (order statistics of its requests), "
                  f"shared low / alone high to shared high / alone low; 'cannot tell' where they straddle "
                  f"{ONLINE_P99_TARGET:g}x."]
    return [*lines, ""]


def interleaved_setups(runs: dict[str, Any]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(round index, setup, its derivation) for each interleaved run of one batch size's rounds, as derive_batch
    scored them (each round against its own solo runs)."""
    for k, d in enumerate((runs.get("derived") or {}).get("per_round") or []):
        for setup, s in (d.get("setups") or {}).items():
            if s.get("interleaved"):
                yield k, setup, s


def interleaved_md(data: dict[str, Any]) -> list[str]:
    """Interleaved runs, round by round: the two phases, and each against the separate alone run (which shows what
    a setup costs a lone online tenant in both phases, across minutes of the VM's drift)."""
    rows = []
    for batch, runs in data.get("batches", {}).items():
        for k, setup, s in interleaved_setups(runs):
            i = s["interleaved"]
            r, q = i.get("running") or {}, i.get("paused") or {}
            cis = " | ".join(fmt_ci(i.get(f"{n}_x"), i.get(f"{n}_x_ci")) for n in INTERLEAVED_STATS)
            rows.append(f"| {batch} | {k + 1} | {setup} | {r.get('n', 0)} / {q.get('n', 0)} | {fmt(r.get('p50'))} / "
                        f"{fmt(r.get('p99'))} | {fmt(q.get('p50'))} / {fmt(q.get('p99'))} | {cis} | "
                        f"{fmt(i.get('paused_p99_x_alone_run'))} | "
                        f"{fmt(s.get('offline_kept'))} | {i.get('switches')}, {fmt(i.get('max_lag_ms'), 1)} ms |")
    if not rows:
        return []
    return ["", "Interleaved (`--interleave S`): in each shared run the trainer idled in every other period of S "
            f"seconds; requests within {INTERLEAVE_GUARD_S:g} s of a switch count for neither phase. The setup's p99 / alone "
            "above is its running periods' p99 against its paused periods' (same run, seconds apart), the offline kept "
            "its rate over its running periods against its solo run. A cost the setup puts on the online tenant in both "
            "phases shows in the paused periods against the alone run (with the minutes of drift between them).", "",
            "Running / paused ratios carry a 90% interval from resampling whole pairs of periods (a running second and "
            "the idle one after it), the independent units here.", "",
            "| batch | round | setup | requests running / paused | running p50 / p99 ms | paused p50 / p99 ms | "
            "p50 running / paused | mean running / paused | p99 running / paused | paused p99 / alone run | "
            "offline kept (running) | switches, max lag |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def fmt_ci(x: float | None, ci: list[float] | None) -> str:
    return fmt(x) + (f" [{fmt(ci[0])}-{fmt(ci[1])}]" if ci else "")


def fmt_ranged(s: dict[str, Any], key: str) -> str:
    rng = s.get(f"{key}_range")
    return fmt(s.get(key)) + (f" [{fmt(rng[0])}-{fmt(rng[1])}]" if rng else "")


# -------------------------------------------------------------------------------------------- plots


def plots(results: dict[str, Any], folder: Path) -> list[Path]:
    """PNG plots for what results.json holds; empty when matplotlib is missing (the tables still stand)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    sc = results.get("scenarios", {})
    if "online" in sc:
        made += online_plot(plt, sc["online"], folder)
        made += online_interleaved_plot(plt, sc["online"], folder)
    return made


def online_plot(plt: Any, data: dict[str, Any], folder: Path) -> list[Path]:
    made = []
    for batch, runs in data.get("batches", {}).items():
        d = runs.get("derived") or {}
        setups = [("alone", d.get("alone_p50_ms"), d.get("alone_p99_ms"), 1.0)]
        setups += [(k, v.get("p50_ms"), v.get("p99_ms"), v.get("offline_kept")) for k, v in (d.get("setups") or {}).items()]
        setups = [s for s in setups if s[2] is not None]
        if not setups:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.5))
        xs = range(len(setups))
        ax.bar([x - 0.2 for x in xs], [s[1] or 0 for s in setups], width=0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [s[2] or 0 for s in setups], width=0.4, label="p99")
        if d.get("alone_p99_ms"):
            ax.axhline(ONLINE_P99_TARGET * d["alone_p99_ms"], color="k", ls="--", lw=0.8, label="target p99")
        ax.set_xticks(list(xs), [setup_tick(s[0], s[3]) for s in setups], fontsize=8)
        ax.set_ylabel("online latency (ms)")
        ax.set_title(f"online inference batch {batch} + training")
        ax.legend(fontsize=8)
        made.append(save_plot(plt, fig, folder / f"online-b{batch}-latency.png"))
    return made


def setup_tick(setup: str, kept: float | None) -> str:
    """A setup's tick label, wrapped (the long names ran into each other) above the trainer's kept."""
    return f"{textwrap.fill(setup, 24)}\noffline {fmt(kept)}"


def online_interleaved_plot(plt: Any, data: dict[str, Any], folder: Path) -> list[Path]:
    """Interleaved runs (first round): p50, mean and p99 beside the trainer over its idle seconds, per setup, with
    their 90% intervals, against the 1.05x line. Why a plot of its own: their reference is the run's own idle
    seconds, not the alone run the latency plot's target line is drawn from."""
    made = []
    for batch, runs in data.get("batches", {}).items():
        rows = [(setup, s["interleaved"], s.get("offline_kept")) for k, setup, s in interleaved_setups(runs) if k == 0]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.5))
        width = 0.8 / len(INTERLEAVED_STATS)
        for j, name in enumerate(INTERLEAVED_STATS):
            xs = [i + (j - (len(INTERLEAVED_STATS) - 1) / 2) * width for i in range(len(rows))]
            ys = [r.get(f"{name}_x") or 0.0 for _, r, _ in rows]
            cis = [r.get(f"{name}_x_ci") or [y, y] for (_, r, _), y in zip(rows, ys, strict=True)]
            err = [[max(0.0, y - c[0]) for y, c in zip(ys, cis, strict=True)],
                   [max(0.0, c[1] - y) for y, c in zip(ys, cis, strict=True)]]
            ax.bar(xs, ys, width=width, yerr=err, capsize=3, label=name)
        ax.axhline(ONLINE_P99_TARGET, color="k", ls="--", lw=0.8, label=f"{ONLINE_P99_TARGET:g}x")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xticks(list(range(len(rows))), [setup_tick(k, kept) for k, _, kept in rows], fontsize=8)
        ax.set_ylim(0.5, 1.6)
        ax.set_ylabel("beside the trainer / its idle seconds")
        ax.set_title(f"online batch {batch}, interleaved (90% intervals)")
        ax.legend(fontsize=8)
        made.append(save_plot(plt, fig, folder / f"online-b{batch}-interleaved.png"))
    return made


def summary(results: dict[str, Any]) -> str:
    """One screen: the headline number of each scenario present."""
    sc = results.get("scenarios", {})
    out = [f"scenarios on {results.get('meta', {}).get('gpu', '?')}:"]
    for batch, runs in (sc.get("online") or {}).get("batches", {}).items():
        derived = runs.get("derived") or {}
        pooled = (derived.get("pooled") or {}).get("setups") or {}
        for setup, s in (derived.get("setups") or {}).items():
            q = pooled.get(setup) if derived.get("rounds") else None
            more = f"; pooled p99 x{fmt(q.get('p99_x_alone'))} of {q['n']} requests: {q['resolution']}" if q else ""
            out.append(f"  online b{batch} {setup:16} p99 x{fmt(s.get('p99_x_alone'))}, offline kept "
                       f"{fmt(s.get('offline_kept'))}{more}")
    return "\n".join(out)


def write_outputs(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    save_json(out / "results.json", results)
    write_atomic(out / "results.md", markdown(results))
    return plots(results, out / "plots")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results folder (results.json is merged into)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help="online, the one scenario (the option stays so that recorded command lines run as they are)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window per run (default 15)")
    ap.add_argument("--warmup", type=float, default=8.0, help="warm-up before the window, no scheduler (default 8)")
    ap.add_argument("--unisched-warmup", type=float, default=15.0, help="warm-up under unisched (default 15)")
    ap.add_argument("--slice-ms", type=float, default=50.0, help="unisched serve --slice-ms (default 50)")
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
