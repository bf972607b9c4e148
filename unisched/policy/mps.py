"""How a compute tenant's processes join the daemon's MPS server: their client priority and SM cap, by class.

Why: in preemptive mode an online request that meets a trainer's queued step shares the GPU with the rest of that
step, whoever gates whom at step boundaries (a ResNet-50 b32 step is ~25 ms of queued work, a b1 request ~6 ms).
Leases keep the weights; only the GPU's own block dispatcher can put the request's kernels first, and it does so
only for MPS clients: an offline client of priority below normal, and capped to part of the SMs, leaves SMs free
for the request. Both settings are fixed when the client's CUDA context is
created, so they come from the tenant's class, not from the moment's demand.
"""

from __future__ import annotations

from dataclasses import dataclass

from unisched.policy.model import Engine, Mode, PolicyError, Priority

__all__ = ["MPS_BELOW_NORMAL", "MPS_NORMAL", "MpsClientSettings", "mps_client_settings", "validate_sm_percent"]

MPS_NORMAL = 0
MPS_BELOW_NORMAL = 1
"""CUDA_MPS_CLIENT_PRIORITY values (CUDA 11.8+): the dispatcher starts a normal client's blocks first."""


@dataclass(frozen=True)
class MpsClientSettings:
    priority: int
    """CUDA_MPS_CLIENT_PRIORITY."""
    sm_percent: int | None
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; None = all SMs."""

    def env(self, pipe_dir: str) -> dict[str, str]:
        """The environment a client process starts with (CUDA reads it when it creates its context)."""
        out = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_CLIENT_PRIORITY": str(self.priority)}
        if self.sm_percent is not None:
            out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.sm_percent)
        return out


def validate_sm_percent(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise PolicyError(f"MPS SM percent must be an integer in 1..100; got {value!r}")
    return value


def mps_client_settings(
    engines: frozenset[Engine], priority: Priority, mode: Mode, offline_sm_percent: int
) -> MpsClientSettings | None:
    """None for tenants without compute (MPS carries CUDA only). In preemptive mode offline tenants run below
    normal on `offline_sm_percent` of the SMs (100 = uncapped); everywhere else all clients are equal and uncapped
    (their shares come from leases and slices, which MPS does not change)."""
    validate_sm_percent(offline_sm_percent)
    if Engine.COMPUTE not in engines:
        return None
    if mode is not Mode.PREEMPTIVE or priority is Priority.ONLINE:
        return MpsClientSettings(MPS_NORMAL, None)
    return MpsClientSettings(MPS_BELOW_NORMAL, None if offline_sm_percent == 100 else offline_sm_percent)

