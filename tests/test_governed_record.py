"""What a crash leaves and a restart finds: the record of what a daemon may freeze (compacted as pods come and go,
kept until its thaw succeeded; over a freezer hierarchy of plain files), and the tenants taken back from the state
file and the live cgroups (over fake cgroups)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_engine import Rig

from unisched.enforce import governed
from unisched.enforce.cgroups import CgroupError
from unisched.enforce.governed import COMPACT_RECORD_BYTES, GovernedRecord, thaw_orphans
from unisched.scheduler.core import Scheduler
from unisched.scheduler.upkeep import MEMORY_CHECK_S
from unisched.telemetry import NoGpuTelemetry


def hierarchy(tmp_path: Path) -> Path:
    mount = tmp_path / "cgroup"
    mount.mkdir()
    return mount


def frozen_cgroup(mount: Path, path: str) -> Path:
    d = mount / path.lstrip("/")
    d.mkdir(parents=True)
    (d / "cgroup.freeze").write_text("1\n")
    return d


def records(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.list"))


def test_a_record_of_many_adoptions_keeps_those_that_exist_and_the_last_is_thawed_after_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's pods come and go, each adopted once: the record is rewritten with the cgroups still there, so it
    stays small, and a crash's thaw reaches the newest adoption and an early one that still runs."""
    mount, directory = hierarchy(tmp_path), tmp_path / "governed"
    monkeypatch.setattr(governed, "_freezer_mounts", lambda: [("v2", mount)])
    record = GovernedRecord(directory, "unisched")
    early = "/kubepods/burstable/pod-early-still-running"
    frozen_cgroup(mount, early)
    record.note(early)
    pods = 40 * COMPACT_RECORD_BYTES // 100  # ~40 compactions' worth of pods that have since gone
    for i in range(pods):
        record.note(f"/kubepods/burstable/pod{i:08d}-0123456789abcdef0123456789abcdef")
    last = "/kubepods/burstable/pod-last"
    frozen_cgroup(mount, last)
    record.note(last)
    assert record.path.stat().st_size <= 2 * COMPACT_RECORD_BYTES
    record.close(keep=True)  # a crash: the lock goes, the record stays
    got = thaw_orphans([directory], [("v2", mount)])
    assert set(got.thawed) == {early, last} and got.problems == () and got.records == 1
    assert (mount / last.lstrip("/") / "cgroup.freeze").read_text() == "0"
    assert records(directory) == []


