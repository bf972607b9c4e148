"""Which engines contend with which, per GPU.

Measured, not assumed. On graphics-class GPUs every SM renders, and compute and graphics contend fully.
On the H100/H200 rendering runs on a few graphics-capable SMs, and whether it overlaps with CUDA depends on
the load: CUDA keeps anywhere from 14% to 95% of its solo rate next to rendering. So compute and graphics are
sliced against each other (one "sm" domain: the guarantee holds everywhere) unless a calibration run on that GPU
measured that they overlap (`from_kept`): fully (each keeps most of its rate: not sliced at all) or partly (together they do more
than either alone, but one falls below its share: mixed slices, unisched/policy/overlap.py). The video engines
are always domains of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from unisched.policy.model import Engine, PolicyError, Resource
from unisched.policy.tuning import TUNING

__all__ = ["PARTIAL_OVERLAP", "SEPARATE_GRAPHICS", "SHARED_SM", "ContentionMap"]

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

        Overlap (separate domains, never sliced against each other) where both keep >= Tuning.overlap_kept;
        partial overlap (separate domains, mixed slices: policy.overlap) where together they keep >= Tuning.mix_sum;
        otherwise they are sliced as one domain (the reasons are the fields'). Must agree with
        bench/scoring.py:contention_verdict.
        """
        if compute_kept >= TUNING.overlap_kept and graphics_kept >= TUNING.overlap_kept:  # NaN compares False: sliced
            return SEPARATE_GRAPHICS
        if compute_kept + graphics_kept >= TUNING.mix_sum and min(compute_kept, graphics_kept) >= 0.0:
            return ContentionMap.partial(compute_kept, graphics_kept)
        return SHARED_SM

    @staticmethod
    def partial(compute_kept: float, graphics_kept: float) -> ContentionMap:
        """Mixed slices planned with these kept rates, whatever their sum (`--contention partial-overlap`: an operator
        who knows the pair overlaps, where one calibration's noise fell under Tuning.mix_sum)."""
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
