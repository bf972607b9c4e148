"""`unisched device-plugin` and `unisched dra-driver`: wire the plugin or the driver, the adopter, telemetry and
the daemon together and run until SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import structlog

from unisched.integrations.kubernetes.adopt import ApiServerPods, PodAdopter, PodDirectory
from unisched.integrations.kubernetes.coexist import coexistence_problem
from unisched.integrations.kubernetes.devices import DECODE, RENDER
from unisched.integrations.kubernetes.dra import DraDriver
from unisched.integrations.kubernetes.dra_claims import ApiServerClaims, ClaimDirectory, DraConfig, SlicePublisher
from unisched.integrations.kubernetes.plugin import DevicePluginServer, PluginConfig
from unisched.telemetry import GpuTelemetry, NoGpuTelemetry
from unisched.telemetry.nvml import open_nvml
from unisched.transport.client import DaemonClient, DaemonError

__all__ = ["daemon_gpus", "serve_device_plugin", "serve_dra_driver"]

log = structlog.get_logger("unisched.kubelet")


def daemon_gpus(daemon: DaemonClient, wait_s: float) -> tuple[int, ...]:
    """The GPUs the daemon serves, waiting up to `wait_s` for it to answer (it starts beside the plugin)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return tuple(g.index for g in daemon.status().gpus)
        except DaemonError as e:
            if time.monotonic() > deadline:
                raise
            log.info("waiting for the daemon", reason=str(e))
            time.sleep(1.0)  # retrying a connection, not standing in for a condition


def _node_gpus(daemon: DaemonClient, gpus: tuple[int, ...], wait_s: float, verb: str) -> tuple[int, ...]:
    """The GPUs given, else those the daemon serves; () when it serves none (logged)."""
    if gpus:
        return gpus
    gpus = daemon_gpus(daemon, wait_s)
    if not gpus:
        log.error(f"the daemon reports no GPUs (no NVML?); pass --gpus to {verb} some anyway")
    return gpus


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _may_advertise(config: PluginConfig, telemetry: GpuTelemetry) -> bool:
    """False (logged, with what to do) where NVIDIA's device plugin hands out GPUs we would share."""
    known = {g.index: g.uuid for g in telemetry.gpus()}
    problem = coexistence_problem(config.kubelet_dir, {i: known.get(i, "") for i in config.gpus})
    if problem is None:
        return True
    if config.beside_nvidia_plugin:
        log.warning("starting beside NVIDIA's device plugin (--beside-nvidia-plugin)", reason=problem)
        return True
    log.error("refusing to start: " + problem)
    return False


def serve_device_plugin(
    config: PluginConfig,
    pod_resources_socket: str,
    interval: float = 2.0,
    wait_s: float = 60.0,
    cgroup_root: Path | None = None,
    pods: PodDirectory | None = None,
    telemetry: GpuTelemetry | None = None,
) -> int:
    with DaemonClient(config.daemon_socket) as daemon:
        config = replace(config, gpus=_node_gpus(daemon, config.gpus, wait_s, "advertise"))
        if not config.gpus:
            return 2
        if telemetry is None:
            telemetry = open_nvml() or NoGpuTelemetry()
        if not _may_advertise(config, telemetry):
            telemetry.close()
            return 3
        if pods is None:
            pods = ApiServerPods.in_cluster()
            if pods is None:
                log.warning("not in a cluster (no service account): pods cannot be looked up, so none is adopted")
        caps = [r.name for r in config.resources if r.name in (RENDER, DECODE)]
        adopter = PodAdopter(daemon, pod_resources_socket, pods, cgroup_root=cgroup_root, caps=caps,
                             gpu_memory={g.index: g.memory_total for g in telemetry.gpus()},
                             units_per_gpu=config.units_per_gpu, require_gpu_profile=config.require_gpu_profile,
                             online_namespaces=config.online_namespaces)
        server = DevicePluginServer(config, telemetry, prestart=adopter.ensure)
        stop = _stop_on_signals()
        log.info("device plugin started", gpus=list(config.gpus), resources=[r.name for r in config.resources],
                 kubelet_dir=str(config.kubelet_dir))
        try:
            server.run(stop, interval, each=adopter.reconcile)
        finally:
            telemetry.close()
        return 0


def serve_dra_driver(
    config: DraConfig,
    interval: float = 2.0,
    wait_s: float = 60.0,
    cgroup_root: Path | None = None,
    api: tuple[ClaimDirectory, SlicePublisher, PodDirectory] | None = None,
    telemetry: GpuTelemetry | None = None,
) -> int:
    """`api`: where claims are read, the slice published and pods looked up (default: the API server in the
    cluster; outside one the driver still serves, and every claim fails with the reason)."""
    with DaemonClient(config.daemon_socket) as daemon:
        config = replace(config, gpus=_node_gpus(daemon, config.gpus, wait_s, "publish"))
        if not config.gpus:
            return 2
        if telemetry is None:
            telemetry = open_nvml() or NoGpuTelemetry()
        pods: PodDirectory | None
        if api is None:
            claims, pods = ApiServerClaims.in_cluster(), ApiServerPods.in_cluster()
            if claims is None or pods is None:
                log.warning("not in a cluster (no service account): no ResourceSlice is published and no claim can "
                            "be read, so every claim fails")
            driver = DraDriver(config, claims, telemetry, slices=claims)
        else:
            claims_api, slices, pods = api
            driver = DraDriver(config, claims_api, telemetry, slices=slices)
        driver.adopter = PodAdopter(daemon, "", pods, cgroup_root=cgroup_root, claims=driver.pod_claims,
                                    gpu_memory={g.index: g.memory_total for g in telemetry.gpus()},
                                    units_per_gpu=config.weight_per_gpu, online_namespaces=config.online_namespaces,
                                    require_gpu_profile=config.require_gpu_profile)
        stop = _stop_on_signals()
        log.info("DRA driver started", driver=config.driver_name, node=config.node_name, gpus=list(config.gpus),
                 cdi_dir=str(config.cdi_dir))
        try:
            driver.run(stop, interval)
        finally:
            telemetry.close()
        return 0
