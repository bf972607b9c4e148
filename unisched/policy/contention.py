"""Which engines contend with which, per GPU model.

Measured, not assumed (DESIGN.md): on the H100/H200 rendering runs on a few graphics-capable SMs and
overlaps with CUDA, so graphics is its own domain there; on graphics-class GPUs every SM renders and
compute and graphics share one domain. The video engines are always separate domains.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from unisched.policy.model import Engine, PolicyError, Resource

__all__ = ["ContentionMap", "SEPARATE_GRAPHICS", "SHARED_SM"]


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
    def for_gpu(gpu_name: str) -> ContentionMap:
        """The measured map for a GPU model name as NVML reports it."""
        upper = gpu_name.upper()
        if any(chip in upper for chip in ("H100", "H200", "H800", "H20", "GH200")):
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
