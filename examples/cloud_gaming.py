#!/usr/bin/env python3
"""Cloud-gaming density: N game-streaming instances on one GPU, each its own process.

Why it looks like this. A cloud-gaming host runs one container per player: each renders its game, reads the
frame back and encodes it to H.264 for the network, paced to the player's frame rate. What the operator cares
about is every player's frame rate (mean, the worst second, the 1% low that players feel as stutter), that the
players are treated alike (fairness = lowest / highest mean FPS), and that one misbehaving container (here: one
that grabs more GPU memory than its share) is stopped at its own door instead of starving the others.

Roles:
  (default) orchestrator: starts --instances instance processes with one shared measured window (an absolute
            --start-at), waits for them with a deadline, and writes one report. With --unisched-socket each
            instance is a tenant of the daemon (`unisched run --tenant cg-<i> --weight W --engines
            graphics,encode`, so it has its own cgroup as a container would; W is --weight, or with --weights
            A,B,... the groups' weights round robin, times 100), and --memory-cap is applied to
            every tenant (`unisched set-limit --memory`) as soon as it exists and before the window. Without the
            socket the same instances share the GPU by the driver's own time-slicing.
  --role instance: one player. EGL/OpenGL renders the shader scene of workloads/egl_render.py at WIDTHxHEIGHT
            (cost --iterations), paced to --fps against absolute deadlines (a late frame starts at once, missed
            slots are skipped, never made up in a burst, so the pace never drifts), glReadPixels reads it back
            and PyAV encodes it (h264_nvenc where it opens; otherwise libx264 ultrafast/zerolatency on one
            thread: the H200 has no NVENC, the report says which encoder ran). With --hog-mib it also fills that
            much GPU memory (GL buffers, cleared on the GPU so they are resident and NVML counts them) and then
            tries to open one more GPU session: a second EGL context in this process and a new process that
            opens its own (what a container launching another game does). The report says whether each opened.
  --role probe: that new process (opens an EGL context, clears it, exits 0; non-zero with the error).

What the memory cap does (unisched/scheduler/upkeep.py): the daemon sums the GPU memory NVML reports for a tenant's
processes once a second. Over its cap the tenant is marked over_memory and counted as a "memory" refusal; its new
GPU sessions are refused by the seccomp session hooks (EPERM on the driver's allocation ioctl) and opening GPU
device nodes is denied by the cgroup-device eBPF program. Nothing already running is killed or shrunk: the hog
keeps rendering, the others should keep their frame rate.

Metrics per instance over the window: fps_mean (frames / window), fps_min (lowest of the 1-second bins),
fps_1pct_low (1 / the 99th-percentile frame time), frames, encoder, memory_bytes (NVML, this process), stage times,
cpu_cores (this player's CPU over the window, in cores) and cpu_user_cores (its user-mode part), a timeline
[[t, fps], ...] per 1-second bin, and its window (ready_s: when it had started up, first_frame_s; a player ready
after the window began is late, one the scheduler held shared the window, held time included).
Overall: fairness_min_over_max, fps_mean_all, cpu_cores_total against player_cores, the CPUs the players may run
on (host_cores unless --player-cpus), gpu_busy (the first GPU's mean NVML utilization over the window, 0..1: with
the CPU figures it says whether the GPU or the host's CPU ran out first; a player waiting on a busy GPU can spin in the
driver's wait, so a saturated GPU can fill the CPUs too), the daemon's view of the tenants at the end of
the window (`unisched tenants --json`: memory, over_memory, refusals) and a hog summary.
The exit status is non-zero when an instance failed or had to be killed at the deadline (its log tail is in the
report's errors).

Where the parts live (examples/workloads/): the player and the probe in _cloud_player.py, its pacing and frame-rate
figures in _pacing.py, the orchestrator's calls to the daemon and the hog's story in _cloud_daemon.py, the GPU's
NVML busy fraction in _nvml_sampler.py, starting and stopping the children in _children.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # unisched: the size parser, stopping a player
sys.path.insert(0, str(Path(__file__).resolve().parent / "workloads"))
from _children import ROOT, Interrupted, child_env, log_tail, raise_interrupted, run_argv
from _cloud_daemon import Daemon, apply_caps, compact, daemon_row, hog_summary, refusal_delta
from _cloud_player import open_encoder, run_instance, run_probe
from _egl import EGLUnavailable
from _nvml_sampler import NvmlSampler
from _pacing import fairness
from _window import add_window_args, fail, write_json

from unisched.calibrate.runs import kill_group

SCENARIO = "cloud_gaming"
LATE_S = 0.5
"""An instance that finished starting up (Python, PyAV, EGL, the encoder) later than this into the window did not
share it. One that was ready in time but got its first frame later did: the scheduler held it."""
FINAL_LEAD_S = 1.0
"""The daemon's final view is asked for this long before the window ends: a `unisched tenants` call is a Python
start-up, and a player that has ended its window and exited is no longer a tenant to report on."""


# ------------------------------------------------------------------------------------- the orchestrator


def weight_of(args: argparse.Namespace, index: int) -> int:
    """Instance `index`'s weight: its group's with --weights (round robin, times 100), else --weight."""
    if not args.weights:
        return int(args.weight)
    groups = [int(w) for w in str(args.weights).split(",")]
    return 100 * groups[index % len(groups)]


def tenant_name(prefix: str, index: int) -> str:
    return f"{prefix}{index}"


def instance_argv(args: argparse.Namespace, index: int, start_at: float, report: Path) -> list[str]:
    """One instance's command line: the orchestrator's frame settings, the shared window, its phase in the frame."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", "instance", "--index", str(index),
            "--seconds", f"{args.seconds:g}", "--start-at", f"{start_at:.3f}", "--report", str(report),
            "--width", str(args.width), "--height", str(args.height), "--fps", f"{args.fps:g}",
            "--iterations", str(args.iterations), "--encoder", args.encoder,
            # players start their frames spread over the period, as independent containers would on average
            "--phase", f"{index / args.instances:.4f}"]
    if args.egl_device is not None:
        argv += ["--egl-device", str(args.egl_device)]
    if args.player_cpus:
        argv += ["--player-cpus", ",".join(map(str, args.player_cpus))]
    if args.hog_mib and index == args.hog_instance:
        argv += ["--hog-mib", str(args.hog_mib), "--hog-at", f"{args.hog_at:g}", "--probe-after", f"{args.probe_after:g}"]
    return argv


