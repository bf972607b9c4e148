"""pycuda: `CudaGate` gates kernel launches on the compute lease and times them with CUDA events.

    gate = CudaGate(client)            # or CudaGate(client, stream=my_stream)
    with gate:                          # waits for the lease, then times what is launched inside
        kernel(..., block=..., grid=...)

    @gate                               # or as a decorator of a function that launches GPU work
    def step(): ...

Needs a current pycuda context (pycuda.autoinit or your own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from unisched_client._extras import missing_extra

try:
    import pycuda.driver as cuda
except ModuleNotFoundError as e:
    raise missing_extra(e, "cuda") from None

from unisched_client._inflight import InFlight
from unisched_client.client import Client

__all__ = ["CudaGate"]

F = TypeVar("F", bound=Callable[..., Any])
_Pair = tuple[Any, Any]


class CudaGate:
    def __init__(self, client: Client, stream: Any = None, engine: str = "compute", max_in_flight: int = 2) -> None:
        self.gate = client.gate(engine)
        self.stream = stream
        self.flight: InFlight[_Pair] = InFlight(
            self.gate,
            done=lambda p: bool(p[1].query()),
            wait=lambda p: p[1].synchronize(),
            elapsed_s=lambda p: float(p[1].time_since(p[0])) / 1000.0,
            max_in_flight=max_in_flight,
        )
        self._start: Any = None

    def __enter__(self) -> CudaGate:
        self.flight.acquire()
        self._start = cuda.Event()
        self._start.record(self.stream)
        return self

    def __exit__(self, *exc: object) -> None:
        end = cuda.Event()
        end.record(self.stream)
        self.flight.add((self._start, end))

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def gated(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return gated  # type: ignore[return-value]

    def drain(self) -> None:
        self.flight.drain()
