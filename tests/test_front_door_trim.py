"""The front door gives a flood's heap back to the system, without letting a flood make that cost the loop more."""

from __future__ import annotations

import asyncio

import pytest


def test_heap_trims_after_floods_look_libc_up_once_and_come_at_most_once_a_minute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any local user can open and close 64 connections a second: each trim walks the heap on the event loop, and
    looking libc up ran `ldconfig -p` every time."""
    import ctypes.util

    from unisched.transport import frontdoor
    from unisched.transport.options import TRIM_AFTER_CLOSED, TRIM_EVERY_S

    looked_up = []
    find = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: looked_up.append(name) or find(name))
    frontdoor._malloc_trim.cache_clear()

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        delays: list[float] = []
        door = frontdoor.FrontDoor()
        monkeypatch.setattr(loop, "call_later", lambda delay, fn: delays.append(delay) or fn())
        for _ in range(2):
            for _ in range(TRIM_AFTER_CLOSED):
                door._per_uid[1000] += 1
                door._closed(asyncio.ensure_future(asyncio.sleep(0)), 1000)
        return delays

    delays = asyncio.run(main())
    frontdoor._malloc_trim.cache_clear()
    assert len(looked_up) <= 1
    assert len(delays) == 2 and delays[0] == 1.0 and delays[1] >= TRIM_EVERY_S - 1.0
