"""NVIDIA's k8s-device-plugin on the same node: find it and say whether it hands out GPUs that unisched shares.

The kubelet accounts each extended resource on its own: it cannot know that `nvidia.com/gpu` and
`unisched.io/gpu-weight` name the same GPUs. A pod given a GPU by NVIDIA's plugin gets its device nodes (and
NVIDIA_VISIBLE_DEVICES for the container toolkit) and runs in no tenant, outside the daemon's weights, freezes and
caps, while the kubelet keeps placing weight pods on that GPU. Two plugins on one node therefore work only on
disjoint GPUs. NVIDIA's plugin serves `nvidia-<name>.sock` in the kubelet's device-plugins directory for
`nvidia.com/<name>` (gpu, gpu.shared, mig-1g.10gb, ...), and its device IDs are GPU UUIDs (`GPU-...`), with
`::N` appended per time-slicing replica, or MIG UUIDs (`MIG-...`, a GPU it cannot map back without NVML).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2 as dp
from unisched.integrations.kubernetes import deviceplugin_v1beta1_pb2_grpc as dp_grpc

__all__ = ["OtherPlugin", "find_nvidia_plugins", "shared_gpus", "coexistence_problem"]

NVIDIA_SOCKETS = "nvidia-*.sock"
PROBE_TIMEOUT_S = 5.0
"""How long a live plugin gets to send its first device list: it sends it at once; a socket nobody serves (left
behind by a stopped plugin) fails to connect well within this."""


@dataclass(frozen=True)
class OtherPlugin:
    socket: Path
    resource: str
    devices: tuple[str, ...]


def find_nvidia_plugins(kubelet_dir: Path, timeout: float = PROBE_TIMEOUT_S) -> list[OtherPlugin]:
    """NVIDIA's plugins serving in `kubelet_dir`, with the device IDs each advertises (its first ListAndWatch
    answer, as the kubelet gets it). Sockets nobody answers on are left out: a stopped plugin's leftovers."""
    found = []
    for path in sorted(kubelet_dir.glob(NVIDIA_SOCKETS)):
        if not path.is_socket():
            continue
        devices = _advertised(path, timeout)
        if devices is not None:
            found.append(OtherPlugin(path, f"nvidia.com/{path.name[len('nvidia-'):-len('.sock')]}", devices))
    return found


def _advertised(path: Path, timeout: float) -> tuple[str, ...] | None:
    with grpc.insecure_channel(f"unix://{path}") as channel:
        stub = dp_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        stream = stub.ListAndWatch(dp.Empty(), timeout=timeout)
        try:
            first = next(stream)
        except (grpc.RpcError, StopIteration):
            return None
        finally:
            stream.cancel()
    return tuple(d.ID for d in first.devices)


def shared_gpus(plugins: Sequence[OtherPlugin], uuids: Mapping[int, str]) -> dict[int, list[str]]:
    """Which of our GPUs (index -> UUID, "" unknown) each plugin also advertises: {index: [resources]}. A GPU UUID
    matches one of ours or none (a GPU of the node we do not advertise); a device ID that is no GPU UUID (MIG), or
    any ID while some of our UUIDs are unknown (no NVML), may be any GPU, so it counts against all of ours."""
    by_uuid = {uuid: index for index, uuid in uuids.items() if uuid}
    all_known = all(uuids.values())
    shared: dict[int, list[str]] = {}
    for plugin in plugins:
        for device in plugin.devices:
            base = device.split("::", 1)[0]
            exact = all_known and base.startswith("GPU-")
            for index in ([by_uuid[base]] if base in by_uuid else [] if exact else uuids):
                if plugin.resource not in shared.setdefault(index, []):
                    shared[index].append(plugin.resource)
    return {index: resources for index, resources in sorted(shared.items()) if resources}


def coexistence_problem(kubelet_dir: Path, uuids: Mapping[int, str], timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the device plugin must not advertise these GPUs beside NVIDIA's plugin, with what to do; None if fine."""
    plugins = find_nvidia_plugins(kubelet_dir, timeout)
    shared = shared_gpus(plugins, uuids)
    if not shared:
        return None
    gpus = ", ".join(f"GPU {i} ({uuids.get(i) or 'UUID unknown'}: {' '.join(r)})" for i, r in shared.items())
    sockets = ", ".join(p.socket.name for p in plugins)
    return (f"NVIDIA's device plugin serves on this node ({sockets}) and advertises GPUs that unisched would share by "
            f"weight: {gpus}. The kubelet cannot tell that both name the same GPUs, so a pod given one by NVIDIA's "
            "plugin would run outside unisched's weights and caps. Keep NVIDIA's plugin off this node (a node "
            "selector that excludes unisched.io/pool), or give the two plugins disjoint GPUs (NVIDIA's "
            "NVIDIA_VISIBLE_DEVICES, our --gpus); --beside-nvidia-plugin starts anyway")
