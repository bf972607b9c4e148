"""The `jitter` rule (policy.slices): slices of random length around the slice, so that frames do not lock in
phase with the turns; in the engine's tick (`slice_jitter`) and in the simulator."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from leaserig import SLICE, LeaseRig

from unisched.policy import PolicyError
from unisched.policy.slices import jittered_slice
from unisched.scheduler.config import ConfigError, DaemonConfig, load_config
from unisched.sim import SimConfig, Simulation, render


@pytest.mark.parametrize(("slice_s", "jitter", "u", "length"), [
    (0.05, 0.0, 0.9, 0.05),  # off: the slice as it is, whatever the draw
    (0.05, 0.1, 0.0, 0.045),  # the shortest
    (0.05, 0.1, 0.5, 0.05),  # the middle draw: the slice
    (0.05, 0.1, 0.75, 0.0525),
    (0.05, 0.5, 0.0, 0.025),  # the largest jitter: half the slice at least
    (0.02, 0.25, 0.25, 0.0175),
])
def test_jittered_slice(slice_s: float, jitter: float, u: float, length: float) -> None:
    assert jittered_slice(slice_s, jitter, u) == pytest.approx(length)


@pytest.mark.parametrize(("jitter", "u"), [(-0.1, 0.5), (0.6, 0.5), (0.1, 1.0), (0.1, -0.01)])
def test_jittered_slice_refuses_bad_input(jitter: float, u: float) -> None:
    with pytest.raises(PolicyError):
        jittered_slice(0.05, jitter, u)


def test_slice_jitter_is_off_unless_asked_and_bounded(tmp_path: Path) -> None:
    assert DaemonConfig().slice_jitter == 0.0
    path = tmp_path / "c.toml"
    path.write_text("[policy]\nslice_jitter = 0.6\n")
    with pytest.raises(ConfigError, match="slice_jitter"):
        load_config(path)
    path.write_text("[policy]\nslice_jitter = 0.1\n")
    assert load_config(path).slice_jitter == 0.1


def _lengths(tmp: Path, jitter: float, n: int = 200) -> list[float]:
    rig = LeaseRig(tmp, slice_jitter=jitter)
    rig.engine._c.rng = random.Random(7)
    out = []
    for _ in range(n):
        start = rig.clock.now
        delay = rig.tick()
        assert rig.engine.next_tick == pytest.approx(start + delay)  # the loop sleeps until the slice's end
        out.append(delay)
        rig.clock.advance(delay)
    return out


def test_tick_draws_each_slice_within_the_jitter(tmp_path: Path) -> None:
    lengths = _lengths(tmp_path, 0.2)
    assert all(0.8 * SLICE - 1e-12 <= x <= 1.2 * SLICE + 1e-12 for x in lengths)
    assert max(lengths) - min(lengths) > 0.3 * SLICE  # they do vary
    assert sum(lengths) / len(lengths) == pytest.approx(SLICE, rel=0.03)  # around the slice


def test_tick_without_jitter_keeps_every_slice(tmp_path: Path) -> None:
    assert set(_lengths(tmp_path, 0.0, 20)) == {SLICE}


def _drains(jitter: float, frame_s: float = 0.029, seconds: float = 60.0) -> dict[str, float]:
    """Two renders at 1:1 in the simulator: each one's GPU time while frozen (its drain), a turn of its own."""
    sim = Simulation([render("a", frame_s=frame_s, depth=1), render("b", frame_s=frame_s, depth=1)],
                     SimConfig(slice_jitter=jitter, seed=1))
    drained = {"a": 0.0, "b": 0.0}
    turns = {"a": 0, "b": 0}
    used = {n: sum(sim.used(n).values()) for n in drained}
    while sim.now < seconds:
        sim.step()
        for n in drained:
            now_used = sum(sim.used(n).values())
            if sim.frozen(n):
                drained[n] += now_used - used[n]
            else:
                turns[n] += 1
            used[n] = now_used
    return {n: drained[n] / turns[n] for n in drained}


def test_jitter_evens_out_the_drains_that_locked_phases_make_unequal() -> None:
    """With turns of one length the frames lock in phase with them: one render drains ~3.7 ms a turn more than the
    other (a lasting error, as the tenant thawed pays for most of the drain beside it); with turns +-10% they
    drain alike."""
    fixed = _drains(0.0)
    assert abs(fixed["a"] - fixed["b"]) > 0.002
    jittered = _drains(0.1)
    assert abs(jittered["a"] - jittered["b"]) < 0.001


def test_sim_refuses_a_jitter_past_the_bound() -> None:
    with pytest.raises(PolicyError):
        SimConfig(slice_jitter=0.7)
