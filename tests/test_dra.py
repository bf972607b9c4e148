"""The DRA driver against a stub kubelet that speaks the real plugin registration v1 and DRA v1beta1 APIs over
Unix sockets, a fake API (ResourceClaims in, ResourceSlices out), and the adopter against the in-process daemon.
No cluster and no real kubelet ran any of this (docs/kubernetes.md)."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import drarig
import pytest
from drarig import DRIVER, NODE, SOCK, Node, cdi_problems, claim, make_config, opaque, ref
from inproc import InProcessServer
from kubelet_stub import StubPluginWatcher

from unisched.integrations.kubernetes import dra_v1beta1_pb2 as dra
from unisched.integrations.kubernetes import pluginregistration_v1_pb2 as reg
from unisched.integrations.kubernetes.adopt import FakePods, PodAdopter, PodInfo, unhooked_claim_users
from unisched.integrations.kubernetes.devices import tenant_name
from unisched.integrations.kubernetes.dra import DraDriver
from unisched.integrations.kubernetes.dra_claims import ClaimError, prepared_claim, resource_slice
from unisched.integrations.kubernetes.plugin import tenant_edits
from unisched.telemetry import FakeTelemetry, GpuSample
from unisched.transport.client import DaemonClient

node_fixture, daemon_fixture = drarig.node_fixture, drarig.daemon_fixture  # the fixtures `node` and `daemon`

# --- registration ------------------------------------------------------------------------------------------


def test_the_protos_have_the_kubelets_method_paths() -> None:
    assert dra.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    assert set(dra.DESCRIPTOR.services_by_name["DRAPlugin"].methods_by_name) == {"NodePrepareResources",
                                                                                  "NodeUnprepareResources"}
    assert reg.DESCRIPTOR.services_by_name["Registration"].full_name == "pluginregistration.Registration"
    assert [f.name for f in dra.Device.DESCRIPTOR.fields] == ["request_names", "pool_name", "device_name", "cdi_device_ids"]
    assert [f.number for f in reg.PluginInfo.DESCRIPTOR.fields] == [1, 2, 3, 4]


def test_registers_through_the_plugins_registry(node: Node) -> None:
    (seen,) = node.watcher.drivers.values()
    assert (seen.info.type, seen.info.name) == ("DRAPlugin", DRIVER)
    assert seen.info.endpoint == str(node.config.plugins_dir / DRIVER / "dra.sock")
    assert Path(seen.info.endpoint).is_socket()
    assert list(seen.info.supported_versions) == ["v1beta1.DRAPlugin"]
    assert node.config.registration_socket == node.config.registry_dir / f"{DRIVER}-reg.sock"
    assert (node.driver.registration.registered, node.driver.registration.error, node.driver.registration.calls) == (
        True, "", 1)
    assert node.driver.check_sockets() is False  # serving: nothing to do
    assert node.watcher.scan() == []


def test_a_refused_registration_is_recorded_and_a_removed_socket_served_again(short_dir: Path,
                                                                            telemetry: FakeTelemetry) -> None:
    n = Node(short_dir, telemetry)
    n.watcher = StubPluginWatcher(n.config.registry_dir, versions=("v1.DRAPlugin",))  # a kubelet without v1beta1
    try:
        n.driver.check_sockets()
        assert n.watcher.scan() == []
        assert "none of the versions ['v1beta1.DRAPlugin'] is supported" in n.watcher.refused[DRIVER]
        reg_status = n.driver.registration
        assert (reg_status.registered, reg_status.calls) == (False, 1)
        assert "v1beta1.DRAPlugin" in reg_status.error
        n.config.registration_socket.unlink()  # someone cleaned the registry directory
        assert n.driver.check_sockets()
        n.watcher = StubPluginWatcher(n.config.registry_dir)
        assert n.watcher.scan() == [DRIVER]
        assert n.driver.registration.registered and n.driver.registration.calls == 2
    finally:
        n.close()
    assert not n.config.endpoint.exists() and not n.config.registration_socket.exists()


# --- prepare / unprepare ------------------------------------------------------------------------------------


def test_prepare_returns_cdi_ids_and_writes_a_valid_cdi_spec(node: Node) -> None:
    c = claim("train", "gpu0", consumed={"weight": "30"})
    node.add(c)
    uid = c["metadata"]["uid"]
    replies = node.prepare(c)
    assert list(replies) == [uid] and replies[uid].error == ""
    (d,) = replies[uid].devices
    cdi_id = f"unisched.io/gpu=claim-{uid}"
    assert (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) == (["gpu"], NODE, "gpu0", [cdi_id])
    spec = json.loads(node.spec_path(c).read_text())
    assert cdi_problems(spec) == []
    assert (spec["cdiVersion"], spec["kind"]) == ("0.6.0", "unisched.io/gpu")
    (device,) = spec["devices"]
    assert f"{spec['kind']}={device['name']}" == cdi_id
    edits = device["containerEdits"]
    tenant = tenant_name([f"{uid}/gpu0"], [0])
    assert tenant.startswith("k8s-g0-")
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env == {"UNISCHED_TENANT": tenant, "UNISCHED_WEIGHT": "30", "UNISCHED_GPU": "0", "UNISCHED_SOCKET": SOCK,
                   "NVIDIA_VISIBLE_DEVICES": "0", "__GL_YIELD": "USLEEP"}
    assert edits["mounts"] == [{"hostPath": "/run/unisched", "containerPath": "/run/unisched",
                                "options": ["ro", "nosuid", "nodev", "bind"]}]
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    # exactly what the device plugin's Allocate gives a container of the same tenant
    same = tenant_edits(tenant, 30, (0,), SOCK, node.config.dev_root)
    assert (env, tuple(m["hostPath"] for m in edits["mounts"]), tuple(n["path"] for n in edits["deviceNodes"])) == (
        same.envs, same.mounts, same.devices)


def test_volume_mounts_name_the_claims_gpus_by_mounts(short_dir: Path, telemetry: FakeTelemetry) -> None:
    """--device-list volume-mounts: the CDI spec mounts /dev/null per GPU under /var/run/nvidia-container-devices
    and points NVIDIA_VISIBLE_DEVICES there, as the device plugin's Allocate does."""
    n = Node(short_dir, telemetry, device_list="volume-mounts")
    try:
        assert n.driver.check_sockets() and n.watcher.scan() == [DRIVER]
        c = claim("two", "gpu0", "gpu1")
        n.add(c)
        assert n.prepare(c)[c["metadata"]["uid"]].error == ""
        (device,) = json.loads(n.spec_path(c).read_text())["devices"]
        edits = device["containerEdits"]
        assert dict(e.split("=", 1) for e in edits["env"])["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
        assert [(m["hostPath"], m["containerPath"]) for m in edits["mounts"]] == [
            ("/run/unisched", "/run/unisched"), ("/dev/null", "/var/run/nvidia-container-devices/0"),
            ("/dev/null", "/var/run/nvidia-container-devices/1")]
    finally:
        n.close()


def test_a_claim_reserved_for_several_pods_is_refused(tmp_path: Path) -> None:
    """The kubelet prepares a claim once: the pods that share it past the first would get its GPU outside any tenant."""
    shared = claim("shared", "gpu0")
    shared["status"]["reservedFor"].append({"resource": "pods", "name": "p1", "uid": str(uuid.uuid4())})
    ref = dra.Claim(namespace="default", name="shared", uid=shared["metadata"]["uid"])
    with pytest.raises(ClaimError, match="reserved for 2 pods"):
        prepared_claim(make_config(tmp_path), ref, shared)


def test_two_gpus_and_weights_from_config_capacity_or_whole_devices(node: Node) -> None:
    whole = claim("two", "gpu0", "gpu1")
    shared = claim("shared", "gpu1", consumed={"weight": "25"})
    both = claim("cfg", "gpu0", consumed={"weight": "25"}, config=[opaque(40, "FromClass"), opaque(10)])
    node.add(whole, shared, both)
    replies = node.prepare(whole, shared, both)
    assert {u: r.error for u, r in replies.items()} == dict.fromkeys(replies, "")
    assert [d.device_name for d in replies[whole["metadata"]["uid"]].devices] == ["gpu0", "gpu1"]

    def env(obj: Mapping[str, Any]) -> dict[str, str]:
        (device,) = json.loads(node.spec_path(obj).read_text())["devices"]
        return dict(e.split("=", 1) for e in device["containerEdits"]["env"])

    assert (env(whole)["UNISCHED_WEIGHT"], env(whole)["NVIDIA_VISIBLE_DEVICES"]) == ("100", "0,1")
    assert env(whole)["UNISCHED_TENANT"].startswith("k8s-g0-1-")
    assert env(shared)["UNISCHED_WEIGHT"] == "25"  # the weight capacity it consumed
    assert env(both)["UNISCHED_WEIGHT"] == "10"  # the claim's opaque config may lower the class's
    assert len({env(o)["UNISCHED_TENANT"] for o in (whole, shared, both)}) == 3


@pytest.mark.parametrize(("consumed", "config", "why"), [
    ({"weight": "1"}, [opaque(10_000)], "its GpuConfig weight 10000 is above the 1 its devices consumed"),
    (None, [opaque(101)], "its GpuConfig weight 101 is above the 100 its devices consumed"),
    ({"weight": "25"}, [opaque(30, "FromClass"), opaque(31)], "its GpuConfig weight 31 is above the 30 its class gives"),
])
def test_a_claim_s_own_config_may_not_raise_its_weight(node: Node, consumed: dict[str, str] | None,
                                                       config: list[dict[str, Any]], why: str) -> None:
    """A user's claim consuming 1 unit of a GPU asked the daemon for weight 10,000 (about all of the GPU beside a
    neighbour of 100): its config may lower the weight its class or its capacity gives, not raise it."""
    c = claim("greedy", "gpu0", consumed=consumed, config=config)
    node.add(c)
    reply = node.prepare(c)[c["metadata"]["uid"]]
    assert why in reply.error


def test_a_class_s_config_sets_the_weight_whatever_was_consumed(node: Node) -> None:
    c = claim("premium", "gpu0", consumed={"weight": "25"}, config=[opaque(400, "FromClass")])
    node.add(c)
    assert node.prepare(c)[c["metadata"]["uid"]].error == ""


def test_unprepare_removes_the_spec_and_both_are_idempotent(node: Node, telemetry: FakeTelemetry) -> None:
    c = claim("infer", "gpu1", consumed={"weight": "50"})
    node.add(c)
    uid = c["metadata"]["uid"]
    first = node.prepare(c)[uid]
    node.api.fail = "connection refused"  # a retried prepare needs no API server: the spec says it all
    assert node.prepare(c, c)[uid] == first
    assert node.driver.prepared()[0].uid == uid
    # a restarted driver finds what it prepared in the CDI directory
    again = DraDriver(node.config, node.api, telemetry)
    assert again.prepare(ref(c)) == first
    assert [p.tenant for p in again.prepared()] == [first_tenant(node, c)]
    assert node.unprepare(c)[uid].error == ""
    assert not node.spec_path(c).exists() and node.driver.prepared() == []
    assert node.unprepare(c, c) == {uid: dra.NodeUnprepareResourceResponse()}  # unknown now: nothing to undo
    node.api.fail = None
    assert node.prepare(c)[uid] == first  # and prepared again from the claim


def test_a_spec_prepared_for_one_pod_does_not_stand_for_another_the_claim_names_later(node: Node) -> None:
    """The kubelet asks again for a claim whose spec is there, and the claim is now reserved for another pod: the
    spec is written again for that pod (its tenant and weight), not answered from the old one."""
    c = claim("shared", "gpu0", pod="first", consumed={"weight": "40"})
    node.add(c)
    uid = c["metadata"]["uid"]
    node.prepare(c)
    assert node.driver.prepared()[0].pod == "first"
    c["status"]["reservedFor"] = [{"resource": "pods", "name": "second", "uid": str(uuid.uuid4())}]
    node.add(c)
    assert node.prepare(c)[uid].error == ""
    assert [(p.pod, p.weight) for p in node.driver.prepared()] == [("second", 40)]


def first_tenant(node: Node, obj: Mapping[str, Any]) -> str:
    (device,) = json.loads(node.spec_path(obj).read_text())["devices"]
    return str(dict(e.split("=", 1) for e in device["containerEdits"]["env"])["UNISCHED_TENANT"])


def _bad_claims() -> list[tuple[str, dict[str, Any], str]]:
    other = claim("other", "gpu0", driver="gpu.nvidia.com")
    elsewhere = claim("elsewhere", "gpu0", pool="node-b")
    no_such_gpu = claim("gpu7", "gpu7")
    unallocated = claim("pending", "gpu0")
    del unallocated["status"]["allocation"]
    no_pod = claim("nopod", "gpu0", pod="")
    renamed = claim("renamed", "gpu0")
    wrong_cfg = claim("cfg", "gpu0", config=[{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "kind": "Other"}}}])
    extra_cfg = claim("extra", "gpu0", config=[opaque(20, priority="online")])
    zero = claim("zero", "gpu0", config=[opaque(0)])
    split = claim("split", "gpu0", "gpu1", consumed={"weight": "30"})
    split["status"]["allocation"]["devices"]["results"][1]["consumedCapacity"] = {"weight": "60"}
    return [
        ("unknown", claim("ghost", "gpu0"), "claim default/ghost not found"),
        ("another driver", other, "has no device of driver gpu.unisched.io (its devices are from ['gpu.nvidia.com'])"),
        ("another node", elsewhere, "device node-b/gpu0 is not one of this node's (node-a/gpu{0,1})"),
        ("no such GPU", no_such_gpu, "device node-a/gpu7 is not one of this node's"),
        ("not allocated", unallocated, "claim default/pending is not allocated"),
        ("no pod", no_pod, "claim default/nopod is reserved for no pod"),
        ("UID changed", renamed, "the kubelet asked for"),
        ("bad config", wrong_cfg, 'opaque config for gpu.unisched.io must be {"apiVersion": "gpu.unisched.io/v1alpha1"'),
        ("unknown config field", extra_cfg, "unknown GpuConfig fields ['priority'] (known: weight)"),
        ("weight 0", zero, "weight must be in 1.."),
        ("two weights", split, "its devices consumed different weights ['30', '60']; a tenant has one weight"),
    ]


