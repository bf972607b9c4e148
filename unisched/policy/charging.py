"""The rules that charge the freezer-governed tenants that ran on a resource in one interval: who pays the
busy time (`charge_rule`), less the work cooperative tenants reported for the same time (`cooperative_part`).
Pure: times passed in. Part of the scheduling model (docs/design/scheduling.md, "charging")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from unisched.policy.model import ChargeSource
from unisched.policy.plan import Rule
from unisched.policy.tuning import TUNING

__all__ = ["ReportMatch", "Unmatched", "charge_rule", "cooperative_part", "gpu_per_cpu", "kept_rate", "sources"]


@dataclass(frozen=True, slots=True)
class Unmatched:
    """An interval's busy time charged to the freezer-governed tenants that ran in it, that no report had yet shown to be a
    cooperative tenant's (a report that arrives later may)."""

    start: float
    end: float
    seconds: float


@dataclass(frozen=True)
class ReportMatch:
    """One resource's matching of cooperative reports against the busy time the freezer-governed tenants are charged."""

    unmatched: Unmatched | None = None
    credit_s: float = 0.0
    """Busy time already charged to freezer-governed tenants that a late report showed was cooperative work: taken off
    their next charge on the resource."""


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def cooperative_part(busy_s: float, start: float, end: float, reports: Sequence[tuple[float, float]],
                     state: ReportMatch, keep_s: float, charged: bool) -> tuple[float, ReportMatch]:
    """Of a resource's busy time over the interval [start, end], the part cooperative tenants did: their reports
    charge them for it, so the freezer-governed tenants that ran beside them are not charged it too (`charge_rule`'s
    `cooperative_s`). `reports`: (arrival, GPU seconds) of each report in the interval; a report covers the work
    just before its arrival, and arrives with the client's next renewal, so part of it can be work of an interval
    already charged: that part, up to what that interval charged the freezer-governed tenants beyond its own reports, is
    credited back to them (`ReportMatch.credit_s`). `charged`: freezer-governed tenants ran on the resource in the interval;
    `keep_s`: how late a report may be."""
    u = state.unmatched
    if u is not None and end - u.end > keep_s:
        u = None
    credit = state.credit_s
    in_now = 0.0
    for at, seconds in reports:
        if seconds <= 0:
            continue
        in_now += _overlap(at - seconds, at, start, end)
        if u is not None and u.seconds > 0:
            late = min(u.seconds, _overlap(at - seconds, at, u.start, u.end))
            u = replace(u, seconds=u.seconds - late)
            credit += late
    if not charged:
        return 0.0, ReportMatch(u, min(credit, keep_s))
    matched = min(busy_s, in_now)
    taken = min(busy_s - matched, credit)
    left = busy_s - matched
    return matched + taken, ReportMatch(Unmatched(start, end, left) if left > 0 else None, min(keep_s, credit - taken))


def charge_rule(util: float, dt: float, cpu_s: Sequence[float], activity_threshold: float,
                cooperative_s: float = 0.0, rates: Sequence[float | None] = ()) -> tuple[list[float], Rule]:
    """GPU seconds to charge each freezer-governed tenant that ran on a resource over the interval (`cpu_s`: their CPU
    seconds). With a GPU signal the busy time (utilization x interval, the drain of work the previous holder queued
    included), less `cooperative_s` that cooperative tenants did in it (`cooperative_part`), is split by CPU
    activity (evenly when none showed any); without one each tenant's CPU time stands in for GPU time, so the same
    engine runs (and is tested) on machines with no GPU. Less the reported part, because a freezer-governed tenant frozen
    while a client held the GPU still ran the few ms its freeze took, and would otherwise pay for the client's
    whole interval: beside a client it paid about twice its use, and got a third of the GPU at 1:1.

    `rates`: each tenant's GPU seconds per CPU second (`gpu_per_cpu`), where known for every one of them: then each
    one's CPU activity is weighed by its rate (PROCESS_RATE). CPU time alone misleads where tenants wait for a busy
    GPU by spinning in the driver: the more often one runs, the more it spins for each frame, so the ones that run
    most are overcharged (in the engine test, twelve such players 1:2:4 split by CPU alone got GPU time 1:1.4:2)."""
    if util > activity_threshold:
        busy = max(0.0, util * dt - cooperative_s)
        if cpu_s and len(rates) == len(cpu_s) and None not in rates:
            scaled = [c * (r or 0.0) for c, r in zip(cpu_s, rates, strict=True)]
            weighed = sum(scaled)
            if weighed > 0:
                return [busy * w / weighed for w in scaled], Rule.PROCESS_RATE
        total = sum(cpu_s)
        return [busy * (w / total if total > 0 else 1.0 / len(cpu_s)) for w in cpu_s], Rule.SIGNAL
    return list(cpu_s), Rule.CPU_TIME


def sources(ran_as: Sequence[ChargeSource], amounts: Sequence[float]) -> list[ChargeSource]:
    """The source of each of `charge_rule`'s `amounts` among the tenants that ran on a resource in an interval, from
    what each did in it (`ran_as`): SHARED thawed, DRAIN frozen in it (its queued work drained in it), FROZEN_TAIL
    frozen before it but using CPU. A thawed tenant is BESIDE_DRAIN where another one drained beside it, whatever
    that one was charged (its part of the busy time may hold that drain: docs/design/scheduling.md, the limit of the
    split), else ALONE where no other tenant was charged anything, else SHARED; the frozen ones keep theirs."""
    drained = ChargeSource.DRAIN in ran_as
    charged = sum(1 for x in amounts if x > 0)
    out: list[ChargeSource] = []
    for a, x in zip(ran_as, amounts, strict=True):
        if a is not ChargeSource.SHARED:
            out.append(a)
        elif drained:
            out.append(ChargeSource.BESIDE_DRAIN)
        else:
            out.append(ChargeSource.ALONE if charged - (x > 0) == 0 else ChargeSource.SHARED)
    return out


def gpu_per_cpu(gpu_busy: float | None, cpu_cores: float, min_cores: float = TUNING.rate_min_cpu_cores) -> float | None:
    """A tenant's GPU seconds per CPU second over a period: its processes' SM busy fraction as NVML's per-process
    samples gave it (`gpu_busy`; None where NVML showed none of them: it omits some processes, CUDA ones on the H200),
    over the cores it used meanwhile. None (unknown) below `min_cores` of CPU."""
    if gpu_busy is None or cpu_cores < min_cores:
        return None
    return max(0.0, gpu_busy) / cpu_cores


def kept_rate(fresh: float | None, kept: tuple[float, float] | None, now: float,
              keep_s: float = TUNING.rate_keep_s) -> tuple[float, float] | None:
    """A tenant's rate on a GPU, and when it was taken: the `fresh` one (`gpu_per_cpu`) where there is one, else the
    one `kept` (rate, taken at) for up to `keep_s` after it was taken, else none."""
    if fresh is not None:
        return fresh, now
    if kept is not None and now - kept[1] <= keep_s:
        return kept
    return None
