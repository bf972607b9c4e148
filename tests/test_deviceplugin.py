"""The Kubernetes device plugin against a test kubelet that speaks the real Registration, DevicePlugin and
PodResources APIs over Unix sockets, and the adopter against the in-process daemon."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog.testing
from conftest import ROOT, QuietHandler, child_env, fake_api_server, freezer_unavailable_reason, wait_until
from inproc import InProcessServer, in_process_server
from kubelet_stub import FakePodResources, StubKubelet, pod

from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2 as dp
from unisched.integrations.kubernetes import podresources_v1_pb2 as pr
from unisched.integrations.kubernetes.adopt import (
    ApiServerPods,
    FakePods,
    PodAdopter,
    PodInfo,
    find_pod_cgroup,
    unhooked_containers,
)
from unisched.integrations.kubernetes.devices import DECODE, RENDER, WEIGHT, preferred_allocation, tenant_name
from unisched.integrations.kubernetes.plugin import DevicePluginServer, PluginConfig, tenant_edits
from unisched.telemetry import FakeTelemetry, GpuSample
from unisched.transport.client import DaemonClient

SOCK = "/run/unisched/unisched.sock"


def ids(gpu: int, first: int, count: int, letter: str = "w") -> list[str]:
    width = 3 if letter == "w" else 1
    return [f"gpu{gpu}-{letter}{k:0{width}d}" for k in range(first, first + count)]


class Plugin:
    """A plugin (2 GPUs, 100 weight units, 2 render and 3 decode sessions each) registered with a stub kubelet."""

    def __init__(self, root: Path, telemetry: FakeTelemetry) -> None:
        self.dir = root / "plugins"
        self.dir.mkdir()
        dev = root / "dev"
        dev.mkdir()
        for node in ("nvidia0", "nvidiactl", "nvidia-uvm"):  # no nvidia1, no nvidia-uvm-tools on this "node"
            (dev / node).touch()
        self.prestarts: list[list[str]] = []
        self.refuse: str | None = None
        self.config = PluginConfig(gpus=(0, 1), units_per_gpu=100, render_sessions=2, decode_sessions=3,
                                   kubelet_dir=self.dir, daemon_socket=SOCK, dev_root=dev)
        self.telemetry = telemetry
        self.server = DevicePluginServer(self.config, telemetry, prestart=self._prestart)
        self.kubelet = StubKubelet(self.dir).start()

    def _prestart(self, device_ids: list[str]) -> str | None:
        self.prestarts.append(device_ids)
        return self.refuse

    def close(self) -> None:
        self.kubelet.stop()
        self.server.close()


@pytest.fixture
def plugin(short_dir: Path, telemetry: FakeTelemetry) -> Iterator[Plugin]:
    p = Plugin(short_dir, telemetry)
    assert p.server.check_kubelet()
    yield p
    p.close()


def test_registers_each_resource_with_the_v1beta1_api(plugin: Plugin) -> None:
    seen = {r.resource_name: r for r in plugin.kubelet.registrations}
    assert set(seen) == {WEIGHT, RENDER, DECODE}
    assert {r.version for r in seen.values()} == {"v1beta1"}
    assert seen[WEIGHT].endpoint == "unisched-gpu-weight.sock" and (plugin.dir / seen[WEIGHT].endpoint).is_socket()
    opts = {name: p.options for name, p in plugin.kubelet.plugins.items()}
    assert opts[WEIGHT].get_preferred_allocation_available and opts[WEIGHT].pre_start_required
    assert opts[RENDER].get_preferred_allocation_available and not opts[RENDER].pre_start_required
    assert plugin.server.check_kubelet() is False  # nothing changed: no second registration
    assert len(plugin.kubelet.registrations) == 3


def test_only_configured_session_resources_are_advertised(short_dir: Path, telemetry: FakeTelemetry) -> None:
    kubelet = StubKubelet(short_dir).start()
    server = DevicePluginServer(PluginConfig(gpus=(0,), units_per_gpu=10, kubelet_dir=short_dir), telemetry)
    try:
        assert server.check_kubelet()
        assert [r.resource_name for r in kubelet.registrations] == [WEIGHT]
        assert kubelet.lists(WEIGHT, 1)[0] == [(i, "Healthy") for i in ids(0, 0, 10)]
    finally:
        kubelet.stop()
        server.close()


def test_list_and_watch_sends_everything_then_again_on_health_change(plugin: Plugin, telemetry: FakeTelemetry) -> None:
    (first,) = plugin.kubelet.lists(WEIGHT, 1)
    assert [i for i, _ in first] == ids(0, 0, 100) + ids(1, 0, 100)
    assert {h for _, h in first} == {"Healthy"}
    assert [i for i, _ in plugin.kubelet.lists(RENDER, 1)[0]] == ["gpu0-r0", "gpu0-r1", "gpu1-r0", "gpu1-r1"]
    assert len(plugin.kubelet.lists(DECODE, 1)[0]) == 6  # every stream has its first list before the change

    telemetry.next_samples = [GpuSample(0, 0.5, 0.0, 0.0, 0), GpuSample(1, 0.0, 0.0, 0.0, 0, ok=False)]  # GPU 1 lost
    assert plugin.server.check_health()
    second = plugin.kubelet.lists(WEIGHT, 2)[1]
    assert {i for i, h in second if h == "Unhealthy"} == set(ids(1, 0, 100))
    assert {i for i, h in second if h == "Healthy"} == set(ids(0, 0, 100))
    assert ("gpu1-d2", "Unhealthy") in plugin.kubelet.lists(DECODE, 2)[1]

    assert plugin.server.check_health() is False  # unchanged: no list sent
    telemetry.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0), GpuSample(1, 0.0, 0.0, 0.0, 0)]  # back
    assert plugin.server.check_health()
    lists = plugin.kubelet.lists(WEIGHT, 3)
    assert {h for _, h in lists[2]} == {"Healthy"}
    assert len(plugin.kubelet.plugins[WEIGHT].lists) == 3


def _preferred(plugin: Plugin, available: list[str], must: list[str], size: int) -> list[str]:
    req = dp.PreferredAllocationRequest(container_requests=[
        dp.ContainerPreferredAllocationRequest(available_deviceIDs=available, must_include_deviceIDs=must,
                                               allocation_size=size)
    ])
    (reply,) = plugin.kubelet.plugin(WEIGHT).GetPreferredAllocation(req, timeout=10).container_responses
    return list(reply.deviceIDs)


def test_preferred_allocation_keeps_a_pods_units_on_one_gpu(plugin: Plugin) -> None:
    everything = ids(0, 0, 100) + ids(1, 0, 100)
    assert _preferred(plugin, everything, [], 30) == ids(0, 0, 30)
    assert _preferred(plugin, everything, ["gpu1-w050"], 3) == ["gpu1-w050", "gpu1-w000", "gpu1-w001"]
    # GPU 0 has 10 units left, GPU 1 all 100: a small request fills GPU 0 (best fit), a big one goes to GPU 1
    partly = ids(0, 90, 10) + ids(1, 0, 100)
    assert _preferred(plugin, partly, [], 5) == ids(0, 90, 5)
    assert _preferred(plugin, partly, [], 50) == ids(1, 0, 50)
    # nothing fits on one GPU: the right count all the same (Allocate then says why it cannot be served)
    spread = preferred_allocation(ids(0, 0, 10) + ids(1, 0, 10), [], 15)
    assert len(spread) == 15 and len(set(spread)) == 15


def _allocate(plugin: Plugin, resource: str, *containers: list[str]) -> dp.AllocateResponse:
    req = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=c) for c in containers])
    return plugin.kubelet.plugin(resource).Allocate(req, timeout=10)  # type: ignore[no-any-return]


def test_allocate_gives_tenant_weight_socket_and_device_nodes(plugin: Plugin) -> None:
    units = ids(0, 10, 30)
    (c,) = _allocate(plugin, WEIGHT, units).container_responses
    assert dict(c.envs) == {
        "UNISCHED_TENANT": tenant_name(units),
        "UNISCHED_WEIGHT": "30",
        "UNISCHED_GPU": "0",
        "UNISCHED_SOCKET": SOCK,
        "NVIDIA_VISIBLE_DEVICES": "0",
        "__GL_YIELD": "USLEEP",  # policy.waits
    }
    assert [(m.container_path, m.host_path, m.read_only) for m in c.mounts] == [("/run/unisched", "/run/unisched", True)]
    assert [(d.container_path, d.host_path, d.permissions) for d in c.devices] == [
        ("/dev/nvidia0", "/dev/nvidia0", "rw"), ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),
    ]
    # the tenant name depends on the set of units only, so the adopter recomputes it from PodResources
    assert tenant_name(list(reversed(units))) == c.envs["UNISCHED_TENANT"] != tenant_name(ids(0, 11, 30))
    # two containers in one call; a GPU whose node is missing here gets no device spec for it
    a, b = _allocate(plugin, WEIGHT, ids(0, 0, 2), ids(1, 0, 5)).container_responses
    assert (a.envs["UNISCHED_WEIGHT"], b.envs["UNISCHED_WEIGHT"], b.envs["UNISCHED_GPU"]) == ("2", "5", "1")
    assert "/dev/nvidia1" not in [d.host_path for d in b.devices]
    (r,) = _allocate(plugin, RENDER, ["gpu1-r0", "gpu1-r1"]).container_responses
    assert dict(r.envs) == {"UNISCHED_RENDER_SESSIONS": "2"} and not r.devices


def test_volume_mounts_name_the_gpus_by_mounts_a_pod_cannot_make_itself(short_dir: Path,
                                                                         telemetry: FakeTelemetry) -> None:
    """--device-list volume-mounts (NVIDIA's device plugin's strategy): /dev/null mounted per GPU under
    /var/run/nvidia-container-devices and NVIDIA_VISIBLE_DEVICES pointing there, which a toolkit set to accept
    volume mounts and refuse the variable from unprivileged containers honours, and a pod's own env cannot forge."""
    kubelet = StubKubelet(short_dir).start()
    config = PluginConfig(gpus=(0, 1), units_per_gpu=10, kubelet_dir=short_dir, daemon_socket=SOCK,
                          device_list="volume-mounts")
    server = DevicePluginServer(config, telemetry)
    try:
        assert server.check_kubelet()
        req = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids(1, 0, 3))])
        (c,) = kubelet.plugin(WEIGHT).Allocate(req, timeout=10).container_responses
        assert c.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
        assert c.envs["UNISCHED_GPU"] == "1"
        assert [(m.container_path, m.host_path, m.read_only) for m in c.mounts] == [
            ("/run/unisched", "/run/unisched", True), ("/var/run/nvidia-container-devices/1", "/dev/null", True)]
    finally:
        kubelet.stop()
        server.close()
    with pytest.raises(ValueError, match="one of envvar, volume-mounts"):
        tenant_edits("t", 1, (0,), SOCK, short_dir, device_list="mounts")


