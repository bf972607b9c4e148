"""What one tenant's hook books take of the daemon's memory at hooks.TENANT_BOUNDS, filled by N listeners together.

    PYTHONPATH=$PWD:$PWD/clients python3 tests/measure_tenant_books.py [N]

Every entry is what a hostile tenant would make it, a distinct object: allocations of 2 MiB under driver-picked
handles (one object and one replayed handle each), devices and subdevices, each graphics object a session of its own,
the rest of the session trees' nodes channels. Measured with tracemalloc; not a test (pytest collects test_*.py).
"""

from __future__ import annotations

import sys
import tracemalloc

from unisched.enforce.nvclasses import NV01_DEVICE_0, NV20_SUBDEVICE_0, RM_ALLOC, SessionKind
from unisched.enforce.seccomp.accounting import SessionBook
from unisched.enforce.seccomp.allowance import Allowance, Entry, Share
from unisched.enforce.seccomp.calls import Call
from unisched.enforce.seccomp.hooks import TENANT_BOUNDS
from unisched.enforce.seccomp.memory import MemoryBook

GRAPHICS, CHANNEL, DEV = 0xCB97, 0xC86F, 0xD000


def fill_memory(book: MemoryBook, roots: list[int], devices: int, allocations: int, owner: tuple[int, str]) -> None:
    per = devices // len(roots)
    for r in roots:
        book.add_device(r, DEV, NV01_DEVICE_0, r, 0, owner)
        for d in range(1, per):
            book.add_device(r, DEV + d, NV20_SUBDEVICE_0, DEV, None, owner)
    for i in range(allocations):
        book.add(roots[i % len(roots)], 0, DEV + i % per, 1 << 21, owner)


def fill_sessions(book: SessionBook, roots: list[int], objects: int, nodes: int, owner: tuple[int, str]) -> None:
    for i in range(objects):
        r = roots[i % len(roots)]
        call = Call(RM_ALLOC, r, r, 0x10_0000 + i, GRAPHICS, SessionKind.GRAPHICS, owner=owner)
        book.needs_decision(call, 1, 0)
        book.commit(call, 1, False, 0)
    for i in range(nodes - objects):
        r = roots[i % len(roots)]
        book.commit(Call(RM_ALLOC, r, r, 0x20_0000 + i, CHANNEL, owner=owner), 1, False, 0)


def main(listeners: int) -> None:
    tracemalloc.start()
    tenant = Allowance("t", TENANT_BOUNDS)
    kept: list[MemoryBook | SessionBook] = []
    memory = 0
    for n in range(listeners):
        part = {kind: bound // listeners for kind, bound in TENANT_BOUNDS.items()}
        owner = (1000 + n, "12345")
        roots = [0xC1D0_0000 + n * 0x10000 + i for i in range(part[Entry.MEMORY_CLIENTS])]
        before = tracemalloc.get_traced_memory()[0]
        mem = MemoryBook(share=Share(tenant))
        fill_memory(mem, roots, part[Entry.DEVICES], part[Entry.ALLOCATIONS], owner)
        memory += tracemalloc.get_traced_memory()[0] - before
        ses = SessionBook("t", 1_000_000_000, share=Share(tenant))
        fill_sessions(ses, roots[:part[Entry.SESSION_CLIENTS]], part[Entry.SESSION_OBJECTS], part[Entry.NODES], owner)
        kept += [mem, ses]
    total = tracemalloc.get_traced_memory()[0]
    assert tenant.used() == dict(TENANT_BOUNDS), tenant.used()
    print(f"{listeners} listener(s) of one tenant, books at the tenant bound: {total / 1e6:.1f} MB "
          f"(memory books {memory / 1e6:.1f}, session books {(total - memory) / 1e6:.1f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
