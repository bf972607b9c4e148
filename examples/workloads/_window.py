"""Measurement window shared by the benchmark workloads (stdlib only).

Why a shared helper: tenants of one pair are separate processes that start with different
initialisation costs (torch + CUDA context vs. an EGL context). If each one measured "warmup
seconds after *its own* start", their windows would not overlap exactly and a tenant that measures
while its partner is still initialising would look faster than it is. So every workload accepts an
absolute `--start-at` wall-clock time from the orchestrator and measures over the same
[start_at, start_at + seconds] interval.

Counting: a step returns how many items it has *completed* (after a synchronising call such as
torch.cuda.synchronize or glFinish). Throughput = items completed inside [start_at, end_at] divided
by end_at - start_at (see measure() for the edges and for a late start).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["TIMELINE_STEP_S", "StepPauser", "Window", "add_window_args", "fail", "latency_summary", "measure", "percentile",
           "plan_window", "quantile_interval", "write_json", "write_report"]

TIMELINE_STEP_S = 0.5


@dataclass(frozen=True)
class Window:
    """What one measurement window saw."""

    items: int
    seconds: float
    t_first: float  # wall time the window started: start_at, or the first completion when late
    t_last: float  # wall time of the last counted completion
    start_at: float  # requested window start
    end_at: float  # requested window end
    late_s: float  # 0, or how far initialisation overran start_at
    warmup_items: int
    # (seconds since start_at, items completed in the window so far), one point per TIMELINE_STEP_S: the
    # benchmarks plot each tenant's share over time from it
    timeline: tuple[tuple[float, int], ...] = ()

    @property
    def throughput(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0


def add_window_args(parser: argparse.ArgumentParser) -> None:
    """The arguments every workload shares, so the orchestrator can drive them all alike."""
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="length of the measured window in seconds (default: 20)")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds of unmeasured work before the window, counted from this "
                             "process's start; ignored when --start-at is given (default: 5)")
    parser.add_argument("--start-at", type=float, default=None, metavar="EPOCH",
                        help="absolute wall-clock time (time.time()) at which the measured window "
                             "starts; the orchestrator gives every tenant of a pair the same value "
                             "so their windows coincide. Total run time is then "
                             "(start-at - now) + seconds.")
    parser.add_argument("--report", type=Path, default=None, metavar="PATH",
                        help="write the result as JSON to PATH")


def plan_window(args: argparse.Namespace, process_start: float) -> tuple[float, float]:
    """Return (start_at, end_at) in wall-clock seconds."""
    start_at = args.start_at if args.start_at is not None else process_start + args.warmup
    return start_at, start_at + args.seconds


def measure(step: Callable[[], int], start_at: float, end_at: float) -> Window:
    """Run `step` until end_at; throughput = items completed in the window / the window's length.

    `step` must block until the items it reports are finished (sync / glFinish), so completion
    times are real; keep each step short (milliseconds) so the edges cost little. The window is the
    nominal [start_at, end_at] shared by all tenants, frozen periods included: a tenant paused by
    the scheduler across an edge must not have that pause dropped from its denominator. The step
    straddling start_at is counted and the one straddling end_at is not, so on average the edges
    cancel. If initialisation overran start_at (no step finished before it), the window starts at
    the first completion instead, since that first step carries one-off costs; late_s says by how much.
    """
    warmup_items = 0
    while True:
        done = step()
        t = time.time()
        if t >= start_at:
            break
        warmup_items += done
    if warmup_items > 0:
        window_start, items = start_at, done
    else:
        window_start, items = t, 0
        warmup_items = done
    t_last = t
    timeline: list[tuple[float, int]] = [(round(t - start_at, 3), items)]
    next_point = t + TIMELINE_STEP_S
    while True:
        done = step()
        t = time.time()
        if t > end_at:
            break
        items += done
        t_last = t
        if t >= next_point:
            timeline.append((round(t - start_at, 3), items))
            next_point = t + TIMELINE_STEP_S
    return Window(items=items, seconds=max(0.0, end_at - window_start), t_first=window_start,
                  t_last=t_last, start_at=start_at, end_at=end_at,
                  late_s=window_start - start_at, warmup_items=warmup_items, timeline=tuple(timeline))


def write_report(path: Path | None, kind: str, unit: str, window: Window,
                 extra: dict[str, Any]) -> dict[str, Any]:
    """Build the JSON report every workload writes (same shape for all, plus `extra`)."""
    report: dict[str, Any] = {
        "kind": kind,
        "throughput": window.throughput,
        "unit": unit,
        "items": window.items,
        "seconds": window.seconds,
        "pid": os.getpid(),
    }
    report["window"] = asdict(window)
    report.update(extra)
    write_json(path, report, indent=2)
    return report


def write_json(path: Path | None, obj: dict[str, Any], indent: int = 1) -> None:
    """Written whole or not at all: the orchestrator never sees a half-written report (None: nowhere)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent) + "\n")
    tmp.replace(path)


