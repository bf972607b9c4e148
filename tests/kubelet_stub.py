"""A kubelet as far as a device plugin can tell, and the kubelet's PodResources service, for tests.

`StubKubelet` serves the real v1beta1 Registration API on <dir>/kubelet.sock. On Register it does what the
kubelet does: checks the version, dials the plugin's endpoint in the same directory, asks its options and keeps
a ListAndWatch stream open, recording every device list. `restart()` behaves like a kubelet restart: the old
server goes, every socket in the directory is removed, and a new kubelet.sock appears.
`FakePodResources` serves the real podresources v1 API on a Unix socket from a list the test edits.
`StubPluginWatcher` is the kubelet's plugin watcher and DRA manager as far as a DRA driver can tell: the
plugin registration v1 API (GetInfo, NotifyRegistrationStatus) on the sockets found in a plugins_registry
directory, then the DRA v1beta1 API on the endpoint the driver names.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2 as dp
from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from unisched.integrations.kubernetes import dra_v1beta1_pb2_grpc as dra_grpc
from unisched.integrations.kubernetes import pluginregistration_v1_pb2 as reg
from unisched.integrations.kubernetes import pluginregistration_v1_pb2_grpc as reg_grpc
from unisched.integrations.kubernetes import podresources_v1_pb2 as pr
from unisched.integrations.kubernetes import podresources_v1_pb2_grpc as pr_grpc

CHECKPOINT = "kubelet_internal_checkpoint"


@dataclass
class PluginSeen:
    """One registration as this kubelet saw it."""

    request: dp.RegisterRequest
    options: dp.DevicePluginOptions
    channel: grpc.Channel
    stub: dp_grpc.DevicePluginStub
    lists: list[list[tuple[str, str]]] = field(default_factory=list)
    """Every ListAndWatch reply: (ID, health) per device."""


class StubKubelet(dp_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, plugin_dir: Path) -> None:
        self.dir = plugin_dir
        self.plugins: dict[str, PluginSeen] = {}
        self.registrations: list[dp.RegisterRequest] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._streams: list[grpc.Future] = []

    @property
    def socket(self) -> Path:
        return self.dir / "kubelet.sock"

    def start(self) -> StubKubelet:
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        dp_grpc.add_RegistrationServicer_to_server(self, server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix:{self.socket}")
        server.start()
        self._server = server
        return self

    def Register(self, request: dp.RegisterRequest, context: grpc.ServicerContext) -> dp.Empty:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported device plugin API version {request.version!r}")
        endpoint = self.dir / request.endpoint
        if "/" in request.endpoint or not endpoint.exists():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no plugin socket {endpoint}")
        channel = grpc.insecure_channel(f"unix:{endpoint}")
        stub = dp_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        options = stub.GetDevicePluginOptions(dp.Empty(), timeout=10)
        seen = PluginSeen(request, options, channel, stub)
        stream = stub.ListAndWatch(dp.Empty())
        self._streams.append(stream)
        threading.Thread(target=self._watch, args=(seen, stream), daemon=True).start()
        with self._cond:
            old = self.plugins.get(request.resource_name)
            if old is not None:
                old.channel.close()
            self.plugins[request.resource_name] = seen
            self.registrations.append(request)
            self._cond.notify_all()
        return dp.Empty()

    def _watch(self, seen: PluginSeen, stream: grpc.Future) -> None:
        try:
            for reply in stream:
                with self._cond:
                    seen.lists.append([(d.ID, d.health) for d in reply.devices])
                    self._cond.notify_all()
        except grpc.RpcError:
            pass  # the plugin or this kubelet went away

    def wait(self, what: str, predicate: Callable[[], object], timeout: float = 10.0) -> None:
        """Wait for a condition on what this kubelet saw (woken by each registration and device list)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
                self._cond.wait(left)

    def lists(self, resource: str, count: int) -> list[list[tuple[str, str]]]:
        """The first `count` device lists the plugin for `resource` sent, once it has sent that many."""
        self.wait(f"{count} device lists for {resource}",
                  lambda: resource in self.plugins and len(self.plugins[resource].lists) >= count)
        return self.plugins[resource].lists[:count]

    def plugin(self, resource: str) -> dp_grpc.DevicePluginStub:
        return self.plugins[resource].stub

    def stop(self) -> None:
        for s in self._streams:
            s.cancel()
        self._streams = []
        for p in self.plugins.values():
            p.channel.close()
        if self._server is not None:
            self._server.stop(grace=None).wait(10)
            self._server = None
        self.socket.unlink(missing_ok=True)

    def restart(self) -> StubKubelet:
        """What a kubelet restart looks like to plugins: every socket here removed, a new kubelet.sock."""
        self.stop()
        for p in self.dir.iterdir():
            if p.name != CHECKPOINT:
                p.unlink()
        fresh = StubKubelet(self.dir)
        return fresh.start()


