"""Pods holding gpu-weight devices become daemon tenants: the adopter.

Allocate runs before the container exists and names no pod, so adoption happens later, from what the kubelet
says: its PodResources API (v1 List) gives each pod's containers and the device IDs they hold, by pod name and
namespace. PodResources carries no pod UID, and the pod's cgroup is named by UID (pod<uid> under cgroupfs,
kubepods-...-pod<uid_with_underscores>.slice under systemd), so a `PodDirectory` looks the UID up (the API
server in a cluster) and the cgroup is found under the daemon's cgroup root. Each pod is one tenant, named from
its first gpu-weight container's IDs (what that container's UNISCHED_TENANT says), weight = its units, pinned
to their GPU; session resources become caps, and the annotations unisched.io/memory and unisched.io/memory-reserve
its GPU memory cap and reserve (a reserve that does not fit is not adopted: PreStartContainer says why). A pass
is idempotent: it removes k8s- tenants whose pods are gone (first, so what they reserved is free), adopts what is
missing, re-adopts a tenant whose pod was replaced, and logs what it cannot do yet.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import grpc
import structlog

from unisched.integrations.kubernetes import podresources_v1_pb2 as pr
from unisched.integrations.kubernetes import podresources_v1_pb2_grpc as pr_grpc
from unisched.integrations.kubernetes.apiserver import ApiServer
from unisched.integrations.kubernetes.defaults import DEFAULT_POD_RESOURCES_SOCKET
from unisched.integrations.kubernetes.devices import DECODE, RENDER, TENANT_PREFIX, WEIGHT, parse_id, tenant_name
from unisched.scheduler.config import parse_size
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb

__all__ = [
    "DEFAULT_POD_RESOURCES_SOCKET",
    "ApiServerPods",
    "FakePods",
    "PassResult",
    "PodAdopter",
    "PodClaim",
    "PodDirectory",
    "PodInfo",
    "claims_of",
    "find_pod_cgroup",
    "memory_terms",
]

log = structlog.get_logger("unisched.kubelet")

ENGINES_ANNOTATION = "unisched.io/engines"
PRIORITY_ANNOTATION = "unisched.io/priority"
MEMORY_ANNOTATION = "unisched.io/memory"
MEMORY_RESERVE_ANNOTATION = "unisched.io/memory-reserve"
_MEMORY_FIELDS = {MEMORY_ANNOTATION: "memory_bytes", MEMORY_RESERVE_ANNOTATION: "memory_reserve"}
_PRIORITY = {"online": pb.PRIORITY_ONLINE, "offline": pb.PRIORITY_OFFLINE}
_SEARCH_DEPTH = 6


@dataclass(frozen=True)
class PodClaim:
    """What one pod holds of our resources, summed over its containers."""

    namespace: str
    name: str
    tenant: str
    weight: int
    gpus: tuple[int, ...]
    render: int
    decode: int
    device_ids: frozenset[str]
    container: str = ""
    """The container whose gpu-weight IDs name the tenant ("" when the claim is the pod's, as DRA's)."""
    problem: str = ""
    """Why the pod cannot be a tenant as it is ("" when it can): it is not adopted, and its containers are held
    back with this."""
    claim: str = ""
    """The DRA ResourceClaim this is ("" for the device plugin's units)."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def labels(self) -> dict[str, str]:
        """What the daemon exports with the tenant's metrics (dcgm-exporter's label names)."""
        out = {"namespace": self.namespace, "pod": self.name}
        if self.container:
            out["container"] = self.container
        return out


def memory_terms(notes: Mapping[str, str], pod: str) -> dict[str, int]:
    """AdoptRequest's memory fields from the pod's unisched.io/memory and unisched.io/memory-reserve (8GiB, ...);
    ValueError naming the pod and annotation when one is not a size. The daemon checks the rest (reserve at most
    the cap, and that it fits beside the other tenants' reserves)."""
    out = {}
    for note, name in _MEMORY_FIELDS.items():
        if note in notes:
            try:
                out[name] = parse_size(notes[note])
            except ValueError as e:
                raise ValueError(f"pod {pod} annotation {note}: {e}") from None
    return out


def claims_of(pods: Iterable[pr.PodResources]) -> list[PodClaim]:
    """One claim per pod with gpu-weight devices (pods with only session devices are no tenant: skipped)."""
    out = []
    for pod in pods:
        held: dict[str, list[str]] = {WEIGHT: [], RENDER: [], DECODE: []}
        first: list[str] = []
        container = ""
        for c in pod.containers:
            for d in c.devices:
                if d.resource_name in held:
                    held[d.resource_name] += list(d.device_ids)
                    if d.resource_name == WEIGHT and not first:
                        first, container = list(d.device_ids), c.name
        if not first:
            continue
        gpus = sorted({u.gpu for i in held[WEIGHT] if (u := parse_id(i)) is not None})
        # one tenant has one weight on each of its GPUs: units from two GPUs would count on both
        problem = (f"pod {pod.namespace}/{pod.name}: its containers' {WEIGHT} units come from GPUs {gpus}; a pod is one "
                   "tenant with one weight, so its units must come from one GPU (give it one container asking for "
                   "them, or fewer units)") if len(gpus) > 1 else ""
        out.append(PodClaim(pod.namespace, pod.name, tenant_name(first), len(held[WEIGHT]), tuple(gpus),
                            len(held[RENDER]), len(held[DECODE]), frozenset(held[WEIGHT] + held[RENDER] + held[DECODE]),
                            container, problem))
    return out


@dataclass(frozen=True)
class PodInfo:
    uid: str
    annotations: Mapping[str, str] = field(default_factory=dict)
    unhooked: tuple[str, ...] = ()
    """Its containers that hold unisched.io/* resources without the GPU seccomp profile (`unhooked_containers`)."""
    unhooked_claims: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """ResourceClaim name -> its containers using it without the GPU seccomp profile (`unhooked_claim_users`)."""
    host_pid: bool = False
    """It runs in the host's pid namespace (spec.hostPID): its root would be the daemon's admin."""

    def unhooked_in(self, claim: str) -> tuple[str, ...]:
        """Its containers without the GPU seccomp profile among those that use DRA claim `claim`, or ("") those
        holding unisched.io resources."""
        return self.unhooked_claims.get(claim, ()) if claim else self.unhooked


GPU_PROFILE_PREFIX: Final = "unisched-gpu"
"""The GPU seccomp profiles' file names start with it (deploy/seccomp: unisched-gpu.json and its containerd forms)."""


def _containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _hooked(container: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
    """Whether the container runs with a Localhost seccomp profile named GPU_PROFILE_PREFIX*.json, its own or the
    pod's, and is not privileged (runtimes give a privileged container no profile)."""
    context = container.get("securityContext") or {}
    profile = context.get("seccompProfile") or (spec.get("securityContext") or {}).get("seccompProfile") or {}
    name = str(profile.get("localhostProfile") or "").rsplit("/", 1)[-1]
    return (profile.get("type") == "Localhost" and name.startswith(GPU_PROFILE_PREFIX) and name.endswith(".json")
            and context.get("privileged") is not True)


def unhooked_containers(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The containers (init containers too) of pod `spec` that hold unisched.io/* resources but are not `_hooked`:
    the runtime hands no listener over for them, so they would run without session hooks (no render or decode caps,
    memory read from NVML's sum)."""
    out = []
    for c in _containers(spec):
        resources = c.get("resources") or {}
        held = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        if any(str(name).startswith("unisched.io/") for name in held) and not _hooked(c, spec):
            out.append(str(c.get("name", "")))
    return tuple(out)


def unhooked_claim_users(pod: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """For each ResourceClaim pod object `pod` uses (by name: its spec's own, or the one status.resourceClaimStatuses
    says was made from its template), the containers using it that are not `_hooked`."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    made = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []}
    claim_of = {e.get("name"): e.get("resourceClaimName") or made.get(e.get("name"))
                for e in spec.get("resourceClaims") or []}
    out: dict[str, list[str]] = {}
    for c in _containers(spec):
        if _hooked(c, spec):
            continue
        for use in (c.get("resources") or {}).get("claims") or []:
            claim = claim_of.get(use.get("name"))
            if claim:
                out.setdefault(str(claim), []).append(str(c.get("name", "")))
    return {k: tuple(v) for k, v in out.items()}


class PodDirectory(Protocol):
    def pod(self, namespace: str, name: str) -> PodInfo | None:
        """The pod's UID and annotations; None when there is no such pod. Raises OSError when it cannot tell."""
        ...


class FakePods:
    """Pods by "namespace/name", for tests."""

    def __init__(self, pods: Mapping[str, PodInfo] | None = None) -> None:
        self.pods: dict[str, PodInfo] = dict(pods or {})

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return self.pods.get(f"{namespace}/{name}")


class ApiServerPods(ApiServer):
    """GET /api/v1/namespaces/NS/pods/NAME with the pod's service account (RBAC: get on pods)."""

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        body = self.request("GET", f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods/{urllib.parse.quote(name)}")
        if body is None:
            return None
        meta = body.get("metadata", {})
        spec = body.get("spec") or {}
        return PodInfo(str(meta["uid"]), dict(meta.get("annotations") or {}), unhooked_containers(spec),
                       unhooked_claim_users(body), spec.get("hostPID") is True)


def find_pod_cgroup(root: Path, uid: str) -> str | None:
    """The pod's cgroup below `root` ("/kubepods.slice/.../kubepods-burstable-pod<uid_>.slice"), breadth first
    to a bounded depth, kubepods branches first; None when the kubelet has not created it (yet). Only root's
    cgroups are looked in (this process's user's), as the kubelet's are: a user's delegated subtree (systemd's
    user@UID.service) could otherwise hold a `pod<uid>` made before the kubelet's, and have its own processes adopted
    with the pod's weight."""
    names = {f"pod{uid}", f"pod{uid.replace('-', '_')}"}
    systemd = f"-pod{uid.replace('-', '_')}.slice"
    level = [root]
    for _ in range(_SEARCH_DEPTH):
        nxt: list[Path] = []
        for d in level:
            try:
                children = sorted((p for p in d.iterdir() if _roots_cgroup(p)), key=lambda p: ("kubepods" not in p.name,
                                                                                            p.name))
            except OSError:
                continue
            for p in children:
                if p.name in names or p.name.endswith(systemd):
                    return "/" + str(p.relative_to(root))
                if p.name != "unisched":
                    nxt.append(p)
        level = nxt
    return None


def _roots_cgroup(p: Path) -> bool:
    """A cgroup directory (not a link) that root owns (this process's user: root where the agent runs)."""
    try:
        st = p.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


@dataclass(frozen=True)
class PassResult:
    """What one pass did: tenants adopted, removed, left as they were, and those it could not adopt (why)."""

    adopted: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    claims: tuple[PodClaim, ...] = ()
    error: str | None = None
    """Why the pass could not run at all (PodResources or the daemon unreachable)."""


PODRESOURCES_REPLY_MAX = 64 << 20
"""The largest PodResources List reply taken. It lists every pod on the node with all its containers, GPU or not,
so pod authors size it: a few pods of thousands of long-named containers pass gRPC's default 4 MiB, and a List
refused at that size would hold back every GPU container's start on the node (PreStartContainer waits for a pass)."""
LOOKUP_BUDGET_S = 10.0
"""How long one adoption pass may spend asking the API server for pods it has not looked up yet (each ask has its
own timeout): a burst of new pods against a slow API server must not hold the pass, and with it every container
start on the node (PreStartContainer waits for it; the kubelet gives up after 30 s). Those left are asked next
pass; a container about to start has its pod asked first."""


class PodAdopter:
    """Keeps the daemon's k8s- tenants equal to the pods that hold gpu-weight devices."""

    def __init__(
        self,
        daemon: DaemonClient,
        pod_resources_socket: str,
        pods: PodDirectory | None,
        cgroup_root: Path | None = None,
        caps: Sequence[str] = (),
        timeout: float = 5.0,
        claims: Callable[[], list[PodClaim]] | None = None,
        gpu_memory: Mapping[int, int] | None = None,
        units_per_gpu: int = 100,
        clock: Callable[[], float] = time.monotonic,
        require_gpu_profile: bool = False,
        online_namespaces: frozenset[str] | None = None,
    ) -> None:
        self.daemon = daemon
        self.online_namespaces = online_namespaces
        """Where a pod may ask for the online priority (PRIORITY_ANNOTATION), which holds the other tenants back
        while it has work; None: anywhere. A pod elsewhere that asks for it is not adopted, with the reason."""
        self.require_gpu_profile = require_gpu_profile
        """Refuse a pod whose containers holding our resources lack the GPU seccomp profile (PodInfo.unhooked): its
        containers are then held back at PreStartContainer with the reason."""
        self.clock = clock
        self.gpu_memory = dict(gpu_memory or {})
        """Each GPU's memory in bytes (NVML's), by index: a pod's reserve is bounded by its weight's part of it."""
        self.units_per_gpu = units_per_gpu
        """The weight a whole GPU stands for (the device plugin's units, the DRA driver's --weight-per-gpu)."""
        self.pod_resources_socket = pod_resources_socket
        self.claims = claims
        """Where the pods to adopt come from; None: the kubelet's PodResources (the device plugin's units)."""
        self.pods = pods
        self.cgroup_root = cgroup_root
        self.caps = frozenset(caps)
        """Session resources the plugin advertises: a pod's count of each becomes its cap (0 when it asked none)."""
        self.timeout = timeout
        self._lock = threading.Lock()
        self._reported: dict[str, str] = {}
        """Each pod's (tenant's) adoption failure logged last pass: logged again only when it changes."""
        self._cgroups: dict[tuple[str, str], tuple[str, PodInfo]] = {}
        """Each pod's cgroup and what the API server said of it (its annotations, read once: a pod whose adoption
        is refused is retried with them, not adopted without them)."""

    def list_pods(self) -> list[pr.PodResources]:
        options = [("grpc.max_receive_message_length", PODRESOURCES_REPLY_MAX)]
        with grpc.insecure_channel(f"unix:{self.pod_resources_socket}", options) as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
            reply = stub.List(pr.ListPodResourcesRequest(), timeout=self.timeout)
        return list(reply.pod_resources)

    def _root(self) -> Path:
        if self.cgroup_root is None:
            self.cgroup_root = Path(self.daemon.status().cgroup_root)
        return self.cgroup_root

    def _cached(self, claim: PodClaim) -> tuple[str, PodInfo] | None:
        """The pod's cgroup and info from an earlier pass, while that cgroup exists."""
        cached = self._cgroups.get((claim.namespace, claim.name))
        return cached if cached is not None and (self._root() / cached[0].lstrip("/")).is_dir() else None

    def _cgroup_of(self, claim: PodClaim) -> tuple[str | None, PodInfo | None, str]:
        """The pod's cgroup and info (cached while the cgroup exists), or why not."""
        key = (claim.namespace, claim.name)
        cached = self._cached(claim)
        if cached is not None:
            return cached[0], cached[1], ""
        if self.pods is None:
            return None, None, "no pod directory to look the pod's UID up in (not in a cluster?)"
        try:
            info = self.pods.pod(claim.namespace, claim.name)
        except OSError as e:
            return None, None, f"cannot look pod {claim.key} up: {e}"
        if info is None:
            return None, None, f"pod {claim.key} not found"
        cg = find_pod_cgroup(self._root(), info.uid)
        if cg is None:
            return None, info, f"no cgroup for pod {claim.key} (uid {info.uid}) under {self._root()} yet"
        self._cgroups[key] = (cg, info)
        return cg, info, ""

    def reconcile(self, first: frozenset[str] = frozenset()) -> PassResult:
        """One pass; the pod holding any of the devices `first` (a container about to start) is looked up first,
        and afresh: a pod recreated under the same name is another pod (its UID), whose cgroup is another, even
        while the old one's still exists."""
        with self._lock:
            try:
                claims = self.claims() if self.claims is not None else claims_of(self.list_pods())
                claims.sort(key=lambda c: not first & c.device_ids)
                for c in claims:
                    if first & c.device_ids:
                        self._cgroups.pop((c.namespace, c.name), None)
            except grpc.RpcError as e:
                why = f"PodResources at {self.pod_resources_socket}: {e.details() or e.code()}"
                log.warning("adoption pass skipped", reason=why)
                return PassResult(error=why)
            except OSError as e:
                why = f"cannot list the pods to adopt: {e}"
                log.warning("adoption pass skipped", reason=why)
                return PassResult(error=why)
            try:
                return self._pass(claims)
            except DaemonError as e:
                log.warning("adoption pass stopped", reason=str(e))
                return PassResult(claims=tuple(claims), error=str(e))

    def _pass(self, claims: list[PodClaim]) -> PassResult:
        ours = {t.name: t for t in self.daemon.tenants() if t.name.startswith(TENANT_PREFIX)}
        adopted: list[str] = []
        kept: list[str] = []
        removed: list[str] = []
        failed: dict[str, str] = {}
        wanted = {c.tenant for c in claims}
        for name, t in ours.items():  # first: what a gone pod reserved (GPU memory) is free for the new ones
            if name not in wanted and t.adopted:
                self.daemon.remove(name)
                removed.append(name)
                log.info("pod gone; tenant removed", tenant=name, cgroup=t.cgroup)
        lookups_end = self.clock() + LOOKUP_BUDGET_S
        for claim in claims:
            if claim.problem:
                failed[claim.tenant] = claim.problem
                continue
            if self.clock() > lookups_end and not self._cached(claim):
                failed[claim.tenant] = (f"pod {claim.key} not looked up yet: the API server answered slowly this pass "
                                        "(it is tried again at the next)")
                continue
            cg, info, why = self._cgroup_of(claim)
            if cg is None:
                failed[claim.tenant] = why
                continue
            have = ours.get(claim.tenant)
            if have is not None and have.cgroup == cg:
                kept.append(claim.tenant)
                continue
            if have is not None:  # same IDs, another pod (the old one was replaced): start over
                self.daemon.remove(claim.tenant)
                removed.append(claim.tenant)
            try:
                self._adopt(claim, cg, info)
            except ValueError as e:  # a bad annotation: the pod's to fix, reported as the daemon's refusals are
                failed[claim.tenant] = str(e)
                continue
            except DaemonError as e:
                if e.code is grpc.StatusCode.UNAVAILABLE:
                    raise
                failed[claim.tenant] = str(e)
                continue
            adopted.append(claim.tenant)
        for tenant, why in failed.items():  # once per pod and reason, not every pass (every 2 s)
            if self._reported.get(tenant) != why:
                log.error("adoption failed", tenant=tenant, error=why)
        self._reported = dict(failed)
        live = {(c.namespace, c.name) for c in claims}
        self._cgroups = {k: v for k, v in self._cgroups.items() if k in live}
        return PassResult(tuple(adopted), tuple(removed), tuple(kept), failed, tuple(claims))

    def _adopt(self, claim: PodClaim, cgroup: str, info: PodInfo | None) -> None:
        if info is not None and info.host_pid:
            raise ValueError(f"pod {claim.key} runs in the host's pid namespace (hostPID): root in it would be the "
                             "daemon's admin, so it is not made a tenant; run GPU pods without hostPID")
        unhooked = () if info is None else info.unhooked_in(claim.claim)
        if self.require_gpu_profile and unhooked:
            held = f"use claim {claim.claim}" if claim.claim else "hold unisched.io resources"
            raise ValueError(f"pod {claim.key}: containers {list(unhooked)} {held} without the GPU seccomp profile "
                             f"(securityContext.seccompProfile: type Localhost, localhostProfile profiles/"
                             f"{GPU_PROFILE_PREFIX}*.json, and not privileged), so their session caps could not be "
                             "enforced; this node's agent runs with --require-gpu-profile")
        notes = info.annotations if info is not None else {}
        engines = [e.strip() for e in notes.get(ENGINES_ANNOTATION, "").split(",") if e.strip()]
        priority = _PRIORITY.get(notes.get(PRIORITY_ANNOTATION, ""), pb.PRIORITY_UNSPECIFIED)
        if (priority == pb.PRIORITY_ONLINE and self.online_namespaces is not None
                and claim.namespace not in self.online_namespaces):
            raise ValueError(f"pod {claim.key} annotation {PRIORITY_ANNOTATION}: online is allowed in namespaces "
                             f"{sorted(self.online_namespaces)} only (the node agent's --online-namespaces)")
        memory = memory_terms(notes, claim.key)
        if "memory_reserve" in memory:
            self._check_reserve(claim, memory["memory_reserve"])
        self.daemon.adopt(pb.AdoptRequest(tenant=claim.tenant, weight=claim.weight, priority=priority, cgroup=cgroup,
                                          engines=engines, gpus=list(claim.gpus), labels=claim.labels, **memory))
        limits = {}
        if RENDER in self.caps:
            limits["render"] = claim.render
        if DECODE in self.caps:
            limits["decode"] = claim.decode
        if limits:
            self.daemon.set_limit(pb.SetLimitRequest(tenant=claim.tenant, **limits))
        log.info("pod adopted", tenant=claim.tenant, pod=claim.key, weight=claim.weight, gpus=list(claim.gpus),
                 cgroup=cgroup, **limits, **memory)

    def _check_reserve(self, claim: PodClaim, reserve: int) -> None:
        """A reserve holds GPU memory for the pod against every other tenant (the daemon's reserves are an admin's
        call, and adopting is one): a pod may reserve at most its weight's part of each of its GPUs' memory.
        ValueError naming the pod and the annotation otherwise."""
        for gpu in claim.gpus:
            total = self.gpu_memory.get(gpu)
            if total is None:
                raise ValueError(f"pod {claim.key} annotation {MEMORY_RESERVE_ANNOTATION}: GPU {gpu}'s memory is not "
                                 "known to the plugin (no NVML), so no reserve can be weighed against it")
            most = total * min(claim.weight, self.units_per_gpu) // self.units_per_gpu
            if reserve > most:
                raise ValueError(f"pod {claim.key} annotation {MEMORY_RESERVE_ANNOTATION}: {reserve} bytes is more "
                                 f"than its weight's part of GPU {gpu} ({claim.weight} of {self.units_per_gpu} of its "
                                 f"{total} bytes: {most})")

    def ensure(self, device_ids: Sequence[str]) -> str | None:
        """Before a container starts (PreStartContainer): its pod is a tenant, or why not."""
        result = self.reconcile(frozenset(device_ids))
        if result.error is not None:
            return result.error
        wanted = set(device_ids)
        claim = next((c for c in result.claims if wanted & c.device_ids), None)
        if claim is None:
            return f"no pod on this node holds devices {sorted(wanted)} (PodResources does not list them)"
        if claim.tenant in result.failed:
            return f"pod {claim.key} is not a unisched tenant yet: {result.failed[claim.tenant]}"
        return None