@pytest.mark.parametrize(("what", "obj", "words"), _bad_claims(), ids=[c[0] for c in _bad_claims()])
def test_a_claim_that_cannot_be_prepared_fails_alone(node: Node, what: str, obj: dict[str, Any], words: str) -> None:
    good = claim("good", "gpu0")
    node.add(good)
    if what != "unknown":
        node.add(obj)
    sent = obj
    if what == "UID changed":
        sent = copy.deepcopy(obj)
        sent["metadata"]["uid"] = str(uuid.uuid4())  # the kubelet holds the UID of a claim since recreated
    replies = node.prepare(good, sent)
    assert replies[good["metadata"]["uid"]].error == "" and replies[good["metadata"]["uid"]].devices
    bad = replies[sent["metadata"]["uid"]]
    assert words in bad.error, bad.error
    assert not bad.devices
    assert not node.spec_path(sent).exists()


def test_bad_requests_and_an_unreachable_api_are_per_claim_errors(node: Node) -> None:
    c = claim("c", "gpu0")
    node.add(c)
    stub = node.watcher.plugin(DRIVER)
    no_uid = dra.Claim(namespace="default", name="c", uid="")
    odd = dra.Claim(namespace="default", name="c", uid="../../etc/x")
    no_ns = dra.Claim(name="c", uid=str(uuid.uuid4()))
    reply = stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[no_uid, odd, no_ns]), timeout=10)
    assert "the request has no uid" in reply.claims[""].error
    assert "is not a UID" in reply.claims["../../etc/x"].error
    assert "the request has no namespace" in reply.claims[no_ns.uid].error
    undo = stub.NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=[odd]), timeout=10)
    assert "is not a UID" in undo.claims["../../etc/x"].error
    assert stub.NodePrepareResources(dra.NodePrepareResourcesRequest(), timeout=10).claims == {}
    node.api.fail = "connection refused"
    err = node.prepare(c)[c["metadata"]["uid"]].error
    assert err == "cannot read claim default/c: connection refused"
    assert not list(node.config.cdi_dir.glob("*.json"))


