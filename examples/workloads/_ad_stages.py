"""The driving simulation's two stages (examples/ad_sim.py --role sim | perception), each its own process.

sim: EGL render -> glReadPixels -> H.264 encode (h264_nvenc, else libx264 on the CPU) -> perception's socket or a
file. perception: NVDEC decode -> YUV to RGB on the GPU -> a torchvision model, timing every frame's stages.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import socket
import time
import traceback
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, BinaryIO

from _ad_stream import FLAG_EOS, FLAG_MEASURED, STOP, Header, WindowClock, end_of_stream, pack_packet, read_message
from _window import fail, write_json

NO_NVENC = "libx264 (CPU): this GPU has no NVENC"


def open_encoder(choice: str, width: int, height: int, fps: int = 60) -> tuple[Any, str, str | None]:
    """(codec context, label for the report, why NVENC did not open): h264_nvenc first, else libx264."""
    import av

    def open_codec(name: str, options: dict[str, str]) -> Any:
        ctx: Any = av.CodecContext.create(name, "w")  # a video encoder's context (PyAV types it as any codec's)
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
        from _egl import EGL_VENDOR, EGLUnavailable, gl_context
        from egl_render import Renderer
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
            ctx: Any = av.CodecContext.create("h264", "r", hwaccel=HWAccel(device_type="cuda", device=str(gpu),
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
