"""The DRA driver's bookkeeping, without gRPC: its config, the ResourceSlice it publishes, ResourceClaims weighed
into prepared claims, and the CDI specs that are its only state (enforced by integrations.kubernetes.dra)."""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from unisched.integrations.kubernetes import dra_v1beta1_pb2 as dra
from unisched.integrations.kubernetes.adopt import PodClaim
from unisched.integrations.kubernetes.apiserver import ApiServer
from unisched.integrations.kubernetes.defaults import (
    CDI_KIND,
    CONFIG_KIND,
    DEFAULT_CDI_DIR,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRY_DIR,
    DRIVER_NAME,
    ENVVAR,
)
from unisched.integrations.kubernetes.devices import tenant_name
from unisched.integrations.kubernetes.plugin import tenant_edits
from unisched.policy import PolicyError, validate_weight
from unisched.scheduler.config import DEFAULT_SOCKET
from unisched.telemetry import GpuInfo

__all__ = [
    "CDI_VERSION",
    "CONFIG_API_VERSION",
    "ApiServerClaims",
    "ClaimDirectory",
    "ClaimError",
    "DraConfig",
    "FakeClaims",
    "PreparedClaim",
    "SlicePublisher",
    "bad_ref",
    "cdi_spec",
    "prepared_claim",
    "read_spec",
    "resource_slice",
    "spec_path",
    "write_json",
]

CDI_VERSION = "0.6.0"
"""The first CDI version with spec annotations, where the driver keeps what it prepared."""
CONFIG_API_VERSION = "gpu.unisched.io/v1alpha1"
RESOURCE_API = "/apis/resource.k8s.io/v1"
_NOTE = "unisched.io/"
_DEVICE = re.compile(r"gpu(\d{1,3})")
_UID = re.compile(r"[0-9a-zA-Z][0-9a-zA-Z._-]{0,62}")
"""What a claim UID must look like here (it names a CDI device and a file): a UUID always does."""


class ClaimError(ValueError):
    """Why one claim cannot be prepared; str() goes to the kubelet (the pod's events show it)."""


@dataclass(frozen=True)
class DraConfig:
    node_name: str
    gpus: tuple[int, ...]
    driver_name: str = DRIVER_NAME
    plugins_dir: Path = Path(DEFAULT_PLUGINS_DIR)
    registry_dir: Path = Path(DEFAULT_REGISTRY_DIR)
    cdi_dir: Path = Path(DEFAULT_CDI_DIR)
    daemon_socket: str = DEFAULT_SOCKET
    dev_root: Path = Path("/dev")
    weight_per_gpu: int = 100
    """The `weight` capacity of each GPU, and the weight of a claim that takes a whole GPU."""
    render_sessions: int = 0
    """Per-GPU session caps published as attributes (0: not published)."""
    decode_sessions: int = 0
    device_list: str = ENVVAR
    """How the claim's GPUs are named to the NVIDIA container toolkit (plugin.DEVICE_LISTS)."""
    online_namespaces: frozenset[str] | None = None
    """Where pods may ask for the online priority (adopt.PodAdopter's); None: anywhere."""
    require_gpu_profile: bool = False
    """Refuse a claim used by a container without the GPU seccomp profile (adopt.PodAdopter's)."""

    @property
    def endpoint(self) -> Path:
        """The DRAPlugin socket, in the driver's own directory under the kubelet's plugins directory."""
        return self.plugins_dir / self.driver_name / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{self.driver_name}-reg.sock"

    @property
    def slice_name(self) -> str:
        return f"{self.node_name}-{self.driver_name}"


def _device_name(gpu: int) -> str:
    return f"gpu{gpu}"


