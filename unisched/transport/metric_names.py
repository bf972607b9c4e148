"""Every metric family the daemon exports, in one list: name, type, help and label names.

The collector (transport.metrics) builds its families from this list only, and the tests check the dashboard
(deploy/grafana/) and the exposition of a running daemon against it. Names follow Prometheus conventions: the
`unisched_` prefix, base units in the name (`_seconds`, `_bytes`, `_ratio` for 0..1), counters end in `_total`
(prometheus-client appends it to a counter's name here), and no series repeats another (a tenant's state is one
family with a `state` label). Labels follow dcgm-exporter's, so one PromQL join matches our series with its:
`gpu` (the NVML index) and `UUID` on every per-GPU series, `modelName` on unisched_gpu_info, and `namespace`,
`pod`, `container` on every per-tenant series (empty for a tenant that is no pod).
"""

from __future__ import annotations

from dataclasses import dataclass

from unisched.scheduler.labels import LABEL_KEYS

__all__ = ["FAMILIES", "GPU", "TENANT", "Family", "family", "sample_names"]

TENANT = ("tenant", *LABEL_KEYS)
"""Labels of every per-tenant series: our tenant name, and where an orchestrator runs it (scheduler.labels)."""
GPU = ("gpu", "UUID")
"""Labels of every per-GPU series: dcgm-exporter's index and UUID."""


