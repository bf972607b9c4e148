"""PyTorch: `with client.step(): ...` around each training or inference step.

The step waits for the compute lease, is timed with CUDA events on the current stream, and is reported to
the daemon as measured GPU time. Steps are not synchronized one by one (two may be in flight, one while
others wait for the engine); all are drained when the lease ends.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch

from unisched_client._inflight import InFlight
from unisched_client.client import Gate

__all__ = ["TorchStep"]

_Pair = tuple[Any, Any]


class TorchStep:
    """Reusable: keep one per loop (`step = client.step()`), or call `client.step()` each time (cheap)."""

    _inflight: ClassVar[weakref.WeakKeyDictionary[Gate, InFlight[_Pair]]] = weakref.WeakKeyDictionary()
    """One in-flight queue per gate, shared by the TorchStep objects made for it."""

    def __init__(self, gate: Gate, stream: object = None, max_in_flight: int = 2) -> None:
        self.gate = gate
        self.stream = stream
        flight = TorchStep._inflight.get(gate)
        if flight is None:
            flight = TorchStep._inflight[gate] = InFlight(
                gate,
                done=lambda p: bool(p[1].query()),
                wait=lambda p: p[1].synchronize(),
                elapsed_s=lambda p: float(p[0].elapsed_time(p[1])) / 1000.0,
                max_in_flight=max_in_flight,
            )
        self.flight = flight
        self._start: Any = None

    def __enter__(self) -> TorchStep:
        self.flight.collect()
        self.gate.acquire()
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record(self.stream)
        return self

    def __exit__(self, *exc: object) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self.flight.add((self._start, end))

    def drain(self) -> None:
        self.flight.drain()
