"""The gRPC face of the daemon: a servicer that maps requests onto the engine, and `serve()` which runs
engine, relay and server in one asyncio loop until SIGTERM/SIGINT, thawing everything on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import grpc
import structlog

from unisched import __version__
from unisched.enforce.leases import LeaseGrant, LeaseMessage
from unisched.enforce.seccomp import probe as seccomp_probe
from unisched.engine.config import DaemonConfig, check_listener
from unisched.engine.core import EngineError, KernelEngine, LeaseAck, TenantSnapshot
from unisched.engine.runner import run_engine
from unisched.policy import Priority
from unisched.transport import unisched_pb2 as pb
from unisched.transport import unisched_pb2_grpc as pb_grpc
from unisched.transport.agent import SeccompAgentServer
from unisched.transport.metrics import EngineView, MetricsServer, start_metrics_server
from unisched.transport.options import SERVER_OPTIONS
from unisched.transport.peercred import PeerCred, PeerCredRelay

__all__ = ["UnischedServicer", "serve", "server_credentials", "snapshot_to_pb"]

log = structlog.get_logger("unisched.transport")

MAX_MESSAGE_BYTES = 64 * 1024
_CODES = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "permission": grpc.StatusCode.PERMISSION_DENIED,
    "failed": grpc.StatusCode.FAILED_PRECONDITION,
}
_PRIORITY = {pb.PRIORITY_ONLINE: Priority.ONLINE, pb.PRIORITY_OFFLINE: Priority.OFFLINE}
_PRIORITY_PB = {v: k for k, v in _PRIORITY.items()}


def snapshot_to_pb(s: TenantSnapshot) -> pb.Tenant:
    return pb.Tenant(
        name=s.name,
        weight=s.weight,
        base_weight=s.base_weight,
        priority=_PRIORITY_PB[s.priority],
        pids=list(s.pids),
        state=s.state,
        target_share=s.target_share,
        measured_share=s.measured_share,
        gpu_seconds=s.gpu_seconds,
        cgroup=s.cgroup,
        engines=sorted(e.value for e in s.engines),
        shares=[
            pb.ResourceShare(
                gpu=x.resource.gpu, domain=x.resource.domain, target_share=x.target, measured_share=x.measured
            )
            for x in s.shares
        ],
        slices=s.slices,
        owner_uid=s.owner_uid,
        adopted=s.adopted,
        sessions=dict(s.sessions),
        refusals=dict(s.refusals),
        caps=pb.Limits(
            render=_cap(s.caps.get("render")), decode=_cap(s.caps.get("decode")),
            encode=_cap(s.caps.get("encode")), memory_bytes=_cap(s.memory_cap),
        ),
        memory_bytes=s.memory_bytes,
        over_memory=s.over_memory,
        devices=s.devices or "",
        cooperative=s.cooperative,
        overrun_s=s.overrun_s,
        enforced=s.enforced,
    )


def _to_public_summary(t: pb.Tenant) -> None:
    """Name, owner, weight, priority, state, engines and shares stay; processes, cgroup and usage details go."""
    del t.pids[:]
    t.cgroup = ""
    t.sessions.clear()
    t.refusals.clear()
    t.memory_bytes = 0
    t.devices = ""


def _cap(value: int | None) -> int:
    return -1 if value is None else value


def _supplementary_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


class UnischedServicer(pb_grpc.UnischedServicer):
    def __init__(
        self,
        engine: KernelEngine,
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

    def _is_admin(self, cred: PeerCred) -> bool:
        if cred.uid == 0:
            return True
        if self._admin_gid is None:
            return False
        return cred.gid == self._admin_gid or self._admin_gid in _supplementary_groups(cred.pid)

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
        if not self._is_admin(cred):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"uid {cred.uid} is not an admin (root or the admin group)")
        return cred

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, e: EngineError) -> NoReturn:
        await context.abort(_CODES[e.kind], str(e))
        raise AssertionError("abort returned")

    # calls ---------------------------------------------------------------------------------------
    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Tenant:
        cred = await self._need_caller(context)
        try:
            snap = self.engine.register(
                request.tenant,
                request.weight or None,
                _PRIORITY.get(request.priority),
                list(request.engines),
                list(request.gpus),
                cred.pid,
                cred.uid,
                self._is_admin(cred),
            )
        except EngineError as e:
            await self._fail(context, e)
        log.info("registered", tenant=snap.name, pid=cred.pid, uid=cred.uid)
        return snapshot_to_pb(snap)

    async def Adopt(self, request: pb.AdoptRequest, context: grpc.aio.ServicerContext) -> pb.Tenant:
        await self._need_admin(context)
        try:
            snap = self.engine.adopt(
                request.tenant,
                request.weight or None,
                _PRIORITY.get(request.priority),
                request.cgroup,
                list(request.engines),
                list(request.gpus),
            )
        except EngineError as e:
            await self._fail(context, e)
        return snapshot_to_pb(snap)

    async def SetWeight(self, request: pb.SetWeightRequest, context: grpc.aio.ServicerContext) -> pb.Tenant:
        await self._need_admin(context)
        try:
            return snapshot_to_pb(self.engine.set_weight(request.tenant, request.weight))
        except EngineError as e:
            await self._fail(context, e)

    async def SetLimit(self, request: pb.SetLimitRequest, context: grpc.aio.ServicerContext) -> pb.Tenant:
        await self._need_admin(context)

        def opt(field: str) -> int | None:
            return int(getattr(request, field)) if request.HasField(field) else None

        try:
            return snapshot_to_pb(self.engine.set_limits(
                request.tenant, opt("render"), opt("decode"), opt("encode"), opt("memory_bytes"),
            ))
        except EngineError as e:
            await self._fail(context, e)

    async def RemoveTenant(self, request: pb.RemoveTenantRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        await self._need_admin(context)
        try:
            self.engine.remove(request.tenant)
        except EngineError as e:
            await self._fail(context, e)
        return pb.Empty()

    async def ListTenants(self, request: pb.ListTenantsRequest, context: grpc.aio.ServicerContext) -> pb.ListTenantsReply:
        """Admins see everything; others see their own tenants whole and a public summary of the rest."""
        cred = self._caller(context)
        admin = cred is not None and self._is_admin(cred)
        out = []
        for snap in self.engine.snapshots():
            t = snapshot_to_pb(snap)
            if not admin and (cred is None or cred.uid != snap.owner_uid):
                _to_public_summary(t)
            out.append(t)
        return pb.ListTenantsReply(tenants=out)

    async def Lease(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        """The user engine's stream: hello, then wants and reports, each answered by an ack; grants and
        revokes pushed by the engine. Closing the stream ends the session (its demand and codec sessions).

        Acks are written by the reading loop itself (a renewal's round trip is one task, no queue hop);
        the engine's pushes go through the channel's queue to a writer task; a lock keeps writes whole."""
        cred = await self._need_caller(context)
        channel = StreamLeaseChannel()
        sid_box: list[int] = []
        lock = asyncio.Lock()
        pusher = asyncio.create_task(self._lease_pusher(context, channel, lock))
        try:
            while True:
                req = await context.read()
                if req is grpc.aio.EOF:
                    return
                if pusher.done():  # the client stopped reading its pushes: dropped
                    item = pusher.result()
                    log.warning("lease stream dropped", reason=str(item), pid=cred.pid)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item))
                try:
                    reply = self._lease_request(req, cred, channel, sid_box)
                except EngineError as e:
                    await self._fail(context, e)
                if reply is not None:
                    async with lock:
                        await context.write(reply)
        finally:
            pusher.cancel()
            if sid_box:
                self.engine.lease_close(sid_box[0])

    @staticmethod
    async def _lease_pusher(context: grpc.aio.ServicerContext, channel: StreamLeaseChannel,
                            lock: asyncio.Lock) -> _Overflow:
        """Write the engine's grants and revokes; returns the overflow that ends the stream."""
        while True:
            item = await channel.queue.get()
            if isinstance(item, _Overflow):
                return item
            async with lock:
                await context.write(item)

    def _lease_request(self, req: pb.LeaseRequest, cred: PeerCred, channel: StreamLeaseChannel,
                       sid_box: list[int]) -> pb.LeaseReply | None:
        """The reply to one lease message; None for a want or report without a seq (no ack asked)."""
        kind = req.WhichOneof("kind")
        if kind == "hello":
            if sid_box:
                raise EngineError("invalid", "hello was already sent on this stream")
            h = req.hello
            sid, snap = self.engine.lease_open(
                h.tenant, h.weight or None, _PRIORITY.get(h.priority), list(h.engines), h.gpu,
                cred.pid, cred.uid, self._is_admin(cred), channel,
            )
            sid_box.append(sid)
            log.info("lease session", tenant=snap.name, session=sid, pid=cred.pid, uid=cred.uid)
            cfg = self.engine.config
            return pb.LeaseReply(welcome=pb.LeaseWelcome(
                tenant=snapshot_to_pb(snap), session=sid, slice_s=cfg.slice_ms / 1000.0,
                valid_s=cfg.lease_timeout_ms / 1000.0,
            ), seq=req.seq)
        if not sid_box:
            raise EngineError("invalid", "the first message on a lease stream must be hello")
        sid = sid_box[0]
        if kind == "want":
            ack = self.engine.lease_want(sid, req.want.engine)
            return _ack_pb(ack, req.seq) if req.seq else None
        if kind == "report":
            r = req.report
            ack = self.engine.lease_report(sid, r.engine, r.gpu_seconds, r.release, r.yielded)
            return _ack_pb(ack, req.seq) if req.seq else None
        if kind == "session":
            ok, why = self.engine.lease_codec(sid, req.session.kind, req.session.open)
            return pb.LeaseReply(ack=pb.LeaseAck(admitted=ok, reason=why), seq=req.seq)
        raise EngineError("invalid", "empty lease request (set hello, want, report or session)")

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
            reply.gpus.append(
                pb.Gpu(
                    index=i,
                    name=g.name,
                    contention=self.engine.contention.name,
                    sm_util=s.sm_util if s else 0.0,
                    dec_util=s.dec_util if s else 0.0,
                    enc_util=s.enc_util if s else 0.0,
                    memory_used=s.memory_used if s else 0,
                    memory_total=g.memory_total,
                )
            )
        if cred is not None:
            reply.caller_pid = cred.pid
            reply.caller_uid = cred.uid
            reply.caller_is_admin = self._is_admin(cred)
            reply.caller_tenant = self.engine.tenant_of_pid(cred.pid) or ""
        reply.agent_socket = self.agent_socket
        reply.session_hooks = self._hooks
        reply.device_admission = self._devices
        return reply


LEASE_QUEUE_MAX = 1024
"""Replies queued for one lease stream; a client that lets this many pile up (it does not read) is dropped."""


class _Overflow(Exception):
    pass


class StreamLeaseChannel:
    """The LeaseChannel of one gRPC lease stream: the engine's messages queued for the stream's writer."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.LeaseReply | _Overflow] = asyncio.Queue(LEASE_QUEUE_MAX)
        self.broken = False

    def put(self, reply: pb.LeaseReply) -> None:
        if self.broken:
            return
        try:
            self.queue.put_nowait(reply)
        except asyncio.QueueFull:
            self.broken = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(_Overflow(f"client did not read {LEASE_QUEUE_MAX} lease replies; session closed"))

    def send(self, message: LeaseMessage) -> None:
        if isinstance(message, LeaseGrant):
            self.put(pb.LeaseReply(grant=pb.LeaseGrant(
                lease=message.lease, engine=message.engine.value, valid_s=message.valid_s,
                contended=message.contended, slice_left_s=message.slice_left_s,
            )))
        else:
            self.put(pb.LeaseReply(revoke=pb.LeaseRevoke(
                lease=message.lease, engine=message.engine.value, reason=message.reason,
            )))


def _ack_pb(ack: LeaseAck, seq: int) -> pb.LeaseReply:
    return pb.LeaseReply(ack=pb.LeaseAck(engine=ack.engine.value, held=ack.held, lease=ack.lease), seq=seq)


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


def _prepare_socket(path: str, group: str | None) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise SystemExit(f"unisched: {path} exists and is not a socket; refusing to replace it")
        p.unlink()


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
    engine: KernelEngine,
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
    _prepare_socket(config.socket, config.socket_group)
    relay = PeerCredRelay(config.socket, port)
    relay_box.append(relay)
    agent = SeccompAgentServer(config.agent_socket, engine)
    servicer.agent_socket = config.agent_socket
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    engine_task = asyncio.create_task(run_engine(engine, stop))
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
        await asyncio.wait([engine_task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    finally:
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


def serve(config: DaemonConfig, engine: KernelEngine, nvml: bool) -> None:
    asyncio.run(serve_async(config, engine, nvml))
