"""The online scenario measured interleaved: one run, the offline tenant idle in every other period.

Why: on the lent H200 VM the online tenant alone moves more between runs than the setups differ from each other.
Two alone runs minutes apart had p50s of 5.82 and 4.58 ms, and the 5 s medians inside one alone run ranged 5.0-6.6 ms
(bench/results/2026-12-02-h200-a/): a 5 % target at p99 cannot be read off runs taken minutes apart. Alternating
within one run, trainer running for a period (~1 s) and idle for the next, puts every request that met the trainer
a second or two from requests on the same host, in the same processes, that did not: an A/B interleaving, whose
slow drift falls on both sides alike.

The trainer idles cooperatively (examples/02 --pausable): SIGUSR1 stops it at its next step boundary, its lease
released, until SIGUSR2. Why not SIGSTOP: stopped mid-step, a trainer would time the stop into its step (CUDA
events around it) and report a second of GPU use to lease enforcement. A request counts for the phase it arrived in,
unless it arrived within `guard_s` of a switch (the step in flight at a pause finishes, ~25 ms; a resumed trainer
takes a step to be back at its pace). The trainer's throughput is its items over the seconds of its running
periods, against its solo run (it completes nothing while idle; its first steps after each resume count against it).
What this does not see: a cost a setup puts on the online tenant in both phases (MPS's own path for a lone client,
the client library's round trip). Those are measured apart (the mps-alone setup; `lease_wait_ms`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

RUNNING, PAUSED = "running", "paused"


@dataclass(frozen=True)
class Alternation:
    """Periods of `period_s` from the window's start: even ones with the offline tenant running, odd ones paused."""

    start_at: float
    """The window's start (time.time()); requests' and completions' times are seconds after it."""
    seconds: float
    period_s: float
    guard_s: float
    until_s: float | None = None
    """Where the pauses ended (the final resume, seconds into the window), when before the window's end: nothing
    after it counts for either phase. Runs recorded without `resumed_at_s` resumed the trainer right after the last
    switch, so a last pause of theirs ran it: from_json finds that from the number of switches."""

    def __post_init__(self) -> None:
        if self.period_s <= 0 or self.seconds <= 0:
            raise ValueError(f"period and window must be positive, got {self.period_s!r} and {self.seconds!r}")
        if not 0 <= 2 * self.guard_s < self.period_s:
            raise ValueError(f"guard {self.guard_s!r} s must be under half the period {self.period_s!r} s")

    def phase(self, t: float) -> str | None:
        """The phase of a moment `t` seconds into the window; None near a switch or outside the window."""
        if not 0 <= t < self.seconds or (self.until_s is not None and t >= self.until_s - self.guard_s):
            return None
        k, into = divmod(t, self.period_s)
        if into < self.guard_s or self.period_s - into < self.guard_s:
            return None
        return RUNNING if int(k) % 2 == 0 else PAUSED

    def switches(self) -> list[tuple[float, bool]]:
        """(seconds into the window, stop?) for every switch inside it: stop at the end of each even period,
        continue at the end of each odd one."""
        out: list[tuple[float, bool]] = []
        k = 1
        while k * self.period_s < self.seconds:
            out.append((k * self.period_s, k % 2 == 1))
            k += 1
        return out

    def to_json(self) -> dict[str, float]:
        out = {"start_at": self.start_at, "seconds": self.seconds, "period_s": self.period_s, "guard_s": self.guard_s}
        return out if self.until_s is None else {**out, "until_s": self.until_s}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Alternation:
        """A plan as a run recorded it (with how it went: `resumed_at_s`, `switches`)."""
        plan = cls(float(d["start_at"]), float(d["seconds"]), float(d["period_s"]), float(d["guard_s"]),
                   None if d.get("until_s") is None else float(d["until_s"]))
        if d.get("resumed_at_s") is not None:
            until = float(d["resumed_at_s"])
        elif d.get("switches") is not None and int(d["switches"]) % 2 == 1:  # recorded before the final pause was held
            until = int(d["switches"]) * plan.period_s
        else:
            return plan
        return plan if until >= plan.seconds else dataclasses.replace(plan, until_s=until)


def split_latencies(plan: Alternation, arrivals_s: Sequence[float], latencies_ms: Sequence[float],
                    since_s: float = 0.0) -> dict[str, list[float]]:
    """The requests' latencies by the phase they arrived in (those after `since_s`: the trainer's first step)."""
    out: dict[str, list[float]] = {RUNNING: [], PAUSED: []}
    for a, ms in zip(arrivals_s, latencies_ms, strict=False):
        p = plan.phase(a)
        if p is not None and a >= since_s:
            out[p].append(ms)
    return out


