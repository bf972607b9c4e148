"""Weights that change by time of day (`tidal` mode): e.g. online serving heavy by day, training by night."""

from __future__ import annotations

import re
from dataclasses import dataclass

from unisched.policy.model import PolicyError, validate_tenant_name, validate_weight

__all__ = ["TidalSchedule", "TidalWindow", "parse_clock"]

_CLOCK_RE = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")
MINUTES_PER_DAY = 24 * 60


def parse_clock(text: str) -> int:
    """'HH:MM' -> minutes since midnight."""
    m = _CLOCK_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise PolicyError(f"time of day must be 'HH:MM' (00:00..23:59), got {text!r}")
    return int(m.group(1)) * 60 + int(m.group(2))


@dataclass(frozen=True)
class TidalWindow:
    """From `start` (inclusive) to `end` (exclusive), minutes since midnight; may wrap midnight."""

    tenant: str
    start: int
    end: int
    weight: int

    def __post_init__(self) -> None:
        validate_tenant_name(self.tenant)
        validate_weight(self.weight)
        for v in (self.start, self.end):
            if not 0 <= v < MINUTES_PER_DAY:
                raise PolicyError(f"tidal window minute out of range: {v}")
        if self.start == self.end:
            raise PolicyError(f"tidal window for {self.tenant!r} is empty (start == end)")

    def contains(self, minute: int) -> bool:
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end


@dataclass(frozen=True)
class TidalSchedule:
    windows: tuple[TidalWindow, ...] = ()

    def weight_at(self, tenant: str, base_weight: int, seconds_of_day: float) -> int:
        """The first window that covers the time wins; outside every window the base weight holds."""
        minute = int(seconds_of_day // 60) % MINUTES_PER_DAY
        for w in self.windows:
            if w.tenant == tenant and w.contains(minute):
                return w.weight
        return base_weight
