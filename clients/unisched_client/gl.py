"""PyOpenGL: `FrameGate` gates each frame on the graphics lease and measures its GPU time with
GL_TIME_ELAPSED timer queries.

    frames = FrameGate(client)
    while running:
        with frames:             # waits for the lease; the frame's GL commands are timed
            draw()
            glFinish()           # or swap buffers

Needs a current GL context (>= 3.3 or ARB_timer_query). Query results are read when available, two frames
in flight at most, all drained when the lease ends.
"""

from __future__ import annotations

import ctypes

from unisched_client._extras import missing_extra

try:
    from OpenGL import GL
except ModuleNotFoundError as e:
    raise missing_extra(e, "gl") from None

from unisched_client._inflight import InFlight
from unisched_client.client import Client

__all__ = ["FrameGate"]


class FrameGate:
    def __init__(self, client: Client, max_in_flight: int = 2) -> None:
        self.gate = client.gate("graphics")
        self._free: list[int] = []
        self.flight: InFlight[int] = InFlight(
            self.gate, done=self._available, wait=self._wait, elapsed_s=self._elapsed, max_in_flight=max_in_flight
        )
        self._query = 0

    @staticmethod
    def _available(q: int) -> bool:
        out = (ctypes.c_uint * 1)()
        GL.glGetQueryObjectuiv(q, GL.GL_QUERY_RESULT_AVAILABLE, out)
        return bool(out[0])

    @staticmethod
    def _result_ns(q: int) -> int:
        out = (ctypes.c_uint64 * 1)()
        GL.glGetQueryObjectui64v(q, GL.GL_QUERY_RESULT, out)  # blocks until the result is there
        return int(out[0])

    def _wait(self, q: int) -> None:
        self._result_ns(q)

    def _elapsed(self, q: int) -> float:
        ns = self._result_ns(q)
        self._free.append(q)
        return ns / 1e9

    def __enter__(self) -> FrameGate:
        self.flight.acquire()
        self._query = self._free.pop() if self._free else int(GL.glGenQueries(1)[0])
        GL.glBeginQuery(GL.GL_TIME_ELAPSED, self._query)
        return self

    def __exit__(self, *exc: object) -> None:
        GL.glEndQuery(GL.GL_TIME_ELAPSED)
        self.flight.add(self._query)

    def drain(self) -> None:
        self.flight.drain()
