"""The unisched device plugin: one kubelet v1beta1 DevicePlugin endpoint per advertised resource.

Each resource gets its own socket in the kubelet's device-plugins directory and its own Register call (that is
how v1beta1 works). Allocate tells the container its tenant, weight, GPU and the daemon's socket, and hands it
the GPU's device nodes; PreStartContainer (gpu-weight only) has the adopter make the pod a tenant before the
container starts, so its first GPU session already meets the daemon. GPU health comes from telemetry (NVML on
a node, FakeTelemetry in tests) and reaches the kubelet through ListAndWatch. When the kubelet restarts it
wipes the directory and recreates kubelet.sock: the plugin notices, serves again and registers again.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
import structlog

from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2 as dp
from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from unisched.integrations.kubernetes.defaults import DEFAULT_KUBELET_DIR, DEVICE_LIST_ROOT, DEVICE_LISTS, ENVVAR, VOLUME_MOUNTS
from unisched.integrations.kubernetes.devices import (
    DECODE,
    RENDER,
    WEIGHT,
    AllocationError,
    Resource,
    one_gpu,
    preferred_allocation,
    tenant_name,
)
from unisched.policy.waits import DRIVER_WAIT_ENV
from unisched.scheduler.config import DEFAULT_SOCKET
from unisched.telemetry import GpuTelemetry

__all__ = [
    "API_VERSION",
    "DEFAULT_KUBELET_DIR",
    "DevicePluginServer",
    "PluginConfig",
    "PreStart",
    "TenantEdits",
    "gpu_health",
    "tenant_edits",
]

log = structlog.get_logger("unisched.kubelet")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
_DEVICE_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
"""Opened by every CUDA/EGL process beside its /dev/nvidiaN; handed over where the node has them."""

PreStart = Callable[[Sequence[str]], str | None]
"""Called with a container's gpu-weight IDs before it starts; returns why it must not start yet, or None."""


@dataclass(frozen=True)
class PluginConfig:
    gpus: tuple[int, ...]
    units_per_gpu: int = 100
    render_sessions: int = 0
    """Per GPU; 0 = unisched.io/render-sessions is not advertised."""
    decode_sessions: int = 0
    kubelet_dir: Path = Path(DEFAULT_KUBELET_DIR)
    daemon_socket: str = DEFAULT_SOCKET
    dev_root: Path = Path("/dev")
    """Where the NVIDIA device nodes are looked for (paths handed to the kubelet are always /dev/...)."""
    beside_nvidia_plugin: bool = False
    """Start even where NVIDIA's device plugin advertises some of these GPUs (a warning instead of a refusal)."""
    device_list: str = ENVVAR
    """DEVICE_LISTS."""
    require_gpu_profile: bool = False
    """Hold back containers holding our resources without the GPU seccomp profile (adopt.PodAdopter's)."""
    online_namespaces: frozenset[str] | None = None
    """Where pods may ask for the online priority (adopt.PodAdopter's); None: anywhere."""

    @property
    def resources(self) -> tuple[Resource, ...]:
        counts = ((WEIGHT, self.units_per_gpu), (RENDER, self.render_sessions), (DECODE, self.decode_sessions))
        return tuple(Resource(name, n) for name, n in counts if n > 0)


@dataclass(frozen=True)
class TenantEdits:
    """What a container of a tenant gets, from the device plugin's Allocate or the DRA driver's CDI spec."""

    envs: dict[str, str]
    mounts: tuple[str, ...]
    """Host directories bind-mounted read-only at the same path (the daemon socket's)."""
    devices: tuple[str, ...]
    """Device node paths, the same in the container as on the host."""
    device_list: tuple[str, ...] = ()
    """Container paths where /dev/null is mounted read-only, one per GPU (DEVICE_LISTS: volume-mounts)."""


def tenant_edits(tenant: str, weight: int, gpus: Sequence[int], daemon_socket: str, dev_root: Path,
                 device_list: str = ENVVAR) -> TenantEdits:
    """Tenant, weight, GPUs, the daemon's socket and how the GPU driver waits (policy.waits) in the env, the
    socket's directory mounted, the GPUs named to the container toolkit as `device_list` says (DEVICE_LISTS), and
    the GPUs' device nodes plus the control nodes every CUDA/EGL process opens, those the node has (looked for under
    dev_root)."""
    if device_list not in DEVICE_LISTS:
        raise ValueError(f"device list {device_list!r}: one of {', '.join(DEVICE_LISTS)}")
    listed = ",".join(map(str, gpus))
    marks = tuple(f"{DEVICE_LIST_ROOT}/{g}" for g in gpus) if device_list == VOLUME_MOUNTS else ()
    envs = {
        "UNISCHED_TENANT": tenant,
        "UNISCHED_WEIGHT": str(weight),
        "UNISCHED_GPU": listed,
        "UNISCHED_SOCKET": daemon_socket,
        "NVIDIA_VISIBLE_DEVICES": DEVICE_LIST_ROOT if marks else listed,
        **DRIVER_WAIT_ENV,
    }
    nodes = [*(f"nvidia{g}" for g in gpus), *_DEVICE_NODES]
    return TenantEdits(envs, (os.path.dirname(daemon_socket),), tuple(f"/dev/{n}" for n in nodes if (dev_root / n).exists()),
                       marks)