@pytest.mark.parametrize(
    ("resource", "containers", "words"),
    [
        (WEIGHT, [["gpu7-w000"]], "unknown device IDs ['gpu7-w000']"),
        (WEIGHT, [["gpu0-w100"]], "unknown device IDs ['gpu0-w100']"),
        (WEIGHT, [["gpu0-w1"]], "unknown device IDs"),
        (WEIGHT, [["gpu0-r0"]], "unknown device IDs ['gpu0-r0']"),
        (WEIGHT, [["gpu0-w000", "gpu1-w000"]], "span GPUs [0, 1]"),
        (WEIGHT, [["gpu0-w000"], ["gpu0-w001", "gpu1-w001"]], "span GPUs [0, 1]"),
        (WEIGHT, [[]], "names no devices"),
        (WEIGHT, [], "named no containers"),
        (WEIGHT, [["gpu0-w000", "gpu0-w000"]], "names a device twice"),
        (DECODE, [["gpu0-d0", "gpu1-d0"]], "span GPUs"),
        (DECODE, [["gpu0-d3"]], "unknown device IDs"),
    ],
)
def test_bad_allocate_requests_are_invalid_argument(plugin: Plugin, resource: str, containers: list[list[str]],
                                                    words: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _allocate(plugin, resource, *containers)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert words in (e.value.details() or ""), e.value.details()
    assert resource in (e.value.details() or "")


def test_prestart_asks_the_adopter_and_holds_the_container_back(plugin: Plugin) -> None:
    stub = plugin.kubelet.plugin(WEIGHT)
    stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=ids(0, 0, 3)), timeout=10)
    plugin.refuse = "pod default/p is not a unisched tenant yet: no cgroup"
    with pytest.raises(grpc.RpcError) as e:
        stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=ids(0, 3, 2)), timeout=10)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "no cgroup" in (e.value.details() or "")
    assert plugin.prestarts == [ids(0, 0, 3), ids(0, 3, 2)]


