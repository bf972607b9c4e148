"""examine.read_call: a notified call's argument read from its caller's memory, with process_vm_readv (one system
call a read) or, where that is refused or cannot read it, /proc/PID/mem; what neither can read is Call(0) marked
unreadable (the supervisor fails it), a caller gone or memory the daemon may not read Call(0), nothing to track.
The caller here is this test's own process, its arguments in buffers of its own."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from unisched.enforce.nvclasses import NVOS00_SIZE, RM_FREE
from unisched.enforce.seccomp import proc
from unisched.enforce.seccomp.calls import Call
from unisched.enforce.seccomp.examine import read_call

FREE = (RM_FREE, NVOS00_SIZE)
WORDS = (0xC1D00001, 0xC1D00001, 0xCAFE)
"""hRoot, hObjectParent, hObjectOld of an RM_FREE"""
LIBC = ctypes.CDLL(None, use_errno=True)


class Warnings:
    """The supervisor's warn-once, as the keys it was told."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, key: str, message: str) -> None:
        self.keys.append(key)


def argument(words: tuple[int, ...]) -> tuple[ctypes.Array[ctypes.c_char], int]:
    """A buffer of ours holding `words`, and its address (keep the buffer while the address is read)."""
    buf = ctypes.create_string_buffer(NVOS00_SIZE)
    ctypes.memmove(buf, (ctypes.c_uint32 * len(words))(*words), 4 * len(words))
    return buf, ctypes.addressof(buf)


class FakeVmReadv:
    """Stands in for libc's process_vm_readv: fails with `err`, counting its calls."""

    def __init__(self, err: int) -> None:
        self.err = err
        self.calls = 0

    def __call__(self, *args: object) -> int:
        self.calls += 1
        ctypes.set_errno(self.err)
        return -1


@pytest.fixture
def no_proc_mem(monkeypatch: pytest.MonkeyPatch) -> Callable[[type[OSError]], list[str]]:
    """Make opening /proc/PID/mem fail with the given error; the paths tried."""

    def refuse(error: type[OSError]) -> list[str]:
        tried: list[str] = []
        real_open = os.open

        def opener(path: str, flags: int, *args: int) -> int:
            if path.startswith("/proc/") and path.endswith("/mem"):
                tried.append(path)
                raise error(errno.EACCES, "refused by the test")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", opener)
        return tried

    return refuse


@pytest.fixture
def vm_readv(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], FakeVmReadv]:
    """Put a failing process_vm_readv in libc's place (restored after the test, forgone or not)."""

    def fake(err: int) -> FakeVmReadv:
        fn = FakeVmReadv(err)
        monkeypatch.setattr(proc, "_vm_readv", fn)
        return fn

    return fake


def test_a_call_is_read_with_process_vm_readv_without_opening_proc_mem(
        no_proc_mem: Callable[[type[OSError]], list[str]]) -> None:
    tried = no_proc_mem(PermissionError)
    warned = Warnings()
    _buf, addr = argument(WORDS)
    assert read_call(os.getpid(), FREE, addr, warned) == Call(RM_FREE, *WORDS)
    assert tried == [] and warned.keys == []


def test_where_the_kernel_has_no_process_vm_readv_proc_mem_reads_every_call(
        vm_readv: Callable[[int], FakeVmReadv]) -> None:
    fake = vm_readv(errno.ENOSYS)
    _buf, addr = argument(WORDS)
    for _ in range(2):
        assert read_call(os.getpid(), FREE, addr, Warnings()) == Call(RM_FREE, *WORDS)
    assert fake.calls == 1 and not proc.vm_readv_usable()  # not tried again


def test_process_vm_readv_refused_is_read_through_proc_mem_call_by_call(
        vm_readv: Callable[[int], FakeVmReadv]) -> None:
    """EPERM may be a policy on the system call (a container runtime's seccomp profile without CAP_SYS_PTRACE) or
    the tenant's own doing (its dumpability, which it may change between two reads): each call falls back alone,
    and a tenant cannot turn process_vm_readv off for the others."""
    fake = vm_readv(errno.EPERM)
    _buf, addr = argument(WORDS)
    for _ in range(2):
        assert read_call(os.getpid(), FREE, addr, Warnings()) == Call(RM_FREE, *WORDS)
    assert fake.calls == 2 and proc.vm_readv_usable()


