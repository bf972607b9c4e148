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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "workloads"))
from _window import add_window_args, fail, write_json  # noqa: E402

SCENARIO = "ad_sim"
TENANTS = {"sim": ("ad-sim", "graphics,encode"), "perception": ("ad-perception", "decode,compute")}
NO_NVENC = "libx264 (CPU): this GPU has no NVENC"
TIMELINE_STEP_S = 0.5
SAMPLE_PERIOD_S = 0.1
LOG_TAIL = 2000

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

# ----------------------------------------------------------------------------------------------- framing
# One message per H.264 packet: magic, flags, frame id, three float64 wall-clock times (render start, render
# end, encode end), payload length; then the payload. A message with FLAG_EOS and no payload ends the stream.

MAGIC = b"ADS1"
HEADER = struct.Struct("<4sIqdddI")
FLAG_MEASURED = 1  # sequential mode: the frame was encoded inside the sim's window
FLAG_EOS = 2
STOP = b"S"  # perception -> sim on the same socket: the window is over, send end-of-stream


class Header(NamedTuple):
    frame_id: int
    flags: int
    t_render_start: float
    t_render_end: float
    t_encode_end: float
    length: int


def pack_packet(frame_id: int, times: tuple[float, float, float], payload: bytes, flags: int = 0) -> bytes:
    """One framed message: header then payload."""
    return HEADER.pack(MAGIC, flags, frame_id, *times, len(payload)) + payload


def end_of_stream() -> bytes:
    return HEADER.pack(MAGIC, FLAG_EOS, -1, 0.0, 0.0, 0.0, 0)


def unpack_header(raw: bytes) -> Header:
    magic, flags, frame_id, t0, t1, t2, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"bad message magic {magic!r} (not an ad_sim stream, or out of step)")
    return Header(frame_id, flags, t0, t1, t2, length)


def _read_exact(stream: BinaryIO, n: int, what: str) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise EOFError(f"stream ended inside a message ({what}: {0 if data is None else len(data)} of {n} bytes)")
    return data


def read_message(stream: BinaryIO) -> tuple[Header, bytes] | None:
    """The next message, or None at a clean end of the byte stream (between messages)."""
    first = stream.read(HEADER.size)
    if not first:
        return None
    raw = first if len(first) == HEADER.size else first + _read_exact(stream, HEADER.size - len(first), "header")
    header = unpack_header(raw)
    return header, _read_exact(stream, header.length, "payload") if header.length else b""


# ------------------------------------------------------------------------------------------------ window


class WindowClock:
    """The measured window of the stage that owns it, fixed by the first completion that stage sees.

    Without --start-at it starts `warmup` seconds after that first completion (start-up costs of torch, CUDA
    and the codecs stay outside); with it, at start_at, or at the first completion when start-up overran it.
    A completion at t counts when start < t <= end, as in _window.measure."""

    def __init__(self, seconds: float, warmup: float, start_at: float | None = None) -> None:
        self.seconds, self.warmup, self.requested = seconds, warmup, start_at
        self.start: float | None = None
        self.late_s = 0.0

    def observe(self, t: float) -> None:
        if self.start is not None:
            return
        if self.requested is None:
            self.start = t + self.warmup
        elif t > self.requested:
            self.start, self.late_s = t, t - self.requested
        else:
            self.start = self.requested

    @property
    def end(self) -> float | None:
        return None if self.start is None else self.start + self.seconds

    def counted(self, t: float) -> bool:
        return self.start is not None and self.start < t <= self.start + self.seconds

    def finished(self, t: float) -> bool:
        return self.start is not None and t > self.start + self.seconds

    def as_dict(self) -> dict[str, float | None]:
        return {"start": self.start, "end": self.end, "seconds": self.seconds, "late_s": self.late_s}


# ----------------------------------------------------------------------------------------------- summary
# A perception record: [frame_id, flags, render start, render end, encode end, received, decoded, inferred].

