"""Which engines contend with which, per GPU.

Measured, not assumed. On graphics-class GPUs every SM renders, and compute and graphics contend fully.
On the H100/H200 rendering runs on a few graphics-capable SMs, and whether it overlaps with CUDA depends on
the load: one probe (DESIGN.md) saw CUDA keep 55-95% of its solo rate next to rendering, the benchmark of
2026-11-30 saw it keep 14% (bench/results). So compute and graphics are sliced against each other (one
"sm" domain: the guarantee holds everywhere) unless a calibration run on that GPU measured that they
overlap (`from_kept`). The video engines are always domains of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from unisched.policy.model import Engine, PolicyError, Resource

__all__ = ["OVERLAP_KEPT", "SEPARATE_GRAPHICS", "SHARED_SM", "ContentionMap"]

OVERLAP_KEPT = 0.75


@dataclass(frozen=True)
class ContentionMap:
    """Maps each engine to the name of the domain it contends in."""

    name: str
    domains: Mapping[Engine, str]

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

        Overlap (separate domains) only where both keep >= OVERLAP_KEPT, so that leaving them unsliced still gives
        each at least its weight share for weights up to 3:1; otherwise they are sliced as one domain.
        Must agree with bench/scoring.py:contention_verdict.
        """
        if compute_kept >= OVERLAP_KEPT and graphics_kept >= OVERLAP_KEPT:  # NaN compares False: sliced
            return SEPARATE_GRAPHICS
        return SHARED_SM


SHARED_SM = ContentionMap(
    "shared-sm",
    MappingProxyType({Engine.COMPUTE: "sm", Engine.GRAPHICS: "sm", Engine.DECODE: "nvdec", Engine.ENCODE: "nvenc"}),
)
SEPARATE_GRAPHICS = ContentionMap(
    "separate-graphics",
    MappingProxyType({Engine.COMPUTE: "sm", Engine.GRAPHICS: "gfx", Engine.DECODE: "nvdec", Engine.ENCODE: "nvenc"}),
)
_BY_NAME = {m.name: m for m in (SHARED_SM, SEPARATE_GRAPHICS)}