def test_kubelet_restart_is_followed_by_a_new_registration(plugin: Plugin) -> None:
    plugin.kubelet.lists(WEIGHT, 1)
    assert plugin.server.registrations == 1
    plugin.kubelet = plugin.kubelet.restart()  # wipes our sockets, new kubelet.sock
    assert not (plugin.dir / "unisched-gpu-weight.sock").exists()
    assert plugin.server.check_kubelet()
    assert {r.resource_name for r in plugin.kubelet.registrations} == {WEIGHT, RENDER, DECODE}
    assert len(plugin.kubelet.lists(WEIGHT, 1)[0]) == 200
    (c,) = _allocate(plugin, WEIGHT, ids(1, 0, 4)).container_responses  # the new endpoint serves
    assert c.envs["UNISCHED_WEIGHT"] == "4"
    assert plugin.server.registrations == 2


def test_no_kubelet_yet_then_it_appears(short_dir: Path, telemetry: FakeTelemetry) -> None:
    server = DevicePluginServer(PluginConfig(gpus=(0,), units_per_gpu=4, kubelet_dir=short_dir), telemetry)
    try:
        assert server.check_kubelet() is False
        kubelet = StubKubelet(short_dir).start()
        assert server.check_kubelet()
        assert kubelet.lists(WEIGHT, 1)[0] == [(i, "Healthy") for i in ids(0, 0, 4)]
        kubelet.stop()
    finally:
        server.close()


# --- adoption -------------------------------------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path, telemetry: FakeTelemetry) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state", telemetry=telemetry) as s:
        yield s


@pytest.fixture
def podres(short_dir: Path) -> Iterator[FakePodResources]:
    fake = FakePodResources(short_dir / "pr.sock").start()
    yield fake
    fake.stop()


