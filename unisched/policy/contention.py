"""Which engines contend with which, per GPU.

Measured, not assumed. On graphics-class GPUs every SM renders, and compute and graphics contend fully.
On the H100/H200 rendering runs on a few graphics-capable SMs, and whether it overlaps with CUDA depends on
the load: one probe saw CUDA keep 55-95% of its solo rate next to rendering, the benchmark of
2026-11-30 saw it keep 14% (bench/results). So compute and graphics are sliced against each other (one
"sm" domain: the guarantee holds everywhere) unless a calibration run on that GPU measured that they
overlap (`from_kept`): fully (each keeps most of its rate: not sliced at all) or partly (together they do more
than either alone, but one falls below its share: mixed slices, unisched/policy/overlap.py). The video engines
are always domains of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from unisched.policy.model import Engine, PolicyError, Resource

__all__ = ["MIX_SUM", "OVERLAP_KEPT", "PARTIAL_OVERLAP", "SEPARATE_GRAPHICS", "SHARED_SM", "ContentionMap"]

OVERLAP_KEPT = 0.75
MIX_SUM = 0.97
"""Kept rates summing to at least this get mixed slices (policy.overlap); below it they are sliced as one domain.
Where the sum is 1 or more, running together some of the time gains (or, at 1, costs nothing) and the mix pauses
each side once a period instead of at every slice. On the H200 the contended pair (a matmul trainer + render,
kept 0.125 + 0.875 = 1.00, 1.01 on 11-30) missed its targets sliced (1:3: 0.21 / 0.79, 4.3 points; 1:1 guarantee
short) and met them mixed (0.50 / 0.50 and 0.24 / 0.76, 0.2-0.9 points, 2 of 2 rounds each:
bench/results/2026-12-01-h200-g/ call-d). The margin under 1 covers one calibration's noise for such a pair; a sum
between it and 1 plans no time together (exclusive runs, as sliced). A ResNet-50 trainer + render kept 1.03-1.13
in runs of one day (its solo rate drifting), all mixed now. Well under 1 (every SM renders, as on graphics-class
GPUs) the closed-loop slicing of one domain stays."""


@dataclass(frozen=True)
class ContentionMap:
    """Maps each engine to the name of the domain it contends in."""

    name: str
    domains: Mapping[Engine, str]
    kept: tuple[float, float] | None = None
    """(compute, graphics) solo-rate fractions kept together, where they overlap partly: slices are mixed."""

    def domain(self, engine: Engine) -> str:
        return self.domains[engine]

    def resources(self, gpus: Iterable[int], engines: Iterable[Engine]) -> frozenset[Resource]:
        return frozenset(Resource(g, self.domains[e]) for g in gpus for e in engines)

    @staticmethod
    def named(name: str) -> ContentionMap:
        try:
            return _BY_NAME[name]
        except KeyError:
            raise PolicyError(f"contention must be one of {sorted(_BY_NAME)} or 'auto', got {name!r}") from None

    @staticmethod
    def from_kept(compute_kept: float, graphics_kept: float) -> ContentionMap:
        """The map a calibration implies: CUDA and rendering run together, each kept this fraction of its solo rate.

        Overlap (separate domains, never sliced against each other) where both keep >= OVERLAP_KEPT, so that
        leaving them unsliced still gives each at least its weight share for weights up to 3:1; partial overlap
        (separate domains, mixed slices: policy.overlap) where together they keep >= MIX_SUM; otherwise they are
        sliced as one domain. Must agree with bench/scoring.py:contention_verdict.
        """
        if compute_kept >= OVERLAP_KEPT and graphics_kept >= OVERLAP_KEPT:  # NaN compares False: sliced
            return SEPARATE_GRAPHICS
        if compute_kept + graphics_kept >= MIX_SUM and min(compute_kept, graphics_kept) >= 0.0:
            return ContentionMap.partial(compute_kept, graphics_kept)
        return SHARED_SM

    @staticmethod
    def partial(compute_kept: float, graphics_kept: float) -> ContentionMap:
        """Mixed slices planned with these kept rates, whatever their sum (`--contention partial-overlap`: an operator
        who knows the pair overlaps, where one calibration's noise fell under MIX_SUM)."""
        if not (compute_kept >= 0.0 and graphics_kept >= 0.0):  # NaN too
            raise PolicyError(f"kept rates must be >= 0, got {compute_kept!r}, {graphics_kept!r}")
        kept = (min(1.0, compute_kept), min(1.0, graphics_kept))  # above solo is noise
        return ContentionMap(PARTIAL_OVERLAP, SEPARATE_GRAPHICS.domains, kept)


SHARED_SM = ContentionMap(
    "shared-sm",
    MappingProxyType({Engine.COMPUTE: "sm", Engine.GRAPHICS: "sm", Engine.DECODE: "nvdec", Engine.ENCODE: "nvenc"}),
)
SEPARATE_GRAPHICS = ContentionMap(
    "separate-graphics",
    MappingProxyType({Engine.COMPUTE: "sm", Engine.GRAPHICS: "gfx", Engine.DECODE: "nvdec", Engine.ENCODE: "nvenc"}),
)
PARTIAL_OVERLAP = "partial-overlap"
"""The name of a map made from a calibration (its kept rates): not one `--contention` can name."""
_BY_NAME = {m.name: m for m in (SHARED_SM, SEPARATE_GRAPHICS)}
