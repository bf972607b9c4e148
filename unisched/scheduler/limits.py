"""A tenant's limits as a call changes them: set-limit, and the GPU memory terms `unisched run` (register) or an
adoption asks for when it makes a tenant. One path for all: validated as SessionLimits (sizes 0..1 PiB, a reserve
at most the cap), and a memory reserve kept only when it fits beside the other tenants' on every GPU it may use
(admission.check_reserve), so no way of making a tenant can promise memory a GPU does not have."""

from __future__ import annotations

from dataclasses import dataclass

from unisched.policy import PolicyError
from unisched.policy.caps import SessionLimits
from unisched.scheduler.admission import check_reserve
from unisched.scheduler.context import Context
from unisched.scheduler.tenant import SchedulerError

__all__ = ["NO_MEMORY_ASK", "MemoryAsk", "changed_limits", "memory_limits"]

CLEAR = -1
"""On the wire, a value that clears a limit back to its default (none, for memory)."""


@dataclass(frozen=True)
class MemoryAsk:
    """GPU memory terms a register or adopt call asks for, in bytes per GPU; None: not asked, -1: none."""

    cap: int | None = None
    reserve: int | None = None

    def reserves(self) -> bool:
        """Whether it asks to keep memory for the tenant (a reserve takes that memory from every other tenant)."""
        return self.reserve not in (None, CLEAR, 0)


NO_MEMORY_ASK = MemoryAsk()


def changed_limits(c: Context, name: str, old: SessionLimits, gpus: tuple[int, ...] | None, *,
                   render: int | None = None, decode: int | None = None, encode: int | None = None,
                   memory_bytes: int | None = None, memory_reserve: int | None = None) -> SessionLimits:
    """`old` with these changes (None keeps a value, -1 clears it), or SchedulerError('invalid') saying why not:
    a bad value, or a reserve that does not fit beside the other tenants' on some GPU of `gpus`."""

    def pick(new: int | None, was: int | None) -> int | None:
        if new is None:
            return was
        return None if new == CLEAR else new

    try:
        limits = SessionLimits(
            render=pick(render, old.render), decode=pick(decode, old.decode), encode=pick(encode, old.encode),
            memory_bytes=pick(memory_bytes, old.memory_bytes), memory_reserve=pick(memory_reserve, old.memory_reserve),
        )
        check_reserve(c, name, limits, gpus)
    except PolicyError as e:
        raise SchedulerError("invalid", str(e)) from None
    return limits


def memory_limits(c: Context, name: str, old: SessionLimits, gpus: tuple[int, ...] | None, ask: MemoryAsk,
                  is_admin: bool, creating: bool) -> SessionLimits:
    """`old` with the memory terms a register or adopt call asks for. A non-admin may cap a tenant it makes (that
    only limits itself) but not reserve memory (that takes it from others), nor change a known tenant's terms
    (its owner would undo an admin's cap): set-limit is for admins, and so is this."""
    if not is_admin and ask.reserves():
        raise SchedulerError("permission", f"only an admin may reserve GPU memory (tenant {name!r}): a reserve "
                                           "takes that memory from every other tenant")
    limits = changed_limits(c, name, old, gpus, memory_bytes=ask.cap, memory_reserve=ask.reserve)
    if not is_admin and not creating and (limits.memory_bytes, limits.memory_reserve) != (old.memory_bytes, old.memory_reserve):
        raise SchedulerError("permission", f"only an admin may change the GPU memory terms of tenant {name!r} "
                                           "once it exists (unisched set-limit)")
    return limits
