"""The 'dropped' lines of the daemon's client sockets (the gRPC door's and the lease stream's): why a connection was
dropped, throttled the same way for both."""

from __future__ import annotations

from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from unisched.logs import Throttle
from unisched.policy.callers import Caller
from unisched.transport.options import DROP_LOG_INTERVAL_S

__all__ = ["DropLog"]


@dataclass(frozen=True)
class DropLog:
    """Logs `event` for a dropped connection at most once per DROP_LOG_INTERVAL_S for each kind of reason and caller
    (PeerCred.caller: a uid, or a pod whatever uids its processes take; None over TLS), saying how many lines it held
    back: a caller opening connections only to have them dropped (hundreds a second) must not flood the log. `kind`
    names the reason apart from its text, which may carry numbers."""

    event: str
    throttle: Throttle = field(default_factory=lambda: Throttle(DROP_LOG_INTERVAL_S))

    def __call__(self, logger: FilteringBoundLogger, caller: Caller | None, kind: str, reason: str,
                 warn: bool = True) -> None:
        """`logger`: the connection's (bound to who it is); `warn`: a warning, else an info line."""
        held_back = self.throttle.allow((kind, caller))
        if held_back is not None:
            (logger.warning if warn else logger.info)(self.event, reason=reason, held_back=held_back)
