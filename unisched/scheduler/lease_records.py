"""What LeaseBook keeps per lease session, per lease held and per cooperative tenant (plain records; the rules
that change them are scheduler.leases)."""

from __future__ import annotations

from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from unisched.enforce.leases import LeaseChannel
from unisched.policy import Engine, Resource
from unisched.policy.callers import Caller
from unisched.policy.leases import OverrunMeter

__all__ = ["CoopRecord", "LeaseRecord", "SessionRecord"]


@dataclass
class SessionRecord:
    id: int
    tenant: str
    gpu: int
    channel: LeaseChannel
    log: FilteringBoundLogger
    """Bound to the tenant and session once: the module's lazy logger re-binds on every call (~6-15 us per
    renewal, even for a debug line that is filtered out)."""
    debug: bool = False
    """Whether `log` writes debug lines (its level is fixed when it is bound): a renewal rounds and packs the fields
    of its debug lines only then, not for a call that drops them."""
    user: Caller | None = None
    """Who opened the session (a uid, or a pod: RegisterAsk.counted_as); None for an admin (LeaseBook.open)."""
    wants: dict[Engine, float] = field(default_factory=dict)
    """engine -> when the client last wanted or reported on it (demand while fresh)."""
    codec: dict[str, int] = field(default_factory=dict)
    """codec sessions admitted through this lease session, by kind (released when it closes)."""
    released: set[Engine] = field(default_factory=set)
    """Engines the client released and has not wanted since: a yield on one is not a renewal."""


@dataclass
class LeaseRecord:
    id: int
    engine: Engine
    contended: bool
    slice_left_s: float = 0.0
    jump: bool = False
    handed_at: float | None = None
    """When the holder before it yielded, for a lease granted at that hand-over: its first report measures the gap."""
    frozen_holder: str | None = None
    """The freezer-governed holder frozen as this lease was granted (None: none): the lease's first units queue
    behind that tenant's work in flight, which is charged to it (`LeaseCharges._frozen_drain`)."""


@dataclass
class CoopRecord:
    sessions: set[int] = field(default_factory=set)
    demand: frozenset[Resource] = frozenset()
    leases: dict[Resource, LeaseRecord] = field(default_factory=dict)
    meters: dict[Resource, OverrunMeter] = field(default_factory=dict)
