"""GPU memory cap and reserve given where a tenant is made: `unisched run --memory/--memory-reserve` (register) and
`unisched adopt`, checked as `set-limit` checks them (one path, scheduler.limits).

End to end: the real CLI against a real daemon (serve_async in this process, on its Unix socket) with real
cgroups; one GPU of 10 GiB comes from fake telemetry (no GPU here), so a reserve has a GPU to fit on. Who may ask
for what is table-tested on the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import _cleanup_cgroups, cli, freezer_unavailable_reason, subtree_for
from inproc import InProcessServer, in_process_server
from test_engine import Rig

from unisched.enforce.cgroups import CgroupDriver, detect_driver
from unisched.policy.caps import SessionLimits
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import SchedulerError
from unisched.scheduler.limits import MemoryAsk
from unisched.telemetry import FakeTelemetry, GpuInfo
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb

GIB = 1 << 30
GPU = GpuInfo(0, "NVIDIA H200", "GPU-x", 10 * GIB)
NO_FIT = ("memory reserve 5.00 GiB of tenant 'train' does not fit on GPU 0: it has 10.00 GiB and other tenants "
          "reserve 6.00 GiB there (game 6.00 GiB)")
"""set-limit's wording (test_memory checks it there): the same check refuses here."""


@pytest.fixture
def driver(tenant_prefix: str) -> Iterator[CgroupDriver]:
    reason = freezer_unavailable_reason()
    if reason:
        pytest.skip(reason)
    yield detect_driver("auto", subtree_for(tenant_prefix))
    _cleanup_cgroups(tenant_prefix)


@pytest.fixture
def served(tmp_path: Path, driver: CgroupDriver) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state", telemetry=FakeTelemetry([GPU]), driver=driver) as s:  # type: ignore[arg-type]
        yield s


def tenants(s: InProcessServer) -> dict[str, dict]:  # type: ignore[type-arg]
    out = cli("tenants", "--socket", s.socket, "--json", check=True).stdout
    return {t["name"]: t for t in json.loads(out)}


def run(s: InProcessServer, tenant: str, *flags: str, marker: Path) -> tuple[int, str]:
    """`unisched run` of a command that leaves `marker` behind: whether the command started shows."""
    out = cli("run", "--socket", s.socket, "--tenant", tenant, "--no-session-hooks", *flags, "--", "touch", str(marker))
    return out.returncode, out.stderr


@pytest.mark.root
def test_run_makes_the_tenant_with_its_terms_and_refuses_a_reserve_that_does_not_fit(
        served: InProcessServer, driver: CgroupDriver, tmp_path: Path) -> None:
    ran = tmp_path / "game-ran"
    assert run(served, "game", "--keep", "--memory", "8GiB", "--memory-reserve", "6GiB", marker=ran) == (0, "")
    assert ran.exists()
    game = tenants(served)["game"]
    assert (game["caps"]["memory_bytes"], game["caps"]["memory_reserve"]) == (8 * GIB, 6 * GIB)
    assert [(m["gpu"], m["cap_bytes"], m["reserve_bytes"]) for m in game["gpu_memory"]] == [(0, 8 * GIB, 6 * GIB)]

    refused = tmp_path / "train-ran"
    rc, err = run(served, "train", "--memory-reserve", "5GiB", marker=refused)
    assert (rc, err.strip()) == (1, f"unisched run: {NO_FIT}")
    assert not refused.exists()  # the command never started
    assert "train" not in tenants(served)
    assert not driver.exists(f"/{driver.subtree}/train")  # nothing was made for it

    fits = tmp_path / "train-fits"
    assert run(served, "train", "--keep", "--memory-reserve", "4GiB", marker=fits) == (0, "")  # 6 + 4 = 10 GiB
    assert fits.exists() and tenants(served)["train"]["caps"]["memory_reserve"] == 4 * GIB


@pytest.mark.root
@pytest.mark.parametrize(("flags", "rc", "said"), [
    (("--memory", "1GiB", "--memory-reserve", "2GiB"), 1, "memory reserve 2147483648 B exceeds the tenant's memory cap"),
    (("--memory-reserve", "2048TiB"), 2, "size must be a number of bytes or like 8GiB, 512MiB (at most 1PiB"),
    (("--memory", "1048577GiB"), 2, "size must be a number of bytes or like 8GiB, 512MiB (at most 1PiB"),
    (("--memory-reserve", "11GiB"), 1, "memory reserve 11.00 GiB of tenant 'x' does not fit on GPU 0: it has 10.00 GiB"),
    (("--memory=-5GiB",), 2, "size must be a number of bytes"),
    (("--memory-reserve=-2",), 2, "size must be a number of bytes"),
    (("--memory", "lots"), 2, "size must be a number of bytes"),
])
def test_run_refuses_bad_terms_before_its_command(served: InProcessServer, tmp_path: Path, flags: tuple[str, ...],
                                                   rc: int, said: str) -> None:
    marker = tmp_path / "ran"
    got, err = run(served, "x", *flags, marker=marker)
    assert got == rc and said in err, err
    assert not marker.exists()
    assert tenants(served) == {}


