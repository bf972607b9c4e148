"""Where a session supervisor's events go: its `on_event`, called at once without an event loop, or on the loop
(from the serving thread, after the answer, so that a callback never costs the caller anything)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from unisched.enforce.seccomp.accounting import SessionEvent

__all__ = ["EventOutlet"]

log = structlog.get_logger("unisched.seccomp")


class EventOutlet:
    """ONE supervisor's `on_event` (None: events go nowhere). `loop`: set when the supervisor is attached to one."""

    def __init__(self, tenant: str, on_event: Callable[[SessionEvent], None] | None) -> None:
        self.tenant = tenant
        self.loop: asyncio.AbstractEventLoop | None = None
        self._on_event = on_event

    def emit(self, events: list[SessionEvent]) -> None:
        """Report events: at once without a loop; with one, on the loop (dropped once it is closed)."""
        if not events or self._on_event is None:
            return
        if self.loop is None:
            self.emit_now(events)
            return
        try:
            self.loop.call_soon_threadsafe(self.emit_now, events)
        except RuntimeError:
            log.debug("event loop closed; session events dropped", tenant=self.tenant, n=len(events))

    def emit_now(self, events: list[SessionEvent]) -> None:
        """Report events on this thread; a failing callback is logged, never raised."""
        if self._on_event is None:
            return
        for event in events:
            try:
                self._on_event(event)
            except Exception:
                log.exception("seccomp on_event callback failed", tenant=self.tenant)