T_RENDER_START, T_RENDER_END, T_ENCODE_END, T_RECV, T_DECODE_END, T_INFER_END = range(2, 8)
LATENCY_STAGES = {
    "render": (T_RENDER_START, T_RENDER_END),
    "readback_encode": (T_RENDER_END, T_ENCODE_END),
    "transfer": (T_ENCODE_END, T_RECV),
    "decode": (T_RECV, T_DECODE_END),
    "infer": (T_DECODE_END, T_INFER_END),
    "end_to_end": (T_RENDER_START, T_INFER_END),
}


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def latency_ms(records: Sequence[Sequence[float]]) -> dict[str, dict[str, float | None]]:
    """p50, p99 and mean in milliseconds for every stage and end to end (None without frames)."""
    out: dict[str, dict[str, float | None]] = {}
    for stage, (a, b) in LATENCY_STAGES.items():
        ms = [1000.0 * (r[b] - r[a]) for r in records]
        out[stage] = ({"p50": round(percentile(ms, 50), 3), "p99": round(percentile(ms, 99), 3),
                       "mean": round(statistics.fmean(ms), 3)} if ms else {"p50": None, "p99": None, "mean": None})
    return out


@dataclass(frozen=True)
class Segment:
    """A stretch of wall-clock time that is measured; offset places it on the report's time axis."""

    start: float
    end: float
    offset: float = 0.0


def to_axis(t: float, segments: Sequence[Segment]) -> float | None:
    """Wall-clock t on the report's time axis (measured time only), or None outside every segment."""
    for s in segments:
        if s.start <= t <= s.end:
            return s.offset + t - s.start
    return None


def timeline(completions: Sequence[float], length: float, step: float = TIMELINE_STEP_S) -> list[list[float]]:
    """[[t, frames finished by t]] every `step` seconds of the axis, and a last point at `length`."""
    done = sorted(completions)
    points: list[list[float]] = []
    i = k = 0
    while k * step <= length + 1e-9:
        t = round(k * step, 6)
        while i < len(done) and done[i] <= t:
            i += 1
        points.append([t, i])
        k += 1
    if not points or points[-1][0] < length - 1e-9:
        points.append([round(length, 6), sum(1 for c in done if c <= length)])
    return points


def colocated_view(records: Sequence[Sequence[float]], start: float, end: float) -> tuple[list[Sequence[float]], list[Segment]]:
    """Frames whose inference ended inside the window, and the window as the one segment."""
    return [r for r in records if start < r[T_INFER_END] <= end], [Segment(start, end)]


def sequential_view(records: Sequence[Sequence[float]], sim_start: float,
                    sim_end: float) -> tuple[list[Sequence[float]], list[Segment]]:
    """The frames the sim encoded inside its window; the axis is the sim's window, then perception's run of them
    (from reading the first such frame to inferring the last), so its length is t_sim + t_perception."""
    counted = [r for r in records if int(r[1]) & FLAG_MEASURED]
    segments = [Segment(sim_start, sim_end)]
    if counted:
        segments.append(Segment(min(r[T_RECV] for r in counted), max(r[T_INFER_END] for r in counted),
                                offset=sim_end - sim_start))
    return counted, segments


def summarize(counted: Sequence[Sequence[float]], segments: Sequence[Segment]) -> dict[str, Any]:
    length = sum(s.end - s.start for s in segments)
    ends = [to_axis(r[T_INFER_END], segments) for r in counted]
    return {"frames": len(counted), "seconds": round(length, 4),
            "fps_end_to_end": round(len(counted) / length, 3) if length > 0 else 0.0,
            "latency_ms": latency_ms(counted),
            "timeline": timeline([length if e is None else e for e in ends], length)}


def gpu_view(samples: Sequence[Sequence[float]], segments: Sequence[Segment]) -> dict[str, Any]:
    """NVML samples [t, util %, decoder util %] inside the segments, on the report's axis, and their means."""
    kept = [[round(a, 3), u, d] for t, u, d in samples if (a := to_axis(t, segments)) is not None]
    return {"gpu_util_mean": round(statistics.fmean(s[1] for s in kept), 2) if kept else None,
            "decoder_util_mean": round(statistics.fmean(s[2] for s in kept), 2) if kept else None,
            "gpu_util_samples": kept}


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


def tenant_argv(socket_path: str, tenant: str, weight: int, engines: str, cmd: Sequence[str]) -> list[str]:
    """`unisched run` wrapping CMD as a tenant (freezer enforcement: cgroup, freezer slices, session hooks)."""
    return [sys.executable, "-m", "unisched", "run", "--socket", socket_path, "--tenant", tenant,
            "--weight", str(weight), "--engines", engines, "--", *cmd]


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
    return tenant_argv(args.unisched_socket, args.tenant_prefix + tenant, weight, engines, cmd)


# ---------------------------------------------------------------------------------------------- sim stage


