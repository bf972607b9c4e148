#!/usr/bin/env python3
"""Driving-simulation pipeline: a render tenant feeds a perception tenant through H.264.

  sim tenant (--role sim)                          perception tenant (--role perception)
    EGL/OpenGL scene shader      GPU graphics        NVDEC H.264 decode (PyAV)   GPU video engine
    glReadPixels RGBA -> host    GPU -> CPU copy     upload, YUV->RGB, resize    GPU (CUDA)
    H.264 encode                 h264_nvenc on the   torchvision model, fp16,    GPU (CUDA)
                                 GPU, else libx264     random weights
                                 on the CPU
          |------ Unix stream socket: header (frame id, timestamps) + one H.264 packet ------>|

Why two processes: they are two tenants, as a simulator and a perception stack would be, so unisched can give
each its weight over the engines it uses (sim: graphics + encode; perception: decode + compute). On the H200
there is no NVENC: opening h264_nvenc fails, so the encode runs on the CPU (libx264, preset ultrafast, tune
zerolatency) and the report says "libx264 (CPU): this GPU has no NVENC"; decode is NVDEC on the GPU.

Modes (the orchestrator: run without --role):
  colocated   both stages at once; frames flow through the pipeline as they are made.
  sequential  the one-after-another baseline: the sim alone renders and encodes every frame into a file, then
              perception alone decodes and infers them; throughput = frames / (t_sim + t_perception).

The measured window (--seconds) starts --warmup seconds after the first frame comes out of the stage that owns
the window (colocated: perception, at inference end; sequential: the sim, at encode end), so torch and CUDA
start-up never eat into it. A frame counts when it finishes inside the window. Latency per frame and stage,
from the header timestamps (wall clock, one host): render, readback+encode, transfer (socket, including
queueing; in sequential mode the wait in the file between the stages), decode (NVDEC + copy to host), infer
(upload + colour conversion + resize + model + sync) and end to end. NVML is sampled every 100 ms (GPU and
decoder utilization) and the samples inside the window are reported.

Report (--report, JSON): scenario, mode, unisched, weights, width, height, model, encoder, decoder, frames,
seconds, fps_end_to_end, latency_ms {stage: {p50, p99, mean}}, gpu_util_mean, decoder_util_mean,
gpu_util_samples [[t, util, dec]], timeline [[t, frames done]] (one point per 0.5 s), errors; one summary line
on stdout. A stage that fails makes the orchestrator stop the other and exit 1 with the stage's log tail in
errors; stages are killed at --warmup + --seconds + --grace (sequential: the perception stage gets four times
the sim's time) and on Ctrl-C.

Where the parts live (examples/workloads/): the two stages in _ad_stages.py, the framing between them and the
figures in _ad_stream.py, starting and stopping the stages in _children.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # unisched: stopping a stage
sys.path.insert(0, str(HERE / "workloads"))
from _ad_stages import run_perception, run_sim  # noqa: E402
from _ad_stream import colocated_view, gpu_view, latency_ms, sequential_view, summarize  # noqa: E402
from _children import Interrupted, child_env, log_tail, raise_interrupted, run_argv  # noqa: E402
from _nvml_sampler import NvmlSampler  # noqa: E402
from _window import add_window_args, write_json  # noqa: E402

from unisched.calibrate.runs import kill_group  # noqa: E402

SCENARIO = "ad_sim"
TENANTS = {"sim": ("ad-sim", "graphics,encode"), "perception": ("ad-perception", "decode,compute")}

EXAMPLES = """\
examples:
  # on the GPU machine, no scheduler: the pipeline, then the one-after-another baseline
  python3 examples/ad_sim.py --mode colocated  --seconds 20 --warmup 5 --report /tmp/ad_colocated.json
  python3 examples/ad_sim.py --mode sequential --seconds 20 --warmup 5 --report /tmp/ad_sequential.json

  # both stages as unisched tenants at 1:1 (a daemon serving on the socket, as root: unisched serve &)
  python3 examples/ad_sim.py --mode colocated --unisched-socket /run/unisched/unisched.sock --weights 1:1 \\
      --report /tmp/ad_unisched.json
  #   runs: python3 -m unisched run --socket S --tenant ad-sim --weight 100 --engines graphics,encode -- \\
  #             python3 ad_sim.py --role sim ...
  #         python3 -m unisched run --socket S --tenant ad-perception --weight 100 --engines decode,compute -- \\
  #             python3 ad_sim.py --role perception ...

  # detection instead of classification, a heavier scene
  python3 examples/ad_sim.py --model ssdlite --iterations 800

