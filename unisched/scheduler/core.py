"""The scheduler: tenants are cgroups (frozen and thawed by the freezer) or lease clients, and each slice the
scheduler measures, charges, decides, and freezes or thaws and grants or revokes leases.

`Scheduler.tick()` is one synchronous step (measure the interval that just ended -> charge the policy ->
update demand -> observe the gates -> decide -> plan -> freeze/thaw, grant/revoke); the asyncio runner calls it
every slice. The rules of each step are policy.plan's (docs/design/scheduling.md): the scheduler measures and applies.
Time comes from an injected Clock, so tests drive it step by step with a FakeClock and fake cgroups.

This class is the facade the transport and the daemon hold; each part is a module of plain functions over one
`Context`: registration (registration.py; the caller's move, off the event loop: moves.py), the tenant table
(roster.py), session caps, device admission and memory reserves (admission.py), video memory terms (memory.py),
NVML memory upkeep (upkeep.py), the slice (tick.py; its saves of the state file are written off the event loop:
saves.py), lease sessions (lease_calls.py), start and stop (lifecycle.py) and what callers see (reporting.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping

from unisched.enforce.cgroups import CgroupDriver
from unisched.enforce.devices import DeviceAdmission
from unisched.enforce.leases import LeaseChannel
from unisched.enforce.mps import MpsControl, MpsStatus
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.timerslack import ThreadSlack
from unisched.policy import ContentionMap, Priority, Resource, WeightedFairShare
from unisched.policy.callers import Caller
from unisched.policy.caps import VideoEngines
from unisched.policy.memory import MemoryTerms
from unisched.policy.overlap import OverlapMix, SliceKind
from unisched.policy.plan import PlanConfig
from unisched.policy.saturation import GateState
from unisched.scheduler import admission, lease_calls, lifecycle, registration, reporting, roster, slack, tick
from unisched.scheduler.clock import Clock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.context import Context, build
from unisched.scheduler.leases import LeaseBook
from unisched.scheduler.limits import NO_MEMORY_ASK, MemoryAsk
from unisched.scheduler.readings import Readings
from unisched.scheduler.registration import RegisterAsk
from unisched.scheduler.state import StateStore
from unisched.scheduler.tenant import LeaseAck, SchedulerError, TenantSnapshot
from unisched.telemetry import GpuSample, GpuTelemetry

__all__ = ["SchedulerError", "Scheduler", "LeaseAck", "RegisterAsk", "TenantSnapshot"]


class Scheduler:
    """The scheduler as its callers see it: each method is one request, answered by the part that owns it."""

    def __init__(
        self,
        config: DaemonConfig,
        driver: CgroupDriver,
        telemetry: GpuTelemetry,
        store: StateStore,
        clock: Clock,
        devices: DeviceAdmission | None = None,
        mps: MpsControl | None = None,
        thread_slack: ThreadSlack | None = None,
    ) -> None:
        """`thread_slack`: how the tenants' threads get their timer slack (default: through /proc)."""
        self._c: Context = build(config, driver, telemetry, store, clock, devices, mps, thread_slack)
        c = self._c
        # collaborators callers read (never replaced: each names the context's own object)
        self.config: DaemonConfig = c.config
        self.driver: CgroupDriver = c.driver
        self.telemetry: GpuTelemetry = c.telemetry
        self.clock: Clock = c.clock
        self.policy: WeightedFairShare = c.policy
        self.leases: LeaseBook = c.leases
        self.contention: ContentionMap = c.contention
        self.gpu_indices: tuple[int, ...] = c.gpu_indices
        self.video: VideoEngines | None = c.video
        self.plan_config: PlanConfig = c.plan_config

    @property
    def devices(self) -> DeviceAdmission | None:
        return self._c.devices

    @devices.setter
    def devices(self, devices: DeviceAdmission | None) -> None:
        self._c.devices = devices

    @property
    def memory_ledger(self) -> MemoryLedger | None:
        """The session hooks' video memory counts (set where the hooks are made; None: not followed)."""
        return self._c.memory_ledger

    @memory_ledger.setter
    def memory_ledger(self, ledger: MemoryLedger | None) -> None:
        self._c.memory_ledger = ledger

    @property
    def next_tick(self) -> float:
        """When the slice the last tick started ends (monotonic seconds)."""
        return self._c.next_tick

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        lifecycle.start(self._c)

    def fold_decisions(self, call_soon: Callable[[Callable[[], None]], object]) -> None:
        """Run in an event loop (`call_soon` its loop's): decisions between ticks past the first few of a loop turn
        fold into one at its end (tick.reschedule)."""
        self._c.defer = call_soon

    def thaw_all(self, extra: Iterable[str] = ()) -> list[str]:
        return lifecycle.thaw_all(self._c, extra)

    def shutdown(self) -> None:
        lifecycle.shutdown(self._c)

    @property
    def left_frozen(self) -> bool:
        """The shutdown could not thaw some cgroup (the next start thaws it from the record of what was governed)."""
        return self._c.left_frozen

    def mps_status(self) -> MpsStatus | None:
        return lifecycle.mps_status(self._c)

    # --- requests -----------------------------------------------------------------------------------
    def has_tenant(self, name: str) -> bool:
        return roster.has_tenant(self._c, name)

    def note_session_hooks(self, tenant: str) -> None:
        roster.note_session_hooks(self._c, tenant)

    def tenant_of_pid(self, pid: int) -> str | None:
        return roster.tenant_of_pid(self._c, pid)

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
        memory: MemoryAsk = NO_MEMORY_ASK,
    ) -> TenantSnapshot:
        """registration.enroll (the caller moved at once, where no event loop runs), answered with the tenant's
        snapshot; the daemon's loop calls `start_register`."""
        ask = RegisterAsk(name, weight, priority, tuple(engines), tuple(gpus), pid, uid, is_admin, alive=alive,
                          keep=keep, session_hooks=session_hooks, memory=memory)
        return reporting.snapshot(self._c, registration.enroll(self._c, ask).name)

    def start_register(self, ask: RegisterAsk) -> asyncio.Future[TenantSnapshot]:
        """`register` from the event loop: the caller's cgroup is read, and the caller moved into the tenant's, off
        the loop (registration.start_enroll); the future is the tenant's snapshot once it is in, or the refusal
        (a new tenant's refusals raise at once)."""
        return registration.start_enroll(self._c, ask, lambda t: reporting.snapshot(self._c, t.name))

    def adopt(self, name: str, weight: int | None, priority: Priority | None, cgroup: str, engines: Iterable[str],
              gpus: Iterable[int], labels: Mapping[str, str] | None = None,
              memory: MemoryAsk = NO_MEMORY_ASK) -> TenantSnapshot:
        return registration.adopt(self._c, name, weight, priority, cgroup, engines, gpus, labels, memory)

    def set_weight(self, name: str, weight: int) -> TenantSnapshot:
        return roster.set_weight(self._c, name, weight)

    def remove_as(self, name: str, uid: int, is_admin: bool) -> None:
        roster.remove_as(self._c, name, uid, is_admin)

    def remove(self, name: str) -> None:
        roster.remove(self._c, name)

    def set_limits(self, name: str, render: int | None, decode: int | None, encode: int | None,
                   memory_bytes: int | None, memory_reserve: int | None = None) -> TenantSnapshot:
        return roster.set_limits(self._c, name, render, decode, encode, memory_bytes, memory_reserve)

    def memory_terms(self) -> Mapping[str, MemoryTerms]:
        """The GPU memory cap and reserve per GPU of each tenant that has one; the session hooks read it from their
        own thread (admission.memory_terms)."""
        return admission.memory_terms(self._c)

    def gpu_memory_totals(self) -> dict[int, int]:
        """Each GPU's memory in bytes (what reserves are checked against)."""
        return admission.gpu_memory_totals(self._c)

    # --- sessions the seccomp hooks see -------------------------------------------------------------
    def admit_session(self, tenant: str, kind: str, h_class: int) -> bool:
        return admission.admit_session(self._c, tenant, kind, h_class)

    def session_freed(self, tenant: str, kind: str, count: int = 1) -> None:
        admission.session_freed(self._c, tenant, kind, count)

    # --- the slice ----------------------------------------------------------------------------------
    def tick(self) -> float:
        return tick.tick(self._c)

    def advance(self, readings: Readings | None = None) -> float:
        """The loop's call: a tick at a slice boundary, else a rationed slice's next step (tick.advance);
        with `readings` (from readings_reader, made off the loop), a tick on them."""
        return tick.advance(self._c, readings)

    def tick_due(self) -> bool:
        return tick.tick_due(self._c)

    def readings_reader(self) -> Callable[[], Readings]:
        """The next tick's reads (NVML, cgroup CPU time) as a call for a worker thread (tick.readings_reader)."""
        return tick.readings_reader(self._c)

    @property
    def sweeps_slack(self) -> bool:
        """Whether the tenants' threads get a timer slack (`timer_slack_us`): the loop then sweeps them."""
        return slack.slack_ns(self._c) > 0

    def slack_sweeper(self) -> Callable[[], slack.Swept] | None:
        """The next sweep of the tenants' timer slack as a call for a worker thread; None when it is off."""
        return slack.sweeper(self._c)

    def note_slack(self, swept: slack.Swept) -> None:
        slack.note(self._c, swept)

    # --- lease sessions -----------------------------------------------------------------------------
    def lease_open(
        self, name: str, weight: int | None, priority: Priority | None, engines: Iterable[str], gpu: int,
        pid: int, uid: int, is_admin: bool, channel: LeaseChannel, alive: Callable[[], bool] | None = None,
        caller: Caller | None = None,
    ) -> tuple[int, TenantSnapshot]:
        """A lease session opened at once (where no event loop runs); the daemon's loop calls `start_lease_open`.
        `caller`: whom the books kept per caller count it as (RegisterAsk.caller)."""
        ask = RegisterAsk(name, weight, priority, tuple(engines), (), pid, uid, is_admin, alive=alive, caller=caller)
        return lease_calls.lease_open(self._c, ask, gpu, channel)

    def start_lease_open(self, ask: RegisterAsk, gpu: int,
                         channel: LeaseChannel) -> asyncio.Future[tuple[int, TenantSnapshot]]:
        """`lease_open` from the event loop: the caller moves in off the loop; the future is the session."""
        return lease_calls.start_lease_open(self._c, ask, gpu, channel)

    def lease_want(self, sid: int, engine: str) -> LeaseAck:
        return lease_calls.lease_want(self._c, sid, engine)

    def lease_report(self, sid: int, engine: str, gpu_seconds: float, release: bool, yielded: bool = False,
                     units: int = 0, ended_ago_s: float = 0.0) -> LeaseAck:
        return lease_calls.lease_report(self._c, sid, engine, gpu_seconds, release, yielded, units, ended_ago_s)

    def lease_codec(self, sid: int, kind: str, open_: bool) -> tuple[bool, str]:
        return lease_calls.lease_codec(self._c, sid, kind, open_)

    def lease_close(self, sid: int) -> None:
        lease_calls.lease_close(self._c, sid)

    # --- reporting ----------------------------------------------------------------------------------
    def snapshots(self, names: Iterable[str] | None = None) -> list[TenantSnapshot]:
        return reporting.snapshots(self._c, names)

    def snapshot(self, name: str) -> TenantSnapshot:
        return reporting.snapshot(self._c, name)

    def gpu_samples(self) -> tuple[GpuSample, ...]:
        return reporting.gpu_samples(self._c)

    def mixed_slices(self, gpu: int) -> tuple[OverlapMix, SliceKind] | None:
        return reporting.mixed_slices(self._c, gpu)

    def gate_states(self) -> tuple[GateState, ...]:
        return reporting.gate_states(self._c)

    def charged_by_rule(self) -> tuple[tuple[Resource, str, float], ...]:
        return reporting.charged_by_rule(self._c)

    @property
    def tenant_count(self) -> int:
        return len(self._c.tenants)
