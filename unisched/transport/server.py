"""The gRPC face of the daemon: a servicer that maps requests onto the engine, and `serve()` which runs the
engine, the front door with its two Unix sockets (gRPC: grpcdoor; the lease stream: lease) and the optional TLS
listener in one asyncio loop until SIGTERM/SIGINT, thawing everything on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import signal
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import structlog

from unisched import __version__
from unisched.enforce.seccomp.abi import probe as seccomp_probe
from unisched.scheduler.config import DaemonConfig, check_listener
from unisched.scheduler.core import RegisterAsk, Scheduler, SchedulerError
from unisched.scheduler.runner import run_engine
from unisched.sdnotify import Notifier, Watchdog, watchdog_interval_s
from unisched.transport.agent import SeccompAgentServer
from unisched.transport.carry import Carried, ListenerCarry
from unisched.transport.claim import replace_stale_socket
from unisched.transport.client import AGENT_SOCKET_METADATA, LEASE_SOCKET_METADATA
from unisched.transport.convert import PRIORITY, memory_ask, public_summary, snapshot_to_pb
from unisched.transport.frontdoor import FrontDoor
from unisched.transport.grpcdoor import MAX_MESSAGE_BYTES, Call, GrpcDoor, fail
from unisched.transport.health import beats, probes
from unisched.transport.identity import CONTAINED_ROOT, PeerCred, admin_uid, is_admin
from unisched.transport.lease import ERROR_CODES, LeaseService
from unisched.transport.metrics import EngineView, MetricsServer, start_metrics_server
from unisched.transport.pacing import NO_UID, Pacer
from unisched.transport.shared_call import SharedCall
from unisched_wire import unisched_pb2 as pb

__all__ = ["MAX_MESSAGE_BYTES", "Doors", "UnischedServicer", "serve", "server_tls", "snapshot_to_pb"]

log = structlog.get_logger("unisched.transport")


MPS_STATUS_FRESH_S = 1.0
"""How long Status reuses the MPS control daemon's last answer (each asks a process)."""


