"""The client's errors: what the daemon refused, or that it could not be reached."""

from __future__ import annotations

__all__ = ["CodecRefused", "UnischedError", "UnischedUnavailable"]


class UnischedError(Exception):
    """The daemon refused a request (bad input, permission); str() says why."""


class UnischedUnavailable(UnischedError):
    """The daemon could not be reached when the client started (and fail_open was not asked for)."""


class CodecRefused(UnischedError):
    """The daemon did not admit a hardware codec session (cap reached, no such engine on this GPU)."""
