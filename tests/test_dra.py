"""The DRA driver against a stub kubelet that speaks the real plugin registration v1 and DRA v1beta1 APIs over
Unix sockets, a fake API (ResourceClaims in, ResourceSlices out), and the adopter against the in-process daemon.
No cluster and no real kubelet ran any of this (docs/kubernetes.md)."""

from __future__ import annotations

import copy
import http.server
import json
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, child_env, wait_until
from inproc import InProcessServer, in_process_server
from kubelet_stub import StubPluginWatcher

from unisched.integrations.kubernetes import dra_v1beta1_pb2 as dra
from unisched.integrations.kubernetes import pluginregistration_v1_pb2 as reg
from unisched.integrations.kubernetes.adopt import FakePods, PodAdopter, PodInfo
from unisched.integrations.kubernetes.devices import tenant_name
from unisched.integrations.kubernetes.dra import DraDriver
from unisched.integrations.kubernetes.dra_claims import (
    ApiServerClaims,
    DraConfig,
    FakeClaims,
    resource_slice,
)
from unisched.integrations.kubernetes.plugin import tenant_edits
from unisched.telemetry import FakeTelemetry, GpuSample
from unisched.transport.client import DaemonClient

SOCK = "/run/unisched/unisched.sock"
DRIVER = "gpu.unisched.io"
NODE = "node-a"


def make_config(root: Path, **overrides: Any) -> DraConfig:
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    for node in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):  # no nvidia-uvm-tools, no nvidia-modeset here
        (dev / node).touch()
    fields: dict[str, Any] = {"node_name": NODE, "gpus": (0, 1), "plugins_dir": root / "plugins",
                              "registry_dir": root / "registry", "cdi_dir": root / "cdi", "daemon_socket": SOCK,
                              "dev_root": dev, "decode_sessions": 2}
    return DraConfig(**{**fields, **overrides})


def claim(name: str, *devices: str, ns: str = "default", uid: str | None = None, pod: str = "p0",
          consumed: Mapping[str, str] | None = None, config: list[dict[str, Any]] | None = None,
          driver: str = DRIVER, pool: str = NODE) -> dict[str, Any]:
    """A ResourceClaim (resource.k8s.io/v1) as the scheduler leaves it: allocated and reserved for a pod."""
    results = []
    for d in devices:
        r: dict[str, Any] = {"request": "gpu", "driver": driver, "pool": pool, "device": d}
        if consumed is not None:
            r["consumedCapacity"] = dict(consumed)
            r["shareID"] = str(uuid.uuid4())
        results.append(r)
    allocation: dict[str, Any] = {"devices": {"results": results}}
    if config:
        allocation["devices"]["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns, "uid": uid or str(uuid.uuid4())},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": {"allocation": allocation,
                   "reservedFor": [{"resource": "pods", "name": pod, "uid": str(uuid.uuid4())}] if pod else []},
    }


def opaque(weight: Any, source: str = "FromClaim", **extra: Any) -> dict[str, Any]:
    params = {"apiVersion": "gpu.unisched.io/v1alpha1", "kind": "GpuConfig", "weight": weight, **extra}
    return {"source": source, "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": params}}


def ref(obj: Mapping[str, Any]) -> dra.Claim:
    m = obj["metadata"]
    return dra.Claim(namespace=m["namespace"], name=m["name"], uid=m["uid"])


class Node:
    """A driver serving on short sockets, registered with a stub plugin watcher, reading claims from a fake API."""

    def __init__(self, root: Path, telemetry: FakeTelemetry, **overrides: Any) -> None:
        self.config = make_config(root, **overrides)
        self.config.registry_dir.mkdir()
        self.api = FakeClaims()
        self.driver = DraDriver(self.config, self.api, telemetry, slices=self.api)
        self.watcher = StubPluginWatcher(self.config.registry_dir)

    def add(self, *objs: dict[str, Any]) -> None:
        for o in objs:
            self.api.claims[f"{o['metadata']['namespace']}/{o['metadata']['name']}"] = o

    def prepare(self, *objs: Mapping[str, Any]) -> dict[str, dra.NodePrepareResourceResponse]:
        reply = self.watcher.plugin(DRIVER).NodePrepareResources(
            dra.NodePrepareResourcesRequest(claims=[ref(o) for o in objs]), timeout=10)
        return dict(reply.claims)

    def unprepare(self, *objs: Mapping[str, Any]) -> dict[str, dra.NodeUnprepareResourceResponse]:
        reply = self.watcher.plugin(DRIVER).NodeUnprepareResources(
            dra.NodeUnprepareResourcesRequest(claims=[ref(o) for o in objs]), timeout=10)
        return dict(reply.claims)

    def spec_path(self, obj: Mapping[str, Any]) -> Path:
        return self.config.cdi_dir / f"unisched.io-gpu_{obj['metadata']['uid']}.json"

    def close(self) -> None:
        self.watcher.stop()
        self.driver.close()


