"""Cooperative clients beside freezer-governed (unmodified) tenants: shares by weight, and who is charged for the
work in flight when one side hands over to the other. Fake cgroups, fake lease channels, an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from leaserig import Coop, LeaseRig, busy_rig

from unisched.enforce.cgroups import _FakeGroup


def test_cooperative_and_kernel_tenants_share_by_weight(tmp_path: Path) -> None:
    rig = LeaseRig(tmp_path)
    a = rig.coop("coop", 100)
    a.want()
    rig.pid += 1
    rig.engine.register("kern", 100, None, (), (), rig.pid, 0, True)
    kern_cpu = 0.0
    for _ in range(400):
        delay = rig.tick()
        g = rig.driver.groups["/unisched/kern"]
        if not g.frozen:
            g.cpu_s += delay
            kern_cpu += delay
        rig.clock.advance(delay)
        a.report(delay if a.held else 0.0)
    assert 0.9 < a.used / kern_cpu < 1.1
    assert not rig.driver.groups["/unisched/coop"].frozen  # leases gate it, not the freezer


def client_beside_kernel(tmp: Path, coop_w: int, kern_w: int, yields: bool = True) -> tuple[LeaseRig, Coop, _FakeGroup]:
    """A GPU that reads busy whoever runs, a client "coop" (yielding at a revoke on its own when `yields`) that
    wants it, and a freezer-governed tenant "kern" beside it, with kern's cgroup."""
    rig = busy_rig(tmp)
    c = rig.coop("coop", coop_w)
    c.yields = yields
    c.want()
    rig.unmodified("kern", kern_w)
    return rig, c, rig.driver.groups["/unisched/kern"]


FREEZE_TAIL_S = 0.002


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize(("coop_w", "kern_w"), [(100, 100), (300, 100), (100, 300)])
def test_a_client_beside_a_kernel_tenant_gets_its_weight_with_a_gpu_signal(tmp_path: Path, coop_w: int,
                                                                           kern_w: int, late: bool) -> None:
    """The GPU reads busy whoever runs. The freezer-governed tenant is charged the busy time of the intervals it ran in,
    and it also ran (a few ms) in each interval its freeze came late in, while the client held the GPU: charged
    that interval's whole busy time, it paid about twice its use and got a third of the GPU at 1:1. `late`: the
    client's reports arrive half a slice after its work (with its next renewal), in the next interval."""
    rig, c, g = client_beside_kernel(tmp_path, coop_w, kern_w)
    kern_s = owed = 0.0
    for _ in range(1200):
        was_frozen = g.frozen
        delay = rig.tick()
        if not g.frozen:  # ran the interval
            g.cpu_s += delay
            kern_s += delay
        elif not was_frozen:  # frozen now: its freeze lands a little late
            g.cpu_s += FREEZE_TAIL_S
        used = delay if c.held else 0.0
        if late:
            rig.clock.advance(delay / 2)
            c.report(owed)
            rig.clock.advance(delay / 2)
            owed = used
        else:
            rig.clock.advance(delay)
            c.report(used)
    share = c.used / (c.used + kern_s)
    assert share == pytest.approx(coop_w / (coop_w + kern_w), abs=0.02), (c.used, kern_s)


TAIL_S, TAIL_UNIT_S = 0.02, 0.010


def _share_beside_a_revoked_tail(tmp: Path, coop_w: int, kern_w: int, after_yield: bool) -> float:
    """The client's share of the work done when, at each revoke, its step in flight (TAIL_S on its timer) runs on
    beside the freezer-governed tenant thawed for its turn, each doing half of that overlap. Reported with the yield
    (`after_yield` False), or after a yield at once, as one unit (TAIL_UNIT_S steps: its held reports count them)."""
    rig, c, g = client_beside_kernel(tmp, coop_w, kern_w, yields=False)  # it yields itself
    coop_work = kern_work = 0.0
    for _ in range(1200):
        was_held = c.held
        delay = rig.tick()
        c.pump()
        if was_held and not c.held:  # revoked: its step runs on beside the thawed tenant
            g.cpu_s += delay
            coop_work += TAIL_S / 2
            kern_work += delay - TAIL_S / 2
            if after_yield:
                rig.engine.lease_report(c.sid, "compute", 0.0, False, yielded=True)
                c.pump()
                rig.clock.advance(TAIL_S)
                rig.engine.lease_report(c.sid, "compute", TAIL_S, False, units=1, ended_ago_s=0.001)
            else:
                rig.clock.advance(TAIL_S)
                rig.engine.lease_report(c.sid, "compute", TAIL_S, False, yielded=True)
            c.pump()
            rig.clock.advance(delay - TAIL_S)
            continue
        if not g.frozen:
            g.cpu_s += delay
            kern_work += delay
        rig.clock.advance(delay)
        if c.held:
            coop_work += delay
        c.report(delay if c.held else 0.0, units=round(delay / TAIL_UNIT_S) if c.held and after_yield else 0)
    return coop_work / (coop_work + kern_work)


@pytest.mark.parametrize(("coop_w", "kern_w"), [(100, 100), (300, 100), (100, 300)])
def test_a_revoked_clients_tail_beside_the_thawed_kernel_tenant_is_charged_half_to_each(
        tmp_path: Path, coop_w: int, kern_w: int) -> None:
    """A client revoked mid-step finishes its step (here 20 ms) after the freezer-governed tenant is thawed for its
    turn, then yields; the GPU time-slices the two, so each does about half of that overlap, while the client's CUDA
    events time all of it. Charged whole to the client and taken whole off the other's busy time, the
    freezer-governed tenant would get about 5 points more than its share at 1:1 with 50 ms steps."""
    share = _share_beside_a_revoked_tail(tmp_path, coop_w, kern_w, after_yield=False)
    assert share == pytest.approx(coop_w / (coop_w + kern_w), abs=0.02)


