"""Kernel-engine logic with fake cgroups, fake telemetry and an injected clock (no sleeps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.policy import Engine, Mode, Priority, TidalSchedule, TidalWindow
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig, DeclaredTenant
from unisched.scheduler.core import Scheduler, SchedulerError
from unisched.scheduler.state import StateStore
from unisched.scheduler.upkeep import MEMORY_CHECK_S
from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample, NoGpuTelemetry

SLICE = 0.05


class Rig:
    """An engine over fake cgroups whose 'processes' burn one core (or `rate[name]`) whenever they are thawed
    and busy."""

    def __init__(self, tmp: Path, config: DaemonConfig | None = None, telemetry: object = None) -> None:
        self.driver = FakeCgroupDriver()
        self.clock = FakeClock()
        self.store = StateStore(tmp / "state")
        self.config = config or DaemonConfig(slice_ms=SLICE * 1000)
        self.engine = Scheduler(self.config, self.driver, telemetry or NoGpuTelemetry(), self.store, self.clock)  # type: ignore[arg-type]
        self.engine.start()
        self.busy: set[str] = set()
        self.rate: dict[str, float] = {}
        self.loop = False
        self.pid = 1000

    def add(self, name: str, weight: int, busy: bool = True, **kw: object) -> None:
        self.pid += 1
        self.engine.register(name, weight, kw.get("priority"), kw.get("engines", ()), (), self.pid, 0, True)  # type: ignore[arg-type]
        if busy:
            self.busy.add(name)

    def step(self, n: int = 1) -> None:
        """`n` slices, or with `loop` set `n` calls of the engine loop's `advance` (a rationed slice's steps too)."""
        for _ in range(n):
            delay = self.engine.advance() if self.loop else self.engine.tick()
            for name in self.busy:
                g = self.driver.groups[f"/unisched/{name}"]
                if not g.frozen:
                    g.cpu_s += delay * self.rate.get(name, 1.0)
            self.clock.advance(delay)

    def cpu(self, name: str) -> float:
        return self.driver.groups[f"/unisched/{name}"].cpu_s

    def frozen(self, name: str) -> bool:
        return self.driver.groups[f"/unisched/{name}"].frozen


def gpu_rig(tmp_path: Path, util: float, **config: object) -> tuple[Rig, FakeTelemetry]:
    """Tenants a (300) and b (100) on GPU 0, whose telemetry reads `util` busy until told otherwise."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    tel.next_samples = [GpuSample(0, util, 0.0, 0.0, 0)]
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000, **config), telemetry=tel)  # type: ignore[arg-type]
    rig.add("a", 300)
    rig.add("b", 100)
    return rig, tel