@dataclass
class Child:
    index: int
    tenant: str | None
    argv: list[str]
    report: Path
    log: Path
    proc: subprocess.Popen[bytes]
    stopped: str | None = None  # why we stopped it, if we did


def orchestrate(args: argparse.Namespace,
                make_argv: Callable[[argparse.Namespace, int, float, Path], list[str]] = instance_argv) -> int:
    """Start the instances, cap them, wait for them (never past the deadline), and report.

    `make_argv` builds an instance's command (the tests pass stand-ins that need no GPU).
    """
    out = args.out or Path(tempfile.mkdtemp(prefix="cloud_gaming-"))
    out.mkdir(parents=True, exist_ok=True)
    env = child_env()
    socket = args.unisched_socket
    daemon = Daemon(socket, env) if socket else None
    names = [tenant_name(args.tenant_prefix, i) if socket else None for i in range(args.instances)]
    start_at = time.time() + args.warmup
    end_at = start_at + args.seconds
    deadline = end_at + args.grace
    errors: list[str | dict[str, Any]] = []
    children: list[Child] = []
    before: list[dict[str, Any]] | None = None  # the daemon's view just before the window
    polls: list[dict[str, Any]] = []
    final: list[dict[str, Any]] | None = None
    caps_applied: dict[str, float] = {}
    interrupted = False
    sampler = NvmlSampler(0)  # the first GPU, where the players render by default
    sampler.start()
    old_term = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        for i in range(args.instances):
            report, log = out / f"instance-{i}.json", out / f"instance-{i}.log"
            report.unlink(missing_ok=True)
            argv = make_argv(args, i, start_at, report)
            if socket:
                argv = run_argv(sys.executable, socket, str(names[i]), weight_of(args, i), args.engines, argv)
            with open(log, "wb") as f:
                proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                        start_new_session=True)  # Ctrl-C reaches only us; we stop them
            children.append(Child(i, names[i], argv, report, log, proc))
        if daemon is not None:
            memory = args.memory_cap or "-1"
            caps_applied, cap_errors = apply_caps(daemon, [str(n) for n in names], memory, start_at - 0.5,
                                                  lambda: any(c.proc.poll() is None for c in children))
            errors += cap_errors
            before = daemon.tenants()
            late = [n for n, t in caps_applied.items() if t > start_at]
            errors += [f"memory cap on {n} applied {caps_applied[n] - start_at:.1f} s into the window" for n in late]
        next_poll = start_at
        while any(c.proc.poll() is None for c in children) and time.time() < deadline:
            now = time.time()
            if daemon is not None and final is None and now >= end_at - min(FINAL_LEAD_S, args.seconds / 4):
                final = daemon.tenants()  # before the players end their window and exit (the daemon drops them)
            elif daemon is not None and args.daemon_poll > 0 and start_at <= now < end_at and now >= next_poll:
                polls.append({"t": round(now - start_at, 2), "tenants": compact(daemon.tenants(), names)})
                next_poll = now + args.daemon_poll
            else:
                time.sleep(0.1)
        for c in children:
            if c.proc.poll() is None:
                c.stopped = "killed at the deadline"
                kill_group(c.proc)
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
        errors.append("interrupted: instances stopped")
        for c in children:
            if c.proc.poll() is None:
                c.stopped = "stopped: interrupted"
                kill_group(c.proc)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        sampler.stop()
    if daemon is not None and final is None and not interrupted:
        final = daemon.tenants()
    gpu = {"gpu_busy": sampler.busy(start_at, end_at), "gpu_busy_error": sampler.error}
    summary = write_summary(args, children, before, final, polls, caps_applied, errors, start_at, gpu)
    print_table(summary, out)
    return 130 if interrupted else 1 if summary["errors"] else 0


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ready_late(window: dict[str, Any]) -> float | None:
    """How late into the window a player was ready to play (0 when in time); a report without its start-up time
    says when its window began."""
    ready = window.get("ready_s")
    return max(0.0, float(ready)) if isinstance(ready, int | float) else window.get("late_s")


