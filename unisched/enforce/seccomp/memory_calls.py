"""A tenant's video memory calls as the supervisor sees them: charge each allocation to the daemon's ledger or
fail it as the driver does when memory is out, and book devices and frees so memory given back is credited."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Final

import structlog

from unisched.enforce.nvclasses import DEVICE_CLASSES, RM_ALLOC, RM_DUP_OBJECT, RM_FREE, ROOT_CLASSES
from unisched.enforce.seccomp.allowance import Share
from unisched.enforce.seccomp.calls import Call
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.listener import Listener
from unisched.enforce.seccomp.memory import Held, MemoryBook, Unbooked
from unisched.logs import Throttle
from unisched.policy.memory import Verdict

__all__ = ["MemoryCalls"]

log = structlog.get_logger("unisched.seccomp")


REFUSAL_LOG_INTERVAL_S: Final = 1.0
"""At most one info line a second per kind of refusal (a session's kind; memory's reason), saying how many it held
back: a tenant refused in a loop (an app retrying past its cap) would fill the host's log with one line per call.
The counts stay exact in the ledger and the metrics."""


class MemoryCalls:
    """The memory side of ONE tenant's supervisor (serving thread only). Without a ledger, memory is not
    enforced: nothing is charged, booked or credited. `share`: the book's part of its tenant's and its user's allowances."""

    def __init__(self, tenant: str, ledger: MemoryLedger | None, listener: Listener,
                 warn: Callable[[str, str], None], share: Share | None = None,
                 carried_before: int | None = None) -> None:
        self.tenant = tenant
        self.ledger = ledger
        self.book = MemoryBook(share=share, carried_before=carried_before)
        self._listener = listener
        self._warn = warn
        """The supervisor's warn-once (key, message), as its listener's."""
        self.refusal_log = Throttle(REFUSAL_LOG_INTERVAL_S)
        """Refusal lines by reason (REFUSAL_LOG_INTERVAL_S); tests give it a clock."""

    def holds(self, h_root: int) -> bool:
        """Whether memory is enforced and the RM client `h_root` holds booked memory or devices."""
        return self.ledger is not None and self.book.holds(h_root)

    def book_call(self, call: Call, refused: bool) -> None:
        """Devices, frees and the handles other allocations take, in the memory book (video memory allocations
        are booked by `conclude`). A `refused` call never reaches the driver: nothing to book."""
        if self.ledger is None or refused:
            return
        if call.op == RM_FREE:
            was_lost = self.book.lost(call.h_root)
            self.credit(self.book.free(call.h_root, call.handle))
            if not was_lost and self.book.lost(call.h_root):
                log.warning("gpu memory: cannot follow the handles the driver picks for an RM client any more; "
                            "what it allocates under them stays counted until it ends", tenant=self.tenant,
                            h_root=f"{call.h_root:#x}", handle=f"{call.handle:#x}")
        elif call.op == RM_DUP_OBJECT or (call.op == RM_ALLOC and call.h_class not in ROOT_CLASSES):
            handle = self.book.handle_for(call.h_root, call.handle, call.h_parent, call.owner or (0, ""))
            if not call.handle:
                call.replayed = handle
            if call.op == RM_DUP_OBJECT:
                call.copied = self.book.dup(call.h_root, handle, call.h_parent, call.source, call.owner or (0, ""))
            elif call.h_class in DEVICE_CLASSES:
                self.book.add_device(call.h_root, handle, call.h_class, call.h_parent, call.device_id,
                                     call.owner or (0, ""))
            elif call.context_share is not None:
                call.made = self.book.made(call.h_root, handle, call.h_class, call.h_parent, call.context_share)

    def unbook_call(self, call: Call) -> None:
        """`book_call`'s call never reached the driver (its caller was gone before the answer)."""
        if call.copied:
            self.credit(self.book.undo_copy(call.h_root, call.replayed or call.handle))
        self.book.unmade(call.h_root, call.made)  # (nothing to undo for an empty Made)
        if call.replayed:
            self.book.untake(call.h_root, call.replayed)

    def credit(self, given_back: list[Held]) -> None:
        if self.ledger is not None and given_back:
            self.ledger.credit(self.tenant, given_back)

    def release(self, roots: list[int]) -> None:
        """Credit what the RM clients `roots` held (their processes exited)."""
        self.credit(self.book.release(roots))

    def release_all(self) -> None:
        self.credit(self.book.release_all())

    def conclude(self, nid: int, pid: int, call: Call) -> bool:
        """A video memory allocation: charge it to the tenant, or fail it as the driver does when memory is out.
        Whether the call was answered (False: it was gone).

        Admitted: booked before the caller resumes, then "continue". Refused: NV_ERR_NO_MEMORY is written into
        the call's status field and the ioctl answered 0 without running, which is what the driver returns for
        an allocation it cannot place, so CUDA reports cudaErrorMemoryAllocation (PyTorch OutOfMemoryError), the GL
        driver places the texture in system memory, and a decoder fails to open (docs/design/memory.md); where the
        status cannot be written, the call fails with ENOMEM instead.
        """
        assert self.ledger is not None and call.mem_bytes is not None
        owner = call.owner or (0, "")
        gpu = self.book.gpu_of(call.h_root, call.h_parent)
        why = self._refusal(gpu, call.h_root, call.handle, call.h_parent, call.mem_bytes, owner)
        if why is None:
            try:
                gpu, key, stale = self.book.add(call.h_root, call.handle, call.h_parent, call.mem_bytes, owner)
            except BaseException:  # charged but booked nowhere: nothing would ever credit it
                self.credit([Held(gpu, call.mem_bytes)])
                raise
            self.credit(stale)
            answered = self._listener.answer(nid, 0)
            if not answered:
                self.credit(self.book.undo(call.h_root, key, driver_chosen=not call.handle))
        else:
            answered = self._refuse(nid, pid, call, why, gpu)
        return answered

    def copy_refusal(self, call: Call) -> Unbooked | None:
        """Why RM_DUP_OBJECT `call`, a copy of booked video memory, cannot be booked (MemoryBook.copy_refusal; None: it
        goes on as other calls do). Such a copy is refused (`refuse_copy`) as an allocation past the bounds is."""
        if self.ledger is None:
            return None
        return self.book.copy_refusal(call.h_root, call.handle, call.h_parent, call.source, call.owner or (0, ""))

    def refuse_copy(self, nid: int, pid: int, call: Call, why: Unbooked) -> bool:
        """Fail the copy `copy_refusal` refused, as out of memory. Whether it was answered."""
        gpu = self.book.gpu_held(call.source)
        self._unbookable(gpu, why)
        return self._refuse(nid, pid, call, why, gpu)

    def _unbookable(self, gpu: int, why: Unbooked) -> None:
        """Count a refusal past the book's bounds; the first one warns."""
        assert self.ledger is not None
        self.ledger.refuse(self.tenant, gpu)
        if why is Unbooked.CARRIED:
            self._warn("carried", "gpu memory: an allocation under a GPU device opened before the daemon restarted was "
                       "refused as out of memory (which GPU it is on is not known, so its caps and reserves cannot be "
                       "held); restart the process to have its memory followed again; later ones are logged at debug")
            return
        self._warn("memory", "gpu memory: an allocation the book cannot record (its bounds, its tenant's or its user's, or a "
                   "process not known) was refused as out of memory; later ones are logged at debug "
                   f"({why.value}; {self.book.size()})")

    def _refuse(self, nid: int, pid: int, call: Call, why: Verdict | Unbooked, gpu: int) -> bool:
        """Fail the call as the driver does when memory is out (its status NV_ERR_NO_MEMORY, the ioctl not run; ENOMEM
        where the status cannot be written), and log it. Whether it was answered."""
        written = self._listener.write_status(nid, pid, call.status_at)
        answered = self._listener.answer(nid, 0 if written else -errno.ENOMEM, run=False)
        if answered:  # past the book's bounds, a flood may be on: the warning said it once
            held = None if isinstance(why, Unbooked) else self.refusal_log.allow(why.value)
            (log.debug if held is None else log.info)(
                "gpu memory allocation refused", tenant=self.tenant, gpu=gpu, bytes=call.mem_bytes, why=why.value, pid=pid,
                held_back=held or 0)
        return answered

    def _refusal(self, gpu: int, h_root: int, handle: int, h_parent: int, nbytes: int,
                 owner: tuple[int, str]) -> Verdict | Unbooked | None:
        """Charge the allocation, or say why it is refused: the book cannot record it (memory.MAX_OBJECTS and the
        other bounds, the listener's, its tenant's or its user's; refused uncharged, since admitted uncounted it would escape the
        caps), or the ledger's verdict."""
        assert self.ledger is not None
        unbooked = self.book.unbooked(h_root, handle, h_parent, owner)
        if unbooked is not None:
            self._unbookable(gpu, unbooked)
            return unbooked
        verdict = self.ledger.charge(self.tenant, gpu, nbytes)
        return None if verdict is Verdict.ADMIT else verdict
