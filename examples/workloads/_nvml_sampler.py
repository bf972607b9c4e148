"""GPU utilization sampled from NVML in a thread, for the scenario orchestrators (ad_sim.py, cloud_gaming.py).

Why a thread: an orchestrator's own loop waits on its children and the daemon; the samples keep their period
whatever it does. Why NVML's 'gpu' utilization: it is the busy signal the daemon's saturation gate reads, so a run's
report says what the daemon saw.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

SAMPLE_PERIOD_S = 0.1


class NvmlSampler:
    """GPU and decoder utilization (percent) every SAMPLE_PERIOD_S, as [t, util, dec], straight from NVML (pynvml).
    Without NVML (no pynvml, no driver) it records no samples and says why in `error`."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.samples: list[list[float]] = []
        self.error: str | None = None
        self.gpu_name: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            name = pynvml.nvmlDeviceGetName(handle)
            self.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception as e:
            self.error = f"NVML unavailable, no utilization samples: {type(e).__name__}: {e}"
            return
        self._thread = threading.Thread(target=self._run, args=(pynvml, handle), daemon=True)
        self._thread.start()

    def _run(self, pynvml: Any, handle: Any) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            try:
                t = time.time()
                util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                dec = pynvml.nvmlDeviceGetDecoderUtilization(handle)[0]
                self.samples.append([t, float(util), float(dec)])
            except Exception as e:
                self.error = self.error or f"NVML sample failed: {type(e).__name__}: {e}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            with contextlib.suppress(Exception):
                import pynvml

                pynvml.nvmlShutdown()

    def busy(self, start: float, end: float) -> float | None:
        """Mean GPU utilization (0..1) of the samples taken in [start, end]; None without any."""
        got = [s[1] for s in self.samples if start <= s[0] <= end]
        return round(sum(got) / len(got) / 100.0, 4) if got else None