def test_memory_process_vm_readv_cannot_pin_is_read_through_proc_mem() -> None:
    """process_vm_readv pins pages and so cannot read a device's VM_IO|VM_PFNMAP mapping, which /proc/PID/mem reads
    through the mapping's own access (the NVIDIA driver's mmap of video memory has one). A PROT_NONE page stands in:
    process_vm_readv fails on it, /proc/PID/mem reads it (FOLL_FORCE)."""
    page = mmap.PAGESIZE
    LIBC.mmap.restype = ctypes.c_void_p
    LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    at = LIBC.mmap(None, page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    try:
        ctypes.memmove(at, (ctypes.c_uint32 * 3)(*WORDS), 12)
        assert LIBC.mprotect(at, page, 0) == 0  # PROT_NONE
        with pytest.raises(OSError):
            proc.read_vm(os.getpid(), at, 12)
        assert read_call(os.getpid(), FREE, at, Warnings()) == Call(RM_FREE, *WORDS)
    finally:
        LIBC.munmap(at, page)


def test_memory_the_daemon_may_not_read_either_way_warns_and_lets_the_call_continue(
        vm_readv: Callable[[int], FakeVmReadv], no_proc_mem: Callable[[type[OSError]], list[str]]) -> None:
    vm_readv(errno.EPERM)
    tried = no_proc_mem(PermissionError)
    warned = Warnings()
    _buf, addr = argument(WORDS)
    assert read_call(os.getpid(), FREE, addr, warned) == Call(0)
    assert warned.keys == ["mem"] and tried == [f"/proc/{os.getpid()}/mem"]
    assert proc.vm_readv_usable()  # a right the daemon lacks, not a policy on the call: tried again next time


def test_a_caller_outside_the_daemons_pid_namespace_warns_and_continues() -> None:
    warned = Warnings()
    _buf, addr = argument(WORDS)
    assert read_call(0, FREE, addr, warned) == Call(0)
    assert warned.keys == ["pid0"]


@pytest.mark.parametrize("through", ["process_vm_readv", "proc_mem"])
def test_another_process_s_argument_is_read(through: str, vm_readv: Callable[[int], FakeVmReadv]) -> None:
    """The daemon reads its tenants, not itself: another process's memory, past the kernel's ptrace check."""
    if os.geteuid() != 0:
        pytest.skip("reading another process's memory needs root (CAP_SYS_PTRACE), as the daemon runs")
    if through == "proc_mem":
        vm_readv(errno.ENOSYS)
    program = ("import ctypes, sys\n"
               f"buf = (ctypes.c_uint32 * 3)(*{WORDS!r})\n"
               "print(ctypes.addressof(buf), flush=True)\n"
               "sys.stdin.read()\n")
    with subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        try:
            assert child.stdout is not None
            addr = int(child.stdout.readline())
            warned = Warnings()
            assert read_call(child.pid, FREE, addr, warned) == Call(RM_FREE, *WORDS)
            assert warned.keys == []
            if through == "process_vm_readv":  # (not through the fallback)
                assert proc.read_vm(child.pid, addr, 12) == struct.pack("=III", *WORDS)
        finally:
            child.kill()


@pytest.mark.parametrize("through", ["process_vm_readv", "proc_mem"])
def test_a_caller_gone_already_is_nothing_to_track(through: str, vm_readv: Callable[[int], FakeVmReadv]) -> None:
    if through == "proc_mem":
        vm_readv(errno.ENOSYS)
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait(30)
    warned = Warnings()
    _buf, addr = argument(WORDS)
    assert read_call(child.pid, FREE, addr, warned) == Call(0)
    assert warned.keys == []


@pytest.fixture
def straddling() -> Iterator[int]:
    """The address of an RM_FREE argument whose last word lies past the end of a mapping (the next page unmapped)."""
    page = mmap.PAGESIZE
    LIBC.mmap.restype = ctypes.c_void_p
    LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base = LIBC.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    assert LIBC.munmap(base + page, page) == 0
    addr = base + page - 8  # hRoot and hObjectParent mapped, hObjectOld not
    ctypes.memmove(addr, (ctypes.c_uint32 * 2)(*WORDS[:2]), 8)
    try:
        yield addr
    finally:
        LIBC.munmap(base, page)


@pytest.mark.parametrize("through", ["process_vm_readv", "proc_mem"])
def test_an_argument_read_in_part_is_unreadable(through: str, straddling: int,
                                                 vm_readv: Callable[[int], FakeVmReadv]) -> None:
    if through == "proc_mem":
        vm_readv(errno.ENOSYS)
    warned = Warnings()
    assert read_call(os.getpid(), FREE, straddling, warned) == Call(0, unreadable=True)
    assert warned.keys == []


def test_a_read_of_a_bad_or_partly_mapped_address_raises_what_decoding_takes_for_unreadable(straddling: int) -> None:
    with pytest.raises(ValueError, match="short read"):
        proc.read_vm(os.getpid(), straddling, 12)
    with pytest.raises(ValueError, match="bad user address"):
        proc.read_vm(os.getpid(), 0, 12)
    with pytest.raises(OSError) as gone:
        proc.read_vm(os.getpid(), straddling + 8, 4)  # nothing of it mapped
    assert gone.value.errno == errno.EFAULT
