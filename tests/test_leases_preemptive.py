"""Preemptive mode: an online client's want does not wait for an offline holder's tail; the overlap is charged
once, half to each. Fake cgroups, fake lease channels, an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from leaserig import SLICE, Coop, LeaseRig, recording

from unisched.policy import Mode, Priority

ONLINE, OFFLINE = Priority.ONLINE, Priority.OFFLINE


def charged(rig: LeaseRig, name: str) -> float:
    (st,) = rig.engine.policy.stats(rig.clock.monotonic(), [name])
    return st.gpu_seconds


def online_offline(tmp: Path) -> tuple[LeaseRig, Coop, Coop]:
    """A trainer holding the GPU with units in flight (it yields only when told to), and an online tenant."""
    rig = LeaseRig(tmp, mode=Mode.PREEMPTIVE)
    train, infer = rig.coop("train", 100, priority=OFFLINE), rig.coop("infer", 100, priority=ONLINE)
    train.yields = False
    train.want()
    train.report(0.03)
    assert train.held
    return rig, train, infer


@pytest.mark.parametrize(("mode", "online_session", "contended"), [
    (Mode.PREEMPTIVE, True, True), (Mode.PREEMPTIVE, False, False), (Mode.SHARED, True, False)])
def test_an_offline_holder_an_online_client_may_preempt_is_told_it_is_contended(
        tmp_path: Path, mode: Mode, online_session: bool, contended: bool) -> None:
    """So it keeps one unit in flight: at a preemption its queued units run beside the online request."""
    rig = LeaseRig(tmp_path, mode=mode)
    train = rig.coop("train", 100, priority=OFFLINE)
    if online_session:
        rig.coop("infer", 100, priority=ONLINE)  # registered, idle between requests
    train.want()
    rig.tick()
    assert train.held and train.grants[-1].contended is contended


def test_preemptive_an_online_want_is_granted_at_once_beside_the_revoked_offline_holder(tmp_path: Path) -> None:
    rig, train, infer = online_offline(tmp_path)
    infer.want()  # no tick, no yield from the trainer
    train.pump()
    assert infer.held
    assert not train.held and [r.reason for r in train.revokes] == ["slice over"]  # it starts no new unit
    assert rig.engine.snapshot("infer").state == "running"


@pytest.mark.parametrize(("mode", "priority", "second_online", "jump"), [
    (Mode.PREEMPTIVE, ONLINE, False, True),  # its wants are granted at once: it may start as it asks
    (Mode.PREEMPTIVE, ONLINE, True, False),  # another online tenant may hold: it must wait for its grant
    (Mode.PREEMPTIVE, OFFLINE, False, False),
    (Mode.SHARED, ONLINE, False, False),
])
def test_grants_tell_an_online_tenant_alone_in_its_class_in_preemptive_mode_it_may_jump(
        tmp_path: Path, mode: Mode, priority: Priority, second_online: bool, jump: bool) -> None:
    rig = LeaseRig(tmp_path, mode=mode)
    a = rig.coop("a", 100, priority=priority)
    if second_online:
        rig.coop("b", 100, priority=ONLINE)  # registered, idle
    a.want()
    assert a.held and [g.jump for g in a.grants] == [jump]


def test_a_jumping_tenant_hears_at_the_next_tick_that_another_online_tenant_arrived(tmp_path: Path) -> None:
    """The flag follows the tenants: the holder's next grant (the next tick's) says it may no longer jump."""
    rig = LeaseRig(tmp_path, mode=Mode.PREEMPTIVE)
    a = rig.coop("a", 100, priority=ONLINE)
    a.want()
    assert a.grants[-1].jump
    rig.coop("b", 100, priority=ONLINE)
    rig.tick()
    a.pump()
    assert a.held and not a.grants[-1].jump


def test_preemptive_online_release_regrants_the_offline_tenant_in_the_same_reschedule(tmp_path: Path) -> None:
    rig, train, infer = online_offline(tmp_path)
    infer.want()
    train.pump()
    assert infer.held and not train.held  # the trainer's tail still runs: it has not yielded
    decisions: list[float] = []
    rig.engine.policy.decide = recording(rig.engine.policy.decide, decisions)  # type: ignore[method-assign, assignment]
    rig.clock.advance(0.005)
    infer.report(0.005, release=True)
    train.pump()
    assert train.held and len(decisions) == 1  # granted by the release's own decision: no tick, no slice wait
    # the trainer's tail finishing later changes nothing: it keeps the lease
    rig.engine.lease_report(train.sid, "compute", 0.02, False, yielded=True)
    train.pump()
    assert train.held and not infer.held


def test_a_yield_after_a_release_is_no_want(tmp_path: Path) -> None:
    """Older clients answered the revoke of their own release with a yield, which the daemon read as a
    renewal: the online tenant wanted the GPU again, was granted it with nobody using it, and the trainer
    was revoked until that lease expired. A yield on a released engine is not a want."""
    rig, train, infer = online_offline(tmp_path)
    infer.want()
    infer.report(0.005, release=True)
    assert [r.reason for r in infer.revokes] == ["released"]  # the release's own revoke
    rig.engine.lease_report(infer.sid, "compute", 0.0, False, yielded=True)  # an older client's answer to it
    train.pump()
    assert train.held and not infer.held
    assert rig.engine.snapshot("infer").state == "idle"
    infer.want()  # a want afterwards is one again
    assert infer.held


def test_the_overlap_is_charged_once_half_to_each(tmp_path: Path) -> None:
    rig, train, infer = online_offline(tmp_path)
    before = charged(rig, "train")
    infer.want()
    rig.clock.advance(0.004)
    # the trainer's last unit ends 4 ms into the online request: both timed those 4 ms
    rig.engine.lease_report(train.sid, "compute", 0.020, False, yielded=True)
    assert charged(rig, "train") - before == pytest.approx(0.020 - 0.002)
    rig.clock.advance(0.003)
    infer.report(0.007, release=True)
    assert charged(rig, "infer") == pytest.approx(0.007 - 0.002)


def test_an_overlap_ended_by_the_online_release_is_credited_on_later_reports(tmp_path: Path) -> None:
    rig, train, infer = online_offline(tmp_path)
    before = charged(rig, "train")
    infer.want()
    rig.clock.advance(0.006)
    infer.report(0.006, release=True)  # charged in full: the overlap ends with this release
    assert charged(rig, "infer") == pytest.approx(0.006)
    rig.engine.lease_report(train.sid, "compute", 0.025, False, yielded=True)
    assert charged(rig, "train") - before == pytest.approx(0.025 - 0.003)
    infer.want()
    infer.report(0.005, release=True)
    assert charged(rig, "infer") == pytest.approx(0.006 + 0.005 - 0.003)


def test_preemptive_online_requests_beside_a_trainer_never_wait_and_the_trainer_keeps_the_rest(tmp_path: Path) -> None:
    rig, train, infer = online_offline(tmp_path)
    for _ in range(50):  # 50 requests, each 5 ms of a 50 ms period, between the engine's ticks
        infer.want()
        train.pump()
        assert infer.held and not train.held
        rig.clock.advance(0.005)
        infer.report(0.005, release=True)
        train.pump()
        assert train.held and not infer.held
        rig.clock.advance(0.005)
        rig.engine.lease_report(train.sid, "compute", 0.010, False, yielded=True)  # its tail ends
        rig.clock.advance(0.040)
        train.report(0.040)
        if rig.clock.monotonic() >= rig.engine.next_tick:
            rig.tick()
    assert train.held
    assert not rig.engine.snapshot("train").enforced


def _holder_revoked_at_a_tick(rig: LeaseRig, holder: Coop) -> None:
    for _ in range(80):
        if not holder.held:
            return
        holder.report(SLICE)
        rig.clock.advance(SLICE)
        rig.tick()
    raise AssertionError("the holder was never revoked")


@pytest.mark.parametrize(("mode", "first", "second"), [
    (Mode.SHARED, OFFLINE, ONLINE),
    (Mode.TIMESHARE, OFFLINE, ONLINE),
    (Mode.PREEMPTIVE, ONLINE, ONLINE),
    (Mode.PREEMPTIVE, OFFLINE, OFFLINE),
    (Mode.PREEMPTIVE, ONLINE, OFFLINE),
])
def test_other_hand_overs_still_wait_for_the_yield(tmp_path: Path, mode: Mode, first: Priority, second: Priority) -> None:
    rig = LeaseRig(tmp_path, mode=mode)
    a, b = rig.coop("a", 100, priority=first), rig.coop("b", 100, priority=second)
    a.yields = b.yields = False
    a.want()
    a.report(0.01)
    b.want()
    if second is OFFLINE and first is ONLINE:  # b never outranks an online tenant: a stops wanting instead
        assert a.held and not b.held
        a.report(0.01, release=True)
        b.pump()
        assert b.held  # released (not revoked): nothing to wait for
        return
    _holder_revoked_at_a_tick(rig, a)
    assert not a.held and not b.held  # b waits for a's last unit
    rig.engine.lease_report(a.sid, "compute", 0.004, False, yielded=True)
    b.pump()
    assert b.held
