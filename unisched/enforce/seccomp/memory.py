"""GPU memory accounting from the RM calls the session hooks see: which allocation holds how many bytes on
which GPU, and the tenant-wide ledger the caps and reserves are decided on. Pure: no I/O, no clock.

- `MemoryBook`, one per listener (one tenant's processes): RM_ALLOC of NV01_DEVICE_0 / NV20_SUBDEVICE_0 says
  which GPU a handle stands for (deviceId); RM_ALLOC of a video memory class (nvclasses.MEMORY_SIZE_AT) under
  one of them holds its size there; RM_FREE of that handle, of its device or subdevice, or of the whole RM
  client gives it back, and so does the exit of the process that made the client. Objects are keyed by
  (hRoot, handle): RM client handles are unique while the client lives, and a client belongs to the process
  whose (tgid, start time) made it, so a reused pid never inherits another's counts. Threads share their
  process's clients; a forked child that makes its own client has its own (CUDA needs a new context after
  fork), and its exit releases only that. A handle the driver picks (handle 0, and EGL's NVOS32 heap
  allocations) is replayed per client by handles.HandleReplay, so its free is matched too.
- `MemoryLedger`, shared by every listener: bytes held per tenant and GPU, charged and credited by the books,
  and each allocation admitted or refused by policy.memory.admit_allocation under one lock, so two tenants'
  allocations never both take the last free bytes.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from unisched.enforce.nvclasses import NV01_DEVICE_0
from unisched.enforce.seccomp.handles import MAX_CLIENTS, HandleReplay
from unisched.policy.memory import MemoryTerms, Verdict, admit_allocation

UNKNOWN_GPU: Final = -1
"""The GPU of memory whose parent object was not seen as a device or subdevice (counted there, capped too)."""


@dataclass(frozen=True)
class Held:
    """Bytes one allocation held, given back by a free or an exit (to credit the ledger)."""

    gpu: int
    nbytes: int


@dataclass(frozen=True)
class _Object:
    gpu: int
    nbytes: int
    parent: int


class MemoryBook:
    """One listener's devices and memory objects (module docstring). One thread changes it (the supervisor's)."""

    def __init__(self) -> None:
        self._owners: dict[int, tuple[int, str]] = {}
        self._devices: dict[tuple[int, int], tuple[int, int]] = {}  # (hRoot, handle) -> (gpu, parent)
        self._objects: dict[tuple[int, int], _Object] = {}
        self._replays: dict[int, HandleReplay] = {}  # hRoot -> its driver-chosen handles
        self._synthetic = itertools.count(-1, -1)

    def owners(self) -> dict[int, tuple[int, str]]:
        """hRoot -> (tgid, start time) of the process that made the client, for finding the exited."""
        return dict(self._owners)

    def holds(self, h_root: int) -> bool:
        """Whether a free in client `h_root` may give bytes back."""
        return h_root in self._owners

    def gpu_of(self, h_root: int, h_parent: int) -> int:
        """The GPU an object made under `h_parent` lives on."""
        found = self._devices.get((h_root, h_parent))
        return UNKNOWN_GPU if found is None else found[0]

    def lost(self, h_root: int) -> bool:
        """Whether the driver-chosen handles of client `h_root` can no longer be replayed (handles.py)."""
        replay = self._replays.get(h_root)
        return replay is not None and replay.lost

    def handle_for(self, h_root: int, handle: int, h_parent: int, owner: tuple[int, str]) -> int:
        """An allocation about to run with `handle` (0: the driver picks): the handle it will have, replayed
        (a negative key of its own when that cannot be known). Call `untake` if the call never runs."""
        self._owners.setdefault(h_root, owner)
        replay = self._replay(h_root)
        if handle:
            replay.note(handle, h_parent)
            return handle
        taken = replay.take(h_parent)
        return next(self._synthetic) if taken is None else taken

    def _replay(self, h_root: int) -> HandleReplay:
        """Client `h_root`'s replay, made on its first call (not one per call: this runs on every RM_ALLOC and free);
        a lost one, not kept, past MAX_CLIENTS."""
        replay = self._replays.get(h_root)
        if replay is None:
            if len(self._replays) >= MAX_CLIENTS:
                return HandleReplay(lost=True)
            replay = self._replays[h_root] = HandleReplay()
        return replay

    def untake(self, h_root: int, handle: int) -> None:
        """The allocation `handle_for` gave a driver-chosen `handle` never reached the driver."""
        replay = self._replays.get(h_root)
        if replay is not None and handle > 0:
            replay.untake(handle)

    def add_device(self, h_root: int, handle: int, h_class: int, h_parent: int, device_id: int | None,
                   owner: tuple[int, str]) -> list[Held]:
        """Record a device (its deviceId) or subdevice (its device's GPU) handle (from `handle_for`)."""
        gpu = device_id if h_class == NV01_DEVICE_0 and device_id is not None else self.gpu_of(h_root, h_parent)
        self._owners.setdefault(h_root, owner)
        self._devices[(h_root, handle)] = (gpu, h_parent)
        return []

    def add(self, h_root: int, handle: int, h_parent: int, nbytes: int,
            owner: tuple[int, str]) -> tuple[int, int, list[Held]]:
        """Record an admitted allocation; (its GPU, its key handle for `undo`, what a stale object of the same
        handle held). A handle seen again means its earlier allocation failed in the driver or its free was not
        seen: the new one replaces it. Handle 0 (the driver picks one) is replayed (`handle_for`)."""
        gpu = self.gpu_of(h_root, h_parent)
        key = (h_root, self.handle_for(h_root, handle, h_parent, owner))
        stale = self._objects.pop(key, None)
        self._objects[key] = _Object(gpu, nbytes, h_parent)
        return gpu, key[1], [] if stale is None else [Held(stale.gpu, stale.nbytes)]

    def undo(self, h_root: int, key: int, driver_chosen: bool) -> list[Held]:
        """The allocation's caller was gone before the answer: forget it (`key` from `add`; `driver_chosen`:
        its call named handle 0)."""
        if driver_chosen:
            self.untake(h_root, key)
        obj = self._objects.pop((h_root, key), None)
        return [] if obj is None else [Held(obj.gpu, obj.nbytes)]

    def free(self, h_root: int, handle: int) -> list[Held]:
        """RM_FREE of `handle` in client `h_root`: the client, a device or subdevice, or a memory object."""
        if handle == h_root:
            return self.release([h_root])
        if h_root in self._owners:
            self._replay(h_root).free(handle)
        out = []
        obj = self._objects.pop((h_root, handle), None)
        if obj is not None:
            out.append(Held(obj.gpu, obj.nbytes))
        if (h_root, handle) in self._devices:
            gone = {handle} | {h for (r, h), (_, p) in self._devices.items() if r == h_root and p == handle}
            for h in gone:
                self._devices.pop((h_root, h), None)
            if h_root in self._replays:
                self._replays[h_root].drop_under(gone)
            for key in [k for k, o in self._objects.items() if k[0] == h_root and o.parent in gone]:
                o = self._objects.pop(key)
                out.append(Held(o.gpu, o.nbytes))
        return out

    def release(self, roots: list[int]) -> list[Held]:
        """Forget RM clients (freed, or their process exited) and everything they held."""
        drop = set(roots)
        for r in drop:
            self._owners.pop(r, None)
            self._replays.pop(r, None)
        self._devices = {k: v for k, v in self._devices.items() if k[0] not in drop}
        out = [Held(o.gpu, o.nbytes) for k, o in self._objects.items() if k[0] in drop]
        self._objects = {k: o for k, o in self._objects.items() if k[0] not in drop}
        return out

    def release_all(self) -> list[Held]:
        return self.release(list(self._owners) + [k[0] for k in self._objects])

    def held(self) -> dict[int, int]:
        """Bytes held per GPU."""
        out: collections.Counter[int] = collections.Counter()
        for o in self._objects.values():
            out[o.gpu] += o.nbytes
        return dict(out)


@dataclass(frozen=True)
class TenantMemory:
    """What /metrics and `unisched tenants` show per tenant and GPU."""

    held: Mapping[int, int]
    refused: Mapping[int, int]
    """Allocations refused per GPU (cap or reserves)."""


class MemoryLedger:
    """Bytes held per tenant and GPU, shared by every listener's book (thread-safe).

    `terms()` gives each tenant's MemoryTerms and `totals()` each GPU's size in bytes (GPUs absent: not known,
    caps only); both are read outside the lock on every allocation, so they must be quick and never block.
    """

    def __init__(self, terms: Callable[[], Mapping[str, MemoryTerms]],
                 totals: Callable[[], Mapping[int, int]] = lambda: {}) -> None:
        self._terms = terms
        self._totals = totals
        self._lock = threading.Lock()
        self._held: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._refused: collections.Counter[tuple[str, int]] = collections.Counter()

    def charge(self, tenant: str, gpu: int, nbytes: int) -> Verdict:
        """Admit and count an allocation, or say why not (counted as refused)."""
        terms = self._terms()
        total = self._totals().get(gpu)
        with self._lock:
            held = self._held[gpu]
            verdict = admit_allocation(tenant, gpu, nbytes, held, terms, total)
            if verdict is Verdict.ADMIT:
                held[tenant] += nbytes
            else:
                self._refused[(tenant, gpu)] += 1
            return verdict

    def credit(self, tenant: str, given_back: list[Held]) -> None:
        with self._lock:
            for h in given_back:
                held = self._held[h.gpu]
                held[tenant] = max(0, held[tenant] - h.nbytes)
                if not held[tenant]:
                    del held[tenant]

    def of(self, tenant: str) -> TenantMemory:
        with self._lock:
            held = {gpu: c[tenant] for gpu, c in self._held.items() if c.get(tenant)}
            refused = {gpu: n for (t, gpu), n in self._refused.items() if t == tenant}
        return TenantMemory(held, refused)

    def held_on(self, gpu: int) -> dict[str, int]:
        with self._lock:
            return dict(self._held.get(gpu, {}))
