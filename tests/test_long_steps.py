"""A client with long steps beside an unmodified (freezer-governed) app, in the engine with a fake clock and a GPU
that reads busy: a small model of the device runs both and the client times its steps as CUDA events do.

Why a model of the device: a revoked client cannot stop mid-step. Its step in flight, and the one it queued behind
it (one unit in flight while contended), run on after the app is thawed for its turn, and the GPU time-slices the
two. The client's CUDA events time each step from its start to its end, the app's work in between included, so
a 50 ms step that shares the GPU for its last part reads longer than 50 ms. On the H200 such a client (240
matmuls a step) got 0.442 of its solo rate and the unmodified app 0.539 at 1:1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from leaserig import busy_rig

TICK_S = 0.001
"""The device model's time step: a step's length is a whole number of them."""


@dataclass
class Step:
    work_s: float
    """Its own GPU time still to run."""
    started: float | None = None
    """When the device reached it (its start event)."""


@dataclass
class Device:
    """One GPU running a client's queued steps and a thawed app: alone each runs at full speed, together the GPU
    time-slices them evenly."""

    step_s: float
    queue: list[Step] = field(default_factory=list)
    client_work: float = 0.0
    app_work: float = 0.0

    def run(self, now: float, dt: float, app_runs: bool) -> list[float]:
        """Run `dt` of wall time; the wall time (start event to end event) of each step that ended."""
        ended = []
        share = 0.5 if self.queue and app_runs else 1.0
        if app_runs:
            self.app_work += dt * (1.0 - share if self.queue else 1.0)
        if self.queue:
            head = self.queue[0]
            if head.started is None:
                head.started = now
            head.work_s -= dt * share
            self.client_work += dt * share
            if head.work_s <= 1e-9:
                self.queue.pop(0)
                ended.append(now + dt - head.started)
        return ended


def run_pair(tmp: Path, coop_w: int, app_w: int, step_s: float, seconds: float) -> float:
    """The client's share of the work done (the app's is the rest)."""
    rig = busy_rig(tmp)
    c = rig.coop("coop", coop_w)
    c.yields = False  # it yields itself, once its steps in flight are done
    c.want()
    rig.unmodified("app", app_w)
    app = rig.driver.groups["/unisched/app"]
    dev = Device(step_s)
    start = rig.clock.now
    next_tick = start
    while rig.clock.now - start < seconds:
        if rig.clock.now >= next_tick - 1e-9:
            next_tick = rig.clock.now + rig.tick()
        c.pump()
        while c.held and len(dev.queue) < 2:  # one step running, one queued behind it (contended)
            dev.queue.append(Step(step_s))
        for wall in dev.run(rig.clock.now, TICK_S, not app.frozen):
            last = not c.held and not dev.queue
            rig.engine.lease_report(c.sid, "compute", wall, False, yielded=last, units=1)
        if not app.frozen:
            app.cpu_s += TICK_S
        rig.clock.advance(TICK_S)
    return dev.client_work / (dev.client_work + dev.app_work)


@pytest.mark.parametrize(("coop_w", "app_w"), [(100, 100), (300, 100), (100, 300)])
@pytest.mark.parametrize("step_s", [0.002, 0.047])
def test_a_client_with_long_steps_beside_an_unmodified_app_gets_its_weight(tmp_path: Path, coop_w: int, app_w: int,
                                                                          step_s: float) -> None:
    """Steps of 47 ms (off the 50 ms tick grid, so revokes land anywhere in a step) need the `beside` rule
    (policy.reports): without it the client gets 0.684 at 3:1 and 0.461 at 1:1. 2 ms steps are the control."""
    share = run_pair(tmp_path, coop_w, app_w, step_s, 40.0)
    assert share == pytest.approx(coop_w / (coop_w + app_w), abs=0.015)
