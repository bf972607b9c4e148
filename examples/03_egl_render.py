#!/usr/bin/env python3
"""03: a headless EGL render loop under unisched (FrameGate), printing frames/s and measured share.

The heavy fragment shader of examples/workloads/egl_render.py at 1920x1080; each frame (draw + glFinish)
waits for the graphics lease and is timed with a GL_TIME_ELAPSED query.

  python3 examples/03_egl_render.py --seconds 20                                 # alone, no unisched
  python3 examples/03_egl_render.py --seconds 20 --tenant render --weight 100 --iterations 447
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _coop import add_unisched_args, connect, share_line, share_report
from _window import add_window_args, fail, measure, plan_window, write_report


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--width", type=int, default=1920)
    ap.add_argument("--height", type=int, default=1080)
    ap.add_argument("--iterations", type=int, default=447, help="shader loop count (447: ~36 FPS alone on the H200)")
    ap.add_argument("--egl-device", type=int, default=None)
    add_unisched_args(ap)
    args = ap.parse_args(argv)
    start_at, end_at = plan_window(args, start)
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    try:
        from _egl import EGLUnavailable, gl_context
        from egl_render import Renderer
    except ImportError as e:
        return fail(f"PyOpenGL is not importable ({e}); pip install 'unisched[gl]'")
    client = connect(args, ("graphics",))
    try:
        with gl_context(args.egl_device):
            renderer = Renderer(args.width, args.height)
            renderer.set_iterations(args.iterations)
            frames = None
            if client is not None:
                from unisched_client.gl import FrameGate

                frames = FrameGate(client)

            def step() -> int:
                if frames is None:
                    return renderer.step()
                with frames:
                    renderer.step()
                frames.drain()
                return 1

            window = measure(step, start_at, end_at)
    except EGLUnavailable as e:
        return fail(f"EGL unavailable: {e}")
    share = share_report(client, "graphics")
    report = write_report(args.report, "render", "frame/s", window, {"share": share, "iterations": args.iterations})
    print(f"03_egl_render pid={report['pid']}: {window.throughput:.2f} frame/s ({args.width}x{args.height}); "
          f"{share_line(share)}", flush=True)
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
