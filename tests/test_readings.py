"""A tick's reads (NVML, the tenants' cgroup CPU time) are made off the event loop: the loop serves while they
block, and a tick on reads made before it sees what changed meanwhile. Fake cgroups and telemetry, the real engine
and its loop; no sleeps (threading events, with a timer that only ever frees a loop that would otherwise hang)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_engine import SLICE, Rig, gpu_rig

from unisched.scheduler.runner import run_engine
from unisched.scheduler.upkeep import MEMORY_CHECK_S
from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample

RELEASE_AFTER_S = 10.0
"""Frees a read that blocks the loop itself (the defect under test), so that the test fails instead of hanging."""


class BlockingTelemetry(FakeTelemetry):
    """Every sample() blocks until `release` is set."""

    def __init__(self) -> None:
        super().__init__([GpuInfo(0, "NVIDIA H200", "GPU-0", 1 << 30)])
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0
        self.threads: list[str] = []

    def sample(self) -> Sequence[GpuSample]:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        self.release.wait(RELEASE_AFTER_S + 5)
        return super().sample()


def test_the_loop_serves_while_a_tick_reads_the_gpus(tmp_path: Path) -> None:
    tel = BlockingTelemetry()
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("a", 300)
    served_while_blocked: list[bool] = []

    async def go() -> None:
        stop = asyncio.Event()
        timer = threading.Timer(RELEASE_AFTER_S, tel.release.set)
        timer.start()
        task = asyncio.create_task(run_engine(rig.engine, stop))
        try:
            assert await asyncio.to_thread(tel.entered.wait, RELEASE_AFTER_S * 2)
            # the loop is free: a call is served (a status, as a client's would be) while the read still blocks
            rig.engine.snapshots()
            served_while_blocked.append(not tel.release.is_set())
        finally:
            tel.release.set()
            timer.cancel()
            stop.set()
            await task

    asyncio.run(go())
    assert served_while_blocked == [True], "the tick read NVML on the event loop, which waited for it"
    assert threading.main_thread().name not in tel.threads


def test_a_tick_on_earlier_reads_uses_them_and_reads_a_tenant_that_came_since(tmp_path: Path) -> None:
    """Reads made for a; a burns more CPU and c registers before the tick: a is charged up to what was read (the
    rest falls in the next interval), c is read in the tick."""
    rig = Rig(tmp_path)
    rig.add("a", 100)
    rig.step(4)
    read = rig.engine.readings_reader()
    reads = read()
    a_read = reads.cpu_usage_s[("a", "/unisched/a")]
    assert a_read == pytest.approx(rig.cpu("a"))
    rig.driver.groups["/unisched/a"].cpu_s += 0.5
    rig.add("c", 100)
    rig.driver.groups["/unisched/c"].cpu_s = 0.25
    rig.clock.advance(SLICE)
    rig.engine.advance(reads)
    tenants = rig.engine._c.tenants
    assert tenants["a"].last_cpu == pytest.approx(a_read)
    assert tenants["c"].last_cpu == pytest.approx(0.25)


def test_advance_with_reads_ticks_even_where_a_step_was_due(tmp_path: Path) -> None:
    """The loop read for a tick (NVML's samples since the last read are taken): the engine must tick on them, not
    take a rationed step and drop them."""
    rig, tel = gpu_rig(tmp_path, 0.9)
    rig.step(2)
    ctx = rig.engine._c
    ctx.plan = dataclasses.replace(ctx.plan, steps=(frozenset(),) * 4)  # a rationed slice, its first step
    ctx.step = 0
    ctx.next_tick = rig.clock.monotonic() + 1.0
    assert not rig.engine.tick_due()
    tel.next_samples = [GpuSample(0, 0.5, 0.0, 0.0, 0)]
    reads = rig.engine.readings_reader()()
    rig.clock.advance(0.01)
    rig.engine.advance(reads)
    assert ctx.last_tick == rig.clock.monotonic(), "a step was taken and the reads dropped"
    assert ctx.last_samples == (GpuSample(0, 0.5, 0.0, 0.0, 0),)


def test_a_telemetry_that_raises_off_the_loop_is_a_slice_without_gpu_signal(tmp_path: Path) -> None:
    class Raising(FakeTelemetry):
        def sample(self) -> Sequence[GpuSample]:
            raise RuntimeError("NVML: GPU is lost")

    rig = Rig(tmp_path, telemetry=Raising([GpuInfo(0, "NVIDIA H200", "GPU-0", 1 << 30)]))
    rig.add("a", 100)
    reads = rig.engine.readings_reader()()
    assert reads.samples == () and reads.failure is not None and "GPU is lost" in reads.failure
    rig.engine.advance(reads)  # does not raise
    assert rig.engine._c.telemetry_failing


def test_the_process_lists_are_read_off_the_loop_for_the_ticks_that_check_memory(tmp_path: Path) -> None:
    """Once a second a tick checks memory from the tenants' process lists: they come with the reads, and the tick
    reads none itself; between those ticks the reads list none. The check works from them (over its cap)."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-0", 1 << 30)])
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("g", 100)
    rig.engine.set_limits("g", None, None, None, 1 << 20)
    pid = rig.driver.pids("/unisched/g")[0]
    tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0, process_memory={pid: 2 << 20})]
    read_here: list[str] = []
    listed = rig.driver.pids
    rig.clock.advance(MEMORY_CHECK_S)
    reads = rig.engine.readings_reader()()
    assert reads.pids == {"/unisched/g": [pid]}
    rig.driver.pids = lambda cgroup: read_here.append(cgroup) or listed(cgroup)  # type: ignore[method-assign]
    rig.engine.advance(reads)
    assert read_here == [], "the tick read a process list on the loop"
    assert rig.engine.snapshot("g").over_memory
    rig.clock.advance(SLICE)
    assert rig.engine.readings_reader()().pids == {}


