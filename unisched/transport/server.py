"""The gRPC face of the daemon: a servicer that maps requests onto the engine, and `serve()` which runs
engine, front door (relay and lease stream) and server in one asyncio loop until SIGTERM/SIGINT, thawing
everything on the way out. The lease stream is not gRPC: see unisched.transport.lease."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import grpc
import structlog

from unisched import __version__
from unisched.enforce.seccomp.abi import probe as seccomp_probe
from unisched.engine.config import DaemonConfig, check_listener
from unisched.engine.core import Scheduler, SchedulerError
from unisched.engine.runner import run_engine
from unisched.sdnotify import Notifier, Watchdog, watchdog_interval_s
from unisched.transport.agent import SeccompAgentServer
from unisched.transport.claim import replace_stale_socket
from unisched.transport.client import AGENT_SOCKET_METADATA
from unisched.transport.convert import PRIORITY, public_summary, snapshot_to_pb
from unisched.transport.identity import PeerCred, is_admin
from unisched.transport.lease import ERROR_CODES, LeaseService
from unisched.transport.metrics import EngineView, MetricsServer, start_metrics_server
from unisched.transport.options import SERVER_OPTIONS
from unisched.transport.peercred import PeerCredRelay
from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc
from unisched_wire.leasewire import MAX_REQUEST_BYTES

__all__ = ["UnischedServicer", "serve", "server_credentials", "snapshot_to_pb"]

log = structlog.get_logger("unisched.transport")

MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES
"""One bound for every request, gRPC or lease stream."""
_CODES = {kind: grpc.StatusCode[name] for kind, name in ERROR_CODES.items()}


class UnischedServicer(pb_grpc.UnischedServicer):
    def __init__(
        self,
        engine: Scheduler,
        creds: Callable[[str], PeerCred | None],
        admin_group: str | None,
        started: float,
        cgroup_driver: str,
        cgroup_root: str,
        nvml: bool,
    ) -> None:
        self.engine = engine
        self._creds = creds
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
        self._hooks = seccomp_probe() or "on"
        self._devices = "on" if engine.devices is not None else "unavailable"

    # identity ------------------------------------------------------------------------------------
    def _caller(self, context: grpc.aio.ServicerContext) -> PeerCred | None:
        if _is_tls(context):
            # the TCP listener: no SO_PEERCRED there. Its peer string may even repeat a relay connection's
            # (the kernel can reuse a source port towards another destination), so never look it up.
            return None
        return self._creds(context.peer())

    def is_admin(self, cred: PeerCred) -> bool:
        """Root or the admin group by the uid's group list, in the host's namespaces (identity.is_admin)."""
        return is_admin(cred, self._admin_gid)

    async def _need_caller(self, context: grpc.aio.ServicerContext) -> PeerCred:
        cred = self._caller(context)
        if cred is None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "this call needs the daemon's Unix socket (identity comes from SO_PEERCRED)",
            )
        assert cred is not None
        return cred

    async def _need_admin(self, context: grpc.aio.ServicerContext) -> PeerCred:
        cred = await self._need_caller(context)
        if not self.is_admin(cred):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"uid {cred.uid} is not an admin (root or the admin group)")
        return cred

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, e: SchedulerError) -> NoReturn:
        await context.abort(_CODES[e.kind], str(e))
        raise AssertionError("abort returned")

    # calls ---------------------------------------------------------------------------------------
    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Tenant:
        cred = await self._need_caller(context)
        try:
            snap = self.engine.register(
                request.tenant,
                request.weight or None,
                PRIORITY.get(request.priority),
                list(request.engines),
                list(request.gpus),
                cred.pid,
                cred.uid,
                self.is_admin(cred),
                alive=cred.alive,
                keep=request.keep,
                session_hooks=request.session_hooks and self._hooks == "on",  # (hooks this kernel can install)
            )
        except SchedulerError as e:
            await self._fail(context, e)
        log.info("registered", tenant=snap.name, pid=cred.pid, uid=cred.uid)
        # what `unisched run` needs next, with this reply: no Status round trip per run
        context.set_trailing_metadata(((AGENT_SOCKET_METADATA, self.agent_socket),))
        return snapshot_to_pb(snap)

    async def Adopt(self, request: pb.AdoptRequest, context: grpc.aio.ServicerContext) -> pb.Tenant:
        await self._need_admin(context)
        try:
            snap = self.engine.adopt(
                request.tenant,
                request.weight or None,
                PRIORITY.get(request.priority),
                request.cgroup,
                list(request.engines),
                list(request.gpus),
            )
        except SchedulerError as e:
            await self._fail(context, e)
        return snapshot_to_pb(snap)

    async def SetWeight(self, request: pb.SetWeightRequest, context: grpc.aio.ServicerContext) -> pb.Tenant:
        await self._need_admin(context)
        try:
            return snapshot_to_pb(self.engine.set_weight(request.tenant, request.weight))
        except SchedulerError as e:
            await self._fail(context, e)

    async def SetLimit(self, request: pb.SetLimitRequest, context: grpc.aio.ServicerContext) -> pb.Tenant:
        await self._need_admin(context)

        def opt(field: str) -> int | None:
            return int(getattr(request, field)) if request.HasField(field) else None

        try:
            return snapshot_to_pb(self.engine.set_limits(
                request.tenant, opt("render"), opt("decode"), opt("encode"), opt("memory_bytes"),
            ))
        except SchedulerError as e:
            await self._fail(context, e)

    async def RemoveTenant(self, request: pb.RemoveTenantRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        """An admin removes any tenant; anyone else only tenants they own (run --keep ones, or those not yet gone)."""
        cred = await self._need_caller(context)
        try:
            self.engine.remove_as(request.tenant, cred.uid, self.is_admin(cred))
        except SchedulerError as e:
            await self._fail(context, e)
        return pb.Empty()

    async def ListTenants(self, request: pb.ListTenantsRequest, context: grpc.aio.ServicerContext) -> pb.ListTenantsReply:
        """Admins see everything; others see their own tenants whole and a public summary of the rest."""
        cred = self._caller(context)
        admin = cred is not None and self.is_admin(cred)
        out = []
        for snap in self.engine.snapshots():
            t = snapshot_to_pb(snap)
            if not admin and (cred is None or cred.uid != snap.owner_uid):
                public_summary(t)
            out.append(t)
        return pb.ListTenantsReply(tenants=out)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        cred = self._caller(context)
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
            reply.caller_uid = cred.uid
            reply.caller_is_admin = self.is_admin(cred)
            tenant = self.engine.tenant_of_pid(cred.pid) or ""
            reply.caller_tenant = tenant if cred.alive() else ""  # read through a pid that still named the caller
        reply.agent_socket = self.agent_socket
        reply.session_hooks = self._hooks
        reply.device_admission = self._devices
        # asks nvidia-cuda-mps-control (a process, up to its timeout): off the loop that runs the slices
        mps = await asyncio.to_thread(self.engine.mps_status)
        reply.mps = "off" if mps is None else "running" if mps.running else "not running"
        reply.mps_pipe_dir = "" if mps is None else mps.pipe_dir
        return reply


def _is_tls(context: grpc.aio.ServicerContext) -> bool:
    auth = context.auth_context() or {}
    return any(v != b"insecure" for v in auth.get("transport_security_type", ()))


def server_credentials(config: DaemonConfig) -> grpc.ServerCredentials:
    """TLS for the TCP listener; clients must present a certificate signed by tls_client_ca."""
    check_listener(config)
    assert config.tls_cert is not None and config.tls_key is not None and config.tls_client_ca is not None
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
        root_certificates=Path(config.tls_client_ca).read_bytes(),
        require_client_auth=True,
    )


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


async def serve_async(
    config: DaemonConfig,
    engine: Scheduler,
    nvml: bool,
    stop: asyncio.Event | None = None,
    ready: Callable[[PeerCredRelay], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or until `stop` is set, when the caller owns stopping, as tests do).

    Raises ConfigError before touching anything when `listen` is set without its TLS files."""
    started = time.monotonic()
    tls = server_credentials(config) if config.listen else None
    engine.start()
    relay_box: list[PeerCredRelay] = []
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
            ("grpc.max_concurrent_streams", 64),
            *SERVER_OPTIONS,
        ]
    )
    servicer = UnischedServicer(
        engine,
        lambda peer: relay_box[0].lookup(peer) if relay_box else None,
        config.admin_group,
        started,
        engine.driver.kind,
        str(engine.driver.mount),
        nvml,
    )
    pb_grpc.add_UnischedServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    if config.listen:
        assert tls is not None
        try:
            bound = server.add_secure_port(config.listen, tls)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {config.listen}: {e}") from None
        if not bound:
            raise OSError(f"cannot listen on {config.listen}")
    replace_stale_socket(config.socket)  # (`serve` holds the socket's lock already: transport.claim)
    relay = PeerCredRelay(config.socket, port, lease=LeaseService(engine, servicer.is_admin).connection,
                          is_admin=servicer.is_admin)
    relay_box.append(relay)
    agent = SeccompAgentServer(config.agent_socket, engine)
    servicer.agent_socket = config.agent_socket
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    notifier = Notifier.from_env()
    engine_task = asyncio.create_task(run_engine(engine, stop, _watchdog(notifier, engine)))
    metrics: MetricsServer | None = None
    metrics_task: asyncio.Task[None] | None = None
    try:
        await server.start()
        await agent.start()
        await relay.start()
        _secure_socket(config.socket, config.socket_group)
        if config.metrics_port:
            view = EngineView(engine)
            view.refresh()
            metrics = start_metrics_server(config.metrics_listen, config.metrics_port, view)
            metrics_task = asyncio.create_task(view.run(stop))
        log.info(
            "serving",
            socket=config.socket,
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
            ready(relay)
        # Type=notify: systemd starts units ordered after this one only now, when both sockets answer
        notifier.ready(f"serving on {config.socket}, {engine.tenant_count} tenants")
        await asyncio.wait([engine_task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
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
        await relay.close()
        await agent.close()
        await server.stop(grace=1.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.socket)
        log.info("stopped")
        notifier.close()


def _watchdog(notifier: Notifier, engine: Scheduler) -> Callable[[], None] | None:
    """The engine loop's liveness ping when systemd set WatchdogSec (WATCHDOG_USEC); None otherwise."""
    interval = watchdog_interval_s()
    if not notifier.enabled or interval is None:
        return None
    return Watchdog(notifier, interval, lambda: f"serving on {engine.config.socket}, {engine.tenant_count} tenants").alive


def serve(config: DaemonConfig, engine: Scheduler, nvml: bool) -> None:
    asyncio.run(serve_async(config, engine, nvml))
