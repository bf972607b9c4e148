"""structlog set-up: JSON lines when stderr is not a TTY, a readable console otherwise. When stderr is the
journal (systemd's $JOURNAL_STREAM names stderr's device and inode), every line starts with its syslog
priority, `<N>` (journald's SyslogLevelPrefix=, on by default), so `journalctl -p warning` filters by level."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Final, TextIO

import structlog

__all__ = ["SYSLOG_PRIORITY", "Throttle", "configure_logging", "stderr_is_journal"]

SYSLOG_PRIORITY: Mapping[str, int] = {
    "critical": 2, "error": 3, "exception": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7, "notset": 7,
}
"""structlog level name -> syslog priority (sd-daemon(3): <2> crit ... <7> debug)."""


def stderr_is_journal(stream: TextIO | None = None, env: Mapping[str, str] | None = None) -> bool:
    """True when `stream` (stderr) is the journal stream systemd connected, not merely inherited: a child whose
    stderr was redirected elsewhere keeps $JOURNAL_STREAM, so the device and inode must match (systemd.exec(5))."""
    env = os.environ if env is None else env
    stream = sys.stderr if stream is None else stream
    dev, _, ino = env.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


class _PriorityPrefix:
    """Wraps the renderer: `<N>` before every line of a rendered event (a console traceback spans lines)."""

    def __init__(self, renderer: structlog.typing.Processor) -> None:
        self._renderer = renderer

    def __call__(self, logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
        prefix = f"<{SYSLOG_PRIORITY.get(str(event_dict.get('level', name)), 6)}>"
        text = str(self._renderer(logger, name, event_dict))
        return prefix + text.replace("\n", "\n" + prefix)


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    json_lines = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    )
    if stderr_is_journal():
        renderer = _PriorityPrefix(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class Throttle:
    """At most one log line per key per interval; counts the lines held back so the next one can say so."""

    _MAX_KEYS: Final = 4096
    """Keys kept before old ones are forgotten (a user namespace can present many uids)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[object, tuple[float, int]] = {}

    def allow(self, key: object) -> int | None:
        """The number of lines held back since the last one when this one may go out; None to hold it back."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return None
        if len(self._last) >= self._MAX_KEYS:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval_s}
        self._last[key] = (now, 0)
        return 0 if last is None else last[1]