def test_a_run_tenant_whose_caller_came_after_the_reads_is_not_removed(tmp_path: Path) -> None:
    """A `unisched run` tenant's cgroup read empty off the loop; its next caller is moved in before the tick: the
    tick must not remove the tenant (and its caller's cgroup) on the stale list."""
    rig = Rig(tmp_path)
    rig.engine.register("once", None, None, (), (), 11, 1000, False, keep=False)
    rig.driver.groups["/unisched/once"].pids.clear()  # its first process exited
    rig.clock.advance(MEMORY_CHECK_S)
    reads = rig.engine.readings_reader()()
    assert reads.pids == {"/unisched/once": []}
    rig.driver.groups["/unisched/once"].pids.append(12)  # the next `unisched run` moved its caller in
    rig.engine.advance(reads)
    assert rig.engine.has_tenant("once")
    assert "/unisched/once" in rig.driver.groups


class StuckTelemetry(FakeTelemetry):
    """No GPUs (the CPU signal decides) until `stuck` is set; then every sample() blocks until `release` is (a GPU fallen off the
    bus holds NVML so)."""

    def __init__(self) -> None:
        super().__init__([])
        self.stuck, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()

    def sample(self) -> Sequence[GpuSample]:
        if self.stuck.is_set():
            self.entered.set()
            self.release.wait(RELEASE_AFTER_S + 5)
        return super().sample()


def contended(tmp_path: Path) -> tuple[Rig, StuckTelemetry]:
    """Tenants a (300) and b (100) sharing a busy GPU, one of them frozen now."""
    tel = StuckTelemetry()
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("a", 300)
    rig.add("b", 100)
    for _ in range(50):
        rig.step()
        if rig.frozen("a") or rig.frozen("b"):
            break
    assert rig.frozen("a") or rig.frozen("b"), "no tenant was frozen: nothing to test"
    tel.stuck.set()
    return rig, tel


def test_a_stop_while_a_read_is_stuck_thaws_and_ends_without_it(tmp_path: Path) -> None:
    rig, tel = contended(tmp_path)

    async def go() -> bool:
        stop = asyncio.Event()
        task = asyncio.create_task(run_engine(rig.engine, stop, read_overdue_s=RELEASE_AFTER_S * 10))
        try:
            assert await asyncio.to_thread(tel.entered.wait, RELEASE_AFTER_S)
            stop.set()
            done, _ = await asyncio.wait((task,), timeout=RELEASE_AFTER_S / 2)
            return task in done
        finally:
            tel.release.set()
            stop.set()
            await task

    assert asyncio.run(go()), "the stop waited for the stuck read"
    assert not rig.frozen("a") and not rig.frozen("b")


def test_a_read_that_does_not_come_back_thaws_every_tenant_meanwhile(tmp_path: Path) -> None:
    rig, tel = contended(tmp_path)
    thawed = threading.Event()
    set_frozen = rig.driver.set_frozen

    def watched(cgroup: str, frozen: bool) -> None:
        set_frozen(cgroup, frozen)
        if tel.entered.is_set() and not rig.frozen("a") and not rig.frozen("b"):
            thawed.set()

    rig.driver.set_frozen = watched  # type: ignore[method-assign]

    async def go() -> bool:
        stop = asyncio.Event()
        task = asyncio.create_task(run_engine(rig.engine, stop, read_overdue_s=0.05))
        try:
            return await asyncio.to_thread(thawed.wait, RELEASE_AFTER_S)
        finally:
            tel.release.set()
            stop.set()
            await task

    assert asyncio.run(go()), "the tenants stayed frozen while the read was stuck"
