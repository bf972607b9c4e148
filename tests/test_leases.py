"""Lease enforcement's lease logic in the scheduler between cooperative clients: fake cgroups, fake lease channels,
an injected clock."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from leaserig import SLICE, Coop, LeaseRig, busy_rig, recording
from structlog.testing import capture_logs

from unisched.enforce.leases import LeaseGrant, LeaseRevoke
from unisched.policy import Engine
from unisched.policy.callers import Pod
from unisched.policy.leases import OverrunMeter
from unisched.scheduler import lease_calls
from unisched.scheduler.core import RegisterAsk, SchedulerError
from unisched.telemetry import FakeTelemetry, GpuInfo


def test_a_lone_cooperative_tenant_is_granted_at_once_and_uncontended(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a = rig.coop("a", 100)
    a.rig.engine.lease_want(a.sid, "compute")
    (grant,) = a.channel.take()
    assert isinstance(grant, LeaseGrant) and not grant.contended
    snap = rig.engine.snapshot("a")
    assert snap.cooperative and snap.state == "running"


def test_two_cooperative_tenants_at_3_to_1_get_leases_3_to_1(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 300), rig.coop("b", 100)
    a.want()
    b.want()
    rig.run(800, [a, b])
    assert 2.85 < a.used / b.used < 3.15
    assert a.used + b.used == pytest.approx(800 * SLICE, rel=0.01)  # one holder at a time, no idle slice
    assert rig.engine.snapshot("a").overrun_s == 0.0


def turn_lengths(holders: list[str]) -> list[int]:
    """Slices per turn, the first and last (cut by the window) left out."""
    runs: list[int] = []
    for i, h in enumerate(holders):
        if i and h == holders[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs[1:-1]


@pytest.mark.parametrize(("unit_s", "max_run_ms", "shortest"), [(0.025, 500.0, 4), (0.05, 500.0, 8), (0.05, 300.0, 6),
                                                                 (0.025, 0.0, 1), (0.005, 500.0, 1)])
def test_long_units_earn_turns_of_several_units(tmp_path: Path, unit_s: float, max_run_ms: float, shortest: int) -> None:
    """8 units of 25 ms a turn: 200 ms, 4 slices of 50 ms; of 50 ms: 400 ms; capped at 300 ms: 6 slices. 5 ms
    units (40 ms < a slice) and a cap of 0 leave the 3:1 pair's turns of one slice for the low weight."""
    rig = LeaseRig(tmp_path, lease_max_run_ms=max_run_ms)
    a, b = rig.coop("a", 300), rig.coop("b", 100)
    a.want()
    b.want()
    rig.run(40, [a, b], unit_s=unit_s)  # the unit estimate settles
    a.used = b.used = 0.0
    turns = turn_lengths(rig.run(1200, [a, b], unit_s=unit_s))
    assert min(turns) == shortest, turns
    assert 2.8 < a.used / b.used < 3.2
    snap = rig.engine.snapshot("b")  # what `unisched tenants --json` shows as unit_ms and turn_ms
    if shortest > 1:
        assert snap.unit_s == pytest.approx(unit_s, rel=0.2)
        assert snap.turn_s == pytest.approx(min(max_run_ms / 1000, 8 * unit_s), rel=0.2)
    else:
        assert snap.turn_s == 0.0


def test_the_turns_log_follows_the_unit_down_from_a_slow_first_step(tmp_path: Path) -> None:
    """On the H200 a b128 trainer's first step took 640 ms (cuDNN autotuning), then 30 ms; the mean fell in steps under
    25% each and the log kept saying 500 ms turns while the daemon gave 240 (bench/results/2026-12-01-h200-f)."""
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 300), rig.coop("b", 100)
    a.want()
    b.want()
    with capture_logs() as logs:
        a.report(0.64, units=1)
        rig.run(200, [a, b], unit_s=0.03)
    runs = [e["min_run_ms"] for e in logs if e["event"] == "lease turns" and e["tenant"] == "a"]
    given = rig.engine.leases.min_run_s("a") * 1000  # ~200: the rig's reports count 2 units of 25 ms a slice
    assert runs[0] == pytest.approx(500.0) and given < 300, (runs, given)
    assert abs(runs[-1] - given) <= 0.25 * max(runs[-1], given), (runs, given)  # the log is never more than 25% off


