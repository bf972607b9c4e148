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
fps_1pct_low (1 / the 99th-percentile frame time), frames, encoder, memory_bytes (NVML, this process), stage
times, cpu_cores (this player's CPU over the window, in cores), a timeline [[t, fps], ...] per 1-second bin.
Overall: fairness_min_over_max, fps_mean_all, cpu_cores_total against host_cores (a CPU-bound host shows here), the
daemon's view of the tenants after the window (`unisched tenants --json`: memory, over_memory, refusals) and a hog
summary.
The exit status is non-zero when an instance failed or had to be killed at the deadline (its log tail is in the
report's errors).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # unisched: the daemon's NVML telemetry, size parser
sys.path.insert(0, str(Path(__file__).resolve().parent / "workloads"))
from _window import add_window_args, fail, percentile, plan_window, write_json
from egl_render import EGLUnavailable, GLContext, Renderer, create_context, gl_context

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCENARIO = "cloud_gaming"
ENCODERS_AUTO = ("h264_nvenc", "libx264", "libopenh264")  # GPU encoder first; CPU ones where it does not open
ENCODER_OPTIONS: dict[str, dict[str, str]] = {
    "h264_nvenc": {"preset": "p1", "tune": "ull", "zerolatency": "1"},
    "libx264": {"preset": "ultrafast", "tune": "zerolatency"},
}
BUFFER_CHUNK = 256 << 20  # the hog's GL buffers: several moderate ones rather than one huge allocation
LOG_TAIL_CHARS = 3000
PROBE_TIMEOUT_S = 30.0
SOFTWARE_ONLY = "only a software EGL device opened"
LATE_S = 0.5  # an instance whose first frame came later than this into the window did not share it


# ----------------------------------------------------------------------------------------- metrics (pure)




@dataclass(frozen=True)
class FrameStats:
    """What a player saw over one window."""

    frames: int
    seconds: float
    fps_mean: float
    fps_min: float
    fps_1pct_low: float | None  # None with fewer than two frames
    frame_time_p99_ms: float | None
    timeline: list[list[float]]  # [[seconds since the window start, fps in that bin], ...]


def frame_stats(completions: Sequence[float], start: float, end: float, bin_s: float = 1.0) -> FrameStats:
    """Frame-rate figures from frame completion times (seconds), counting those in (start, end].

    fps_min is the lowest full `bin_s` bin (a window shorter than one bin is one bin): a mean hides a frozen second.
    The 1% low is the frame rate of the 99th-percentile frame time; each counted frame's time is the gap since
    the previous completion, the one before the window included, so a stall across the start still counts; the
    frame still in progress at the end counts with the time it has taken so far, so a stall at the end counts too.
    """
    seconds = max(0.0, end - start)
    times = sorted(completions)
    inside = [t for t in times if start < t <= end]
    width = bin_s if seconds >= bin_s else max(seconds, 1e-9)
    nbins = max(1, int(seconds / width + 1e-9))
    counts = [0] * nbins
    for t in inside:
        k = int((t - start) / width)
        if k < nbins:
            counts[k] += 1
    timeline = [[round(k * width, 3), round(c / width, 3)] for k, c in enumerate(counts)]
    gaps = [b - a for a, b in itertools.pairwise(times) if start < b <= end]
    done = [t for t in times if t <= end]
    gaps.append(end - max(done[-1], start) if done else seconds)
    p99 = percentile(gaps, 99) if gaps else None
    return FrameStats(
        frames=len(inside), seconds=seconds, fps_mean=len(inside) / seconds if seconds > 0 else 0.0,
        fps_min=min(c / width for c in counts), fps_1pct_low=1.0 / p99 if p99 else None,
        frame_time_p99_ms=round(1000.0 * p99, 3) if p99 is not None else None, timeline=timeline)


def fairness(fps: Sequence[float]) -> float | None:
    """Lowest / highest mean FPS: 1.0 when every player gets the same frame rate; 0 when one got nothing."""
    if not fps:
        return None
    top = max(fps)
    return min(fps) / top if top > 0 else 0.0


# ------------------------------------------------------------------------------------------- pacing (pure)


def first_slot(t0: float, period: float, now: float) -> int:
    """The first frame slot (slot k starts at t0 + k * period) that has not begun yet."""
    return math.ceil((now - t0) / period)


def next_slot(slot: int, now: float, t0: float, period: float) -> int:
    """The slot the next frame belongs to, given the current one's slot and its completion time `now`.

    On time: the next slot (sleep until it begins). Late by less than a period: still the next slot, whose start
    has passed, so the frame starts at once. Later than that: the slot under way now (missed ones are skipped, not
    caught up in a burst). Deadlines are always t0 + k * period, so sleeping and overruns never make the pace drift.
    """
    return max(slot + 1, math.floor((now - t0) / period))


@dataclass
class Paced:
    completions: list[float] = field(default_factory=list)  # wall time of every completed frame up to the end
    skipped_slots: int = 0  # frame slots inside the window that no frame started in


@dataclass
class CpuMeter:
    """This player's CPU time (every thread of it, the software encoder's too) over the frames in its window, in
    cores. With the host's cores it tells a CPU-bound host from a GPU-bound one: where the players need more cores
    than there are, no GPU scheduler can make their frame rates follow the weights."""

    start_at: float
    cpu: Callable[[], float] = time.process_time
    first: tuple[float, float] | None = None  # (wall, CPU seconds) at the first frame done in the window
    last: tuple[float, float] | None = None

    def on_frame(self, now: float) -> None:
        if now >= self.start_at:
            mark = (now, self.cpu())
            self.first = self.first or mark
            self.last = mark

    def cores(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


def paced_loop(step: Callable[[], object], start_at: float, end_at: float, t0: float, period: float,
               on_frame: Callable[[float], None] | None = None, clock: Callable[[], float] = time.time,
               sleep: Callable[[float], None] = time.sleep) -> Paced:
    """Run `step` (one whole frame) until end_at, one frame per slot when period > 0, as fast as it goes otherwise.

    The clock and sleep are parameters so the pacing can be tested without a GPU and without waiting.
    """
    out = Paced()
    slot = first_slot(t0, period, clock()) if period > 0 else 0
    while True:
        if period > 0:
            due = t0 + slot * period
            if due > end_at:
                break
            wait = due - clock()
            if wait > 0:
                sleep(wait)
        step()
        now = clock()
        if now > end_at:
            break
        out.completions.append(now)
        if on_frame is not None:
            on_frame(now)
        if period > 0:
            following = next_slot(slot, now, t0, period)
            if now >= start_at:
                out.skipped_slots += following - slot - 1
            slot = following
    return out


# ----------------------------------------------------------------------------------------- the instance


@dataclass
class Encoder:
    """One H.264 encoder (PyAV) fed RGBA frames; it converts them to yuv420p itself."""

    name: str
    ctx: Any
    not_opened: list[str]  # "encoder: why" for each one tried before this one
    frames: int = 0
    bytes_out: int = 0

    def encode(self, rgba: Any) -> None:
        import av

        frame = av.VideoFrame.from_ndarray(rgba, format="rgba")
        frame.pts = self.frames
        self.frames += 1
        self.bytes_out += sum(p.size for p in self.ctx.encode(frame))

    def close(self) -> None:
        self.bytes_out += sum(p.size for p in self.ctx.encode(None))


def open_encoder(choice: str, width: int, height: int, fps: float) -> Encoder:
    """The first encoder of the choice ('auto': h264_nvenc, then libx264, libopenh264) that opens."""
    import av

    names = ENCODERS_AUTO if choice == "auto" else (choice,)
    rate = Fraction(fps if fps > 0 else 60).limit_denominator(1001)
    errors: list[str] = []
    for name in names:
        try:
            ctx: Any = av.CodecContext.create(name, "w")
            ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
            ctx.framerate, ctx.time_base = rate, 1 / rate
            ctx.thread_count = 1  # one encode thread per player: density is also a CPU budget
            ctx.max_b_frames = 0  # streaming: every frame in gives its packet out at once, nothing held back
            ctx.options = dict(ENCODER_OPTIONS.get(name, {}))
            ctx.open()
        except Exception as e:  # not in this build, or (h264_nvenc on the H200) no NVENC engine to open
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        return Encoder(name, ctx, errors)
    raise RuntimeError("no H.264 encoder opened (" + "; ".join(errors) + ")")


class StreamPipeline:
    """Render -> read back -> encode, one whole frame per step(), with the time each stage took."""

    def __init__(self, renderer: Renderer, encoder: Encoder) -> None:
        import numpy as np

        self.renderer, self.encoder = renderer, encoder
        self.pixels = np.empty((renderer.height, renderer.width, 4), dtype=np.uint8)
        self.stages: list[tuple[float, float, float]] = []

    def step(self) -> int:
        gl = self.renderer.gl
        t0 = time.perf_counter()
        self.renderer.step()  # draw + glFinish
        t1 = time.perf_counter()
        # Bottom-up rows, as GL stores them: the stream is upside down, which costs the encoder nothing.
        gl.glReadPixels(0, 0, self.renderer.width, self.renderer.height, gl.GL_RGBA, gl.GL_UNSIGNED_BYTE, self.pixels)
        t2 = time.perf_counter()
        self.encoder.encode(self.pixels)
        self.stages.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return 1


class OwnGpuMemory:
    """GPU memory NVML lists for this process (graphics and compute lists, as the daemon's memory cap reads them).

    Opened once at start: over its cap a tenant may no longer open GPU device nodes, so a later nvmlInit could fail.
    """

    def __init__(self) -> None:
        self.nvml: Any = None
        self.handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.nvml = pynvml
        except Exception:  # no pynvml, no driver: the report says None
            pass

    def read(self) -> int | None:
        if self.nvml is None:
            return None
        pid, total, seen = os.getpid(), 0, False
        for h in self.handles:
            used = 0
            for query in (self.nvml.nvmlDeviceGetGraphicsRunningProcesses, self.nvml.nvmlDeviceGetComputeRunningProcesses):
                try:
                    for proc in query(h):
                        if proc.pid == pid and isinstance(proc.usedGpuMemory, int):
                            used, seen = max(used, proc.usedGpuMemory), True
                except Exception:  # NVMLError: one list unavailable
                    continue
            total += used
        return total if seen else None

    def close(self) -> None:
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()


def probe_second_context(ctx: GLContext) -> dict[str, Any]:
    """Try one more EGL context in this process (a new graphics session), then make ours current again."""
    egl, dpy = ctx.egl, ctx.display.handle
    t = time.perf_counter()
    extra = None
    try:
        extra = create_context(egl, ctx.display)  # current on success
        from OpenGL import GL as gl  # type: ignore[import-not-found, unused-ignore]

        gl.glClear(gl.GL_COLOR_BUFFER_BIT)
        gl.glFinish()
        software = "software" in ctx.display.source  # Mesa llvmpipe: no GPU session, so not "opened"
        result: dict[str, Any] = {"opened": not software, "error": SOFTWARE_ONLY if software else None}
    except Exception as e:  # EGLUnavailable (eglCreateContext failed: EPERM from the hooks shows as EGL_BAD_ALLOC) or GL
        result = {"opened": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        egl.lib.eglMakeCurrent(dpy, ctx.surface, ctx.surface, ctx.context)
        if extra is not None:
            if extra.surface:
                egl.lib.eglDestroySurface(dpy, extra.surface)
            egl.lib.eglDestroyContext(dpy, extra.context)
    result["ms"] = round(1000 * (time.perf_counter() - t), 1)
    return result


class Hog:
    """The instance that goes over its memory cap: allocates at `alloc_at`, probes for a new session later."""

    def __init__(self, args: argparse.Namespace, ctx: GLContext, renderer: Renderer, start_at: float,
                 memory: OwnGpuMemory) -> None:
        self.mib = args.hog_mib
        self.memory = memory
        self.ctx, self.gl = ctx, renderer.gl
        self.start_at = start_at
        self.alloc_at = start_at + args.hog_at
        self.probe_at = self.alloc_at + args.probe_after
        self.egl_device = args.egl_device
        self.buffers: list[int] = []
        self.child: subprocess.Popen[str] | None = None
        self.child_started = 0.0
        self.report: dict[str, Any] = {"mib": self.mib, "allocated": False, "alloc_error": None,
                                       "probe_in_process": None, "probe_new_process": None}

    def tick(self, now: float) -> None:
        """Called after every frame: each step runs once, when its time has come."""
        if not self.report["allocated"] and self.report["alloc_error"] is None and now >= self.alloc_at:
            self.allocate(now)
        elif self.report["probe_in_process"] is None and now >= self.probe_at:
            self.report["probe_at_s"] = round(now - self.start_at, 3)
            self.start_probe_process()  # first: should the in-process attempt take this process down, it still ran
            self.report["probe_in_process"] = probe_second_context(self.ctx)
        elif self.child is not None and self.child.poll() is not None:
            self.collect_probe_process()

    def allocate(self, now: float) -> None:
        gl = self.gl
        t = time.perf_counter()
        self.report["alloc_at_s"] = round(now - self.start_at, 3)
        try:
            left = self.mib << 20
            fill = bytes([0xA5])
            while left > 0:
                size = min(left, BUFFER_CHUNK)
                buf = int(gl.glGenBuffers(1))
                self.buffers.append(buf)
                gl.glBindBuffer(gl.GL_COPY_WRITE_BUFFER, buf)
                gl.glBufferData(gl.GL_COPY_WRITE_BUFFER, size, None, gl.GL_STATIC_DRAW)
                # a GPU-side write of every byte, so the driver really backs the buffer and NVML counts it
                gl.glClearBufferData(gl.GL_COPY_WRITE_BUFFER, gl.GL_R8UI, gl.GL_RED_INTEGER, gl.GL_UNSIGNED_BYTE, fill)
                left -= size
            gl.glBindBuffer(gl.GL_COPY_WRITE_BUFFER, 0)
            gl.glFinish()
            self.report["allocated"] = True
        except Exception as e:  # GL_OUT_OF_MEMORY, or GL < 4.3 without glClearBufferData
            self.report["alloc_error"] = f"{type(e).__name__}: {e}"
        self.report["alloc_ms"] = round(1000 * (time.perf_counter() - t), 1)
        self.report["buffers"] = len(self.buffers)
        self.report["memory_bytes_after_alloc"] = self.memory.read()

    def start_probe_process(self) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--role", "probe"]
        if self.egl_device is not None:
            argv += ["--egl-device", str(self.egl_device)]
        self.child_started = time.time()
        self.child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def collect_probe_process(self, timeout: float = 0.0) -> None:
        child = self.child
        if child is None:
            return
        self.child = None
        try:
            out, _ = child.communicate(timeout=timeout or None)
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
            self.report["probe_new_process"] = {"opened": False, "error": f"probe hung; killed after {timeout:.0f} s"}
            return
        line = out.strip().splitlines()[-1] if out.strip() else ""
        try:
            found = json.loads(line) if child.returncode == 0 else None
        except ValueError:
            found = None
        if not isinstance(found, dict):
            found = {"opened": False, "error": line[-500:] or f"exit status {child.returncode}"}
        found["ms"] = round(1000 * (time.time() - self.child_started), 1)
        self.report["probe_new_process"] = found

    def finish(self) -> dict[str, Any]:
        """After the window: wait (bounded) for the probe process, then give the memory back."""
        if self.child is not None:
            self.collect_probe_process(timeout=max(1.0, PROBE_TIMEOUT_S - (time.time() - self.child_started)))
        if self.buffers:
            self.gl.glDeleteBuffers(len(self.buffers), self.buffers)
        return self.report


def run_instance(args: argparse.Namespace, process_start: float) -> int:
    try:
        import av  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        return fail(f"{e.name} is not importable; pip install 'unisched[codec]' numpy (GPU machine: .devcache/setup.sh)")
    start_at, end_at = plan_window(args, process_start)
    period = 1.0 / args.fps if args.fps > 0 else 0.0
    t0 = start_at + args.phase * period
    with gl_context(args.egl_device) as ctx:
        renderer = Renderer(args.width, args.height)
        renderer.set_iterations(args.iterations)
        encoder = open_encoder(args.encoder, args.width, args.height, args.fps)
        pipeline = StreamPipeline(renderer, encoder)
        nvml = OwnGpuMemory()
        hog = Hog(args, ctx, renderer, start_at, nvml) if args.hog_mib else None
        meter = CpuMeter(start_at)

        def on_frame(now: float) -> None:
            meter.on_frame(now)
            if hog is not None:
                hog.tick(now)

        paced = paced_loop(pipeline.step, start_at, end_at, t0, period, on_frame)
        encoder.close()
        memory = nvml.read()
        hog_report = hog.finish() if hog is not None else None
        nvml.close()
        info = renderer.info()
    done, cores = paced.completions, meter.cores()
    window_start = start_at if done and done[0] < start_at else (done[0] if done else start_at)
    stats = frame_stats(done, window_start, end_at)
    in_window = [s for t, s in zip(done, pipeline.stages, strict=False) if window_start < t]
    stage_ms = {name: round(1000 * sum(s[k] for s in in_window) / len(in_window), 3) if in_window else None
                for k, name in enumerate(("render", "readback", "encode"))}
    report = {
        "role": "instance", "index": args.index, "pid": os.getpid(), **asdict(stats),
        "fps_target": args.fps, "width": args.width, "height": args.height, "iterations": renderer.iterations,
        "encoder": encoder.name, "encoders_not_opened": encoder.not_opened, "encoded_bytes": encoder.bytes_out,
        "memory_bytes": memory, "skipped_slots": paced.skipped_slots, "stage_ms": stage_ms,
        "cpu_cores": None if cores is None else round(cores, 3),
        "window": {"start_at": start_at, "end_at": end_at, "window_start": window_start,
                   "late_s": round(window_start - start_at, 3)},
        "egl_display": ctx.display.source, "gl_context": f"{ctx.version[0]}.{ctx.version[1]} core",
        "gl_renderer": info["gl_renderer"], "hog": hog_report,
    }
    write_json(args.report, report)
    low = f"{stats.fps_1pct_low:.1f}" if stats.fps_1pct_low is not None else "n/a"
    print(f"cloud_gaming instance {args.index} pid={os.getpid()}: {stats.fps_mean:.1f} fps mean, {stats.fps_min:.1f} min, "
          f"{low} 1% low ({stats.frames} frames, {args.width}x{args.height}, {encoder.name}, {info['gl_renderer']})",
          flush=True)
    return 0


def run_probe(args: argparse.Namespace) -> int:
    """A new process asking for a GPU session, as a container launching one more game would."""
    try:
        with gl_context(args.egl_device) as ctx:
            from OpenGL import GL as gl  # type: ignore[import-not-found, unused-ignore]

            gl.glClear(gl.GL_COLOR_BUFFER_BIT)
            gl.glFinish()
            source = ctx.display.source
    except EGLUnavailable as e:
        return fail(f"EGL: {e}", code=3)
    except Exception as e:
        return fail(f"{type(e).__name__}: {e}", code=3)
    software = "software" in source  # Mesa llvmpipe is no GPU session: say so rather than call it admitted
    print(json.dumps({"opened": not software, "egl_display": source, "error": SOFTWARE_ONLY if software else None}),
          flush=True)
    return 0




# ------------------------------------------------------------------------------------- the orchestrator


def unisched_argv(python: str, socket: str, *args: str) -> list[str]:
    """A `unisched` client command on the daemon's socket (run as a module: works without the console script)."""
    return [python, "-m", "unisched", args[0], "--socket", socket, *args[1:]]


def weight_of(args: argparse.Namespace, index: int) -> int:
    """Instance `index`'s weight: its group's with --weights (round robin, times 100), else --weight."""
    if not args.weights:
        return int(args.weight)
    groups = [int(w) for w in str(args.weights).split(",")]
    return 100 * groups[index % len(groups)]


def run_argv(python: str, socket: str, tenant: str, weight: int, engines: str, cmd: Sequence[str]) -> list[str]:
    """`unisched run`: the command starts in the tenant's own cgroup, behind the session hooks."""
    return unisched_argv(python, socket, "run", "--tenant", tenant, "--weight", str(weight), "--engines", engines,
                         "--", *cmd)


def set_limit_argv(python: str, socket: str, tenant: str, memory: str) -> list[str]:
    """`unisched set-limit --memory` (admin); '-1' clears a cap an earlier run left on the tenant."""
    return unisched_argv(python, socket, "set-limit", "--tenant", tenant, "--memory", memory)


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
    if args.hog_mib and index == args.hog_instance:
        argv += ["--hog-mib", str(args.hog_mib), "--hog-at", f"{args.hog_at:g}", "--probe-after", f"{args.probe_after:g}"]
    return argv


def child_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH (so `python3 -m unisched` is this one) and headless EGL for PyOpenGL."""
    paths = [str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "PYTHONUNBUFFERED": "1",
            "PYOPENGL_PLATFORM": os.environ.get("PYOPENGL_PLATFORM", "egl")}


def tail(path: Path, limit: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return ""


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM then SIGKILL to a child and everything it started (it leads its own session)."""
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the orchestrator: stop the children, still write what is known."""


def _interrupt(_signum: int, _frame: object) -> None:
    raise Interrupted


@dataclass
class Child:
    index: int
    tenant: str | None
    argv: list[str]
    report: Path
    log: Path
    proc: subprocess.Popen[bytes]
    stopped: str | None = None  # why we stopped it, if we did


class Daemon:
    """The orchestrator's calls to the daemon, all through the `unisched` command line."""

    def __init__(self, socket: str, env: dict[str, str]) -> None:
        self.socket, self.env = socket, env

    def call(self, *args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(unisched_argv(sys.executable, self.socket, *args), capture_output=True, text=True,
                              timeout=timeout, env=self.env, cwd=ROOT)

    def tenants(self) -> list[dict[str, Any]] | None:
        try:
            p = self.call("tenants", "--json")
            found = json.loads(p.stdout) if p.returncode == 0 else None
            return found if isinstance(found, list) else None
        except (subprocess.TimeoutExpired, ValueError):
            return None

    def set_limits(self, names: Sequence[str], memory: str) -> dict[str, str | None]:
        """`set-limit --memory` on each tenant at once (in parallel: N start-ups must fit in the warm-up)."""
        procs = {n: subprocess.Popen(set_limit_argv(sys.executable, self.socket, n, memory), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self.env, cwd=ROOT) for n in names}
        out: dict[str, str | None] = {}
        for n, p in procs.items():
            try:
                text, _ = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            out[n] = None if p.returncode == 0 else (text.strip()[-300:] or f"exit status {p.returncode}")
        return out


def apply_caps(daemon: Daemon, names: Sequence[str], memory: str, until: float,
               alive: Callable[[], bool]) -> tuple[dict[str, float], list[str]]:
    """Cap every tenant as soon as the daemon knows it, polling `tenants --json` until `until` at the latest.

    Returns (the time each cap was applied, errors).
    """
    pending = set(names)
    applied: dict[str, float] = {}
    errors: list[str] = []
    while pending:
        known = {t["name"] for t in daemon.tenants() or []}
        ready = sorted(pending & known)
        for name, err in daemon.set_limits(ready, memory).items():
            pending.discard(name)
            if err is None:
                applied[name] = time.time()
            else:
                errors.append(f"set-limit --memory {memory} on {name} failed: {err}")
        if not pending or time.time() >= until or not alive():
            break
        time.sleep(0.5)  # each poll is a Python start-up: leave the CPUs to the starting players
    errors += [f"tenant {n} did not appear before the window; its memory cap was not applied" for n in sorted(pending)]
    return applied, errors


def refusal_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    """Refusals counted during this run (the daemon keeps counting across runs of a tenant name)."""
    before, after = before or {}, after or {}
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] - before.get(k, 0)}


def daemon_row(tenants: list[dict[str, Any]] | None, name: str | None) -> dict[str, Any] | None:
    return next((t for t in tenants or [] if t.get("name") == name), None)


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
    old_term = signal.signal(signal.SIGTERM, _interrupt)
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
            if daemon is not None and final is None and now >= end_at:
                final = daemon.tenants()  # at the end of the window, while the instances still hold their memory
            elif daemon is not None and args.daemon_poll > 0 and start_at <= now < end_at and now >= next_poll:
                polls.append({"t": round(now - start_at, 2), "tenants": compact(daemon.tenants(), names)})
                next_poll = now + args.daemon_poll
            else:
                time.sleep(0.1)
        for c in children:
            if c.proc.poll() is None:
                c.stopped = "killed at the deadline"
                stop_group(c.proc)
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
        errors.append("interrupted: instances stopped")
        for c in children:
            if c.proc.poll() is None:
                c.stopped = "stopped: interrupted"
                stop_group(c.proc)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    if daemon is not None and final is None and not interrupted:
        final = daemon.tenants()
    summary = write_summary(args, children, before, final, polls, caps_applied, errors, start_at)
    print_table(summary, out)
    return 130 if interrupted else 1 if summary["errors"] else 0


def compact(tenants: list[dict[str, Any]] | None, names: Sequence[str | None]) -> dict[str, Any]:
    """The daemon's view of our tenants, reduced to what the memory story needs."""
    keep = ("memory_bytes", "over_memory", "state", "refusals")
    return {t["name"]: {k: t.get(k) for k in keep} for t in tenants or [] if t.get("name") in names}


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_summary(args: argparse.Namespace, children: list[Child], before: list[dict[str, Any]] | None,
                  final: list[dict[str, Any]] | None, polls: list[dict[str, Any]], caps_applied: dict[str, float],
                  errors: list[str | dict[str, Any]], start_at: float) -> dict[str, Any]:
    """Per-instance figures, fairness, the daemon's view and the hog's story, as one report (--report)."""
    per: list[dict[str, Any]] = []
    reports: list[dict[str, Any] | None] = []
    for c in children:
        r = read_json(c.report)
        reports.append(r)
        rc = c.proc.poll()
        got = r or {"fps_mean": 0.0, "fps_min": 0.0, "frames": 0}  # a player that reported nothing showed nothing
        row = daemon_row(final, c.tenant)
        entry: dict[str, Any] = {
            "index": c.index, "tenant": c.tenant, "rc": rc, "weight": weight_of(args, c.index),
            **{k: got.get(k) for k in ("pid", "fps_mean", "fps_min", "fps_1pct_low", "frame_time_p99_ms", "frames",
                                       "encoder", "skipped_slots", "stage_ms", "cpu_cores", "timeline")},
            "late_s": (got.get("window") or {}).get("late_s"),
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
            errors.append({"instance": c.index, "tenant": c.tenant, "error": why, "log_tail": tail(c.log)})
        elif (entry["late_s"] or 0) > LATE_S:
            entry["error"] = f"started {entry['late_s']:.1f} s into the window: give a longer --warmup"
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


def hog_summary(args: argparse.Namespace, per: list[dict[str, Any]], reports: list[dict[str, Any] | None],
                polls: list[dict[str, Any]], others: list[float]) -> dict[str, Any] | None:
    """What happened to the instance that went over its cap, and to everyone else meanwhile."""
    if not args.hog_mib or args.hog_instance >= len(per):
        return None
    k = args.hog_instance
    entry, own = per[k], (reports[k] or {}).get("hog") or {}
    name = entry["tenant"]
    seen_over = [p["t"] for p in polls if (p["tenants"].get(name) or {}).get("over_memory")]
    if entry["over_memory"]:
        seen_over.append(round(args.seconds, 2))
    probes = {w: own.get(f"probe_{w}") or {} for w in ("in_process", "new_process")}
    refused = {w: p.get("error") for w, p in probes.items() if p and not p.get("opened")}
    out: dict[str, Any] = {
        "instance": k, "tenant": name, **own, "memory_bytes": entry["memory_bytes"],
        "daemon_over_memory": bool(seen_over) if args.unisched_socket else None,
        "daemon_over_memory_first_seen_s": min(seen_over) if seen_over else None,
        "daemon_refusals": entry["refusals"], "refused": bool(refused),
        "refused_error": "; ".join(f"{w}: {e}" for w, e in refused.items()) or None,
        "others_fps_mean": sum(others) / len(others) if others else None,
    }
    tried = [w for w, p in probes.items() if p]
    state = ("not tried" if not tried else f"did not open ({out['refused_error']})" if refused else "opened")
    cap = f"(cap {args.memory_cap})" if args.memory_cap else "(no cap)"
    alloc = (f"allocated {args.hog_mib} MiB" if own.get("allocated") else
             f"allocation failed ({own['alloc_error']})" if own.get("alloc_error") else "reported no allocation")
    daemon = ("" if not args.unisched_socket else
              f", daemon over_memory={out['daemon_over_memory']} refusals={entry['refusals'] or {}}")
    out["summary"] = f"instance {k} {alloc} {cap}; new GPU session {state}{daemon}"
    return out


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
        return run_instance(args, process_start)
    except EGLUnavailable as e:
        return fail(f"EGL unavailable: {e}")
    except ImportError as e:
        return fail(f"{e.name or e} is not importable ({e}); on the GPU machine source .devcache/setup.sh")
    except Exception as e:  # GL or encoder errors: one clear line instead of a bare traceback
        return fail(f"instance failed: {type(e).__name__}: {e}", code=3)


if __name__ == "__main__":
    sys.exit(main())
