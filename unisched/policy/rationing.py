"""Rationing a GPU held open for paced tenants: the rules that pick who sits out of a slice.

Why: paced tenants (games, video streams at a frame rate) that saturate the GPU only together each use a small part
of a turn, so the saturation gate holds the GPU open rather than slice it (policy.saturation). While it is held
open and still saturated (`policy.saturation.rationing`) every tenant may run, and those furthest ahead of their
weight share sit a slice out, as many as still keep the GPU full: the weights hold without turns that one tenant
cannot fill. Pure: leads, counts and busy fractions passed in.
"""

from __future__ import annotations

from collections.abc import Iterable

from unisched.policy.tuning import TUNING

__all__ = ["ahead_rule", "sit_out_budget", "sit_out_rule"]


def ahead_rule(lead_s: float, slice_s: float, lead_slices: float = TUNING.ration_lead_slices) -> bool:
    """On a rationed resource, a tenant sits out while it has had more than `lead_slices` slices of GPU time beyond
    its weight share (`lead_s`: its virtual time less the resource's virtual clock, times its weight; the clock is the
    lowest virtual time among the tenants that want it)."""
    return lead_s > lead_slices * slice_s


def sit_out_budget(out: int, cap: int | None, util: float | None, high: float,
                   low: float) -> tuple[int, int | None]:
    """How many tenants ahead of their share may sit out of a rationed resource next slice, and the cap on that
    while the resource stays held open. `out`: how many sat out of the slice just read. One more after a saturated
    slice (>= `high`), one fewer after one with room: it tracks the most that keep the GPU full, since paced tenants
    can each use only so much of a slice. Where some sat out and the GPU read idle (under `low`, the gate's unused
    turn), their absence emptied it, and fewer than that may sit out while it stays held open: two tenants that
    fill the GPU only together do not ration. `sit_out_rule` clamps the budget to how many did."""
    if util is not None and util >= high - 1e-9:
        budget = out + 1
    else:
        budget = max(0, out - 1)
        if out > 0 and (util is None or util < low):
            cap = out - 1 if cap is None else min(cap, out - 1)
    return (budget if cap is None else min(budget, cap)), cap


def sit_out_rule(leads: Iterable[tuple[float, str]], budget: int, slice_s: float) -> frozenset[str]:
    """Who sits out of a rationed resource next slice: of the tenants ahead of their share (`ahead_rule`; `leads`:
    each tenant's lead in GPU seconds and its name), the `budget` furthest ahead."""
    ahead = sorted((x for x in leads if ahead_rule(x[0], slice_s)), reverse=True)
    return frozenset(name for _, name in ahead[:budget])
