"""policy.rotation: waiting work served by owner in rotation, each owner's own in order (table-tested)."""

from __future__ import annotations

import pytest

from unisched.policy.rotation import Rotation

CASES = [
    ("one owner: in the order they came", [(1, "a0"), (1, "a1"), (1, "a2")], ["a0", "a1", "a2"]),
    ("a burst and a late call: the call waits for one of the burst",
     [(1, "a0"), (1, "a1"), (1, "a2"), (2, "b0")], ["a0", "b0", "a1", "a2"]),
    ("three owners in the order they first came", [(3, "c0"), (1, "a0"), (1, "a1"), (2, "b0"), (3, "c1")],
     ["c0", "a0", "b0", "c1", "a1"]),
]


@pytest.mark.parametrize(("pushes", "order"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_items_are_served_one_owner_at_a_time_in_rotation(pushes: list[tuple[int, str]], order: list[str]) -> None:
    r: Rotation[str] = Rotation()
    for owner, item in pushes:
        r.push(owner, item)
    assert len(r) == len(order)
    assert [r.pop() for _ in order] == order
    assert not r and len(r) == 0


def test_an_owner_that_comes_back_joins_the_back_of_the_rotation() -> None:
    r: Rotation[str] = Rotation()
    r.push(1, "a0")
    r.push(2, "b0")
    assert r.pop() == "a0"  # owner 1 has nothing left: out of the rotation
    r.push(1, "a1")
    r.push(2, "b1")
    assert [r.pop(), r.pop(), r.pop()] == ["b0", "a1", "b1"]
    with pytest.raises(IndexError):
        r.pop()
