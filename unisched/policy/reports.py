"""What a cooperative report says about a freezer-governed tenant's work beside it (pure; times passed in).

A client times its units with a start and an end marker on its stream (CUDA events): the timer runs from the
unit's start to its end, whatever else the device ran in between. Beside a freezer-governed tenant's work the
units read longer than the client's own work: after that tenant's freeze (its queued work drains first) and after
a revoke (the client cannot stop mid-step, so its unit in flight, and the one queued behind it, run on beside the
tenant thawed for its turn, and the GPU time-slices the two). The time beyond the units' usual length is the other
tenant's work: charged to the client and taken off the busy time the other pays, it moves the weights twice,
and most for long steps (docs/design/scheduling.md, the `beside` rule).
"""

from __future__ import annotations

__all__ = ["EVEN_SLICING", "beside_excess", "learnable_tail", "report_pieces"]

EVEN_SLICING = 0.5
"""The other tenant's part of a report's time beside it when the units' usual length is unknown (a part of a unit
that a pause point ended, or no whole unit reported yet): two contexts the GPU time-slices get about even time."""


def learnable_tail(gpu_s: float, beside_s: float, unit_s: float | None, time_sliced: bool) -> float:
    """`learn` rule: of a report that ran `beside_s` beside a freezer-governed tenant's work (a tail after a revoke),
    the part the units' usual length may learn from. Where the GPU time-slices the two (graphics: a 28 ms frame beside
    a thawed render reads 56 ms), half the time beside is the other's. Where it may instead run the client's queued
    work first (`time_sliced` False: short CUDA steps at a hand-over), a tail's length tells nothing once a usual
    length is known, and is left out: counted half, such steps pull the usual length down (by about a tenth for
    1.7 ms steps), and the `beside` rule then takes that much of the client's real work off its charge at every turn,
    a few points of the GPU in the client's favour. With no usual length yet, half."""
    if not time_sliced and unit_s is not None:
        return 0.0
    return gpu_s - beside_excess(gpu_s, 0, None, beside_s, EVEN_SLICING)


def beside_excess(gpu_s: float, units: int, unit_s: float | None, most_s: float, unknown_share: float) -> float:
    """`beside` rule: of a report of `gpu_s` covering `units` whole units that ran beside a freezer-governed tenant's
    work, the time beyond their usual length (`unit_s`, the client's mean unit): the other tenant's work, which the
    client's timer counted. At most `most_s` (the report's time beside that work). Where the usual length is not
    known, `unknown_share` of the time beside it."""
    shared = min(gpu_s, most_s)
    if shared <= 0:
        return 0.0
    if units < 1 or unit_s is None:
        return unknown_share * shared
    return min(shared, max(0.0, gpu_s - unit_s * units))


def report_pieces(at: float, gpu_s: float, excess_s: float, since: float) -> tuple[tuple[float, float], ...]:
    """Where the client's own work of a report lies in time, as (end, seconds) pieces for
    `policy.charging.cooperative_part`. The report arrives at `at` and its timer's `gpu_s` spans [at - gpu_s, at]; the
    part of that span after `since` (when a freezer-governed tenant was thawed beside it) held `excess_s` of that
    tenant's work, and the client's own work there is the rest; before `since` the client ran alone. Placed whole
    at the report's end, the client's work before the thaw would be taken off the busy time the thawed tenant is
    charged, and it would run that much for free at every hand-over."""
    shared = max(0.0, min(gpu_s, at - since))
    pieces = ((at - shared, gpu_s - shared), (at, max(0.0, shared - excess_s)))
    return tuple(p for p in pieces if p[1] > 0)