def test_without_an_api_server_the_driver_serves_and_says_why_claims_fail(short_dir: Path,
                                                                         telemetry: FakeTelemetry) -> None:
    n = Node(short_dir, telemetry)
    n.driver = DraDriver(n.config, None, telemetry)
    try:
        n.driver.check()  # serves; publishes nothing
        assert n.driver.published is None
        assert n.watcher.scan() == [DRIVER]
        c = claim("c", "gpu0")
        assert "no API server to read it from" in n.prepare(c)[c["metadata"]["uid"]].error
    finally:
        n.close()


# --- the ResourceSlice ---------------------------------------------------------------------------------------


def test_resource_slice_describes_each_gpu_from_telemetry(short_dir: Path, telemetry: FakeTelemetry) -> None:
    config = make_config(short_dir)
    body = resource_slice(config, telemetry.gpus(), {0: True, 1: True})
    assert (body["apiVersion"], body["kind"], body["metadata"]["name"]) == ("resource.k8s.io/v1", "ResourceSlice",
                                                                            f"{NODE}-{DRIVER}")
    spec = body["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]) == (DRIVER, NODE, {"name": NODE, "generation": 1,
                                                                                "resourceSliceCount": 1})
    gpu0, gpu1 = spec["devices"]
    assert gpu0["name"] == "gpu0" and gpu0["allowMultipleAllocations"] is True
    assert gpu1["attributes"] == {"index": {"int": 1}, "uuid": {"string": "GPU-1"}, "product": {"string": "H200"},
                                  "decodeSessions": {"int": 2}}
    assert gpu0["capacity"] == {
        "weight": {"value": "100", "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}},
        "memory": {"value": str(141 << 30)},
    }
    # an unhealthy GPU is left out; a GPU telemetry does not know (no NVML) gets its index only
    assert [d["name"] for d in resource_slice(config, telemetry.gpus(), {0: True, 1: False})["spec"]["devices"]] == ["gpu0"]
    (bare,) = resource_slice(make_config(short_dir, gpus=(3,), weight_per_gpu=50), [], {})["spec"]["devices"]
    assert bare["attributes"] == {"index": {"int": 3}, "decodeSessions": {"int": 2}}
    assert bare["capacity"]["weight"]["value"] == "50"


def test_resource_slice_and_claims_match_the_kubernetes_schemas(short_dir: Path, telemetry: FakeTelemetry) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra) bundles the schemas")
    body = resource_slice(make_config(short_dir, render_sessions=4), telemetry.gpus(), {})
    objs = [body, claim("c", "gpu0", consumed={"weight": "30"}, config=[opaque(30)])]
    for version in ("1.34.0", "1.37.0"):  # resource.k8s.io/v1 is GA from 1.34
        for obj in objs:
            kv.validate(obj, version, strict=True)
    broken = copy.deepcopy(body)
    broken["spec"]["devices"][0]["capacity"]["weight"]["requestPolicy"]["validRange"]["maximum"] = "1"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.34.0", strict=True)


