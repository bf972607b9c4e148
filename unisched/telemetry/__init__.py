"""GPU telemetry. Only unisched.telemetry.nvml imports pynvml."""

from unisched.telemetry.model import FakeTelemetry, GpuInfo, GpuSample, GpuTelemetry, NoGpuTelemetry

__all__ = ["FakeTelemetry", "GpuInfo", "GpuSample", "GpuTelemetry", "NoGpuTelemetry"]