def test_weights_3_to_1_split_cpu_time_3_to_1(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.add("a", 300)
    rig.add("b", 100)
    rig.step(2000)
    ratio = rig.cpu("a") / rig.cpu("b")
    assert 2.9 < ratio < 3.1
    shares = {s.name: s for s in rig.engine.snapshots()}
    assert shares["a"].target_share == pytest.approx(0.75)
    assert shares["a"].measured_share == pytest.approx(0.75, abs=0.02)


def test_a_tenant_alone_is_never_frozen(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.add("a", 100)
    rig.step(200)
    assert not any(frozen for _, frozen in rig.driver.freeze_log)
    assert rig.cpu("a") == pytest.approx(200 * SLICE, rel=0.01)


def test_idle_share_is_lent_then_returns_within_two_slices(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.add("a", 100)
    rig.add("b", 100, busy=False)
    rig.step(100)
    assert not rig.frozen("a") and rig.cpu("a") == pytest.approx(100 * SLICE, rel=0.02)
    rig.busy.add("b")
    rig.step(2)
    assert rig.frozen("a") or rig.frozen("b"), "the waking tenant was not given a share within 2 slices"
    before = rig.cpu("b")
    rig.step(400)
    assert (rig.cpu("b") - before) / (400 * SLICE) == pytest.approx(0.5, abs=0.03)


def test_an_idle_tenant_cannot_bank_credit(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.add("a", 100)
    rig.add("b", 100, busy=False)
    rig.step(1000)
    rig.busy.add("b")
    a0, b0 = rig.cpu("a"), rig.cpu("b")
    rig.step(20)
    # with 2 slices of lag allowed, b may run a few slices ahead, never the 50 s a ran alone
    assert rig.cpu("b") - b0 <= (20 / 2 + 3) * SLICE
    assert rig.cpu("a") - a0 >= (20 / 2 - 3) * SLICE


def test_removed_cgroup_does_not_stop_the_engine(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.add("a", 100)
    rig.add("b", 100)
    rig.step(10)
    del rig.driver.groups["/unisched/b"]
    rig.busy.discard("b")
    rig.step(10)
    snap = {s.name: s for s in rig.engine.snapshots()}
    assert snap["b"].state == "idle" and snap["b"].pids == ()
    assert not rig.frozen("a")


@pytest.mark.parametrize("again", ["owner", "admin", "ended"])
def test_a_name_whose_cgroup_still_holds_a_removed_tenants_processes_is_not_given_to_another_user(
        tmp_path: Path, again: str) -> None:
    """Removing a tenant while its processes run leaves them in its cgroup: another user's tenant of that name
    would take them in, and they could join it as members. Refused; its owner or an admin may make it again,
    and anyone once those processes ended."""
    rig = Rig(tmp_path)
    attacker, victim, kept = 1001, 1002, 4242
    rig.engine.register("train", None, None, (), (), kept, attacker, False, keep=True)
    rig.engine.remove_as("train", attacker, False)
    assert rig.driver.pids("/unisched/train") == [kept]
    with pytest.raises(SchedulerError, match="still holds processes"):
        rig.engine.register("train", 100, None, (), (), 5555, victim, False, keep=False)
    assert not rig.engine.has_tenant("train")
    if again == "owner":
        rig.engine.register("train", None, None, (), (), kept, attacker, False, keep=True)
    elif again == "admin":
        rig.engine.register("train", 100, None, (), (), 5556, 0, True)
    else:
        rig.driver.groups["/unisched/train"].pids.clear()
        rig.engine.register("train", 100, None, (), (), 5555, victim, False, keep=False)
    assert rig.engine.has_tenant("train")
    rig.engine.remove("train")  # made again: the owner's record went with it, and is the new owner's now
    if again == "owner":
        with pytest.raises(SchedulerError, match="still holds processes"):
            rig.engine.register("train", 100, None, (), (), 5555, victim, False, keep=False)


def test_the_removed_tenants_left_behind_are_bounded_oldest_first(tmp_path: Path) -> None:
    from unisched.scheduler.roster import MAX_LEFT_BEHIND, leave_behind

    rig = Rig(tmp_path)
    c = rig.engine._c
    for i in range(MAX_LEFT_BEHIND + 2):
        leave_behind(c, f"/unisched/t{i}", i)
    assert len(c.left_behind) == MAX_LEFT_BEHIND and "/unisched/t0" not in c.left_behind
    assert c.left_behind["/unisched/t2"] == 2 and list(c.left_behind)[-1] == f"/unisched/t{MAX_LEFT_BEHIND + 1}"


def test_restart_thaws_what_a_crash_left_frozen_and_restores_weights(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.add("a", 300)
    rig.add("b", 100)
    rig.step(5)
    assert rig.frozen("a") or rig.frozen("b")
    assert rig.engine._c.writer.wait(10.0), "the tick's save was never written"  # on the writer thread
    # a crash: no shutdown(); a new engine over the same cgroups and state
    engine2 = Scheduler(rig.config, rig.driver, NoGpuTelemetry(), rig.store, rig.clock)
    engine2.start()
    assert not rig.frozen("a") and not rig.frozen("b")
    assert {s.name: s.base_weight for s in engine2.snapshots()} == {"a": 300, "b": 100}


def test_declared_tenants_come_from_config(tmp_path: Path) -> None:
    cfg = DaemonConfig(tenants=(DeclaredTenant("train", 700, Priority.OFFLINE, frozenset({Engine.COMPUTE})),))
    rig = Rig(tmp_path, cfg)
    assert [(s.name, s.weight) for s in rig.engine.snapshots()] == [("train", 700)]


def test_tidal_weights_follow_the_clock(tmp_path: Path) -> None:
    sched = TidalSchedule((TidalWindow("a", 8 * 60, 20 * 60, 900),))
    rig = Rig(tmp_path, DaemonConfig(mode=Mode.TIDAL, tidal=sched, slice_ms=SLICE * 1000))
    rig.add("a", 100)
    rig.add("b", 100)
    rig.clock.day = 12 * 3600
    rig.step(400)
    assert rig.engine.policy.weight("a") == 900
    day_ratio = rig.cpu("a") / rig.cpu("b")
    rig.clock.day = 22 * 3600
    a0, b0 = rig.cpu("a"), rig.cpu("b")
    rig.step(400)
    assert rig.engine.policy.weight("a") == 100
    assert 8 < day_ratio < 10
    assert (rig.cpu("a") - a0) / (rig.cpu("b") - b0) == pytest.approx(1.0, abs=0.15)


def test_a_tidal_window_gives_a_tenant_a_user_made_no_more_than_max_user_weight(tmp_path: Path) -> None:
    """A window names a tenant: whoever makes a tenant of that name while the window is open must not get more
    than a user may ask for."""
    sched = TidalSchedule((TidalWindow("nightly", 0, 24 * 60 - 1, 10000), TidalWindow("ops", 0, 24 * 60 - 1, 5000)))
    rig = Rig(tmp_path, DaemonConfig(mode=Mode.TIDAL, tidal=sched, slice_ms=SLICE * 1000, max_user_weight=100))
    rig.clock.day = 12 * 3600
    rig.engine.register("nightly", 1, None, (), (), 5555, 1001, False, keep=True)
    rig.add("ops", 100)  # root's
    rig.step(2)
    assert rig.engine.policy.weight("nightly") == 100 and rig.engine.policy.weight("ops") == 5000


def test_preemptive_mode_runs_online_first(tmp_path: Path) -> None:
    rig = Rig(tmp_path, DaemonConfig(mode=Mode.PREEMPTIVE, slice_ms=SLICE * 1000))
    rig.add("off", 900, priority=Priority.OFFLINE)
    rig.add("on", 100, priority=Priority.ONLINE)
    rig.step(100)
    assert rig.cpu("on") > 0.95 * 100 * SLICE


def test_gpu_busy_time_is_charged_split_by_cpu_activity(tmp_path: Path) -> None:
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("a", 100)
    rig.add("b", 100)
    tel.next_samples = [GpuSample(0, 0.5, 0.0, 0.0, 0)]
    rig.step(200)
    total = sum(s.gpu_seconds for s in rig.engine.snapshots())
    assert total == pytest.approx(0.5 * 199 * SLICE, rel=0.02)  # GPU seconds, not CPU seconds


def test_online_priority_is_an_admin_s_to_give(tmp_path: Path) -> None:
    """Online runs ahead of every offline tenant (in preemptive mode, strictly): a user asking it for its own
    tenant, new or its own already, is refused, and nothing of the tenant changes."""
    rig = Rig(tmp_path)
    with pytest.raises(SchedulerError, match="only admins may give a tenant online priority"):
        rig.engine.register("rush", None, Priority.ONLINE, (), (), 11, 1000, False)
    assert not rig.engine.has_tenant("rush")
    rig.engine.register("mine", 50, Priority.OFFLINE, (), (), 12, 1000, False)
    with pytest.raises(SchedulerError, match="only admins may give a tenant online priority"):
        rig.engine.register("mine", 90, Priority.ONLINE, (), (), 12, 1000, False)
    snap = rig.engine.snapshot("mine")
    assert (snap.weight, snap.priority) == (50, Priority.OFFLINE)
    assert rig.engine.register("mine", None, Priority.ONLINE, (), (), 13, 0, True).priority == Priority.ONLINE


def test_register_checks_ownership_and_weight_caps(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.engine.register("mine", None, None, (), (), 11, 1000, False)
    with pytest.raises(SchedulerError, match="belongs to uid 1000"):
        rig.engine.register("mine", None, None, (), (), 12, 2000, False)
    with pytest.raises(SchedulerError, match="max_user_weight"):
        rig.engine.register("big", 5000, None, (), (), 13, 1000, False)
    with pytest.raises(SchedulerError, match="weight must be in"):
        rig.engine.register("bad", 0, None, (), (), 14, 0, True)
    with pytest.raises(SchedulerError, match="unknown tenant"):
        rig.engine.set_weight("nobody", 5)
    with pytest.raises(SchedulerError, match="no GPU"):
        rig.engine.register("gpu9", None, None, (), (9,), 15, 0, True)


def test_a_process_inside_an_adopted_tenant_joins_it_without_being_moved(tmp_path: Path) -> None:
    """A client in a container of an adopted pod registers as the pod's tenant: it is not moved into the
    pod-level cgroup (cgroup v2 forbids processes there) and, though not the owner, may join but not re-weight it."""
    rig = Rig(tmp_path)
    rig.driver.create("/kubepods.slice/pod-u1")
    rig.engine.adopt("pod-u1", 300, None, "/kubepods.slice/pod-u1", (), ())
    rig.driver.pid_cgroup[41] = "/kubepods.slice/pod-u1/ctr-a"  # the container's own cgroup, below the tenant's
    snap = rig.engine.register("pod-u1", 300, Priority.ONLINE, ("graphics",), (0,), 41, 1000, False)
    assert snap.weight == 300
    # it joins as the owner set the tenant up: engines, GPUs and priority are not the member's to change
    assert snap.engines == frozenset({Engine.COMPUTE}) and snap.priority is Priority.OFFLINE
    assert rig.driver.pid_cgroup[41] == "/kubepods.slice/pod-u1/ctr-a"  # not moved
    with pytest.raises(SchedulerError, match="may change the weight of tenant 'pod-u1'"):
        rig.engine.register("pod-u1", 5000, None, (), (), 41, 1000, False)
    # a process outside the tenant is still refused, and a member's registration moves nothing
    rig.driver.pid_cgroup[42] = "/kubepods.slice/pod-u2"
    with pytest.raises(SchedulerError, match="belongs to uid"):
        rig.engine.register("pod-u1", None, None, (), (), 42, 1000, False)
    # a look-alike prefix is not membership
    rig.driver.pid_cgroup[43] = "/kubepods.slice/pod-u10/ctr"
    with pytest.raises(SchedulerError, match="belongs to uid"):
        rig.engine.register("pod-u1", None, None, (), (), 43, 1000, False)


def test_decode_sessions_follow_the_weight_share_and_refusals_are_counted(tmp_path: Path) -> None:
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])  # 7 NVDEC engines
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("a", 100)
    rig.add("b", 300)
    rig.step(3)
    # a is owed 25% of the GPU: floor(0.25 * 7) = 1 decode session at a time
    assert rig.engine.admit_session("a", "nvdec", 0xB8B0)
    assert not rig.engine.admit_session("a", "nvdec", 0xB8B0)
    snap = rig.engine.snapshot("a")
    assert snap.sessions == {"nvdec": 1} and snap.refusals == {"nvdec": 1} and snap.caps["decode"] == 1
    assert Engine.DECODE in snap.engines  # an open decoder is demand on NVDEC
    rig.engine.session_freed("a", "nvdec")
    assert rig.engine.admit_session("a", "nvdec", 0xB8B0)
    # the H200 has no NVENC: encoding is refused whatever the share
    assert not rig.engine.admit_session("b", "nvenc", 0xC9B7)
    # compute contexts are counted, never capped
    assert all(rig.engine.admit_session("a", "compute", 0xCBC0) for _ in range(5))


def test_a_session_decision_reads_the_weights_taken_once_a_slice(tmp_path: Path) -> None:
    """A hooked app retrying a refused session asks again as fast as it is answered, on the daemon's loop: the
    weights of the tenants with work on its GPUs are taken once a slice, not walked at every decision (a walk over
    1000 tenants took ~0.3 ms a decision)."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])  # 7 NVDEC engines
    rig = Rig(tmp_path, telemetry=tel)
    for i in range(20):
        rig.add(f"t{i}", 100)
    rig.step(3)
    assert rig.engine.admit_session("t0", "nvdec", 0xB8B0)  # its one (a share of 1/20 still gets one)
    policy = rig.engine._c.policy
    asked = [0]
    weight = policy.weight

    def counted(name: str) -> int:
        asked[0] += 1
        return weight(name)

    policy.weight = counted  # type: ignore[method-assign]
    assert not any(rig.engine.admit_session("t0", "nvdec", 0xB8B0) for _ in range(200))
    assert asked[0] <= 200 + 20  # its own weight each time, the others' once (a walk each time: 4000)
    assert rig.engine.snapshot("t0").refusals == {"nvdec": 200}


def test_the_share_behind_a_default_cap_follows_the_tenants_at_the_next_slice(tmp_path: Path) -> None:
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])  # 7 NVDEC engines
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("a", 100)
    rig.add("b", 300)
    rig.add("c", 100, busy=False)
    rig.step(3)
    assert rig.engine.snapshot("b").caps["decode"] == 5  # owed 300 / 400 of the GPU: floor(0.75 * 7)
    rig.busy.add("c")  # 400 more weight with work there, seen from the next slice on
    rig.engine.set_weight("c", 400)
    assert rig.engine.snapshot("b").caps["decode"] == 5
    rig.step(3)
    assert rig.engine.snapshot("b").caps["decode"] == 2  # owed 300 / 800: floor(0.375 * 7)
    rig.engine.remove("c")
    rig.step(1)
    assert rig.engine.snapshot("b").caps["decode"] == 5


def test_the_tenant_of_a_pid_is_the_one_whose_cgroup_holds_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.add("a", 100)
    rig.driver.create("/kubepods.slice/pod-u1")
    rig.engine.adopt("pod-u1", 300, None, "/kubepods.slice/pod-u1", (), ())
    where = rig.driver.pid_cgroup
    where.update({41: "/unisched/a", 42: "/unisched/a/worker/", 43: "/kubepods.slice/pod-u1/ctr",
                  44: "/kubepods.slice/pod-u10/ctr", 45: "/unisched", 46: "/", 47: "kubepods.slice/pod-u1"})
    assert [rig.engine.tenant_of_pid(p) for p in range(41, 49)] == ["a", "a", "pod-u1", None, None, None, None, None]

    class Unwalked(dict[str, object]):  # every Status call asks: a lookup, not a walk over every tenant
        def values(self) -> Any:
            raise AssertionError("walked every tenant")

        items = values

    walked, rig.engine._c.tenants = rig.engine._c.tenants, Unwalked(rig.engine._c.tenants)  # type: ignore[assignment]
    assert rig.engine.tenant_of_pid(42) == "a"
    rig.engine._c.tenants = walked
    rig.engine.remove("pod-u1")
    assert rig.engine.tenant_of_pid(43) is None
    rig.engine.adopt("pod-u1", 300, None, "/kubepods.slice/pod-u1", (), ())
    assert rig.engine.tenant_of_pid(43) == "pod-u1"


def test_configured_render_cap_and_memory_cap(tmp_path: Path) -> None:
    from unisched.enforce.devices import FakeDeviceAdmission

    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    devices = FakeDeviceAdmission()
    rig = Rig(tmp_path, telemetry=tel)
    rig.engine.devices = devices
    rig.add("g", 100)
    rig.engine.set_limits("g", 2, None, None, 1 << 20)
    assert rig.engine.admit_session("g", "graphics", 0xCB97)
    assert rig.engine.admit_session("g", "graphics", 0xCB97)
    assert not rig.engine.admit_session("g", "graphics", 0xCB97)
    pid = rig.driver.pids("/unisched/g")[0]
    tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0, process_memory={pid: 2 << 20})]
    rig.step(1)
    snap = rig.engine.snapshot("g")
    assert snap.over_memory and snap.memory_bytes == 2 << 20 and snap.refusals.get("memory") == 1
    rig.engine.session_freed("g", "graphics", 2)
    assert not rig.engine.admit_session("g", "graphics", 0xCB97), "over its memory cap it gets no new session"
    # device opens are refused too while over the cap (fake cgroups have no v2 directory, so check the intent)
    tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0, process_memory={pid: 1024})]
    rig.step(round(MEMORY_CHECK_S / SLICE) + 1)  # memory is checked at most once a second
    assert not rig.engine.snapshot("g").over_memory
    assert rig.engine.admit_session("g", "graphics", 0xCB97)
    # limits survive a restart
    engine2 = Scheduler(rig.config, rig.driver, NoGpuTelemetry(), rig.store, rig.clock)
    engine2.start()
    assert engine2.snapshot("g").memory_cap == 1 << 20


def test_session_refusals_warn_once_a_second_and_say_how_many_they_held_back(tmp_path: Path) -> None:
    """An app retrying past its cap asks again at once: the host's log gets one warning a second per tenant and
    kind, not one per call; the refusals are all counted."""
    import structlog

    rig = Rig(tmp_path)
    rig.add("g", 100)
    rig.add("h", 100)
    rig.engine.set_limits("g", 0, None, None, None)
    rig.engine.set_limits("h", 0, None, None, None)
    with structlog.testing.capture_logs() as logs:
        assert not any(rig.engine.admit_session("g", "graphics", 0xCB97) for _ in range(50))
        assert not rig.engine.admit_session("h", "graphics", 0xCB97)  # another tenant's first: its own warning
        rig.clock.advance(0.99)
        assert not rig.engine.admit_session("g", "graphics", 0xCB97)
        rig.clock.advance(0.01)
        assert not rig.engine.admit_session("g", "graphics", 0xCB97)
    warned = [(e["tenant"], e["held_back"]) for e in logs if e["event"] == "session refused" and e["log_level"] == "warning"]
    assert warned == [("g", 0), ("h", 0), ("g", 50)]
    assert len([e for e in logs if e["event"] == "session refused"]) == 53
    assert rig.engine.snapshot("g").refusals == {"graphics": 52}


def test_engines_coming_and_going_with_sessions_log_once_a_second_and_their_demand_follows_each_time(
        tmp_path: Path) -> None:
    """A hooked app opening and freeing a session of a kind outside its declared engines in a loop changes its
    engines twice a loop: the demand follows every change, the info line at most once a second per tenant (it was
    two lines a loop, 4,000 for 2,000 loops in 0.7 s), held_back saying how many were held back."""
    import structlog

    rig = Rig(tmp_path)
    rig.add("a", 100)
    rig.add("b", 100)
    rig.step(2)
    policy = rig.engine._c.policy
    set_demand, demanded = policy.set_demand, []

    def counted(name: str, resources: Any) -> None:
        demanded.append(name)
        set_demand(name, resources)

    policy.set_demand = counted  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        for _ in range(50):
            assert rig.engine.admit_session("a", "graphics", 0xCB97)
            assert Engine.GRAPHICS in rig.engine.snapshot("a").engines
            rig.engine.session_freed("a", "graphics")
            assert Engine.GRAPHICS not in rig.engine.snapshot("a").engines
        assert rig.engine.admit_session("b", "graphics", 0xCB97)  # another tenant's first: its own line
        rig.clock.advance(0.99)
        assert rig.engine.admit_session("a", "graphics", 0xCB97)
        rig.clock.advance(0.01)
        rig.engine.session_freed("a", "graphics")
    info = [e for e in logs if e["event"] == "engines" and e["log_level"] == "info"]
    lines = [(e["tenant"], e["engines"], e.get("held_back")) for e in info]
    assert lines == [("a", ["compute", "graphics"], 0), ("b", ["compute", "graphics"], 0), ("a", ["compute"], 100)]
    assert len([e for e in logs if e["event"] == "engines"]) == 103  # the rest at debug
    assert demanded == ["a"] * 100 + ["b"] + ["a"] * 2  # the demand followed every change


def test_device_admission_follows_gpus_and_memory(tmp_path: Path) -> None:
    from unisched.enforce.devices import FakeDeviceAdmission

    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30), GpuInfo(1, "NVIDIA H200", "GPU-y", 1 << 30)])
    rig = Rig(tmp_path, telemetry=tel)
    devices = FakeDeviceAdmission()
    rig.engine.devices = devices
    rig.driver.kind = "v2"  # device admission needs a v2 cgroup directory
    rig.pid += 1
    rig.engine.register("pinned", 100, None, (), (1,), rig.pid, 0, True)
    assert devices.current[Path("/fake/unisched/pinned")] == frozenset({1})
    rig.engine.set_limits("pinned", None, None, None, 100)
    tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0, process_memory={rig.pid: 5000}),
                        GpuSample(1, 0.0, 0.0, 0.0, 0)]
    rig.step(1)
    assert devices.current[Path("/fake/unisched/pinned")] == frozenset()
    rig.engine.remove("pinned")
    assert Path("/fake/unisched/pinned") not in devices.current


def test_cpu_a_tenant_uses_after_its_freeze_is_charged_so_weights_hold(tmp_path: Path) -> None:
    """A freeze lands a few ms late: the tail a frozen tenant still runs must be charged to it, or the tenant
    frozen most often per unit of share (the low weight) gets more than its weight."""
    rig = Rig(tmp_path)
    rig.add("a", 300)
    rig.add("b", 100)
    was_frozen = {"a": False, "b": False}
    for _ in range(2000):
        delay = rig.engine.tick()
        for name in ("a", "b"):
            g = rig.driver.groups[f"/unisched/{name}"]
            if not g.frozen:
                g.cpu_s += delay
            elif not was_frozen[name]:
                g.cpu_s += 0.25 * delay  # the tail after the freeze request
            was_frozen[name] = g.frozen
        rig.clock.advance(delay)
    ratio = rig.cpu("a") / rig.cpu("b")
    assert 2.85 < ratio < 3.15, ratio


def test_encoder_counts_follow_nvml_after_two_disagreeing_checks(tmp_path: Path) -> None:
    """A free the hooks never saw leaves the NVENC count (and a cap) too high: NVML's encoder session list wins
    when it disagrees twice in a row; once is a session caught between its allocation and NVML's list."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA L4", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("enc", 100, busy=False, engines=("encode",))
    pid = rig.pid
    assert rig.engine.admit_session("enc", "nvenc", 0xC0B7) and rig.engine.admit_session("enc", "nvenc", 0xC0B7)
    tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.1, 0, encoder_sessions={pid: 1, 99999: 3})]
    rig.clock.advance(MEMORY_CHECK_S)
    rig.engine.tick()
    assert rig.engine.snapshot("enc").sessions["nvenc"] == 2  # one disagreement: not yet
    rig.clock.advance(MEMORY_CHECK_S)
    rig.engine.tick()
    assert rig.engine.snapshot("enc").sessions["nvenc"] == 1
    tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.1, 0, encoder_sessions=None)]  # NVML cannot say: counts kept
    for _ in range(3):
        rig.clock.advance(MEMORY_CHECK_S)
        rig.engine.tick()
    assert rig.engine.snapshot("enc").sessions["nvenc"] == 1


def test_a_hooked_tenant_without_a_gpu_context_is_neither_frozen_nor_charged(tmp_path: Path) -> None:
    """A trainer importing torch (hooks attached, no context yet, NVML lists none of its processes) next to a
    saturating render: it runs its CPU start-up unfrozen and uncharged; from its first context on it is sliced
    by weight; NVML still listing a process keeps it on the GPU after the hooks saw its context freed."""
    rig, tel = gpu_rig(tmp_path, 1.0)  # a: 300, b: 100, the GPU saturated
    b_pid = rig.pid
    tel.next_samples = [GpuSample(0, 1.0, 0.0, 0.0, 0, gpu_pids=frozenset({1001}))]  # only a's process
    rig.engine.note_session_hooks("b")
    rig.step(round(MEMORY_CHECK_S / SLICE) + 1)  # NVML's lists are read once a second
    f0, a0, b0 = len(rig.driver.freeze_log), rig.cpu("a"), rig.cpu("b")
    rig.step(200)
    assert not any(frozen for _, frozen in rig.driver.freeze_log[f0:])
    assert rig.cpu("b") - b0 == pytest.approx(200 * SLICE, rel=0.01)
    assert rig.engine.snapshot("b").gpu_seconds < 0.01 * (rig.cpu("a") - a0)
    assert rig.engine.admit_session("b", "compute", 0xCBC0)  # its first CUDA context: sliced 3:1 from now on
    rig.step(2)
    a1, b1 = rig.cpu("a"), rig.cpu("b")
    rig.step(400)
    assert (rig.cpu("a") - a1) / (rig.cpu("b") - b1) == pytest.approx(3.0, rel=0.1)
    tel.next_samples = [GpuSample(0, 1.0, 0.0, 0.0, 0, gpu_pids=frozenset({1001, b_pid}))]
    rig.step(round(MEMORY_CHECK_S / SLICE) + 1)
    rig.engine.session_freed("b", "compute")  # the hooks saw the free; NVML still lists b's process
    a2, b2 = rig.cpu("a"), rig.cpu("b")
    rig.step(400)
    assert (rig.cpu("a") - a2) / (rig.cpu("b") - b2) == pytest.approx(3.0, rel=0.1)


def test_a_run_tenants_cpu_start_up_is_not_charged_as_gpu_time(tmp_path: Path) -> None:
    """`unisched run` registers with session_hooks: the tenant it creates holds no GPU context until the hooks
    count one, so its CPU start-up (a torch import) on an idle GPU is neither charged nor shown as running; the
    CPU stand-in charged it as GPU time until the hand-over and NVML's next list (3 GPU-s on the H200 machine),
    and a test reading 'GPU seconds > 2' then saw the tenant idle before its first kernel."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0, gpu_pids=frozenset())]  # the GPU idle, NVML lists nobody
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000), telemetry=tel)
    rig.step()  # the daemon has sampled the GPU before anyone registers
    rig.pid += 1
    rig.engine.register("t", None, None, (), (), rig.pid, 0, True, session_hooks=True)
    rig.busy.add("t")  # importing torch: one core busy
    rig.step(round(3.0 / SLICE))
    snap = rig.engine.snapshot("t")
    assert rig.cpu("t") == pytest.approx(3.0, rel=0.05) and snap.gpu_seconds == 0.0 and snap.state == "idle"
    assert rig.engine.admit_session("t", "compute", 0xCBC0)  # its first CUDA context
    rig.step(round(1.0 / SLICE))
    snap = rig.engine.snapshot("t")
    assert snap.gpu_seconds > 0.9 and snap.state == "running"


def test_without_a_process_list_a_run_tenants_cpu_is_its_gpu_work(tmp_path: Path) -> None:
    """Without NVML (CPU time stands in for GPU time) a run tenant is on the GPU from its first process: it
    contends at once, as a fork storm beside a busy tenant must (tests/test_faults.py)."""
    rig = Rig(tmp_path)
    rig.add("busy", 100)
    rig.step()
    rig.pid += 1
    rig.engine.register("t", None, None, (), (), rig.pid, 0, True, session_hooks=True)
    rig.busy.add("t")
    rig.step(round(0.5 / SLICE))
    assert rig.engine.snapshot("t").gpu_seconds > 0.1 and rig.engine.snapshot("t").state in ("running", "frozen")


def test_without_hooks_no_gpu_context_is_assumed_missing(tmp_path: Path) -> None:
    """An adopted or unhooked tenant's sessions are unknown: an empty NVML list alone does not exempt it."""
    rig, tel = gpu_rig(tmp_path, 1.0)
    tel.next_samples = [GpuSample(0, 1.0, 0.0, 0.0, 0, gpu_pids=frozenset())]
    rig.step(400)
    assert rig.cpu("a") / rig.cpu("b") == pytest.approx(3.0, rel=0.1)
