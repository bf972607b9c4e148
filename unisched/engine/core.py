"""The kernel engine: tenants are cgroups, and each slice the engine measures, charges, decides and
freezes or thaws.

`KernelEngine.tick()` is one synchronous step (measure the interval that just ended -> charge the policy ->
update demand -> observe the gates -> decide -> plan -> freeze/thaw, grant/revoke); the asyncio runner calls it
every slice. The rules of each step are policy.plan's (docs/design/scheduling.md): the engine measures and applies.
Time comes from an injected Clock, so tests drive it step by step with a FakeClock and fake cgroups.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from unisched.enforce.cgroups import CgroupDriver, CgroupError, adopt_refusal, within
from unisched.enforce.devices import DeviceAdmission, DeviceAdmissionError
from unisched.enforce.leases import LeaseChannel
from unisched.enforce.mps import MpsControl, MpsStatus
from unisched.enforce.seccomp.memory import MemoryLedger
from unisched.engine.clock import Clock
from unisched.engine.config import ConfigError, DaemonConfig, DeclaredTenant
from unisched.engine.labels import LabelError, validate_labels
from unisched.engine.leases import LeaseBook, LeaseError
from unisched.engine.memory import GpuMemory, gpu_memory, gpu_totals, reserve_refusal, terms_of
from unisched.engine.state import SavedTenant, StateStore
from unisched.policy import (
    DEFAULT_WEIGHT,
    SHARED_SM,
    ContentionMap,
    Decision,
    Engine,
    FairShareConfig,
    Mode,
    PolicyError,
    Priority,
    Resource,
    TenantSpec,
    WeightedFairShare,
    validate_tenant_name,
    validate_weight,
)
from unisched.policy.caps import CapKind, SessionLimits, VideoEngines, default_cap, video_engines_for
from unisched.policy.contention import PARTIAL_OVERLAP
from unisched.policy.memory import MemoryTerms
from unisched.policy.mps import mps_client_settings
from unisched.policy.overlap import OverlapMix, SliceKind
from unisched.policy.plan import (
    GateOutcome,
    KernelUse,
    PairMember,
    PairWeights,
    Plan,
    PlanConfig,
    PlanInputs,
    PlanState,
    ReportMatch,
    Rule,
    TenantView,
    charge_rule,
    cooperative_part,
    demand_rule,
    observe,
    pair_weights,
    plan,
)
from unisched.policy.saturation import GateState, gate_states
from unisched.policy.tuning import TUNING
from unisched.telemetry import GpuSample, GpuTelemetry

__all__ = ["MAX_TENANTS", "MAX_USER_TENANTS", "EngineError", "KernelEngine", "LeaseAck", "TenantSnapshot"]

log = structlog.get_logger("unisched.engine")
MEMORY_CHECK_S = 1.0
SAVE_DELAY_S = 0.5
"""Registrations are written to the state file by the tick at most this long after them: one write per burst
instead of one fsync'ed rewrite of every tenant per call, at the cost of that window's entries on a crash."""
MAX_TENANTS = 10_000
"""Tenants one daemon keeps (each is a cgroup, a state entry and a policy entry)."""
MAX_USER_TENANTS = 32
"""Tenants one non-admin uid may create: creating tenants must not be a way to exhaust the daemon."""
MAX_MESSAGE_CHARS = 400
"""Error messages echo requests; clipped so that a 60 KiB name cannot make an error larger than gRPC's metadata
limit (the client then saw RESOURCE_EXHAUSTED 'metadata size exceeds hard limit' instead of the reason)."""


class EngineError(Exception):
    """A request the engine refuses. `kind` is not_found, invalid, permission or failed."""

    def __init__(self, kind: str, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ResourceShare:
    resource: Resource
    target: float
    measured: float
    gpu_seconds: float = 0.0
    """GPU time charged on this resource since the tenant was added."""


@dataclass(frozen=True)
class TenantSnapshot:
    """One tenant as `unisched tenants`, metrics and logs see it."""

    name: str
    weight: int
    base_weight: int
    priority: Priority
    pids: tuple[int, ...]
    state: str
    target_share: float
    measured_share: float
    gpu_seconds: float
    cgroup: str
    engines: frozenset[Engine]
    shares: tuple[ResourceShare, ...]
    slices: int
    owner_uid: int
    adopted: bool
    sessions: Mapping[str, int] = field(default_factory=dict)
    refusals: Mapping[str, int] = field(default_factory=dict)
    caps: Mapping[str, int | None] = field(default_factory=dict)
    memory_cap: int | None = None
    memory_reserve: int | None = None
    memory_bytes: int = 0
    over_memory: bool = False
    devices: str | None = None
    cooperative: bool = False
    overrun_s: float = 0.0
    enforced: bool = False
    unit_s: float | None = None
    """Cooperative: the mean GPU time of its units, once it reported counted ones."""
    turn_s: float = 0.0
    """Cooperative: its minimum run (Tuning.run_units units, capped), 0 when its units are short."""
    env: Mapping[str, str] = field(default_factory=dict)
    """What its processes start with (`unisched run` sets it): the MPS client settings while the daemon runs MPS."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Where an orchestrator runs it (engine.labels: pod, namespace, container), for metrics."""
    gpu_memory: tuple[GpuMemory, ...] = ()
    """Video memory per GPU as the session hooks count it (exact), with its cap, reserve and refusals."""


@dataclass(frozen=True)
class LeaseAck:
    """The engine's answer to a want or a report: does the tenant hold the engine now."""

    engine: Engine
    held: bool
    lease: int


# Which session kinds (unisched.enforce.nvclasses.SessionKind values) a cap applies to, and the engine
# whose demand an open session shows.
_CAP_OF_KIND = {"graphics": CapKind.RENDER, "nvdec": CapKind.DECODE, "nvenc": CapKind.ENCODE}
_ENGINE_OF_KIND = {"graphics": Engine.GRAPHICS, "compute": Engine.COMPUTE, "nvdec": Engine.DECODE, "nvenc": Engine.ENCODE}


@dataclass
class _Tenant:
    name: str
    base_weight: int
    priority: Priority
    engines: frozenset[Engine]
    gpus: tuple[int, ...] | None
    cgroup: str
    adopted: bool
    owner_uid: int
    frozen: bool = False
    last_cpu: float | None = None
    idle_run: int = 0
    active: bool = False
    missing: bool = False
    resources: frozenset[Resource] = field(default_factory=frozenset)
    limits: SessionLimits = field(default_factory=SessionLimits)
    sessions: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    memory_bytes: int = 0
    over_memory: bool = False
    devices_admitted: bool = False
    encoder_mismatch: int = 0
    """Consecutive once-a-second checks where NVML's encoder session list disagreed with `sessions`."""
    hooked: bool = False
    """Session hooks govern (some of) its processes: its session counts say when it holds a GPU context."""
    nvml_on_gpu: bool = True
    """NVML lists one of its processes on a GPU (refreshed once a second; True while unknown)."""
    ephemeral: bool = False
    """Made by `unisched run` without --keep: removed once its last process has exited (`_reap_emptied`)."""
    labels: Mapping[str, str] = field(default_factory=dict)

    def saved(self) -> SavedTenant:
        return SavedTenant(
            self.name, self.base_weight, self.priority, self.engines, self.gpus,
            self.cgroup, self.adopted, self.owner_uid, self.limits, self.ephemeral, self.labels,
        )

    def all_engines(self) -> frozenset[Engine]:
        """Declared engines plus those its open sessions show (an open decoder is demand on NVDEC)."""
        seen = {_ENGINE_OF_KIND[k] for k, n in self.sessions.items() if n > 0 and k in _ENGINE_OF_KIND}
        return self.engines | seen


def _state(t: _Tenant, holds_lease: bool | None = None) -> str:
    """holds_lease: None for a kernel tenant; for a cooperative one, whether it holds a lease now."""
    if t.frozen:
        return "frozen"
    if holds_lease is not None and t.active and not holds_lease:
        return "waiting"
    return "running" if t.active else "idle"