def last_polled(polls: list[dict[str, Any]], name: str | None) -> dict[str, Any] | None:
    """A tenant's row in the latest poll that has it: where the final view came too late for a player that had
    already exited, its last view during the window."""
    return next((p["tenants"][name] for p in reversed(polls) if name in p["tenants"]), None)


def write_summary(args: argparse.Namespace, children: list[Child], before: list[dict[str, Any]] | None,
                  final: list[dict[str, Any]] | None, polls: list[dict[str, Any]], caps_applied: dict[str, float],
                  errors: list[str | dict[str, Any]], start_at: float, gpu: dict[str, Any]) -> dict[str, Any]:
    """Per-instance figures, fairness, the daemon's view and the hog's story, as one report (--report). `gpu`:
    what NVML read of the GPU over the window (gpu_busy), where it could."""
    per: list[dict[str, Any]] = []
    reports: list[dict[str, Any] | None] = []
    for c in children:
        r = read_json(c.report)
        reports.append(r)
        rc = c.proc.poll()
        got = r or {"fps_mean": 0.0, "fps_min": 0.0, "frames": 0}  # a player that reported nothing showed nothing
        row = daemon_row(final, c.tenant) or last_polled(polls, c.tenant)
        entry: dict[str, Any] = {
            "index": c.index, "tenant": c.tenant, "rc": rc, "weight": weight_of(args, c.index),
            **{k: got.get(k) for k in ("pid", "fps_mean", "fps_min", "fps_1pct_low", "frame_time_p99_ms", "frames",
                                       "encoder", "skipped_slots", "stage_ms", "cpu_cores", "cpu_user_cores",
                                       "timeline")},
            "late_s": ready_late(got.get("window") or {}),
            "memory_bytes": got.get("memory_bytes") or (row or {}).get("memory_bytes"),
            "over_memory": (row or {}).get("over_memory"),
            "refusals": refusal_delta((daemon_row(before, c.tenant) or {}).get("refusals"), row.get("refusals"))
            if row else None,
            "memory_cap_applied_s": round(caps_applied[c.tenant] - start_at, 2) if c.tenant in caps_applied else None,
            "error": None,
        }
        if c.stopped or rc != 0 or r is None:
            why = c.stopped or (f"exit status {rc}" if rc else "no report written")
            entry["error"] = why
            errors.append({"instance": c.index, "tenant": c.tenant, "error": why, "log_tail": log_tail(c.log)})
        elif (entry["late_s"] or 0) > LATE_S:
            entry["error"] = f"ready {entry['late_s']:.1f} s into the window: give a longer --warmup"
            errors.append({"instance": c.index, "tenant": c.tenant, "error": entry["error"], "log_tail": ""})
        per.append(entry)
    fps = [float(e["fps_mean"] or 0.0) for e in per]
    others = [f for e, f in zip(per, fps, strict=True) if not (args.hog_mib and e["index"] == args.hog_instance)]
    encoders = sorted({str(e["encoder"]) for e in per if e["encoder"]})
    first = next((r for r in reports if r), {})
    summary: dict[str, Any] = {
        "scenario": SCENARIO, "instances": args.instances, "unisched": bool(args.unisched_socket),
        "socket": args.unisched_socket, "memory_cap": args.memory_cap,
        "memory_cap_bytes": cap_bytes(args.memory_cap), "fps_target": args.fps, "width": args.width,
        "height": args.height, "iterations": args.iterations, "seconds": args.seconds, "warmup": args.warmup,
        "start_at": start_at, "encoder": ", ".join(encoders) or None,
        "encoders_not_opened": getattr(args, "encoders_not_opened", None) or first.get("encoders_not_opened"),
        "gpu": first.get("gl_renderer"),
        "per_instance": per, "fairness_min_over_max": fairness(fps),
        "fairness_without_hog": fairness(others) if args.hog_mib else None,
        "fps_mean_all": sum(fps) / len(fps) if fps else None, "fps_total": sum(fps),
        "cpu_cores_total": cpu_total(per), "host_cores": os.cpu_count(),
        "player_cores": len(args.player_cpus) or os.cpu_count(), **gpu,
        "hog": hog_summary(args, per, reports, polls, others),
        "tenants": [t for t in final or [] if t.get("name") in {c.tenant for c in children}],
        "daemon_timeline": polls, "errors": errors, "command": [sys.executable, *sys.argv],
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start_at)),
    }
    write_json(args.report, summary)
    return summary