def open_encoder(choice: str, width: int, height: int, fps: int = 60) -> tuple[Any, str, str | None]:
    """(codec context, label for the report, why NVENC did not open): h264_nvenc first, else libx264."""
    import av

    def open_codec(name: str, options: dict[str, str]) -> Any:
        ctx = av.CodecContext.create(name, "w")
        ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
        ctx.time_base, ctx.framerate = Fraction(1, fps), Fraction(fps, 1)
        ctx.gop_size, ctx.max_b_frames = fps, 0  # no B-frames: one packet out per frame in
        ctx.options = options
        ctx.open()
        return ctx

    nvenc_error = None
    if choice in ("auto", "h264_nvenc"):
        try:
            return open_codec("h264_nvenc", {"preset": "p1", "tune": "ull", "zerolatency": "1"}), "h264_nvenc (GPU)", None
        except Exception as e:  # the H200 has no NVENC: avcodec_open2 fails (or unisched refuses the session)
            nvenc_error = f"{type(e).__name__}: {e}"
            if choice == "h264_nvenc":
                raise RuntimeError(f"h264_nvenc did not open ({nvenc_error})") from e
    ctx = open_codec("libx264", {"preset": "ultrafast", "tune": "zerolatency"})
    return ctx, NO_NVENC if nvenc_error else "libx264 (CPU)", nvenc_error


