"""One cloud-gaming player (examples/cloud_gaming.py --role instance) and the probe its hog starts (--role probe).

A player renders the shader scene of egl_render.py, reads each frame back and encodes it to H.264, paced to its
frame rate, and writes its report (frame-rate figures, stage times, encoder, GPU memory, CPU). The hog is the player
that goes over its memory cap and then asks for one more GPU session, in its own process and in a new one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from _egl import EGLUnavailable, GLContext, create_context, gl_context
from _pacing import CpuMeter, frame_stats, paced_loop
from _window import fail, plan_window, write_json
from egl_render import Renderer

ENCODERS_AUTO = ("h264_nvenc", "libx264", "libopenh264")  # GPU encoder first; CPU ones where it does not open
ENCODER_OPTIONS: dict[str, dict[str, str]] = {
    "h264_nvenc": {"preset": "p1", "tune": "ull", "zerolatency": "1"},
    "libx264": {"preset": "ultrafast", "tune": "zerolatency"},
}
BUFFER_CHUNK = 256 << 20  # the hog's GL buffers: several moderate ones rather than one huge allocation
PROBE_TIMEOUT_S = 30.0
SOFTWARE_ONLY = "only a software EGL device opened"


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
                 memory: OwnGpuMemory, probe_argv: list[str]) -> None:
        self.mib = args.hog_mib
        self.memory = memory
        self.ctx, self.gl = ctx, renderer.gl
        self.start_at = start_at
        self.alloc_at = start_at + args.hog_at
        self.probe_at = self.alloc_at + args.probe_after
        self.probe_argv = probe_argv + ([] if args.egl_device is None else ["--egl-device", str(args.egl_device)])
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
        self.child_started = time.time()
        self.child = subprocess.Popen(self.probe_argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

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


def run_instance(args: argparse.Namespace, process_start: float, probe_argv: list[str]) -> int:
    """One player over its window; `probe_argv` starts the new process the hog asks for a session in."""
    try:
        import av  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        return fail(f"{e.name} is not importable; pip install 'unisched[codec]' numpy (GPU machine: .devcache/setup.sh)")
    if args.player_cpus:  # before the GL context: a software rasterizer's threads inherit it
        os.sched_setaffinity(0, args.player_cpus)
    start_at, end_at = plan_window(args, process_start)
    period = 1.0 / args.fps if args.fps > 0 else 0.0
    t0 = start_at + args.phase * period
    with gl_context(args.egl_device) as ctx:
        renderer = Renderer(args.width, args.height)
        renderer.set_iterations(args.iterations)
        encoder = open_encoder(args.encoder, args.width, args.height, args.fps)
        pipeline = StreamPipeline(renderer, encoder)
        nvml = OwnGpuMemory()
        hog = Hog(args, ctx, renderer, start_at, nvml, probe_argv) if args.hog_mib else None
        meter = CpuMeter(start_at)

        def on_frame(now: float) -> None:
            meter.on_frame(now)
            if hog is not None:
                hog.tick(now)

        ready_at = time.time()  # started up: what follows is the window's, frozen time included
        paced = paced_loop(pipeline.step, start_at, end_at, t0, period, on_frame)
        encoder.close()
        memory = nvml.read()
        hog_report = hog.finish() if hog is not None else None
        nvml.close()
        info = renderer.info()
    done, cores, user = paced.completions, meter.cores(), meter.user_cores()
    # Ready in time, the player shared the whole window, however long the scheduler held it; ready late, its
    # window starts at its first frame, and the orchestrator reports it as late.
    window_start = start_at if ready_at <= start_at or not done else max(start_at, done[0])
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
        "cpu_user_cores": None if user is None else round(user, 3),
        "window": {"start_at": start_at, "end_at": end_at, "window_start": window_start,
                   "late_s": round(window_start - start_at, 3), "ready_s": round(ready_at - start_at, 3),
                   "first_frame_s": round(done[0] - start_at, 3) if done else None},
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
