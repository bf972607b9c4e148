"""Each tenant's GPU seconds per CPU second, taken once a second from NVML's per-process samples, for the split
of a GPU's busy time among the tenants that ran (policy.charging.charge_rule). CPU time alone misleads where tenants
wait for a busy GPU by spinning in the driver: the more often one runs, the more it spins for each frame."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from unisched.policy import Engine
from unisched.policy.charging import gpu_per_cpu
from unisched.scheduler.context import Context
from unisched.scheduler.tenant import Tenant
from unisched.telemetry import GpuSample

__all__ = ["update_rates"]


def update_rates(c: Context, samples: Mapping[int, GpuSample], now: float,
                 pids_of: Callable[[Tenant], list[int]]) -> None:
    """Each freezer-governed tenant's rates (Tenant.gpu_rates) over the time since they were last taken: the SM busy
    fraction NVML gave its processes on each GPU over the cores it used meanwhile. A GPU where NVML showed none of
    its processes gives it no rate there, and the charge split falls back to CPU time for whoever it runs beside.

    Only for tenants whose GPU work NVML can see: under the session hooks (which count its contexts) and with no
    compute context or declared compute. NVML leaves CUDA processes out of its samples on the H200, so a tenant
    running CUDA beside a small render would show a rate of its render alone and pay for little of its GPU time."""
    shown = {i: s.process_sm for i, s in samples.items() if s.ok and s.process_sm}
    for t in c.tenants.values():
        if t.missing or c.leases.cooperative(t.name):
            continue
        last = t.rate_cpu
        t.rate_cpu = None if t.last_cpu is None else (t.last_cpu, now)
        t.gpu_rates = {}
        if not shown or last is None or t.last_cpu is None or now <= last[1] or not _visible(t):
            continue
        cores = (t.last_cpu - last[0]) / (now - last[1])
        pids = pids_of(t)
        for i, by_pid in shown.items():
            busy = [by_pid[pid] for pid in pids if pid in by_pid]
            rate = gpu_per_cpu(sum(busy) if busy else None, cores)
            if rate is not None:
                t.gpu_rates[i] = rate


def _visible(t: Tenant) -> bool:
    """Whether NVML's per-process samples can show all of the tenant's GPU work (see update_rates)."""
    return t.hooked and Engine.COMPUTE not in t.all_engines()