what runs where on the H200: render on the GPU's graphics SMs; readback and the H.264 encode on the CPU
(libx264: the H200 has no NVENC); decode on NVDEC; colour conversion, resize and the model on the SMs (CUDA).
"""


# ------------------------------------------------------------------------------------- orchestrator argv


def parse_weights(text: str) -> tuple[int, int]:
    """'A:B' -> tenant weights scaled so that the smaller is 100 (the default weight): 1:1 -> 100, 100."""
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--weights wants A:B (e.g. 1:1 or 3:1), got {text!r}") from None
    if a <= 0 or b <= 0:
        raise argparse.ArgumentTypeError(f"--weights must be positive, got {text!r}")
    low = min(a, b)
    weights = (round(100 * a / low), round(100 * b / low))
    if max(weights) > 10000:
        raise argparse.ArgumentTypeError(f"--weights {text}: a ratio above 100:1 does not fit unisched's 1..10000")
    return weights


def stage_command(args: argparse.Namespace, role: str, workdir: Path, deadline: float) -> list[str]:
    """The command line of one stage; wrapped in `unisched run` when --unisched-socket is given."""
    colocated = args.mode == "colocated"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--seconds", str(args.seconds),
           "--warmup", str(args.warmup), "--width", str(args.width), "--height", str(args.height),
           "--report", str(workdir / f"{role}.json"), "--deadline", f"{deadline:.3f}"]
    owns_window = (role == "perception") == colocated
    if args.start_at is not None and owns_window:
        cmd += ["--start-at", f"{args.start_at:.3f}"]
    if role == "sim":
        cmd += ["--iterations", str(args.iterations), "--encoder", args.encoder, "--queue-kib", str(args.queue_kib)]
        if args.egl_device is not None:
            cmd += ["--egl-device", str(args.egl_device)]
        cmd += ["--connect", str(workdir / "frames.sock")] if colocated else ["--output", str(workdir / "frames.h264")]
    else:
        cmd += ["--model", args.model, "--decoder", args.decoder, "--gpu", str(args.gpu)]
        cmd += ["--listen", str(workdir / "frames.sock")] if colocated else ["--input", str(workdir / "frames.h264")]
    if args.unisched_socket is None:
        return cmd
    tenant, engines = TENANTS[role]
    weight = parse_weights(args.weights)[0 if role == "sim" else 1]
    return run_argv(sys.executable, args.unisched_socket, args.tenant_prefix + tenant, weight, engines, cmd)


# ---------------------------------------------------------------------------------------------- orchestrator


@dataclass
class Child:
    """One stage process, in its own session so that it and everything it starts can be stopped together."""

    role: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=child_env(), start_new_session=True)

    def tail(self) -> str:
        return log_tail(self.log)

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)


def wait_all(children: list[Child], kill_at: float) -> list[str]:
    """Wait for every stage; on the first failure or at kill_at stop the rest. Returns the errors."""
    while True:
        failed = [c for c in children if c.proc is not None and c.proc.poll() not in (None, 0)]
        if failed:
            errors = [f"{c.role} stage failed (exit {c.proc.returncode}); log tail:\n{c.tail()}"
                      for c in failed if c.proc is not None]
            for c in children:
                c.stop()
            return errors
        running = [c for c in children if c.proc is not None and c.proc.poll() is None]
        if not running:
            return []
        if time.time() > kill_at:
            for c in running:
                c.stop()
            return [f"{c.role} stage killed at the deadline (--warmup + --seconds + --grace); log tail:\n{c.tail()}"
                    for c in running]
        with contextlib.suppress(subprocess.TimeoutExpired):
            running[0].proc.wait(timeout=0.2)  # type: ignore[union-attr]


def _run_stages(args: argparse.Namespace, workdir: Path, roles: Sequence[str], budget_s: float,
                children: list[Child]) -> tuple[list[str], list[dict[str, Any]]]:
    """Start `roles` at once (perception first: it listens), wait; their reports in role order."""
    kill_at = time.time() + budget_s
    started = [Child(role, stage_command(args, role, workdir, kill_at - 5.0), workdir / f"{role}.log") for role in roles]
    children.extend(started)
    for child in started:
        print(f"ad_sim: starting {child.role}: {' '.join(child.argv)}", file=sys.stderr, flush=True)
        child.start()
    errors = wait_all(started, kill_at)
    reports = []
    for child in started:
        path = workdir / f"{child.role}.json"
        if not errors and not path.exists():
            errors.append(f"{child.role} stage exited 0 without a report; log tail:\n{child.tail()}")
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return errors, reports


def orchestrate(args: argparse.Namespace) -> int:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ad-sim-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sampler = NvmlSampler(args.gpu)
    children: list[Child] = []
    errors: list[str] = []  # every error; `fatal` says whether the run failed (NVML missing is not fatal)
    report: dict[str, Any] = {
        "scenario": SCENARIO, "mode": args.mode, "unisched": args.unisched_socket is not None, "weights": args.weights,
        "width": args.width, "height": args.height, "model": args.model, "encoder": None, "decoder": None,
        "frames": 0, "seconds": 0.0, "fps_end_to_end": 0.0, "latency_ms": latency_ms([]), "gpu_util_mean": None,
        "decoder_util_mean": None, "gpu_util_samples": [], "timeline": [], "errors": errors,
        "iterations": args.iterations}
    if args.unisched_socket is not None:
        weights = parse_weights(args.weights)
        report["tenant_weights"] = {args.tenant_prefix + TENANTS[role][0]: w for role, w in zip(TENANTS, weights, strict=True)}
    old = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    sampler.start()
    code = 0
    try:
        code = _measure(args, workdir, children, sampler, report)
    except Interrupted:
        errors.append("interrupted (Ctrl-C or SIGTERM): stages stopped")
        code = 130
    finally:
        for s in old:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        for child in children:
            child.stop()
        sampler.stop()
        for s, handler in old.items():
            signal.signal(s, handler)
    if sampler.error:
        errors.append(sampler.error)
    report["gpu"] = sampler.gpu_name
    write_json(args.report, report)
    print(summary_line(report), flush=True)
    if code:
        print(f"ad_sim: stage logs kept in {workdir}", file=sys.stderr)
    elif args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return code


def _measure(args: argparse.Namespace, workdir: Path, children: list[Child], sampler: NvmlSampler,
             report: dict[str, Any]) -> int:
    """Run the stages of the mode, fill `report`; 0, or 1 when a stage failed or no frame was measured."""
    errors: list[str] = report["errors"]
    budget = args.warmup + args.seconds + args.grace
    if args.mode == "colocated":
        errs, (perception, sim) = _run_stages(args, workdir, ("perception", "sim"), budget, children)
        owner = perception
    else:
        errs, (sim,) = _run_stages(args, workdir, ("sim",), budget, children)
        perception = {}
        if not errs:  # perception works through every frame the sim made: allow it 4x the sim's time
            errs, (perception,) = _run_stages(args, workdir, ("perception",), 4 * (args.warmup + args.seconds)
                                              + args.grace, children)
        owner = sim
        report["latency_note"] = ("sequential: transfer and end_to_end include the time frames waited in the file "
                                  "between the stages")
    errors += errs
    report["encoder"], report["encoder_error"] = sim.get("encoder"), sim.get("encoder_error")
    report["decoder"], report["decoder_frame_format"] = perception.get("decoder"), perception.get("decoder_frame_format")
    report["window"] = owner.get("window")
    report["stages"] = {"sim": {k: v for k, v in sim.items() if k != "window"},
                        "perception": {k: v for k, v in perception.items() if k not in ("records", "window")}}
    window = owner.get("window") or {}
    if errs:
        return 1
    if window.get("start") is None:
        errors.append("the stage owning the window reported no window (no frame came through)")
        return 1
    view = colocated_view if args.mode == "colocated" else sequential_view
    counted, segments = view(perception["records"], window["start"], window["end"])
    report.update(summarize(counted, segments))
    report["stage_seconds"] = [round(s.end - s.start, 4) for s in segments]
    report.update(gpu_view(sampler.samples, segments))
    if report["frames"] == 0:
        errors.append("no frame finished inside the measured window")
        return 1
    return 0


def summary_line(r: dict[str, Any]) -> str:
    how = f"under unisched {r['weights']}" if r["unisched"] else "without unisched"
    if r["errors"] and not r["frames"]:
        lines = [x for x in r["errors"][0].splitlines() if x.strip()]
        return f"ad_sim {r['mode']} {how}: FAILED: {lines[0]}" + (f" ... {lines[-1].strip()}" if len(lines) > 1 else "")
    e2e = r["latency_ms"]["end_to_end"]
    util = "GPU util n/a" if r["gpu_util_mean"] is None else \
        f"GPU util {r['gpu_util_mean']:.0f}% (NVDEC {r['decoder_util_mean']:.0f}%)"
    return (f"ad_sim {r['mode']} {how}: {r['fps_end_to_end']:.1f} frames/s end to end ({r['frames']} frames in "
            f"{r['seconds']:.1f} s), end-to-end latency p50 {e2e['p50']:.1f} ms p99 {e2e['p99']:.1f} ms, {util}; "
            f"{r['width']}x{r['height']}, encoder {r['encoder']}, decoder {r['decoder']}, {r['model']}")


# ------------------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    for action in ap._actions:  # the shared help speaks of process start; here the first frame starts the clock
        if action.dest == "warmup":
            action.help = ("seconds from the first frame out of the stage owning the window to the window's start "
                           "(default: 5)")
        elif action.dest == "start_at":
            action.help = "absolute wall-clock start of the window instead of --warmup (late start-up: first frame)"
    ap.add_argument("--mode", choices=["colocated", "sequential"], default="colocated",
                    help="colocated: both stages at once, a pipeline; sequential: sim alone into a file, then "
                         "perception alone on it (default: colocated)")
    ap.add_argument("--unisched-socket", default=None, metavar="PATH",
                    help="run each stage as a unisched tenant (`unisched run`) of the daemon on PATH: ad-sim with "
                         "engines graphics,encode, ad-perception with decode,compute (default: no scheduler)")
    ap.add_argument("--weights", default="1:1", metavar="SIM:PERCEPTION",
                    help="tenant weights, scaled so that the smaller is 100 (default: 1:1 -> 100 and 100)")
    ap.add_argument("--tenant-prefix", default="", metavar="PREFIX",
                    help="prepended to the tenant names (tests use it to keep their tenants apart; default: none)")
    ap.add_argument("--gpu", type=int, default=0, help="GPU index for NVML, CUDA and NVDEC (default: 0)")
    ap.add_argument("--grace", type=float, default=120.0,
                    help="seconds allowed for start-up and drain on top of --warmup + --seconds before stages are "
                         "killed (default: 120)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="stage logs, reports, socket and (sequential) the H.264 file (default: a temp dir, removed "
                         "after a clean run)")
    g = ap.add_argument_group("sim stage")
    g.add_argument("--width", type=int, default=1280, help="frame width (default: 1280)")
    g.add_argument("--height", type=int, default=720, help="frame height (default: 720)")
    g.add_argument("--iterations", type=int, default=300,
                   help="scene shader rounds per pixel (egl_render's FurMark shader; default: 300, moderate)")
    g.add_argument("--encoder", choices=["auto", "h264_nvenc", "libx264"], default="auto",
                   help="auto: h264_nvenc, else libx264 on the CPU (default: auto)")
    g.add_argument("--queue-kib", type=int, default=0, metavar="KIB",
                   help="socket send buffer between the stages, i.e. how far the sim may run ahead (default: 0, "
                        "the kernel's, ~208 KiB: a few 720p frames). Under freezer enforcement a deeper queue lets "
                        "each stage keep working while the other is frozen, at the cost of queueing latency")
    g.add_argument("--egl-device", type=int, default=None, metavar="INDEX",
                   help="EGL device index (default: first hardware device)")
    g = ap.add_argument_group("perception stage")
    g.add_argument("--model", choices=["resnet18", "ssdlite"], default="resnet18",
                   help="resnet18 classification at 224x224 fp16, or ssdlite320_mobilenet_v3_large detection; "
                        "random weights, nothing downloaded (default: resnet18)")
    g.add_argument("--decoder", choices=["nvdec", "cuvid", "cpu"], default="nvdec",
                   help="nvdec: PyAV hwaccel cuda, else h264_cuvid; cuvid: h264_cuvid only; cpu: software decode "
                        "(default: nvdec)")
    g = ap.add_argument_group("one stage (set by the orchestrator)")
    g.add_argument("--role", choices=["sim", "perception"], default=None,
                   help="run one stage instead of orchestrating")
    g.add_argument("--connect", type=Path, default=None, help="sim: send to perception's socket")
    g.add_argument("--output", type=Path, default=None, help="sim: write the stream to this file")
    g.add_argument("--listen", type=Path, default=None, help="perception: listen on this socket")
    g.add_argument("--input", type=Path, default=None, help="perception: read the stream from this file")
    g.add_argument("--deadline", type=float, default=None, metavar="EPOCH", help="give up at this wall-clock time")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.width <= 0 or args.height <= 0 or args.width % 2 or args.height % 2:
        ap.error("--width and --height must be positive and even (H.264 4:2:0)")
    if args.seconds <= 0 or args.warmup < 0 or args.iterations <= 0 or args.grace < 0 or args.queue_kib < 0:
        ap.error("--seconds and --iterations must be positive, --warmup, --grace and --queue-kib not negative")
    try:
        parse_weights(args.weights)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if args.role == "sim" and (args.connect is None) == (args.output is None):
        ap.error("--role sim needs exactly one of --connect or --output")
    if args.role == "perception" and (args.listen is None) == (args.input is None):
        ap.error("--role perception needs exactly one of --listen or --input")
    if args.role is not None and args.deadline is None:
        args.deadline = time.time() + args.warmup + args.seconds + args.grace
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "sim":
        return run_sim(args)
    if args.role == "perception":
        return run_perception(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