@pytest.mark.parametrize(("coop_w", "kern_w"), [(100, 100), (300, 100), (100, 300)])
def test_a_revoked_clients_step_reported_after_its_yield_is_split_with_the_thawed_tenant(
        tmp_path: Path, coop_w: int, kern_w: int) -> None:
    """The client's app already waits for its next 10 ms step when the revoke comes, so it yields at once; the step it
    queued last still runs, time-sliced beside the freezer-governed tenant thawed for its turn (20 ms on its timer,
    half of that the other's work), and is reported when seen done, after the yield. It ran beside that tenant as a
    tail reported with the yield does: charged whole to the client and taken whole off the other's busy time, the
    other would get the difference twice."""
    share = _share_beside_a_revoked_tail(tmp_path, coop_w, kern_w, after_yield=True)
    assert share == pytest.approx(coop_w / (coop_w + kern_w), abs=0.02)


@pytest.mark.parametrize(("coop_w", "kern_w"), [(100, 100), (300, 100), (100, 300)])
def test_the_work_a_frozen_tenant_left_queued_is_its_own_not_the_next_clients(
        tmp_path: Path, coop_w: int, kern_w: int) -> None:
    """Frozen for the client's turn, the freezer-governed tenant still has 10 ms of GPU work queued; the client's
    first units wait behind it, and its CUDA events time that wait. The time beyond its usual units is the frozen
    tenant's, not the client's."""
    drain, unit = 0.010, 0.005  # a whole number of units after the drain: the model reports only whole units
    rig, c, g = client_beside_kernel(tmp_path, coop_w, kern_w)
    coop_work = kern_work = 0.0
    for _ in range(1200):
        was_frozen, was_held = g.frozen, c.held
        delay = rig.tick()
        rig.clock.advance(delay)
        if not g.frozen:
            g.cpu_s += delay
            kern_work += delay
        elif not was_frozen:
            g.cpu_s += FREEZE_TAIL_S
        if not c.held:
            c.report(0.0)
            continue
        queued = drain if not was_held and was_frozen is False else 0.0  # its first slice after the other's turn
        kern_work += queued
        coop_work += delay - queued
        c.report(delay, units=round((delay - queued) / unit))
    share = coop_work / (coop_work + kern_work)
    assert share == pytest.approx(coop_w / (coop_w + kern_w), abs=0.02), (coop_work, kern_work)


def test_a_frozen_tenants_queued_work_is_charged_to_it_once_when_the_holder_reports_it(tmp_path: Path) -> None:
    """The holder's first units after a freeze waited behind the frozen tenant's queued work, and its timer counted
    it: the holder is charged its units, the frozen tenant the rest, at the report (not only where its freeze fell in
    the same tick as the report: on the GPU it often did not, and that work went uncharged). The tick that follows
    does not charge it again."""
    rig, c, g = client_beside_kernel(tmp_path, 100, 100)
    for _ in range(40):  # the client reports 10 units of 5 ms per slice held; the tenant runs when thawed
        was_frozen = g.frozen
        delay = rig.tick()
        if c.held and g.frozen and not was_frozen and rig.engine.snapshot("coop").unit_s is not None:
            break
        rig.clock.advance(delay)
        if not g.frozen:
            g.cpu_s += delay
        c.report(delay if c.held else 0.0, units=10 if c.held else 0)
    else:
        pytest.fail("the client was never granted as the other tenant was frozen")
    kern, coop = rig.engine.snapshot("kern").gpu_seconds, rig.engine.snapshot("coop").gpu_seconds
    kern_as, coop_as = _charged_as(rig, "kern"), _charged_as(rig, "coop")
    rig.clock.advance(delay)
    c.report(0.05, units=8)  # 8 units of 5 ms, after 10 ms of the frozen tenant's work
    assert rig.engine.snapshot("kern").gpu_seconds - kern == pytest.approx(0.010)
    assert rig.engine.snapshot("coop").gpu_seconds - coop == pytest.approx(0.040)
    # kept as what they are: the frozen tenant's drain as the report timed it, and the client's own reported work
    drain, own = ("report", "drain"), ("report", "reported")
    assert _charged_as(rig, "kern").get(drain, 0.0) - kern_as.get(drain, 0.0) == pytest.approx(0.010)
    assert _charged_as(rig, "coop")[own] - coop_as.get(own, 0.0) == pytest.approx(0.040)
    rig.tick()  # its interval was all reported work: nothing more for the frozen tenant
    assert rig.engine.snapshot("kern").gpu_seconds - kern == pytest.approx(0.010)


def _charged_as(rig: LeaseRig, name: str) -> dict[tuple[str, str], float]:
    """A tenant's charges on GPU 0's SMs by (rule, source)."""
    return {(k.rule, k.source): s for share in rig.engine.snapshot(name).shares if str(share.resource) == "gpu0/sm"
            for k, s in share.charges}


def test_an_idle_unmodified_tenant_takes_no_turns_from_a_lone_client(tmp_path: Path) -> None:
    """The GPU reads busy with the client's work alone: a thawed freezer-governed tenant that does nothing (no CPU, a
    client gone, a `--keep` tenant between runs) is not 'alone on a busy GPU' while a client holds the lease there,
    so it shows no demand and the client keeps the GPU (counted as the idle tenant's, it would take every other slice)."""
    rig = busy_rig(tmp_path)
    rig.unmodified("idle", 100)
    a = rig.coop("a", 100)
    a.want()
    holders = rig.run(100, [a])
    assert holders.count("a") >= 98, holders
    assert rig.engine.snapshot("idle").state == "idle"
