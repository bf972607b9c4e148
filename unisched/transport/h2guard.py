"""What one HTTP/2 connection's frames may cost the event loop (grpcdoor's _Connection).

The limit on calls in flight does not bound a connection's work: h2 answers every PING and SETTINGS at once, and
grpclib starts a task for every stream a HEADERS frame opens, even one the client resets in the same read ("rapid
reset", CVE-2023-44487), so the stream is closed again before the limit counts it: one read (up to 256 KiB) of
such pairs, or of PINGs, would be seconds of work on the loop. So a connection's bytes are handed to h2
FEED_PER_TURN at a time, one slice per turn of the loop, and a connection that resets more than RESETS_PER_WINDOW
streams, or sends more than CONTROL_PER_WINDOW control frames, within one WINDOW_S is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container

from h2.events import (
    DataReceived,
    Event,
    PingAckReceived,
    PingReceived,
    PriorityUpdated,
    RemoteSettingsChanged,
    RequestReceived,
    SettingsAcknowledged,
    StreamReset,
    UnknownFrameReceived,
    WindowUpdated,
)

__all__ = ["CONTROL_PER_CALL", "CONTROL_PER_WINDOW", "FEED_PER_TURN", "RESETS_PER_WINDOW", "WINDOW_S", "FrameBudget"]

FEED_PER_TURN = 16 * 1024
"""Bytes of one connection given to h2 in one turn of the loop (about 1,000 frames of the smallest kinds: tens of
milliseconds at most); the rest of a read waits for the next turns, with the connection's reading paused."""
WINDOW_S = 1.0
RESETS_PER_WINDOW = 64
"""Streams a connection may reset within WINDOW_S in the same slice of its bytes that opened them (rapid reset).
A call reset later (its deadline passed, or its caller went away: an honest client with short deadlines against a
slow daemon resets many) is not counted: it was open for a turn of the loop at least, so the calls-in-flight
limit bounds those."""
CONTROL_PER_WINDOW = 512
"""PING, SETTINGS, WINDOW_UPDATE, PRIORITY, unknown frames and empty DATA frames a connection may send within
WINDOW_S besides those its calls earn (CONTROL_PER_CALL): keepalive PINGs and settings now and then. A flood of
them is answered frame by frame on the loop."""
CONTROL_PER_CALL = 16
"""Control frames each call opened within WINDOW_S adds to the connection's allowance: a gRPC client sends a few
per call (flow-control updates, a bandwidth-probing PING and its answer), so a client making calls back to back
sends thousands a second. A call costs the loop far more than the frames it earns."""
_CONTROL = (PingReceived, PingAckReceived, RemoteSettingsChanged, SettingsAcknowledged, WindowUpdated, PriorityUpdated,
            UnknownFrameReceived)


class FrameBudget:
    """Counts one connection's stream resets and control frames in fixed windows of WINDOW_S by `clock`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since = clock()
        self.resets = 0
        self.control = 0
        self.calls = 0

    def over(self, event: Event, opened: Container[int] = ()) -> str | None:
        """Count `event` (`opened`: the streams the slice of bytes it came in opened); why the connection must be
        dropped once it is past a bound, else None."""
        if isinstance(event, RequestReceived):
            self._tick()
            self.calls += 1
            return None
        if isinstance(event, StreamReset):
            if not event.remote_reset or event.stream_id not in opened:
                return None
            self._tick()
            self.resets += 1
            return f"reset more than {RESETS_PER_WINDOW} streams in {WINDOW_S:g} s" \
                if self.resets > RESETS_PER_WINDOW else None
        if isinstance(event, _CONTROL) or (isinstance(event, DataReceived) and not event.flow_controlled_length):
            self._tick()
            self.control += 1
            allowed = CONTROL_PER_WINDOW + CONTROL_PER_CALL * self.calls
            return f"sent more than {allowed} control frames in {WINDOW_S:g} s" if self.control > allowed else None
        return None

    def _tick(self) -> None:
        now = self._clock()
        if now - self._since >= WINDOW_S:
            self._since, self.resets, self.control, self.calls = now, 0, 0, 0