def gpu_health(telemetry: GpuTelemetry, gpus: Sequence[int]) -> dict[int, bool]:
    """A GPU is healthy while telemetry samples it fine. No GPU signal at all (no NVML) says nothing: healthy."""
    ok = {s.index: s.ok for s in telemetry.sample()}
    if not ok:
        return dict.fromkeys(gpus, True)
    return {g: ok.get(g, False) for g in gpus}


@dataclass
class _Devices:
    """The health every endpoint reports, and a version that ListAndWatch streams wait on."""

    health: dict[int, bool]
    version: int = 0
    closed: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    def update(self, health: Mapping[int, bool]) -> bool:
        with self.cond:
            if dict(health) == self.health:
                return False
            self.health = dict(health)
            self.version += 1
            self.cond.notify_all()
            return True

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class _Endpoint(dp_grpc.DevicePluginServicer):
    def __init__(self, resource: Resource, config: PluginConfig, devices: _Devices, prestart: PreStart | None) -> None:
        self.resource = resource
        self.config = config
        self.devices = devices
        self.prestart = prestart if resource.name == WEIGHT else None

    def options(self) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(pre_start_required=self.prestart is not None, get_preferred_allocation_available=True)

    def GetDevicePluginOptions(self, request: dp.Empty, context: grpc.ServicerContext) -> dp.DevicePluginOptions:
        return self.options()

    def _list(self) -> dp.ListAndWatchResponse:
        health = self.devices.health
        return dp.ListAndWatchResponse(devices=[
            dp.Device(ID=self.resource.device_id(g, k), health=HEALTHY if health.get(g, True) else UNHEALTHY)
            for g in self.config.gpus for k in range(self.resource.per_gpu)
        ])

    def ListAndWatch(self, request: dp.Empty, context: grpc.ServicerContext) -> Iterator[dp.ListAndWatchResponse]:
        d = self.devices
        sent = -1
        while context.is_active():
            with d.cond:
                if d.version == sent and not d.closed:
                    d.cond.wait(timeout=1.0)  # woken by a health change or close; the timeout rechecks the stream
                if d.closed:
                    return
                if d.version == sent:
                    continue
                sent = d.version
                reply = self._list()
            yield reply

    def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> dp.PreferredAllocationResponse:
        return dp.PreferredAllocationResponse(container_responses=[
            dp.ContainerPreferredAllocationResponse(
                deviceIDs=preferred_allocation(r.available_deviceIDs, r.must_include_deviceIDs, r.allocation_size)
            )
            for r in request.container_requests
        ])

    def Allocate(self, request: dp.AllocateRequest, context: grpc.ServicerContext) -> dp.AllocateResponse:
        if not request.container_requests:
            _abort(context, f"{self.resource.name}: Allocate named no containers")
        try:
            replies = [self._container(list(r.devices_ids)) for r in request.container_requests]
        except AllocationError as e:
            log.warning("allocate refused", resource=self.resource.name, reason=str(e))
            _abort(context, str(e))
        return dp.AllocateResponse(container_responses=replies)

    def _container(self, ids: list[str]) -> dp.ContainerAllocateResponse:
        gpu = one_gpu(self.resource, self.config.gpus, ids)
        if self.resource.name == RENDER:
            return dp.ContainerAllocateResponse(envs={"UNISCHED_RENDER_SESSIONS": str(len(ids))})
        if self.resource.name == DECODE:
            return dp.ContainerAllocateResponse(envs={"UNISCHED_DECODE_SESSIONS": str(len(ids))})
        edits = tenant_edits(tenant_name(ids), len(ids), (gpu,), self.config.daemon_socket, self.config.dev_root,
                             self.config.device_list)
        return dp.ContainerAllocateResponse(
            envs=edits.envs,
            mounts=[*(dp.Mount(container_path=d, host_path=d, read_only=True) for d in edits.mounts),
                    *(dp.Mount(container_path=m, host_path="/dev/null", read_only=True) for m in edits.device_list)],
            devices=[dp.DeviceSpec(container_path=n, host_path=n, permissions="rw") for n in edits.devices],
        )

    def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> dp.PreStartContainerResponse:
        if self.prestart is not None:
            problem = self.prestart(list(request.devices_ids))
            if problem is not None:
                log.warning("container start held back", reason=problem)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        return dp.PreStartContainerResponse()


