"""PyAV: hardware decode and encode sessions admitted by the daemon and gated on codec leases.

    with HardwareDecoder(client, "clip.mp4") as dec:      # NVDEC via hwaccel cuda (or h264_cuvid)
        for frame in dec.frames():
            ...

    enc = HardwareEncoder(client, 1920, 1080)             # h264_nvenc; CodecRefused with a clear reason
                                                          # where the GPU has no NVENC (the H200 has none)

The daemon counts the session against the tenant's decode/encode cap before the codec is opened and
releases it on close. Each packet is decoded (or frame encoded) under the decode (encode) lease; its wall
time is what is reported, the engine's own busy time not being visible per session.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from unisched_client._extras import missing_extra

try:
    import av
except ModuleNotFoundError as e:
    raise missing_extra(e, "av") from None

from unisched_client.client import Client
from unisched_client.errors import CodecRefused

__all__ = ["CodecRefused", "HardwareDecoder", "HardwareEncoder"]


class _Session:
    kind = ""
    engine = ""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.gate = client.gate(self.engine)
        client.codec_session(self.kind)  # raises CodecRefused
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self.gate.release()
            self.client.codec_session_closed(self.kind)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HardwareDecoder(_Session):
    kind, engine = "nvdec", "decode"
    codec_context: Any  # the stream's VideoCodecContext or a created one (PyAV types that as the base class)

    def __init__(self, client: Client, path: str, codec: str | None = None) -> None:
        """codec None: the stream's codec with hwaccel cuda (NVDEC); or a cuvid decoder such as h264_cuvid."""
        super().__init__(client)
        try:
            if codec is None:
                from av.codec.hwaccel import HWAccel

                self.container = av.open(path, hwaccel=HWAccel(device_type="cuda", allow_software_fallback=False))
                self.stream = self.container.streams.video[0]
                self.codec_context = self.stream.codec_context
            else:
                self.container = av.open(path)
                self.stream = self.container.streams.video[0]
                self.codec_context = av.CodecContext.create(codec, "r")
                self.codec_context.extradata = self.stream.codec_context.extradata
        except Exception:
            self.close()
            raise

    def frames(self, loop: bool = False) -> Iterator[Any]:
        """Decoded frames; with loop=True the clip starts over at its end (one session throughout)."""
        own = self.codec_context is not self.stream.codec_context
        while True:
            for packet in self.container.demux(self.stream):
                self.gate.acquire()
                t0 = time.perf_counter()
                out = self.codec_context.decode(packet) if own else packet.decode()
                self.gate.done(time.perf_counter() - t0)
                yield from out
            if not loop:
                return
            self.container.seek(0)
            self.codec_context.flush_buffers()

    def close(self) -> None:
        c = getattr(self, "container", None)
        if c is not None:
            c.close()
        super().close()


class HardwareEncoder(_Session):
    kind, engine = "nvenc", "encode"
    context: Any  # a VideoCodecContext; PyAV's create() is typed as returning the base class

    def __init__(self, client: Client, width: int, height: int, codec: str = "h264_nvenc", fps: int = 30) -> None:
        super().__init__(client)
        try:
            self.context = av.CodecContext.create(codec, "w")
            self.context.width, self.context.height = width, height
            self.context.pix_fmt = "yuv420p"
            self.context.time_base = Fraction(1, fps)  # PyAV 16 refuses the string form
            self.context.open()
        except Exception as e:
            self.close()
            raise CodecRefused(f"cannot open {codec}: {e}") from e

    def encode(self, frame: Any) -> list[Any]:
        self.gate.acquire()
        t0 = time.perf_counter()
        packets = list(self.context.encode(frame))
        self.gate.done(time.perf_counter() - t0)
        return packets
