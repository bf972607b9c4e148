"""A scheduler with fake cgroups, fake lease channels and an injected clock, and cooperative clients on it: the rig
of the lease tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.leases import FakeLeaseChannel, LeaseGrant, LeaseRevoke
from unisched.policy import Decision, Priority
from unisched.policy.callers import Caller
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample, NoGpuTelemetry

SLICE = 0.05


class Coop:
    """One cooperative client: its session, its channel, and the lease it believes it holds."""

    def __init__(self, rig: LeaseRig, name: str, weight: int, engine: str = "compute",
                 priority: Priority | None = None, uid: int = 0, caller: Caller | None = None) -> None:
        self.rig = rig
        self.name = name
        self.engine = engine
        self.channel = FakeLeaseChannel()
        rig.pid += 1
        self.sid, _ = rig.engine.lease_open(name, weight, priority, [engine], 0, rig.pid, uid, uid == 0,
                                            self.channel, caller=caller)
        self.held = False
        self.revokes: list[LeaseRevoke] = []
        self.grants: list[LeaseGrant] = []
        self.used = 0.0
        self.yields = True

    def want(self) -> None:
        self.rig.engine.lease_want(self.sid, self.engine)
        self.pump()

    def pump(self) -> None:
        for m in self.channel.take():
            if isinstance(m, LeaseGrant):
                self.held = True
                self.grants.append(m)
            else:
                self.held = False
                self.revokes.append(m)
                if self.yields and m.reason == "slice over":  # nothing in flight: hand over at once
                    self.rig.engine.lease_report(self.sid, self.engine, 0.0, False, yielded=True)

    def report(self, seconds: float, release: bool = False, units: int = 0) -> None:
        self.used += seconds
        self.rig.engine.lease_report(self.sid, self.engine, seconds, release, units=units)
        self.pump()


class LeaseRig:
    def __init__(self, tmp: Path, telemetry: object = None, **cfg: object) -> None:
        self.driver = FakeCgroupDriver()
        self.clock = FakeClock()
        config = DaemonConfig(slice_ms=SLICE * 1000, **cfg)  # type: ignore[arg-type]
        self.engine = Scheduler(config, self.driver, telemetry or NoGpuTelemetry(), StateStore(tmp / "s"), self.clock)  # type: ignore[arg-type]
        self.engine.start()
        self.pid = 5000
        self.clients: list[Coop] = []

    def coop(self, name: str, weight: int, engine: str = "compute", priority: Priority | None = None,
             uid: int = 0, caller: Caller | None = None) -> Coop:
        """A client of `uid` (0: an admin) opening a lease session in tenant `name`; `caller`: whom the books count
        it as (a pod's process: its pod; None: its uid)."""
        c = Coop(self, name, weight, engine, priority, uid, caller)
        self.clients.append(c)
        return c

    def unmodified(self, name: str, weight: int, engine: str = "compute") -> None:
        """A freezer-governed tenant on GPU 0 (as `unisched run` makes one), with a process of its own; its cgroup is
        `self.driver.groups[f"/unisched/{name}"]`."""
        self.pid += 1
        self.engine.register(name, weight, None, [engine], (0,), self.pid, 0, True)

    def tick(self) -> float:
        delay = self.engine.tick()
        while any(c.channel.messages for c in self.clients):  # a yield can grant the next holder at once
            for c in self.clients:
                c.pump()
        return delay

    def run(self, slices: int, busy: list[Coop], obey: bool = True, unit_s: float = 0.0) -> list[str]:
        """Each slice, every busy client that holds its lease (or every busy one, obey=False) uses all of it, in
        units of `unit_s` (counted in its reports) when given. Returns who held the lease, slice by slice."""
        holders = []
        for _ in range(slices):
            delay = self.tick()
            holders.append("+".join(c.name for c in busy if c.held))
            self.clock.advance(delay)
            for c in busy:
                if c.held or not obey:
                    c.report(delay, units=max(1, round(delay / unit_s)) if unit_s else 0)
                else:
                    c.report(0.0)  # renews: still wants the engine
        return holders


def busy_rig(tmp: Path) -> LeaseRig:
    """A rig whose GPU 0 reads fully busy at every sample, whoever runs on it (a saturated GPU as NVML shows it)."""
    rig = LeaseRig(tmp, telemetry=FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 141 << 30)]))
    rig.engine.telemetry.next_samples = [GpuSample(0, 1.0, 0.0, 0.0, 0)]  # type: ignore[attr-defined]
    return rig


def recording(decide: Callable[[float], Decision], into: list[float]) -> Callable[[float], Decision]:
    """`decide`, noting each time it is asked."""
    def wrapped(now: float) -> Decision:
        into.append(now)
        return decide(now)
    return wrapped
