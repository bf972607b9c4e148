"""The saturation gate: slice a resource only while it is busy (pure; samples passed in slice order)."""

from __future__ import annotations

import pytest

from unisched.policy.model import PolicyError, Resource
from unisched.policy.saturation import SaturationConfig, SaturationGate

SM = Resource(0, "sm")


def feed(gate: SaturationGate, utils: list[float | None], contenders: int = 2) -> list[bool]:
    return [gate.observe(SM, u, contenders) for u in utils]


def test_open_until_saturated_for_two_slices_then_sliced_while_busy() -> None:
    gate = SaturationGate()
    assert feed(gate, [0.3, 0.5, 0.95]) == [True, True, True]  # one busy slice is not yet saturation
    assert feed(gate, [0.95]) == [False]
    assert feed(gate, [1.0, 0.9, 0.7, 0.61]) == [False] * 4  # a saturating holder keeps it sliced


def test_holders_leaving_the_gpu_idle_while_others_wait_open_it_again() -> None:
    gate = SaturationGate()
    feed(gate, [1.0] * 20)  # opened long ago: no flapping
    assert not gate.is_open(SM)
    assert feed(gate, [0.2, 0.2]) == [False, True]


def test_fewer_than_two_wanting_it_opens_at_once_and_no_signal_slices() -> None:
    gate = SaturationGate()
    feed(gate, [1.0, 1.0])
    assert not gate.is_open(SM)
    assert gate.observe(SM, 1.0, contenders=1)
    assert not gate.observe(SM, None, contenders=2)  # no GPU signal: slice, as before the gate


def test_re_saturating_soon_after_opening_doubles_the_wait_before_reopening() -> None:
    """Paced tenants that together overload the GPU settle into slicing instead of flapping every slice."""
    gate = SaturationGate(SaturationConfig(leave_slices=2, max_leave_slices=8, flap_slices=8))
    feed(gate, [1.0, 1.0])  # the first saturation is not a flap: 2 idle slices open it
    assert feed(gate, [0.2] * 2) == [False, True]
    feed(gate, [1.0, 1.0])  # saturated again 2 slices after opening: wait 4
    assert feed(gate, [0.2] * 4) == [False, False, False, True]
    feed(gate, [1.0, 1.0])  # again quickly: wait 8
    assert feed(gate, [0.2] * 8) == [False] * 7 + [True]
    feed(gate, [1.0, 1.0])  # capped at 8
    assert feed(gate, [0.2] * 8) == [False] * 7 + [True]
    feed(gate, [0.5] * 20)  # a long open stretch resets the wait
    feed(gate, [1.0, 1.0])
    assert feed(gate, [0.2, 0.2]) == [False, True]


def test_disabled_gate_always_slices_and_bad_config_is_refused() -> None:
    gate = SaturationGate(SaturationConfig(high=0.0, low=0.0))
    assert feed(gate, [0.0, 0.1, 1.0]) == [False, False, False]
    with pytest.raises(PolicyError):
        SaturationConfig(high=0.5, low=0.7)
    with pytest.raises(PolicyError):
        SaturationConfig(enter_slices=0)


def test_saturation_is_the_mean_over_the_entry_window_not_every_slice() -> None:
    """A short window's busy fraction is noisy: a pair never idle on average must not be held open by one slice
    just below the line, and a load idle a few percent on average must not be sliced by one busy burst."""
    gate = SaturationGate(SaturationConfig(high=0.98, low=0.68, enter_slices=4))
    assert feed(gate, [1.0, 0.97, 1.0]) == [True] * 3  # not yet a full window
    assert feed(gate, [1.0]) == [False]  # mean 0.9925
    other = SaturationGate(SaturationConfig(high=0.98, low=0.68, enter_slices=4))
    assert all(feed(other, [1.0, 1.0, 0.94, 0.94] * 10))  # bursts of full slices, 97% on average: open
