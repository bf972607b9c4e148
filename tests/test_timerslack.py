"""The tenants' timer slack (`timer_slack_us`): real threads of real processes in real cgroups get it through /proc,
only theirs, bounded a sweep; the engine sweeps the charged tenants only, in turn; a real daemon gives it to a
`unisched run` tenant's threads. Needs root (CAP_SYS_NICE) and a freezer for the real parts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env, needs_freezer, wait_until
from structlog.testing import capture_logs

from unisched.enforce.cgroups import CgroupDriver, CgroupError, FakeCgroupDriver, detect_driver
from unisched.enforce.leases import FakeLeaseChannel
from unisched.enforce.timerslack import MAX_THREADS_A_SWEEP, FakeThreadSlack, ProcThreadSlack, SlackSweep, settle_thread
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.runner import run_engine, run_slack
from unisched.scheduler.state import StateStore
from unisched.telemetry import NoGpuTelemetry

SLACK_NS = 1_000_000
THREADS_CHILD = ("import sys, threading\nev = threading.Event()\n"
                 "ts = [threading.Thread(target=ev.wait) for _ in range({})]\n"
                 "[t.start() for t in ts]\nprint('up', flush=True)\nsys.stdin.readline()\nev.set()\n")
"""A child with N more threads than its main one, all waiting until a line on its stdin."""

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="setting another process's timer slack needs root")


def slacks(pid: int) -> list[int]:
    return [int((Path(f"/proc/{tid}/timerslack_ns")).read_text())
            for tid in os.listdir(f"/proc/{pid}/task")]


def real_driver(prefer: str) -> CgroupDriver:
    try:
        return detect_driver(prefer)
    except CgroupError as e:
        pytest.skip(f"no cgroup {prefer} freezer here: {e}")


@pytest.fixture
def child_in(tenant_prefix: str, request: pytest.FixtureRequest) -> Iterator[tuple[CgroupDriver, str, subprocess.Popen[str]]]:
    """A child with 3 waiting threads (4 in all), in a fresh tenant cgroup (request.param: the cgroup version;
    with "below", in a cgroup under the tenant's, as a pod's containers are)."""
    prefer, below = request.param
    driver = real_driver(prefer)
    cg = driver.tenant_cgroup(f"{tenant_prefix}slack")
    driver.create(cg)
    inner = f"{cg}/inner" if below else cg
    if below:
        driver.create(inner)
    child = subprocess.Popen([sys.executable, "-c", THREADS_CHILD.format(3)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        driver.attach(inner, child.pid)
        yield driver, cg, child
    finally:
        child.kill()
        child.communicate()
        if below:
            driver.remove(inner)
        driver.remove(cg)


@root_only
@needs_freezer
@pytest.mark.parametrize("child_in", [("v2", False), ("v1", False), ("v2", True), ("v1", True)], indirect=True)
def test_every_thread_of_the_cgroup_gets_the_slack_once(child_in: tuple[CgroupDriver, str, subprocess.Popen[str]]) -> None:
    driver, cg, child = child_in
    assert SLACK_NS not in slacks(child.pid)
    first = ProcThreadSlack(driver).settle(cg, SLACK_NS, 100)
    assert first == SlackSweep(set=4), first
    assert slacks(child.pid) == [SLACK_NS] * 4
    assert ProcThreadSlack(driver).settle(cg, SLACK_NS, 100) == SlackSweep(already=4)


@root_only
@needs_freezer
@pytest.mark.parametrize("child_in", [("v2", False), ("v1", False)], indirect=True)
def test_a_sweep_looks_at_no_more_threads_than_its_bound(child_in: tuple[CgroupDriver, str, subprocess.Popen[str]]) -> None:
    driver, cg, child = child_in
    assert ProcThreadSlack(driver).settle(cg, SLACK_NS, 3) == SlackSweep(set=3, left=1)
    assert sorted(slacks(child.pid)).count(SLACK_NS) == 3
    assert ProcThreadSlack(driver).settle(cg, SLACK_NS, 100) == SlackSweep(set=1, already=3)


@root_only
@needs_freezer
@pytest.mark.parametrize("child_in", [("v2", True), ("v1", True)], indirect=True)
def test_a_sweep_looks_into_no_more_cgroups_than_its_bound(
        child_in: tuple[CgroupDriver, str, subprocess.Popen[str]]) -> None:
    """A delegated tenant may make many cgroups below its own: a sweep walks `most` of them at most (here the
    tenant's own, empty, then the one below that holds the child)."""
    driver, cg, child = child_in
    assert ProcThreadSlack(driver).settle(cg, SLACK_NS, 1) == SlackSweep()
    assert SLACK_NS not in slacks(child.pid)
    assert ProcThreadSlack(driver).settle(cg, SLACK_NS, 2) == SlackSweep(set=2, left=2)


@root_only
@needs_freezer
@pytest.mark.parametrize("prefer", ["v2", "v1"])
def test_a_thread_not_in_the_cgroup_is_left_alone(prefer: str, tenant_prefix: str) -> None:
    """A tid the cgroup listed may be another process's by the time it is written (reused): the thread is checked to
    be in the cgroup, through the same handle on /proc/TID the write goes through."""
    driver = real_driver(prefer)
    cg = driver.tenant_cgroup(f"{tenant_prefix}other")
    driver.create(cg)
    stranger = subprocess.Popen([sys.executable, "-c", THREADS_CHILD.format(0)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stranger.stdout is not None and stranger.stdout.readline().strip() == "up"
        before = slacks(stranger.pid)
        assert settle_thread(stranger.pid, cg, driver.kind, SLACK_NS) == "gone"
        assert slacks(stranger.pid) == before != [SLACK_NS]
        assert settle_thread(2 ** 22 + 1, cg, driver.kind, SLACK_NS) == "gone"  # past pid_max: no such thread
    finally:
        stranger.kill()
        stranger.communicate()
        driver.remove(cg)
    assert ProcThreadSlack(driver).settle(cg, SLACK_NS, 100) == SlackSweep()  # the cgroup is gone


# --- the engine's sweeps (fakes) ------------------------------------------------------------------------------------
def engine(tmp: Path, slack_us: float, fake: FakeThreadSlack, *names: str, engines: tuple[str, ...] = ("graphics",)
           ) -> Scheduler:
    """An engine over fake cgroups with tenants `names` registered (freezer-governed: their CPU is charged), each
    declaring `engines`."""
    e = Scheduler(DaemonConfig(timer_slack_us=slack_us), FakeCgroupDriver(), NoGpuTelemetry(), StateStore(tmp / "state"),
                  FakeClock(), thread_slack=fake)
    e.start()
    for i, name in enumerate(names):
        e.register(name, 100, None, engines, (), 1000 + i, 0, True)
    return e


def test_no_sweep_while_the_knob_is_off(tmp_path: Path) -> None:
    fake = FakeThreadSlack()
    e = engine(tmp_path, 0, fake, "a")
    assert e.slack_sweeper() is None
    assert asyncio.run(asyncio.wait_for(run_slack(e, asyncio.Event()), 5)) is None  # returns at once
    assert fake.swept == []


def test_sweeps_take_the_charged_tenants_in_turn_within_one_bound(tmp_path: Path) -> None:
    fake = FakeThreadSlack({"/unisched/a": MAX_THREADS_A_SWEEP - 96, "/unisched/b": 200})
    e = engine(tmp_path, 1000, fake, "a", "b", "c")
    sweep = e.slack_sweeper()
    assert sweep is not None
    swept = sweep()
    assert [(n, s.set, s.left) for n, s in swept] == [("a", MAX_THREADS_A_SWEEP - 96, 0), ("b", 96, 104)]
    assert fake.swept[0] == ("/unisched/a", SLACK_NS, MAX_THREADS_A_SWEEP)
    swept = e.slack_sweeper()()  # type: ignore[misc]
    assert swept == [("b", SlackSweep(set=200)), ("c", SlackSweep(set=1)),
                     ("a", SlackSweep(set=MAX_THREADS_A_SWEEP - 201, left=105))]
    assert [n for n, _ in e.slack_sweeper()()] == ["c", "a", "b"]  # type: ignore[misc]


def test_the_engine_loop_sweeps_beside_its_slices(tmp_path: Path) -> None:
    """run_engine starts the sweeps when the knob is set: the first comes with the loop's start, on a worker thread."""

    class StopWhenSwept(FakeThreadSlack):
        stop: asyncio.Event
        loop: asyncio.AbstractEventLoop

        def settle(self, cgroup: str, slack_ns: int, most: int) -> SlackSweep:
            got = super().settle(cgroup, slack_ns, most)
            self.loop.call_soon_threadsafe(self.stop.set)
            return got

    async def go() -> None:
        fake.loop, fake.stop = asyncio.get_running_loop(), asyncio.Event()
        await asyncio.wait_for(run_engine(e, fake.stop), 30)

    fake = StopWhenSwept()
    e = engine(tmp_path, 1000, fake, "a")
    asyncio.run(go())
    assert fake.swept == [("/unisched/a", SLACK_NS, MAX_THREADS_A_SWEEP)]


def test_only_tenants_that_render_and_are_charged_are_swept(tmp_path: Path) -> None:
    """Cooperative clients report their GPU time (their renewals would only wait longer); compute and video tenants
    have no GL driver wait to mend, only timers to delay; a tenant whose render sessions show is swept from then on."""
    fake = FakeThreadSlack()
    e = engine(tmp_path, 500, fake, "app")
    e.lease_open("client", 100, None, ["graphics"], 0, 2000, 0, True, FakeLeaseChannel())
    e.register("trainer", 100, None, ("compute",), (), 3000, 0, True)
    e.register("decoder", 100, None, ("decode", "encode"), (), 3001, 0, True)
    swept = e.slack_sweeper()()  # type: ignore[misc]
    assert [n for n, _ in swept] == ["app"] and fake.swept == [("/unisched/app", 500_000, MAX_THREADS_A_SWEEP)]
    assert e.admit_session("trainer", "graphics", 0xC097)  # (a render context the hooks saw)
    assert sorted(n for n, _ in e.slack_sweeper()()) == ["app", "trainer"]  # type: ignore[misc]


def test_a_refused_write_is_warned_once_a_minute(tmp_path: Path) -> None:
    fake = FakeThreadSlack(refuse=frozenset({"/unisched/a"}))
    e = engine(tmp_path, 1000, fake, "a")
    with capture_logs() as logs:
        for _ in range(3):
            e.note_slack(e.slack_sweeper()())  # type: ignore[misc]
    warned = [r for r in logs if "CAP_SYS_NICE" in str(r.get("event"))]
    assert len(warned) == 1 and warned[0]["tenant"] == "a"


# --- a real daemon --------------------------------------------------------------------------------------------------
@root_only
@needs_freezer
@pytest.mark.root
def test_the_daemon_gives_a_run_tenants_threads_the_slack(daemon_factory, tenant_prefix: str) -> None:  # type: ignore[no-untyped-def]
    d: Daemon = daemon_factory("--slice-ms", "20", "--timer-slack-us", "1000")
    name = f"{tenant_prefix}slk"
    tenant = subprocess.Popen(
        [sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", name, "--weight", "100",
         "--engines", "graphics", "--",
         sys.executable, "-c", THREADS_CHILD.format(2)],
        cwd=ROOT, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert tenant.stdout is not None and tenant.stdout.readline().strip() == "up"
        pids = wait_until(lambda: next((t["pids"] for t in d.tenants() if t["name"] == name and t["pids"]), None), 20,
                          "the tenant to register")
        threads = wait_until(lambda: [s for p in pids for s in slacks(p)], 20, "the tenant's threads")
        assert len(threads) >= 3  # the child's main thread and its two (and `unisched run`'s own, where it stays)
        wait_until(lambda: all(s == SLACK_NS for p in pids for s in slacks(p)), 20, "the tenant's threads' slack")
    finally:
        tenant.kill()
        tenant.communicate()
