"""Session caps and device admission: which GPU sessions a tenant may open (render, decode, encode caps;
none while over its memory cap), which GPUs its cgroup may open, and whether a memory reserve fits."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import structlog

from unisched.enforce.bpf import DeviceAdmissionError
from unisched.policy import PolicyError
from unisched.policy import memory as policy_memory
from unisched.policy.caps import CapKind, SessionLimits, default_cap
from unisched.policy.memory import MemoryTerms
from unisched.policy.mps import mps_client_settings
from unisched.policy.waits import DRIVER_WAIT_ENV
from unisched.scheduler.context import Context
from unisched.scheduler.memory import gpu_totals, terms_of
from unisched.scheduler.tenant import (
    Tenant,
)

__all__ = [
    "admit", "admit_session", "apply_devices", "cap_of", "check_reserve", "client_env",
    "engines_changed", "gpu_memory_totals", "memory_terms", "session_freed", "update_memory_terms", "v2_dir",
]

log = structlog.get_logger("unisched.scheduler")
# Which session kinds (unisched.enforce.nvclasses.SessionKind values) a cap applies to.
_CAP_OF_KIND = {"graphics": CapKind.RENDER, "nvdec": CapKind.DECODE, "nvenc": CapKind.ENCODE}


def client_env(c: Context, t: Tenant) -> dict[str, str]:
    """What the tenant's processes start with: how the GPU driver waits (policy.waits), and MPS client settings
    where the daemon runs an MPS server and the tenant runs compute."""
    env = dict(DRIVER_WAIT_ENV)
    if c.mps is None:
        return env
    settings = mps_client_settings(t.all_engines(), t.priority, c.config.mode, c.config.mps_offline_sm_percent)
    return env if settings is None else {**env, **settings.env(c.mps.pipe_dir)}


def memory_terms(c: Context) -> Mapping[str, MemoryTerms]:
    """The GPU memory cap, reserve and GPUs of each tenant that has one; the session hooks read it from their own
    thread on every allocation, so it is kept up to date (`update_memory_terms`), not gathered from every tenant."""
    return c.memory_terms


def update_memory_terms(c: Context, name: str) -> None:
    """After tenant `name` was added or removed or its limits or GPUs changed: its entry in `c.memory_terms`, in a
    new mapping (the hooks' threads read the old one meanwhile). A tenant without a cap, a reserve or GPUs of its
    own has no entry (policy.memory: absent is none); a pinned one has, so that its memory on other GPUs is refused
    (MemoryLedger walks only the reserves, however many tenants are pinned)."""
    t = c.tenants.get(name)
    terms = terms_of(t.limits, t.gpus) if t is not None else None
    if terms is not None and terms.cap is None and not terms.reserve and terms.gpus is None:
        terms = None
    if c.memory_terms.get(name) == terms:
        return
    changed = dict(c.memory_terms)
    if terms is None:
        del changed[name]
    else:
        changed[name] = terms
    c.memory_terms = MappingProxyType(changed)


def gpu_memory_totals(c: Context) -> dict[int, int]:
    """Each GPU's memory in bytes (what reserves are checked against)."""
    return gpu_totals(c.telemetry.gpus())


def check_reserve(c: Context, name: str, limits: SessionLimits, gpus: tuple[int, ...] | None) -> None:
    """PolicyError when the tenant's memory reserve does not fit beside the other tenants' on some GPU. Without a
    reserve nothing can be refused, and every tenant's terms (a walk over all of them, on every registration) are
    not gathered."""
    if not limits.memory_reserve:
        return
    why = policy_memory.check_reserve(name, terms_of(limits, gpus), memory_terms(c), gpu_memory_totals(c))
    if why is not None:
        raise PolicyError(why)


def cap_of(c: Context, t: Tenant, kind: CapKind) -> int | None:
    configured = t.limits.get(kind)
    if configured is not None:
        return configured
    if c.video is None:
        return None  # no GPU seen: nothing to derive a cap from
    return default_cap(kind, _gpu_share(c, t), c.video)


def _gpu_share(c: Context, t: Tenant) -> float:
    """The tenant's weight share of its GPUs: its weight over the weights of every tenant with work there."""
    mine = c.policy.weight(t.name)
    total, each = _weights_on(c, frozenset(t.gpus or c.gpu_indices))
    return mine / (mine + total - each.get(t.name, 0))


def _weights_on(c: Context, gpus: frozenset[int]) -> tuple[int, Mapping[str, int]]:
    """The weights of the tenants with work on any of `gpus`: their sum, and each one's. Taken once a slice for each
    set of GPUs asked about (kept in `c.weights_on` until the tick's next demand update clears it), so that a session
    decision, which a hooked app retrying a refused session can ask for as fast as it is answered, is not a walk over
    every tenant; what tenants do changes the answer at the next slice."""
    got = c.weights_on.get(gpus)
    if got is None:
        each = {o.name: c.policy.weight(o.name) for o in c.tenants.values()
                if o.active and any(r.gpu in gpus for r in o.resources)}
        got = c.weights_on[gpus] = (sum(each.values()), MappingProxyType(each))
    return got


def admit_session(c: Context, tenant: str, kind: str, h_class: int) -> bool:
    """A new GPU session (seen by the seccomp supervisor on RM_ALLOC): admit it or refuse it (EPERM)."""
    t = c.tenants.get(tenant)
    if t is None:
        return True  # not ours (any more): never wedge a process
    return admit(c, t, kind, h_class) is None


def admit(c: Context, t: Tenant, kind: str, h_class: int) -> str | None:
    """Count a new session of `kind`, or refuse it: returns why (logged and counted), None when admitted.
    The one check for sessions seen by the hooks and sessions cooperative clients ask for."""
    cap_kind = _CAP_OF_KIND.get(kind)
    refuse_reason = None
    if cap_kind is not None and t.over_memory:
        refuse_reason = "over memory cap"
    elif cap_kind is not None:
        cap = cap_of(c, t, cap_kind)
        if cap is not None and t.sessions.get(kind, 0) >= cap:
            refuse_reason = f"{kind} cap {cap} reached"
    if refuse_reason is not None:
        t.refusals[kind] = t.refusals.get(kind, 0) + 1
        # an app retrying past its cap asks again at once: one warning a second per tenant and kind, saying how many
        # it held back (the counts stay exact in `refusals` and the metrics)
        held = c.session_refusals.allow((t.name, kind))
        (log.debug if held is None else log.warning)(
            "session refused", tenant=t.name, kind=kind, h_class=f"0x{h_class:04X}", reason=refuse_reason,
            held_back=held or 0)
        return refuse_reason
    before = t.all_engines()
    t.sessions[kind] = t.sessions.get(kind, 0) + 1
    if t.all_engines() != before:
        engines_changed(c, t)
    return None


def session_freed(c: Context, tenant: str, kind: str, count: int = 1) -> None:
    t = c.tenants.get(tenant)
    if t is None:
        return
    before = t.all_engines()
    t.sessions[kind] = max(0, t.sessions.get(kind, 0) - count)
    if t.all_engines() != before:
        engines_changed(c, t)


def engines_changed(c: Context, t: Tenant) -> None:
    """A session kind outside the tenant's declared engines came or went: its demand follows at once; the line saying
    so at most once an interval per tenant (c.engine_lines), held_back counting those between, as a tenant opening
    and freeing a session in a loop would otherwise write two lines a loop."""
    t.resources = c.contention.resources(t.gpus or c.gpu_indices, t.all_engines())
    if t.active:
        c.policy.set_demand(t.name, t.resources)
    held = c.engine_lines.allow(t.name)
    (log.debug if held is None else log.info)(
        "engines", tenant=t.name, engines=sorted(e.value for e in t.all_engines()), reason="sessions",
        held_back=held or 0)


def v2_dir(c: Context, t: Tenant) -> Path:
    return c.driver.mount / t.cgroup.lstrip("/")


def apply_devices(c: Context, t: Tenant) -> None:
    """Device admission: only the tenant's GPUs may be opened; none while it is over its memory cap."""
    if c.devices is None or c.driver.kind != "v2":
        return
    gpus: frozenset[int] | None = frozenset() if t.over_memory else (frozenset(t.gpus) if t.gpus else None)
    if gpus is None and not t.devices_admitted:
        return  # nothing to restrict
    try:
        c.devices.admit(v2_dir(c, t), gpus)
        t.devices_admitted = True
    except DeviceAdmissionError as e:
        log.error("device admission failed", tenant=t.name, error=str(e))