def test_parts_of_a_step_reported_apart_count_as_one_step(tmp_path: Path) -> None:
    """A client with pause points reports a 30 ms step as parts (0 units) and its end (1 unit), often in different
    reports: the daemon learns 30 ms steps, not the last part's length."""
    rig = LeaseRig(tmp_path)
    a = rig.coop("a", 100)
    a.want()
    for _ in range(40):
        a.report(0.01, units=0)
        a.report(0.01, units=0)
        a.report(0.01, units=1)
    assert rig.engine.leases.unit_s("a") == pytest.approx(0.03)


def test_long_frames_earn_no_long_turns(tmp_path: Path) -> None:
    """Two renders time-slice at no loss: longer turns would only stall each one's frames for longer. Their frames'
    length is still learnt (the `beside` rule reads it beside a freezer-governed render)."""
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 300, "graphics"), rig.coop("b", 100, "graphics")
    a.want()
    b.want()
    rig.run(40, [a, b], unit_s=0.028)
    assert rig.engine.snapshot("b").turn_s == 0.0
    assert rig.engine.leases.unit_s("b") == pytest.approx(0.028, rel=0.2)
    assert min(turn_lengths(rig.run(400, [a, b], unit_s=0.028))) == 1


def test_a_long_turn_is_granted_as_one_slice_and_cleared_with_the_session(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 100), rig.coop("b", 100)
    a.want()
    b.want()
    rig.run(40, [a, b], unit_s=0.025)
    a.grants.clear()
    b.grants.clear()
    rig.run(40, [a, b], unit_s=0.025)
    # a client may start units until the decision that can end its turn (200 ms on), not only until the next tick
    firsts = [g.slice_left_s for g in a.grants + b.grants if g.slice_left_s > SLICE + 1e-6]
    assert firsts and max(firsts) == pytest.approx(0.2)  # then 0.15, 0.1 as the turn goes on
    assert max(rig.engine.policy.min_run_left(n, rig.clock.monotonic()) for n in "ab") > 0
    rig.engine.lease_close(a.sid)
    rig.engine.lease_close(b.sid)
    assert rig.engine.leases.unit_s("a") is None
    assert rig.engine.policy.min_run_left("a", rig.clock.monotonic()) == 0.0


@pytest.mark.parametrize(("late_s", "unit_s"), [(0.0, 0.025), (0.0035, 0.0265), (0.0035, 0.025), (0.012, 0.0265)])
def test_a_holder_is_never_revoked_before_the_end_it_was_told(tmp_path: Path, late_s: float, unit_s: float) -> None:
    """A grant or renewal tells the holder until when it may start units (`slice_left_s`), and a contended client
    queues its next unit by it. The daemon's ticks come late (its own work, the event loop: ~3.5 ms a tick on the
    H200), so a tick due before the minimum run ends can land after it and end the turn: told one tick more, the client
    queued a 50 ms step that then ran whole beside the next holder. (Units of 26.5 ms: minimum runs of 212 ms, which
    end just after a tick due on the 50 ms grid.)"""
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 300), rig.coop("b", 100)
    a.want()
    b.want()
    told: dict[str, float] = {}
    checked = 0
    for _ in range(300):
        seen = {c.name: (len(c.grants), len(c.revokes)) for c in (a, b)}
        delay = rig.tick()
        now = rig.clock.monotonic()
        for c in (a, b):
            grants, revokes = seen[c.name]
            if len(c.revokes) > revokes and c.name in told:
                assert now >= told[c.name] - 1e-9, (c.name, now, told[c.name])
                checked += 1
            if len(c.grants) > grants:
                told[c.name] = now + c.grants[-1].slice_left_s
        rig.clock.advance(delay + late_s)
        for c in (a, b):
            c.report(2 * unit_s if c.held else 0.0, units=2 if c.held else 0)  # turns of 8 units
    assert checked > 20 and rig.engine.policy.min_run_left("a", rig.clock.monotonic()) >= 0


