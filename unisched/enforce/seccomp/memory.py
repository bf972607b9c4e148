"""GPU memory accounting from the RM calls the session hooks see: which allocation holds how many bytes on
which GPU. Pure: no I/O, no clock.

- `MemoryBook`, one per listener (one tenant's processes): RM_ALLOC of NV01_DEVICE_0 / NV20_SUBDEVICE_0 says
  which GPU a handle stands for (deviceId); RM_ALLOC of a video memory class (nvclasses.MEMORY_SIZE_AT) under
  one of them holds its size there; RM_FREE of that handle, of its device or subdevice, or of the whole RM
  client gives it back, and so does the exit of the process that made the client. Objects are keyed by
  (hRoot, handle): RM client handles are unique while the client lives, and a client belongs to the process
  whose (tgid, start time) made it, so a reused pid never inherits another's counts. Threads share their
  process's clients; a forked child that makes its own client has its own (CUDA needs a new context after
  fork), and its exit releases only that. A handle the driver picks (handle 0, and EGL's NVOS32 heap
  allocations) is replayed per client by handles.HandleReplay, so its free is matched too. The book is bounded
  (MAX_CLIENTS and the others below): the calls are the tenant's to make up.
The tenant-wide ledger the books charge and credit is ledger.py.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from unisched.enforce.nvclasses import NV0080_MAX_DEVICES, NV01_DEVICE_0
from unisched.enforce.seccomp.allowance import Entry, Share
from unisched.enforce.seccomp.handles import Budget, HandleReplay, Made

UNKNOWN_GPU: Final = -1
"""The GPU of memory whose parent object was not seen as a device or subdevice (counted there, capped too)."""

# The book's bounds, per listener (each also drawn from its tenant's and its user's allowances, hooks.py). Every RM call is
# the tenant's to write: it may name any hRoot, handle, class, parent and deviceId, and the driver's refusal of a
# made-up one is never seen, so without them one process could grow the root daemon without end. Past each, what
# cannot be booked is refused or followed less closely, never admitted uncounted, so caps and reserves hold. Each
# booked entry belongs to a booked client, and so to the process that made it: the process's exit
# (SessionSupervisor.reconcile) drops them all. At all four bounds the book takes about 70 MB of the daemon's memory
# (measured with tracemalloc: ~450 B a client, ~210 a device, ~230 an allocation, ~90 a replayed handle).
MAX_CLIENTS: Final = 1024
"""RM clients booked. A process using the GPU makes a few (EGL made three on the H200), and those of exited processes
are dropped within seconds. Past it a new client is not booked: its video memory allocations are refused
(NV_ERR_NO_MEMORY, as when the GPU is full), because what is not booked under its process could never be given back
at its exit; its other calls go on unfollowed. A client whose process is not known is not booked either."""
MAX_DEVICES: Final = 16 * MAX_CLIENTS
"""Device and subdevice handles booked: a client makes one of each per GPU it uses (16 on an 8-GPU host). Past it,
a client that could not book one has its memory under parents the book does not know refused: counted on
UNKNOWN_GPU it would escape the caps and reserves of the GPU it is really on."""
MAX_OBJECTS: Final = 200_000
"""Live video memory allocations booked. The H200 EGL trace held tens; PyTorch's caching allocator asks the driver
for 2 MiB or more at a time, and 141 GB of an H200 is 67,000 of those. Past it a new allocation is refused as out of
memory, until frees bring the book below it. Not counted under a key freed only at exit instead: every allocation and
free past the bound would then add to the tenant's count until its own cap refused it, which is worse for an honest
tenant, and each still a book entry."""
MAX_LIVE: Final = 200_000
"""Driver-picked handles replayed (handles.py), for all the book's clients together. Past it the client whose call
found it spent is lost: its driver-picked allocations get keys of their own, counted until it ends."""


@dataclass(frozen=True)
class Held:
    """Bytes one allocation held, given back by a free or an exit (to credit the ledger)."""

    gpu: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Object:
    gpu: int
    nbytes: int
    parent: int


@dataclass(frozen=True)
class BookBounds:
    """A book's bounds (the constants above; smaller ones for tests)."""

    clients: int = MAX_CLIENTS
    devices: int = MAX_DEVICES
    objects: int = MAX_OBJECTS
    live: int = MAX_LIVE


@dataclass(frozen=True)
class BookSize:
    """Entries a book holds, against its bounds."""

    clients: int
    devices: int
    objects: int
    live: int


