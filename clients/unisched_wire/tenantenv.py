"""The environment a tenant process starts with, given the settings the daemon sent for its tenant (how the GPU
driver waits, MPS client settings).

Both sides apply it: `unisched run` to the command it starts, and the client library to the process it registers
(the daemon's reply carries the settings), so it sits with the wire, not in either.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["process_env"]


def process_env(inherited: Mapping[str, str], settings: Mapping[str, str]) -> dict[str, str]:
    """A tenant process's environment: the daemon's settings over the inherited ones; where they carry MPS
    settings, those replace every inherited CUDA_MPS_* value (a cap from the caller's shell must not stay on an
    online tenant), but the log directory, which is not a setting."""
    if not any(k.startswith("CUDA_MPS_") for k in settings):
        return {**inherited, **settings}
    kept = {k: v for k, v in inherited.items() if not k.startswith("CUDA_MPS_") or k == "CUDA_MPS_LOG_DIRECTORY"}
    return {**kept, **settings}