def resource_slice(config: DraConfig, gpus: Sequence[GpuInfo], healthy: Mapping[int, bool], generation: int = 1
                   ) -> dict[str, Any]:
    """The node's ResourceSlice (resource.k8s.io/v1): one device per healthy GPU of `config.gpus`, described by
    what telemetry knows of it (`gpus`; a GPU it does not know gets its index only)."""
    info = {g.index: g for g in gpus}
    devices = []
    for index in config.gpus:
        if not healthy.get(index, True):
            continue
        attributes: dict[str, dict[str, Any]] = {"index": {"int": index}}
        g = info.get(index)
        if g is not None:
            attributes["uuid"] = {"string": g.uuid}
            attributes["product"] = {"string": g.name}
        if config.render_sessions:
            attributes["renderSessions"] = {"int": config.render_sessions}
        if config.decode_sessions:
            attributes["decodeSessions"] = {"int": config.decode_sessions}
        whole = str(config.weight_per_gpu)
        capacity: dict[str, dict[str, Any]] = {
            "weight": {"value": whole, "requestPolicy": {"default": whole,
                                                         "validRange": {"min": "1", "max": whole, "step": "1"}}},
        }
        if g is not None and g.memory_total > 0:
            capacity["memory"] = {"value": str(g.memory_total)}
        devices.append({"name": _device_name(index), "attributes": attributes, "capacity": capacity,
                        "allowMultipleAllocations": True})
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": config.slice_name, "labels": {"app.kubernetes.io/part-of": "unisched"}},
        "spec": {
            "driver": config.driver_name,
            "nodeName": config.node_name,
            "pool": {"name": config.node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


# --- claims ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedClaim:
    """A claim prepared on this node: what its CDI spec injects and what the adopter makes of its pod."""

    uid: str
    namespace: str
    name: str
    pod: str
    """The pod it is reserved for (the first, where several share it)."""
    weight: int
    gpus: tuple[int, ...]
    devices: tuple[tuple[str, str, str], ...]
    """(request, pool, device) per allocated device of this driver."""

    @property
    def tenant(self) -> str:
        return tenant_name([f"{self.uid}/{d}" for _, _, d in self.devices], self.gpus)

    @property
    def cdi_name(self) -> str:
        return f"claim-{self.uid}"

    @property
    def cdi_id(self) -> str:
        return f"{CDI_KIND}={self.cdi_name}"

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def pod_claim(self) -> PodClaim:
        """What the adopter works from: the pod, its tenant, weight and GPUs (session counts are not claimed)."""
        ids = frozenset(f"{self.uid}/{d}" for _, _, d in self.devices)
        return PodClaim(self.namespace, self.pod, self.tenant, self.weight, self.gpus, 0, 0, ids, claim=self.name)

    def reply(self) -> dra.NodePrepareResourceResponse:
        return dra.NodePrepareResourceResponse(devices=[
            dra.Device(request_names=[r], pool_name=p, device_name=d, cdi_device_ids=[self.cdi_id])
            for r, p, d in self.devices
        ])


def _weight_of(config: DraConfig, claim: Mapping[str, Any], ours: Sequence[Mapping[str, Any]], key: str) -> int:
    """The tenant's one weight: the `weight` capacity its devices consumed (else whole GPUs: --weight-per-gpu), or
    this driver's opaque config for any of our requests. The class's config (an admin's DeviceClass) sets it; the
    claim's (its user's) may lower it, never raise it past the class's or what the devices consumed, so a claim
    consuming 1 unit of a GPU cannot ask the daemon for 10,000."""
    requests = {r.get("request") for r in ours}
    given: dict[str, Any] = {}
    configs = claim.get("status", {}).get("allocation", {}).get("devices", {}).get("config") or []
    for source in ("FromClass", "FromClaim"):
        for c in configs:
            opaque = c.get("opaque") or {}
            applies = not c.get("requests") or requests & set(c["requests"])
            if c.get("source") != source or opaque.get("driver") != config.driver_name or not applies:
                continue
            params = opaque.get("parameters")
            if not isinstance(params, Mapping) or (params.get("apiVersion"), params.get("kind")) != (
                    CONFIG_API_VERSION, CONFIG_KIND):
                raise ClaimError(f"claim {key}: opaque config for {config.driver_name} must be "
                                 f'{{"apiVersion": "{CONFIG_API_VERSION}", "kind": "{CONFIG_KIND}", "weight": N}}, '
                                 f"got {json.dumps(params)}")
            unknown = sorted(set(params) - {"apiVersion", "kind", "weight"})
            if unknown:
                raise ClaimError(f"claim {key}: unknown {CONFIG_KIND} fields {unknown} (known: weight)")
            if "weight" in params:
                given[source] = params["weight"]
    consumed = {str((r.get("consumedCapacity") or {}).get("weight", config.weight_per_gpu)) for r in ours}
    try:
        if "FromClass" in given:
            ceiling = validate_weight(given["FromClass"])
        elif len(consumed) == 1:
            (text,) = consumed
            ceiling = validate_weight(_number(text))
        elif "FromClaim" not in given:
            raise ClaimError(f"claim {key}: its devices consumed different weights {sorted(consumed)}; a tenant has "
                             f"one weight (give it in a {CONFIG_KIND} opaque config)")
        else:  # devices that consumed different weights, and the claim's own: at most the least of them
            ceiling = min(validate_weight(_number(t)) for t in consumed)
        if "FromClaim" not in given:
            return ceiling
        weight = validate_weight(given["FromClaim"])
    except PolicyError as e:
        raise ClaimError(f"claim {key}: {e}") from None
    if weight > ceiling:
        raise ClaimError(f"claim {key}: its {CONFIG_KIND} weight {weight} is above the {ceiling} "
                         f"{'its class gives' if 'FromClass' in given else 'its devices consumed'}; a claim's config "
                         "may lower its weight, not raise it")
    return weight


def _number(text: str) -> Any:
    """A consumed capacity's value, as a number where it is one (validate_weight says what else is wrong)."""
    return int(text) if text.isdigit() else text


def prepared_claim(config: DraConfig, ref: dra.Claim, claim: Mapping[str, Any]) -> PreparedClaim:
    """What preparing `ref` means on this node, from its ResourceClaim object (pure); ClaimError says why not."""
    key = f"{ref.namespace}/{ref.name}"
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise ClaimError(f"claim {key} has UID {meta.get('uid')!r}, the kubelet asked for {ref.uid!r} "
                         "(deleted and created again?)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {key} is not allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    ours = [r for r in results if r.get("driver") == config.driver_name]
    if not ours:
        others = sorted({str(r.get("driver")) for r in results})
        raise ClaimError(f"claim {key} has no device of driver {config.driver_name} (its devices are from {others})")
    devices = []
    gpus = []
    for r in ours:
        pool, device = str(r.get("pool")), str(r.get("device"))
        m = _DEVICE.fullmatch(device)
        if pool != config.node_name or m is None or int(m.group(1)) not in config.gpus:
            raise ClaimError(f"claim {key}: device {pool}/{device} is not one of this node's "
                             f"({config.node_name}/gpu{{{','.join(map(str, config.gpus))}}})")
        devices.append((str(r.get("request", "")), pool, device))
        gpus.append(int(m.group(1)))
    weight = _weight_of(config, claim, ours, key)
    pods = [p for p in (claim.get("status") or {}).get("reservedFor") or [] if p.get("resource") == "pods"]
    if not pods:
        raise ClaimError(f"claim {key} is reserved for no pod")
    if len(pods) > 1:  # one tenant is one pod: the kubelet prepares a claim once, so the others would run ungoverned
        raise ClaimError(f"claim {key} is reserved for {len(pods)} pods; a {config.driver_name} claim serves one pod "
                         "(make it from a ResourceClaimTemplate; dra/admission-policy.yaml stops the sharing sooner)")
    return PreparedClaim(ref.uid, ref.namespace, ref.name, str(pods[0]["name"]), weight, tuple(sorted(set(gpus))),
                         tuple(devices))


class ClaimDirectory(Protocol):
    def claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The ResourceClaim object; None when there is none. Raises OSError when it cannot tell."""
        ...


class SlicePublisher(Protocol):
    def publish_slice(self, body: Mapping[str, Any]) -> None:
        """Create or replace the ResourceSlice of that name. Raises OSError on failure."""
        ...


class FakeClaims:
    """ResourceClaims by "namespace/name", and the slices published, for tests."""

    def __init__(self, claims: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.claims: dict[str, Mapping[str, Any]] = dict(claims or {})
        self.slices: list[Mapping[str, Any]] = []
        self.fail: str | None = None
        """When set: every call raises OSError with it (an API server that does not answer)."""

    def claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        if self.fail:
            raise OSError(self.fail)
        return self.claims.get(f"{namespace}/{name}")

    def publish_slice(self, body: Mapping[str, Any]) -> None:
        if self.fail:
            raise OSError(self.fail)
        self.slices.append(body)


class ApiServerClaims(ApiServer):
    """ResourceClaims read and the node's ResourceSlice written (RBAC: get resourceclaims; get, create and
    update resourceslices)."""

    def claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        q = urllib.parse.quote
        return self.request("GET", f"{RESOURCE_API}/namespaces/{q(namespace)}/resourceclaims/{q(name)}")

    def publish_slice(self, body: Mapping[str, Any]) -> None:
        name = urllib.parse.quote(body["metadata"]["name"])
        have = self.request("GET", f"{RESOURCE_API}/resourceslices/{name}")
        if have is None:
            self.request("POST", f"{RESOURCE_API}/resourceslices", body)
            return
        meta = {**body["metadata"], "resourceVersion": have.get("metadata", {}).get("resourceVersion")}
        pool = {**body["spec"]["pool"], "generation": int(have.get("spec", {}).get("pool", {}).get("generation", 0)) + 1}
        self.request("PUT", f"{RESOURCE_API}/resourceslices/{name}",
                     {**body, "metadata": meta, "spec": {**body["spec"], "pool": pool}})


# --- CDI -------------------------------------------------------------------------------------------------


def cdi_spec(config: DraConfig, claim: PreparedClaim) -> dict[str, Any]:
    """One CDI device for the claim, with what the device plugin's Allocate gives a container; the claim itself
    rides along in the spec's annotations, so the spec files are all the state the driver keeps."""
    edits = tenant_edits(claim.tenant, claim.weight, claim.gpus, config.daemon_socket, config.dev_root,
                         config.device_list)
    bind = ["ro", "nosuid", "nodev", "bind"]
    container_edits: dict[str, Any] = {
        "env": [f"{k}={v}" for k, v in edits.envs.items()],
        "mounts": [*({"hostPath": d, "containerPath": d, "options": bind} for d in edits.mounts),
                   *({"hostPath": "/dev/null", "containerPath": m, "options": bind} for m in edits.device_list)],
    }
    if edits.devices:
        container_edits["deviceNodes"] = [{"path": d, "hostPath": d, "permissions": "rw"} for d in edits.devices]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "annotations": {
            _NOTE + "claim": json.dumps({"uid": claim.uid, "namespace": claim.namespace, "name": claim.name,
                                         "pod": claim.pod, "weight": claim.weight, "gpus": list(claim.gpus),
                                         "devices": [list(d) for d in claim.devices]}, separators=(",", ":")),
        },
        "devices": [{"name": claim.cdi_name, "containerEdits": container_edits}],
    }


def spec_path(config: DraConfig, uid: str) -> Path:
    return config.cdi_dir / f"{CDI_KIND.replace('/', '-')}_{uid}.json"


def read_spec(path: Path) -> PreparedClaim:
    """The claim a spec of ours was written for; ValueError (or OSError) when it is not one."""
    spec = json.loads(path.read_text())
    c = json.loads(spec["annotations"][_NOTE + "claim"])
    return PreparedClaim(str(c["uid"]), str(c["namespace"]), str(c["name"]), str(c["pod"]), int(c["weight"]),
                         tuple(int(g) for g in c["gpus"]), tuple((str(r), str(p), str(d)) for r, p, d in c["devices"]))


def write_json(path: Path, body: Mapping[str, Any]) -> None:
    """Atomically (the runtime reads the directory at any time): a temporary file renamed over the spec."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(tmp, path)

def bad_ref(ref: dra.Claim) -> str | None:
    missing = [f for f in ("namespace", "uid", "name") if not getattr(ref, f)]
    if missing:
        return f"claim {ref.namespace}/{ref.name} (UID {ref.uid!r}): the request has no {', '.join(missing)}"
    if not _UID.fullmatch(ref.uid):
        return f"claim {ref.namespace}/{ref.name}: UID {ref.uid!r} is not a UID"
    return None