class FakePodResources(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """The kubelet's PodResources v1 service over a Unix socket; `pods` is what List answers."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.pods: list[pr.PodResources] = []
        self.calls = 0
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self._server.add_insecure_port(f"unix:{socket}")

    def start(self) -> FakePodResources:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait(10)
        self.socket.unlink(missing_ok=True)

    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        self.calls += 1
        return pr.ListPodResourcesResponse(pod_resources=list(self.pods))

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        for p in self.pods:
            if (p.namespace, p.name) == (request.pod_namespace, request.pod_name):
                return pr.GetPodResourcesResponse(pod_resources=p)
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
        raise AssertionError("unreachable")


def pod(namespace: str, name: str, **containers: dict[str, list[str]]) -> pr.PodResources:
    """A PodResources entry: pod("ns", "p", main={"unisched.io/gpu-weight": [...]})."""
    return pr.PodResources(
        namespace=namespace,
        name=name,
        containers=[
            pr.ContainerResources(
                name=c, devices=[pr.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in held.items()]
            )
            for c, held in containers.items()
        ],
    )


@dataclass
class DriverSeen:
    """One DRA driver as the watcher registered it."""

    info: reg.PluginInfo
    channel: grpc.Channel
    stub: dra_grpc.DRAPluginStub


class StubPluginWatcher:
    """What the kubelet does with a plugins_registry directory, one `scan()` at a time (the kubelet reacts to
    file events; a test scans when it wants the watcher to look).

    For each socket not seen before: dial it, GetInfo, validate as the kubelet's DRA plugin handler does (type
    DRAPlugin, a supported version it knows, an endpoint that exists), NotifyRegistrationStatus with the verdict,
    and keep a DRAPlugin stub to the endpoint of each registered driver.
    """

    def __init__(self, registry_dir: Path, versions: tuple[str, ...] = ("v1beta1.DRAPlugin",)) -> None:
        self.dir = registry_dir
        self.versions = versions
        self.drivers: dict[str, DriverSeen] = {}
        self.refused: dict[str, str] = {}
        self._seen: set[Path] = set()

    def scan(self) -> list[str]:
        """Socket files new since the last scan, each registered or refused; the names registered."""
        registered = []
        for sock in sorted(p for p in self.dir.iterdir() if p.is_socket() and p not in self._seen):
            self._seen.add(sock)
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
                info = stub.GetInfo(reg.InfoRequest(), timeout=10)
                problem = self._validate(info)
                stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=problem is None,
                                                                     error=problem or ""), timeout=10)
            if problem is not None:
                self.refused[info.name] = problem
                continue
            old = self.drivers.pop(info.name, None)
            if old is not None:
                old.channel.close()
            ch = grpc.insecure_channel(f"unix:{info.endpoint}")
            self.drivers[info.name] = DriverSeen(info, ch, dra_grpc.DRAPluginStub(ch))  # type: ignore[no-untyped-call]
            registered.append(info.name)
        return registered

    def _validate(self, info: reg.PluginInfo) -> str | None:
        if info.type != "DRAPlugin":
            return f"plugin type {info.type!r} is not DRAPlugin"
        if not set(info.supported_versions) & set(self.versions):
            return f"none of the versions {list(info.supported_versions)} is supported (this kubelet: {list(self.versions)})"
        if not Path(info.endpoint).is_absolute() or not Path(info.endpoint).is_socket():
            return f"endpoint {info.endpoint!r} is not a socket"
        return None

    def forget(self) -> None:
        """Look at every socket again at the next scan (a kubelet restart)."""
        self._seen.clear()

    def plugin(self, name: str) -> dra_grpc.DRAPluginStub:
        return self.drivers[name].stub

    def stop(self) -> None:
        for d in self.drivers.values():
            d.channel.close()
        self.drivers = {}