def test_the_slice_is_published_when_it_changes(node: Node, telemetry: FakeTelemetry) -> None:
    assert node.driver.publish()
    assert node.driver.publish() is False  # unchanged
    (published,) = node.api.slices
    assert [d["name"] for d in published["spec"]["devices"]] == ["gpu0", "gpu1"]
    telemetry.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0), GpuSample(1, 0.0, 0.0, 0.0, 0, ok=False)]
    node.api.fail = "API server down"
    assert node.driver.publish() is False  # logged, retried at the next check
    node.api.fail = None
    assert node.driver.publish()
    assert [d["name"] for d in node.api.slices[-1]["spec"]["devices"]] == ["gpu0"]


# --- adoption -------------------------------------------------------------------------------------------------



def test_the_containers_using_each_claim_without_the_gpu_profile_are_found() -> None:
    gpu = {"type": "Localhost", "localhostProfile": "profiles/unisched-gpu.json"}

    def container(name: str, claims: list[str], profile: dict[str, str] | None = None,
                  privileged: bool = False) -> dict[str, Any]:
        context: dict[str, Any] = {"seccompProfile": profile} if profile else {}
        if privileged:
            context["privileged"] = True
        return {"name": name, "resources": {"claims": [{"name": c} for c in claims]}, "securityContext": context}

    pod = {"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-weight-25"},
                                       {"name": "direct", "resourceClaimName": "shared"},
                                       {"name": "later", "resourceClaimTemplateName": "t"}],
                    "initContainers": [container("init", ["gpu"])],
                    "containers": [container("main", ["gpu", "direct"], gpu), container("side", ["direct"]),
                                   container("root", ["gpu"], gpu, privileged=True), container("cpu", [])]},
           "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p0-gpu-x7k2"}]}}
    assert unhooked_claim_users(pod) == {"p0-gpu-x7k2": ("init", "root"), "shared": ("side",)}


