"""The device plugin beside NVIDIA's k8s-device-plugin: a stand-in for NVIDIA's plugin serves the real device
plugin API on nvidia-gpu.sock in a temporary kubelet directory (GPU UUIDs as device IDs, as NVIDIA's plugin
advertises them); ours finds it, tells which GPUs both would hand out, and refuses to start, or warns and starts
with --beside-nvidia-plugin."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from conftest import ROOT, child_env
from inproc import InProcessServer, in_process_server
from kubelet_stub import FakePodResources, StubKubelet

from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2 as dp
from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from unisched.integrations.kubernetes.coexist import OtherPlugin, coexistence_problem, find_nvidia_plugins, shared_gpus
from unisched.integrations.kubernetes.devices import WEIGHT
from unisched.telemetry import FakeTelemetry

UUIDS = {0: "GPU-0", 1: "GPU-1"}  # the conftest telemetry's two H200s


class NvidiaPlugin(dp_grpc.DevicePluginServicer):
    """Serves ListAndWatch as NVIDIA's plugin does: the device list at once, then holds the stream open."""

    def __init__(self, path: Path, device_ids: list[str]) -> None:
        self.devices = [dp.Device(ID=i, health="Healthy") for i in device_ids]
        self.stopped = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        dp_grpc.add_DevicePluginServicer_to_server(self, self.server)  # type: ignore[no-untyped-call]
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def ListAndWatch(self, request: dp.Empty, context: grpc.ServicerContext) -> Iterator[dp.ListAndWatchResponse]:
        yield dp.ListAndWatchResponse(devices=self.devices)
        while context.is_active() and not self.stopped.wait(0.1):
            pass

    def stop(self) -> None:
        self.stopped.set()
        self.server.stop(grace=None)


@pytest.fixture
def nvidia(short_dir: Path) -> Iterator[NvidiaPlugin]:
    p = NvidiaPlugin(short_dir / "nvidia-gpu.sock", ["GPU-0"])
    yield p
    p.stop()


def test_finds_a_serving_nvidia_plugin_and_skips_leftover_sockets(nvidia: NvidiaPlugin, short_dir: Path) -> None:
    leftover = socket.socket(socket.AF_UNIX)  # a stopped plugin's socket file: nobody accepts on it
    leftover.bind(str(short_dir / "nvidia-mig-1g.10gb.sock"))
    leftover.close()
    ours = socket.socket(socket.AF_UNIX)
    ours.bind(str(short_dir / "unisched-gpu-weight.sock"))
    try:
        found = find_nvidia_plugins(short_dir, timeout=5)
    finally:
        ours.close()
    assert found == [OtherPlugin(short_dir / "nvidia-gpu.sock", "nvidia.com/gpu", ("GPU-0",))]


def test_shared_gpus_by_uuid_replica_and_unknown_ids() -> None:
    gpu = OtherPlugin(Path("nvidia-gpu.sock"), "nvidia.com/gpu", ("GPU-1",))
    shared = OtherPlugin(Path("nvidia-gpu.shared.sock"), "nvidia.com/gpu.shared", ("GPU-0::0", "GPU-0::1"))
    mig = OtherPlugin(Path("nvidia-mig-1g.10gb.sock"), "nvidia.com/mig-1g.10gb", ("MIG-5c89852c",))
    other_gpu = OtherPlugin(Path("nvidia-gpu.sock"), "nvidia.com/gpu", ("GPU-7",))
    assert shared_gpus([gpu], UUIDS) == {1: ["nvidia.com/gpu"]}
    assert shared_gpus([gpu, shared], UUIDS) == {0: ["nvidia.com/gpu.shared"], 1: ["nvidia.com/gpu"]}
    assert shared_gpus([other_gpu], UUIDS) == {}  # a GPU we do not advertise: disjoint, both plugins fine
    assert shared_gpus([mig], UUIDS) == {0: ["nvidia.com/mig-1g.10gb"], 1: ["nvidia.com/mig-1g.10gb"]}
    assert shared_gpus([other_gpu], {0: "", 1: ""}) == {0: ["nvidia.com/gpu"], 1: ["nvidia.com/gpu"]}  # no NVML
    assert shared_gpus([], UUIDS) == {}


def test_the_problem_names_the_gpu_the_socket_and_what_to_do(nvidia: NvidiaPlugin, short_dir: Path,
                                                             telemetry: FakeTelemetry) -> None:
    uuids = {g.index: g.uuid for g in telemetry.gpus()}
    problem = coexistence_problem(short_dir, uuids, timeout=5)
    assert problem is not None
    for words in ("nvidia-gpu.sock", "GPU 0 (GPU-0: nvidia.com/gpu)", "NVIDIA_VISIBLE_DEVICES", "--gpus",
                  "--beside-nvidia-plugin", "outside unisched's weights"):
        assert words in problem, words
    assert "GPU 1" not in problem
    assert coexistence_problem(short_dir, {1: "GPU-1"}, timeout=5) is None  # --gpus 1: disjoint
    nvidia.stop()
    assert coexistence_problem(short_dir, uuids, timeout=5) is None  # NVIDIA's plugin gone, its socket left


@pytest.fixture
def daemon(tmp_path: Path, telemetry: FakeTelemetry) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state", telemetry=telemetry) as s:
        yield s


def _device_plugin(daemon: InProcessServer, kubelet_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "unisched", "device-plugin", "--socket", daemon.socket, "--kubelet-dir", str(kubelet_dir),
         "--pod-resources-socket", str(kubelet_dir / "pr.sock"), "--interval", "0.2", "--log-format", "json", *extra],
        cwd=ROOT, env={**child_env(), "KUBERNETES_SERVICE_HOST": ""}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def test_device_plugin_command_refuses_to_start_beside_nvidia_s_plugin(
    nvidia: NvidiaPlugin, daemon: InProcessServer, short_dir: Path
) -> None:
    """No NVML here, so the command cannot tell which GPU NVIDIA's device is: it counts against all of ours."""
    proc = _device_plugin(daemon, short_dir)
    try:
        log = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, log[-2000:]
    assert "refusing to start: NVIDIA's device plugin serves on this node (nvidia-gpu.sock)" in log, log[-2000:]
    assert not list(short_dir.glob("unisched-*.sock"))


def test_device_plugin_command_starts_beside_nvidia_s_plugin_when_told(
    nvidia: NvidiaPlugin, daemon: InProcessServer, short_dir: Path
) -> None:
    kubelet = StubKubelet(short_dir).start()
    podres = FakePodResources(short_dir / "pr.sock").start()
    proc = _device_plugin(daemon, short_dir, "--beside-nvidia-plugin")
    try:
        assert len(kubelet.lists(WEIGHT, 1)[0]) == 200
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=20)[0].decode()
        assert proc.returncode == 0, log[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        podres.stop()
        kubelet.stop()
    assert "starting beside NVIDIA's device plugin (--beside-nvidia-plugin)" in log, log[-2000:]
