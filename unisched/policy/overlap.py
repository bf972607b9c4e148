"""Compute beside graphics where they partly overlap: how much of the time to run them together.

Why: on an H200 a ResNet-50 trainer keeps ~22% of its solo rate beside a heavy render, which keeps ~92% of its own
(no scheduler). Together they do 1.14 solos of work, more than either alone, but
the trainer gets far less than its weight share. Slicing them against each other gives each its share and throws
the overlap away (sum <= 1.0). Mixing three kinds of slice does both where it can: both thawed (rates kept_c,
kept_g), compute alone (1, 0), graphics alone (0, 1). With time fractions b, c, g (b + c + g = 1), compute gets
kept_c*b + c and graphics kept_g*b + g of their solo rates; the most overlap that still gives each its weight share
is the largest b for which c = max(0, share_c - kept_c*b) and g = max(0, share_g - kept_g*b) fit in 1 - b.

For the H200 pair: 1:1 -> b 0.64, sum 1.09; 3:1 -> b 0.32, sum 1.05; 1:3 -> b 0.96, sum 1.13 (against 1.0 sliced).
Open loop: the kept rates come from a calibration of the workloads on that GPU (`unisched calibrate`);
other workloads keep other rates. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import pairwise

from unisched.policy.contention import ContentionMap
from unisched.policy.model import Engine, PolicyError, Resource

__all__ = ["MixClock", "MixTurns", "OverlapMix", "PairMember", "PairWeights", "SliceKind", "mix_contenders", "overlap_mix",
           "pair_weights"]


class SliceKind(StrEnum):
    BOTH = "both"
    COMPUTE = "compute"
    GRAPHICS = "graphics"


@dataclass(frozen=True)
class OverlapMix:
    """Fractions of the time each kind of slice gets (they sum to 1)."""

    both: float
    compute_only: float
    graphics_only: float

    def fraction(self, kind: SliceKind) -> float:
        if kind is SliceKind.BOTH:
            return self.both
        return self.compute_only if kind is SliceKind.COMPUTE else self.graphics_only

    def kept(self, kept_compute: float, kept_graphics: float) -> tuple[float, float]:
        """(compute, graphics) normalized throughput this mix gives, by the calibrated rates."""
        return kept_compute * self.both + self.compute_only, kept_graphics * self.both + self.graphics_only


def overlap_mix(kept_compute: float, kept_graphics: float, share_compute: float) -> OverlapMix:
    """The mix with the most time together that still gives compute `share_compute` and graphics the rest."""
    if not (0.0 <= kept_compute <= 1.0 and 0.0 <= kept_graphics <= 1.0 and 0.0 <= share_compute <= 1.0):
        raise PolicyError(f"kept rates and share must be within 0..1, got {kept_compute}, {kept_graphics}, {share_compute}")
    share_graphics = 1.0 - share_compute

    def spare(b: float) -> float:  # time left over when both run for b: >= 0 means b is feasible
        return 1.0 - b - max(0.0, share_compute - kept_compute * b) - max(0.0, share_graphics - kept_graphics * b)

    # spare() is concave and piecewise linear (0 at b = 0): its largest root lies at 1 or on the last segment
    # that still has room; the breakpoints are where one side's exclusive time reaches zero
    points = sorted({0.0, 1.0, *(s / k for s, k in ((share_compute, kept_compute), (share_graphics, kept_graphics))
                                  if k > 0 and s / k < 1.0)})
    best = 0.0
    for lo, hi in pairwise(points):
        if spare(hi) >= -1e-12:
            best = hi
            continue
        if spare(lo) >= -1e-12:  # the root is inside [lo, hi]: spare is linear there
            s_lo, s_hi = spare(lo), spare(hi)
            best = min(hi, max(lo, lo + (hi - lo) * s_lo / (s_lo - s_hi)))  # rounding must not leave [lo, hi]
        break
    # nothing is left over: spare(best) is 0 (a root), or best is 1 with neither side owed time alone
    return OverlapMix(best, max(0.0, share_compute - kept_compute * best), max(0.0, share_graphics - kept_graphics * best))


@dataclass(frozen=True)
class MixClock:
    """Which kind of slice comes next: each kind runs for its fraction of a period at a stretch, and then the
    kind furthest behind its fraction of the recent time goes next. A value: `choose` and `ran` return the next.
    Why runs and not single slices: a render paused mid-frame finishes that frame beside the compute that
    follows it (up to a frame, ~28 ms on the H200), so every switch turns the start of a compute-only slice into
    time together. Alternating 50 ms slices (BBC BBC ...) switch ~7 times a second, and the render then takes ~9
    points of a trainer's 1:1 share that way; one switch a period costs about one frame a period. A longer period
    pauses each side for longer at a time.
    The history decays (`horizon_s`, at least two periods), so a new mix (weights or demand changed) is followed
    within a few periods."""

    period_s: float = 1.0
    horizon_s: float = 2.0
    spent: Mapping[SliceKind, float] = field(default_factory=dict)
    owed: Mapping[SliceKind, float] = field(default_factory=dict)
    """What a kind's last run fell short of its part of the period (negative: overran; slices are whole), added
    to its next run so that the runs keep the fractions on average."""
    current: SliceKind | None = None
    run_s: float = 0.0
    slice_s: float = 0.0

    def choose(self, mix: OverlapMix) -> tuple[SliceKind, MixClock]:
        kinds = [k for k in SliceKind if mix.fraction(k) > 0]
        if not kinds:
            return SliceKind.BOTH, self
        owed = {k: v for k, v in self.owed.items() if k in kinds}  # a kind that left the mix owes nothing on its return
        if len(kinds) == 1:  # one kind all the time: no runs to keep (and none overrun)
            return kinds[0], replace(self, owed={}, current=None)
        current = self.current
        run_s = self.run_s
        if current is not None and run_s > 0.0:
            target = mix.fraction(current) * self.period_s + owed.get(current, 0.0)
            if current in kinds and run_s < target - 1e-9:  # (ten 0.05 s slices sum to 0.4999...)
                return current, replace(self, owed=owed)
            owed[current] = max(-self.period_s, min(self.period_s, target - run_s))
            run_s = 0.0
        total = sum(self.spent.values())

        def behind(k: SliceKind) -> float:
            return mix.fraction(k) * total - self.spent.get(k, 0.0)

        # where a kind's part of the period is under a slice, runs are single slices and the one that just ran
        # goes again while still behind (by half a slice); otherwise another kind follows a run
        short = current is not None and mix.fraction(current) * self.period_s < self.slice_s
        nxt = [k for k in kinds if k is not current or (short and behind(k) > 0.5 * self.slice_s)] or kinds
        return max(nxt, key=lambda k: (behind(k), mix.fraction(k))), replace(self, owed=owed, run_s=run_s)

    def ran(self, kind: SliceKind, seconds: float) -> MixClock:
        keep = max(0.0, 1.0 - seconds / max(self.horizon_s, 2.0 * self.period_s))
        spent = {k: v * keep for k, v in self.spent.items()}
        spent[kind] = spent.get(kind, 0.0) + seconds
        run_s = self.run_s + seconds if kind is self.current else seconds
        return replace(self, spent=spent, run_s=run_s, current=kind, slice_s=seconds)


@dataclass
class MixTurns:
    """A mutable holder of a `MixClock` (the same turns, one call at a time)."""

    period_s: float = 1.0
    horizon_s: float = 2.0
    _clock: MixClock | None = None

    def choose(self, mix: OverlapMix) -> SliceKind:
        kind, self._clock = self._now().choose(mix)
        return kind

    def ran(self, kind: SliceKind, seconds: float) -> None:
        self._clock = self._now().ran(kind, seconds)

    def _now(self) -> MixClock:
        if self._clock is None:
            self._clock = MixClock(self.period_s, self.horizon_s)
        return self._clock


# --- who is on each side ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PairMember:
    """A tenant with demand, as the compute + graphics mix weighs it."""

    weight: int
    resources: frozenset[Resource]
    cooperative: bool


@dataclass(frozen=True)
class PairWeights:
    """A GPU's compute and graphics sides, by the summed weights of the tenants with demand on each."""

    compute: int
    graphics: int
    cooperative: bool
    """A cooperative tenant is among them (its leases follow the mix whatever the saturation gate says)."""


def mix_contenders(pair: PairWeights | None) -> int:
    """The joint resource's contenders: two when both sides have demand, else the one side (or none)."""
    if pair is None:
        return 0
    return 2 if pair.compute and pair.graphics else int(bool(pair.compute or pair.graphics))


def pair_weights(members: Iterable[PairMember], contention: ContentionMap) -> dict[int, PairWeights]:
    """Per GPU, the weights of the tenants with demand on its compute and on its graphics side (a tenant using
    both counts on the compute side)."""
    out: dict[int, PairWeights] = {}
    compute, graphics = contention.domain(Engine.COMPUTE), contention.domain(Engine.GRAPHICS)
    for m in members:
        sides: dict[int, bool] = {}  # GPU -> on its compute side
        for r in m.resources:
            if r.domain == compute:
                sides[r.gpu] = True
            elif r.domain == graphics:
                sides.setdefault(r.gpu, False)
        for g, is_compute in sides.items():
            p = out.get(g, PairWeights(0, 0, False))
            out[g] = PairWeights(p.compute + m.weight * is_compute, p.graphics + m.weight * (not is_compute),
                                 p.cooperative or m.cooperative)
    return out