def test_negative_units_are_refused(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a = rig.coop("a", 100)
    a.want()
    with pytest.raises(SchedulerError, match="units"):
        rig.engine.lease_report(a.sid, "compute", 0.01, False, units=-1)


@pytest.mark.parametrize("ago", [-0.001, float("nan"), float("inf"), 61.0])
def test_a_report_whose_work_ended_at_no_real_time_is_refused(tmp_path: Path, ago: float) -> None:
    rig = LeaseRig(tmp_path)
    a = rig.coop("a", 100)
    a.want()
    with pytest.raises(SchedulerError, match="ended_ago_s"):
        rig.engine.lease_report(a.sid, "compute", 0.01, False, units=1, ended_ago_s=ago)


def test_the_holder_hears_it_is_contended_when_another_wants(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 100), rig.coop("b", 100)
    a.want()
    a.report(0.01)
    b.rig.engine.lease_want(b.sid, "compute")
    msgs = a.channel.take()
    grants = [m for m in msgs if isinstance(m, LeaseGrant)]
    revokes = [m for m in msgs if isinstance(m, LeaseRevoke)]
    # either a keeps the slice and is told to stop at its end, or b (no usage yet) takes over at once
    assert (grants and grants[-1].contended) or revokes


def test_a_release_hands_the_engine_on_without_waiting_for_a_tick(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 100), rig.coop("b", 100)
    a.want()
    b.want()
    holder, other = (a, b) if a.held else (b, a)
    assert holder.held and not other.held
    holder.report(0.02, release=True)
    other.pump()
    assert other.held and not holder.held


def test_a_holder_that_stops_renewing_is_revoked_and_the_other_runs(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path, lease_timeout_ms=200.0)
    a, b = rig.coop("a", 100), rig.coop("b", 100)
    a.want()
    b.want()
    rig.run(10, [a, b])
    rig.run(12, [b])  # a goes silent (hung): 12 slices = 600 ms > 200 ms
    assert any("not renewed" in r.reason for r in a.revokes)
    before = b.used
    rig.run(20, [b])
    assert b.used - before == pytest.approx(20 * SLICE)  # b alone now holds every slice
    assert rig.engine.snapshot("a").state == "idle"


def overrun(rig: LeaseRig, good: Coop, bad: Coop, slices: int = 60) -> None:
    """Both want the GPU; `good` uses only the slices it holds, `bad` ignores revocations and uses every slice."""
    bad.yields = False
    good.want()
    bad.want()
    for _ in range(slices):
        delay = rig.tick()
        rig.clock.advance(delay)
        good.report(delay if good.held else 0.0)
        bad.report(delay)


def test_overrun_is_charged_and_a_repeat_overrunner_is_frozen_outside_its_leases(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    good, bad = rig.coop("good", 100), rig.coop("bad", 100)
    overrun(rig, good, bad)
    snap = rig.engine.snapshot("bad")
    assert snap.overrun_s > 0.2
    assert snap.enforced
    # charged in full: the policy now holds the overrunner back (the good one gets most slices)
    assert rig.engine.snapshot("good").overrun_s == 0.0
    frozen_when_waiting = []
    for _ in range(20):
        rig.tick()
        rig.clock.advance(SLICE)
        frozen_when_waiting.append(rig.driver.groups["/unisched/bad"].frozen == (not bad.held))
        good.report(SLICE if good.held else 0.0)
        bad.report(SLICE if bad.held else 0.0)
    assert all(frozen_when_waiting)
    assert not rig.engine.snapshot("good").enforced


def test_a_user_whose_leases_overran_stays_enforced_in_a_tenant_made_again(tmp_path: Path) -> None:
    """Removing the overrunning tenant and making it again, under its name or another, must not wipe the record:
    the freezer backs the leases of every tenant that user has or opens a session in. Another user's are not."""
    rig = LeaseRig(tmp_path)
    good, bad = rig.coop("good", 100, uid=1001), rig.coop("bad", 100, uid=1000)
    also = rig.coop("bad-also", 100, uid=1000)  # the same user's session in a tenant of its own, open meanwhile
    overrun(rig, good, bad)
    assert rig.engine.snapshot("bad").enforced and not rig.engine.snapshot("good").enforced
    assert rig.engine.snapshot("bad-also").enforced and also.sid  # at once, not after strikes of its own
    rig.engine.remove("bad")
    again, renamed = rig.coop("bad", 100, uid=1000), rig.coop("bad-2", 100, uid=1000)
    other = rig.coop("other", 100, uid=1002)
    assert rig.engine.snapshot("bad").enforced and rig.engine.snapshot("bad-2").enforced
    assert not rig.engine.snapshot("other").enforced and not rig.engine.snapshot("good").enforced
    assert again.sid and renamed.sid and other.sid


def test_a_pod_s_overrun_record_is_its_pod_s_not_that_of_the_host_uid_it_runs_as(tmp_path: Path) -> None:
    """uid 1000 in a pod is not the host's uid 1000: a pod whose sessions overran has the freezer back the leases of
    the tenants it opens sessions in later, and the host user of that uid keeps a clean record (and the other way
    round)."""
    rig = LeaseRig(tmp_path)
    good, bad = rig.coop("good", 100, uid=1001), rig.coop("pod", 100, uid=1000, caller=Pod(7))
    host = rig.coop("host", 100, uid=1000)  # the host user of the same uid, its session open meanwhile
    overrun(rig, good, bad)
    assert rig.engine.snapshot("pod").enforced
    assert not rig.engine.snapshot("host").enforced and host.sid
    again, later = rig.coop("pod-2", 100, uid=1000, caller=Pod(7)), rig.coop("host-2", 100, uid=1000)
    assert rig.engine.snapshot("pod-2").enforced and again.sid
    assert not rig.engine.snapshot("host-2").enforced and later.sid


def test_a_pod_s_overrun_record_ends_with_its_last_session(tmp_path: Path) -> None:
    """A pod is keyed by its pid namespace's inode, which the kernel gives the next pod once it is gone: a record kept
    after the pod's last session ended would enforce an unrelated pod. While one of its sessions is open the record
    holds; its tenants stay enforced after."""
    rig = LeaseRig(tmp_path)
    good, bad = rig.coop("good", 100, uid=1001), rig.coop("pod", 100, uid=1000, caller=Pod(7))
    still = rig.coop("pod-b", 100, uid=1000, caller=Pod(7))
    overrun(rig, good, bad)
    rig.engine.lease_close(bad.sid)
    assert rig.engine.snapshot("pod-b").enforced  # the pod has a session left: its record holds
    rig.engine.lease_close(still.sid)
    assert rig.engine.snapshot("pod").enforced  # its tenants stay enforced
    later = rig.coop("next-pod", 100, uid=1000, caller=Pod(7))  # the same inode, another pod
    assert later.sid and not rig.engine.snapshot("next-pod").enforced


@pytest.mark.parametrize(("share", "gap_s", "turn_s"), [(0.01, 0.0, 0.0), (0.01, 0.0015, 0.15), (0.01, 0.02, 0.5),
                                                      (0.0, 0.02, 0.0)])
def test_turns_between_clients_grow_with_the_measured_hand_over_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    share: float, gap_s: float, turn_s: float) -> None:
    """Short units, and each holder's first work starts `gap_s` after the yield before it: turns long enough for
    the gap to cost Tuning.handover_share (here 1%) of them, at most lease_max_run_ms (500), none under two slices;
    with the share at 0 (the default) the gap is measured but sizes no turn."""
    import dataclasses

    from unisched.policy.tuning import TUNING
    from unisched.scheduler import turns

    monkeypatch.setattr(turns, "TUNING", dataclasses.replace(TUNING, handover_share=share))
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 100), rig.coop("b", 100)
    a.want()
    b.want()
    for _ in range(200):
        delay = rig.tick()
        rig.clock.advance(delay)
        for c in (a, b):
            if c.held:  # started gap_s after its grant (the hand-over's), short units
                c.report(delay - (gap_s if len(c.grants) > 1 and c.grants[-1] is not None else 0.0), units=20)
            else:
                c.report(0.0)
    assert rig.engine.leases.min_run_s("a") == pytest.approx(turn_s, rel=0.05)
    if gap_s:
        assert rig.engine.leases.handover_gap_s(rig.engine.leases.resource(0, Engine.COMPUTE)) == \
            pytest.approx(gap_s, rel=0.05)


