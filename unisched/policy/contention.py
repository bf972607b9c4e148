"""Which engines contend with which, per GPU.

Measured, not assumed. On graphics-class GPUs every SM renders, and compute and graphics contend fully.
On the H100/H200 rendering runs on a few graphics-capable SMs, and whether it overlaps with CUDA depends on
the load: one probe (DESIGN.md) saw CUDA keep 55-95% of its solo rate next to rendering, the benchmark of
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
MIX_SUM = 1.05
"""Kept rates summing to at least this are a partial overlap worth mixed slices. Any sum above 1 gains from running
together some of the time (policy.overlap); the margin covers the calibration's noise: the H200's ResNet-50 trainer
kept 0.16-0.27 beside the render in runs of one day (bench/results/2026-12-01-h200-e/, its solo rate drifting) and
the render 0.88, sums 1.03-1.13 (scored over the seconds both ran; two of those runs fall below this and would be
sliced), and slicing missed the trainer's guarantee by 3-8 points where mixed slices met it. The contended pair of
11-30 (a matmul trainer + render) kept 1.01."""


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