def _pod_dir(root: Path, uid: str) -> str:
    """A systemd-driver burstable pod cgroup, as the kubelet names it."""
    rel = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    (root / rel.lstrip("/") / "cri-containerd-abc.scope").mkdir(parents=True)
    return rel


def test_adopter_makes_pods_tenants_and_removes_them_when_gone(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    root = tmp_path / "cgroup"
    uid = str(uuid.uuid4())
    cg = _pod_dir(root, uid)
    daemon.driver.create(cg)  # the daemon's fake cgroups see the same tree
    units = ids(1, 0, 40)
    podres.pods = [
        pod("render", "farm-0", main={WEIGHT: units, RENDER: ["gpu1-r0"]}, sidecar={"example.com/other": ["x"]}),
        pod("default", "no-gpu", main={}),
    ]
    pods = FakePods({"render/farm-0": PodInfo(uid, {"unisched.io/engines": "compute,graphics",
                                                   "unisched.io/priority": "online"})})
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(podres.socket), pods, cgroup_root=root, caps=[RENDER, DECODE])
        first = adopter.reconcile()
        tenant = tenant_name(units)
        assert first.adopted == (tenant,) and not first.failed and first.error is None
        (t,) = client.tenants()
        assert (t.name, t.weight, t.cgroup, t.adopted) == (tenant, 40, cg, True)
        assert sorted(t.engines) == ["compute", "graphics"] and t.priority == 1  # PRIORITY_ONLINE
        assert {s.gpu for s in t.shares} == {1}
        assert (t.caps.render, t.caps.decode) == (1, 0)  # asked 1 render session, no decode session
        # the pod's coordinates travel with the adoption and stay with the tenant (metrics labels them)
        assert daemon.engine.snapshot(tenant).labels == {"namespace": "render", "pod": "farm-0", "container": "main"}
        again = adopter.reconcile()  # idempotent
        assert again.kept == (tenant,) and not again.adopted and not again.removed
        assert adopter.ensure(units[:1]) is None
        podres.pods = []
        gone = adopter.reconcile()
        assert gone.removed == (tenant,)
        assert client.tenants() == []
        assert adopter.ensure(units[:1]) == f"no pod on this node holds devices {units[:1]} (PodResources does not list them)"


GPU_PROFILE = {"type": "Localhost", "localhostProfile": "profiles/unisched-gpu.json"}


def _spec(*containers: dict[str, Any], profile: dict[str, str] | None = None) -> dict[str, Any]:
    return {"containers": list(containers), **({"securityContext": {"seccompProfile": profile}} if profile else {})}