@pytest.fixture
def node(short_dir: Path, telemetry: FakeTelemetry) -> Iterator[Node]:
    n = Node(short_dir, telemetry)
    assert n.driver.check_sockets()
    assert n.watcher.scan() == [DRIVER]
    yield n
    n.close()


# --- CDI: what a valid spec is (github.com/cncf-tags/container-device-interface SPEC.md) ------------------

_CDI_VENDOR = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9]")
_CDI_CLASS = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*[A-Za-z0-9]")
_CDI_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*[A-Za-z0-9]")


def cdi_problems(spec: Mapping[str, Any]) -> list[str]:
    """What the CDI spec rules say about a spec: version, kind, device names, container edits."""
    out = []
    version = tuple(int(x) for x in str(spec.get("cdiVersion", "0")).split("."))
    if version < (0, 6, 0):
        out.append(f"cdiVersion {spec.get('cdiVersion')} is below 0.6.0 (spec annotations need 0.6.0)")
    vendor, _, cls = str(spec.get("kind", "")).partition("/")
    if not _CDI_VENDOR.fullmatch(vendor) or not _CDI_CLASS.fullmatch(cls):
        out.append(f"kind {spec.get('kind')!r} is not vendor/class")
    if not spec.get("devices"):
        out.append("no devices")
    for d in spec.get("devices", []):
        if not _CDI_DEVICE.fullmatch(str(d.get("name", ""))):
            out.append(f"device name {d.get('name')!r}")
        edits = d.get("containerEdits") or {}
        if not any(edits.get(k) for k in ("env", "deviceNodes", "mounts", "hooks")):
            out.append(f"device {d.get('name')} has no container edits")
    for edits in [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices", [])]:
        out += [f"env {e!r} is not KEY=VALUE" for e in edits.get("env", []) if "=" not in e]
        out += [f"device node {n}" for n in edits.get("deviceNodes", []) if not str(n.get("path", "")).startswith("/")]
        out += [f"mount {m}" for m in edits.get("mounts", []) if not (m.get("hostPath") and m.get("containerPath"))]
    out += [f"annotation {k!r}" for k, v in (spec.get("annotations") or {}).items() if not isinstance(v, str)]
    return out


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
                   "NVIDIA_VISIBLE_DEVICES": "0"}
    assert edits["mounts"] == [{"hostPath": "/run/unisched", "containerPath": "/run/unisched",
                                "options": ["ro", "nosuid", "nodev", "bind"]}]
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    # exactly what the device plugin's Allocate gives a container of the same tenant
    same = tenant_edits(tenant, 30, (0,), SOCK, node.config.dev_root)
    assert (env, tuple(m["hostPath"] for m in edits["mounts"]), tuple(n["path"] for n in edits["deviceNodes"])) == (
        same.envs, same.mounts, same.devices)


def test_two_gpus_and_weights_from_config_capacity_or_whole_devices(node: Node) -> None:
    whole = claim("two", "gpu0", "gpu1")
    shared = claim("shared", "gpu1", consumed={"weight": "25"})
    both = claim("cfg", "gpu0", consumed={"weight": "25"}, config=[opaque(10, "FromClass"), opaque(40)])
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
    assert env(both)["UNISCHED_WEIGHT"] == "40"  # the claim's opaque config over the class's, over the capacity
    assert len({env(o)["UNISCHED_TENANT"] for o in (whole, shared, both)}) == 3


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