def cpu_total(per: list[dict[str, Any]]) -> float | None:
    """The players' CPU over the window, in cores (None where none measured it)."""
    got = [float(e["cpu_cores"]) for e in per if isinstance(e.get("cpu_cores"), int | float)]
    return round(sum(got), 3) if got else None


def cap_bytes(memory_cap: str | None) -> int | None:
    if memory_cap is None:
        return None
    from unisched.scheduler.config import parse_size

    return parse_size(memory_cap)


def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    return f"{x:.{digits}f}" if isinstance(x, float | int) and not isinstance(x, bool) else str(x)


def print_table(s: dict[str, Any], out: Path) -> None:
    where = f"unisched ({s['socket']}), memory cap {s['memory_cap'] or 'none'}" if s["unisched"] else "no scheduler"
    print(f"cloud_gaming: {s['instances']} instances, {s['width']}x{s['height']} at {fmt(s['fps_target'], 0)} fps target, "
          f"{where}, encoder {s['encoder']}, GPU {s['gpu']}")
    rows = [["#", "tenant", "fps mean", "fps min", "1% low", "frames", "GPU MiB", "over mem", "refusals", "error"]]
    for e in s["per_instance"]:
        mem = e["memory_bytes"] / 2**20 if e["memory_bytes"] else None
        rows.append([str(e["index"]), e["tenant"] or "-", fmt(e["fps_mean"]), fmt(e["fps_min"]), fmt(e["fps_1pct_low"]),
                     str(e["frames"]), fmt(mem, 0), fmt(e["over_memory"]), json.dumps(e["refusals"] or {}),
                     e["error"] or ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"fairness (min/max fps): {fmt(s['fairness_min_over_max'], 3)}; fps mean of all: {fmt(s['fps_mean_all'])}")
    if s["hog"]:
        print(f"hog: {s['hog']['summary']}; others' fps mean {fmt(s['hog']['others_fps_mean'])}, "
              f"fairness without it {fmt(s['fairness_without_hog'], 3)}")
    for err in s["errors"]:
        print(f"error: {err if isinstance(err, str) else err['error'] + ' (instance ' + str(err['instance']) + ')'}")
    print(f"logs and instance reports: {out}", flush=True)


# ------------------------------------------------------------------------------------------------- main

EPILOG = """\
examples:
  # no scheduler (driver time-slicing), 8 players
  python3 examples/cloud_gaming.py --instances 8 --seconds 30 --warmup 10 --report /tmp/cg-8.json

  # under unisched (`unisched serve` running as root), 16 players with 4GiB caps; player 3 fills 6 GiB
  python3 examples/cloud_gaming.py --instances 16 --unisched-socket /run/unisched/unisched.sock \\
      --memory-cap 4GiB --hog-instance 3 --hog-mib 6144 --seconds 30 --warmup 20 --report /tmp/cg-16.json

  # one player on its own, uncapped frame rate
  python3 examples/cloud_gaming.py --role instance --fps 0 --seconds 10

Give the warm-up time for every instance to start (Python, EGL, the encoder) and, under unisched, for the caps to
be applied: an instance that starts late or a cap applied late is reported. The daemon keeps tenants (and their
refusal counts) across runs: the report counts only this run's refusals, and without --memory-cap the orchestrator
clears any memory cap an earlier run left on these tenant names (set-limit --memory -1).
"""


def resolve_encoder(args: argparse.Namespace) -> None:
    """'auto' decided once, here, outside any tenant: each player then opens the encoder that works.

    Otherwise every player would try h264_nvenc first, and under unisched a GPU without NVENC (the H200) would
    turn each attempt into an "nvenc" refusal of the session hooks, mixed into the refusals this run reports.
    """
    if args.encoder != "auto":
        return
    try:
        enc = open_encoder("auto", args.width, args.height, args.fps)
    except ImportError:
        return  # no PyAV here: the players say so
    except RuntimeError as e:
        args.encoders_not_opened = [str(e)]
        return
    enc.close()
    args.encoder, args.encoders_not_opened = enc.name, enc.not_opened


def cpu_list(text: str) -> tuple[int, ...]:
    """'1' or '2,3' -> CPU numbers this host has."""
    try:
        cpus = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: CPU numbers separated by commas, e.g. 1 or 2,3") from None
    have = os.sched_getaffinity(0)
    if not cpus or any(c not in have for c in cpus):
        raise argparse.ArgumentTypeError(f"{text!r}: this process may run on CPUs {sorted(have)} only")
    return cpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("orchestrator", "instance", "probe"), default="orchestrator",
                    help="orchestrator (default): start and measure N instances; instance: one player; probe: one "
                         "attempt to open a GPU session (used by the hog)")
    add_window_args(ap)
    g = ap.add_argument_group("each player")
    g.add_argument("--width", type=int, default=1280, help="frame width (default 1280)")
    g.add_argument("--height", type=int, default=720, help="frame height (default 720)")
    g.add_argument("--fps", type=float, default=60.0, help="target frame rate; 0 = uncapped (default 60)")
    g.add_argument("--iterations", type=int, default=30,
                   help="shader rounds per pixel, the GPU cost of a frame (default 30: about 0.8 ms at 1280x720 on "
                        "the H200, scaled from the calibrated 447 rounds = 27 ms at 1920x1080 (bench/suites.py), "
                        "so 16 players at 60 fps would keep its few graphics SMs about 75%% busy)")
    g.add_argument("--encoder", default="auto",
                   help="auto (h264_nvenc where it opens, else libx264, else libopenh264) or a PyAV encoder name")
    g.add_argument("--egl-device", type=int, default=None, metavar="INDEX", help="EGL device (default: first GPU)")
    g.add_argument("--player-cpus", type=cpu_list, default=(), metavar="LIST",
                   help="run every player on these CPUs only, e.g. 1 or 2,3 (as a container's cpuset would; with "
                        "`unisched serve --cpu-stand-in` a CPU stands in for the GPU). Default: any CPU")
    g.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    g.add_argument("--phase", type=float, default=0.0,
                   help="instance: offset of its frame slots, in periods (the orchestrator spreads players over 0..1)")
    g.add_argument("--hog-mib", type=int, default=0, metavar="M",
                   help="fill M MiB of GPU memory during the window, then try to open a new GPU session "
                        "(orchestrator: in --hog-instance only)")
    g.add_argument("--hog-at", type=float, default=2.0, help="seconds into the window the hog allocates (default 2)")
    g.add_argument("--probe-after", type=float, default=4.0,
                   help="seconds after the allocation it tries a new session: the daemon reads per-process memory "
                        "from NVML about once a second and checks caps once a second, so give it two (default 4)")
    o = ap.add_argument_group("orchestrator")
    o.add_argument("--instances", type=int, default=4, help="players, each its own process (default 4)")
    o.add_argument("--hog-instance", type=int, default=None, metavar="K", help="the player that goes over its cap")
    o.add_argument("--grace", type=float, default=30.0,
                   help="seconds after the window before unfinished instances are killed (default 30)")
    o.add_argument("--out", type=Path, default=None, help="instance logs and reports (default: a new temp folder)")
    u = ap.add_argument_group("unisched (orchestrator)")
    u.add_argument("--unisched-socket", default=None, metavar="PATH",
                   help="run each player as a tenant of the daemon on PATH (default: no scheduler)")
    u.add_argument("--memory-cap", default=None, metavar="SIZE", help="GPU memory cap per tenant, e.g. 4GiB")
    u.add_argument("--weight", type=int, default=100, help="every tenant's weight (default 100)")
    u.add_argument("--weights", default=None, metavar="A,B,...",
                   help="weight groups instead: instance i gets weight 100 * the (i mod count)-th of these, e.g. 1,2,4 "
                        "(the benchmark's groups); the report gives each instance's weight")
    u.add_argument("--engines", default="graphics,encode", help="engines declared per tenant (default graphics,encode)")
    u.add_argument("--tenant-prefix", default="cg-", help="tenant names are PREFIX<i> (default cg-)")
    u.add_argument("--daemon-poll", type=float, default=2.0,
                   help="seconds between `unisched tenants --json` snapshots during the window; 0 = only after it "
                        "(default 2)")
    args = ap.parse_args(argv)
    if args.width <= 0 or args.height <= 0 or args.width % 2 or args.height % 2:
        ap.error("--width and --height must be positive and even (H.264 4:2:0)")
    if args.weights and not all(w.isdigit() and int(w) > 0 for w in args.weights.split(",")):
        ap.error(f"--weights {args.weights!r}: positive integers separated by commas, e.g. 1,2,4")
    if args.fps < 0 or args.iterations < 1 or args.seconds <= 0 or args.instances < 1 or args.hog_mib < 0:
        ap.error("--fps >= 0, --iterations >= 1, --seconds > 0, --instances >= 1 and --hog-mib >= 0 please")
    if args.role == "orchestrator":
        if (args.hog_instance is None) != (not args.hog_mib):
            ap.error("--hog-instance K and --hog-mib M go together")
        if args.hog_instance is not None and not 0 <= args.hog_instance < args.instances:
            ap.error(f"--hog-instance must be in 0..{args.instances - 1}")
        if args.memory_cap is not None and not args.unisched_socket:
            ap.error("--memory-cap needs --unisched-socket: without the daemon nothing enforces it")
        if args.start_at is not None:
            ap.error("--start-at is for instances; the orchestrator starts the window --warmup seconds after it starts")
        try:
            cap_bytes(args.memory_cap)
        except ValueError as e:
            ap.error(f"--memory-cap: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    process_start = time.time()
    args = parse_args(argv)
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")  # before the first OpenGL import
    if args.role == "orchestrator":
        resolve_encoder(args)
        return orchestrate(args)
    if args.role == "probe":
        return run_probe(args)
    try:
        return run_instance(args, process_start, [sys.executable, str(Path(__file__).resolve()), "--role", "probe"])
    except EGLUnavailable as e:
        return fail(f"EGL unavailable: {e}")
    except ImportError as e:
        return fail(f"{e.name or e} is not importable ({e}); on the GPU machine source .devcache/setup.sh")
    except Exception as e:  # GL or encoder errors: one clear line instead of a bare traceback
        return fail(f"instance failed: {type(e).__name__}: {e}", code=3)


if __name__ == "__main__":
    sys.exit(main())
