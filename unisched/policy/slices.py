"""How long the next slice lasts (pure; the random draw passed in).

A render's frames and the daemon's turns are both periodic. At a turn's end the tenant frozen keeps running the
work it had queued (its drain) beside the tenant thawed, and how much it had queued depends on where in its frame
the freeze fell. With turns of one fixed length that phase can lock in: one tenant is frozen early in its frames
turn after turn, the other late, so one drains more than the other at every hand-over. The busy time of an interval
is split by CPU activity, which a drain shows little of, so the tenant thawed pays for most of the drain beside it,
and a lasting difference between the two drains moves their shares. Turn lengths drawn at random around the slice
break the lock: the phases wander and the drains even out over the turns (tests/test_slices.py shows both in the
simulator).
"""

from __future__ import annotations

from unisched.policy.model import PolicyError

__all__ = ["JITTER_MAX", "jittered_slice"]

JITTER_MAX = 0.5
"""The largest jitter: a slice stays between half and one and a half of its length."""


def jittered_slice(slice_s: float, jitter: float, u: float) -> float:
    """`jitter` rule: the slice's length, `slice_s` scaled by 1 + jitter x (2u - 1) for a uniform draw `u` in
    [0, 1): between (1 - jitter) and (1 + jitter) of it, `slice_s` on average. `jitter` 0 (the default) keeps it."""
    if not 0.0 <= jitter <= JITTER_MAX:
        raise PolicyError(f"jitter must be within 0 .. {JITTER_MAX}, got {jitter}")
    if not 0.0 <= u < 1.0:
        raise PolicyError(f"u must be within [0, 1), got {u}")
    return slice_s * (1.0 + jitter * (2.0 * u - 1.0))