def test_closing_the_session_drops_demand_and_frees_codec_sessions(tmp_path: Path) -> None:
    gpu = GpuInfo(0, "NVIDIA H200", "GPU-x", 141 << 30)
    rig = LeaseRig(tmp_path, telemetry=FakeTelemetry([gpu]))
    a = rig.coop("a", 100, engine="decode")
    assert rig.engine.lease_codec(a.sid, "nvdec", True) == (True, "")
    ok, why = rig.engine.lease_codec(a.sid, "nvenc", True)
    assert not ok and "no NVENC" in why
    a.want()
    assert rig.engine.snapshot("a").sessions == {"nvdec": 1}
    rig.engine.lease_close(a.sid)
    snap = rig.engine.snapshot("a")
    assert snap.sessions == {"nvdec": 0} and not snap.cooperative and snap.state == "idle"


def test_decode_cap_refuses_a_codec_session_beyond_it(tmp_path: Path) -> None:
    gpu = GpuInfo(0, "NVIDIA H200", "GPU-x", 141 << 30)
    rig = LeaseRig(tmp_path, telemetry=FakeTelemetry([gpu]))
    a = rig.coop("a", 100, engine="decode")
    rig.engine.set_limits("a", None, 1, None, None)
    assert rig.engine.lease_codec(a.sid, "nvdec", True)[0]
    ok, why = rig.engine.lease_codec(a.sid, "nvdec", True)
    assert not ok and "nvdec cap 1" in why
    assert rig.engine.lease_codec(a.sid, "nvdec", False) == (True, "")
    assert rig.engine.lease_codec(a.sid, "nvdec", True)[0]


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf, 61.0])
def test_bad_reports_are_refused(tmp_path: Path, seconds: float) -> None:
    rig = LeaseRig(tmp_path)
    a = rig.coop("a", 100)
    with pytest.raises(SchedulerError, match="gpu_seconds"):
        rig.engine.lease_report(a.sid, "compute", seconds, False)


