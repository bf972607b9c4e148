"""Waiting work served by owner in rotation: each owner (a caller: a uid, or a pod, policy.callers) that waits gets
the next turn in order, its own items in the order they came. The rule that one user's pile of calls delays another
user's call by one item, not by the whole pile (the daemon's registrations and cgroup moves are served so)."""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from unisched.policy.callers import Caller

__all__ = ["Rotation"]

T = TypeVar("T")


class Rotation(Generic[T]):
    """Items waiting, per owner; `pop` takes the next owner's oldest item and sends that owner to the back."""

    def __init__(self) -> None:
        self._waiting: dict[Caller, deque[T]] = {}
        self._order: deque[Caller] = deque()
        """The owners that wait, the next to have a turn first."""

    def __len__(self) -> int:
        return sum(map(len, self._waiting.values()))

    def __bool__(self) -> bool:
        return bool(self._order)

    def push(self, owner: Caller, item: T) -> None:
        """`item` waits after `owner`'s earlier ones; an owner not waiting yet joins the back of the rotation."""
        mine = self._waiting.get(owner)
        if mine is None:
            mine = self._waiting[owner] = deque()
            self._order.append(owner)
        mine.append(item)

    def pop(self) -> T:
        """The next item in rotation (IndexError when none waits)."""
        owner = self._order.popleft()
        mine = self._waiting[owner]
        item = mine.popleft()
        if mine:
            self._order.append(owner)  # its next waits for every other owner's turn
        else:
            del self._waiting[owner]
        return item

    def discard(self, owner: Caller, item: T) -> bool:
        """Take `item` out of `owner`'s waiting ones (its caller gave up): what nobody waits for must not stay queued
        until its turn, or a caller that asks and gives up in a loop grows the queue without bound. False when it
        does not wait (it had its turn)."""
        mine = self._waiting.get(owner)
        if mine is None:
            return False
        for i, waiting in enumerate(mine):
            if waiting is item:
                del mine[i]
                break
        else:
            return False
        if not mine:
            del self._waiting[owner]
            self._order.remove(owner)
        return True
