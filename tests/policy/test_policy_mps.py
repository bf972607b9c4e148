"""MPS client settings by class: which tenants' kernels the GPU's dispatcher puts first, and on how many SMs."""

from __future__ import annotations

import pytest

from unisched.policy import Engine, Mode, PolicyError, Priority
from unisched.policy.mps import MPS_BELOW_NORMAL, MPS_NORMAL, MpsClientSettings, mps_client_settings
from unisched_wire.tenantenv import process_env

COMPUTE = frozenset({Engine.COMPUTE})


@pytest.mark.parametrize(("engines", "priority", "mode", "percent", "expected"), [
    (COMPUTE, Priority.OFFLINE, Mode.PREEMPTIVE, 50, MpsClientSettings(MPS_BELOW_NORMAL, 50)),
    (COMPUTE | {Engine.GRAPHICS}, Priority.OFFLINE, Mode.PREEMPTIVE, 70, MpsClientSettings(MPS_BELOW_NORMAL, 70)),
    (COMPUTE, Priority.OFFLINE, Mode.PREEMPTIVE, 100, MpsClientSettings(MPS_BELOW_NORMAL, None)),
    (COMPUTE, Priority.ONLINE, Mode.PREEMPTIVE, 50, MpsClientSettings(MPS_NORMAL, None)),
    (COMPUTE, Priority.OFFLINE, Mode.SHARED, 50, MpsClientSettings(MPS_NORMAL, None)),
    (COMPUTE, Priority.OFFLINE, Mode.TIDAL, 50, MpsClientSettings(MPS_NORMAL, None)),
    (frozenset({Engine.GRAPHICS, Engine.ENCODE}), Priority.OFFLINE, Mode.PREEMPTIVE, 50, None),
])
def test_settings_by_class(engines: frozenset[Engine], priority: Priority, mode: Mode, percent: int,
                           expected: MpsClientSettings | None) -> None:
    assert mps_client_settings(engines, priority, mode, percent) == expected


def test_env_names_the_pipe_and_leaves_the_cap_out_when_uncapped() -> None:
    assert MpsClientSettings(MPS_BELOW_NORMAL, 50).env("/run/u/mps") == {
        "CUDA_MPS_PIPE_DIRECTORY": "/run/u/mps", "CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    assert MpsClientSettings(MPS_NORMAL, None).env("/p") == {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_CLIENT_PRIORITY": "0"}


@pytest.mark.parametrize("bad", [0, 101, -5, True, 50.0])
def test_bad_percent_is_refused(bad: object) -> None:
    with pytest.raises(PolicyError, match=r"1\.\.100"):
        mps_client_settings(COMPUTE, Priority.OFFLINE, Mode.PREEMPTIVE, bad)  # type: ignore[arg-type]


def test_process_env_replaces_inherited_mps_settings_but_the_log_directory() -> None:
    inherited = {"PATH": "/bin", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "90", "CUDA_MPS_CLIENT_PRIORITY": "1",
                 "CUDA_MPS_LOG_DIRECTORY": "/var/log/mps"}
    online = MpsClientSettings(MPS_NORMAL, None).env("/p")
    assert process_env(inherited, online) == {"PATH": "/bin", "CUDA_MPS_LOG_DIRECTORY": "/var/log/mps", **online}
    assert process_env(inherited, {}) == inherited
