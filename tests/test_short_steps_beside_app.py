"""A client with short CUDA steps (1.7 ms, eight 4096x4096 matmuls) beside an unmodified app, in the engine with a
fake clock and a GPU that reads busy: a model of the device and of the client library's gate as it runs them.

What the model has that tests/test_long_steps.py does not: the app's queued matmuls (four of 1.6 ms) drain after its
freeze; the client keeps two steps on the GPU, renews with its pending report every 25 ms saying when its last step
ended, starts steps until 5 ms past its slice, and yields once its steps in flight are done; the daemon's ticks come
up to 3 ms late and its messages 1.5 ms after. At a hand-over the GPU runs the client's queued steps before the
thawed app's (short steps fit in the GPU's own time slice), so a tail reads its steps' usual length.

On the H200 such a client got 0.503-0.524 at 1:1, 0.759-0.765 at 3:1 and 0.269-0.272 at 1:3 (0.6-2.7 points over).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from leaserig import busy_rig

from unisched.enforce.leases import LeaseGrant

TICK_S = 0.0001
STEP_S = 0.0017
APP_MATMUL_S = 0.0016
APP_QUEUED = 4
RENEW_S = 0.025
GRACE_S = 0.005
LATENCY_S = 0.0015
TICK_JITTER_S = 0.003


@dataclass
class Client:
    """unisched_client's gate as a contended PyTorch loop drives it (gate.py, _inflight.py)."""

    lease: int = 0
    contended: bool = False
    slice_end: float = 0.0
    owes_yield: bool = False
    on_gpu: list[list[float]] = field(default_factory=list)
    """Steps queued on the GPU: [own work left, when the GPU started it (-1: not yet)]."""
    pending_s: float = 0.0
    pending_units: int = 0
    done_at: float = 0.0
    next_renew: float = 0.0
    inbox: list[tuple[float, object]] = field(default_factory=list)


def run_pair(tmp: Path, coop_w: int, app_w: int, seconds: float) -> float:
    """The client's share of the work done (the app's is the rest)."""
    rig = busy_rig(tmp)
    coop = rig.coop("coop", coop_w)
    rig.engine.lease_want(coop.sid, "compute")
    rig.unmodified("app", app_w)
    app = rig.driver.groups["/unisched/app"]
    jitter = random.Random(1)
    c = Client()
    app_queue: list[float] = []
    client_work = app_work = 0.0

    def report(now: float, yielded: bool = False) -> None:
        ago = max(1e-6, now - c.done_at) if c.pending_s > 0 else 0.0
        rig.engine.lease_report(coop.sid, "compute", c.pending_s, False, yielded=yielded, units=c.pending_units,
                                ended_ago_s=ago)
        c.pending_s, c.pending_units = 0.0, 0

    def pump(now: float) -> None:
        c.inbox.extend((now + LATENCY_S, m) for m in coop.channel.take())
        ready = [m for at, m in c.inbox if at <= now + 1e-12]
        c.inbox[:] = [(at, m) for at, m in c.inbox if at > now + 1e-12]
        for m in ready:
            if isinstance(m, LeaseGrant):
                c.lease, c.contended, c.slice_end, c.owes_yield = m.lease, m.contended, now + m.slice_left_s, False
            elif c.lease in (getattr(m, "lease", 0), 0):
                c.lease, c.owes_yield = 0, True
                if not c.on_gpu:
                    c.owes_yield = False
                    report(now, yielded=True)

    start = next_tick = rig.clock.now
    while rig.clock.now - start < seconds:
        now = rig.clock.now
        if now >= next_tick - 1e-9:
            next_tick = now + rig.engine.tick() + jitter.uniform(0.0, TICK_JITTER_S)
        pump(now)
        while c.lease and len(c.on_gpu) < 2 and (not c.contended or now < c.slice_end + GRACE_S):
            c.on_gpu.append([STEP_S, -1.0])
        if c.lease and not c.on_gpu and c.pending_s > 0 and c.contended and now >= c.slice_end + GRACE_S:
            report(now)  # it waits for the next slice: charge this one first
        if now >= c.next_renew:
            c.next_renew = now + RENEW_S
            if c.lease:
                report(now)
        if not app.frozen and not app_queue:
            app_queue = [APP_MATMUL_S] * APP_QUEUED
        if c.on_gpu:  # the client's queued steps run first (see the module's docstring)
            step = c.on_gpu[0]
            if step[1] < 0:
                step[1] = now
            step[0] -= TICK_S
            client_work += TICK_S
            if step[0] <= 1e-12:
                c.on_gpu.pop(0)
                c.pending_s += now + TICK_S - step[1]
                c.pending_units += 1
                c.done_at = now + TICK_S
                if c.owes_yield and not c.on_gpu:
                    c.owes_yield = False
                    report(now + TICK_S, yielded=True)
        elif app_queue:
            app_queue[0] -= TICK_S
            app_work += TICK_S
            if app_queue[0] <= 1e-12:
                app_queue.pop(0)
        if not app.frozen:
            app.cpu_s += TICK_S
        rig.clock.advance(TICK_S)
    return client_work / (client_work + app_work)


@pytest.mark.parametrize(("coop_w", "app_w"), [(100, 100), (300, 100), (100, 300)])
def test_a_client_with_short_steps_beside_an_unmodified_app_gets_its_weight(tmp_path: Path, coop_w: int,
                                                                           app_w: int) -> None:
    """Needs the `learn` rule (policy.reports.learnable_tail): with tails counted half their time beside the app, the
    usual step length is learnt a tenth short and the client gets 0.511 at 1:1 and 0.262 at 1:3."""
    share = run_pair(tmp_path, coop_w, app_w, 12.0)
    assert share == pytest.approx(coop_w / (coop_w + app_w), abs=0.006)
