"""What the device plugin advertises, as plain data: one device ID per unit of a resource on a GPU.

`unisched.io/gpu-weight` has `units_per_gpu` IDs per GPU (gpu0-w000 ... gpu0-w099): a pod asks for its weight
as a count and gets that many IDs, all on one GPU. `unisched.io/render-sessions` and
`unisched.io/decode-sessions` count live sessions the same way (gpu0-r0, gpu0-d0, ...). No I/O here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "DECODE",
    "RENDER",
    "TENANT_PREFIX",
    "WEIGHT",
    "AllocationError",
    "Resource",
    "Unit",
    "one_gpu",
    "parse_id",
    "preferred_allocation",
    "tenant_name",
]

WEIGHT = "unisched.io/gpu-weight"
RENDER = "unisched.io/render-sessions"
DECODE = "unisched.io/decode-sessions"
_LETTER = {WEIGHT: "w", RENDER: "r", DECODE: "d"}
_ID = re.compile(r"gpu(\d{1,3})-([wrd])(\d{1,5})")

TENANT_PREFIX = "k8s-"
"""Tenants the adopter creates are named k8s-...; it removes such tenants when their pod is gone."""


class AllocationError(ValueError):
    """A request the kubelet sent that cannot be served; str() is the message the pod's events show."""


@dataclass(frozen=True, order=True)
class Unit:
    gpu: int
    letter: str
    index: int


def parse_id(device_id: str) -> Unit | None:
    m = _ID.fullmatch(device_id)
    return Unit(int(m.group(1)), m.group(2), int(m.group(3))) if m else None


@dataclass(frozen=True)
class Resource:
    """One advertised resource: its name and how many device IDs each GPU has."""

    name: str
    per_gpu: int

    @property
    def letter(self) -> str:
        return _LETTER[self.name]

    @property
    def endpoint(self) -> str:
        """The plugin's socket file in the kubelet's device-plugins directory."""
        return "unisched-" + self.name.split("/", 1)[1] + ".sock"

    def device_id(self, gpu: int, index: int) -> str:
        width = max(1 if self.letter != "w" else 3, len(str(self.per_gpu - 1)))
        return f"gpu{gpu}-{self.letter}{index:0{width}d}"

    def device_ids(self, gpus: Iterable[int]) -> list[str]:
        return [self.device_id(g, k) for g in gpus for k in range(self.per_gpu)]


def one_gpu(resource: Resource, gpus: Sequence[int], ids: Sequence[str]) -> int:
    """The GPU a container's IDs are on; AllocationError unless they are known, distinct and on one GPU."""
    if not ids:
        raise AllocationError(f"{resource.name}: the request names no devices")
    if len(set(ids)) != len(ids):
        raise AllocationError(f"{resource.name}: the request names a device twice: {sorted(ids)}")
    units = {i: parse_id(i) for i in ids}
    unknown = sorted(
        i for i, u in units.items()
        if u is None or u.letter != resource.letter or u.gpu not in gpus or u.index >= resource.per_gpu
        or resource.device_id(u.gpu, u.index) != i
    )
    if unknown:
        raise AllocationError(f"{resource.name}: unknown device IDs {unknown} (this node advertises GPUs {list(gpus)})")
    on = sorted({u.gpu for u in units.values() if u is not None})
    if len(on) != 1:
        raise AllocationError(
            f"{resource.name}: the devices span GPUs {on}; a container's {resource.name} must come from one GPU "
            "(ask for at most the units of one GPU)"
        )
    return on[0]


def tenant_name(ids: Iterable[str], gpus: Iterable[int] | None = None) -> str:
    """The tenant of a container's gpu-weight IDs: the same for the plugin at Allocate (which knows only the
    IDs) and for the adopter that later finds the pod holding them. The DRA driver passes IDs of its own
    (claim UID and device names) with the claim's GPUs."""
    ordered = sorted(ids)
    on = sorted(set(gpus) if gpus is not None else {u.gpu for i in ordered if (u := parse_id(i)) is not None})
    digest = hashlib.sha256(",".join(ordered).encode()).hexdigest()[:12]
    return f"{TENANT_PREFIX}g{'-'.join(map(str, on))}-{digest}"


def preferred_allocation(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """`size` IDs from one GPU where one GPU has room: the must-include IDs' GPU, else the GPU with the fewest
    free units that still fits (keeping big holes for big requests). Where none fits, the fewest GPUs."""
    chosen = list(dict.fromkeys(must_include))
    free: dict[int, list[str]] = {}
    for i in sorted(set(available) - set(chosen), key=lambda i: parse_id(i) or Unit(-1, "", -1)):
        u = parse_id(i)
        if u is not None:
            free.setdefault(u.gpu, []).append(i)
    need = size - len(chosen)
    if need <= 0:
        return chosen[:size] if size > 0 else chosen
    pinned = {u.gpu for i in chosen if (u := parse_id(i)) is not None}
    fits = [g for g, ids in free.items() if len(ids) >= need and (not pinned or pinned == {g})]
    if fits:
        g = min(fits, key=lambda g: (len(free[g]), g))
        return chosen + free[g][:need]
    for g in sorted(free, key=lambda g: (g not in pinned, -len(free[g]), g)):
        chosen += free[g][: size - len(chosen)]
    return chosen
