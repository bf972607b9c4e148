"""The client's lease state machine alone: no daemon, the daemon's replies fed in, its requests read back, an
injected clock. Units in flight, yields, reports, jumps, pause points."""

from __future__ import annotations

import queue
import sys
import threading

import pytest
from conftest import ROOT, wait_until

sys.path.insert(0, str(ROOT / "clients"))  # this checkout's client library, not an installed one

from unisched_client import Client
from unisched_client.clock import Clock, FakeClock
from unisched_wire import unisched_pb2 as pb


class _Recorder:
    """Stands in for the client's connection: the requests it writes, in order."""

    def __init__(self, out: queue.SimpleQueue[pb.LeaseRequest | None]) -> None:
        self.send = out.put


def offline_client(monkeypatch: pytest.MonkeyPatch, clock: Clock | None = None,
                   ) -> tuple[Client, queue.SimpleQueue[pb.LeaseRequest | None]]:
    monkeypatch.setattr(Client, "_stream_loop", lambda self: None)
    monkeypatch.setattr(Client, "_renew_loop", lambda self: None)
    client = Client("t", socket="/nonexistent.sock", fail_open=True, connect_timeout=0, clock=clock)
    out: queue.SimpleQueue[pb.LeaseRequest | None] = queue.SimpleQueue()
    client._conn, client.governed = _Recorder(out), True
    return client, out


def sent(out: queue.SimpleQueue[pb.LeaseRequest | None]) -> list[str]:
    msgs = []
    while not out.empty():
        r = out.get_nowait()
        assert r is not None
        kind = r.WhichOneof("kind")
        if kind == "report":
            kind += "".join(f" {f}" for f in ("release", "yielded") if getattr(r.report, f))
        msgs.append(kind)
    return msgs


def reports(out: queue.SimpleQueue[pb.LeaseRequest | None]) -> list[pb.LeaseReport]:
    """The usage reports sent so far (taken off the queue)."""
    found: list[pb.LeaseReport] = []
    while not out.empty():
        r = out.get_nowait()
        if r is not None and r.WhichOneof("kind") == "report":
            found.append(r.report)
    return found


def grant(client: Client, lease: int) -> None:
    client._on_reply(pb.LeaseReply(grant=pb.LeaseGrant(lease=lease, engine="compute", valid_s=0.25, slice_left_s=0.05)))


def jump_grant(client: Client, lease: int, jump: bool) -> None:
    client._on_reply(pb.LeaseReply(grant=pb.LeaseGrant(lease=lease, engine="compute", valid_s=0.25, slice_left_s=0.05,
                                                       jump=jump)))


