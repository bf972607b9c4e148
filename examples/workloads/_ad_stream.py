"""The driving simulation's stream and figures (examples/ad_sim.py), pure: no GPU, no sockets of its own.

Why here: the framing is the protocol between the two stage processes, and the window, latencies and timeline are
what the ad-sim suite reports, so all of it is unit-tested on synthetic bytes and times.
"""

from __future__ import annotations

import math
import statistics
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

TIMELINE_STEP_S = 0.5

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
