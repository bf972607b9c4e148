#!/usr/bin/env python3
"""04: an NVDEC decode loop under unisched (PyAV hwaccel cuda), printing frames/s and measured share.

The daemon admits the decode session first (the tenant's decode cap) and releases it on close; each packet
is decoded under the decode lease. A test clip (H.264, 1920x1080, 5 s) is encoded on the CPU first
unless --clip is given.

  python3 examples/04_nvdec_decode.py --seconds 15
  python3 examples/04_nvdec_decode.py --seconds 15 --tenant decode --weight 100
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

from _coop import add_unisched_args, connect, share_line, share_report
from _window import add_window_args, fail, measure, plan_window, write_report

CPU_H264 = ("libx264", "libopenh264", "h264")


class NoFrames(RuntimeError):
    """The decoder took the clip and gave nothing back."""


DEFAULT_CLIP = Path(tempfile.gettempdir()) / "unisched-04-clip.mp4"
"""The test clip without --clip: made on first use, then kept for later runs."""


def make_clip(path: Path, seconds: int = 5, size: tuple[int, int] = (1920, 1080), fps: int = 30) -> str:
    """Encode a moving gradient with a CPU H.264 encoder; returns the encoder used."""
    import av
    import numpy as np
    from av.video.stream import VideoStream

    last: Exception | None = None
    tmp = path.with_name(path.name + ".part.mp4")
    for name in CPU_H264:
        try:
            with av.open(str(tmp), "w") as out:
                s = out.add_stream(name, rate=fps)
                assert isinstance(s, VideoStream)  # a video encoder's stream
                s.width, s.height, s.pix_fmt = size[0], size[1], "yuv420p"
                s.time_base = Fraction(1, fps)
                w, h = size
                yy, xx = np.mgrid[0:h, 0:w]
                for i in range(seconds * fps):
                    img = np.stack([(xx + 4 * i) % 256, (yy + 2 * i) % 256, (xx + yy + i) % 256], axis=-1).astype(np.uint8)
                    for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                        out.mux(p)
                for p in s.encode():
                    out.mux(p)
            tmp.replace(path)  # a clip cut short by an interrupt is never mistaken for a whole one
            return name
        except Exception as e:  # that encoder is not in this PyAV build: try the next
            last = e
    raise RuntimeError(f"no CPU H.264 encoder in this PyAV build ({', '.join(CPU_H264)}): {last}")


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--clip", type=Path, default=None, help="an H.264 file to decode (default: make one)")
    add_unisched_args(ap)
    args = ap.parse_args(argv)
    try:
        import av
        from av.codec.hwaccel import HWAccel
    except ImportError as e:
        return fail(f"PyAV is not importable ({e}); pip install 'unisched[codec]'")
    clip = args.clip
    if clip is None:
        clip = DEFAULT_CLIP
        if not clip.exists():
            print(f"making a test clip {clip} ...", flush=True)
            print(f"made it with {make_clip(clip)}", flush=True)
            start = time.time()  # the warm-up counts from here, not from before the clip was made
    start_at, end_at = plan_window(args, start)
    client = connect(args, ("decode",))
    decoder = None
    if client is not None:
        from unisched_client.av import CodecRefused, HardwareDecoder

        try:
            decoder = HardwareDecoder(client, str(clip))
        except CodecRefused as e:
            return fail(f"the daemon refused the decode session: {e}")
        it = decoder.frames(loop=True)
    else:
        def unmanaged() -> Iterator[Any]:
            # one decoder for the whole run, as HardwareDecoder does: reopening the clip each loop would close and
            # reopen the NVDEC session every second, and a decode cap would see the count flicker
            with av.open(str(clip), hwaccel=HWAccel(device_type="cuda", allow_software_fallback=False)) as c:
                stream = c.streams.video[0]
                while True:
                    frames = 0
                    for packet in c.demux(stream):
                        for frame in packet.decode():
                            frames += 1
                            yield frame
                    if not frames:  # a refused NVDEC session can fail quietly: every packet decodes to nothing
                        raise NoFrames("a whole pass over the clip decoded no frame")
                    c.seek(0)
                    stream.codec_context.flush_buffers()

        it = unmanaged()

    def step() -> int:
        next(it)
        return 1

    try:
        window = measure(step, start_at, end_at)
    except (av.error.FFmpegError, NoFrames) as e:
        return fail(f"hardware decode failed: {e}", code=3)
    if window.items == 0:  # a refused session can stall instead of failing: the first frame came after the window
        return fail(f"hardware decode failed: no frame decoded in the {args.seconds:g} s window "
                    f"(first one {window.t_first - start_at:.1f} s after the window opened)", code=3)
    share = share_report(client, "decode")
    if decoder is not None:
        decoder.close()
    report = write_report(args.report, "decode", "frame/s", window, {"share": share, "clip": str(clip)})
    print(f"04_nvdec_decode pid={report['pid']}: {window.throughput:.1f} frame/s; {share_line(share)}", flush=True)
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
