"""A discrete-event simulator: simulated GPUs and tenants around the real scheduling policy.

It runs the engine's loop (decide, freeze/thaw, run a slice, measure, charge, update demand) in simulated time,
so that accuracy, work conservation and decision cost can be checked on a CPU, at any scale.
"""

from unisched.sim.gpu import SimResource, SimStream
from unisched.sim.results import ResourceResult, SimResult, TenantResult, WakeEvent, weight_shares
from unisched.sim.simulator import SimConfig, Simulation
from unisched.sim.workload import (
    Activity,
    SimTenant,
    StreamSpec,
    bursty,
    cuda,
    decode,
    idle,
    mixed,
    render,
)

__all__ = [
    "Activity",
    "ResourceResult",
    "SimConfig",
    "SimResource",
    "SimResult",
    "SimStream",
    "SimTenant",
    "Simulation",
    "StreamSpec",
    "TenantResult",
    "WakeEvent",
    "bursty",
    "cuda",
    "decode",
    "idle",
    "mixed",
    "render",
    "weight_shares",
]
