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
    "DRIVER_NAME",
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