class Unbooked(StrEnum):
    """Why a video memory allocation cannot be booked, and so is refused (MAX_CLIENTS, MAX_DEVICES, MAX_OBJECTS; the
    TENANT_ ones: the bounds its book shares with the tenant's other listeners, hooks.TENANT_BOUNDS, or with the other
    listeners its non-root user handed over, hooks.USER_BOUNDS)."""

    CLIENT = "client not booked"
    DEVICE = "device not booked"
    OBJECTS = "too many allocations"
    TENANT_CLIENT = "client not booked: the tenant's or its user's bound"
    TENANT_DEVICE = "device not booked: the tenant's or its user's bound"
    TENANT_OBJECTS = "too many allocations for the tenant or its user"
    CARRIED = "a device opened before the daemon restarted"


_DEVICE, _MEMORY = 0, 1
"""The kinds of entry in MemoryBook's index: a device or subdevice handle, a memory object."""


class MemoryBook:
    """One listener's devices and memory objects (module docstring), within its bounds and its allowances' (`share`:
    every client, device, allocation and replayed handle it records is taken from it, and given back when dropped).
    One thread changes it (the supervisor's)."""

    def __init__(self, bounds: BookBounds = BookBounds(), share: Share | None = None,
                 carried_before: int | None = None) -> None:
        """`carried_before`: the book of a listener carried over a restart (transport/carry.py), which saw nothing of
        what processes started before that time (clock ticks since boot, as /proc/PID/stat's start time) made: their
        devices' GPUs and the handles the driver gave them are unknown. Their driver-picked handles are not replayed
        (what they allocate under them stays counted until they end), and their memory under a parent not seen
        being made as a device is refused (Unbooked.CARRIED): counted on UNKNOWN_GPU it would escape the caps and
        reserves of the GPU it is on."""
        self._bounds = bounds
        self._carried_before = carried_before
        self.share = Share() if share is None else share
        self._owners: dict[int, tuple[int, str]] = {}
        self._devices: dict[tuple[int, int], tuple[int, int]] = {}  # (hRoot, handle) -> (gpu, parent)
        self._objects: dict[tuple[int, int], _Object] = {}
        self._under: dict[tuple[int, int], set[tuple[int, int]]] = {}
        """(hRoot, parent) -> the (_DEVICE or _MEMORY, handle) recorded under it; and hRoot -> all of them (`_of_root`):
        a free or an exit touches only what it drops. Found by scanning the book, a device freed in a loop cost
        each time a pass over up to MAX_OBJECTS entries, holding the interpreter (and so the daemon) that long."""
        self._of_root: dict[int, set[tuple[int, int]]] = {}
        self._replays: dict[int, HandleReplay] = {}  # hRoot -> its driver-chosen handles; one per owner
        self._unplaced: dict[int, Unbooked] = {}  # booked clients with a device the book had no room for, and why
        self._sharing: dict[tuple[int, int], set[tuple[int, int]]] = {}
        """Memory objects that name the same memory (an allocation and its RM_DUP_OBJECT copies in this book): each
        one's key -> the one set of them all. One of them carries the bytes; one dropped while others remain hands
        its bytes on (`_drop_object`), so the memory stays charged until its last handle goes, as the driver keeps it."""
        self._budget = Budget(bounds.live, self.share)
        self._synthetic = itertools.count(-1, -1)

    def owners(self) -> dict[int, tuple[int, str]]:
        """hRoot -> (tgid, start time) of the process that made the client, for finding the exited."""
        return dict(self._owners)

    def holds(self, h_root: int) -> bool:
        """Whether a free in client `h_root` may give bytes back."""
        return h_root in self._owners

    def size(self) -> BookSize:
        return BookSize(len(self._owners), len(self._devices), len(self._objects), self._bounds.live - self._budget.left)

    def gpu_of(self, h_root: int, h_parent: int) -> int:
        """The GPU an object made under `h_parent` lives on."""
        found = self._devices.get((h_root, h_parent))
        return UNKNOWN_GPU if found is None else found[0]

    def gpu_held(self, key: tuple[int, int]) -> int:
        """The GPU booked memory object `key` (hRoot, handle) lives on."""
        obj = self._objects.get(key)
        return UNKNOWN_GPU if obj is None else obj.gpu

    def lost(self, h_root: int) -> bool:
        """Whether the driver-chosen handles of client `h_root` can no longer be replayed (handles.py)."""
        replay = self._replays.get(h_root)
        return replay is not None and replay.lost

    def _client(self, h_root: int, owner: tuple[int, str], force: bool = False) -> HandleReplay | None:
        """Client `h_root`'s replay, booking the client on its first call (not a replay per call: this runs on every
        RM_ALLOC); None when it cannot be booked (MAX_CLIENTS, or its process is not known). `force`: its room in the
        shared allowances was asked before (Share.take)."""
        replay = self._replays.get(h_root)
        if replay is None:
            if self._client_refusal(owner) is not None or not self.share.take(Entry.MEMORY_CLIENTS, force=force):
                return None
            self._owners[h_root] = owner
            replay = self._replays[h_root] = HandleReplay(self._budget, lost=self._predates(owner))
        return replay

    def _predates(self, owner: tuple[int, str]) -> bool:
        """Whether process `owner` started before this book's listener was carried over a restart."""
        return self._carried_before is not None and owner[1].isdigit() and int(owner[1]) < self._carried_before

    def handle_for(self, h_root: int, handle: int, h_parent: int, owner: tuple[int, str], force: bool = False) -> int:
        """An allocation about to run with `handle` (0: the driver picks): the handle it will have, replayed
        (a negative key of its own when that cannot be known). Call `untake` if the call never runs. `force`: as
        `_client`'s."""
        replay = self._client(h_root, owner, force)
        if handle:
            if replay is not None:
                replay.note(handle, h_parent)
            return handle
        taken = None if replay is None else replay.take(h_parent)
        return next(self._synthetic) if taken is None else taken

    def made(self, h_root: int, handle: int, h_class: int, h_parent: int, context_share: int | None) -> Made:
        """The children the driver makes inside the allocation of `handle` (from `handle_for`), replayed
        (HandleReplay.made); `unmade` if the call never runs."""
        replay = self._replays.get(h_root)
        if replay is None:
            return Made()
        found = self._devices.get((h_root, h_parent))
        is_device = found is not None and found[1] == h_root  # a subdevice's parent is a device, a device's the client
        return replay.made(h_class, handle, h_parent, context_share, is_device)

    def unmade(self, h_root: int, made: Made) -> None:
        replay = self._replays.get(h_root)
        if replay is not None:
            replay.unmade(made)

    def untake(self, h_root: int, handle: int) -> None:
        """The allocation `handle_for` gave a driver-chosen `handle` never reached the driver."""
        replay = self._replays.get(h_root)
        if replay is not None and handle > 0:
            replay.untake(handle)

    def add_device(self, h_root: int, handle: int, h_class: int, h_parent: int, device_id: int | None,
                   owner: tuple[int, str], gpu: int | None = None) -> list[Held]:
        """Record a device (its deviceId) or subdevice (its device's GPU) handle (from `handle_for`), or with `gpu`
        a copy of one (`dup`). A deviceId the driver refuses (NV0080_MAX_DEVICES) stands for no GPU, so the GPUs
        the ledger keys on stay few."""
        if gpu is None and h_class == NV01_DEVICE_0 and device_id is not None:
            gpu = device_id if device_id < NV0080_MAX_DEVICES else UNKNOWN_GPU
        elif gpu is None:
            gpu = self.gpu_of(h_root, h_parent)
        key = (h_root, handle)
        if self._client(h_root, owner) is None:
            return []
        old = self._devices.get(key)
        if old is None:
            if len(self._devices) >= self._bounds.devices:
                self._unplaced[h_root] = Unbooked.DEVICE
                return []
            if not self.share.take(Entry.DEVICES):
                self._unplaced[h_root] = Unbooked.TENANT_DEVICE
                return []
        else:
            self._unlink(h_root, (_DEVICE, handle), old[1])
        self._devices[key] = (gpu, h_parent)
        self._link(h_root, (_DEVICE, handle), h_parent)
        return []

    def copy_refusal(self, h_root: int, handle: int, h_parent: int, source: tuple[int, int],
                     owner: tuple[int, str]) -> Unbooked | None:
        """Why RM_DUP_OBJECT of `source` into client `h_root` cannot be booked where it must be (None: it may go
        on). A copy of booked memory must be: admitted unbooked, the original's free (or its client's end) would
        give back what the copy still holds. Ask before answering; a refused copy is failed as out of memory."""
        if source not in self._objects or source == (h_root, handle):
            return None
        return self.unbooked(h_root, handle, h_parent, owner)

    def dup(self, h_root: int, handle: int, h_parent: int, source: tuple[int, int],
            owner: tuple[int, str]) -> bool:
        """RM_DUP_OBJECT made `handle` (from `handle_for`) in client `h_root` name what `source` (hClientSrc,
        hObjectSrc) names. A booked device: the copy stands for the same GPU. Booked memory: the copy shares its
        bytes (`_sharing`), so freeing the original while the copy lives gives nothing back (`copy_refusal` said
        it may be booked). Anything else (a source in another process's book, or none, or a handle in use, which
        the driver refuses) is not followed. Whether the copy was recorded (for `undo_copy`)."""
        key = (h_root, handle)
        if key in self._devices or key in self._objects:
            return False  # a handle in use: the driver refuses the copy (what the handle holds stays)
        if source in self._devices:
            self.add_device(h_root, handle, 0, h_parent, None, owner, gpu=self._devices[source][0])
            return key in self._devices
        src = self._objects.get(source)
        if src is None or h_root not in self._owners:
            return False  # nothing followed
        self.share.take(Entry.ALLOCATIONS, force=True)  # `copy_refusal` asked for room
        self._objects[key] = _Object(src.gpu, 0, h_parent)
        self._link(h_root, (_MEMORY, handle), h_parent)
        group = self._sharing.get(source) or {source}
        group.add(key)
        for k in group:
            self._sharing[k] = group
        return True

    def undo_copy(self, h_root: int, handle: int) -> list[Held]:
        """The RM_DUP_OBJECT that `dup` recorded as `handle` never reached the driver: forget the copy."""
        self._drop_device(h_root, handle)
        obj = self._drop_object(h_root, handle)
        return [] if obj is None or not obj.nbytes else [Held(obj.gpu, obj.nbytes)]

    def unbooked(self, h_root: int, handle: int, h_parent: int, owner: tuple[int, str],
                 shared: bool = True) -> Unbooked | None:
        """Why a video memory allocation could not be booked (None: `add` may book it). Ask before charging it.
        `shared`: ask the tenant's and the user's allowances too (their room may be taken by another listener
        meanwhile; the book's own bounds only this thread changes)."""
        if h_root not in self._owners:
            why = self._client_refusal(owner)
            if why is not None or (shared and not self.share.room(Entry.MEMORY_CLIENTS)):
                return why or Unbooked.TENANT_CLIENT
        if h_root in self._unplaced and (h_root, h_parent) not in self._devices:
            return self._unplaced[h_root]
        if self._predates(self._owners.get(h_root, owner)) and (h_root, h_parent) not in self._devices:
            return Unbooked.CARRIED
        if not handle or (h_root, handle) not in self._objects:
            if len(self._objects) >= self._bounds.objects:
                return Unbooked.OBJECTS
            if shared and not self.share.room(Entry.ALLOCATIONS):
                return Unbooked.TENANT_OBJECTS
        return None

    def _client_refusal(self, owner: tuple[int, str]) -> Unbooked | None:
        """Why a new client of process `owner` cannot be booked by this book's own bound (or its process is not
        known, so its exit could never drop it)."""
        return Unbooked.CLIENT if not owner[0] or len(self._owners) >= self._bounds.clients else None

    def add(self, h_root: int, handle: int, h_parent: int, nbytes: int,
            owner: tuple[int, str]) -> tuple[int, int, list[Held]]:
        """Record an admitted allocation that `unbooked` let through; (its GPU, its key handle for `undo`, what a
        stale object of the same handle held). A handle seen again means its earlier allocation failed in the driver
        or its free was not seen: the new one replaces it. Handle 0 (the driver picks one) is replayed
        (`handle_for`). The shared allowances are not asked again: `unbooked` asked them before the charge, and
        another listener taking their last room meanwhile must not leave a charge booked nowhere (Share.take's
        force: a bound overshot by at most one entry per listener)."""
        why = self.unbooked(h_root, handle, h_parent, owner, shared=False)
        if why is not None:
            raise ValueError(f"memory allocation cannot be booked ({why}): refuse it before charging it")
        gpu = self.gpu_of(h_root, h_parent)
        key = (h_root, self.handle_for(h_root, handle, h_parent, owner, force=True))
        stale = self._drop_object(h_root, key[1])
        self.share.take(Entry.ALLOCATIONS, force=True)  # `unbooked` asked for room
        self._objects[key] = _Object(gpu, nbytes, h_parent)
        self._link(h_root, (_MEMORY, key[1]), h_parent)
        return gpu, key[1], [] if stale is None else [Held(stale.gpu, stale.nbytes)]
    def undo(self, h_root: int, key: int, driver_chosen: bool) -> list[Held]:
        """The allocation's caller was gone before the answer: forget it (`key` from `add`; `driver_chosen`:
        its call named handle 0)."""
        if driver_chosen:
            self.untake(h_root, key)
        obj = self._drop_object(h_root, key)
        return [] if obj is None else [Held(obj.gpu, obj.nbytes)]

    def free(self, h_root: int, handle: int) -> list[Held]:
        """RM_FREE of `handle` in client `h_root`: the client, a device or subdevice, or a memory object."""
        if handle == h_root:
            return self.release([h_root])
        if h_root in self._replays:
            self._replays[h_root].free(handle)
        out = []
        obj = self._drop_object(h_root, handle)
        if obj is not None:
            out.append(Held(obj.gpu, obj.nbytes))
        if (h_root, handle) in self._devices:
            gone = {handle} | {h for kind, h in self._under.get((h_root, handle), ()) if kind == _DEVICE}
            for h in gone:
                self._drop_device(h_root, h)
            if h_root in self._replays:
                self._replays[h_root].drop_under(gone)
            for parent in gone:
                for kind, h in list(self._under.get((h_root, parent), ())):
                    o = self._drop_object(h_root, h) if kind == _MEMORY else None
                    if o is not None:
                        out.append(Held(o.gpu, o.nbytes))
        return out

    def release(self, roots: list[int]) -> list[Held]:
        """Forget RM clients (freed, or their process exited) and everything they held."""
        drop = set(roots)
        for r in drop:
            if self._owners.pop(r, None) is not None:
                self.share.give(Entry.MEMORY_CLIENTS)
            self._unplaced.pop(r, None)
            replay = self._replays.pop(r, None)
            if replay is not None:
                replay.close()
        out = []
        for r in drop:
            for kind, h in list(self._of_root.get(r, ())):
                if kind == _DEVICE:
                    self._drop_device(r, h)
                else:
                    o = self._drop_object(r, h)
                    if o is not None:
                        out.append(Held(o.gpu, o.nbytes))
        return out

    def release_all(self) -> list[Held]:
        """Forget everything (the listener ended), and give its tenant back all the book took."""
        out = self.release(list(self._owners) + list(self._of_root))
        self.share.give_all()
        return out

    # --- the index of what each client recorded under each parent ------------------------------------------------
    def _link(self, h_root: int, entry: tuple[int, int], parent: int) -> None:
        self._under.setdefault((h_root, parent), set()).add(entry)
        self._of_root.setdefault(h_root, set()).add(entry)

    def _unlink(self, h_root: int, entry: tuple[int, int], parent: int) -> None:
        under = self._under.get((h_root, parent))
        if under is not None:
            under.discard(entry)
            if not under:
                del self._under[(h_root, parent)]
        mine = self._of_root.get(h_root)
        if mine is not None:
            mine.discard(entry)
            if not mine:
                del self._of_root[h_root]

    def _drop_device(self, h_root: int, handle: int) -> None:
        found = self._devices.pop((h_root, handle), None)
        if found is not None:
            self.share.give(Entry.DEVICES)
            self._unlink(h_root, (_DEVICE, handle), found[1])

    def _drop_object(self, h_root: int, handle: int) -> _Object | None:
        """Forget a memory object; what it held comes back, unless a copy of it lives on (`_sharing`): then its bytes
        go to that copy and it comes back holding none."""
        key = (h_root, handle)
        obj = self._objects.pop(key, None)
        if obj is None:
            return None
        self.share.give(Entry.ALLOCATIONS)
        self._unlink(h_root, (_MEMORY, handle), obj.parent)
        group = self._sharing.pop(key, None)
        if group is None:
            return obj
        group.discard(key)
        heir = next(iter(group))
        if len(group) == 1:
            del self._sharing[heir]
        if obj.nbytes:
            kept = self._objects[heir]
            self._objects[heir] = _Object(kept.gpu, kept.nbytes + obj.nbytes, kept.parent)
        return _Object(obj.gpu, 0, obj.parent)

    def held(self) -> dict[int, int]:
        """Bytes held per GPU."""
        out: collections.Counter[int] = collections.Counter()
        for o in self._objects.values():
            out[o.gpu] += o.nbytes
        return dict(out)