def _parse_engine(name: str) -> Engine:
    try:
        return Engine(name)
    except ValueError:
        raise EngineError("invalid", f"engine must be one of {', '.join(e.value for e in Engine)}; got {name[:40]!r}") from None


CALLER_GONE = "the connecting process has exited"
"""Why a call that would act on the caller's process is refused once that process is gone."""


def _need_alive(alive: Callable[[], bool] | None) -> None:
    if alive is not None and not alive():
        raise EngineError("failed", CALLER_GONE)


def _parse_engines(names: Iterable[str]) -> frozenset[Engine]:
    try:
        engines = frozenset(Engine(n) for n in names)
    except ValueError:
        raise EngineError("invalid", f"engines must be among {', '.join(e.value for e in Engine)}; got {list(names)}") from None
    return engines or frozenset({Engine.COMPUTE})


class KernelEngine:
    def __init__(
        self,
        config: DaemonConfig,
        driver: CgroupDriver,
        telemetry: GpuTelemetry,
        store: StateStore,
        clock: Clock,
        devices: DeviceAdmission | None = None,
        mps: MpsControl | None = None,
    ) -> None:
        self.config = config
        self.devices = devices
        if config.mps and mps is None:
            raise ConfigError("config 'mps': this engine was built without an MPS control")
        self.mps = mps if config.mps else None
        self.driver = driver
        self.telemetry = telemetry
        self.memory_ledger: MemoryLedger | None = None
        """The session hooks' video memory counts (set where the hooks are made; None: not followed)."""
        self.store = store
        self.clock = clock
        self.policy = WeightedFairShare(
            FairShareConfig(
                mode=config.mode,
                slice_s=config.slice_ms / 1000.0,
                lag_limit_slices=config.lag_limit_slices,
                timeshare_window_s=config.timeshare_window_ms / 1000.0,
                share_window_s=config.share_window_s,
            )
        )
        gate = TUNING.gate(config.saturated_util, config.slice_ms)
        gpus = list(telemetry.gpus())
        self.gpu_indices: tuple[int, ...] = tuple(g.index for g in gpus) or (0,)
        self.video: VideoEngines | None = video_engines_for(gpus[0].name) if gpus else None
        self.contention = self._contention(gpus[0].name if gpus else None)
        self.plan_config = PlanConfig(self.contention, self.gpu_indices, gate, config.activity_threshold,
                                      config.idle_slices, config.mix_period_ms / 1000.0)
        self._plan = PlanState()
        """The scheduling model's state between slices (policy.plan): gates, mixed-slice clocks."""
        self._tenants: dict[str, _Tenant] = {}
        self._declared = frozenset(d.name for d in config.tenants)
        """Tenants the config declares stay when their processes exit, however they were first made."""
        self._last_tick = clock.monotonic()
        self._last_samples: tuple[GpuSample, ...] = ()
        self._matches: dict[Resource, ReportMatch] = {}
        """Per resource, cooperative reports matched against the busy time charged to kernel tenants."""
        self._last_active: frozenset[str] = frozenset()
        self._memory_at = float("-inf")
        self._telemetry_failing = False
        self.leases = LeaseBook(self.policy, self.contention, config.slice_ms / 1000.0, config.lease_timeout_ms / 1000.0,
                                config.lease_max_run_ms / 1000.0)
        self._next_tick = self._last_tick
        self._mix_shown: dict[int, OverlapMix] = {}
        """Per GPU, the last mix logged (and shown by `mixed_slices`)."""
        self._logged_shares: dict[str, tuple[float, str]] = {}
        self._unsaved = False
        self._saved_at = float("-inf")

    def _contention(self, gpu_name: str | None) -> ContentionMap:
        wanted = self.config.contention
        if wanted not in ("auto", PARTIAL_OVERLAP):
            return ContentionMap.named(wanted)
        kept = self.store.measured_contention(gpu_name) if gpu_name is not None else None
        if kept is None:
            if wanted == PARTIAL_OVERLAP:  # mixed slices whatever the calibration's sum: it must exist
                raise ConfigError(f"contention 'partial-overlap' plans mixed slices from a calibration of the GPU "
                                  f"model, and there is none for {gpu_name or 'this machine (no GPU seen)'} in "
                                  f"{self.config.state_dir}: run `unisched calibrate`, or use 'auto'")
            if gpu_name is not None:
                log.info(
                    "contention of compute and graphics not measured on this GPU: slicing them as one domain",
                    gpu=gpu_name, hint="`unisched calibrate` measures it",
                )
            return SHARED_SM
        chosen = ContentionMap.partial(*kept) if wanted == PARTIAL_OVERLAP else ContentionMap.from_kept(*kept)
        log.info("measured contention", gpu=gpu_name, compute_kept=kept[0], graphics_kept=kept[1], map=chosen.name,
                 contention=wanted)
        return chosen

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Thaw everything we may have left frozen, start (or join) MPS where configured, then restore tenants
        (saved state, then config, then live cgroups of the subtree that neither names). Raises MpsError before
        restoring any tenant when MPS does not start; the thaw comes first so that a daemon which cannot start
        leaves no cgroup frozen. The state file is read once: reading it moves a damaged one aside."""
        saved = self.store.load()
        thawed = self.thaw_all(extra=[t.cgroup for t in saved])
        if thawed:
            log.warning("thawed cgroups left frozen by a previous run", cgroups=thawed)
        if self.mps is not None:
            mps = self.mps.start()
            capped = self.config.mode is Mode.PREEMPTIVE and self.config.mps_offline_sm_percent < 100
            log.info("MPS joined" if mps.joined else "MPS started", pipe_dir=mps.pipe_dir, servers=list(mps.servers),
                     offline_sm_percent=self.config.mps_offline_sm_percent if capped else None)
        for s in saved:
            self._restore(s)
        for declared in self.config.tenants:
            if declared.name not in self._tenants:
                self._add_declared(declared)
        self._readopt_live()
        self._save()

    def _restore(self, saved: SavedTenant) -> None:
        missing = False
        if not self.driver.exists(saved.cgroup):
            if saved.adopted:
                log.warning("adopted cgroup is gone; forgetting tenant", tenant=saved.name, cgroup=saved.cgroup)
                return
            try:
                self.driver.create(saved.cgroup)
            except (CgroupError, OSError) as e:
                # keep the tenant (and its weight); it is recreated when it registers again
                log.error("could not recreate a saved tenant's cgroup", tenant=saved.name, cgroup=saved.cgroup, error=str(e))
                missing = True
        self._add(
            _Tenant(saved.name, saved.weight, saved.priority, saved.engines, saved.gpus, saved.cgroup, saved.adopted,
                    saved.owner_uid, missing=missing, limits=saved.limits,
                    ephemeral=saved.ephemeral and saved.name not in self._declared, labels=saved.labels),
            reason="restored",
        )

    def _readopt_live(self) -> None:
        """A cgroup of our subtree with processes in it that no tenant names (its entry was lost with a damaged
        state file) is governed again, not left to run unscheduled: a tenant named after it, default weight,
        owned by root."""
        named = {t.cgroup for t in self._tenants.values()}
        for cg in self.driver.managed():
            if cg in named:
                continue
            name = cg.rsplit("/", 1)[-1]
            try:
                pids = self.driver.pids(cg)
            except (CgroupError, OSError, ValueError):
                continue
            if not pids:
                continue
            why = self._cannot_readopt(name)
            if why is not None:
                log.error("live cgroup in the subtree not governed", cgroup=cg, pids=len(pids), why=why)
                continue
            self._add(_Tenant(name, DEFAULT_WEIGHT, Priority.OFFLINE, _parse_engines(()), None, cg, False, 0),
                      reason="re-adopted")
            log.warning("re-adopted a live cgroup the state file did not name", tenant=name, cgroup=cg,
                        pids=len(pids), weight=DEFAULT_WEIGHT)

    def _cannot_readopt(self, name: str) -> str | None:
        try:
            validate_tenant_name(name)
        except PolicyError as e:
            return str(e)
        if name in self._tenants:
            return f"tenant {name!r} exists with another cgroup"
        if len(self._tenants) >= MAX_TENANTS:
            return f"this daemon already has {len(self._tenants)} tenants, the most it keeps"
        return None

    def _add_declared(self, d: DeclaredTenant) -> None:
        try:
            self._check_reserve(d.name, d.limits, d.gpus)
        except PolicyError as e:
            log.error("declared tenant refused", tenant=d.name, error=str(e))
            return
        if d.cgroup is not None:
            try:
                cgroup = self.driver.normalize(d.cgroup)
            except CgroupError as e:
                log.error("declared tenant's cgroup not adopted", tenant=d.name, error=str(e))
                return
            why = self.adopt_refusal(cgroup)
            if why is not None:
                log.error("declared tenant's cgroup not adopted", tenant=d.name, error=why)
                return
            adopted = True
        else:
            cgroup = self.driver.tenant_cgroup(d.name)
            try:
                self.driver.create(cgroup)
            except (CgroupError, OSError) as e:
                log.error("declared tenant's cgroup could not be created", tenant=d.name, cgroup=cgroup, error=str(e))
                return
            adopted = False
        self._add(_Tenant(d.name, d.weight, d.priority, d.engines, d.gpus, cgroup, adopted, 0, limits=d.limits),
                  reason="declared")

    def thaw_all(self, extra: Iterable[str] = ()) -> list[str]:
        """Thaw every cgroup we manage or know of; returns those that were frozen."""
        cgroups = set(self.driver.managed()) | {t.cgroup for t in self._tenants.values()} | set(extra)
        was_frozen = []
        for cg in sorted(cgroups):
            try:
                if self.driver.exists(cg) and self.driver.is_frozen(cg):
                    was_frozen.append(cg)
                if self.driver.exists(cg):
                    self.driver.set_frozen(cg, False)
            except CgroupError as e:
                log.error("could not thaw", cgroup=cg, error=str(e))
        for t in self._tenants.values():
            t.frozen = False
        return was_frozen

    def shutdown(self) -> None:
        self.thaw_all()
        self._save()  # also what _save_soon left for the tick
        log.info("all managed cgroups thawed")
        if self.mps is not None:
            self.mps.stop()
            log.info("MPS asked to quit once its clients are done", pipe_dir=self.mps.pipe_dir)

    def mps_status(self) -> MpsStatus | None:
        """None while the daemon runs without MPS."""
        return None if self.mps is None else self.mps.status()

    def _client_env(self, t: _Tenant) -> dict[str, str]:
        if self.mps is None:
            return {}
        settings = mps_client_settings(t.all_engines(), t.priority, self.config.mode, self.config.mps_offline_sm_percent)
        return {} if settings is None else settings.env(self.mps.pipe_dir)

    def _save(self) -> None:
        self.store.save([t.saved() for t in sorted(self._tenants.values(), key=lambda t: t.name)])
        self._unsaved = False

    def _save_soon(self) -> None:
        """For registrations (`run` and lease sessions): saved by the tick within SAVE_DELAY_S, so a thousand
        clients registering at once do not rewrite the file a thousand times."""
        self._unsaved = True

    def _add(self, t: _Tenant, reason: str) -> None:
        if t.adopted and self.driver.before_freeze is not None:
            # recorded now, where a damaged state file cannot lose it (enforce.governed); a freeze retries it
            try:
                self.driver.before_freeze(t.cgroup)
            except OSError as e:
                log.error("could not record the adopted cgroup; it is not frozen until it can be", tenant=t.name,
                          cgroup=t.cgroup, error=str(e))
        t.resources = self.contention.resources(t.gpus or self.gpu_indices, t.all_engines())
        self._tenants[t.name] = t
        self._apply_devices(t)
        self.policy.upsert(TenantSpec(t.name, t.base_weight, t.priority))
        log.info(
            "tenant added",
            tenant=t.name,
            weight=t.base_weight,
            priority=t.priority.value,
            engines=sorted(e.value for e in t.engines),
            cgroup=t.cgroup,
            reason=reason,
        )

    # --- requests ----------------------------------------------------------------------------------
    def has_tenant(self, name: str) -> bool:
        return name in self._tenants

    def note_session_hooks(self, tenant: str) -> None:
        """The seccomp hooks now see the tenant's GPU session allocations (see `_off_gpu`)."""
        t = self._tenants.get(tenant)
        if t is not None:
            t.hooked = True

    @staticmethod
    def _off_gpu(t: _Tenant) -> bool:
        """No GPU context anywhere in the tenant: the hooks count none and NVML lists none of its processes.

        Such a tenant cannot use the GPU, so it shows no demand there and is never frozen: freezing it only
        slowed its CPU start-up (a ResNet-50 trainer at weight 1:3 next to a render took 4x its 4 s of torch
        import and set-up on the H200) and charged it for the other tenant's GPU time. Both signals must agree,
        so an unclassified context class or a process outside the hooks still counts as on the GPU."""
        return t.hooked and not t.nvml_on_gpu and not any(n > 0 for n in t.sessions.values())

    def tenant_of_pid(self, pid: int) -> str | None:
        cg = self.driver.cgroup_of(pid)
        if cg is None:
            return None
        for t in self._tenants.values():
            if cg == t.cgroup or cg.startswith(t.cgroup.rstrip("/") + "/"):
                return t.name
        return None

    def register(
        self,
        name: str,
        weight: int | None,
        priority: Priority | None,
        engines: Iterable[str],
        gpus: Iterable[int],
        pid: int,
        uid: int,
        is_admin: bool,
        alive: Callable[[], bool] | None = None,
        keep: bool | None = None,
        session_hooks: bool = False,
    ) -> TenantSnapshot:
        """Move the caller's own process into the tenant's cgroup, creating the tenant if needed.

        `alive` says whether the process that connected still runs (the transport pins it; None: not checked).
        A pid outlives its process: once the caller exits another process may take the number, so a caller
        that is gone is never acted on, before anything changes and again after the move.

        keep=False (`unisched run` without --keep): a tenant this call creates is removed once its last process
        has exited, so tenants made for one run do not pile up against MAX_USER_TENANTS. keep=True: the owner
        keeps it (also one made that way before). None (lease sessions): a new tenant is kept, a known one unchanged.

        What changed is saved by the tick within SAVE_DELAY_S, not here: a burst of `unisched run` (each a new
        tenant) rewrote and fsync'ed the whole state file once per call, on the event loop, so replies queued
        behind the disk. A graceful stop saves at once; a crash within that half second can lose only the
        entries of the registrations made in it.

        session_hooks (`unisched run`): the caller's children get the session hooks before they exec, so a tenant
        this call creates is hooked from its first process on and holds no GPU context until the hooks count one.
        Without it the CPU of its start-up (a torch import: ~3 s on the H200 machine) was charged as GPU time,
        through the CPU stand-in, until the hand-over and NVML's next process list caught up."""
        _need_alive(alive)
        try:
            validate_tenant_name(name)
            if weight is not None:
                validate_weight(weight)
        except PolicyError as e:
            raise EngineError("invalid", str(e)) from None
        engine_set = _parse_engines(engines)
        gpu_tuple = self._check_gpus(gpus)
        t = self._tenants.get(name)
        changed = t is None
        # a caller already inside the tenant's cgroup (a container of an adopted pod, whose pod-level cgroup may hold
        # no process of its own under cgroup v2) is the tenant: it joins without being moved, whoever owns it
        member = t is not None and self._is_member(t, pid)
        _need_alive(alive)  # what was read from /proc/<pid> was the caller's
        if t is None:
            if not is_admin and not self.config.user_tenants:
                raise EngineError("permission", "only admins may create tenants on this daemon (user_tenants = false)")
            w = weight if weight is not None else DEFAULT_WEIGHT
            if not is_admin and w > self.config.max_user_weight:
                raise EngineError(
                    "permission",
                    f"weight {w} is above max_user_weight {self.config.max_user_weight} for non-admin callers",
                )
            self._check_room(uid, is_admin)
            cgroup = self.driver.tenant_cgroup(name)
            self._check_not_governed(name, cgroup)
            self._create_cgroup(name, cgroup)
            t = _Tenant(name, w, priority or Priority.OFFLINE, engine_set, gpu_tuple, cgroup, False, uid,
                        ephemeral=keep is False and name not in self._declared)
            if session_hooks:
                # its only process now is the CLI, which holds no context; where NVML lists the GPUs' processes
                # that list says when one appears (without it, CPU time is the GPU's stand-in: on the GPU as before)
                t.hooked = True
                t.nvml_on_gpu = not self._nvml_lists_processes()
            self._add(t, reason="registered")
        else:
            owner = is_admin or uid == t.owner_uid
            if not owner and not member:
                raise EngineError("permission", f"tenant {name!r} belongs to uid {t.owner_uid}; you are uid {uid}")
            before = t.saved()
            if weight is not None and weight != t.base_weight:
                if not owner:
                    raise EngineError("permission", f"only uid {t.owner_uid} or an admin may change the weight of "
                                                    f"tenant {name!r} ({t.base_weight}); you are uid {uid}")
                if not is_admin and weight > self.config.max_user_weight:
                    raise EngineError(
                        "permission",
                        f"weight {weight} is above max_user_weight {self.config.max_user_weight} for non-admin callers",
                    )
                self._set_weight(t, weight, reason="registered")
            # a member that is not the owner joins as it is: engines, GPUs and priority stay as the owner set them
            if owner and priority is not None and priority != t.priority:
                t.priority = priority
                self.policy.upsert(TenantSpec(t.name, t.base_weight, t.priority))
            if owner and list(engines):
                t.engines = engine_set
            if owner and list(gpus):
                t.gpus = gpu_tuple
            if owner and keep is True:
                t.ephemeral = False
            t.resources = self.contention.resources(t.gpus or self.gpu_indices, t.all_engines())
            self._apply_devices(t)
            if t.missing or not self.driver.exists(t.cgroup):
                self._create_cgroup(name, t.cgroup)
                if t.missing:
                    log.info("tenant cgroup recreated", tenant=name, cgroup=t.cgroup)
                t.missing = False
                t.last_cpu = None
            changed = t.saved() != before
        if not member:
            self._attach_caller(t.cgroup, pid, alive)
        if changed:  # the state file holds every tenant: rewrite it only when what it keeps changed
            self._save_soon()
        return self.snapshot(name)

    def _attach_caller(self, cgroup: str, pid: int, alive: Callable[[], bool] | None) -> None:
        """Move the caller into `cgroup`; if it exited meanwhile, the pid may name another process by now:
        whatever process holds the pid in `cgroup` goes back where the caller was, and the call fails."""
        try:
            origin = self.driver.cgroup_of(pid)
        except OSError:
            origin = None
        _need_alive(alive)
        try:
            self.driver.attach(cgroup, pid)
        except CgroupError as e:
            raise EngineError("failed", f"cannot move pid {pid} into {cgroup}: {e}") from None
        if alive is None or alive():
            return
        with contextlib.suppress(OSError, CgroupError):
            if origin is not None and self.driver.cgroup_of(pid) == cgroup:
                self.driver.attach(origin, pid)
                log.warning("moved a reused pid back", pid=pid, cgroup=origin)
        raise EngineError("failed", CALLER_GONE)

    def _check_not_governed(self, name: str, cgroup: str) -> None:
        """A new tenant's cgroup must not be (or nest with) an adopted one: two tenants would freeze one cgroup."""
        for o in self._tenants.values():
            if o.adopted and (within(cgroup, o.cgroup) or within(o.cgroup, cgroup)):
                raise EngineError("invalid", f"tenant {name!r} would live in {cgroup}, which is nested with adopted "
                                             f"tenant {o.name!r}'s cgroup {o.cgroup}; choose another name")

    def _nvml_lists_processes(self) -> bool:
        """Whether the last samples listed every GPU's processes (NVML on a GPU that reports them)."""
        samples = self._last_samples
        return bool(samples) and all(s.ok and s.gpu_pids is not None for s in samples)

    def _is_member(self, t: _Tenant, pid: int) -> bool:
        """Whether `pid` already sits in the tenant's cgroup or below it."""
        try:
            where = self.driver.cgroup_of(pid)
        except OSError:  # gone, or /proc unreadable: not a member
            return False
        root = t.cgroup.rstrip("/")
        return where is not None and (where == t.cgroup or where.startswith(root + "/"))

    def _create_cgroup(self, name: str, cgroup: str) -> None:
        try:
            self.driver.create(cgroup)
        except FileExistsError:
            raise EngineError("invalid", f"tenant name {name!r} is taken by a cgroup interface file; choose another") from None
        except CgroupError as e:
            raise EngineError("failed", str(e)) from None
        except OSError as e:
            raise EngineError("failed", f"cannot create cgroup {cgroup}: {e.strerror}") from None

    def _check_room(self, uid: int, is_admin: bool) -> None:
        if len(self._tenants) >= MAX_TENANTS:
            raise EngineError("failed", f"this daemon already has {len(self._tenants)} tenants, the most it keeps")
        if not is_admin:
            owned = sum(1 for t in self._tenants.values() if t.owner_uid == uid and not t.adopted)
            if owned >= MAX_USER_TENANTS:
                raise EngineError(
                    "permission", f"uid {uid} already created {owned} tenants, the most a non-admin may (remove some first)"
                )

    def adopt(
        self,
        name: str,
        weight: int | None,
        priority: Priority | None,
        cgroup: str,
        engines: Iterable[str],
        gpus: Iterable[int],
        labels: Mapping[str, str] | None = None,
    ) -> TenantSnapshot:
        """`labels`: where an orchestrator runs it (engine.labels), kept for metrics."""
        try:
            validate_tenant_name(name)
            if weight is not None:
                validate_weight(weight)
            kept = validate_labels(labels or {})
        except (PolicyError, LabelError) as e:
            raise EngineError("invalid", str(e)) from None
        if name in self._tenants:
            raise EngineError("invalid", f"tenant {name!r} already exists; remove it first")
        self._check_room(0, True)
        try:
            path = self.driver.normalize(cgroup)
        except CgroupError as e:
            raise EngineError("invalid", str(e)) from None
        why = self.adopt_refusal(path)
        if why is not None:
            raise EngineError("invalid", why)
        t = _Tenant(
            name,
            weight if weight is not None else DEFAULT_WEIGHT,
            priority or Priority.OFFLINE,
            _parse_engines(engines),
            self._check_gpus(gpus),
            path,
            True,
            0,
            labels=kept,
        )
        self._add(t, reason="adopted")
        self._save()
        return self.snapshot(name)

    def adopt_refusal(self, path: str) -> str | None:
        """Why this canonical cgroup path cannot be adopted here (see `adopt_refusal`), or None."""
        subtree = posixpath.dirname(self.driver.tenant_cgroup("x"))
        return adopt_refusal(path, subtree, self.driver.cgroup_of(os.getpid()),
                             ((t.name, t.cgroup) for t in self._tenants.values()))

    def set_weight(self, name: str, weight: int) -> TenantSnapshot:
        t = self._get(name)
        try:
            validate_weight(weight)
        except PolicyError as e:
            raise EngineError("invalid", str(e)) from None
        self._set_weight(t, weight, reason="set-weight")
        self._save()
        return self.snapshot(name)

    def _set_weight(self, t: _Tenant, weight: int, reason: str) -> None:
        t.base_weight = weight
        self.policy.upsert(TenantSpec(t.name, weight, t.priority))
        self._apply_tidal(t)
        self._log_shares(reason=reason)

    def remove_as(self, name: str, uid: int, is_admin: bool) -> None:
        """Remove a tenant for a caller: an admin any, others only tenants they own."""
        t = self._get(name)
        if not is_admin and uid != t.owner_uid:
            raise EngineError("permission", f"tenant {name!r} belongs to uid {t.owner_uid}; only its owner or an "
                                            f"admin may remove it (you are uid {uid})")
        self.remove(name)

    def remove(self, name: str) -> None:
        self._drop(self._get(name))
        self._save()
        log.info("tenant removed", tenant=name)
        self._log_shares(reason="removed")

    def _drop(self, t: _Tenant) -> None:
        """Forget a tenant and thaw (and, when it made it and it is empty, delete) its cgroup; the caller saves."""
        name = t.name
        if t.devices_admitted and self.devices is not None:
            try:
                self.devices.revoke(self._v2_dir(t))
            except DeviceAdmissionError as e:
                log.error("could not revoke device admission", tenant=name, error=str(e))
        try:
            if self.driver.exists(t.cgroup):
                self.driver.set_frozen(t.cgroup, False)
                if not t.adopted and not self.driver.pids(t.cgroup):
                    self.driver.remove(t.cgroup)
        except CgroupError as e:
            log.error("cleanup of removed tenant failed", tenant=name, error=str(e))
        del self._tenants[name]
        self._logged_shares.pop(name, None)
        self.leases.forget_tenant(name)
        self.policy.remove(name)

    def _get(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            raise EngineError("not_found", f"unknown tenant {name!r}")
        return t

    def _check_gpus(self, gpus: Iterable[int]) -> tuple[int, ...] | None:
        g = tuple(gpus)
        bad = [i for i in g if i not in self.gpu_indices]
        if bad:
            raise EngineError("invalid", f"no GPU {bad}; this host has GPUs {list(self.gpu_indices)}")
        return g or None

    # --- sessions, caps and device admission ---------------------------------------------------------
    def set_limits(self, name: str, render: int | None, decode: int | None, encode: int | None,
                   memory_bytes: int | None, memory_reserve: int | None = None) -> TenantSnapshot:
        """Change caps; None keeps a value, -1 clears it back to the default."""
        t = self._get(name)

        def pick(new: int | None, old: int | None) -> int | None:
            if new is None:
                return old
            return None if new == -1 else new

        try:
            limits = SessionLimits(
                render=pick(render, t.limits.render), decode=pick(decode, t.limits.decode),
                encode=pick(encode, t.limits.encode), memory_bytes=pick(memory_bytes, t.limits.memory_bytes),
                memory_reserve=pick(memory_reserve, t.limits.memory_reserve),
            )
            self._check_reserve(name, limits, t.gpus)
            t.limits = limits
        except PolicyError as e:
            raise EngineError("invalid", str(e)) from None
        log.info("limits", tenant=name, render=t.limits.render, decode=t.limits.decode, encode=t.limits.encode,
                 memory_bytes=t.limits.memory_bytes, memory_reserve=t.limits.memory_reserve)
        self._save()
        return self.snapshot(name)

    def memory_terms(self) -> dict[str, MemoryTerms]:
        """Every tenant's GPU memory cap and reserve per GPU; the session hooks read it from their own thread."""
        return {n: terms_of(t.limits, t.gpus) for n, t in list(self._tenants.items())}

    def gpu_memory_totals(self) -> dict[int, int]:
        """Each GPU's memory in bytes (what reserves are checked against)."""
        return gpu_totals(self.telemetry.gpus())

    def _check_reserve(self, name: str, limits: SessionLimits, gpus: tuple[int, ...] | None) -> None:
        """PolicyError when the tenant's memory reserve does not fit beside the other tenants' on some GPU."""
        why = reserve_refusal(name, limits, gpus, self.memory_terms(), self.gpu_memory_totals())
        if why is not None:
            raise PolicyError(why)

    def cap(self, t: _Tenant, kind: CapKind, by_gpu: Mapping[int, int] | None = None) -> int | None:
        configured = t.limits.get(kind)
        if configured is not None:
            return configured
        if self.video is None:
            return None  # no GPU seen: nothing to derive a cap from
        return default_cap(kind, self._gpu_share(t, by_gpu), self.video)

    def _gpu_share(self, t: _Tenant, by_gpu: Mapping[int, int] | None = None) -> float:
        """The tenant's weight share of its GPUs: its weight over the weights of every tenant with work there.

        `by_gpu` (from _active_weight_by_gpu) lets a caller that asks for every tenant sum the weights once.
        """
        mine = self.policy.weight(t.name)
        gpus = set(t.gpus or self.gpu_indices)
        if by_gpu is not None and len(gpus) == 1:
            (g,) = gpus
            own = mine if t.active and any(r.gpu == g for r in t.resources) else 0
            return mine / (mine + by_gpu.get(g, 0) - own)
        total = sum(
            self.policy.weight(o.name)
            for o in self._tenants.values()
            if o is not t and o.active and gpus & {r.gpu for r in o.resources}
        )
        return mine / (mine + total)

    def _active_weight_by_gpu(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for o in self._tenants.values():
            if o.active:
                w = self.policy.weight(o.name)
                for g in {r.gpu for r in o.resources}:
                    out[g] = out.get(g, 0) + w
        return out

    def admit_session(self, tenant: str, kind: str, h_class: int) -> bool:
        """A new GPU session (seen by the seccomp supervisor on RM_ALLOC): admit it or refuse it (EPERM)."""
        t = self._tenants.get(tenant)
        if t is None:
            return True  # not ours (any more): never wedge a process
        return self._admit(t, kind, h_class) is None

    def _admit(self, t: _Tenant, kind: str, h_class: int) -> str | None:
        """Count a new session of `kind`, or refuse it: returns why (logged and counted), None when admitted.
        The one check for sessions seen by the hooks and sessions cooperative clients ask for."""
        cap_kind = _CAP_OF_KIND.get(kind)
        refuse_reason = None
        if cap_kind is not None and t.over_memory:
            refuse_reason = "over memory cap"
        elif cap_kind is not None:
            cap = self.cap(t, cap_kind)
            if cap is not None and t.sessions.get(kind, 0) >= cap:
                refuse_reason = f"{kind} cap {cap} reached"
        if refuse_reason is not None:
            t.refusals[kind] = t.refusals.get(kind, 0) + 1
            log.warning("session refused", tenant=t.name, kind=kind, h_class=f"0x{h_class:04X}", reason=refuse_reason)
            return refuse_reason
        before = t.all_engines()
        t.sessions[kind] = t.sessions.get(kind, 0) + 1
        if t.all_engines() != before:
            self._engines_changed(t)
        return None

    def session_freed(self, tenant: str, kind: str, count: int = 1) -> None:
        t = self._tenants.get(tenant)
        if t is None:
            return
        before = t.all_engines()
        t.sessions[kind] = max(0, t.sessions.get(kind, 0) - count)
        if t.all_engines() != before:
            self._engines_changed(t)

    def _engines_changed(self, t: _Tenant) -> None:
        t.resources = self.contention.resources(t.gpus or self.gpu_indices, t.all_engines())
        if t.active:
            self.policy.set_demand(t.name, t.resources)
        log.info("engines", tenant=t.name, engines=sorted(e.value for e in t.all_engines()), reason="sessions")

    def _v2_dir(self, t: _Tenant) -> Path:
        return self.driver.mount / t.cgroup.lstrip("/")

    def _apply_devices(self, t: _Tenant) -> None:
        """Device admission: only the tenant's GPUs may be opened; none while it is over its memory cap."""
        if self.devices is None or self.driver.kind != "v2":
            return
        gpus: frozenset[int] | None = frozenset() if t.over_memory else (frozenset(t.gpus) if t.gpus else None)
        if gpus is None and not t.devices_admitted:
            return  # nothing to restrict
        try:
            self.devices.admit(self._v2_dir(t), gpus)
            t.devices_admitted = True
        except DeviceAdmissionError as e:
            log.error("device admission failed", tenant=t.name, error=str(e))

    def _update_memory(self, samples: Mapping[int, GpuSample], now: float) -> None:
        """Per-tenant GPU memory against caps, whether NVML lists a hooked tenant on a GPU (see `_off_gpu`), and
        which `unisched run` tenants have emptied, at most once a second: it reads tenants' process lists."""
        if now - self._memory_at < MEMORY_CHECK_S:
            return
        self._memory_at = now
        read: dict[str, list[int]] = {}

        def pids_of(t: _Tenant) -> list[int]:  # each cgroup's process list read once for all three checks
            got = read.get(t.cgroup)
            if got is None:
                got = read[t.cgroup] = self.driver.pids(t.cgroup)
            return got

        self._reconcile_encoders(samples, pids_of)
        by_pid: dict[int, int] = {}
        for s in samples.values():
            for pid, used in s.process_memory.items():
                by_pid[pid] = by_pid.get(pid, 0) + used
        lists = [s.gpu_pids for s in samples.values() if s.ok and s.gpu_pids is not None]
        # a GPU NVML cannot list processes for: every hooked tenant may be on it
        listed = frozenset().union(*lists) if lists and len(lists) == len(samples) else None
        for t in self._tenants.values():
            if t.missing or not (by_pid or t.hooked):
                continue
            pids = pids_of(t) if by_pid or listed is not None else []
            if t.hooked:
                t.nvml_on_gpu = listed is None or any(pid in listed for pid in pids)
            if not by_pid:
                continue
            t.memory_bytes = sum(by_pid.get(pid, 0) for pid in pids)
            cap = t.limits.memory_bytes
            over = cap is not None and not t.hooked and t.memory_bytes > cap  # hooked: capped at each allocation
            if over != t.over_memory:
                t.over_memory = over
                if over:
                    t.refusals["memory"] = t.refusals.get("memory", 0) + 1
                log.warning("memory cap", tenant=t.name, memory_bytes=t.memory_bytes, cap=cap, over=over)
                self._apply_devices(t)
        self._reap_emptied(pids_of)

    def _reap_emptied(self, pids_of: Callable[[_Tenant], list[int]]) -> None:
        """Remove tenants `unisched run` made whose last process has exited (once a second, from the same process
        lists as the memory checks). Never one with a lease session open: its client talks to it even while its
        cgroup shows no process (a client outside the cgroup cannot hold one, but the session is its claim)."""
        gone = [t for t in self._tenants.values()
                if t.ephemeral and not self.leases.cooperative(t.name) and (t.missing or not pids_of(t))]
        for t in gone:
            self._drop(t)
            log.info("tenant removed", tenant=t.name, reason="its last process exited")
        if gone:
            self._save()
            self._log_shares(reason="removed")

    def _reconcile_encoders(self, samples: Mapping[int, GpuSample], pids_of: Callable[[_Tenant], list[int]]) -> None:
        """Live NVENC session counts against NVML's encoder session list (once a second). The hooks count
        allocations and frees; a free they never saw leaves a count too high (and a cap refusing), a session
        opened where no hook runs leaves it too low. NVML lists the sessions that exist: when it disagrees with
        the count twice in a row (not a session caught between its allocation and NVML's list), it wins."""
        lists = [s.encoder_sessions for s in samples.values() if s.ok and s.encoder_sessions is not None]
        if not lists:
            return
        by_pid: dict[int, int] = {}
        for sessions in lists:
            for pid, n in sessions.items():
                by_pid[pid] = by_pid.get(pid, 0) + n
        for t in self._tenants.values():
            if t.missing:
                continue
            seen = sum(by_pid.get(pid, 0) for pid in pids_of(t)) if by_pid else 0
            counted = t.sessions.get("nvenc", 0)
            if seen == counted:
                t.encoder_mismatch = 0
                continue
            t.encoder_mismatch += 1
            if t.encoder_mismatch >= 2:
                log.warning("encoder sessions reconciled with NVML", tenant=t.name, counted=counted, nvml=seen)
                before = t.all_engines()
                t.sessions["nvenc"] = seen
                t.encoder_mismatch = 0
                if t.all_engines() != before:
                    self._engines_changed(t)

    # --- the slice ---------------------------------------------------------------------------------
    def tick(self) -> float:
        """One slice boundary. Returns the seconds until the next one."""
        now = self.clock.monotonic()
        dt = max(now - self._last_tick, 1e-6)
        self._last_tick = now
        samples = {s.index: s for s in self._sample()}
        self._last_samples = tuple(samples.values())
        self._update_memory(samples, now)
        cpu = self._cpu_deltas()
        thawed_on: dict[Resource, list[_Tenant]] = {}
        leases = self.leases
        for t in self._tenants.values():
            # thawed tenants, and frozen ones that still ran: a freeze takes effect a few ms late, and an
            # uncharged tail favours the tenant frozen most often per unit of its share (the low weight)
            ran = not t.frozen or cpu.get(t.name, 0.0) > 0.0
            if ran and not t.missing and not leases.cooperative(t.name) and not self._off_gpu(t):
                # (cooperative ones report their GPU time; one with no GPU context used none)
                for r in t.resources:
                    thawed_on.setdefault(r, []).append(t)
        gpu_active: set[str] = set()
        reports = leases.take_reported()
        for r, ts in thawed_on.items():
            self._charge_resource(r, ts, samples.get(r.gpu), cpu, dt, now, gpu_active, reports.pop(r, ()))
        for r in set(reports) | (set(self._matches) - set(thawed_on)):  # late reports of intervals already charged
            _, self._matches[r] = cooperative_part(0.0, now - dt, now, reports.get(r, ()),
                                                   self._matches.get(r, ReportMatch()), leases.valid_s, False)
        self._update_demand(cpu, dt, gpu_active)
        pairs = self._mix_weights() if self.plan_config.mixing else {}
        self._observe_saturation(samples, cpu, dt, pairs)
        tenants = self._tenants
        leases.expire(now, lambda name: tenants[name].frozen)
        if self.config.mode is Mode.TIDAL:
            for t in self._tenants.values():
                self._apply_tidal(t)
        decision = self.policy.decide(now)
        self._next_tick = now + decision.slice_s
        self._apply(decision, now, tick=True, pairs=pairs, dt=dt)
        if self._unsaved and now - self._saved_at >= SAVE_DELAY_S:
            self._saved_at = now
            self._save()
        active = frozenset(n for n, t in self._tenants.items() if t.active)
        if active != self._last_active:
            self._last_active = active
            self._log_shares(reason="demand")
        return decision.slice_s

    def _observe_saturation(self, samples: Mapping[int, GpuSample], cpu: Mapping[str, float], dt: float,
                            pairs: Mapping[int, PairWeights]) -> None:
        """Measure what the saturation gates read (policy.plan.observe), level the fair share of resources that
        slicing starts on, and log the gates' changes."""
        cooperative = self.leases.cooperative
        use = [KernelUse(t.resources, t.all_engines(), t.frozen, cpu.get(t.name, 0.0) / dt)
               for t in self._tenants.values() if not t.missing and not cooperative(t.name)]
        contenders = {r: self.policy.contenders(r) for u in use for r in u.resources}
        outcome, self._plan = observe(self.plan_config, use, samples, contenders, pairs, self._plan)
        for r in outcome.level:
            self.policy.level(r)
        self._log_gates(outcome)

    def _log_gates(self, outcome: GateOutcome) -> None:
        """Why a sliced GPU stays sliced or opens (--log-level debug), and each change of a contended gate."""
        for g in outcome.readings:
            r = g.resource
            if not g.was_open and g.contenders >= 2:
                log.debug("turn", gpu=r.gpu, domain=r.domain, util=g.util, cpu_busy=g.cpu_busy, used=g.used)
            if g.now_open != g.was_open and g.contenders >= 2:
                held_s = g.held * self.config.slice_ms / 1000.0
                reason = ("saturated" if not g.now_open else
                          f"turns left unused (paced tenants): every tenant runs for {held_s:.1f} s"
                          if g.held else "unsaturated: every tenant runs")
                log.info("slicing" if not g.now_open else "lending", gpu=r.gpu, domain=r.domain,
                         util=None if g.util is None else round(g.util, 3), reason=reason)

    def _mix_weights(self) -> dict[int, PairWeights]:
        """Per GPU, the weights of the tenants with demand on its compute and on its graphics side."""
        cooperative, weight = self.leases.cooperative, self.policy.weight
        return pair_weights((PairMember(weight(t.name), t.resources, cooperative(t.name))
                             for t in self._tenants.values() if t.active and not t.missing), self.contention)

    def _apply(self, decision: Decision, now: float, tick: bool, pairs: Mapping[int, PairWeights] | None = None,
               dt: float = 0.0) -> None:
        """Ask the scheduling model (policy.plan) what the decision means for each tenant and lease, then freeze or
        thaw kernel tenants (and cooperative ones the freezer backs) and grant or revoke leases as it says."""
        leases = self.leases
        tenants = tuple(self._tenants.values())
        coop, enforced = leases.cooperative_names(), leases.enforced_names()
        views = tuple([TenantView(t.name, t.resources, t.active, t.name in coop, t.name in enforced) for t in tenants])
        p, self._plan = plan(self.plan_config, PlanInputs(decision, views, pairs, dt), self._plan)
        self._log_mixes(p)
        for t, verdict in zip(tenants, p.freeze, strict=True):
            if verdict.frozen != t.frozen and not t.missing:
                try:
                    self.driver.set_frozen(t.cgroup, verdict.frozen)
                    t.frozen = verdict.frozen
                    if not verdict.frozen:
                        leases.touch(t.name, now)
                except CgroupError as e:
                    self._lost(t, str(e))
        if p.revoked:
            decision = replace(decision, holders=p.holders)
        leases.apply(decision, now, max(0.0, self._next_tick - now), tick, p.mixed)

    def _log_mixes(self, p: Plan) -> None:
        for g, m in p.mixes.items():
            if self._mix_shown.get(g) != m.mix:
                self._mix_shown[g] = m.mix
                log.info("mixed slices", gpu=g, together=round(m.mix.both, 3),
                         compute_alone=round(m.mix.compute_only, 3), graphics_alone=round(m.mix.graphics_only, 3),
                         period_ms=self.config.mix_period_ms, compute_weight=m.weights.compute,
                         graphics_weight=m.weights.graphics)
            if m.kind is not m.previous:
                log.debug("mixed slice", gpu=g, kind=m.kind.value)

    def _reschedule(self) -> None:
        """Decide now, between ticks: a cooperative tenant's new demand is served (and a released engine
        handed on) at once, not at the next slice boundary."""
        now = self.clock.monotonic()
        self._apply(self.policy.decide(now), now, tick=False)

    def _sample(self) -> Sequence[GpuSample]:
        """The telemetry's samples; a telemetry that raises (it must not) counts as no GPU signal this slice,
        so the slice goes on with CPU signals instead of failing (and thawing everything) every slice."""
        try:
            samples = tuple(self.telemetry.sample())
        except Exception as e:
            if not self._telemetry_failing:
                log.error("telemetry failed; slicing on CPU signals until it recovers", error=repr(e))
            self._telemetry_failing = True
            return ()
        if self._telemetry_failing:
            log.info("telemetry recovered")
            self._telemetry_failing = False
        return samples

    def _cpu_deltas(self) -> dict[str, float]:
        out = {}
        cooperative = self.leases.cooperative
        for t in self._tenants.values():
            if t.missing or cooperative(t.name):  # cooperative tenants report GPU time: no cgroup reads
                continue
            usage = self.driver.cpu_usage_s(t.cgroup)
            if usage is None:
                self._lost(t, "cgroup removed")
                continue
            out[t.name] = 0.0 if t.last_cpu is None else max(0.0, usage - t.last_cpu)
            t.last_cpu = usage
        return out

    def _charge_resource(
        self,
        r: Resource,
        ts: list[_Tenant],
        sample: GpuSample | None,
        cpu: dict[str, float],
        dt: float,
        now: float,
        gpu_active: set[str],
        reports: Sequence[tuple[float, float]] = (),
    ) -> None:
        """Charge the measured use of `r` over the interval to the tenants that were thawed on it.

        `util` is the highest busy fraction of the engines they use there (0 without a sample); how it is split is
        policy.plan.charge_rule. A tenant alone on a busy resource showed GPU activity (`gpu_active`)."""
        util = 0.0
        if sample is not None and sample.ok:
            util = max(
                (sample.util(e) for t in ts for e in t.all_engines() if self.contention.domain(e) == r.domain),
                default=0.0,
            )
        threshold = self.config.activity_threshold
        busy = util * dt if util > threshold else 0.0
        matched, self._matches[r] = cooperative_part(busy, now - dt, now, reports, self._matches.get(r, ReportMatch()),
                                                     self.leases.valid_s, True)
        amounts, rule = charge_rule(util, dt, [cpu.get(t.name, 0.0) for t in ts], threshold, matched)
        for t, seconds in zip(ts, amounts, strict=True):
            if seconds > 0:
                self.policy.charge(t.name, r, seconds, now)
        if rule is Rule.SIGNAL and len(ts) == 1:
            gpu_active.add(ts[0].name)

    def _update_demand(self, cpu: dict[str, float], dt: float, gpu_active: set[str]) -> None:
        threshold = self.config.activity_threshold
        leases = self.leases
        for t in self._tenants.values():
            if leases.cooperative(t.name):
                t.active = bool(leases.demand(t.name))  # from its lease session (LeaseBook sets the demand)
                continue
            active, t.idle_run, _ = demand_rule(
                was_active=t.active, lost=t.missing, frozen=t.frozen, off_gpu=self._off_gpu(t),
                gpu_alone=t.name in gpu_active, cpu_cores=cpu.get(t.name, 0.0) / dt, idle_run=t.idle_run,
                activity_threshold=threshold, idle_slices=self.config.idle_slices)
            if active != t.active or not active:
                self.policy.set_demand(t.name, t.resources if active else ())
            t.active = active

    def _apply_tidal(self, t: _Tenant) -> None:
        w = t.base_weight
        if self.config.mode is Mode.TIDAL:
            w = self.config.tidal.weight_at(t.name, t.base_weight, self.clock.seconds_of_day())
        if w != self.policy.weight(t.name):
            self.policy.set_weight(t.name, w)
            log.info("tidal weight", tenant=t.name, weight=w, base_weight=t.base_weight)
            self._log_shares(reason="tidal")

    def _lost(self, t: _Tenant, why: str) -> None:
        if not t.missing:
            log.error("tenant cgroup lost; tenant kept idle until it registers again", tenant=t.name, cgroup=t.cgroup, error=why)
        t.missing = True
        t.frozen = False
        t.active = False
        t.last_cpu = None
        self.policy.set_demand(t.name, ())

    def _log_shares(self, reason: str) -> None:
        """One line per tenant whose share or state changed materially (a tenth of its share, or a point);
        from the policy alone (no cgroup reads on the slice path). With a thousand equal tenants, one that
        wakes changes everyone's share by a thousandth: that one is logged, not the other 999."""
        targets = self.policy.target_shares()
        logged = self._logged_shares
        for name, t in sorted(self._tenants.items()):
            shares = [targets.get(name, {}).get(r, 0.0) for r in t.resources]
            share = round(max(shares, default=0.0), 4)
            state = _state(t)
            last = logged.get(name)
            if last is not None and last[1] == state and abs(share - last[0]) <= max(0.01, 0.1 * max(share, last[0])):
                continue
            logged[name] = (share, state)
            log.info("share", tenant=name, weight=self.policy.weight(name), share=share, state=state, reason=reason)

    # --- the user engine: lease sessions ------------------------------------------------------------
    def lease_open(
        self, name: str, weight: int | None, priority: Priority | None, engines: Iterable[str], gpu: int,
        pid: int, uid: int, is_admin: bool, channel: LeaseChannel, alive: Callable[[], bool] | None = None,
    ) -> tuple[int, TenantSnapshot]:
        """Register the caller (as `register`: its process joins the tenant's cgroup) and open a lease session."""
        if gpu not in self.gpu_indices:
            raise EngineError("invalid", f"no GPU {gpu}; this host has GPUs {list(self.gpu_indices)}")
        t = self._tenants.get(name)
        gpus = [gpu] if t is None or t.gpus is not None else []
        self.register(name, weight, priority, engines, gpus, pid, uid, is_admin, alive=alive)
        t = self._tenants[name]
        if t.frozen:  # was a kernel tenant: leases gate it from now on
            self._thaw(t)
        sid = self.leases.open(name, gpu, channel)
        t.active = bool(self.leases.demand(name))
        self.policy.set_demand(name, self.leases.demand(name))
        return sid, self.snapshot(name)

    def _thaw(self, t: _Tenant) -> None:
        try:
            self.driver.set_frozen(t.cgroup, False)
            t.frozen = False
        except CgroupError as e:
            self._lost(t, str(e))

    def _lease_call(self, sid: int) -> _Tenant:
        try:
            name = self.leases.session_tenant(sid)
        except LeaseError as e:
            raise EngineError("invalid", str(e)) from None
        t = self._tenants.get(name)
        if t is None:
            raise EngineError("not_found", f"tenant {name!r} was removed")
        return t

    def _ack(self, sid: int, t: _Tenant, engine: Engine) -> LeaseAck:
        lease = self.leases.lease_of(t.name, sid, engine)
        return LeaseAck(engine, lease is not None, lease or 0)

    def lease_want(self, sid: int, engine: str) -> LeaseAck:
        t = self._lease_call(sid)
        e = _parse_engine(engine)
        if self.leases.want(sid, e, self.clock.monotonic()):
            t.active = bool(self.leases.demand(t.name))
            self._reschedule()
        return self._ack(sid, t, e)

    def lease_report(self, sid: int, engine: str, gpu_seconds: float, release: bool, yielded: bool = False,
                     units: int = 0) -> LeaseAck:
        t = self._lease_call(sid)
        e = _parse_engine(engine)
        try:
            changed, _ = self.leases.report(sid, e, gpu_seconds, release, self.clock.monotonic(), yielded, units)
        except LeaseError as err:
            raise EngineError("invalid", str(err)) from None
        if changed:
            t.active = bool(self.leases.demand(t.name))
        # (or just enforced: freeze it now if it must wait)
        if changed or (self.leases.enforced(t.name) and not t.frozen and not self.leases.holds(t.name) and t.active):
            self._reschedule()
        return self._ack(sid, t, e)

    def lease_codec(self, sid: int, kind: str, open_: bool) -> tuple[bool, str]:
        """A client asks to open (or closes) a hardware codec session: the same caps as the kernel hooks."""
        t = self._lease_call(sid)
        if kind not in ("nvdec", "nvenc"):
            raise EngineError("invalid", f"codec session kind must be nvdec or nvenc, got {kind!r}")
        if not open_:
            if self.leases.codec_open(sid, kind) > 0:
                self.leases.note_codec(sid, kind, -1)
                self.session_freed(t.name, kind)
            return True, ""
        if kind == "nvenc" and self.video is not None and self.video.nvenc == 0:
            gpu = self.telemetry.gpus()[0].name if self.telemetry.gpus() else "this GPU"
            return False, f"{gpu} has no NVENC encoder; encode on the CPU (e.g. libx264) or on another GPU"
        why = self._admit(t, kind, 0)
        if why is not None:
            return False, f"tenant {t.name!r}: {why}"
        self.leases.note_codec(sid, kind, +1)
        return True, ""

    def lease_close(self, sid: int) -> None:
        closed = self.leases.close(sid, self.clock.monotonic())
        if closed is None:
            return
        name, codec, affected = closed
        t = self._tenants.get(name)
        if t is None:
            return
        for kind, n in codec.items():
            if n:
                self.session_freed(name, kind, n)
        t.active = bool(self.leases.demand(name)) if self.leases.cooperative(name) else False
        if not self.leases.cooperative(name):
            t.idle_run = 0
            t.last_cpu = None
        if affected:
            self._reschedule()

    # --- reporting ---------------------------------------------------------------------------------
    def snapshots(self, names: Iterable[str] | None = None) -> list[TenantSnapshot]:
        """Every tenant's snapshot, or those of `names` (a registration answers with one: O(1), not O(tenants))."""
        wanted = sorted(self._tenants) if names is None else sorted(names)
        stats = {s.name: s for s in self.policy.stats(self.clock.monotonic(), wanted)}
        by_gpu = self._active_weight_by_gpu()
        out = []
        for name in wanted:
            t = self._tenants[name]
            st = stats[name]
            shares = tuple(
                ResourceShare(r, st.target_share.get(r, 0.0), st.measured_share.get(r, 0.0), st.seconds_by.get(r, 0.0))
                for r in sorted(t.resources)
            )
            main = max(shares, key=lambda s: (s.target, s.measured), default=None)
            coop = self.leases.cooperative(name)
            state = _state(t, self.leases.holds(name) if coop else None)
            pids = () if t.missing else tuple(sorted(self.driver.pids(t.cgroup)))
            out.append(
                TenantSnapshot(
                    name=name,
                    weight=st.weight,
                    base_weight=t.base_weight,
                    priority=t.priority,
                    pids=pids,
                    state=state,
                    target_share=main.target if main else 0.0,
                    measured_share=main.measured if main else 0.0,
                    gpu_seconds=st.gpu_seconds,
                    cgroup=t.cgroup,
                    engines=t.all_engines(),
                    shares=shares,
                    slices=st.slices,
                    owner_uid=t.owner_uid,
                    adopted=t.adopted,
                    sessions=dict(t.sessions),
                    refusals=dict(t.refusals),
                    caps={k.value: self.cap(t, k, by_gpu) for k in CapKind},
                    memory_cap=t.limits.memory_bytes,
                    memory_reserve=t.limits.memory_reserve,
                    memory_bytes=t.memory_bytes,
                    over_memory=t.over_memory,
                    devices=self.devices.describe(self._v2_dir(t)) if t.devices_admitted and self.devices else None,
                    cooperative=coop,
                    overrun_s=self.leases.overrun_s(name),
                    enforced=self.leases.enforced(name),
                    unit_s=self.leases.unit_s(name),
                    turn_s=self.leases.min_run_s(name),
                    env=self._client_env(t),
                    labels=t.labels,
                    gpu_memory=gpu_memory(self.memory_ledger, name, t.limits, t.gpus, self.gpu_memory_totals()),
                )
            )
        return out

    def snapshot(self, name: str) -> TenantSnapshot:
        if name not in self._tenants:
            raise EngineError("not_found", f"unknown tenant {name!r}")
        return self.snapshots([name])[0]

    def gpu_samples(self) -> tuple[GpuSample, ...]:
        return self._last_samples

    def mixed_slices(self, gpu: int) -> tuple[OverlapMix, SliceKind] | None:
        """The mix a GPU's partly overlapping compute + graphics get now, and the kind of slice running; None
        while it is not mixing (no such pair with work, or an unsaturated GPU)."""
        kind = self._plan.running.get(gpu)
        mix = self._mix_shown.get(gpu)
        return None if kind is None or mix is None else (mix, kind)

    def gate_states(self) -> tuple[GateState, ...]:
        """Per contended resource: sliced (tenants take turns) or open, and how long it is held open."""
        return gate_states(self._plan.gates)

    @property
    def tenant_count(self) -> int:
        return len(self._tenants)
