"""SharedCall: a blocking call (the MPS control program behind Status) made once for every caller at a time."""

from __future__ import annotations

import asyncio
import threading

from unisched.transport.shared_call import SharedCall


def test_callers_at_once_share_one_call_and_its_answer_stays_fresh_for_a_while() -> None:
    release, calls, now = threading.Event(), [], [0.0]

    def fn() -> int:
        calls.append(1)
        release.wait(30)
        return len(calls)

    async def run() -> None:
        shared = SharedCall(fn, fresh_s=1.0, clock=lambda: now[0])
        waiting = [asyncio.ensure_future(shared.get()) for _ in range(20)]
        await asyncio.sleep(0)  # one turn of the loop: every caller is now awaiting (no time passes)
        waiting[0].cancel()  # a caller that gives up does not end the call for the others
        release.set()
        got = await asyncio.gather(*waiting[1:])
        assert got == [1] * 19 and len(calls) == 1
        now[0] = 0.9
        assert await shared.get() == 1 and len(calls) == 1  # still fresh
        now[0] = 1.0
        assert await shared.get() == 2 and len(calls) == 2  # asked again

    asyncio.run(run())