def test_prepare_refuses_a_claim_a_container_uses_without_the_gpu_profile(node: Node, daemon: InProcessServer,
                                                                         tmp_path: Path) -> None:
    """--require-gpu-profile on the DRA driver: a claim whose pod uses it in a container without the GPU seccomp
    profile is not prepared (the kubelet retries, and reports why); once the pod's containers have it, it is."""
    root = tmp_path / "cgroup"
    uid = str(uuid.uuid4())
    cg = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    (root / cg.lstrip("/")).mkdir(parents=True)
    daemon.driver.create(cg)
    c = claim("render", "gpu1", ns="games", pod="player-0")
    node.add(c)
    pods = FakePods({"games/player-0": PodInfo(uid, unhooked_claims={"render": ("main",)})})
    with DaemonClient(daemon.socket) as client:
        node.driver.adopter = PodAdopter(client, "", pods, cgroup_root=root, claims=node.driver.pod_claims,
                                         require_gpu_profile=True)
        err = node.prepare(c)[c["metadata"]["uid"]].error
        assert "containers ['main'] use claim render without the GPU seccomp profile" in err, err
        assert not node.spec_path(c).exists() and client.tenants() == []
        pods.pods["games/player-0"] = PodInfo(uid, unhooked_claims={"other": ("side",)})  # another claim's user
        node.driver.adopter = PodAdopter(client, "", pods, cgroup_root=root, claims=node.driver.pod_claims,
                                         require_gpu_profile=True)
        assert node.prepare(c)[c["metadata"]["uid"]].error == ""
        assert [t.name for t in client.tenants()] == [first_tenant(node, c)]


