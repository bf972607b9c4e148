"""Rationing a GPU held open for paced tenants: the rules that pick who sits out, step by step of a slice.

Why: paced tenants (games, video streams at a frame rate) that saturate the GPU only together each use a small part
of a turn, so the saturation gate holds the GPU open rather than slice it (policy.saturation). While it is held
open and still saturated (`policy.saturation.rationing`) every tenant may run, and those furthest ahead of their
weight share sit out, a step of a slice at a time, as many as still keep the GPU full: the weights hold without
turns that one tenant cannot fill. Pure: leads, counts and busy fractions passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from unisched.policy.tuning import TUNING

__all__ = ["Rationed", "SitOutCap", "ahead_rule", "out_runs", "sit_out_budget", "step_schedule"]


class Rationed(NamedTuple):
    """A tenant that may sit out of a rationed resource, as `step_schedule` weighs it."""

    name: str
    lead_s: float
    """GPU seconds it has had there beyond its weight share (FairShare.lead)."""
    weight: int
    used_s: float
    """GPU seconds it was charged there over the last slice."""
    ran_steps: int
    """Steps of the last slice it ran (was not sitting out)."""
    out_steps: int = 0
    """Steps in a row it has sat out up to now, across slices (`out_runs`)."""


def ahead_rule(lead_s: float, slice_s: float, lead_slices: float = TUNING.ration_lead_slices) -> bool:
    """On a rationed resource, a tenant sits out while it has had more than `lead_slices` slices of GPU time beyond
    its weight share (`lead_s`: its virtual time less the resource's virtual clock, times its weight; the clock is the
    lowest virtual time among the tenants that want it)."""
    return lead_s > lead_slices * slice_s


class SitOutCap(NamedTuple):
    """The most tenants that may sit out of a step of a resource held open (`sit_out_budget`)."""

    most: int
    age: int = 0
    """Slices since it was last lowered or raised."""


def sit_out_budget(out: int, cap: SitOutCap | None, util: float | None, high: float, low: float,
                   settle: int = 1, release: int = 0) -> tuple[int, SitOutCap | None]:
    """How many tenants ahead of their share may sit out of a rationed resource next slice, and the cap on that
    while the resource stays held open. `out`: how many sat out of the slice just read. One more after a saturated
    slice (>= `high`), one fewer after one with room: it tracks the most that keep the GPU full, since paced tenants
    can each use only so much of a slice. Where some sat out and the GPU read idle (under `low`, the gate's unused
    turn), their absence emptied it, and fewer than that may sit out: two tenants that fill the GPU only together
    do not ration. The cap is lowered at most once in `settle` slices (one GPU reading can span several) and, not
    lowered for `release` slices, rises by one (0: never), so that one dip does not hold it down for as long as the
    resource stays open. The plan clamps the budget to the most that did sit out of a step."""
    if cap is not None:
        cap = cap._replace(age=cap.age + 1)
    if util is not None and util >= high - 1e-9:
        budget = out + 1
    else:
        budget = max(0, out - 1)
        if out > 0 and (util is None or util < low) and (cap is None or cap.age >= settle):
            cap = SitOutCap(out - 1 if cap is None else min(cap.most, out - 1))
    if cap is not None and release and cap.age >= release:
        cap = SitOutCap(cap.most + 1)
    return (budget if cap is None else min(budget, cap.most)), cap


def out_runs(before: Mapping[str, int], steps: Sequence[frozenset[str]]) -> dict[str, int]:
    """How many steps in a row each tenant has sat out after `steps` (a slice's; () when nobody sat out of it), from
    `before` (at its start): a tenant that ran a step starts again from 0. Tenants at 0 are left out."""
    if not steps:
        return {}
    runs = dict(before)
    for out in steps:
        runs = {name: runs.get(name, 0) + 1 for name in out}
    return runs


def step_schedule(tenants: Iterable[Rationed], budget: int, steps: int, slice_s: float,
                  run_steps: int = TUNING.ration_run_steps) -> tuple[frozenset[str], ...]:
    """Who sits out of each of the `steps` steps of the next slice: in each, the `budget` tenants furthest ahead of
    their share (`ahead_rule`) as their lead will stand by then, furthest by virtual time (the lead over the weight),
    except that one that has sat out `run_steps` steps in a row goes after every other tenant ahead: it sits out
    again only where too few others are ahead to fill the budget.

    A tenant's lead falls by its weight's part of a step's GPU time for each step the others run, and rises by what
    it uses for each step it runs (its last slice's use per step it ran; where it did not run, the median of the
    others': paced tenants use much alike). So one far ahead sits out every step, while those a little ahead take
    turns step by step: a paced tenant that must sit out most of the time misses a step at a time between frames,
    instead of a slice or more (the frames due meanwhile, which players feel as stutter). With one step, the
    `budget` furthest ahead sit the slice out. The resource is taken as saturated (rationing needs it): the weights
    share all of each step.

    By virtual time, not GPU seconds: a tenant paced below its share (a heavy player at its frame rate) holds the
    resource's clock back, so every other tenant runs up a lead; ranked by GPU seconds, those would end up nearer
    equal GPU time whatever their weights (six players 1:2:4 in a model: 1:1.5 where 1:2 was owed)."""
    rows = list(tenants)
    total_w = sum(t.weight for t in rows)
    if not rows or budget <= 0 or total_w <= 0:
        return (frozenset(),) * steps
    step_s = slice_s / steps
    drop = {t.name: step_s * t.weight / total_w for t in rows}
    known = sorted(t.used_s / t.ran_steps for t in rows if t.ran_steps)
    usual = known[len(known) // 2] if known else step_s / len(rows)
    rise = {t.name: t.used_s / t.ran_steps if t.ran_steps else usual for t in rows}
    ran = dict.fromkeys(drop, 0)
    run = {t.name: t.out_steps for t in rows}
    out: list[frozenset[str]] = []
    for s in range(steps):
        ahead = sorted(((run[t.name] < run_steps, lead / t.weight, t.name) for t in rows
                        if ahead_rule(lead := t.lead_s + ran[t.name] * rise[t.name] - s * drop[t.name], slice_s)),
                       reverse=True)
        chosen = frozenset(name for *_, name in ahead[:budget])
        for name in ran:
            if name in chosen:
                run[name] += 1
            else:
                ran[name] += 1
                run[name] = 0
        out.append(chosen)
    return tuple(out)