@pytest.fixture
def outside(driver: CgroupDriver, tenant_prefix: str) -> Iterator[list[str]]:
    """Two empty cgroups beside the daemon's subtree (as containers' are), removed after the daemon stopped."""
    top = f"/{subtree_for(tenant_prefix)}-ctr"
    made = [f"{top}/game", f"{top}/train"]
    for cg in made:
        driver.create(cg)
    yield made
    for cg in [*made, top]:
        driver.remove(cg)


@pytest.mark.root
def test_adopt_takes_the_terms_and_refuses_a_reserve_that_does_not_fit(outside: list[str],
                                                                       served: InProcessServer) -> None:
    def adopt(tenant: str, cgroup: str, *flags: str) -> tuple[int, str]:
        out = cli("adopt", "--socket", served.socket, "--tenant", tenant, "--cgroup", cgroup, *flags)
        return out.returncode, out.stderr.strip()

    assert adopt("game", outside[0], "--memory", "8GiB", "--memory-reserve", "6GiB")[0] == 0
    game = tenants(served)["game"]
    assert (game["adopted"], game["caps"]["memory_bytes"], game["caps"]["memory_reserve"]) == (True, 8 * GIB, 6 * GIB)
    assert adopt("train", outside[1], "--memory-reserve", "5GiB") == (1, f"unisched adopt: {NO_FIT}")
    assert adopt("train", outside[1], "--memory", "1GiB", "--memory-reserve", "2GiB")[0] == 1
    with DaemonClient(served.socket) as client:  # what the CLI would not send: the daemon checks it too
        for bad in (pb.AdoptRequest(tenant="train", cgroup=outside[1], memory_reserve=-5),
                    pb.AdoptRequest(tenant="train", cgroup=outside[1], memory_bytes=1 << 62)):
            with pytest.raises(DaemonError, match=r"must be a number of bytes in 0\.\.") as e:
                client.adopt(bad)
            assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "train" not in tenants(served)
    assert adopt("train", outside[1], "--memory-reserve", "4GiB")[0] == 0
    assert tenants(served)["train"]["caps"]["memory_reserve"] == 4 * GIB


# --- who may ask for what (engine, fake cgroups) ---------------------------------------------------------------------
def _rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path, DaemonConfig(slice_ms=50), telemetry=FakeTelemetry([GPU]))


def _register(rig: Rig, name: str, ask: MemoryAsk, uid: int = 1000, admin: bool = False) -> SessionLimits:
    rig.pid += 1
    snap = rig.engine.register(name, None, None, (), (), rig.pid, uid, admin, memory=ask)
    return SessionLimits(memory_bytes=snap.memory_cap, memory_reserve=snap.memory_reserve)


def test_a_user_may_cap_a_tenant_it_makes_but_not_reserve_nor_change_terms_later(tmp_path: Path) -> None:
    rig = _rig(tmp_path)
    assert _register(rig, "mine", MemoryAsk(cap=2 * GIB)) == SessionLimits(memory_bytes=2 * GIB)
    with pytest.raises(SchedulerError, match="only an admin may reserve GPU memory"):
        _register(rig, "greedy", MemoryAsk(reserve=10 * GIB))
    assert not rig.engine.has_tenant("greedy")
    with pytest.raises(SchedulerError, match="only an admin may change the GPU memory terms of tenant 'mine'"):
        _register(rig, "mine", MemoryAsk(cap=-1))  # its owner lifting the cap
    assert _register(rig, "mine", MemoryAsk()) == SessionLimits(memory_bytes=2 * GIB)  # joining as it is
    assert _register(rig, "mine", MemoryAsk(cap=2 * GIB)) == SessionLimits(memory_bytes=2 * GIB)  # the same terms


def test_an_admin_changes_a_known_tenant_s_terms_at_register_as_set_limit_would(tmp_path: Path) -> None:
    rig = _rig(tmp_path)
    _register(rig, "game", MemoryAsk(reserve=6 * GIB), admin=True)
    _register(rig, "train", MemoryAsk(cap=8 * GIB), uid=0, admin=True)
    with pytest.raises(SchedulerError, match="does not fit on GPU 0"):
        _register(rig, "train", MemoryAsk(reserve=5 * GIB), admin=True)
    assert rig.engine.snapshot("train").memory_reserve is None  # refused: left as it was
    assert _register(rig, "train", MemoryAsk(reserve=4 * GIB), admin=True) == SessionLimits(memory_bytes=8 * GIB,
                                                                                           memory_reserve=4 * GIB)
    assert _register(rig, "train", MemoryAsk(cap=-1, reserve=-1), admin=True) == SessionLimits()
