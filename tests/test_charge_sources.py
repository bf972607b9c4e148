"""Each tenant's charges kept by the rule that split them and their source (policy.ChargeSource): how they are told
apart, that they add up to its GPU seconds, and where they are shown (snapshots, `unisched tenants --json`, the
`tenant removed` log line; metrics in test_metrics.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs
from test_engine import Rig, gpu_rig

from unisched.cli.commands import tenant_to_dict
from unisched.policy import ChargeKind, ChargeSource, Resource, TenantSpec, WeightedFairShare
from unisched.policy.charging import sources
from unisched.scheduler.tenant import TenantSnapshot
from unisched.transport.convert import public_summary, snapshot_to_pb

A, S, D, T = ChargeSource.ALONE, ChargeSource.SHARED, ChargeSource.DRAIN, ChargeSource.FROZEN_TAIL
SM = Resource(0, "sm")


@pytest.mark.parametrize(("ran_as", "amounts", "expected"), [
    ([S], [0.05], [A]),  # thawed, the only one charged: the busy time is its own
    ([S, S], [0.05, 0.0], [A, S]),  # the other thawed but idle: charged nothing
    ([S, S], [0.03, 0.02], [S, S]),
    ([S, D], [0.05, 0.0], [ChargeSource.BESIDE_DRAIN, D]),  # the other's queued work drained beside it, uncharged
    ([S, S, D], [0.02, 0.02, 0.01], [ChargeSource.BESIDE_DRAIN, ChargeSource.BESIDE_DRAIN, D]),
    ([S, T], [0.04, 0.01], [S, T]),  # a frozen tenant's CPU tail is no drain
    ([D], [0.05], [D]),
    ([T], [0.05], [T]),
    ([], [], []),
])
def test_sources_tell_a_thawed_tenant_beside_a_drain_from_one_alone(
        ran_as: list[ChargeSource], amounts: list[float], expected: list[ChargeSource]) -> None:
    assert sources(ran_as, amounts) == expected


def test_the_fair_share_keeps_each_kind_of_charge_apart_and_its_vtime_alike() -> None:
    plain, kinded = WeightedFairShare(), WeightedFairShare()
    for policy in (plain, kinded):
        policy.upsert(TenantSpec("a"))
        policy.set_demand("a", {SM})
    plain.charge("a", SM, 0.3, 1.0)
    plain.charge("a", SM, 0.2, 1.0)
    signal_alone, report = ChargeKind("signal", A), ChargeKind("report", ChargeSource.REPORTED)
    kinded.charge("a", SM, 0.1, 1.0, signal_alone)
    kinded.charge("a", SM, 0.2, 1.0, signal_alone)
    kinded.charge("a", SM, 0.2, 1.0, report)
    (p,), (k,) = plain.stats(1.0), kinded.stats(1.0)
    assert k.charged_as == {(SM, signal_alone): pytest.approx(0.3), (SM, report): pytest.approx(0.2)}
    assert p.charged_as == {} and p.gpu_seconds == pytest.approx(k.gpu_seconds)
    assert plain.vtimes() == kinded.vtimes()


def _charges(snap: TenantSnapshot) -> dict[tuple[str, str, str], float]:
    """A snapshot's charges as {(resource, rule, source): seconds}."""
    return {(str(s.resource), k.rule, k.source): seconds for s in snap.shares for k, seconds in s.charges}


def test_a_sliced_pairs_charges_add_up_to_its_gpu_seconds_by_source(tmp_path: Path) -> None:
    """Two tenants on a saturated GPU take turns. Each charge is kept by its source: the interval after a hand-over,
    in which the tenant just frozen drains (and its freeze lands late, with a CPU tail), is the thawed one's
    `beside-drain` and the frozen one's `drain`; a tenant still using CPU after a tick frozen is `frozen-tail`; the
    intervals with one tenant running are `alone`. Together they are every second it was charged."""
    rig, _ = gpu_rig(tmp_path, 1.0)
    frozen_for = {"a": 0, "b": 0}
    for _ in range(400):
        delay = rig.engine.tick()
        for name in ("a", "b"):
            g = rig.driver.groups[f"/unisched/{name}"]
            frozen_for[name] = frozen_for[name] + 1 if g.frozen else 0
            if not g.frozen:
                g.cpu_s += delay
            elif frozen_for[name] == 1:
                g.cpu_s += 0.25 * delay  # the tail after the freeze request
            elif frozen_for[name] == 2:
                g.cpu_s += 0.01 * delay  # a straggler a tick after the freeze's interval
        rig.clock.advance(delay)
    seen = set()
    for name in ("a", "b"):
        snap = rig.engine.snapshot(name)
        charges = _charges(snap)
        assert sum(charges.values()) == pytest.approx(snap.gpu_seconds)
        assert {rule for (_, rule, _) in charges} == {"signal"}
        seen |= {src for (_, _, src) in charges}
    # (shared: both ran before the gate read the GPU saturated, and beside a frozen tail)
    assert seen == {"shared", "alone", "beside-drain", "drain", "frozen-tail"}
    # the thawed one pays most of each hand-over's interval: what a drain split by CPU activity leaves it
    a = _charges(rig.engine.snapshot("a"))
    assert a[("gpu0/sm", "signal", "beside-drain")] > a[("gpu0/sm", "signal", "drain")]


def test_a_tenant_alone_is_charged_alone_and_without_a_gpu_by_cpu_time(tmp_path: Path) -> None:
    rig, _ = gpu_rig(tmp_path, 1.0)
    rig.busy.discard("b")
    rig.step(100)
    a = _charges(rig.engine.snapshot("a"))  # (shared: the first tick, before either showed CPU, is split evenly)
    assert a[("gpu0/sm", "signal", "alone")] > 0.95 * sum(a.values())
    plain = Rig(tmp_path / "no-gpu")
    plain.add("c", 100)
    plain.step(50)
    assert set(_charges(plain.engine.snapshot("c"))) == {("gpu0/sm", "cpu-time", "alone")}


def test_charges_are_shown_to_the_owner_and_cleared_from_the_public_summary(tmp_path: Path) -> None:
    rig, _ = gpu_rig(tmp_path, 1.0)
    rig.step(100)
    snap = rig.engine.snapshot("a")
    t = snapshot_to_pb(snap)
    shown = tenant_to_dict(t)["shares"]
    assert sum(c["seconds"] for s in shown for c in s["charges"]) == pytest.approx(snap.gpu_seconds, abs=1e-3)
    assert {(c["rule"], c["source"]) for s in shown for c in s["charges"]} >= {("signal", "beside-drain")}
    public_summary(t)  # what another user sees: no measure of its work
    assert all(not s.charges for s in t.shares)


def test_a_removed_tenants_charges_stay_in_the_log(tmp_path: Path) -> None:
    rig, _ = gpu_rig(tmp_path, 1.0)
    rig.step(100)
    seconds = rig.engine.snapshot("b").gpu_seconds
    with capture_logs() as logs:
        rig.engine.remove("b")
    (line,) = [e for e in logs if e["event"] == "tenant removed"]
    assert sum(line["charged"]["gpu0/sm"].values()) == pytest.approx(seconds, abs=1e-3)
    assert set(line["charged"]["gpu0/sm"]) <= {f"signal/{s}" for s in ChargeSource}