class StepPauser:
    """Idle between steps on request: SIGUSR1 pauses at the next step boundary, SIGUSR2 resumes.

    Why: a benchmark that compares requests beside a busy trainer with requests beside an idle one in the same run
    (bench/interleave.py) needs the trainer to go idle the way a real one does, between steps, with nothing in
    flight and its lease handed back; a SIGSTOP mid-step would be timed into that step. The signals are blocked
    and read with sigpending/sigwait, so no handler races the check: make one before any thread starts (the
    unisched client's, PyTorch's), which then inherit the mask.
    """

    SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})

    def __init__(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        self.pauses = 0
        self.paused_s = 0.0

    def between_steps(self, on_pause: Callable[[], None] = lambda: None) -> None:
        """At a step boundary: when a pause was asked for, call `on_pause` (hand the GPU back) and wait for the
        resume. A resume already pending with it (both came within one step) is no pause."""
        pending = signal.sigpending() & self.SIGNALS
        if not pending:
            return
        for sig in pending:
            signal.sigwait({sig})
        if pending != {signal.SIGUSR1}:
            return  # a resume alone (the end of a run), or a pause and its resume within one step
        on_pause()
        t = time.monotonic()
        signal.sigwait({signal.SIGUSR2})
        self.pauses += 1
        self.paused_s += time.monotonic() - t


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence: a value that was really seen."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def quantile_interval(values: Sequence[float], q: float, confidence: float = 0.9) -> tuple[float, float]:
    """A distribution-free interval for the q-th percentile (q in 0..100) of what was sampled: the order
    statistics that bracket it with `confidence` (binomial ranks), clamped to the smallest and largest value.

    Why: a p99 from a few hundred requests rests on its top few samples; two setups whose intervals overlap
    cannot be told apart by it (12 s at 20 req/s: 240 requests, p99 between the 1st and the ~6th highest)."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no values")
    p, tail = q / 100.0, (1.0 - confidence) / 2.0
    cdf, acc = [], 0.0  # cdf[k] = P(Binomial(n, p) <= k)
    for k in range(n + 1):
        if 0.0 < p < 1.0:
            acc += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                            + k * math.log(p) + (n - k) * math.log1p(-p))
        else:
            acc = 1.0 if (p <= 0.0 or k == n) else 0.0
        cdf.append(acc)
    lo = max([k for k in range(n + 1) if cdf[k] <= tail], default=0)  # ranks are 1-based: x_(lo) ... x_(hi)
    hi = min([k for k in range(n + 1) if cdf[k] >= 1.0 - tail], default=n) + 1
    return ordered[max(1, lo) - 1], ordered[min(n, hi) - 1]


def latency_summary(ms: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 with the p99's 90% interval (p99_lo, p99_hi), n, mean and max of latencies in ms ({} if none)."""
    if not ms:
        return {}
    p99_lo, p99_hi = quantile_interval(ms, 99)
    return {"p50": round(percentile(ms, 50), 3), "p90": round(percentile(ms, 90), 3), "p99": round(percentile(ms, 99), 3),
            "p99_lo": round(p99_lo, 3), "p99_hi": round(p99_hi, 3), "n": len(ms),
            "mean": round(sum(ms) / len(ms), 3), "max": round(max(ms), 3)}


def fail(message: str, code: int = 2) -> int:
    """Print a clear one-line error and return the exit code (2: environment not usable)."""
    print(f"error: {message}", file=sys.stderr)
    return code