class Outbox:
    """Where the sim's messages go: perception's socket (colocated) or a file (sequential)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.sock: socket.socket | None = None
        self.file: BinaryIO | None = None
        if args.output is not None:
            self.file = open(args.output, "wb")  # noqa: SIM115  # closed in close()
            return
        while True:  # perception listens only once its model and decoder are ready
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(args.connect))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.time() > args.deadline:
                    raise TimeoutError(f"perception never listened on {args.connect}") from None
                time.sleep(0.05)
        s.settimeout(60.0)  # a perception stage that stops reading for a minute is a failure, not a wait
        if args.queue_kib:  # how far the sim may run ahead of perception (SO_SNDBUFFORCE as root: past wmem_max)
            force = getattr(socket, "SO_SNDBUFFORCE", None)
            try:
                s.setsockopt(socket.SOL_SOCKET, force if force is not None else socket.SO_SNDBUF, args.queue_kib * 1024)
            except PermissionError:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.queue_kib * 1024)
        self.sock = s

    def send(self, data: bytes) -> int:
        if self.sock is not None:
            self.sock.sendall(data)
        elif self.file is not None:
            self.file.write(data)
        return len(data)

    def stop_requested(self) -> bool:
        """Perception said the window is over (or went away)."""
        if self.sock is None or not select.select([self.sock], [], [], 0)[0]:
            return False
        data = self.sock.recv(16)
        return not data or STOP in data

    def close(self) -> None:
        self.send(end_of_stream())
        if self.sock is not None:
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.close()
        if self.file is not None:
            self.file.close()


def run_sim(args: argparse.Namespace) -> int:
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")  # before the first OpenGL import
    try:
        import av
        import numpy as np
        from egl_render import EGL_VENDOR, EGLUnavailable, Renderer, gl_context
    except ImportError as e:
        return fail(f"the sim needs PyAV, numpy and PyOpenGL ({e}); on the GPU machine source .devcache/setup.sh")
    try:
        encoder, encoder_label, nvenc_error = open_encoder(args.encoder, args.width, args.height)
    except Exception as e:
        return fail(f"no H.264 encoder opened: {type(e).__name__}: {e}", code=3)
    file_mode = args.output is not None
    clock = WindowClock(args.seconds, args.warmup, args.start_at)  # owns the window in file mode only
    w, h = args.width, args.height
    pending: dict[int, tuple[float, float]] = {}
    counts = {"frames": 0, "packets": 0, "bytes": 0, "measured": 0}
    try:
        with gl_context(args.egl_device) as ctx:
            renderer = Renderer(w, h)
            renderer.set_iterations(args.iterations)
            gl = renderer.gl
            gl.glPixelStorei(gl.GL_PACK_ALIGNMENT, 1)
            pixels = np.empty((h, w, 4), np.uint8)  # rows bottom-up as GL stores them; perception flips on the GPU
            out = Outbox(args)

            def emit(packets: list[Any]) -> None:
                for pkt in packets:
                    t_enc = time.time()
                    fid = int(pkt.pts) if pkt.pts is not None and int(pkt.pts) in pending else min(pending)
                    t0, t1 = pending.pop(fid)
                    flags = 0
                    if file_mode:
                        clock.observe(t_enc)
                        if clock.counted(t_enc):
                            flags, counts["measured"] = FLAG_MEASURED, counts["measured"] + 1
                    counts["bytes"] += out.send(pack_packet(fid, (t0, t1, t_enc), bytes(pkt), flags))
                    counts["packets"] += 1

            while True:
                t0 = time.time()
                renderer.step()  # draw + glFinish
                t1 = time.time()
                got = gl.glReadPixels(0, 0, w, h, gl.GL_RGBA, gl.GL_UNSIGNED_BYTE, pixels)  # into `pixels` (PyOpenGL 3.1)
                rgba = got if isinstance(got, np.ndarray) else np.frombuffer(got, np.uint8)
                frame = av.VideoFrame.from_ndarray(rgba.reshape(h, w, 4), format="rgba")  # copies; encoder -> yuv420p
                frame.pts = counts["frames"]
                pending[counts["frames"]] = (t0, t1)
                counts["frames"] += 1
                emit(list(encoder.encode(frame)))
                if out.stop_requested() or (file_mode and clock.finished(time.time())):
                    break
                if time.time() > args.deadline:
                    return fail("deadline reached before the window ended (start-up too slow? raise --grace)", code=4)
            emit(list(encoder.encode(None)))
            out.close()
            info = {"gl_context": f"{ctx.version[0]}.{ctx.version[1]} core", "egl_display": ctx.display.source,
                    "egl_vendor": ctx.egl.query_string(ctx.display.handle, EGL_VENDOR), **renderer.info()}
    except EGLUnavailable as e:
        return fail(f"EGL unavailable: {e}")
    except ImportError as e:
        return fail(f"PyOpenGL is not importable ({e}); on the GPU machine source .devcache/setup.sh")
    except OSError as e:  # the socket: perception went away, stalled or never listened
        return fail(f"sending frames failed: {type(e).__name__}: {e}", code=3)
    except Exception as e:  # GL or codec errors: the traceback goes to the log the orchestrator quotes
        traceback.print_exc()
        return fail(f"the sim failed: {type(e).__name__}: {e}", code=3)
    report = {"role": "sim", "encoder": encoder_label, "encoder_error": nvenc_error, "width": w, "height": h,
              "iterations": args.iterations, "frames_rendered": counts["frames"], "packets_sent": counts["packets"],
              "bytes_sent": counts["bytes"], "measured_frames": counts["measured"],
              "window": clock.as_dict() if file_mode else None, "pid": os.getpid(), **info}
    write_json(args.report, report)
    print(f"ad_sim sim pid={os.getpid()}: {counts['frames']} frames {w}x{h}, {args.iterations} iterations, "
          f"{encoder_label}, {counts['bytes'] / max(1, counts['packets']) / 1024:.1f} KiB/packet", flush=True)
    return 0


# --------------------------------------------------------------------------------------- perception stage


def open_decoder(choice: str, gpu: int) -> tuple[Any, str]:
    """A streaming H.264 decoder fed packet by packet, opened before the sim connects: NVDEC through hwaccel cuda
    (as 04 and av.py do), else the h264_cuvid decoder (also NVDEC); `cpu` only where asked. low_delay: one frame
    out per packet in (for cuvid it also sets the display delay to 0). PyAV's default slice threading keeps
    software decode from holding frames back."""
    import av
    from av.codec.context import Flags
    from av.codec.hwaccel import HWAccel

    def opened(ctx: Any, label: str) -> tuple[Any, str]:
        ctx.flags = ctx.flags | Flags.low_delay
        ctx.open()
        return ctx, label

    if choice == "cpu":
        return opened(av.CodecContext.create("h264", "r"), "h264 (CPU software decode)")
    tried: list[str] = []
    if choice == "nvdec":
        try:
            ctx = av.CodecContext.create("h264", "r", hwaccel=HWAccel(device_type="cuda", device=str(gpu),
                                                                      allow_software_fallback=False))
            if ctx.is_hwaccel:
                return opened(ctx, "h264 + hwaccel cuda (NVDEC)")
            tried.append("hwaccel cuda: no CUDA hardware config for h264")
        except Exception as e:
            tried.append(f"hwaccel cuda: {type(e).__name__}: {e}")
    try:
        ctx = av.CodecContext.create("h264_cuvid", "r")
        ctx.options = {"gpu": str(gpu)}
        return opened(ctx, "h264_cuvid (NVDEC)")
    except Exception as e:
        tried.append(f"h264_cuvid: {type(e).__name__}: {e}")
    raise RuntimeError("no NVDEC decoder opened (" + "; ".join(tried) + "); --decoder cpu decodes on the CPU")


def build_model(name: str, device: Any, width: int, height: int) -> tuple[Callable[[Any], Any], str]:
    """A torchvision model with random weights (nothing downloaded), warmed up; returns (infer(rgb), label).

    rgb is a (3, H, W) float16 tensor in 0..1 on the GPU. resnet18: resized to 224x224 on the GPU, normalized,
    fp16 weights; ssdlite: the detector's own transform resizes to 320, under fp16 autocast."""
    import torch
    import torchvision
    from torch.nn import functional

    torch.backends.cudnn.benchmark = True
    if name == "resnet18":
        net = torchvision.models.resnet18(weights=None).eval().to(device).half().to(memory_format=torch.channels_last)
        mean = torch.tensor([0.485, 0.456, 0.406], device=device, dtype=torch.float16).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225], device=device, dtype=torch.float16).view(1, 3, 1, 1)

        def infer(rgb: Any) -> Any:
            x = functional.interpolate(rgb[None], size=(224, 224), mode="bilinear", align_corners=False)
            return net(((x - mean) / std).contiguous(memory_format=torch.channels_last))

        label = "resnet18 (classification, 224x224, fp16, random weights)"
    else:
        det = torchvision.models.detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None)
        det = det.eval().to(device)

        def infer(rgb: Any) -> Any:
            with torch.autocast("cuda", dtype=torch.float16):
                return det([rgb.float()])

        label = "ssdlite320_mobilenet_v3_large (detection, fp16 autocast, random weights)"
    with torch.inference_mode():
        dummy = torch.rand(3, height, width, device=device, dtype=torch.float16)
        for _ in range(3):  # cudnn autotuning and lazy CUDA init stay out of the first frame's latency
            infer(dummy)
        torch.cuda.synchronize(device)
    return infer, label


