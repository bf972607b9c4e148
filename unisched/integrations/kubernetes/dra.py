"""The unisched DRA driver `gpu.unisched.io`: the kubelet's Dynamic Resource Allocation plugin API (v1beta1).

Where the device plugin advertises 100 unit devices per GPU, the driver describes each GPU once, in a
ResourceSlice (`dra_claims.resource_slice`, pure): attributes index, uuid, product and the configured render/decode session
caps; capacity `weight` = 100 per GPU, which claims consume where the cluster has consumable capacity (KEP-5075),
so several claims share a GPU by weight. The scheduler allocates; the driver never picks devices itself.

The kubelet finds the driver through its plugins_registry directory: the driver serves the plugin registration
API on <registry>/gpu.unisched.io-reg.sock (GetInfo: type DRAPlugin, name, the DRAPlugin endpoint under
<plugins>/gpu.unisched.io/, supported version v1beta1.DRAPlugin; NotifyRegistrationStatus: the kubelet's verdict).

NodePrepareResources, per claim: read the ResourceClaim (API server), take its allocation's results of this
driver on this node, weigh it (opaque config `weight`, else the weight capacity it consumed, else the whole
GPU's), write one CDI spec per claim under the CDI directory whose one device injects what the device plugin's
Allocate gives (`tenant_edits`: tenant, weight, GPUs, daemon socket mount, device nodes), and have the adopter
make the claim's pod a daemon tenant (the pod's cgroup exists by then: the kubelet prepares claims just before
it creates the pod sandbox). The CDI specs are the driver's only state: a restarted driver reads them back.
NodeUnprepareResources removes the spec and the tenant. Both are idempotent and report a claim's failure in its
`error`, never as a gRPC error (which would make the kubelet drop every claim's result).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from unisched.integrations.kubernetes import dra_v1beta1_pb2 as dra
from unisched.integrations.kubernetes import dra_v1beta1_pb2_grpc as dra_grpc
from unisched.integrations.kubernetes import pluginregistration_v1_pb2 as reg
from unisched.integrations.kubernetes import pluginregistration_v1_pb2_grpc as reg_grpc
from unisched.integrations.kubernetes.adopt import PodAdopter, PodClaim
from unisched.integrations.kubernetes.apiserver import ApiServerError
from unisched.integrations.kubernetes.defaults import (
    CDI_KIND,
)
from unisched.integrations.kubernetes.dra_claims import (
    ClaimDirectory,
    ClaimError,
    DraConfig,
    PreparedClaim,
    SlicePublisher,
    bad_ref,
    cdi_spec,
    prepared_claim,
    read_spec,
    resource_slice,
    spec_path,
    write_json,
)
from unisched.integrations.kubernetes.plugin import gpu_health
from unisched.telemetry import GpuTelemetry

__all__ = [
    "DRAPLUGIN_SERVICE",
    "PLUGIN_TYPE",
    "DraDriver",
]

log = structlog.get_logger("unisched.dra")

PLUGIN_TYPE = "DRAPlugin"
DRAPLUGIN_SERVICE = "v1beta1.DRAPlugin"
"""What PluginInfo.supported_versions lists for the v1beta1 DRAPlugin service (DRAPluginService in the kubelet)."""

# --- the driver ------------------------------------------------------------------------------------------


@dataclass
class _Registration:
    """What the kubelet said at registration."""

    registered: bool = False
    error: str = ""
    calls: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)


class _RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(self, config: DraConfig, status: _Registration) -> None:
        self.config = config
        self.status = status

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(type=PLUGIN_TYPE, name=self.config.driver_name, endpoint=str(self.config.endpoint),
                              supported_versions=[DRAPLUGIN_SERVICE])

    def NotifyRegistrationStatus(self, request: reg.RegistrationStatus, context: grpc.ServicerContext
                                 ) -> reg.RegistrationStatusResponse:
        s = self.status
        with s.cond:
            s.registered, s.error = request.plugin_registered, request.error
            s.calls += 1
            s.cond.notify_all()
        if request.plugin_registered:
            log.info("registered with the kubelet", driver=self.config.driver_name, endpoint=str(self.config.endpoint))
        else:
            log.error("the kubelet refused the registration", driver=self.config.driver_name, error=request.error)
        return reg.RegistrationStatusResponse()


class _PluginService(dra_grpc.DRAPluginServicer):
    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver

    def NodePrepareResources(self, request: dra.NodePrepareResourcesRequest, context: grpc.ServicerContext
                             ) -> dra.NodePrepareResourcesResponse:
        return dra.NodePrepareResourcesResponse(claims={c.uid: self.driver.prepare(c) for c in request.claims})

    def NodeUnprepareResources(self, request: dra.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
                               ) -> dra.NodeUnprepareResourcesResponse:
        return dra.NodeUnprepareResourcesResponse(claims={c.uid: self.driver.unprepare(c) for c in request.claims})


class DraDriver:
    """Serves DRAPlugin and Registration, prepares claims, publishes the node's ResourceSlice.

    `check()` is what `run()` calls every interval (sockets, health, the slice, the adopter's pass); tests call
    it and `prepare`/`unprepare` through a stub kubelet.
    """

    def __init__(self, config: DraConfig, claims: ClaimDirectory | None, telemetry: GpuTelemetry,
                 slices: SlicePublisher | None = None, adopter: PodAdopter | None = None) -> None:
        self.config = config
        self.claims = claims
        self.telemetry = telemetry
        self.slices = slices
        self.adopter = adopter
        """Makes a prepared claim's pod a tenant; None: no adoption (the env still names the tenant)."""
        self.registration = _Registration()
        self.published: dict[str, Any] | None = None
        self._server: grpc.Server | None = None
        self._lock = threading.Lock()
        self._said_no_api = False

    # the state: CDI specs

    def prepared(self) -> list[PreparedClaim]:
        """Every claim whose spec is in the CDI directory (this driver's files only; unreadable ones logged)."""
        out = []
        for path in sorted(self.config.cdi_dir.glob(f"{CDI_KIND.replace('/', '-')}_*.json")):
            try:
                out.append(read_spec(path))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("CDI spec unreadable; skipped", path=str(path), error=str(e))
        return out

    def pod_claims(self) -> list[PodClaim]:
        return [c.pod_claim() for c in self.prepared()]

    def prepare(self, ref: dra.Claim) -> dra.NodePrepareResourceResponse:
        bad = bad_ref(ref)
        if bad is not None:
            return self._failed(bad)
        with self._lock:
            path = spec_path(self.config, ref.uid)
            before = self._prepared_before(path)
            if self.claims is None:
                if before is not None:
                    return before.reply()
                return self._failed(f"claim {ref.namespace}/{ref.name}: no API server to read it from "
                                               "(not in a cluster?)")
            try:
                obj = self.claims.claim(ref.namespace, ref.name)
            except OSError as e:
                if before is not None:  # (a retry while the API server is away: as prepared)
                    return before.reply()
                return self._failed(f"cannot read claim {ref.namespace}/{ref.name}: {e}")
            if obj is None:
                return self._failed(f"claim {ref.namespace}/{ref.name} not found")
            try:
                claim = prepared_claim(self.config, ref, obj)
                if claim == before:
                    return claim.reply()  # a retry, or after a restart: prepared as the claim still says
                if before is not None:  # the claim now names another pod or weight: the spec must not stand for it
                    log.warning("claim changed since its spec was written; preparing it again", claim=claim.key,
                                pod=claim.pod, was_pod=before.pod)
                write_json(path, cdi_spec(self.config, claim))
            except (ClaimError, OSError) as e:
                return self._failed(str(e))
            if self.adopter is not None:
                why = self.adopter.ensure(sorted(claim.pod_claim().device_ids))
                if why is not None:
                    path.unlink(missing_ok=True)
                    return self._failed(f"claim {claim.key}: {why}")
            log.info("claim prepared", claim=claim.key, uid=claim.uid, pod=claim.pod, tenant=claim.tenant,
                     weight=claim.weight, gpus=list(claim.gpus), cdi=claim.cdi_id)
            return claim.reply()

    @staticmethod
    def _prepared_before(path: Path) -> PreparedClaim | None:
        """The claim a spec already in the CDI directory was written for (a retry, or before a restart); None."""
        if not path.exists():
            return None
        try:
            return read_spec(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("CDI spec unreadable; preparing again", path=str(path), error=str(e))
            return None

    def unprepare(self, ref: dra.Claim) -> dra.NodeUnprepareResourceResponse:
        bad = bad_ref(ref)
        if bad is not None:
            return dra.NodeUnprepareResourceResponse(error=self._refuse("unprepare", bad))
        with self._lock:
            path = spec_path(self.config, ref.uid)
            try:
                existed = path.exists()
                path.unlink(missing_ok=True)
            except OSError as e:
                return dra.NodeUnprepareResourceResponse(error=self._refuse("unprepare", f"claim {ref.uid}: {e}"))
            if existed and self.adopter is not None:
                result = self.adopter.reconcile()  # the claim is no longer listed: its tenant goes
                if result.error is not None:
                    log.warning("tenant of the unprepared claim not removed yet; the next pass retries",
                                claim=f"{ref.namespace}/{ref.name}", reason=result.error)
            if existed:
                log.info("claim unprepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid)
            return dra.NodeUnprepareResourceResponse()

    def _failed(self, why: str) -> dra.NodePrepareResourceResponse:
        return dra.NodePrepareResourceResponse(error=self._refuse("prepare", why))

    @staticmethod
    def _refuse(what: str, why: str) -> str:
        log.warning(f"{what} refused", reason=why)
        return why

    # serving

    def _serve(self) -> None:
        self._stop_server()
        for sock in (self.config.endpoint, self.config.registration_socket):
            sock.parent.mkdir(parents=True, exist_ok=True)
            sock.unlink(missing_ok=True)
        server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="dra"))
        dra_grpc.add_DRAPluginServicer_to_server(_PluginService(self), server)  # type: ignore[no-untyped-call]
        reg_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
            _RegistrationService(self.config, self.registration), server)
        server.add_insecure_port(f"unix:{self.config.endpoint}")
        server.add_insecure_port(f"unix:{self.config.registration_socket}")
        server.start()
        self._server = server
        log.info("serving", endpoint=str(self.config.endpoint), registration=str(self.config.registration_socket))

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

    def check_sockets(self) -> bool:
        """Serve (again) when either socket is missing; True when it started serving."""
        if self._server is not None and self.config.endpoint.exists() and self.config.registration_socket.exists():
            return False
        if self._server is not None:
            log.warning("a socket of ours was removed; serving again")
        self._serve()
        return True

    def slice(self) -> dict[str, Any]:
        return resource_slice(self.config, self.telemetry.gpus(), gpu_health(self.telemetry, self.config.gpus))

    def publish(self) -> bool:
        """Publish the ResourceSlice when it changed; True when it was published."""
        body = self.slice()
        if self.slices is None:
            if not self._said_no_api:
                log.warning("no API server: the ResourceSlice is not published (claims cannot be allocated here)",
                            devices=[d["name"] for d in body["spec"]["devices"]])
                self._said_no_api = True
            return False
        if body == self.published:
            return False
        try:
            self.slices.publish_slice(body)
        except OSError as e:
            why = str(e) if not isinstance(e, ApiServerError) else f"{e} (code {e.code})"
            log.error("ResourceSlice not published; will retry", slice=self.config.slice_name, error=why)
            return False
        self.published = body
        log.info("ResourceSlice published", slice=self.config.slice_name,
                 devices=[d["name"] for d in body["spec"]["devices"]])
        return True

    def check(self) -> None:
        self.check_sockets()
        self.publish()
        if self.adopter is not None:
            self.adopter.reconcile()

    def run(self, stop: threading.Event, interval: float = 2.0) -> None:
        try:
            while True:
                self.check()
                if stop.wait(interval):
                    return
        finally:
            self.close()

    def close(self) -> None:
        self._stop_server()
        for sock in (self.config.endpoint, self.config.registration_socket):
            sock.unlink(missing_ok=True)