def pair_of(plan: Alternation, t: float) -> int | None:
    """Which running period + following paused period (a pair, 0-based) a moment belongs to, guards left out."""
    return None if plan.phase(t) is None else int(t // (2 * plan.period_s))


Block = tuple[list[float], list[float]]
"""One pair of periods: the latencies (ms) of requests beside the trainer, and of those in the idle period after."""


def period_pairs(plan: Alternation, arrivals_s: Sequence[float], latencies_ms: Sequence[float],
                 since_s: float = 0.0) -> list[Block]:
    """The run's requests by pair of periods (a running period and the paused one after it), pairs with both."""
    pairs: dict[int, Block] = {}
    for a, ms in zip(arrivals_s, latencies_ms, strict=False):
        k = pair_of(plan, a)
        if k is None or a < since_s:
            continue
        side = pairs.setdefault(k, ([], []))
        side[0 if plan.phase(a) == RUNNING else 1].append(ms)
    return [pairs[k] for k in sorted(pairs) if pairs[k][0] and pairs[k][1]]


def paired_bootstrap(blocks: Sequence[Block], stat: Callable[[Sequence[float]], float], reps: int = 1000,
                     seed: int = 1, confidence: float = 0.9) -> tuple[float, float] | None:
    """A `confidence` interval for stat(running) / stat(paused), resampling whole pairs of periods with
    replacement: requests seconds apart share the host's state, so the pairs, not the requests, are the
    independent units; a pair keeps both of its sides. Pairs of several runs pool. None below 4 pairs."""
    if len(blocks) < 4:
        return None
    rng = random.Random(seed)
    ratios: list[float] = []
    for _ in range(reps):
        run: list[float] = []
        idle: list[float] = []
        for r, q in (blocks[rng.randrange(len(blocks))] for _ in blocks):
            run += r
            idle += q
        base = stat(idle)
        if base > 0:
            ratios.append(stat(run) / base)
    ratios.sort()
    tail = (1 - confidence) / 2
    lo = ratios[max(0, math.floor(tail * len(ratios)))]
    hi = ratios[min(len(ratios) - 1, math.ceil((1 - tail) * len(ratios)) - 1)]
    return lo, hi


def running_rate(plan: Alternation, items: float, since_s: float = 0.0) -> float | None:
    """Items per second the offline tenant ran: `items` completed in the window from `since_s` (its first step,
    where it started late) over the seconds it ran from then on: its running periods, guards included, and all
    of the window after the pauses ended (`until_s`)."""
    end = plan.seconds if plan.until_s is None else min(plan.seconds, plan.until_s)
    seconds, k = max(0.0, plan.seconds - max(end, since_s)), 0
    while k * plan.period_s < end:
        if k % 2 == 0:
            seconds += max(0.0, min((k + 1) * plan.period_s, end) - max(k * plan.period_s, since_s))
        k += 1
    return items / seconds if seconds > 0 else None


@dataclass
class Alternator:
    """Sends one process the pause and resume signals on an Alternation's switches, in a thread; always resumes
    it at the end. `kill`, `clock` and `wait` are injectable (a test drives them; `wait(s)` returns True to halt)."""

    plan: Alternation
    pid: int
    kill: Callable[[int, int], None] = os.kill
    clock: Callable[[], float] = time.time
    wait: Callable[[float], bool] | None = None
    pause_signal: int = signal.SIGUSR1
    resume_signal: int = signal.SIGUSR2
    lags_s: list[float] = field(default_factory=list)
    """How late each switch was sent."""
    resumed_at_s: float | None = None
    """When the final resume was sent, seconds into the window."""
    error: str | None = None

    def __post_init__(self) -> None:
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        if self.wait is None:
            self.wait = self._halt.wait

    def run(self) -> None:
        assert self.wait is not None
        try:
            for at, stop in self.plan.switches():
                due = self.plan.start_at + at
                if self.wait(max(0.0, due - self.clock())):
                    return
                self.kill(self.pid, self.pause_signal if stop else self.resume_signal)
                self.lags_s.append(self.clock() - due)
            # a last pause holds to the window's end: resumed at once, its period would run the trainer
            self.wait(max(0.0, self.plan.start_at + self.plan.seconds - self.clock()))
        except ProcessLookupError:
            self.error = "the paused tenant ended before the window did"
        finally:
            self.resumed_at_s = self.clock() - self.plan.start_at
            with contextlib.suppress(ProcessLookupError):
                self.kill(self.pid, self.resume_signal)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="alternator", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        """Halt (resuming the process) and say how it went."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        return {**self.plan.to_json(), "switches": len(self.lags_s), "resumed_at_s": self.resumed_at_s,
                "max_lag_ms": round(1000 * max(self.lags_s), 3) if self.lags_s else None, "error": self.error}
