"""Each tenant's GPU seconds per CPU second, taken once a second from NVML's per-process samples, for the split
of a GPU's busy time among the tenants that ran (policy.charging.charge_rule). CPU time alone misleads where tenants
wait for a busy GPU by spinning in the driver: the more often one runs, the more it spins for each frame."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import structlog

from unisched.policy import Engine
from unisched.policy.charging import gpu_per_cpu, kept_rate
from unisched.scheduler.context import Context
from unisched.scheduler.tenant import Tenant
from unisched.telemetry import GpuSample

__all__ = ["update_rates"]

log = structlog.get_logger("unisched.scheduler")


def update_rates(c: Context, samples: Mapping[int, GpuSample], now: float,
                 pids_of: Callable[[Tenant], list[int]]) -> None:
    """Each freezer-governed tenant's rates (Tenant.gpu_rates) over the time since they were last taken: the SM busy
    fraction NVML gave its processes on each GPU over the cores it used meanwhile. A GPU where NVML showed none of
    its processes gives it no new rate there: its last one stands for a while (`policy.charging.kept_rate`), and
    after that the charge split falls back to CPU time for whoever it runs beside.

    Only for tenants whose GPU work NVML can see: under the session hooks (which count its contexts) and with no
    compute context or declared compute. NVML leaves CUDA processes out of its samples on the H200, so a tenant
    running CUDA beside a small render would show a rate of its render alone and pay for little of its GPU time."""
    shown = {i: s.process_sm for i, s in samples.items() if s.ok and s.process_sm}
    debug = log.is_enabled_for(logging.DEBUG)
    why: dict[str, object] = {}
    for t in c.tenants.values():
        if t.missing or c.leases.cooperative(t.name):
            continue
        last = t.rate_cpu
        t.rate_cpu = None if t.last_cpu is None else (t.last_cpu, now)
        if not _visible(t):
            t.gpu_rates = {}
            if debug:
                why[t.name] = "not visible"
            continue
        cores = None
        if last is not None and t.last_cpu is not None and now > last[1]:
            cores = (t.last_cpu - last[0]) / (now - last[1])
        pids = pids_of(t) if cores is not None and shown else []
        busy: dict[int, float] = {}
        for i in shown.keys() | t.gpu_rates.keys():
            by_pid = shown.get(i, {})
            seen = [by_pid[pid] for pid in pids if pid in by_pid]
            if seen:
                busy[i] = sum(seen)
            fresh = None if cores is None else gpu_per_cpu(busy.get(i), cores)
            rate = kept_rate(fresh, t.gpu_rates.get(i), now)
            if rate is None:
                t.gpu_rates.pop(i, None)
            else:
                t.gpu_rates[i] = rate
        if debug:
            why[t.name] = {"cores": None if cores is None else round(cores, 3),
                           "busy": {i: round(b, 3) for i, b in busy.items()},
                           "rates": {i: [round(r, 3), round(now - at, 2)] for i, (r, at) in t.gpu_rates.items()}}
    if debug:  # what NVML's per-process samples showed, and each tenant's rates (and their age) with what they came from
        log.debug("rates", now=round(now, 4), sampled={i: len(by_pid) for i, by_pid in shown.items()}, tenants=why)


def _visible(t: Tenant) -> bool:
    """Whether NVML's per-process samples can show all of the tenant's GPU work (see update_rates)."""
    return t.hooked and Engine.COMPUTE not in t.all_engines()