def test_a_record_whose_thaw_failed_is_kept_and_the_next_start_thaws(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    mount, directory = hierarchy(tmp_path), tmp_path / "governed"
    frozen_cgroup(mount, "/pods/p1")
    directory.mkdir(mode=0o700)
    (directory / "dead.list").write_text("subtree /unisched\nadopted /pods/p1\n")
    thaw_dir = governed._thaw_dir
    busy = [True]

    def once_busy(kind: str, d: Path) -> bool:
        if busy.pop() if busy else False:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return thaw_dir(kind, d)

    monkeypatch.setattr(governed, "_thaw_dir", once_busy)
    first = thaw_orphans([directory], [("v2", mount)])
    assert first.thawed == () and first.records == 0 and any("busy" in p for p in first.problems)
    assert records(directory) == [directory / "dead.list"], "the record went with the cgroup still frozen"
    second = thaw_orphans([directory], [("v2", mount)])
    assert second.thawed == ("/pods/p1",) and second.records == 1 and records(directory) == []


def test_a_record_larger_than_is_read_is_kept_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount, directory = hierarchy(tmp_path), tmp_path / "governed"
    directory.mkdir(mode=0o700)
    monkeypatch.setattr(governed, "MAX_RECORD_BYTES", 64)
    (directory / "big.list").write_text("subtree /unisched\n" + "adopted /pods/p\n" * 10)
    got = thaw_orphans([directory], [("v2", mount)])
    assert got.records == 0 and any("tail was not read" in p for p in got.problems)
    assert records(directory) == [directory / "big.list"]


def test_a_shutdown_that_cannot_thaw_a_tenant_says_so_and_a_clean_one_does_not(tmp_path: Path) -> None:
    """The daemon removes its record only when the shutdown thawed everything (daemon._serve reads left_frozen)."""
    rig = Rig(tmp_path)
    rig.add("a", 300)
    rig.add("b", 100)
    rig.step(5)
    set_frozen = rig.driver.set_frozen

    def stuck(cgroup: str, frozen: bool) -> None:
        if cgroup.endswith("/a") and not frozen:
            raise CgroupError("cannot write cgroup.freeze: Device or resource busy")
        set_frozen(cgroup, frozen)

    rig.driver.set_frozen = stuck  # type: ignore[method-assign]
    rig.engine.shutdown()
    assert rig.engine.left_frozen
    clean = Rig(tmp_path / "clean")
    clean.add("a", 100)
    clean.engine.shutdown()
    assert not clean.engine.left_frozen


def test_a_record_closed_with_something_left_frozen_stays_for_the_next_start(tmp_path: Path) -> None:
    kept, removed = GovernedRecord(tmp_path / "k", "k"), GovernedRecord(tmp_path / "r", "r")
    kept.close(keep=True)
    removed.close()
    assert kept.path.exists() and not removed.path.exists()
    assert thaw_orphans([tmp_path / "k"], []).records == 1


def restart(rig: Rig) -> Scheduler:
    """A new engine over the same cgroups and state, as after a crash (no shutdown)."""
    assert rig.engine._c.writer.wait(10.0), "the last save was never written"
    engine = Scheduler(rig.config, rig.driver, NoGpuTelemetry(), rig.store, rig.clock)
    engine.start()
    return engine


def test_a_tenant_removed_while_its_processes_ran_comes_back_only_until_they_end(tmp_path: Path) -> None:
    """A restart governs the live cgroup again (not left unscheduled), but not as a tenant kept for ever at root's
    weight: it goes when its processes have, and its owner may make it again."""
    rig = Rig(tmp_path)
    rig.engine.register("job", 50, None, (), (), 4242, 1000, False, keep=True)
    rig.engine.remove_as("job", 1000, False)  # its process still runs in the cgroup
    engine = restart(rig)
    (job,) = [t for t in engine._c.tenants.values() if t.name == "job"]
    assert job.ephemeral and job.owner_uid == 0
    rig.driver.groups["/unisched/job"].pids.clear()  # its process ended
    rig.clock.advance(MEMORY_CHECK_S)
    engine.tick()
    assert not engine.has_tenant("job")
    engine.register("job", 50, None, (), (), 4343, 1000, False, keep=True)  # its owner makes it again
    assert engine._c.tenants["job"].owner_uid == 1000


def test_a_saved_adopted_cgroup_that_now_holds_the_daemon_is_not_restored(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.driver.create("/system.slice")
    rig.engine.adopt("sys", 100, None, "/system.slice", (), ())
    rig.driver.create("/system.slice/unisched.service")
    rig.driver.attach("/system.slice/unisched.service", os.getpid())  # the daemon runs there now
    engine = restart(rig)
    assert not engine.has_tenant("sys"), "a cgroup holding the daemon was restored: its turns would freeze the daemon"


def test_a_users_removal_is_saved_by_the_tick_off_the_loop_and_an_admins_at_once(tmp_path: Path) -> None:
    """A user may remove and re-make its tenant in a loop: that must not put two fsyncs on the event loop each time
    (the tick saves it within SAVE_DELAY_S, as registrations); an admin's removal is on disk when answered."""
    from unisched.scheduler.context import SAVE_DELAY_S

    rig = Rig(tmp_path)
    on_loop: list[bytes] = []
    writer = rig.engine._c.writer
    write_now = writer.write_now
    writer.write_now = lambda body: on_loop.append(body) or write_now(body)  # type: ignore[method-assign]
    rig.engine.register("mine", 50, None, (), (), 4242, 1000, False, keep=True)
    rig.engine.register("theirs", 50, None, (), (), 4343, 1001, False, keep=True)
    rig.engine.remove_as("mine", 1000, False)
    assert on_loop == []
    rig.clock.advance(SAVE_DELAY_S)
    rig.engine.tick()
    assert writer.wait(10.0)
    assert b'"mine"' not in rig.store.path.read_bytes() and b'"theirs"' in rig.store.path.read_bytes()
    rig.engine.remove_as("theirs", 0, True)
    assert len(on_loop) == 1 and b'"theirs"' not in on_loop[0]


def test_a_record_directory_others_could_write_is_made_ours_before_a_record_goes_there(tmp_path: Path) -> None:
    """The orphan thaw ignores records in a directory others can write: a daemon that wrote its record there ran
    without its crash safety net."""
    directory = tmp_path / "governed"
    directory.mkdir(mode=0o755)
    directory.chmod(0o777)
    mount = hierarchy(tmp_path)
    frozen_cgroup(mount, "/pods/p1")
    record = GovernedRecord(directory, "unisched")
    record.note("/pods/p1")
    record.close(keep=True)  # a crash
    assert directory.stat().st_mode & 0o022 == 0
    assert thaw_orphans([directory], [("v2", mount)]).thawed == ("/pods/p1",)
