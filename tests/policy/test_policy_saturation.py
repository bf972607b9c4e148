"""The saturation gate: slice a resource only while it is busy (pure; samples passed in slice order)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from unisched.policy.model import PolicyError, Resource
from unisched.policy.saturation import GateState, SaturationConfig, SaturationGate, fresh_gate, gate_step

SM = Resource(0, "sm")
BASE = SaturationConfig(high=0.90, low=0.60, enter_slices=2, leave_slices=2, hold_slices=40, max_hold_slices=600,
                        reset_slices=40, cap_settle_slices=1, cap_release_slices=0)
"""The gate these tests start from (the daemon's own comes from its knobs and policy.tuning)."""


def new_gate(**changes: Any) -> SaturationGate:
    return SaturationGate(replace(BASE, **changes))


def feed(gate: SaturationGate, utils: list[float | None], contenders: int = 2) -> list[bool]:
    return [gate.observe(SM, u, contenders) for u in utils]


def test_open_until_saturated_for_two_slices_then_sliced_while_busy() -> None:
    gate = new_gate()
    assert feed(gate, [0.3, 0.5, 0.95]) == [True, True, True]  # one busy slice is not yet saturation
    assert feed(gate, [0.95]) == [False]
    assert feed(gate, [1.0, 0.9, 0.7, 0.61]) == [False] * 4  # a saturating holder keeps it sliced


def test_holders_leaving_the_gpu_idle_while_others_wait_open_it_again() -> None:
    gate = new_gate()
    feed(gate, [1.0] * 20)  # opened long ago: no flapping
    assert not gate.is_open(SM)
    assert feed(gate, [0.2, 0.2]) == [False, True]


def test_fewer_than_two_wanting_it_opens_at_once_and_no_signal_slices() -> None:
    gate = new_gate()
    feed(gate, [1.0, 1.0])
    assert not gate.is_open(SM)
    assert gate.observe(SM, 1.0, contenders=1)
    assert not gate.observe(SM, None, contenders=2)  # no GPU signal: slice, as before the gate


def test_slicing_that_leaves_turns_unused_is_held_off_longer_each_time() -> None:
    """Sixteen paced cloud instances read saturated but use a few ms of each 50 ms turn: sliced, they lost 55 of
    60 FPS on the H200. Each time slicing proves useless the resource stays open longer before it is tried again."""
    gate = new_gate(leave_slices=2, hold_slices=4, max_hold_slices=8)
    feed(gate, [1.0, 1.0])
    assert not gate.is_open(SM)
    assert feed(gate, [0.2] * 2) == [False, True]  # the holders left their turns unused: open
    assert gate.states() == (GateState(SM, sliced=False, held_slices=4),)  # what metrics show
    assert all(feed(gate, [1.0] * 4))  # held open for 4 slices although saturated
    assert feed(gate, [1.0]) == [False]  # tried again
    assert feed(gate, [0.2] * 2) == [False, True]
    assert all(feed(gate, [1.0] * 8))  # 8 this time
    assert feed(gate, [1.0]) == [False]
    assert feed(gate, [0.2] * 2) == [False, True]
    assert all(feed(gate, [1.0] * 8)) and feed(gate, [1.0]) == [False]  # capped at 8


def test_turns_used_keep_it_sliced_and_reset_the_hold() -> None:
    """A trainer's CUDA work can be invisible to utilization (PyTorch on the H200 VM): its busy CPU says it used
    its turn, so a render + training pair stays sliced; a long stretch of used turns resets the hold."""
    gate = new_gate(leave_slices=2, hold_slices=4, max_hold_slices=64, reset_slices=10)
    feed(gate, [1.0, 1.0])
    assert [gate.observe(SM, 0.0, 2, used=True) for _ in range(30)] == [False] * 30
    assert [gate.observe(SM, 0.0, 2, used=False) for _ in range(2)] == [False, True]
    assert all(feed(gate, [1.0] * 4)) and feed(gate, [1.0]) == [False]
    assert [gate.observe(SM, 1.0, 2, used=True) for _ in range(10)] == [False] * 10  # used: hold back to 4
    assert feed(gate, [0.2] * 2) == [False, True]
    assert all(feed(gate, [1.0] * 4)) and feed(gate, [1.0]) == [False]


def test_a_new_set_of_contenders_starts_without_a_hold() -> None:
    gate = new_gate(leave_slices=2, hold_slices=4)
    feed(gate, [1.0, 1.0, 0.2, 0.2])
    assert gate.is_open(SM)
    assert gate.observe(SM, 1.0, contenders=1)
    assert feed(gate, [1.0, 1.0]) == [True, False]


def test_disabled_gate_always_slices_and_bad_config_is_refused() -> None:
    gate = new_gate(high=0.0, low=0.0)
    assert feed(gate, [0.0, 0.1, 1.0]) == [False, False, False]
    with pytest.raises(PolicyError):
        replace(BASE, high=0.5, low=0.7)
    with pytest.raises(PolicyError):
        replace(BASE, enter_slices=0)


def test_saturation_is_the_mean_over_the_entry_window_not_every_slice() -> None:
    """A short window's busy fraction is noisy: a pair never idle on average must not be held open by one slice
    just below the line, and a load idle a few percent on average must not be sliced by one busy burst."""
    gate = new_gate(high=0.98, low=0.68, enter_slices=4)
    assert feed(gate, [1.0, 0.97, 1.0]) == [True] * 3  # not yet a full window
    assert feed(gate, [1.0]) == [False]  # mean 0.9925
    other = new_gate(high=0.98, low=0.68, enter_slices=4)
    assert all(feed(other, [1.0, 1.0, 0.94, 0.94] * 10))  # bursts of full slices, 97% on average: open


def test_a_hold_that_ends_while_rationed_is_renewed_instead_of_tried_again() -> None:
    """Paced tenants rationed on a GPU held open: when the hold ends it is renewed, doubling, without the try at
    turns that would stall every player for the others' turns (rationing keeps the weights meanwhile). A hold that
    ends with rationing off (the GPU had room) ends in a try, as before."""
    c = replace(BASE, leave_slices=2, hold_slices=4, max_hold_slices=16)
    s = fresh_gate(c)
    for u in (1.0, 1.0, 0.2, 0.2):  # sliced, turns unused: held open 4
        s = gate_step(c, s, u, 2)
    assert s.open and s.held == 4
    for _ in range(4):
        s = gate_step(c, s, 1.0, 2, rationed=True)
    assert s.open and s.held == 8  # renewed, doubled
    for _ in range(8):
        s = gate_step(c, s, 1.0, 2, rationed=False)
    assert s.open and s.held == 0
    assert gate_step(c, s, 1.0, 2).sliced  # tried again
