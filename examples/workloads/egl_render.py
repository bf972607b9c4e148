#!/usr/bin/env python3
"""Heavy headless render tenant: a FurMark-style fragment-shader loop through EGL + OpenGL.

Why it looks like this: it is the "render" side of the sharing benchmark (bench/gpu_pairs.py). It
needs no display: EGL's device platform opens the GPU directly, an OpenGL 4.x core context renders
into a 1920x1080 framebuffer object, and every frame is one full-screen quad whose fragment shader
runs `--iterations` rounds of arithmetic per pixel. glFinish after each frame keeps at most one
frame in flight, so a frozen tenant stops using the GPU within one frame time. Such a load
ran at 36.9 FPS alone on the H200 (graphics runs on few SMs there); `--calibrate-fps`
finds the iteration count that gives a chosen frame rate on the machine at hand. With `--client
TENANT` every frame runs inside `FrameGate` (unisched_client.gl), as a render app using the client
library would: the cooperative side of bench/mixed_engines.py's render pairs.

Output: one human line on stdout, and with --report a JSON file
  {"kind": "render", "throughput": frames/s, "unit": "frames/s", "items": n, "seconds": window, "pid": ...}
counting only frames finished inside the measured window (see _window.py).

The display and context come from _egl.py (EGL through ctypes, GL through PyOpenGL).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _egl import EGL_VENDOR, EGLUnavailable, gl_context
from _window import add_window_args, fail, measure, plan_window, write_report

KIND = "render"
UNIT = "frames/s"

VERTEX_SHADER = """
#version 330 core
// Full-screen quad from gl_VertexID alone (drawn as a 4-vertex triangle strip): no vertex buffers.
void main() {
    vec2 p = vec2(float(gl_VertexID & 1), float(gl_VertexID >> 1));
    gl_Position = vec4(p * 2.0 - 1.0, 0.0, 1.0);
}
"""

FRAGMENT_SHADER = """
#version 330 core
// FurMark-style per-pixel burner: a bounded complex iteration with transcendental terms. The loop
// count is a uniform (the compiler cannot unroll it away), every pixel runs the same count (no
// divergence), and the colour depends on every round (nothing is dead code).
uniform int u_iters;
uniform float u_time;
uniform vec2 u_res;
out vec4 frag_color;
void main() {
    vec2 uv = (2.0 * gl_FragCoord.xy - u_res) / u_res.y;
    vec2 z = uv;
    vec2 c = vec2(-0.745 + 0.05 * sin(u_time * 0.7), 0.186 + 0.05 * cos(u_time * 0.5));
    vec3 acc = vec3(0.0);
    for (int i = 0; i < u_iters; ++i) {
        z = vec2(z.x * z.x - z.y * z.y, 2.0 * z.x * z.y) + c;
        z *= inversesqrt(1.0 + dot(z, z));
        acc += vec3(sin(z.x * 5.0 + u_time), cos(z.y * 5.0 - u_time), z.x * z.y);
    }
    acc /= float(max(u_iters, 1));
    frag_color = vec4(0.5 + 0.5 * acc, 1.0);
}
"""


# ---------------------------------------------------------------------------------------------- GL


def _compile(gl: Any, kind: int, source: str) -> int:
    shader = gl.glCreateShader(kind)
    gl.glShaderSource(shader, source)
    gl.glCompileShader(shader)
    if not gl.glGetShaderiv(shader, gl.GL_COMPILE_STATUS):
        log = gl.glGetShaderInfoLog(shader)
        raise RuntimeError(f"shader compile failed: {log.decode(errors='replace') if log else '?'}")
    return int(shader)


def _link(gl: Any, vs: int, fs: int) -> int:
    """Link without glValidateProgram: validation can fail spuriously in core profile."""
    program = gl.glCreateProgram()
    gl.glAttachShader(program, vs)
    gl.glAttachShader(program, fs)
    gl.glLinkProgram(program)
    if not gl.glGetProgramiv(program, gl.GL_LINK_STATUS):
        log = gl.glGetProgramInfoLog(program)
        raise RuntimeError(f"program link failed: {log.decode(errors='replace') if log else '?'}")
    return int(program)


class Renderer:
    """The render target (FBO), the burner program, and one-frame steps."""

    def __init__(self, width: int, height: int) -> None:
        from OpenGL import GL as gl  # type: ignore[import-not-found, unused-ignore]  # lazy: needs a current context

        self.gl = gl
        self.width, self.height = width, height
        self.program = _link(gl, _compile(gl, gl.GL_VERTEX_SHADER, VERTEX_SHADER),
                             _compile(gl, gl.GL_FRAGMENT_SHADER, FRAGMENT_SHADER))
        self.vao = gl.glGenVertexArrays(1)  # core profile draws need a bound VAO, even an empty one
        gl.glBindVertexArray(self.vao)
        self.fbo = gl.glGenFramebuffers(1)
        gl.glBindFramebuffer(gl.GL_FRAMEBUFFER, self.fbo)
        self.rbo = gl.glGenRenderbuffers(1)
        gl.glBindRenderbuffer(gl.GL_RENDERBUFFER, self.rbo)
        gl.glRenderbufferStorage(gl.GL_RENDERBUFFER, gl.GL_RGBA8, width, height)
        gl.glFramebufferRenderbuffer(gl.GL_FRAMEBUFFER, gl.GL_COLOR_ATTACHMENT0,
                                     gl.GL_RENDERBUFFER, self.rbo)
        status = gl.glCheckFramebufferStatus(gl.GL_FRAMEBUFFER)
        if status != gl.GL_FRAMEBUFFER_COMPLETE:
            raise RuntimeError(f"framebuffer incomplete: {hex(int(status))}")
        gl.glViewport(0, 0, width, height)
        gl.glUseProgram(self.program)
        self.u_iters = gl.glGetUniformLocation(self.program, "u_iters")
        self.u_time = gl.glGetUniformLocation(self.program, "u_time")
        gl.glUniform2f(gl.glGetUniformLocation(self.program, "u_res"), float(width), float(height))
        self.iterations = 1
        self.frame = 0

    def set_iterations(self, iterations: int) -> None:
        self.iterations = max(1, int(iterations))
        self.gl.glUniform1i(self.u_iters, self.iterations)

    def step(self) -> int:
        """Draw one frame and wait until the GPU has finished it."""
        gl = self.gl
        self.frame += 1
        gl.glUniform1f(self.u_time, self.frame * (1.0 / 60.0))
        gl.glDrawArrays(gl.GL_TRIANGLE_STRIP, 0, 4)
        gl.glFinish()
        return 1

    def info(self) -> dict[str, Any]:
        gl = self.gl

        def text(name: int) -> str:
            raw = gl.glGetString(name)
            return raw.decode(errors="replace") if raw else ""

        pixel = gl.glReadPixels(self.width // 2, self.height // 2, 1, 1, gl.GL_RGBA, gl.GL_UNSIGNED_BYTE)
        return {"gl_renderer": text(gl.GL_RENDERER), "gl_vendor": text(gl.GL_VENDOR),
                "gl_version": text(gl.GL_VERSION), "center_pixel": list(bytearray(bytes(pixel)))}


# ------------------------------------------------------------------------------------- calibration


def frame_time(renderer: Renderer, frames: int) -> float:
    """Median seconds per frame over `frames` frames (median: robust to one slow frame)."""
    times = []
    for _ in range(frames):
        t0 = time.perf_counter()
        renderer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(renderer: Renderer, target_fps: float, start: int, budget_s: float = 6.0) -> tuple[int, float]:
    """Iteration count whose frame rate is close to `target_fps` (frame time ~ linear in iterations).

    Grows geometrically while frames are too short to time well, then applies the proportional
    correction until it is within 3% (or the time budget is spent). Returns (iterations, fps).
    """
    target = 1.0 / target_fps
    iters = max(1, start)
    renderer.set_iterations(iters)
    renderer.step()  # first frame pays for shader specialisation
    deadline = time.perf_counter() + budget_s
    ft = frame_time(renderer, 3)
    while time.perf_counter() < deadline:
        if ft < 0.002:
            new = iters * 8
        else:
            new = round(iters * target / ft)
            if abs(new - iters) <= max(1, 0.03 * iters):
                break
        new = max(1, min(new, iters * 16, 1 << 22))
        iters = new
        renderer.set_iterations(iters)
        ft = frame_time(renderer, max(3, min(15, int(0.3 / max(ft, 1e-4)))))
    return iters, 1.0 / ft


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Heavy headless render load for GPU-sharing benchmarks: EGL (device platform) + "
                    "OpenGL core context, WIDTHxHEIGHT FBO, one full-screen quad per frame with an "
                    "expensive per-pixel loop, glFinish every frame. Measures frames/s over a "
                    "window that starts after --warmup (or at --start-at).",
        epilog="Examples: egl_render.py --seconds 20 --warmup 5 --report /tmp/render.json\n"
               "          egl_render.py --calibrate-fps 36 --report /tmp/cal.json   "
               "(prints the --iterations giving ~36 FPS alone)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_window_args(parser)
    parser.add_argument("--width", type=int, default=1920, help="render width (default: 1920)")
    parser.add_argument("--height", type=int, default=1080, help="render height (default: 1080)")
    parser.add_argument("--iterations", type=int, default=1500,
                        help="shader loop rounds per pixel; sets the cost of a frame (default: 1500)")
    parser.add_argument("--calibrate-fps", type=float, default=None, metavar="FPS",
                        help="instead of measuring, search the --iterations that give about FPS "
                             "frames/s when running alone; report {kind: render-calibration, "
                             "iterations, fps}. Run it on an otherwise idle GPU.")
    parser.add_argument("--egl-device", type=int, default=None, metavar="INDEX",
                        help="use this EGL device index (default: first hardware device that works)")
    parser.add_argument("--client", metavar="TENANT", default=None,
                        help="run as a cooperative client of unisched under this tenant name: every frame runs "
                             "inside `FrameGate` (waits for the graphics lease; a GL_TIME_ELAPSED query times it) "
                             "instead of ungoverned, as an app using the client library would")
    parser.add_argument("--weight", type=int, default=100, help="with --client: the tenant's weight (default: 100)")
    parser.add_argument("--socket", default=None, help="with --client: the daemon's socket (default: the client's)")
    args = parser.parse_args(argv)
    if args.width <= 0 or args.height <= 0 or args.iterations <= 0 or args.seconds <= 0:
        parser.error("--width, --height, --iterations and --seconds must be positive")
    if args.calibrate_fps is not None and args.calibrate_fps <= 0:
        parser.error("--calibrate-fps must be positive")
    if args.client is not None and args.calibrate_fps is not None:
        parser.error("--calibrate-fps measures the render alone: leave out --client")
    return args


@contextmanager
def frame_gated(renderer: Renderer, tenant: str, weight: int,
                socket: str | None) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
    """A step that draws one frame inside `FrameGate`: the graphics lease gates it and a GL query times it (the
    frame's glFinish has it done, so its time is reported at once). The client ends with the step: the daemon
    hands the GPU on at once rather than when the process exits; the dict it yields is filled then with what the
    client saw (for the report)."""
    from unisched_client import Client  # type: ignore[import-not-found, unused-ignore]  # lazy: needs clients/
    from unisched_client.gl import FrameGate  # type: ignore[import-not-found, unused-ignore]

    client = Client(tenant, weight, socket=socket, engines=("graphics",))
    frames = FrameGate(client)

    def step() -> int:
        with frames:
            renderer.step()
        frames.drain()
        return 1

    seen: dict[str, Any] = {"client": tenant, "weight": weight}
    try:
        yield step, seen
    finally:
        seen.update(governed=client.governed, gpu_seconds_reported=round(frames.gate.used_s, 3),
                    lease_wait_s=round(frames.gate.waited_s, 3))
        client.close()


def run(args: argparse.Namespace, process_start: float) -> int:
    start_at, end_at = plan_window(args, process_start)
    with gl_context(args.egl_device) as ctx:
        renderer = Renderer(args.width, args.height)
        base = {"width": args.width, "height": args.height, "egl_display": ctx.display.source,
                "egl_vendor": ctx.egl.query_string(ctx.display.handle, EGL_VENDOR),
                "gl_context": f"{ctx.version[0]}.{ctx.version[1]} core"}
        if args.calibrate_fps is not None:
            return report_calibration(args, renderer, base)
        renderer.set_iterations(args.iterations)
        if args.client is None:
            window = measure(renderer.step, start_at, end_at)
        else:
            with frame_gated(renderer, args.client, args.weight, args.socket) as (step, seen):
                window = measure(step, start_at, end_at)
            base.update(seen)
        extra = {**base, "iterations": renderer.iterations, **renderer.info()}
    report = write_report(args.report, KIND, UNIT, window, extra)
    late = f", started {window.late_s:.1f} s late" if window.late_s > 0.5 else ""
    print(f"egl_render pid={report['pid']}: {window.throughput:.2f} {UNIT} "
          f"({window.items} frames in {window.seconds:.2f} s, {args.width}x{args.height}, "
          f"{renderer.iterations} iterations, {extra['gl_renderer']}{late})", flush=True)
    return 0


def report_calibration(args: argparse.Namespace, renderer: Renderer, base: dict[str, Any]) -> int:
    import json

    iters, fps = calibrate(renderer, args.calibrate_fps, args.iterations)
    report = {"kind": "render-calibration", "iterations": iters, "fps": fps,
              "target_fps": args.calibrate_fps, "pid": os.getpid(), **base, **renderer.info()}
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(f"egl_render calibration: --iterations {iters} gives {fps:.1f} frames/s alone "
          f"(target {args.calibrate_fps:g}, {args.width}x{args.height}, {report['gl_renderer']})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    process_start = time.time()
    args = parse_args(argv)
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")  # before the first OpenGL import
    try:
        return run(args, process_start)
    except EGLUnavailable as exc:
        return fail(f"EGL unavailable: {exc}")
    except ImportError as exc:
        if args.client is not None and "unisched_client" in str(exc):
            return fail(f"--client needs the client library ({exc}); put the checkout's clients/ on PYTHONPATH")
        return fail(f"PyOpenGL is not importable ({exc}); on the GPU machine source .devcache/setup.sh")
    except Exception as exc:  # GL errors: say what failed instead of a bare traceback
        return fail(f"OpenGL rendering failed: {type(exc).__name__}: {exc}", code=3)


if __name__ == "__main__":
    sys.exit(main())