@dataclass(frozen=True)
class Family:
    name: str
    """As prometheus-client is given it: a counter's samples are named `<name>_total`."""
    kind: str
    """gauge or counter."""
    help: str
    labels: tuple[str, ...]

    @property
    def sample(self) -> str:
        """The name its samples have in the exposition."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


FAMILIES = (
    Family("unisched_build_info", "gauge", "The unisched version and scheduling mode (always 1)", ("version", "mode")),
    Family("unisched_view_age_seconds", "gauge", "Age of the engine state this scrape reports (it grows when "
           "the daemon's loop is stuck)", ()),
    Family("unisched_tenants", "gauge", "Tenants known to the daemon", ()),
    Family("unisched_tenant_weight", "gauge", "Weight in effect (after tidal schedules)", TENANT),
    Family("unisched_tenant_base_weight", "gauge", "Configured weight", TENANT),
    Family("unisched_tenant_target_share_ratio", "gauge", "Share of the GPU engine domain the tenant is entitled "
           "to now (0..1)", (*TENANT, *GPU, "domain")),
    Family("unisched_tenant_measured_share_ratio", "gauge", "Share of the GPU engine domain the tenant got over "
           "the share window (0..1)", (*TENANT, *GPU, "domain")),
    Family("unisched_tenant_gpu_seconds", "counter", "GPU time charged to the tenant on the GPU engine domain",
           (*TENANT, *GPU, "domain")),
    Family("unisched_tenant_charged_seconds", "counter", "unisched_tenant_gpu_seconds by how each charge came: the rule "
           "that split the busy time (signal, process-rate, cpu-time; report: a cooperative report) and its source "
           "(alone, shared, beside-drain: thawed beside a tenant whose queued work drained, drain, frozen-tail, "
           "reported)", (*TENANT, *GPU, "domain", "rule", "source")),
    Family("unisched_tenant_slices", "counter", "Slices the tenant was given", TENANT),
    Family("unisched_tenant_session_refusals", "counter", "GPU sessions refused (kind=memory: memory-cap "
           "crossings)", (*TENANT, "kind")),
    Family("unisched_tenant_sessions", "gauge", "Live GPU sessions by kind", (*TENANT, "kind")),
    Family("unisched_tenant_session_cap", "gauge", "Session cap in effect (absent: unlimited)", (*TENANT, "kind")),
    Family("unisched_tenant_state", "gauge", "1 for the tenant's state (running, idle, frozen), 0 for the others",
           (*TENANT, "state")),
    Family("unisched_tenant_memory_used_bytes", "gauge", "Video memory the tenant holds on the GPU, counted "
           "exactly from the allocations and frees the session hooks see", (*TENANT, *GPU)),
    Family("unisched_tenant_memory_cap_bytes", "gauge", "Video memory cap per GPU (absent: none)", TENANT),
    Family("unisched_tenant_memory_reserve_bytes", "gauge", "Video memory kept for the tenant on the GPU (absent: "
           "none)", (*TENANT, *GPU)),
    Family("unisched_tenant_memory_refusals", "counter", "Video memory allocations refused at the hooks (the "
           "tenant's cap or other tenants' reserves)", (*TENANT, *GPU)),
    Family("unisched_tenant_memory_seen_bytes", "gauge", "GPU memory NVML lists for the tenant's processes "
           "(graphics ones; NVML does not list every CUDA process)", TENANT),
    Family("unisched_tenant_over_memory", "gauge", "1 while the daemon holds the tenant over its memory cap "
           "(new sessions refused)", TENANT),
    Family("unisched_tenant_processes", "gauge", "Processes in the tenant's cgroup", TENANT),
    Family("unisched_tenant_hook_calls", "counter", "GPU driver calls of the tenant's hooked processes that the "
           "session hooks were notified of (answered, or gone before the answer)", TENANT),
    Family("unisched_tenant_hook_answer_seconds", "counter", "Time from each hooked call's notification reaching "
           "the daemon to its answer, summed (its rate over unisched_tenant_hook_calls_total's is the mean wait the "
           "daemon adds to a call)", TENANT),
    Family("unisched_tenant_hook_send_seconds", "counter", "Time in the answers' own system calls, summed apart: "
           "the kernel's wake-up of the caller, and what the caller ran on the daemon's CPU before the call "
           "returned (its wait had ended)", TENANT),
    Family("unisched_tenant_hook_paced", "counter", "Of the hooked calls, those that waited for their turn of the "
           "hooks' budget (a listener's, or its owner's: a user's, or one of root's tenants) before the daemon took "
           "them: an app making driver calls faster than the budget is slowed to it", TENANT),
    Family("unisched_tenant_hook_paced_seconds", "counter", "The time unisched_tenant_hook_paced's calls waited "
           "for their turn, summed (apart from unisched_tenant_hook_answer_seconds)", TENANT),
    Family("unisched_tenant_hook_errors", "counter", "Hooked calls let through uncounted because handling them "
           "failed (a daemon bug: its log has each one)", TENANT),
    Family("unisched_tenant_hook_decisions", "counter", "Of the hooked calls, the new GPU sessions the daemon's event "
           "loop decided (admission against the caps): the only ones that wait for the loop", TENANT),
    Family("unisched_tenant_hook_decision_seconds", "counter", "Of unisched_tenant_hook_answer_seconds, the time to "
           "the answers of unisched_tenant_hook_decisions (a busy event loop shows here alone)", TENANT),
    Family("unisched_gpu_info", "gauge", "GPUs the daemon sees (always 1)", (*GPU, "modelName")),
    Family("unisched_gpu_utilization_ratio", "gauge", "Busy fraction (0..1) over the last slice per engine (sm: "
           "SMs, dec: NVDEC, enc: NVENC)", (*GPU, "engine")),
    Family("unisched_gpu_memory_used_bytes", "gauge", "GPU memory in use", GPU),
    Family("unisched_gpu_memory_total_bytes", "gauge", "GPU memory", GPU),
    Family("unisched_gpu_sample_ok", "gauge", "1 when the last NVML sample of the GPU succeeded (0: GPU lost, "
           "Xid)", GPU),
    Family("unisched_gpu_sliced", "gauge", "1 while the tenants of a GPU engine domain take turns (it is "
           "saturated), 0 while every tenant runs", (*GPU, "domain")),
    Family("unisched_gpu_open_hold_seconds", "gauge", "How long a GPU engine domain stays open whatever its busy "
           "fraction, because slicing left its turns unused (paced tenants)", (*GPU, "domain")),
    Family("unisched_gpu_charged_seconds", "counter", "GPU busy time charged to the freezer-governed tenants of a "
           "GPU engine domain, by the rule that split it among them (process-rate: CPU weighed by NVML's per-process "
           "samples; signal: by CPU activity; cpu-time: no GPU signal, CPU time stands in)", (*GPU, "domain", "rule")),
    Family("unisched_gpu_mixed_time_ratio", "gauge", "Where compute and graphics overlap partly: the part of the "
           "time each kind of slice gets (both, compute, graphics)", (*GPU, "kind")),
    Family("unisched_gpu_mixed_now", "gauge", "1 for the kind of mixed slice running now", (*GPU, "kind")),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    return _BY_NAME[name]


def sample_names() -> dict[str, Family]:
    """Each family by the name its samples carry (what PromQL names)."""
    return {f.sample: f for f in FAMILIES}
