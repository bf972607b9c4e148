"""What the scheduler's parts share (`Context`: its collaborators, its tenants and the state between slices),
and how it is built from the config. Each part is a module of plain functions taking the context."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import structlog

from unisched.enforce.cgroups import CgroupDriver
from unisched.enforce.devices import DeviceAdmission
from unisched.enforce.mps import MpsControl
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.memory_calls import REFUSAL_LOG_INTERVAL_S
from unisched.enforce.timerslack import ProcThreadSlack, ThreadSlack
from unisched.logs import Throttle
from unisched.policy import SHARED_SM, ContentionMap, FairShareConfig, Resource, WeightedFairShare
from unisched.policy.caps import VideoEngines, video_engines_for
from unisched.policy.charging import ReportMatch
from unisched.policy.contention import PARTIAL_OVERLAP
from unisched.policy.memory import MemoryTerms
from unisched.policy.overlap import OverlapMix
from unisched.policy.plan import PlanConfig, PlanState, Rule
from unisched.policy.tuning import TUNING
from unisched.scheduler.clock import Clock
from unisched.scheduler.config import ConfigError, DaemonConfig
from unisched.scheduler.leases import LeaseBook
from unisched.scheduler.moves import MoveThread
from unisched.scheduler.saves import StateWriter
from unisched.scheduler.state import LineCache, StateStore
from unisched.scheduler.tenant import SchedulerError, Tenant
from unisched.telemetry import GpuSample, GpuTelemetry

__all__ = [
    "SAVE_DELAY_S", "WRITER_STOP_S", "Context", "build", "check_gpus", "get", "save", "save_off_loop", "save_soon",
]

log = structlog.get_logger("unisched.scheduler")
SAVE_DELAY_S = 0.5
"""Registrations are written to the state file by the tick at most this long after them: one write per burst
instead of one fsync'ed rewrite of every tenant per call, at the cost of that window's entries on a crash."""
WRITER_STOP_S = 5.0
"""How long shutdown waits for the state file's writer thread to end (it has nothing left to write by then)."""


@dataclass
class Context:
    """The scheduler's collaborators and mutable state, passed explicitly to the functions of its parts."""

    config: DaemonConfig
    driver: CgroupDriver
    telemetry: GpuTelemetry
    store: StateStore
    clock: Clock
    devices: DeviceAdmission | None
    mps: MpsControl | None
    policy: WeightedFairShare
    gpu_indices: tuple[int, ...]
    video: VideoEngines | None
    contention: ContentionMap
    plan_config: PlanConfig
    leases: LeaseBook
    last_tick: float
    next_tick: float
    thread_slack: ThreadSlack
    """Sets the timer slack of the rendering tenants' threads (`timer_slack_us`; scheduler.slack)."""
    plan: PlanState = field(default_factory=PlanState)
    """The scheduling model's state between slices (policy.plan): gates, mixed-slice clocks."""
    tenants: dict[str, Tenant] = field(default_factory=dict)
    tenant_of_cgroup: dict[str, str] = field(default_factory=dict)
    """Each tenant's cgroup (no trailing slash) -> its name (roster.add and drop keep it; roster.tenant_of_pid)."""
    left_behind: dict[str, int] = field(default_factory=dict)
    """The cgroups of removed tenants that still held processes -> the removed tenant's owner uid (roster.drop):
    only that owner or an admin may make a tenant there again (registration._check_unoccupied). Oldest first,
    at most MAX_LEFT_BEHIND."""
    declared: frozenset[str] = frozenset()
    """Tenants the config declares stay when their processes exit, however they were first made."""
    slack_from: int = 0
    """Where the next timer slack sweep starts in the tenants' list (each sweep starts one further)."""
    slack_refusals: Throttle = field(default_factory=lambda: Throttle(60.0))
    """The warning that the kernel refused to set a timer slack: at most once a minute."""
    session_refusals: Throttle = field(init=False)
    """The warning that a session was refused (admission.admit): at most one per tenant and kind in the hooks' own
    refusal lines' interval (memory_calls.REFUSAL_LOG_INTERVAL_S), on the engine's clock."""
    engine_lines: Throttle = field(init=False)
    """The info line that a tenant's engines changed with its sessions (admission.engines_changed): a hooked app can
    open and free a session of a kind outside its declared engines in a loop, so at most one per tenant in the same
    interval, on the engine's clock."""
    memory_ledger: MemoryLedger | None = None
    """The session hooks' video memory counts (set where the hooks are made; None: not followed)."""
    weights_on: dict[frozenset[int], tuple[int, Mapping[str, int]]] = field(default_factory=dict)
    """Per set of GPUs, the weights of the tenants with work there since the last demand update, which clears it
    (admission._weights_on; tick._update_demand)."""
    memory_terms: Mapping[str, MemoryTerms] = field(default_factory=lambda: MappingProxyType({}))
    """The memory cap, reserve and GPUs of each tenant that has one (admission.update_memory_terms). The hooks' threads
    read it on every allocation; each change replaces the mapping whole, so a reader never sees one half made."""
    last_samples: tuple[GpuSample, ...] = ()
    charged: dict[tuple[str, Resource], float] = field(default_factory=dict)
    """GPU seconds each freezer-governed tenant was charged per resource at the last tick (what rationing weighs)."""
    charged_by_rule: dict[tuple[Resource, Rule], float] = field(default_factory=dict)
    """GPU seconds charged to freezer-governed tenants since the start, per resource and the rule that split them
    (policy.charging.charge_rule): whether the split used NVML's per-process samples (unisched_gpu_charged_seconds)."""
    step: int = 0
    """The step of the slice running now (a rationed slice has PlanState.steps; see tick.advance)."""
    matches: dict[Resource, ReportMatch] = field(default_factory=dict)
    """Per resource, cooperative reports matched against the busy time charged to freezer-governed tenants."""
    last_active: frozenset[str] = frozenset()
    memory_at: float = float("-inf")
    telemetry_failing: bool = False
    mix_shown: dict[int, OverlapMix] = field(default_factory=dict)
    """Per GPU, the last mix logged (and shown by `mixed_slices`)."""
    logged_shares: dict[str, tuple[float, str]] = field(default_factory=dict)
    unsaved: bool = False
    saved_at: float = float("-inf")
    stopped: bool = False
    """The engine has shut down (everything thawed): no decision may freeze anything again."""
    left_frozen: bool = False
    """The shutdown's thaw failed for some cgroup: the daemon keeps its record of what it governs for the next start."""
    defer: Callable[[Callable[[], None]], object] | None = None
    """The daemon's event loop's call_soon (None: no loop, every decision at once): see tick.reschedule."""
    decisions_this_turn: int = 0
    decision_due: bool = False
    mover: MoveThread = field(default_factory=MoveThread)
    """Where registering callers are moved into their tenants' cgroups, off the event loop (moves.py)."""
    lines: LineCache = field(default_factory=LineCache)
    """The state file's lines of the last save, each made again only when its tenant changed."""
    writer: StateWriter = field(init=False)
    """Writes the state file: the tick's saves on a thread of its own, the others here (saves.py)."""

    def __post_init__(self) -> None:
        self.writer = StateWriter(self.store)
        self.session_refusals = Throttle(REFUSAL_LOG_INTERVAL_S, self.clock.monotonic)
        self.engine_lines = Throttle(REFUSAL_LOG_INTERVAL_S, self.clock.monotonic)


