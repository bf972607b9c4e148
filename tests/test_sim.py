"""The simulator drives the real policy: 3:1 converges, drain is charged, idle tenants wake quickly."""

from __future__ import annotations

import pytest

from unisched.policy import SEPARATE_GRAPHICS, SHARED_SM, FairShareConfig, Resource
from unisched.sim import SimConfig, Simulation, bursty, cuda, idle, render

SM0 = Resource(0, "sm")


def test_three_to_one_converges_in_gpu_time_and_throughput() -> None:
    sim = Simulation([cuda("a", 300), cuda("b", 100)])
    res = sim.run(30.0, measure_from_s=2.0)
    shares = res.shares(SM0)
    assert shares["a"][0] == pytest.approx(0.75, abs=0.01)
    assert shares["a"][1] == pytest.approx(0.75)
    assert res.share_error_points() <= 1.0
    items = {t.name: t.items for t in res.tenants}
    assert items["a"] / items["b"] == pytest.approx(3.0, rel=0.03)
    assert res.efficiency() == pytest.approx((1.0, 1.0))
    # everything the GPU ran was charged to the policy
    stats = {s.name: s for s in sim.policy.stats(sim.now)}
    for name in ("a", "b"):
        assert stats[name].gpu_seconds == pytest.approx(sim.used(name)[SM0])


def test_drain_after_a_freeze_is_run_and_charged() -> None:
    """A deep CUDA queue (100 x 2 ms) keeps running after its freeze; that time is charged, and the closed
    loop still gives 1:1 against a tenant that syncs every kernel."""
    sim = Simulation([cuda("deep", 100, depth=100), cuda("sync", 100, depth=1)])
    drained = 0.0
    was_running = False
    for _ in range(400):
        before = sim.used("deep")[SM0]
        d = sim.step()
        ran = sim.used("deep")[SM0] - before
        if "deep" in d.waiting and was_running:
            drained += ran  # it was frozen for this whole slice, and its queue kept the GPU busy
            assert ran > 0
        was_running = "deep" in d.running
    assert drained > 1.0  # seconds of GPU time run while frozen
    stats = {s.name: s for s in sim.policy.stats(sim.now)}
    assert stats["deep"].gpu_seconds == pytest.approx(sim.used("deep")[SM0])  # the drain included
    res = sim.run(sim.now + 60.0, measure_from_s=sim.now)
    assert res.shares(SM0)["deep"][0] == pytest.approx(0.5, abs=0.01)
    assert res.efficiency()[0] == pytest.approx(1.0)


def test_idle_tenants_use_and_owe_nothing() -> None:
    sim = Simulation([cuda("a", 100), idle("nap", 10_000)])
    res = sim.run(5.0)
    nap = next(t for t in res.tenants if t.name == "nap")
    assert nap.gpu_s[SM0] == 0.0 and nap.expected_s[SM0] == 0.0
    assert next(t for t in res.tenants if t.name == "a").gpu_s[SM0] == pytest.approx(5.0)


def test_a_waking_tenant_runs_within_two_decisions_and_gets_its_share() -> None:
    sim = Simulation(
        [cuda("steady", 100), bursty(cuda("burst", 100), on_s=1.0, off_s=2.0, start_s=1.0, jitter=False)],
        SimConfig(policy=FairShareConfig(slice_s=0.05)),
    )
    res = sim.run(60.0, measure_from_s=0.5)
    assert len(res.wakes) == 20
    for w in res.wakes:
        assert w.share == pytest.approx(0.5)
        assert w.slices_to_run is not None and w.slices_to_run <= 2
        assert w.slices_to_share is not None and w.slices_to_share <= 2
    # only the idle detection costs anything: a slice or so per burst end
    assert res.efficiency()[0] >= 0.95


@pytest.mark.parametrize(("cmap", "together"), [(SEPARATE_GRAPHICS, True), (SHARED_SM, False)])
def test_compute_and_render_overlap_only_on_separate_graphics(cmap: object, together: bool) -> None:
    sim = Simulation([cuda("cuda", 100), render("render", 100)], SimConfig(contention=cmap))  # type: ignore[arg-type]
    res = sim.run(20.0, measure_from_s=2.0)
    used = {t.name: sum(t.gpu_s.values()) for t in res.tenants}
    if together:
        assert used["cuda"] == pytest.approx(18.0, rel=0.01) and used["render"] == pytest.approx(18.0, rel=0.01)
    else:
        assert used["cuda"] + used["render"] == pytest.approx(18.0, rel=0.01)
        assert used["cuda"] / used["render"] == pytest.approx(1.0, rel=0.05)


def test_same_seed_same_run() -> None:
    def once() -> tuple[object, ...]:
        tenants = [cuda("a", 300), bursty(render("b", 100), on_s=0.5, off_s=0.5)]
        res = Simulation(tenants, SimConfig(seed=7)).run(10.0)
        return (res.tenants, res.wakes)

    assert once() == once()


def test_time_slicing_two_queues_does_less_work_and_charges_each_half_the_wall_time() -> None:
    from unisched.policy import Engine
    from unisched.sim.gpu import SimResource, SimStream
    from unisched.sim.workload import StreamSpec

    res = SimResource(Resource(0, "sm"), efficiency=0.8)
    a, b = (SimStream(n, StreamSpec(Engine.COMPUTE, 0.01, 2), res) for n in "ab")
    for s in (a, b):
        s.submitting = True
        s.fill()
    res.advance(1.0)
    assert a.used == pytest.approx(0.5) and b.used == pytest.approx(0.5)
    assert a.done + b.done == pytest.approx(79, abs=1.5)  # 0.8 s of work in 1 s: 80 items of 10 ms, the last pair at 1 s
    b.submitting = False
    done = a.done
    res.advance(2.0)  # b's queue runs out soon; then a runs alone at full speed
    assert a.done - done > 95


@pytest.mark.parametrize("bad", [0.0, 1.5])
def test_bad_timeslice_efficiency_is_refused(bad: float) -> None:
    from unisched.policy import PolicyError

    with pytest.raises(PolicyError, match="timeslice_efficiency"):
        SimConfig(timeslice_efficiency=bad)


def test_long_turns_keep_more_of_a_pair_that_loses_work_to_time_slicing() -> None:
    """The mechanism bench/handover_model.py tabulates: a freeze (a revocation) leaves the queued units to run beside
    the next holder's, at the pair's time-slicing efficiency; turns of several units have fewer such overlaps."""
    from unisched.policy import Engine
    from unisched.sim.workload import SimTenant, StreamSpec

    def total(min_run_s: float) -> float:
        tenants = [SimTenant(n, w, (StreamSpec(Engine.COMPUTE, 0.03, 2),), min_run_s=min_run_s)
                   for n, w in (("a", 300), ("b", 100))]
        sim = Simulation(tenants, SimConfig(policy=FairShareConfig(slice_s=0.05), timeslice_efficiency=0.9))
        sim.run(2.0)
        before = {n: sim.items(n) for n in "ab"}
        sim.run(22.0)
        return sum(sim.items(n) - before[n] for n in "ab") * 0.03 / 20.0

    assert total(0.25) > total(0.0) + 0.02
