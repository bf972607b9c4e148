"""The DRA driver tests' rig: a driver on short sockets registered with a stub kubelet plugin watcher and reading
claims from a fake API (Node, and its `node` fixture), an in-process daemon (`daemon`), claims as the API server
returns them, and what a valid CDI spec is."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from inproc import InProcessServer, in_process_server
from kubelet_stub import StubPluginWatcher

from unisched.integrations.kubernetes import dra_v1beta1_pb2 as dra
from unisched.integrations.kubernetes.dra import DraDriver
from unisched.integrations.kubernetes.dra_claims import DraConfig, FakeClaims
from unisched.telemetry import FakeTelemetry

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


@pytest.fixture(name="node")
def node_fixture(short_dir: Path, telemetry: FakeTelemetry) -> Iterator[Node]:
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


@pytest.fixture(name="daemon")
def daemon_fixture(tmp_path: Path, telemetry: FakeTelemetry) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state", telemetry=telemetry) as s:
        yield s