def frame_to_gpu(frame: Any, device: Any) -> Any:
    """A decoded frame as a (3, H, W) float16 RGB tensor in 0..1 on the GPU: the YUV planes are uploaded as they
    are and converted there (BT.601, limited range), flipped upright (the sim sends GL's bottom-up rows)."""
    import torch

    h, w = frame.height, frame.width
    fmt = frame.format.name
    if fmt not in ("nv12", "yuv420p"):
        rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).to(device).permute(2, 0, 1)
        return (rgb.to(torch.float16) / 255.0).flip(-2)
    planes = torch.from_numpy(frame.to_ndarray()).to(device)  # (H * 3/2, W): Y, then chroma
    y = planes[:h].to(torch.float16)
    if fmt == "nv12":
        uv = planes[h:].reshape(h // 2, w // 2, 2).permute(2, 0, 1)
    else:
        flat = planes[h:].reshape(-1)
        uv = flat.reshape(2, h // 2, w // 2)
    uv = (uv.to(torch.float16) - 128.0) / 224.0
    uv = uv.repeat_interleave(2, dim=1).repeat_interleave(2, dim=2)
    luma = (y - 16.0) / 219.0
    u, v = uv[0], uv[1]
    rgb = torch.stack([luma + 1.402 * v, luma - 0.344136 * u - 0.714136 * v, luma + 1.772 * u])
    return rgb.clamp_(0.0, 1.0).flip(-2)


def _accept(path: Path, deadline: float) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(max(1.0, deadline - time.time()))
    try:
        conn, _ = server.accept()
    except TimeoutError:
        raise TimeoutError("the sim never connected") from None
    finally:
        server.close()
        path.unlink(missing_ok=True)
    conn.settimeout(60.0)  # a sim that sends nothing for a minute is a failure, not a wait
    return conn


def run_perception(args: argparse.Namespace) -> int:
    try:
        import av
        import torch
    except ImportError as e:
        return fail(f"perception needs PyAV and PyTorch ({e}); on the GPU machine source .devcache/setup.sh")
    if not torch.cuda.is_available():
        return fail("torch.cuda.is_available() is False (no GPU or no CUDA driver)")
    device = torch.device(f"cuda:{args.gpu}")
    try:
        infer, model_label = build_model(args.model, device, args.width, args.height)
    except Exception as e:
        return fail(f"building {args.model} failed: {type(e).__name__}: {e}", code=3)
    try:
        decoder, decoder_label = open_decoder(args.decoder, args.gpu)
    except RuntimeError as e:
        return fail(str(e))
    try:
        conn = _accept(args.listen, args.deadline) if args.listen is not None else None
        stream: BinaryIO = conn.makefile("rb") if conn is not None else open(args.input, "rb")  # noqa: SIM115
    except OSError as e:
        return fail(f"perception got no stream: {type(e).__name__}: {e}", code=3)
    clock = WindowClock(args.seconds, args.warmup, args.start_at)  # owns the window on a socket only
    pending: dict[int, tuple[Header, float]] = {}
    records: list[list[float]] = []
    frame_format: str | None = None
    stopping = False

    def finish(frames: list[Any], t_dec: float) -> None:
        nonlocal frame_format, stopping
        for frame in frames:
            fid = frame.pts if frame.pts is not None and frame.pts in pending else min(pending)
            hdr, t_recv = pending.pop(fid)
            frame_format = frame_format or frame.format.name
            infer(frame_to_gpu(frame, device))
            torch.cuda.synchronize(device)
            t_inf = time.time()
            records.append([fid, hdr.flags, hdr.t_render_start, hdr.t_render_end, hdr.t_encode_end, t_recv,
                            t_dec, t_inf])
            if conn is not None and not stopping:
                clock.observe(t_inf)
                if clock.finished(t_inf):
                    conn.sendall(STOP)
                    stopping = True

    try:
        with torch.inference_mode():
            while True:
                msg = read_message(stream)
                if msg is None:
                    raise EOFError("the sim closed the stream without end-of-stream (did it fail?)")
                hdr, payload = msg
                if hdr.flags & FLAG_EOS:
                    break
                t_recv = time.time()
                if time.time() > args.deadline:
                    return fail("deadline reached before the stream ended (raise --grace)", code=4)
                if stopping:
                    continue  # the window is over: drain to end-of-stream
                packet = av.Packet(payload)
                packet.pts = packet.dts = hdr.frame_id
                pending[hdr.frame_id] = (hdr, t_recv)
                frames = list(decoder.decode(packet))
                finish(frames, time.time())
            if conn is None:
                finish(list(decoder.decode(None)), time.time())
    except (EOFError, OSError, ValueError, av.error.FFmpegError) as e:
        return fail(f"perception failed: {type(e).__name__}: {e}", code=3)
    except Exception as e:  # CUDA or model errors: the traceback goes to the log the orchestrator quotes
        traceback.print_exc()
        return fail(f"perception failed: {type(e).__name__}: {e}", code=3)
    finally:
        stream.close()
        if conn is not None:
            conn.close()
    if conn is not None and not stopping:
        return fail("end-of-stream before the window ended (the sim stopped early)", code=3)
    report = {"role": "perception", "decoder": decoder_label, "decoder_frame_format": frame_format,
              "model": args.model, "model_label": model_label, "device_name": torch.cuda.get_device_name(device),
              "frames_done": len(records), "undecoded": len(pending),
              "window": clock.as_dict() if conn is not None else None, "pid": os.getpid(), "records": records}
    write_json(args.report, report)
    print(f"ad_sim perception pid={os.getpid()}: {len(records)} frames, {decoder_label} "
          f"({frame_format}), {model_label}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- orchestrator




class NvmlSampler:
    """GPU and decoder utilization every 100 ms in a thread, straight from NVML (pynvml)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.samples: list[list[float]] = []
        self.error: str | None = None
        self.gpu_name: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            name = pynvml.nvmlDeviceGetName(handle)
            self.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception as e:
            self.error = f"NVML unavailable, no utilization samples: {type(e).__name__}: {e}"
            return
        self._thread = threading.Thread(target=self._run, args=(pynvml, handle), daemon=True)
        self._thread.start()

    def _run(self, pynvml: Any, handle: Any) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            try:
                t = time.time()
                util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                dec = pynvml.nvmlDeviceGetDecoderUtilization(handle)[0]
                self.samples.append([t, float(util), float(dec)])
            except Exception as e:
                self.error = self.error or f"NVML sample failed: {type(e).__name__}: {e}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            with contextlib.suppress(Exception):
                import pynvml

                pynvml.nvmlShutdown()


@dataclass
class Child:
    """One stage process, in its own session so that it and everything it starts can be stopped together."""

    role: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYOPENGL_PLATFORM": os.environ.get("PYOPENGL_PLATFORM", "egl"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH")]))}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the stage's process group, SIGKILL after 5 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


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


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the orchestrator."""


def _interrupt(_signum: int, _frame: object) -> None:
    raise Interrupted


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
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
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