def test_prepare_adopts_the_pod_and_unprepare_removes_the_tenant(node: Node, daemon: InProcessServer,
                                                                  tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    uid = str(uuid.uuid4())
    cg = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    (root / cg.lstrip("/")).mkdir(parents=True)
    daemon.driver.create(cg)
    c = claim("render", "gpu1", ns="games", pod="player-0", consumed={"weight": "60"})
    waiting = claim("early", "gpu0", ns="games", pod="player-1")
    node.add(c, waiting)
    pods = FakePods({"games/player-0": PodInfo(uid, {"unisched.io/engines": "compute,graphics"}),
                     "games/player-1": PodInfo(str(uuid.uuid4()))})
    with DaemonClient(daemon.socket) as client:
        node.driver.adopter = PodAdopter(client, "", pods, cgroup_root=root, claims=node.driver.pod_claims)
        replies = node.prepare(c, waiting)
        assert replies[c["metadata"]["uid"]].error == ""
        (t,) = client.tenants()
        assert (t.name, t.weight, t.cgroup, t.adopted) == (first_tenant(node, c), 60, cg, True)
        assert {s.gpu for s in t.shares} == {1} and sorted(t.engines) == ["compute", "graphics"]
        # a pod whose cgroup is not there: its claim fails (the kubelet retries), nothing is left behind
        err = replies[waiting["metadata"]["uid"]].error
        assert "claim games/early: pod games/player-1 is not a unisched tenant yet: no cgroup for pod games/player-1" in err, err
        assert not node.spec_path(waiting).exists()
        node.driver.check()  # the periodic pass keeps what is prepared
        assert [x.name for x in client.tenants()] == [t.name]
        assert node.unprepare(c)[c["metadata"]["uid"]].error == ""
        assert client.tenants() == []
