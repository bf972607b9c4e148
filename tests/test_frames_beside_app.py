"""A render client (every frame inside `FrameGate`) beside the same render unmodified (freezer-governed), in the
engine with a fake clock and a GPU that reads busy: a small model of the device runs both, and the client times
its frames as GL timer queries do (from the frame's start to its end, the other context's work included).

What differs from CUDA steps (tests/test_long_steps.py): frames of ~28 ms on the graphics engine, one in flight
(the client's frame ends with glFinish inside its query), reported with the client's renewals (twice a slice while
contended, so up to 25 ms after the frame ended); and the app's glFinish each frame, so when it is frozen its frame
in flight (up to 28 ms) still runs, beside the client's first frame of its turn. On the H200 such a client got
0.726 of the GPU at 3:1 and 0.207 at 1:3, 0.491 at 1:1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from leaserig import LeaseRig, busy_rig

from unisched.enforce.leases import FakeLeaseChannel, LeaseGrant

TICK_S = 0.0005
"""The device model's time step."""
FRAME_S = 0.028
"""A frame's own GPU time: the bench's render at 447 iterations, ~36 frames/s alone on the H200."""
RENEW_S = 0.025
"""A contended client renews (with its pending report) twice a 50 ms slice (unisched_client.renewals)."""


@dataclass
class Frame:
    work_s: float
    """Its own GPU time still to run."""
    started: float | None = None


@dataclass
class Gpu:
    """Alone a context runs at full speed; the client's and the app's frames together time-slice evenly. With
    `queued_first`, a client's frame that starts while the app's frame runs waits for it (its query starts when
    its own commands do): on the H200 the first frame of a client's turn read 28 ms, not inflated, and ended a frame
    after the grant."""

    client: Frame | None = None
    app: Frame | None = None
    client_work: float = 0.0
    app_work: float = 0.0
    queued_first: bool = False

    def run(self, now: float, dt: float) -> float | None:
        """Run `dt`; the wall time (query start to end) of the client's frame if it ended."""
        if self.queued_first and self.app and self.client and self.client.started is None:
            self.app.work_s -= dt
            self.app_work += dt
            if self.app.work_s <= 1e-9:
                self.app = None
            return None
        share = 0.5 if self.client and self.app else 1.0
        if self.app:
            self.app.work_s -= dt * share
            self.app_work += dt * share
            if self.app.work_s <= 1e-9:
                self.app = None
        f = self.client
        if f is None:
            return None
        if f.started is None:
            f.started = now
        f.work_s -= dt * share
        self.client_work += dt * share
        if f.work_s > 1e-9:
            return None
        self.client = None
        return now + dt - f.started


class FrameClient:
    """The client library's gate as FrameGate drives it (unisched_client.gate, _inflight): a frame starts only while
    the lease is held and, contended, before the slice ends; its time is pending until the next renewal, or the
    yield when the lease was revoked meanwhile."""

    def __init__(self, rig: LeaseRig, weight: int, renew_s: float) -> None:
        self.rig = rig
        self.renew_s = renew_s
        self.done_at = 0.0
        """When its last frame ended: each report says how long before it that was (LeaseReport.ended_ago_s)."""
        self.channel = FakeLeaseChannel()
        rig.pid += 1
        self.sid, _ = rig.engine.lease_open("frames", weight, None, ["graphics"], 0, rig.pid, 0, True, self.channel)
        self.lease = 0
        self.contended = False
        self.slice_end = 0.0
        self.in_frame = False
        self.owes_yield = False
        self.pending_s = 0.0
        self.pending_units = 0
        self.next_renew = 0.0
        rig.engine.lease_want(self.sid, "graphics")

    def flush(self, yielded: bool = False) -> None:
        s, n, self.pending_s, self.pending_units = self.pending_s, self.pending_units, 0.0, 0
        ago = max(1e-6, self.rig.clock.now - self.done_at) if s > 0 else 0.0
        self.rig.engine.lease_report(self.sid, "graphics", s, False, yielded=yielded, units=n, ended_ago_s=ago)

    def pump(self, now: float) -> None:
        for m in self.channel.take():
            if isinstance(m, LeaseGrant):
                self.lease, self.contended, self.slice_end = m.lease, m.contended, now + m.slice_left_s
                self.owes_yield = False
            elif self.lease in (m.lease, 0):
                self.lease, self.owes_yield = 0, True
                if not self.in_frame:
                    self.yield_now()

    def yield_now(self) -> None:
        self.owes_yield = False
        self.flush(yielded=True)

    def may_start(self, now: float) -> bool:
        return bool(self.lease) and (not self.contended or now < self.slice_end)

    def frame_done(self, wall_s: float) -> None:
        self.in_frame = False
        self.done_at = self.rig.clock.now
        self.pending_s += wall_s
        self.pending_units += 1
        if self.owes_yield:
            self.yield_now()

    def renew(self, now: float) -> None:
        if self.contended and now >= self.next_renew:
            self.next_renew = now + self.renew_s
            if self.lease or self.pending_s > 0:
                self.flush()