class UnischedServicer:
    """The API's calls (named as in the proto's service), each given its request and its Call."""

    def __init__(
        self,
        engine: Scheduler,
        admin_group: str | None,
        started: float,
        cgroup_driver: str,
        cgroup_root: str,
        nvml: bool,
        pacer: Pacer,
    ) -> None:
        self.engine = engine
        self.pacer = pacer
        """Calls that add, remove or list every tenant take turns with the lease stream's hellos (pacing)."""
        self._admin_gid: int | None = None
        if admin_group is not None:
            try:
                self._admin_gid = grp.getgrnam(admin_group).gr_gid
            except KeyError:
                log.warning("admin group does not exist; only root is admin", group=admin_group)
        self._started = started
        self._driver = cgroup_driver
        self._root = cgroup_root
        self._nvml = nvml
        self.agent_socket = ""
        self.runtime_agent_socket = ""
        self.lease_socket = ""
        self._hooks = seccomp_probe() or "on"
        self._devices = "on" if engine.devices is not None else "unavailable"
        # asks nvidia-cuda-mps-control (a process, up to its timeout): off the loop that runs the slices, once at a
        # time and at most once a second however many Status calls come
        self._mps = SharedCall(engine.mps_status, MPS_STATUS_FRESH_S, time.monotonic)

    # identity ------------------------------------------------------------------------------------
    def is_admin(self, cred: PeerCred) -> bool:
        """Root or the admin group by the uid's group list, in the host's namespaces (identity.is_admin)."""
        return is_admin(cred, self._admin_gid)

    def may_be_admin(self, uid: int) -> bool:
        """Whether a caller of kernel uid `uid` could be an admin (is_admin then decides, once it is pinned)."""
        return admin_uid(uid, self._admin_gid)

    @staticmethod
    def _owner(cred: PeerCred) -> int:
        """The uid whose tenants the caller owns: the one it is known by, unless it is contained (PeerCred.contained:
        CONTAINED_ROOT owns nothing, RegisterAsk.contained)."""
        return CONTAINED_ROOT if cred.contained else cred.uid

    @staticmethod
    def _need_caller(call: Call) -> PeerCred:
        if call.caller is None:
            fail("PERMISSION_DENIED", "this call needs the daemon's Unix socket (identity comes from SO_PEERCRED)")
        return call.caller

    def _need_admin(self, call: Call) -> PeerCred:
        cred = self._need_caller(call)
        if not self.is_admin(cred):
            fail("PERMISSION_DENIED", f"uid {cred.uid} is not an admin (root or the admin group)")
        return cred

    @staticmethod
    def _fail(e: SchedulerError) -> NoReturn:
        fail(ERROR_CODES[e.kind], str(e))

    # calls ---------------------------------------------------------------------------------------
    async def Register(self, request: pb.RegisterRequest, call: Call) -> pb.Tenant:
        cred = self._need_caller(call)
        await self.pacer.turn(cred.caller)
        ask = RegisterAsk(
            request.tenant,
            request.weight or None,
            PRIORITY.get(request.priority),
            tuple(request.engines),
            tuple(request.gpus),
            cred.pid,
            cred.uid,
            self.is_admin(cred),
            alive=cred.alive,
            keep=request.keep,
            session_hooks=request.session_hooks and self._hooks == "on",  # (hooks this kernel can install)
            memory=memory_ask(request),
            contained=cred.contained,
            caller=cred.caller,
        )
        try:  # the caller's cgroup move runs off the loop: others are served meanwhile
            snap = await self.engine.start_register(ask)
        except SchedulerError as e:
            self._fail(e)
        log.info("registered", tenant=snap.name, pid=cred.pid, uid=cred.uid)
        # what `unisched run` needs next, with this reply: no Status round trip per run
        call.trailers.update({AGENT_SOCKET_METADATA: self.agent_socket, LEASE_SOCKET_METADATA: self.lease_socket})
        return snapshot_to_pb(snap)

    async def Adopt(self, request: pb.AdoptRequest, call: Call) -> pb.Tenant:
        cred = self._need_admin(call)
        await self.pacer.turn(cred.caller)
        try:
            snap = self.engine.adopt(
                request.tenant,
                request.weight or None,
                PRIORITY.get(request.priority),
                request.cgroup,
                list(request.engines),
                list(request.gpus),
                dict(request.labels),
                memory_ask(request),
            )
        except SchedulerError as e:
            self._fail(e)
        return snapshot_to_pb(snap)

    async def SetWeight(self, request: pb.SetWeightRequest, call: Call) -> pb.Tenant:
        self._need_admin(call)
        try:
            return snapshot_to_pb(self.engine.set_weight(request.tenant, request.weight))
        except SchedulerError as e:
            self._fail(e)

    async def SetLimit(self, request: pb.SetLimitRequest, call: Call) -> pb.Tenant:
        self._need_admin(call)

        def opt(field: str) -> int | None:
            return int(getattr(request, field)) if request.HasField(field) else None

        try:
            return snapshot_to_pb(self.engine.set_limits(
                request.tenant, opt("render"), opt("decode"), opt("encode"), opt("memory_bytes"),
                opt("memory_reserve"),
            ))
        except SchedulerError as e:
            self._fail(e)

    async def RemoveTenant(self, request: pb.RemoveTenantRequest, call: Call) -> pb.Empty:
        """An admin removes any tenant; anyone else only tenants they own (run --keep ones, or those not yet gone)."""
        cred = self._need_caller(call)
        await self.pacer.turn(cred.caller)
        try:
            self.engine.remove_as(request.tenant, self._owner(cred), self.is_admin(cred))
        except SchedulerError as e:
            self._fail(e)
        return pb.Empty()

    async def ListTenants(self, request: pb.ListTenantsRequest, call: Call) -> pb.ListTenantsReply:
        """Admins see everything; others see their own tenants whole and a public summary of the rest. It walks
        every tenant (tens of milliseconds at a thousand), so it takes its turn with the registrations."""
        cred = call.caller
        admin = cred is not None and self.is_admin(cred)
        await self.pacer.turn(cred.caller if cred is not None else NO_UID)
        mine = NO_UID if cred is None else self._owner(cred)
        out = []
        for snap in self.engine.snapshots():
            t = snapshot_to_pb(snap)
            if not admin and snap.owner_uid != mine:
                public_summary(t)
            out.append(t)
        return pb.ListTenantsReply(tenants=out)

    async def Status(self, request: pb.StatusRequest, call: Call) -> pb.StatusReply:
        cred = call.caller
        gpus = {g.index: g for g in self.engine.telemetry.gpus()}
        samples = {s.index: s for s in self.engine.gpu_samples()}
        reply = pb.StatusReply(
            version=__version__,
            mode=self.engine.config.mode.value,
            slice_ms=self.engine.config.slice_ms,
            cgroup_driver=self._driver,
            cgroup_root=self._root,
            nvml=self._nvml,
            tenants=self.engine.tenant_count,
            uptime_s=time.monotonic() - self._started,
        )
        for i, g in sorted(gpus.items()):
            s = samples.get(i)
            gpu = pb.Gpu(
                index=i,
                name=g.name,
                contention=self.engine.contention.name,
                sm_util=s.sm_util if s else 0.0,
                dec_util=s.dec_util if s else 0.0,
                enc_util=s.enc_util if s else 0.0,
                memory_used=s.memory_used if s else 0,
                memory_total=g.memory_total,
            )
            mixed = self.engine.mixed_slices(i)
            if mixed is not None:
                mix, kind = mixed
                gpu.mix.CopyFrom(pb.MixedSlices(together=mix.both, compute_alone=mix.compute_only,
                                                graphics_alone=mix.graphics_only, now=kind.value))
            reply.gpus.append(gpu)
        if cred is not None:
            reply.caller_pid = cred.pid
            reply.caller_uid = max(cred.uid, 0)  # root in a container (CONTAINED_ROOT) is root where it runs
            reply.caller_is_admin = self.is_admin(cred)
            tenant = self.engine.tenant_of_pid(cred.pid) or ""
            reply.caller_tenant = tenant if cred.alive() else ""  # read through a pid that still named the caller
        reply.agent_socket = self.agent_socket
        reply.runtime_agent_socket = self.runtime_agent_socket
        reply.session_hooks = self._hooks
        reply.device_admission = self._devices
        mps = await self._mps.get()
        reply.mps = "off" if mps is None else "running" if mps.running else "not running"
        reply.mps_pipe_dir = "" if mps is None else mps.pipe_dir
        return reply


