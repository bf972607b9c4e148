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


DISCARDS = [
    ("a waiting item leaves; the owner keeps its place", [(1, "a0"), (2, "b0"), (1, "a1")], (1, "a0"), True,
     ["a1", "b0"]),
    ("an owner's last item leaves: the owner leaves the rotation", [(1, "a0"), (2, "b0"), (3, "c0")], (2, "b0"), True,
     ["a0", "c0"]),
    ("an item that does not wait: nothing changes", [(1, "a0")], (1, "zz"), False, ["a0"]),
    ("an owner that does not wait: nothing changes", [(1, "a0")], (2, "a0"), False, ["a0"]),
]


@pytest.mark.parametrize(("pushes", "gone", "found", "order"), [c[1:] for c in DISCARDS], ids=[c[0] for c in DISCARDS])
def test_an_item_whose_caller_gave_up_leaves_the_rotation(pushes: list[tuple[int, str]], gone: tuple[int, str],
                                                          found: bool, order: list[str]) -> None:
    r: Rotation[str] = Rotation()
    items = {name: object() for _, name in pushes}  # discarded by identity, as the pacer's closures are
    names = {id(v): k for k, v in items.items()}
    for owner, name in pushes:
        r.push(owner, items[name])  # type: ignore[arg-type]
    assert r.discard(gone[0], items.get(gone[1], object())) is found  # type: ignore[arg-type]
    assert len(r) == len(order)
    assert [names[id(r.pop())] for _ in order] == order
    assert not r
