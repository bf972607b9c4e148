"""Policy values: weights and names are validated; contention maps say which engines contend."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unisched.policy import (
    CGROUP_FILE_PREFIXES,
    DEFAULT_WEIGHT,
    SEPARATE_GRAPHICS,
    SHARED_SM,
    WEIGHT_MAX,
    WEIGHT_MIN,
    ContentionMap,
    Engine,
    PolicyError,
    Resource,
    TenantSpec,
    validate_tenant_name,
    validate_weight,
)


@given(st.integers(WEIGHT_MIN, WEIGHT_MAX))
def test_weights_in_range_are_kept(w: int) -> None:
    assert validate_weight(w) == w
    assert TenantSpec("a", w).weight == w


@given(st.one_of(st.integers(max_value=WEIGHT_MIN - 1), st.integers(min_value=WEIGHT_MAX + 1)))
def test_weights_out_of_range_are_refused(w: int) -> None:
    with pytest.raises(PolicyError, match=r"1\.\.10000"):
        validate_weight(w)


@pytest.mark.parametrize("bad", [0, 10**9, True, False, 100.0, "100", None])
def test_bad_weights(bad: object) -> None:
    with pytest.raises(PolicyError):
        validate_weight(bad)  # type: ignore[arg-type]


def test_default_weight() -> None:
    assert TenantSpec("a").weight == DEFAULT_WEIGHT == 100


@pytest.mark.parametrize("good", ["a", "A9", "web-1", "team.ml_train", "x" * 63, "0"])
def test_good_names(good: str) -> None:
    assert validate_tenant_name(good) == good


@pytest.mark.parametrize(
    "bad", ["", "-a", ".a", "_a", "a b", "a/b", "x" * 64, "é", "a\nb", "a\n", None, 7]
)
def test_bad_names(bad: object) -> None:
    with pytest.raises(PolicyError, match="tenant name"):
        validate_tenant_name(bad)  # type: ignore[arg-type]
    with pytest.raises(PolicyError):
        TenantSpec(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("squat", [
    "hugetlb.2MB.max", "cpu.max", "cpuset.cpus", "cpuset.cpus.partition", "cgroup.procs", "cgroup.new", "memory.high",
    "io.max", "pids.max", "rdma.max", "misc.max", "dmem.max", "irq.pressure", "debug.stat", "cpuacct.usage", "blkio.weight",
    "freezer.state", "devices.allow", "net_cls.classid", "net_prio.ifpriomap", "perf_event.x", "memory.",
    "cpu.no-such-file-yet",
])
def test_names_of_cgroup_interface_files_are_refused(squat: str) -> None:
    """A tenant's cgroup named like a controller's file that is not there yet would make root's `+controller` in
    cgroup.subtree_control fail with EEXIST (host-wide): refused by the name's part before its first '.'."""
    with pytest.raises(PolicyError, match=r"tenant name .* cgroup interface files"):
        validate_tenant_name(squat)
    with pytest.raises(PolicyError):
        TenantSpec(squat)


@pytest.mark.parametrize("fine", [
    "cpu", "memory", "cgroup", "io", "cpu-max", "cpu_max", "cpux.max", "CPU.max", "Memory.high", "my.cpu.max",
    "team.memory", "iox.max", "hugetlb2.x", "k8s-g0-0123456789ab",
])
def test_names_near_the_cgroup_prefixes_are_kept(fine: str) -> None:
    """Only the part before the first '.', compared exactly (cgroupfs names are case-sensitive): a name without a dot
    is a directory no interface file can be named like."""
    assert validate_tenant_name(fine) == fine


def test_the_prefixes_cover_every_controller_of_this_host() -> None:
    """Whatever this kernel offers (cgroup v2's list of controllers) is among the refused prefixes."""
    offered: set[str] = set()
    for v2 in ("/sys/fs/cgroup/cgroup.controllers", "/sys/fs/cgroup/unified/cgroup.controllers"):
        try:
            with open(v2) as f:
                offered |= set(f.read().split())
        except OSError:
            pass
    try:
        with open("/proc/cgroups") as f:
            offered |= {line.split()[0] for line in f if line.strip() and not line.startswith("#")}
    except OSError:
        pass
    assert offered <= CGROUP_FILE_PREFIXES


@pytest.mark.parametrize(
    ("cmap", "engine", "domain"),
    [
        (SHARED_SM, Engine.COMPUTE, "sm"),
        (SHARED_SM, Engine.GRAPHICS, "sm"),
        (SEPARATE_GRAPHICS, Engine.COMPUTE, "sm"),
        (SEPARATE_GRAPHICS, Engine.GRAPHICS, "gfx"),
        (SEPARATE_GRAPHICS, Engine.DECODE, "nvdec"),
        (SHARED_SM, Engine.ENCODE, "nvenc"),
    ],
)
def test_contention_domains(cmap: ContentionMap, engine: Engine, domain: str) -> None:
    assert cmap.domain(engine) == domain


@pytest.mark.parametrize(
    ("compute_kept", "graphics_kept", "expected"),
    [
        (0.95, 0.97, SEPARATE_GRAPHICS),  # both keep most of their solo rate: they overlap, slice apart
        (0.75, 0.75, SEPARATE_GRAPHICS),
        (0.04, 0.90, SHARED_SM),  # CUDA kept 4% next to rendering, which lost 10%: they contend, one domain
        (0.02, 0.92, SHARED_SM),
        (float("nan"), 1.0, SHARED_SM),
    ],
)
def test_contention_from_calibration(compute_kept: float, graphics_kept: float, expected: ContentionMap) -> None:
    assert ContentionMap.from_kept(compute_kept, graphics_kept) is expected


@pytest.mark.parametrize(("compute_kept", "graphics_kept"),
                         [(0.74, 0.99), (0.22, 0.92), (0.16, 0.91), (0.14, 1.0), (0.125, 0.875), (0.04, 1.0)])
def test_a_partial_overlap_gets_mixed_slices(compute_kept: float, graphics_kept: float) -> None:
    cmap = ContentionMap.from_kept(compute_kept, graphics_kept)
    assert cmap.name == "partial-overlap" and cmap.kept == (compute_kept, graphics_kept)
    assert cmap.domain(Engine.COMPUTE) != cmap.domain(Engine.GRAPHICS)  # the mix, not the slicer, pairs them


def test_contention_by_name() -> None:
    assert ContentionMap.named("shared-sm") is SHARED_SM
    assert ContentionMap.named("separate-graphics") is SEPARATE_GRAPHICS
    with pytest.raises(PolicyError, match="contention must be one of"):
        ContentionMap.named("magic")


def test_resources_of_a_tenant() -> None:
    got = SEPARATE_GRAPHICS.resources([0, 1], [Engine.COMPUTE, Engine.GRAPHICS])
    assert got == {Resource(0, "sm"), Resource(0, "gfx"), Resource(1, "sm"), Resource(1, "gfx")}
    assert SHARED_SM.resources([0], [Engine.COMPUTE, Engine.GRAPHICS]) == {Resource(0, "sm")}
    assert str(Resource(3, "nvdec")) == "gpu3/nvdec"