def test_bad_engine_unknown_session_and_removed_tenant(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a = rig.coop("a", 100)
    with pytest.raises(SchedulerError, match="engine must be one of"):
        rig.engine.lease_want(a.sid, "warp-drive")
    with pytest.raises(SchedulerError, match="no lease session"):
        rig.engine.lease_want(999, "compute")
    with pytest.raises(SchedulerError, match="codec session kind"):
        rig.engine.lease_codec(a.sid, "nvjpg", True)
    a.want()
    rig.engine.remove("a")
    assert any(r.reason == "tenant removed" for r in a.channel.take() if isinstance(r, LeaseRevoke))
    with pytest.raises(SchedulerError):
        rig.engine.lease_want(a.sid, "compute")


def test_overrun_meter_counts_strikes_only_beyond_slack() -> None:
    m = OverrunMeter(window_s=0.2, slack_s=0.05, strikes_to_enforce=2)
    m.hold(0.0)
    assert m.report(0.1, 0.1) is None
    v = m.report(0.1, 0.2)  # 0.2 used in 0.2 held: fine
    assert v is not None and v.overrun_s == 0 and v.strikes == 0
    m.drop(0.2)
    v = m.report(0.3, 0.4)  # 0.3 used, 0 held
    assert v is not None and v.overrun_s == pytest.approx(0.25) and not v.enforce
    v = m.report(0.3, 0.65)
    assert v is not None and v.enforce and m.overrun_total_s == pytest.approx(0.5)


def test_a_report_that_lands_in_the_next_window_is_not_an_overrun() -> None:
    """Work done late in one window and reported in the next: the first window under-reports, the second
    over-reports. On a loaded 2-core machine that jitter struck honest clients; the held time left unused carries
    over (one window at most), and a steady overrunner is still enforced."""
    m = OverrunMeter(window_s=1.0, slack_s=0.25, strikes_to_enforce=2)  # (units: windows, exact in binary)
    m.hold(0.0)
    v = m.report(0.5, 1.0)  # half the window's work reported in time, the rest comes late
    assert v is not None and v.overrun_s == 0
    v = m.report(1.5, 2.0)  # this window's 1.0 plus the late 0.5: 0.25 beyond slack without the carry
    assert v is not None and v.overrun_s == 0 and v.strikes == 0
    for end in (3.0, 4.0):  # now it really runs 2x its lease: the credit is gone after one window
        v = m.report(2.0, end)
    assert v is not None and v.enforce


def test_a_waiting_tenant_need_not_renew_only_holders_must(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path, lease_timeout_ms=100.0)
    a, b = rig.coop("a", 10000), rig.coop("b", 1)
    a.want()
    b.want()
    for _ in range(40):  # 2 s; b renews only while it holds the lease, as the client library does
        delay = rig.tick()
        rig.clock.advance(delay)
        a.report(delay if a.held else 0.0)
        if b.held:
            b.report(delay)
    assert rig.engine.snapshot("b").state in ("waiting", "running")  # still wants the GPU
    assert not any("not renewed" in r.reason for r in b.revokes)


def test_the_next_holder_is_granted_when_the_revoked_one_yields_or_a_slice_later(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a, b = rig.coop("a", 100), rig.coop("b", 100)
    a.yields = b.yields = False
    a.want()
    b.want()
    holder, other = (a, b) if a.held else (b, a)
    for _ in range(40):  # run until the engine switches holders at a tick
        holder.report(SLICE)
        rig.clock.advance(SLICE)
        rig.tick()
        if not holder.held:
            break
    assert not holder.held and not other.held  # revoked, and the other waits for the yield
    rig.engine.lease_report(holder.sid, holder.engine, 0.004, False, yielded=True)
    other.pump()
    assert other.held  # granted at once on the yield, not at the next tick
    # a holder that never yields delays the next one by at most a slice
    for _ in range(40):
        other.report(SLICE)
        rig.clock.advance(SLICE)
        rig.tick()
        if not other.held:
            break
    assert not other.held and not holder.held
    rig.clock.advance(SLICE)
    rig.tick()
    assert holder.held


def test_closing_a_waiters_session_decides_nothing_closing_the_holders_hands_over(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a, b, c = rig.coop("a", 100), rig.coop("b", 100), rig.coop("c", 100)
    for x in (a, b, c):
        x.want()
    holder = next(x for x in (a, b, c) if x.held)
    waiters = [x for x in (a, b, c) if x is not holder]
    decisions: list[float] = []
    rig.engine.policy.decide = recording(rig.engine.policy.decide, decisions)  # type: ignore[method-assign, assignment]
    rig.engine.lease_close(waiters[0].sid)
    assert decisions == []  # a waiter leaving changes no holder
    rig.engine.lease_close(holder.sid)
    waiters[1].pump()
    assert len(decisions) == 1 and waiters[1].held  # the holder leaving hands the GPU on at once


@pytest.mark.parametrize(("weights", "both"), [((100, 100), 0.64), ((300, 100), 0.32)])
def test_cooperative_compute_and_graphics_that_overlap_partly_get_mixed_leases(
        tmp_path: Path, weights: tuple[int, int], both: float) -> None:
    """As freezer-governed tenants do (policy.overlap): both leases held together part of the time, the trainer's alone for
    the rest, so the trainer gets its weight share and the pair keeps most of the overlap. Side by side, the
    trainer would keep 22% whatever its weight; leases sliced against each other would keep no overlap."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "contention.json").write_text(json.dumps(
        {"version": 1, "gpus": {"NVIDIA H200": {"compute_kept": 0.22, "graphics_kept": 0.92}}}))
    rig = LeaseRig(tmp_path, telemetry=FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 141 << 30)]))
    assert rig.engine.contention.kept == (0.22, 0.92)
    cuda, render = rig.coop("cuda", weights[0], "compute"), rig.coop("render", weights[1], "graphics")
    cuda.want()
    render.want()
    rig.run(40, [cuda, render])
    held = {"cuda": 0, "render": 0, "both": 0}
    for _ in range(400):
        rig.run(1, [cuda, render])
        held["cuda"] += cuda.held
        held["render"] += render.held
        held["both"] += cuda.held and render.held
    assert held["both"] / 400 == pytest.approx(both, abs=0.04)
    assert held["render"] == held["both"]  # the render never needs time alone at these weights
    share = weights[0] / sum(weights)
    assert 0.22 * held["both"] / 400 + (held["cuda"] - held["both"]) / 400 >= share - 0.02
    assert any(r.reason == "slice over" for r in render.revokes)
    # each side is revoked when it sits out: contended, so a paused render leaves one frame in flight, not two
    assert render.grants[-1].contended and cuda.grants[-1].contended


def test_no_decision_is_made_after_shutdown(tmp_path: Path) -> None:
    """The engine thaws everything when it shuts down, but lease requests still come until the sockets close, and a
    decision folded into a loop turn's end may be pending: a decision then could freeze a tenant again and leave it
    frozen, so none is made."""
    rig = busy_rig(tmp_path)
    pending: list[Callable[[], None]] = []
    rig.engine.fold_decisions(pending.append)
    clients = [rig.coop(f"c{i}", 100) for i in range(6)]
    rig.unmodified("kern", 100)
    decided: list[float] = []
    rig.engine.policy.decide = recording(rig.engine.policy.decide, decided)  # type: ignore[method-assign, assignment]
    for c in clients:
        c.want()
    assert len(decided) == 4 and pending  # the rest folded into the turn's end
    rig.engine.shutdown()
    assert not any(g.frozen for g in rig.driver.groups.values())
    decided.clear()
    for run in pending:
        run()  # the turn ends
    for c in clients:
        c.report(0.0, release=True)
        c.want()
    assert decided == []
    assert not any(g.frozen for g in rig.driver.groups.values())


def test_a_renewal_that_changes_no_want_recomputes_no_demand_one_that_does_still_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewal is the daemon's most frequent request, and one that wants what it wanted leaves the demand as it
    was: it is not rebuilt for each. A report that wants again (after a release, or after its want expired) or
    releases still changes the demand, and the holders follow."""
    rig = LeaseRig(tmp_path, lease_timeout_ms=100.0)
    a, b = rig.coop("a", 100), rig.coop("b", 100)
    a.want()
    b.want()
    book = rig.engine.leases
    refreshed: list[str] = []
    refresh = book._refresh_demand
    monkeypatch.setattr(book, "_refresh_demand", lambda tenant, *rest, **kw: refreshed.append(tenant)
                        or refresh(tenant, *rest, **kw))
    rig.run(20, [a, b])
    assert refreshed == [] and book.demand("a") and book.demand("b")
    holder, other = (a, b) if a.held else (b, a)
    holder.report(0.01, release=True)  # released: its demand goes, and the other holds at once
    other.pump()
    assert not book.demand(holder.name) and other.held and refreshed == [holder.name]
    holder.report(0.0)  # a renewal after the release wants the engine again
    assert book.demand(holder.name) and refreshed == [holder.name] * 2
    rig.run(12, [other])  # the holder goes silent past valid_s: its want expires and its lease is revoked
    silent = a if any("not renewed" in r.reason for r in a.revokes) else b
    assert not book.demand(silent.name)
    refreshed.clear()
    silent.report(0.0)  # renewing again: its demand is back, and it gets its turn
    assert book.demand(silent.name) and refreshed == [silent.name]
    assert silent.name in rig.run(10, [a, b])


def test_a_member_may_not_open_a_lease_on_a_gpu_its_tenant_is_not_bound_to(tmp_path: Path) -> None:
    """A process in a pod's tenant (bound to GPU 0) saying hello for GPU 1 would contend a GPU its tenant is weighted
    on nowhere (and cannot open: device admission); only the owner or an admin moves a tenant."""
    from unisched.enforce.leases import FakeLeaseChannel

    rig = LeaseRig(tmp_path, telemetry=FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-0", 141 << 30),
                                                      GpuInfo(1, "NVIDIA H200", "GPU-1", 141 << 30)]))
    rig.engine.register("t", 100, None, ["compute"], (0,), 6001, 1000, False)
    rig.driver.attach("/unisched/t", 6002)  # a member: a process of the tenant, another uid's
    with pytest.raises(SchedulerError, match=r"bound to GPUs \[0\]; only its owner or an admin may move it to GPU 1"):
        rig.engine.lease_open("t", None, None, ["compute"], 1, 6002, 2000, False, FakeLeaseChannel())
    rig.engine.lease_open("t", None, None, ["compute"], 0, 6002, 2000, False, FakeLeaseChannel())  # its own GPU
    rig.driver.attach("/unisched/t", 6003)  # a member in a container, running as the owner's uid: it owns nothing
    in_pod = RegisterAsk("t", None, None, ("compute",), (), 6003, 1000, False, contained=True, caller=Pod(7))
    with pytest.raises(SchedulerError, match=r"bound to GPUs \[0\]; only its owner or an admin may move it to GPU 1"):
        lease_calls.lease_open(rig.engine._c, in_pod, 1, FakeLeaseChannel())
    rig.engine.lease_open("t", None, None, ["compute"], 1, 6001, 1000, False, FakeLeaseChannel())  # the owner moves it
    assert {r.gpu for s in rig.engine.snapshot("t").shares for r in (s.resource,)} == {1}


def test_with_user_leases_off_only_admins_open_lease_sessions(tmp_path: Path) -> None:
    """A client's GPU time is what it reports: where every app must be held to its weight, the lease socket is an
    admin's, and a user's app runs under the freezer."""
    from unisched.enforce.leases import FakeLeaseChannel

    rig = LeaseRig(tmp_path, user_leases=False)
    with pytest.raises(SchedulerError, match=r"only admins may open lease sessions on this daemon \(user_leases = "):
        rig.engine.lease_open("mine", 100, None, ["compute"], 0, 6001, 1000, False, FakeLeaseChannel())
    assert not rig.engine.has_tenant("mine")
    rig.engine.lease_open("ops", 100, None, ["compute"], 0, 6002, 0, True, FakeLeaseChannel())