def test_api_server_claims_reads_claims_and_creates_then_updates_the_slice(tmp_path: Path, short_dir: Path) -> None:
    c = claim("c", "gpu0", ns="ml")
    seen: list[tuple[str, str, Any]] = []
    slices: dict[str, dict[str, Any]] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")

        def do_GET(self) -> None:
            seen.append(("GET", self.path, self.headers.get("Authorization")))
            if self.path == "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c":
                self._reply(200, c)
            elif self.path.startswith("/apis/resource.k8s.io/v1/resourceslices/") and self.path.rsplit("/", 1)[1] in slices:
                self._reply(200, slices[self.path.rsplit("/", 1)[1]])
            else:
                self._reply(404, {"kind": "Status", "code": 404})

        def do_POST(self) -> None:
            body = self._body()
            seen.append(("POST", self.path, body))
            slices[body["metadata"]["name"]] = {**body, "metadata": {**body["metadata"], "resourceVersion": "7"}}
            self._reply(201, body)

        def do_PUT(self) -> None:
            body = self._body()
            seen.append(("PUT", self.path, body))
            self._reply(200, body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    try:
        api = ApiServerClaims(f"http://127.0.0.1:{httpd.server_port}", token, None)
        assert api.claim("ml", "c") == c
        assert api.claim("ml", "gone") is None
        body = resource_slice(make_config(short_dir), [], {})
        api.publish_slice(body)  # none yet: created
        api.publish_slice(body)  # there: replaced, with its resourceVersion and the next pool generation
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert seen[0] == ("GET", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c", "Bearer t0ken")
    writes = [(m, p) for m, p, _ in seen if m != "GET"]
    assert writes == [("POST", "/apis/resource.k8s.io/v1/resourceslices"),
                      ("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{NODE}-{DRIVER}")]
    put = seen[-1][2]
    assert put["metadata"]["resourceVersion"] == "7" and put["spec"]["pool"]["generation"] == 2


# --- adoption -------------------------------------------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path, telemetry: FakeTelemetry) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state", telemetry=telemetry) as s:
        yield s


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


# --- the command ------------------------------------------------------------------------------------------------


def test_dra_driver_help_explains_it() -> None:
    out = subprocess.run([sys.executable, "-m", "unisched", "dra-driver", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=child_env())
    assert out.returncode == 0
    for words in (DRIVER, "--node-name", "--cdi-dir", "--plugins-dir", "--registry-dir", "NodePrepareResources",
                  "ResourceSlice", "v1beta1.DRAPlugin", "unisched.io/gpu", "GpuConfig"):
        assert words in out.stdout, words


def test_dra_driver_needs_a_node_name() -> None:
    out = subprocess.run([sys.executable, "-m", "unisched", "dra-driver"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**child_env(), "NODE_NAME": ""})
    assert out.returncode == 2 and "pass --node-name or set NODE_NAME" in out.stderr


def test_dra_driver_command_registers_serves_and_cleans_up(daemon: InProcessServer, short_dir: Path) -> None:
    config = make_config(short_dir)
    config.registry_dir.mkdir()
    watcher = StubPluginWatcher(config.registry_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "unisched", "dra-driver", "--socket", daemon.socket, "--node-name", NODE,
         "--plugins-dir", str(config.plugins_dir), "--registry-dir", str(config.registry_dir), "--cdi-dir",
         str(config.cdi_dir), "--interval", "0.2", "--log-format", "json"],
        cwd=ROOT, env={**child_env(), "KUBERNETES_SERVICE_HOST": ""}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: config.registration_socket.exists() and config.endpoint.exists(), 30, "the driver's sockets")
        assert watcher.scan() == [DRIVER]
        c = claim("c", "gpu0")
        reply = watcher.plugin(DRIVER).NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[ref(c)]), timeout=10)
        assert "no API server" in reply.claims[c["metadata"]["uid"]].error
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=20)[0].decode()
        assert proc.returncode == 0, log[-2000:]
    finally:
        watcher.stop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert not config.endpoint.exists() and not config.registration_socket.exists()
    # GPUs from the daemon's Status (the in-process daemon's fake telemetry has GPUs 0 and 1)
    assert '"gpus": [0, 1]' in log and "DRA driver started" in log, log[-2000:]
    assert "no API server: the ResourceSlice is not published" in log and "registered with the kubelet" in log