def _abort(context: grpc.ServicerContext, message: str) -> NoReturn:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    raise AssertionError("unreachable: abort raises")


class DevicePluginServer:
    """Serves one endpoint per resource and keeps them registered with the kubelet.

    `check_kubelet()` and `check_health()` are what `run()` calls every interval; tests call them directly.
    """

    def __init__(self, config: PluginConfig, telemetry: GpuTelemetry, prestart: PreStart | None = None) -> None:
        self.config = config
        self.telemetry = telemetry
        self.prestart = prestart
        self.devices = _Devices(gpu_health(telemetry, config.gpus))
        self._servers: list[grpc.Server] = []
        self._registered_with: tuple[int, int] | None = None
        self.registrations = 0
        """Successful rounds of Register calls (one per resource each): 1 at start, +1 per kubelet restart."""

    @property
    def kubelet_socket(self) -> Path:
        return self.config.kubelet_dir / KUBELET_SOCKET

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = self.kubelet_socket.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _serve(self) -> None:
        """(Re)start every endpoint on a fresh socket."""
        self._stop_servers()
        for resource in self.config.resources:
            path = self.config.kubelet_dir / resource.endpoint
            path.unlink(missing_ok=True)
            server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"dp-{resource.letter}"))
            dp_grpc.add_DevicePluginServicer_to_server(  # type: ignore[no-untyped-call]
                _Endpoint(resource, self.config, self.devices, self.prestart), server
            )
            server.add_insecure_port(f"unix:{path}")
            server.start()
            self._servers.append(server)

    def _stop_servers(self) -> None:
        for server in self._servers:
            server.stop(grace=None)
        self._servers = []

    def _register(self) -> None:
        with grpc.insecure_channel(f"unix:{self.kubelet_socket}") as channel:
            stub = dp_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            for resource in self.config.resources:
                endpoint = _Endpoint(resource, self.config, self.devices, self.prestart)
                stub.Register(
                    dp.RegisterRequest(
                        version=API_VERSION, endpoint=resource.endpoint, resource_name=resource.name,
                        options=endpoint.options(),
                    ),
                    timeout=10,
                )
                log.info("registered with the kubelet", resource=resource.name, endpoint=resource.endpoint,
                         devices=resource.per_gpu * len(self.config.gpus))

    def check_kubelet(self) -> bool:
        """Serve and register when not registered with the kubelet that runs now; True when it registered."""
        ident = self._kubelet_identity()
        if ident is None:
            if self._registered_with is not None:
                log.warning("kubelet socket gone; waiting for the kubelet", socket=str(self.kubelet_socket))
                self._registered_with = None
            return False
        ours = all((self.config.kubelet_dir / r.endpoint).exists() for r in self.config.resources)
        if ident == self._registered_with and ours and self._servers:
            return False
        if self._registered_with is not None:
            log.info("kubelet restarted; registering again")
        try:
            self._serve()
            self._register()
        except (grpc.RpcError, RuntimeError) as e:
            detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
            log.error("registration with the kubelet failed; will retry", error=detail)
            self._registered_with = None
            return False
        self._registered_with = ident
        self.registrations += 1
        return True

    def check_health(self) -> bool:
        """Sample GPU health; True (and a new device list to every ListAndWatch stream) when it changed."""
        health = gpu_health(self.telemetry, self.config.gpus)
        changed = self.devices.update(health)
        if changed:
            log.warning("GPU health changed", healthy=sorted(g for g, ok in health.items() if ok),
                        unhealthy=sorted(g for g, ok in health.items() if not ok))
        return changed

    def run(self, stop: threading.Event, interval: float = 2.0, each: Callable[[], Any] | None = None) -> None:
        """Until `stop` is set: keep registered, watch health and call `each` (the adopter's pass)."""
        try:
            while True:
                self.check_kubelet()
                self.check_health()
                if each is not None:
                    each()
                if stop.wait(interval):
                    return
        finally:
            self.close()

    def close(self) -> None:
        self.devices.close()
        self._stop_servers()
        for resource in self.config.resources:
            (self.config.kubelet_dir / resource.endpoint).unlink(missing_ok=True)
