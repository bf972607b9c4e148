"""The tick's save is written off the event loop, on the state file's writer thread (scheduler.saves), while the
engine serves; newer snapshots win, saves a caller relies on are on disk when it is answered and are never
overwritten by an older snapshot, shutdown leaves the last state on disk, and a failed write is saved again.

The disk is the real one, with os.fsync held (until the test's threading.Event) or failing on demand, and
os.replace recording each snapshot as it lands; fake cgroups and an injected clock."""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.scheduler import state
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.context import SAVE_DELAY_S
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import NoGpuTelemetry

WAIT_S = 10.0
"""A deadline for what the test waits on (an event, a future), never a delay standing in for one."""
Landed = dict[str, int]
"""A snapshot as it landed in state.json: each tenant's weight."""


class Disk:
    """os.fsync, held while `hold()` is on (until `go()`) or failing with `fail`; os.replace records what lands
    in state.json and on which thread."""

    def __init__(self, real_fsync: Callable[[int], None], real_replace: Callable[[str, str], None]) -> None:
        self._fsync, self._replace = real_fsync, real_replace
        self.holding = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail: OSError | None = None
        self.landed: list[Landed] = []
        self.threads: list[str] = []

    def hold(self) -> None:
        self.entered.clear()
        self.release.clear()
        self.holding = True

    def go(self) -> None:
        self.holding = False
        self.release.set()

    def fsync(self, fd: int) -> None:
        if self.fail is not None:
            raise self.fail
        if self.holding:
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the held fsync"
        self._fsync(fd)

    def replace(self, src: str, dst: str) -> None:
        if Path(dst).name == "state.json":
            body = json.loads(Path(src).read_bytes())
            self.landed.append({t["name"]: t["weight"] for t in body["tenants"]})
            self.threads.append(threading.current_thread().name)
        self._replace(src, dst)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    d = Disk(os.fsync, os.replace)
    monkeypatch.setattr(state.os, "fsync", d.fsync)
    monkeypatch.setattr(state.os, "replace", d.replace)
    try:
        yield d
    finally:
        d.go()  # never leave a writer thread waiting


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.clock = FakeClock()
        self.store = StateStore(tmp / "state")
        self.engine = Scheduler(DaemonConfig(), FakeCgroupDriver(), NoGpuTelemetry(), self.store, self.clock)  # type: ignore[arg-type]
        self.engine.start()
        self.pid = 1000

    def add(self, name: str) -> None:
        self.pid += 1
        self.engine.register(name, None, None, (), (), self.pid, 0, True)

    def tick_later(self) -> None:
        """A tick once the registrations' save is due."""
        self.clock.advance(SAVE_DELAY_S)
        self.engine.tick()

    def written(self) -> bool:
        return self.engine._c.writer.wait(WAIT_S)

    def on_disk(self) -> Landed:
        return {t.name: t.weight for t in self.store.load()}


def held_with_one_waiting(tmp: Path, disk: Disk) -> Rig:
    """A rig whose tick's save of {a} is held in its fsync, with {a, b} waiting behind it."""
    rig = Rig(tmp)
    rig.add("a")
    disk.hold()
    rig.tick_later()
    assert disk.entered.wait(WAIT_S), "the tick's save never started"
    rig.add("b")
    rig.tick_later()
    return rig


def released_during(disk: Disk, call: Callable[[], object]) -> None:
    """Make `call` on another thread (it may wait for the held write), release the write, and wait for it."""
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(call)
        disk.go()
        done.result(timeout=WAIT_S)


def test_a_tick_returns_and_the_engine_serves_while_its_save_is_held_in_fsync(tmp_path: Path, disk: Disk) -> None:
    rig = Rig(tmp_path)
    rig.add("a")
    disk.hold()
    with ThreadPoolExecutor(1) as pool:
        ticked = pool.submit(rig.tick_later)
        assert disk.entered.wait(WAIT_S), "the tick's save never started"
        ticked.result(timeout=WAIT_S)  # the tick returned while the fsync is held
        rig.add("b")  # registrations, listings and ticks go on meanwhile
        assert {s.name for s in rig.engine.snapshots()} == {"a", "b"}
        rig.engine.tick()
        assert not disk.release.is_set() and disk.landed == [{}], "the held write landed early"
        disk.go()
    assert rig.written()
    assert disk.landed[-1] == {"a": 100} and disk.threads[-1] == "unisched-save"


def test_a_newer_snapshot_replaces_the_waiting_one_and_lands_last(tmp_path: Path, disk: Disk) -> None:
    rig = held_with_one_waiting(tmp_path, disk)
    rig.add("c")
    rig.tick_later()  # replaces {a, b}
    disk.go()
    assert rig.written()
    assert disk.landed == [{}, {"a": 100}, {"a": 100, "b": 100, "c": 100}]
    assert rig.on_disk() == {"a": 100, "b": 100, "c": 100}


def test_a_weight_set_while_a_save_is_held_is_on_disk_and_never_overwritten_by_an_older_snapshot(
        tmp_path: Path, disk: Disk) -> None:
    rig = held_with_one_waiting(tmp_path, disk)
    released_during(disk, lambda: rig.engine.set_weight("a", 300))  # an admin's call: answered once on disk
    assert rig.on_disk() == {"a": 300, "b": 100}, "the admin was answered before the weight was on disk"
    assert rig.written()
    rig.tick_later()
    assert rig.written()
    assert rig.on_disk() == {"a": 300, "b": 100}
    first = disk.landed.index({"a": 300, "b": 100})
    assert {"a": 100, "b": 100} not in disk.landed[first:], "an older snapshot landed after the admin's"


def test_shutdown_leaves_the_last_state_on_disk_and_ends_the_writer(tmp_path: Path, disk: Disk) -> None:
    rig = held_with_one_waiting(tmp_path, disk)
    rig.add("c")  # not handed off yet: only shutdown saves it
    released_during(disk, rig.engine.shutdown)
    assert rig.on_disk() == {"a": 100, "b": 100, "c": 100}
    assert disk.landed[-1] == {"a": 100, "b": 100, "c": 100}
    assert rig.engine._c.writer.wait(0), "the writer thread outlived shutdown"


def test_a_failed_write_is_logged_and_a_later_tick_writes_again(tmp_path: Path, disk: Disk) -> None:
    rig = Rig(tmp_path)
    rig.add("a")
    disk.fail = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with capture_logs() as logs:
        rig.tick_later()  # the tick itself does not fail
        assert rig.written()
    said = [e for e in logs if e["event"].startswith("state file not written")]
    assert said and said[0]["log_level"] == "error" and said[0]["error"] == os.strerror(errno.ENOSPC)
    assert rig.on_disk() == {}
    disk.fail = None
    rig.engine.tick()  # before SAVE_DELAY_S: the failure is seen, the save is due later
    assert rig.engine._c.unsaved
    rig.tick_later()
    assert rig.written()
    assert rig.on_disk() == {"a": 100} and not rig.engine._c.unsaved