def server_tls(config: DaemonConfig) -> ssl.SSLContext:
    """TLS for the TCP listener; clients must present a certificate signed by tls_client_ca."""
    check_listener(config)
    assert config.tls_cert is not None and config.tls_key is not None and config.tls_client_ca is not None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=config.tls_client_ca)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(config.tls_cert, config.tls_key)
    context.set_alpn_protocols(["h2"])  # gRPC clients insist on it
    return context


def _secure_socket(path: str, group: str | None) -> None:
    if group is None:
        os.chmod(path, 0o666)
        return
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise SystemExit(f"unisched: socket_group {group!r} does not exist") from None
    os.chown(path, 0, gid)
    os.chmod(path, 0o660)


@dataclass(frozen=True)
class Doors:
    """What serves clients, for a caller (tests) that wants to look at it: both sockets' front door, and the
    gRPC server (its `caller` hook stands in other uids)."""

    front: FrontDoor
    grpc: GrpcDoor


async def _listen_tls(door: GrpcDoor, config: DaemonConfig, tls: ssl.SSLContext) -> None:
    assert config.listen is not None
    host, _, port = config.listen.rpartition(":")
    try:
        await door.start_tls(host.strip("[]"), int(port), tls)
    except OSError as e:
        raise OSError(f"cannot listen on {config.listen}: {e.strerror or e}") from None