def test_an_online_gate_told_it_jumps_starts_its_next_unit_with_the_want(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a release, a gate whose last grant said `jump` passes acquire() as it sends the want (no round trip);
    once per release; the grant that follows makes it a holder; a grant without the flag, or a revoke, or a lost
    daemon makes it ask and wait again."""
    client, out = offline_client(monkeypatch)
    gate = client.gate("compute")
    assert not gate.acquire(timeout=0)  # never granted: it waits like any gate
    jump_grant(client, 1, True)
    assert gate.acquire(timeout=0)
    gate.done(0.004)
    gate.release()
    sent(out)
    assert gate.acquire(timeout=0) and not gate.held and sent(out) == ["want"] and gate.jumps == 1
    assert not gate.acquire(timeout=0)  # the second unit before the grant waits for it
    jump_grant(client, 2, True)
    assert gate.held and gate.acquire(timeout=0)
    gate.release()
    assert gate.acquire(timeout=0) and gate.jumps == 2  # (the grant renewed the flag)
    gate.done(0.002)
    gate.release()  # a unit shorter than the want's round trip: its grant comes after the release
    jump_grant(client, 3, True)
    assert not gate.held and gate.acquire(timeout=0) and gate.jumps == 3  # and still renews the flag
    jump_grant(client, 3, False)  # another online tenant came: wants wait for their grants again
    gate.release()
    assert not gate.acquire(timeout=0) and gate.jumps == 3
    jump_grant(client, 4, True)
    gate.release()
    revoke(client, 4, "released")  # the answer to a release leaves the flag
    assert gate.acquire(timeout=0) and gate.jumps == 4
    jump_grant(client, 5, True)
    revoke(client, 5, "slice over")  # revoked while wanted: outranked, no jump until a grant says so
    gate.release()
    assert not gate.acquire(timeout=0) and gate.jumps == 4
    jump_grant(client, 6, True)
    gate.release()
    with client._cond:
        client._disconnected_locked()  # a restarted daemon may see other online tenants
    client.governed = True
    assert not gate.acquire(timeout=0) and gate.jumps == 4


def revoke(client: Client, lease: int, reason: str) -> None:
    client._on_reply(pb.LeaseReply(revoke=pb.LeaseRevoke(lease=lease, engine="compute", reason=reason)))


def test_a_released_gate_does_not_yield_to_the_revoke_of_its_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon reads a yield as a renewal: answering the revoke that follows a release with one wanted the
    engine again, and an online tenant that released between requests kept a lease nobody used."""
    client, out = offline_client(monkeypatch)
    gate = client.gate("compute")
    assert not gate.acquire(timeout=0) and sent(out) == ["want"]
    grant(client, 7)
    assert gate.acquire(timeout=0)
    gate.done(0.004)
    gate.release()
    assert sent(out) == ["report release"]
    revoke(client, 7, "released")
    assert sent(out) == [] and gate.revokes == 0 and not gate.owes_yield


def test_a_revoked_gate_starts_no_unit_yields_once_drained_and_runs_again_when_granted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    client, out = offline_client(monkeypatch)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    grant(client, 3)
    assert gate.acquire(timeout=0) and gate.acquire(timeout=0)  # two units in flight
    sent(out)
    revoke(client, 3, "slice over")  # an online tenant wants the GPU
    assert gate.ending() and sent(out) == []  # the app drains the two units in flight (InFlight.add)
    gate.done(0.015)
    assert sent(out) == []
    gate.done(0.015)
    assert sent(out) == ["report yielded"]  # the last one done: the hand-over may complete
    assert not gate.acquire(timeout=0) and sent(out) == []  # and no new unit starts while revoked
    grant(client, 4)  # the online tenant released: the trainer runs again at once
    assert gate.acquire(timeout=0) and not gate.ending()
    gate.done(0.015)
    assert sent(out) == [] and gate.revokes == 1


def test_a_grant_while_a_yield_is_owed_cancels_it(monkeypatch: pytest.MonkeyPatch) -> None:
    client, out = offline_client(monkeypatch)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    grant(client, 3)
    assert gate.acquire(timeout=0)
    revoke(client, 3, "slice over")
    grant(client, 4)  # granted again before its unit ended: the daemon waits for no yield
    sent(out)
    gate.done(0.015)
    assert sent(out) == []


def test_reports_count_the_units_they_cover(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon learns a tenant's unit length from them (long units earn longer turns)."""
    client, out = offline_client(monkeypatch)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    grant(client, 1)
    for _ in range(3):
        assert gate.acquire(timeout=0)
        gate.done(0.01)
    gate.release()
    gate.acquire(timeout=0)
    grant(client, 2)
    gate.done(0.02)
    gate.release()
    assert [(r.units, round(r.gpu_seconds, 6)) for r in reports(out)] == [(3, 0.03), (1, 0.02)]


@pytest.mark.parametrize(("contended", "waited_after"), [(False, [[], [], [0]]), (True, [[], [0], [0, 1]])])
def test_one_unit_in_flight_while_others_wait_for_the_engine(
        monkeypatch: pytest.MonkeyPatch, contended: bool, waited_after: list[list[int]]) -> None:
    """A hand-over leaves the holder's queued units to run beside the next holder's, which the driver time-slices:
    while contended the app waits for the previous unit before queueing past the next one."""
    from unisched_client._inflight import InFlight

    client, _ = offline_client(monkeypatch)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    client._on_reply(pb.LeaseReply(grant=pb.LeaseGrant(lease=1, engine="compute", valid_s=0.25, slice_left_s=0.05,
                                                       contended=contended)))
    waited: list[int] = []
    flight: InFlight[int] = InFlight(gate, done=lambda u: u in waited, wait=waited.append, elapsed_s=lambda u: 0.01)
    seen = []
    for unit in range(3):
        assert gate.acquire(timeout=0)
        flight.add(unit)
        seen.append(list(waited))
    assert seen == waited_after


def test_a_unit_that_would_start_past_the_slice_behind_a_running_one_waits_for_the_next_decision(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While contended, a unit queued behind a running one starts on the GPU only when that one ends (its measured
    length on): if that is past the slice's end (and the grace), the app waits for the daemon's next decision, which
    comes before the running one ends, so a revoke leaves one unit beside the next holder, not two."""
    from unisched_client._inflight import InFlight
    from unisched_client.gate import START_GRACE_S

    clock = FakeClock(start=100.0)
    client, _ = offline_client(monkeypatch, clock)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    contended_grant(client, 1, slice_left_s=0.09)  # the slice ends at 100.09
    waited: list[int] = []
    flight: InFlight[int] = InFlight(gate, done=lambda u: u in waited, wait=waited.append, elapsed_s=lambda u: 0.05)
    assert gate.acquire(timeout=0)
    flight.add(0)  # nothing measured yet: no estimate
    assert gate.busy_until == 0.0
    assert gate.acquire(timeout=0)
    flight.add(1)  # waits for unit 0, so unit 1 starts now and runs 0.05 s (unit 0's length)
    assert gate.busy_until == pytest.approx(100.05)
    clock.advance(0.05)
    assert gate.acquire(timeout=0)  # unit 2 starts at 100.05, as unit 1 ends: before the slice's end
    flight.add(2)
    assert gate.busy_until == pytest.approx(100.10)
    assert clock.monotonic() < 100.09 + START_GRACE_S  # a rule that looked only at the time now would start unit 3
    assert not gate.acquire(timeout=0)  # but it would start at 100.10, past the slice's end and its grace
    clock.advance(0.04)
    contended_grant(client, 1, slice_left_s=0.05)  # the daemon's decision at 100.09: renewed, to 100.14
    assert gate.acquire(timeout=0)  # queued behind unit 2, before it ends


def test_a_unit_still_running_when_the_app_waits_for_the_engine_is_reported_as_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Revoked while its app waits for the next unit, the gate yields at once; the unit it queued last runs on, and
    is reported when it ends, by when it ended, while the app still waits: not at the next grant, where the daemon
    took it for work of that turn (InFlight.acquire)."""
    from unisched_client._inflight import POLL_S, InFlight

    clock = FakeClock(start=100.0)
    client, out = offline_client(monkeypatch, clock)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    contended_grant(client, 1, slice_left_s=0.09)
    finished: set[int] = set()
    flight: InFlight[int] = InFlight(gate, done=lambda u: u in finished, wait=finished.add, elapsed_s=lambda u: 0.05)
    assert gate.acquire(timeout=0)
    flight.add(0)
    reports(out)
    revoke(client, 1, "slice over")  # unit 0 still runs
    app = threading.Thread(target=flight.acquire, name="app", daemon=True)
    app.start()
    assert clock.await_sleep("app") == pytest.approx(POLL_S)
    assert [(r.yielded, r.gpu_seconds) for r in reports(out)] == [(True, 0.0)]  # the hand-over need not wait
    finished.add(0)
    clock.advance(0.02)  # it looks again, and sees unit 0 done
    assert clock.await_sleep("app", after=1) is None  # then waits for a grant alone
    sent_now = reports(out)
    assert [(r.yielded, r.gpu_seconds, r.units) for r in sent_now] == [(False, 0.05, 1)]
    assert sent_now[0].ended_ago_s < 0.002  # placed where it ended
    contended_grant(client, 2)
    app.join(timeout=30)
    assert not app.is_alive()
    assert gate.waited_s == pytest.approx(0.02)  # the wait spans the calls it was looked at between


def test_a_unit_that_does_not_end_is_looked_at_less_often_the_later_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit the GPU never ends (a hang) while the app waits for the engine costs a few looks a second, not one a
    millisecond: the wait between looks is a tenth of how late the unit is."""
    from unisched_client._inflight import POLL_S, InFlight

    clock = FakeClock(start=100.0)
    client, _ = offline_client(monkeypatch, clock)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    contended_grant(client, 1)
    flight: InFlight[int] = InFlight(gate, done=lambda u: False, wait=lambda u: None, elapsed_s=lambda u: 0.05)
    assert gate.acquire(timeout=0)
    flight.add(0)  # never ends; let start at 100.0, nothing measured yet
    revoke(client, 1, "slice over")
    app = threading.Thread(target=flight.acquire, name="app", daemon=True)
    app.start()
    assert clock.await_sleep("app") == pytest.approx(POLL_S)
    clock.advance(2.0)
    assert clock.await_sleep("app", after=1) == pytest.approx(0.2)  # 2 s late: a look every 0.2 s
    contended_grant(client, 2)
    app.join(timeout=30)
    assert not app.is_alive()


def test_the_estimate_of_queued_work_ends_with_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every queued unit is seen done (collect, drain), nothing is queued: the next unit starts now."""
    from unisched_client._inflight import InFlight

    clock = FakeClock(start=100.0)
    client, _ = offline_client(monkeypatch, clock)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    contended_grant(client, 1)
    finished: set[int] = set()
    flight: InFlight[int] = InFlight(gate, done=lambda u: u in finished, wait=finished.add, elapsed_s=lambda u: 0.5)
    for unit in range(2):
        assert gate.acquire(timeout=0)
        flight.add(unit)
    assert gate.busy_until == pytest.approx(100.5) and flight.mean_s == 0.5
    finished.add(1)
    flight.collect()
    assert gate.busy_until == 0.0 and gate.acquire(timeout=0)
    flight.add(2)
    assert gate.busy_until == pytest.approx(100.5)  # unit 2 was let start at 100.0, with nothing ahead of it
    flight.drain()
    assert gate.busy_until == 0.0


def contended_grant(client: Client, lease: int, slice_left_s: float = 0.05) -> None:
    client._on_reply(pb.LeaseReply(grant=pb.LeaseGrant(lease=lease, engine="compute", valid_s=0.25,
                                                       slice_left_s=slice_left_s, contended=True)))


def test_pause_points_split_a_step_only_while_others_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone (uncontended) a point costs nothing; contended, each part is timed and charged, and the step is still
    counted once in the reports (the daemon learns the step's length from them)."""
    from unisched_client._inflight import InFlight

    client, out = offline_client(monkeypatch)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    grant(client, 1)
    flight: InFlight[str] = InFlight(gate, done=lambda u: True, wait=lambda u: None, elapsed_s=lambda u: 0.01)
    assert gate.acquire(timeout=0) and not flight.split_wanted()
    contended_grant(client, 2)
    assert flight.split_wanted()
    flight.split("part 1")
    flight.split("part 2")
    flight.add("end")
    gate.release()
    assert [(r.units, round(r.gpu_seconds, 6)) for r in reports(out)] == [(1, 0.03)]
    assert flight.splits == 2 and gate.open_units == 0


def test_a_revoked_step_stops_at_its_next_point_and_goes_on_when_granted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point drains what the step queued so far, yields, and starts nothing more until the next grant."""
    from unisched_client._inflight import InFlight

    client, out = offline_client(monkeypatch)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    contended_grant(client, 1)
    waited: list[str] = []
    flight: InFlight[str] = InFlight(gate, done=lambda u: u in waited, wait=waited.append, elapsed_s=lambda u: 0.01)
    assert gate.acquire(timeout=0)
    sent(out)
    revoke(client, 1, "online tenant wants the GPU")
    assert flight.split_wanted()
    resumed = threading.Event()

    def step_goes_on() -> None:
        flight.split("part before the revoke")
        resumed.set()

    t = threading.Thread(target=step_goes_on, daemon=True)
    t.start()
    yielded = wait_until(lambda: "report yielded" in sent(out) or None, 5, "the paused step to yield")
    assert yielded and waited == ["part before the revoke"] and not resumed.is_set()
    contended_grant(client, 2)
    t.join(timeout=5)
    assert resumed.is_set() and gate.open_units == 1  # the rest of the step runs under the new lease
