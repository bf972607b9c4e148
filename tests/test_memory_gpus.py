"""Video memory on GPUs a tenant may not use.

The filter cannot tell which file an ioctl is made on, so a hooked tenant may make up an NV01_DEVICE_0 naming any
deviceId and allocate memory under it. Booked on that GPU, made-up memory would count against the other tenants'
reserves there, though a tenant pinned to other GPUs cannot open it (device admission). A pinned tenant's memory on
another GPU is refused as out of memory, nothing charged; a tenant that may use every GPU is bounded by its cap.
End to end as in test_memory.py: a real child behind the real filter, its RM calls on /dev/null.
"""

from __future__ import annotations

from pathlib import Path

from test_engine import Rig
from test_memory import DEV, GIB, LET_THROUGH, REFUSED, Served, mem
from test_seccomp import ENOTTY, needs_notify

from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.memory import UNKNOWN_GPU
from unisched.policy.memory import MemoryTerms, Verdict, admit_allocation
from unisched.scheduler.config import DaemonConfig
from unisched.telemetry import FakeTelemetry, GpuInfo

OTHER_DEV = 0xD3  # a device the child makes on GPU 3
TOTALS = {0: 80 * GIB, 3: 80 * GIB}


def test_a_pinned_tenant_s_allocation_on_another_gpu_is_refused_and_on_no_known_gpu_capped_only() -> None:
    pinned = {"a": MemoryTerms(gpus=frozenset({0}))}
    assert admit_allocation("a", 3, GIB, {}, pinned, 80 * GIB) is Verdict.GPU
    assert admit_allocation("a", 0, GIB, {}, pinned, 80 * GIB) is Verdict.ADMIT
    assert admit_allocation("a", UNKNOWN_GPU, GIB, {}, pinned, None) is Verdict.ADMIT
    assert admit_allocation("b", 3, GIB, {}, pinned, 80 * GIB) is Verdict.ADMIT  # b may use every GPU


@needs_notify
def test_a_tenant_pinned_to_gpu_0_cannot_book_memory_on_gpu_3_and_another_s_allocation_there_goes_on() -> None:
    ledger = MemoryLedger(lambda: {"t": MemoryTerms(gpus=frozenset({0}))}, lambda: TOTALS)
    served = Served({}, ledger=ledger)
    try:
        assert served.proc.call(f"dev {OTHER_DEV:#x} 3") == ENOTTY  # a made-up device on GPU 3: followed
        assert mem(served.proc, 0x10, 79 * GIB, parent=OTHER_DEV) == REFUSED  # out of memory, nothing charged
        assert mem(served.proc, 0x11, GIB) == LET_THROUGH  # on its own GPU it goes on
        assert dict(ledger.of("t").held) == {0: GIB} and dict(ledger.of("t").refused) == {3: 1}
        assert ledger.charge("b", 3, 2 * GIB) is Verdict.ADMIT
    finally:
        served.close()


@needs_notify
def test_a_tenant_that_may_use_every_gpu_books_there_within_its_cap() -> None:
    """Not pinned, a tenant's booked memory on any GPU counts against the others' reserves there, as its cap allows."""
    ledger = MemoryLedger(lambda: {"t": MemoryTerms(cap=4 * GIB)}, lambda: TOTALS)
    served = Served({}, ledger=ledger)
    try:
        assert served.proc.call(f"dev {OTHER_DEV:#x} 3") == ENOTTY
        assert mem(served.proc, 0x10, 79 * GIB, parent=OTHER_DEV) == REFUSED  # its cap
        assert mem(served.proc, 0x11, 4 * GIB, parent=OTHER_DEV) == LET_THROUGH
        assert dict(ledger.of("t").held) == {3: 4 * GIB}
    finally:
        served.close()


@needs_notify
def test_the_engine_s_terms_pin_a_tenant_without_a_cap_or_a_reserve(tmp_path: Path) -> None:
    """The terms the hooks read carry a pinned tenant's GPUs even when it has no memory limits (without them it
    had no terms, and could book 79 GiB on GPU 3, refusing another tenant's allocations there)."""
    tel = FakeTelemetry([GpuInfo(i, "NVIDIA H200", f"GPU-{i}", 80 * GIB) for i in range(4)])
    rig = Rig(tmp_path, DaemonConfig(slice_ms=50), telemetry=tel)
    rig.engine.register("t", 100, None, (), (0,), 2001, 0, True)
    rig.engine.register("b", 100, None, (), (3,), 2002, 0, True)
    assert rig.engine.memory_terms() == {"t": MemoryTerms(gpus=frozenset({0})), "b": MemoryTerms(gpus=frozenset({3}))}
    ledger = MemoryLedger(rig.engine.memory_terms, rig.engine.gpu_memory_totals)
    served = Served({}, ledger=ledger)
    try:
        assert served.proc.call(f"dev {OTHER_DEV:#x} 3") == ENOTTY
        assert mem(served.proc, 0x10, 79 * GIB, parent=OTHER_DEV) == REFUSED
        assert ledger.charge("b", 3, 2 * GIB) is Verdict.ADMIT
        assert mem(served.proc, 0x11, GIB, parent=DEV) == LET_THROUGH
    finally:
        served.close()
