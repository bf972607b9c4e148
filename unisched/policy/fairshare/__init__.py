"""Weighted fair sharing of GPU resources by virtual time (the fairness math of unisched).

Each tenant keeps a virtual time per resource it uses: charging `s` GPU-seconds on a resource advances it
by `s / weight`. Each decision hands every contended resource to the runnable tenant furthest behind
(lowest virtual time relative to the resource's virtual clock), greedily, so tenants that do not contend
run together. Charges are what was *measured* (including the drain of queued work after a freeze), so
the loop is closed: whatever a slice really cost is paid back by waiting, and measured shares converge
to the weights whatever the slice length or drain.

Work conservation: only tenants with demand take part; an idle tenant neither runs a slice nor
accumulates credit beyond the lag limit, so it cannot hoard the GPU when it wakes, and it gets its share
back at the first decision after its demand is seen.

Cost. `decide` runs every slice, so it does not walk or sort the tenants. Each resource keeps min-heaps of
the tenants active on it, by kind (tenants that use only this resource, "single", and those that use several,
"multi") and, in preemptive mode only, by priority class. Entries are keyed by virtual time, lazily: a charge
only raises the tenant's value, and an entry whose key lags its value is re-placed when it reaches the top
(a vtime never decreases while its tenant has demand, so a lagging key is a lower bound); dead entries (demand
withdrawn) are dropped when they surface. On one resource the single tenants share the clock, so they rank by
vtime alone: only the heap top, or the holder when it ties with it, can win. A multi-resource tenant can only
win if no single one is ahead of it on any of its resources; only those few enter the greedy, which then picks
exactly what the greedy over every active tenant would. A decision costs O(R log N) for R contended resources
(plus the multi-resource tenants that pass that test), and a charge O(1); only `Decision.waiting`, a set of
every waiting tenant, is O(N) (a copy in C). `stats` and `target_shares` walk all tenants (reporting).
Ties in virtual time that exist only through float rounding of (vtime - clock) may break differently than a
full sort by that difference would; exact ties break as they always did (holder first, then name).
"""

from __future__ import annotations

from unisched.policy.fairshare.book import Decision, FairShareConfig, TenantStats
from unisched.policy.fairshare.share import WeightedFairShare

__all__ = ["Decision", "FairShareConfig", "TenantStats", "WeightedFairShare"]
