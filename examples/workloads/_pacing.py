"""Frame pacing and frame-rate figures of a paced player (examples/cloud_gaming.py), pure: no GPU, clock injected.

Why here: the pacing decides which frame slots a player fills, and the figures (mean, the worst second, the 1% low)
are what the cloud-gaming suite judges, so both are unit-tested on synthetic times.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from _window import percentile


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
    than there are, no GPU scheduler can make their frame rates follow the weights. Its user-mode part apart: time
    in the kernel includes the driver's wait for the GPU when that wait sleeps in a loop (`__GL_YIELD=USLEEP`)."""

    start_at: float
    cpu: Callable[[], float] = time.process_time
    user: Callable[[], float] = lambda: os.times().user
    first: tuple[float, float, float] | None = None  # (wall, CPU seconds, user-mode CPU seconds) at the first frame
    last: tuple[float, float, float] | None = None

    def on_frame(self, now: float) -> None:
        if now >= self.start_at:
            mark = (now, self.cpu(), self.user())
            self.first = self.first or mark
            self.last = mark

    def cores(self) -> float | None:
        return self._cores(1)

    def user_cores(self) -> float | None:
        return self._cores(2)

    def _cores(self, i: int) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[i] - self.first[i]) / (self.last[0] - self.first[0])


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