def _container(name: str, resource: str = WEIGHT, profile: dict[str, str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "resources": {"limits": {resource: "10"}}}
    if profile is not None:
        c["securityContext"] = {"seccompProfile": profile}
    return c


@pytest.mark.parametrize(("spec", "unhooked"), [
    (_spec(_container("main", profile=GPU_PROFILE)), ()),
    (_spec(_container("main"), profile=GPU_PROFILE), ()),  # the pod's profile
    (_spec(_container("main", profile={"type": "Localhost", "localhostProfile": "unisched-gpu-containerd.json"})), ()),
    (_spec(_container("main")), ("main",)),
    (_spec(_container("main", profile={"type": "RuntimeDefault"}), profile=GPU_PROFILE), ("main",)),  # overridden
    (_spec(_container("main", profile={"type": "Localhost", "localhostProfile": "profiles/other.json"})), ("main",)),
    (_spec(_container("main", profile={"type": "Unconfined", "localhostProfile": "unisched-gpu.json"})), ("main",)),
    (_spec(_container("side", resource="cpu"), _container("gpu", resource=RENDER)), ("gpu",)),  # ours only
    ({"initContainers": [_container("init")], "containers": []}, ("init",)),
    (_spec({**_container("main", profile=GPU_PROFILE), "securityContext": {"seccompProfile": GPU_PROFILE,
                                                                           "privileged": True}}), ("main",)),
    ({}, ()),
])
def test_containers_holding_our_resources_without_the_gpu_profile_are_found(spec: dict[str, Any],
                                                                             unhooked: tuple[str, ...]) -> None:
    assert unhooked_containers(spec) == unhooked


def test_a_pod_without_the_gpu_profile_is_held_back_when_the_profile_is_required(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    """--require-gpu-profile: a pod whose GPU container runs without the profile is not adopted and its containers
    are held back at PreStartContainer with the reason; once it has the profile it is adopted. Without the flag it
    is adopted (weighted, without session hooks)."""
    root = tmp_path / "cgroup"
    uid, remade = str(uuid.uuid4()), str(uuid.uuid4())
    first = _pod_dir(root, uid)
    daemon.driver.create(first)
    units = ids(0, 0, 20)
    podres.pods = [pod("games", "p-1", main={WEIGHT: units})]
    pods = FakePods({"games/p-1": PodInfo(uid, unhooked=("main",))})
    with DaemonClient(daemon.socket) as client:
        strict = PodAdopter(client, str(podres.socket), pods, cgroup_root=root, require_gpu_profile=True)
        why = strict.ensure(units[:1])
        assert why is not None and "containers ['main'] hold unisched.io resources without the GPU seccomp" in why
        assert client.tenants() == []
        shutil.rmtree(root / first.lstrip("/"))  # the pod made again with the profile (a spec's never changes)
        daemon.driver.create(_pod_dir(root, remade))
        pods.pods["games/p-1"] = PodInfo(remade)
        assert strict.ensure(units[:1]) is None
        assert [t.name for t in client.tenants()] == [tenant_name(units)]
        client.remove(tenant_name(units))
        pods.pods["games/p-1"] = PodInfo(remade, unhooked=("main",))
        lax = PodAdopter(client, str(podres.socket), pods, cgroup_root=root)
        assert lax.ensure(units[:1]) is None and [t.name for t in client.tenants()] == [tenant_name(units)]


def test_a_pod_in_the_hosts_pid_namespace_is_not_made_a_tenant(daemon: InProcessServer, podres: FakePodResources,
                                                               tmp_path: Path) -> None:
    """hostPID: root in the pod is root in the daemon's namespaces, an admin; such a pod is not adopted, with the
    reason (its containers are held back), whatever else it asks."""
    root = tmp_path / "cgroup"
    uid = str(uuid.uuid4())
    daemon.driver.create(_pod_dir(root, uid))
    units = ids(0, 0, 10)
    podres.pods = [pod("games", "host", main={WEIGHT: units})]
    pods = FakePods({"games/host": PodInfo(uid, host_pid=True)})
    with DaemonClient(daemon.socket) as client:
        why = PodAdopter(client, str(podres.socket), pods, cgroup_root=root).ensure(units[:1])
        assert why is not None and "runs in the host's pid namespace (hostPID)" in why
        assert client.tenants() == []


def test_the_online_priority_is_honoured_only_in_the_namespaces_the_operator_names(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    """--online-namespaces: online holds every other tenant back while it has work, so a pod outside the named
    namespaces that asks for it is not adopted (its containers held back with the reason); inside, it is online."""
    root = tmp_path / "cgroup"
    online = {"unisched.io/priority": "online"}
    uids = {key: str(uuid.uuid4()) for key in ("serving/api", "batch/sneaky")}
    for uid in uids.values():
        daemon.driver.create(_pod_dir(root, uid))
    api, sneaky = ids(0, 0, 10), ids(0, 10, 10)
    podres.pods = [pod("serving", "api", main={WEIGHT: api}), pod("batch", "sneaky", main={WEIGHT: sneaky})]
    pods = FakePods({key: PodInfo(uid, online) for key, uid in uids.items()})
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(podres.socket), pods, cgroup_root=root, online_namespaces=frozenset({"serving"}))
        assert adopter.ensure(api[:1]) is None
        why = adopter.ensure(sneaky[:1])
        assert why is not None and "online is allowed in namespaces ['serving'] only" in why
        (t,) = client.tenants()
        assert (t.name, t.priority) == (tenant_name(api), 1)  # PRIORITY_ONLINE


def test_adopter_takes_a_pod_resources_list_past_4_mib(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    """PodResources lists every pod on the node: pod authors size it (here 4 pods of 16,000 long-named containers,
    no GPU asked). A reply past gRPC's default 4 MiB must not stop adoption, and with it every GPU container's start."""
    root = tmp_path / "cgroup"
    uid = str(uuid.uuid4())
    cg = _pod_dir(root, uid)
    daemon.driver.create(cg)
    units = ids(0, 0, 30)
    fat = [pr.PodResources(namespace="evil", name=f"fat-{p}",
                           containers=[pr.ContainerResources(name=f"c{i:05d}".ljust(63, "x")) for i in range(16_000)])
           for p in range(4)]
    podres.pods = [pod("team-a", "trainer", main={WEIGHT: units}), *fat]
    assert pr.ListPodResourcesResponse(pod_resources=podres.pods).ByteSize() > 4 << 20
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(podres.socket), FakePods({"team-a/trainer": PodInfo(uid)}), cgroup_root=root)
        assert adopter.ensure(units[:1]) is None
        assert [t.name for t in client.tenants()] == [tenant_name(units)]


def test_adopter_waits_for_the_pod_cgroup_and_follows_a_replaced_pod(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    old, new = str(uuid.uuid4()), str(uuid.uuid4())
    units = ids(0, 0, 25)
    podres.pods = [pod("web", "api-0", server={WEIGHT: units})]
    pods = FakePods({"web/api-0": PodInfo(old)})
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(podres.socket), pods, cgroup_root=root)
        why = adopter.ensure(units)
        assert why is not None and "no cgroup for pod web/api-0" in why and old in why
        assert client.tenants() == []
        old_cg = _pod_dir(root, old)
        daemon.driver.create(old_cg)
        assert adopter.ensure(units) is None
        assert client.tenants()[0].cgroup == old_cg
        # the pod is replaced by one of the same name that got the same units (a StatefulSet)
        shutil.rmtree(root / old_cg.lstrip("/"))
        new_cg = _pod_dir(root, new)
        daemon.driver.create(new_cg)
        pods.pods["web/api-0"] = PodInfo(new)
        result = adopter.reconcile()
        assert result.removed == result.adopted == (tenant_name(units),)
        (t,) = client.tenants()
        assert (t.cgroup, t.weight) == (new_cg, 25)
        # a pod the API server does not know, and a daemon error, are reported, not raised
        podres.pods.append(pod("web", "ghost", c={WEIGHT: ids(0, 50, 2)}))
        result = adopter.reconcile()
        assert result.failed == {tenant_name(ids(0, 50, 2)): "pod web/ghost not found"}
        assert result.kept == (tenant_name(units),)


def test_adopter_gives_pods_their_memory_annotations_and_bounds_a_reserve_by_the_pod_s_weight(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    """unisched.io/memory and unisched.io/memory-reserve become the tenant's GPU memory terms. A reserve holds memory
    against every other tenant, so a pod may reserve at most its weight's part of its GPU (141 GiB): 20 units of 100
    may not reserve 50 GiB (any pod could otherwise hold a GPU's memory from all others); that pod is not adopted,
    and its container start says why."""
    root = tmp_path / "cgroup"
    uids = {n: str(uuid.uuid4()) for n in ("game", "train", "typo")}
    for uid in uids.values():
        daemon.driver.create(_pod_dir(root, uid))
    units = {"game": ids(0, 0, 70), "train": ids(0, 70, 20), "typo": ids(0, 90, 10)}
    podres.pods = [pod("ns", n, c={WEIGHT: u}) for n, u in units.items()]
    notes = {"game": {"unisched.io/memory": "120GiB", "unisched.io/memory-reserve": "90GiB"},
             "train": {"unisched.io/memory-reserve": "50GiB"}, "typo": {"unisched.io/memory": "lots"}}
    pods = FakePods({f"ns/{n}": PodInfo(uids[n], notes[n]) for n in uids})
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(podres.socket), pods, cgroup_root=root, gpu_memory={0: 141 << 30})
        result = adopter.reconcile()
        game, train, typo = (tenant_name(units[n]) for n in ("game", "train", "typo"))
        assert result.adopted == (game,)
        (t,) = client.tenants()
        assert (t.name, t.caps.memory_bytes, t.caps.memory_reserve) == (game, 120 << 30, 90 << 30)
        assert result.failed[train] == (f"pod ns/train annotation unisched.io/memory-reserve: {50 << 30} bytes is more "
                                        f"than its weight's part of GPU 0 (20 of 100 of its {141 << 30} bytes: "
                                        f"{(141 << 30) * 20 // 100})")
        assert result.failed[typo].startswith("pod ns/typo annotation unisched.io/memory: size must be a number")
        why = adopter.ensure(units["train"])
        assert why is not None and "pod ns/train annotation unisched.io/memory-reserve" in why
        assert {t.name for t in client.tenants()} == {game}  # retried with its annotations, refused again
        blind = PodAdopter(client, str(podres.socket), pods, cgroup_root=root)  # no GPU memory known: no reserve
        assert "GPU 0's memory is not known to the plugin" in blind.reconcile().failed[train]


def test_adopter_reports_an_unreachable_kubelet(daemon: InProcessServer, short_dir: Path) -> None:
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(short_dir / "none.sock"), FakePods(), cgroup_root=short_dir, timeout=2)
        result = adopter.reconcile()
    assert result.error is not None and "PodResources" in result.error and not result.adopted


def test_find_pod_cgroup_knows_both_cgroup_drivers(tmp_path: Path) -> None:
    uid = "5f1c0e4a-9d2b-4c55-8a3e-0123456789ab"
    (tmp_path / "kubepods" / "besteffort" / f"pod{uid}" / "c1").mkdir(parents=True)
    assert find_pod_cgroup(tmp_path, uid) == f"/kubepods/besteffort/pod{uid}"
    other = "0a1b2c3d-0000-1111-2222-333344445555"
    (tmp_path / "kubepods.slice" / f"kubepods-pod{other.replace('-', '_')}.slice").mkdir(parents=True)
    assert find_pod_cgroup(tmp_path, other) == f"/kubepods.slice/kubepods-pod{other.replace('-', '_')}.slice"
    assert find_pod_cgroup(tmp_path, str(uuid.uuid4())) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a cgroup to another user needs root")
def test_find_pod_cgroup_looks_only_in_roots_cgroups_not_a_users_delegated_subtree(tmp_path: Path) -> None:
    """A user who learns a pod's UID before the kubelet makes its cgroup makes `pod<uid>` in its own delegated subtree
    (shallower than the kubelet's): it is not the pod's."""
    uid = "5f1c0e4a-9d2b-4c55-8a3e-0123456789ab"
    user = tmp_path / "user.slice" / "user@1000.service"
    (user / f"pod{uid}").mkdir(parents=True)
    for d in (user, user / f"pod{uid}"):
        os.chown(d, 1000, 1000)
    assert find_pod_cgroup(tmp_path, uid) is None
    (tmp_path / "kubepods" / "burstable" / f"pod{uid}").mkdir(parents=True)
    assert find_pod_cgroup(tmp_path, uid) == f"/kubepods/burstable/pod{uid}"


def test_api_server_pods_looks_the_uid_up_with_the_token(tmp_path: Path) -> None:
    seen: list[tuple[str, str | None]] = []

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            code, body = {
                "/api/v1/namespaces/ns/pods/p": (200, b'{"metadata": {"uid": "u-1", "annotations": {"a": "b"}}, '
                                                   b'"spec": {"containers": [{"name": "gpu", "resources": '
                                                   b'{"limits": {"unisched.io/gpu-weight": "5"}}}]}}'),
                "/api/v1/namespaces/ns/pods/host": (200, b'{"metadata": {"uid": "u-2"}, "spec": {"hostPID": true}}'),
                "/api/v1/namespaces/ns/pods/broken": (500, b"{}"),
            }.get(self.path, (404, b"{}"))
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with fake_api_server(Handler) as url:
        pods = ApiServerPods(url, token, None)
        assert pods.pod("ns", "p") == PodInfo("u-1", {"a": "b"}, ("gpu",))
        assert pods.pod("ns", "host") == PodInfo("u-2", host_pid=True)
        assert pods.pod("ns", "gone") is None
        with pytest.raises(OSError, match="500"):
            pods.pod("ns", "broken")
    assert seen[0] == ("/api/v1/namespaces/ns/pods/p", "Bearer s3cret")


@pytest.mark.root
def test_adopter_adopts_a_real_pod_cgroup(tmp_path: Path, telemetry: FakeTelemetry, podres: FakePodResources) -> None:
    """A real cgroup made as the kubelet would (cgroupfs driver) under the real root, adopted by a daemon
    with the real cgroup driver: the tenant governs that directory, and goes with the pod."""
    reason = freezer_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from unisched.enforce.cgroups import detect_driver

    uid = str(uuid.uuid4())
    subtree = f"unisched-test-{uid[:8]}"  # its own: the default one may hold other daemons' live tenants
    driver = detect_driver("auto", subtree)
    top = driver.mount / f"kubepods-test-{uid[:8]}"
    pod_dir = top / "burstable" / f"pod{uid}"
    pod_dir.mkdir(parents=True)
    units = ids(0, 0, 60)
    podres.pods = [pod("games", "session-7", game={WEIGHT: units})]
    try:
        server = in_process_server(tmp_path / "state", telemetry=telemetry, driver=driver)  # type: ignore[arg-type]
        with server as daemon, DaemonClient(daemon.socket) as client:
            adopter = PodAdopter(client, str(podres.socket), FakePods({"games/session-7": PodInfo(uid)}))
            assert adopter.ensure(units) is None  # cgroup root from the daemon's Status
            (t,) = client.tenants()
            assert (t.name, t.weight, t.cgroup) == (tenant_name(units), 60, f"/{top.name}/burstable/pod{uid}")
            assert not driver.is_frozen(t.cgroup)  # alone on the GPU: never frozen
            podres.pods = []
            assert adopter.reconcile().removed == (t.name,)
            assert client.tenants() == []
    finally:
        for d in (pod_dir, pod_dir.parent, top):
            d.rmdir()
        driver.remove(f"/{subtree}")


# --- the command ----------------------------------------------------------------------------------------


def test_device_plugin_help_explains_the_resources() -> None:
    out = subprocess.run([sys.executable, "-m", "unisched", "device-plugin", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=child_env())
    assert out.returncode == 0
    for words in ("unisched.io/gpu-weight", "unisched.io/render-sessions", "--units-per-gpu", "--kubelet-dir",
                  "--pod-resources-socket", "PreStartContainer", "ListAndWatch"):
        assert words in out.stdout, words


def test_device_plugin_command_registers_and_cleans_up(daemon: InProcessServer, short_dir: Path,
                                                       podres: FakePodResources) -> None:
    kubelet = StubKubelet(short_dir).start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "unisched", "device-plugin", "--socket", daemon.socket, "--kubelet-dir", str(short_dir),
         "--pod-resources-socket", str(podres.socket), "--decode-sessions", "2", "--interval", "0.2",
         "--log-format", "json"],
        cwd=ROOT, env={**child_env(), "KUBERNETES_SERVICE_HOST": ""}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        # GPUs from the daemon's Status (the in-process daemon's fake telemetry has GPUs 0 and 1)
        assert len(kubelet.lists(WEIGHT, 1)[0]) == 200
        assert len(kubelet.lists(DECODE, 1)[0]) == 4
        assert {r.resource_name for r in kubelet.registrations} == {WEIGHT, DECODE}
        wait_until(lambda: podres.calls >= 2, 20, "the adopter to poll PodResources")
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=20)[0].decode()
        assert proc.returncode == 0, log[-2000:]
        assert not (short_dir / "unisched-gpu-weight.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kubelet.stop()
    assert "device plugin started" in log and "registered with the kubelet" in log, log[-2000:]
    assert os.path.exists(daemon.socket)


def test_a_pod_whose_weight_units_come_from_two_gpus_is_held_back_with_the_reason(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    """Two containers of 50 units, one on each GPU: as one tenant it would have weight 100 on both (a 50-unit
    neighbour on either would get a third instead of half), so it is not adopted and its start says why."""
    root = tmp_path / "cgroup"
    uid = str(uuid.uuid4())
    daemon.driver.create(_pod_dir(root, uid))
    a, b = ids(0, 0, 50), ids(1, 0, 50)
    podres.pods = [pod("ns", "split", one={WEIGHT: a}, two={WEIGHT: b})]
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(podres.socket), FakePods({"ns/split": PodInfo(uid)}), cgroup_root=root)
        with structlog.testing.capture_logs() as logs:
            result = adopter.reconcile()
            adopter.reconcile()  # the same reason again: logged once, not every pass
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["adoption failed"]
        assert result.adopted == () and client.tenants() == []
        assert "its containers' unisched.io/gpu-weight units come from GPUs [0, 1]" in result.failed[tenant_name(a)]
        why = adopter.ensure(a)
        assert why is not None and "come from GPUs [0, 1]" in why


def test_a_slow_api_server_costs_a_pass_its_lookup_budget_and_the_starting_pod_is_asked_first(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    """Each lookup takes 6 s (an API server near its timeout): a pass asks for pods for 10 s, then leaves the rest
    for the next, so a container start (PreStartContainer, given up by the kubelet at 30 s) is not held behind a
    burst of new pods; and the pod whose container is starting is asked first."""
    from unisched.integrations.kubernetes.adopt import LOOKUP_BUDGET_S

    root = tmp_path / "cgroup"
    now = [0.0]
    names = [f"p{i}" for i in range(5)]
    uids = {n: str(uuid.uuid4()) for n in names}
    for uid in uids.values():
        daemon.driver.create(_pod_dir(root, uid))
    units = {n: ids(0, 10 * i, 10) for i, n in enumerate(names)}
    podres.pods = [pod("ns", n, c={WEIGHT: units[n]}) for n in names]
    asked: list[str] = []

    class SlowPods(FakePods):
        def pod(self, namespace: str, name: str) -> PodInfo | None:
            asked.append(name)
            now[0] += 6.0
            return super().pod(namespace, name)

    pods = SlowPods({f"ns/{n}": PodInfo(uids[n]) for n in names})
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(podres.socket), pods, cgroup_root=root, clock=lambda: now[0])
        assert adopter.ensure(units["p4"]) is None  # its pod asked first, and adopted
        assert asked == ["p4", "p0"]  # 0 s and 6 s into the budget; at 12 s the rest waits
        assert 6.0 * (len(asked) - 1) <= LOOKUP_BUDGET_S
        result = adopter.reconcile()  # the next pass asks for the next ones
        assert asked == ["p4", "p0", "p1", "p2"]
        assert set(result.adopted) == {tenant_name(units["p1"]), tenant_name(units["p2"])}
        assert result.failed[tenant_name(units["p3"])].startswith("pod ns/p3 not looked up yet")


def test_a_pod_recreated_under_its_name_is_adopted_onto_its_own_cgroup_while_the_old_one_lingers(
    daemon: InProcessServer, podres: FakePodResources, tmp_path: Path
) -> None:
    """The kubelet removes a deleted pod's cgroup a while after the pod: its successor of the same name (and here
    the same units) starting meanwhile is another pod, looked up afresh at its container's start."""
    root = tmp_path / "cgroup"
    old, new = str(uuid.uuid4()), str(uuid.uuid4())
    old_cg, new_cg = _pod_dir(root, old), _pod_dir(root, new)
    daemon.driver.create(old_cg)
    units = ids(0, 0, 25)
    podres.pods = [pod("web", "api-0", server={WEIGHT: units})]
    pods = FakePods({"web/api-0": PodInfo(old)})
    with DaemonClient(daemon.socket) as client:
        adopter = PodAdopter(client, str(podres.socket), pods, cgroup_root=root)
        assert adopter.ensure(units) is None
        assert client.tenants()[0].cgroup == old_cg
        daemon.driver.create(new_cg)  # the old cgroup is still there
        pods.pods["web/api-0"] = PodInfo(new)
        assert adopter.ensure(units) is None
        assert client.tenants()[0].cgroup == new_cg