async def serve_async(
    config: DaemonConfig,
    engine: Scheduler,
    nvml: bool,
    stop: asyncio.Event | None = None,
    ready: Callable[[Doors], None] | None = None,
    carried: list[tuple[int, Carried]] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or until `stop` is set, when the caller owns stopping, as tests do). `carried`:
    the session hooks' listeners the last graceful stop kept (ListenerCarry.take, which the caller made first).

    Raises ConfigError before touching anything when `listen` is set without its TLS files, and at the agent's start
    when the runtime agent socket's directory cannot be made or is not one of its own."""
    started = time.monotonic()
    tls = server_tls(config) if config.listen else None
    engine.start()
    loop = asyncio.get_running_loop()
    pacer = Pacer(loop.call_soon)
    engine.fold_decisions(loop.call_soon)
    servicer = UnischedServicer(engine, config.admin_group, started, engine.driver.kind, str(engine.driver.mount), nvml,
                                pacer)
    servicer.agent_socket = config.agent_socket
    servicer.runtime_agent_socket = config.runtime_agent_socket
    servicer.lease_socket = config.lease_socket
    front = FrontDoor(is_admin=servicer.is_admin, may_be_admin=servicer.may_be_admin)
    door = GrpcDoor(servicer, config.lease_socket)
    lease = LeaseService(engine, servicer.is_admin, pacer)
    notifier = Notifier.from_env()
    agent = SeccompAgentServer(config.agent_socket, engine, carry=ListenerCarry(notifier, config.state_dir),
                               carried=carried, runtime_path=config.runtime_agent_socket)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    served = asyncio.Event()
    health = probes(config, engine, nvml, served.is_set)
    engine_task = asyncio.create_task(run_engine(engine, stop, beats(health.heartbeat, _watchdog(notifier, engine))))
    metrics: MetricsServer | None = None
    metrics_task: asyncio.Task[None] | None = None
    bound: list[str] = []
    try:
        if tls is not None:
            await _listen_tls(door, config, tls)
        await agent.start()
        for path, serve_one in ((config.socket, door.serve), (config.lease_socket, lease.serve)):
            replace_stale_socket(path)  # (`serve` holds each socket's lock already: transport.claim)
            await front.open(path, serve_one)
            bound.append(path)
            _secure_socket(path, config.socket_group)
        served.set()
        if config.metrics_port:
            view = EngineView(engine, agent.hooks)
            view.refresh()
            metrics = start_metrics_server(config.metrics_listen, config.metrics_port, view, health)
            metrics_task = asyncio.create_task(view.run(stop))
        log.info(
            "serving",
            socket=config.socket,
            lease_socket=config.lease_socket,
            listen=config.listen,
            metrics=f"{metrics.host}:{metrics.port}" if metrics else None,
            mode=config.mode.value,
            slice_ms=config.slice_ms,
            cgroup_driver=engine.driver.kind,
            cgroup_root=str(engine.driver.mount),
            gpus=len(engine.telemetry.gpus()),
            contention=engine.contention.name,
        )
        if ready is not None:
            ready(Doors(front, door))
        # Type=notify: systemd starts units ordered after this one only now, when every socket answers
        notifier.ready(f"serving on {config.socket}, {engine.tenant_count} tenants")
        await asyncio.wait([engine_task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        # a stop asked for, not an engine that died: carry the hooks over (the engine also ends once `stop` is set,
        # so whether it is done by now says nothing)
        died = engine_task.done() and (engine_task.cancelled() or engine_task.exception() is not None)
        agent.graceful = stop.is_set() and not died
    finally:
        notifier.stopping("thawing every tenant and saving state")
        stop.set()
        with contextlib.suppress(Exception):
            await engine_task  # its finally thaws every managed cgroup
        if metrics_task is not None:
            with contextlib.suppress(Exception):
                await metrics_task
        if metrics is not None:
            await asyncio.to_thread(metrics.close)
        await front.close()
        await door.close()
        await agent.close()
        for path in bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        log.info("stopped")
        notifier.close()


def _watchdog(notifier: Notifier, engine: Scheduler) -> Callable[[], None] | None:
    """The engine loop's liveness ping when systemd set WatchdogSec (WATCHDOG_USEC); None otherwise."""
    interval = watchdog_interval_s()
    if not notifier.enabled or interval is None:
        return None
    return Watchdog(notifier, interval, lambda: f"serving on {engine.config.socket}, {engine.tenant_count} tenants").alive


def serve(config: DaemonConfig, engine: Scheduler, nvml: bool, carried: list[tuple[int, Carried]] | None = None) -> None:
    asyncio.run(serve_async(config, engine, nvml, carried=carried))