def build(
    config: DaemonConfig,
    driver: CgroupDriver,
    telemetry: GpuTelemetry,
    store: StateStore,
    clock: Clock,
    devices: DeviceAdmission | None = None,
    mps: MpsControl | None = None,
    slack: ThreadSlack | None = None,
) -> Context:
    if config.mps and mps is None:
        raise ConfigError("config 'mps': this scheduler was built without an MPS control")
    policy = WeightedFairShare(
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
    gpu_indices: tuple[int, ...] = tuple(g.index for g in gpus) or (0,)
    contention = _contention(config, store, gpus[0].name if gpus else None)
    plan_config = PlanConfig(contention, gpu_indices, gate, config.activity_threshold, config.idle_slices,
                             slice_s=config.slice_ms / 1000.0, mix_period_s=config.mix_period_ms / 1000.0,
                             ration=config.ration_paced)
    leases = LeaseBook(policy, contention, config.slice_ms / 1000.0, config.lease_timeout_ms / 1000.0,
                       config.lease_max_run_ms / 1000.0)
    now = clock.monotonic()
    return Context(
        config=config, driver=driver, telemetry=telemetry, store=store, clock=clock, devices=devices,
        mps=mps if config.mps else None, policy=policy, gpu_indices=gpu_indices,
        video=video_engines_for(gpus[0].name) if gpus else None, contention=contention, plan_config=plan_config,
        leases=leases, last_tick=now, next_tick=now, declared=frozenset(d.name for d in config.tenants),
        thread_slack=ProcThreadSlack(driver) if slack is None else slack,
    )


def _contention(config: DaemonConfig, store: StateStore, gpu_name: str | None) -> ContentionMap:
    wanted = config.contention
    if wanted not in ("auto", PARTIAL_OVERLAP):
        return ContentionMap.named(wanted)
    kept = store.measured_contention(gpu_name) if gpu_name is not None else None
    if kept is None:
        if wanted == PARTIAL_OVERLAP:  # mixed slices whatever the calibration's sum: it must exist
            raise ConfigError(f"contention 'partial-overlap' plans mixed slices from a calibration of the GPU "
                              f"model, and there is none for {gpu_name or 'this machine (no GPU seen)'} in "
                              f"{config.state_dir}: run `unisched calibrate`, or use 'auto'")
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


def save(c: Context) -> None:
    """Write the state file before returning, on the event loop: for a change its caller is told is done (and
    durable), and at start and stop. A periodic save waiting on the writer thread is dropped (this one is newer),
    one being written is waited for: the file never goes back. A failed write raises to the caller."""
    c.writer.write_now(_encoded(c))
    c.unsaved = False


def save_off_loop(c: Context) -> None:
    """The tick's save: the snapshot is taken here, written on the writer thread (saves.py) while the loop
    serves. A write that fails is logged there and saved again by a later tick (`c.unsaved`)."""
    c.unsaved = False
    c.writer.hand_off(_encoded(c))


def _encoded(c: Context) -> bytes:
    return c.lines.body(c.tenants[name].saved_fields() for name in sorted(c.tenants))


def save_soon(c: Context) -> None:
    """For registrations (`run` and lease sessions) and tenants the daemon removes itself: saved by the tick
    within SAVE_DELAY_S, off the event loop, so a thousand clients registering at once neither rewrite the file a
    thousand times nor hold the loop for its writes."""
    c.unsaved = True


def get(c: Context, name: str) -> Tenant:
    t = c.tenants.get(name)
    if t is None:
        raise SchedulerError("not_found", f"unknown tenant {name!r}")
    return t


def check_gpus(c: Context, gpus: Iterable[int]) -> tuple[int, ...] | None:
    g = tuple(gpus)
    bad = [i for i in g if i not in c.gpu_indices]
    if bad:
        raise SchedulerError("invalid", f"no GPU {bad}; this host has GPUs {list(c.gpu_indices)}")
    return g or None