def run_pair(tmp: Path, client_w: int, app_w: int, seconds: float, freeze_lag_s: float, renew_s: float,
             queued_first: bool = False) -> float:
    """The client's share of the GPU work done (the app's is the rest). `freeze_lag_s`: how long the app's CPU
    (spinning in glFinish) runs on after its freeze; `renew_s`: how often the client renews with its report;
    `queued_first`: see Gpu."""
    rig = busy_rig(tmp)
    c = FrameClient(rig, client_w, renew_s)
    rig.unmodified("app", app_w, "graphics")
    app = rig.driver.groups["/unisched/app"]
    gpu = Gpu(queued_first=queued_first)
    start = next_tick = rig.clock.now
    frozen_at: float | None = None
    while rig.clock.now - start < seconds:
        now = rig.clock.now
        if now >= next_tick - 1e-9:
            next_tick = now + rig.engine.tick()
        c.pump(now)
        if not c.in_frame and c.may_start(now):
            c.in_frame = True
            gpu.client = Frame(FRAME_S)
        elif not c.in_frame and c.lease and c.pending_s > 0:
            c.flush()  # it waits for the next slice: charge it before the daemon decides
        c.renew(now)
        c.pump(now)
        frozen_at = (frozen_at if frozen_at is not None else now) if app.frozen else None
        if gpu.app is None and not app.frozen:
            gpu.app = Frame(FRAME_S)  # its next frame (the one in flight at a freeze runs on)
        if frozen_at is None or now - frozen_at < freeze_lag_s:
            app.cpu_s += TICK_S
        wall = gpu.run(now, TICK_S)
        rig.clock.advance(TICK_S)
        if wall is not None:
            c.frame_done(wall)
            c.pump(rig.clock.now)
    return gpu.client_work / (gpu.client_work + gpu.app_work)


@pytest.mark.parametrize(("client_w", "app_w"), [(100, 100), (300, 100), (100, 300)])
@pytest.mark.parametrize(("freeze_lag_s", "renew_s"), [(0.0, RENEW_S), (0.002, RENEW_S), (0.002, TICK_S)])
def test_a_frame_gated_render_beside_an_unmodified_render_gets_its_weight(tmp_path: Path, client_w: int, app_w: int,
                                                                          freeze_lag_s: float, renew_s: float) -> None:
    """Each case needs the charging rules for frames: their usual length learnt (without it the client pays the
    app's frame in flight at every hand-over), reports placed where their work ran (at their arrival, the work
    falls in the next interval), and a just-frozen app charged its drain. The 1:3 case with a report per frame
    (`renew_s` of a model step) needs the usual length learnt from untrimmed reports: fed the reports the `beside`
    rule had cut to it, the estimate keeps whatever value it started from."""
    share = run_pair(tmp_path, client_w, app_w, 30.0, freeze_lag_s, renew_s)
    assert share == pytest.approx(client_w / (client_w + app_w), abs=0.012)


@pytest.mark.parametrize(("client_w", "app_w"), [(100, 100), (300, 100), (100, 300)])
def test_a_render_client_whose_first_frame_waits_for_the_frozen_apps_gets_its_weight(tmp_path: Path, client_w: int,
                                                                                   app_w: int) -> None:
    """The client's first frame of each turn waits for the frozen app's frame in flight (as on the H200). Needs the
    reports placed where the client says its frames ended (`ended_ago_s`): placed back to back from the grant, its
    frames fall a frame early, over the app's drain, and that drain is taken off the app's charge at every turn."""
    share = run_pair(tmp_path, client_w, app_w, 30.0, 0.002, RENEW_S, queued_first=True)
    assert share == pytest.approx(client_w / (client_w + app_w), abs=0.012)
