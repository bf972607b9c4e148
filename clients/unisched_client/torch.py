"""PyTorch: `with client.step(): ...` around each training or inference step.

The step waits for the compute lease, is timed with CUDA events on the current stream, and is reported to
the daemon as measured GPU time. Steps are not synchronized one by one (two may be in flight, one while
others wait for the engine); all are drained when the lease ends.

`step.pause_points(model)` lets a step stop inside itself while others wait for the engine: every few weight
layers, forward and backward, the step ends a timed part and goes on only while the lease is held (see
`InFlight.split`). For tenants next to latency-sensitive ones: a revoked step then leaves a part or two, not the
rest of the step, to run beside the next holder's work.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from unisched_client._extras import missing_extra

try:
    import torch
except ModuleNotFoundError as e:
    raise missing_extra(e, "torch") from None

from unisched_client._inflight import InFlight
from unisched_client.gate import Gate

__all__ = ["TorchStep"]

_Pair = tuple[Any, Any]


def _timing_event(stream: Any) -> Any:
    """A CUDA event that can time, recorded on `stream` (None: the current one). Typed Any: torch's stubs leave
    the event's constructor untyped, and mypy must pass with torch installed or not."""
    make: Any = torch.cuda.Event
    event = make(enable_timing=True)
    event.record(stream)
    return event


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
        self.flight.acquire()
        self._start = _timing_event(self.stream)
        return self

    def __exit__(self, *exc: object) -> None:
        self.flight.add((self._start, _timing_event(self.stream)))
        self._start = None

    def point(self) -> None:
        """A place inside the step where it may pause (a no-op outside a step and while nobody else waits)."""
        if self._start is None or not self.flight.split_wanted():
            return
        self.flight.split((self._start, _timing_event(self.stream)))
        self._start = _timing_event(self.stream)

    def pause_points(self, model: torch.nn.Module, every: int = 8) -> Callable[[], None]:
        """Pause points after every `every`-th weight layer (a parameter of 2+ dimensions: convolutions, linear
        layers) in the forward pass and, through a hook on its output, in the backward pass. Returns a function
        that removes them. Normalization layers are skipped: their outputs are often changed in place."""
        if every < 1:
            raise ValueError(f"every must be at least 1; got {every}")
        layers = [m for m in model.modules() if not any(True for _ in m.children())
                  and any(p.dim() >= 2 for p in m.parameters(recurse=False))]

        def backward_point(grad: Any) -> None:
            self.point()

        def forward_point(module: Any, inputs: Any, output: Any) -> None:
            self.point()
            tensor: Any = output  # (torch's stubs leave register_hook untyped)
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                tensor.register_hook(backward_point)

        handles = [m.register_forward_hook(forward_point) for m in layers[every - 1::every]]

        def remove() -> None:
            for h in handles:
                h.remove()

        return remove

    def drain(self) -> None:
        self.flight.drain()
