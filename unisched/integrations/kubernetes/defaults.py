"""The kubelet paths and names the node agents use by default, in a module of constants only: the CLI names
them in its help, and importing the agents themselves (grpc stubs, structlog) for that made every `unisched run`
pay for them."""

from __future__ import annotations

__all__ = [
    "CDI_KIND",
    "CONFIG_KIND",
    "DEFAULT_CDI_DIR",
    "DEFAULT_KUBELET_DIR",
    "DEFAULT_PLUGINS_DIR",
    "DEFAULT_POD_RESOURCES_SOCKET",
    "DEFAULT_REGISTRY_DIR",
    "DEVICE_LISTS",
    "DEVICE_LIST_ROOT",
    "DRIVER_NAME",
    "ENVVAR",
    "VOLUME_MOUNTS",
]

DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
DRIVER_NAME = "gpu.unisched.io"
DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_CDI_DIR = "/var/run/cdi"
CDI_KIND = "unisched.io/gpu"
CONFIG_KIND = "GpuConfig"
"""Opaque config a claim or class passes to this driver: {"apiVersion": ..., "kind": "GpuConfig", "weight": 30}."""
ENVVAR, VOLUME_MOUNTS = "envvar", "volume-mounts"
DEVICE_LISTS = (ENVVAR, VOLUME_MOUNTS)
"""How a container's GPUs are named to the NVIDIA container toolkit, which mounts the driver's libraries for them:
NVIDIA_VISIBLE_DEVICES itself (envvar), or an empty file mounted per GPU under DEVICE_LIST_ROOT (volume-mounts,
NVIDIA's device plugin's strategy of that name). Only the second can be told apart from a pod that sets the
variable itself: a toolkit with `accept-nvidia-visible-devices-envvar-when-unprivileged = false` and
`accept-nvidia-visible-devices-as-volume-mounts = true` then gives GPUs to the containers this plugin allocated
only."""
DEVICE_LIST_ROOT = "/var/run/nvidia-container-devices"
