"""Injected time: the engine asks a Clock, tests advance a FakeClock; nothing sleeps to wait."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def seconds_of_day(self) -> float:
        """Local wall-clock seconds since midnight (tidal schedules)."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def seconds_of_day(self) -> float:
        t = time.localtime()
        return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec


class FakeClock:
    def __init__(self, start: float = 1000.0, seconds_of_day: float = 12 * 3600) -> None:
        self.now = start
        self.day = seconds_of_day

    def monotonic(self) -> float:
        return self.now

    def seconds_of_day(self) -> float:
        return self.day

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.day = (self.day + seconds) % 86400
