"""Helper process for tests/test_seccomp.py (not a test module).

  seccomp_child.py tenant SOCKFD|PATH|-
                                   install the GPU session filter, hand the listener over the inherited socket
                                   SOCKFD (OCI agent message, as runc does) or to the agent socket at PATH
                                   (hand_over, as `unisched run` does; prints "refused ..." if the agent says no),
                                   or (-) neither, as the command of `unisched run`, which did both;
                                   print "ready", then run commands from stdin, one reply line each:
                                   "ok ERRNO [extra]" (ERRNO 0 = the call succeeded)
  seccomp_child.py foreign-getppid|foreign-control SOCKFD
                                   as tenant SOCKFD, behind a filter that is not the daemon's: the GPU session
                                   filter that also notifies getppid(), or 'F'/RM_CONTROL (0x2A) ioctls
  seccomp_child.py hold SOCKFD     a stand-in daemon: receive a listener, print "ready", receive one
                                   notification without ever answering it, print "got", then sleep

Tenant commands (numbers accept 0x...): alloc CLASS HANDLE [SIZE [ROOT]] | alloc_eng CLASS HANDLE INSTANCE |
churn_eng CLASS HANDLE N (alloc_eng CLASS HANDLE on instances 1..N in turn, each freed; extra = how many failed
with EPERM) | thread_alloc CLASS HANDLE (alloc on a thread of its own: its reply comes when the call returns, the
commands after it run meanwhile) | xalloc CLASS HANDLE |
alloc_sx CLASS HANDLE (request sign-extended to 64 bits, as musl does) | free HANDLE [ROOT] | xfree HANDLE |
fionread |
unreadable 0|1|2 (an argument, or parameters, nobody else can read) | fork_alloc CLASS HANDLE ROOT | bench N CLASS |
bench_plain N | getppid | control | exit.
dup PARENT HANDLE SOURCE | xdup PARENT HANDLE SOURCE (RM_DUP_OBJECT into our client; HANDLE 0: the driver picks).
aobj CLASS HANDLE (RM_ALLOC_OBJECT) | amem PARENT HANDLE BYTES [CLASS] (RM_ALLOC_MEMORY; extra: the status field).
Memory: dev HANDLE DEVICEID [ROOT] (NV01_DEVICE_0) | mem PARENT HANDLE BYTES [ROOT [SIZE]] (NV01_MEMORY_LOCAL_USER;
"ok ERRNO STATUS", STATUS the status field after the call) | xmem PARENT HANDLE BYTES (through XFER) |
threads_mem N PARENT BYTES FIRST (N threads at once, handles FIRST..; extra = how many were let through) |
fork_mem DEVICEID BYTES ROOT (a child makes client ROOT with a device and BYTES of memory and exits; extra = its pid).
The RM calls go to /dev/null, standing in for /dev/nvidiactl: when let through they fail there with ENOTTY.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import select
import socket
import struct
import sys
import termios
import time

ROOT_HANDLE = 0xC1D00001
RM_ALLOC, RM_FREE, XFER, VID_HEAP, DUP, ALLOC_OBJECT, ALLOC_MEMORY = 0x2B, 0x29, 0xD3, 0x4A, 0x34, 0x28, 0x27
RM_CONTROL = 0x2A
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_IOCTL_NR = {"x86_64": 16, "aarch64": 29}[platform.machine()]
_GETPPID_NR = {"x86_64": 110, "aarch64": 173}[platform.machine()]


def iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


def ioctl(fd: int, cmd: int, buf: ctypes.Array[ctypes.c_char] | None, sign_extend: bool = False) -> int:
    addr = ctypes.addressof(buf) if buf is not None else 0
    if sign_extend:
        request = cmd | 0xFFFFFFFF00000000 if cmd & 0x80000000 else cmd
        ret = _libc.syscall(ctypes.c_long(_IOCTL_NR), ctypes.c_long(fd), ctypes.c_ulong(request), ctypes.c_void_p(addr))
    else:
        ret = _libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(cmd), ctypes.c_void_p(addr))
    return ctypes.get_errno() if ret < 0 else 0


def nvos21(h_class: int, handle: int, root: int = ROOT_HANDLE, size: int = 32) -> ctypes.Array[ctypes.c_char]:
    buf = ctypes.create_string_buffer(size)
    struct.pack_into("=IIII", buf, 0, root, root, handle, h_class)
    return buf


def nvos00(handle: int, root: int = ROOT_HANDLE) -> ctypes.Array[ctypes.c_char]:
    buf = ctypes.create_string_buffer(16)
    struct.pack_into("=IIII", buf, 0, root, root, handle, 0)
    return buf


def xfer(inner_nr: int, inner: ctypes.Array[ctypes.c_char]) -> ctypes.Array[ctypes.c_char]:
    buf = ctypes.create_string_buffer(16)
    struct.pack_into("=IIQ", buf, 0, inner_nr, len(inner), ctypes.addressof(inner))
    return buf


def mem_call(dev: int, parent: int, handle: int, nbytes: int, root: int = ROOT_HANDLE, size: int = 32,
             h_class: int = 0x40, at: int = 64, through_xfer: bool = False) -> tuple[int, int]:
    """RM_ALLOC of `h_class` with `nbytes` at `at` of its parameters: (errno, the status field afterwards)."""
    params = ctypes.create_string_buffer(160)
    struct.pack_into("=Q", params, at, nbytes)
    buf = nvos21(h_class, handle, root, size)
    struct.pack_into("=IIIQ", buf, 4, parent, handle, h_class, ctypes.addressof(params))
    struct.pack_into("=I", buf, 24 if size == 32 else 32, len(params))
    err = ioctl(dev, iowr(XFER, 16), xfer(RM_ALLOC, buf)) if through_xfer else ioctl(dev, iowr(RM_ALLOC, size), buf)
    return err, struct.unpack_from("=I", buf, 28 if size == 32 else 40)[0]


def unreadable_call(dev: int, how: int) -> int:
    """A call whose memory no reader from outside this process can read: 0, an RM_FREE whose argument lies in an
    unmapped page; 1, a 1 GiB video memory RM_ALLOC whose parameters do; 2, whose parameters lie in memfd_secret's
    memory (mapped here, so the driver's copy_from_user reads it; hidden from process_vm_readv and /proc/PID/mem).
    ENOSYS where memfd_secret is not there."""
    page = 4096
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    if how == 2:
        fd = _libc.syscall(ctypes.c_long(447), ctypes.c_long(0))  # memfd_secret (x86_64, aarch64)
        if fd < 0 or os.ftruncate(fd, page) is not None:
            return errno.ENOSYS
        at = _libc.mmap(None, page, 3, 0x01, fd, 0)  # PROT_READ|PROT_WRITE, MAP_SHARED
        if at in (None, ctypes.c_void_p(-1).value):
            return errno.ENOSYS
    else:
        at = _libc.mmap(None, page, 3, 0x22, -1, 0)  # MAP_PRIVATE | MAP_ANONYMOUS, then unmapped
        _libc.munmap(ctypes.c_void_p(at), ctypes.c_size_t(page))
    if how == 0:
        return ioctl(dev, iowr(RM_FREE, 16), (ctypes.c_char * 16).from_address(at))
    if how == 2:
        struct.pack_into("=Q", (ctypes.c_char * page).from_address(at), 64, 1 << 30)
    buf = nvos21(0x40, 0x77, ROOT_HANDLE, 32)
    struct.pack_into("=IIIQ", buf, 4, 0x10, 0x77, 0x40, at)
    struct.pack_into("=I", buf, 24, 160)
    return ioctl(dev, iowr(RM_ALLOC, 32), buf)


def heap_call(dev: int, function: int, parent: int, handle: int, nbytes: int, flags: int, attr: int) -> tuple[int, int]:
    """RM_VID_HEAP_CONTROL (NVOS32, 184 bytes): an ALLOC_SIZE (function 2) of `nbytes` with `flags` and `attr`, or
    a FREE (3) of `handle`; (errno, the status field afterwards)."""
    buf = ctypes.create_string_buffer(184)
    struct.pack_into("=III", buf, 0, ROOT_HANDLE, parent, function)
    if function == 3:
        struct.pack_into("=II", buf, 44, handle, flags)
    else:
        struct.pack_into("=II", buf, 44, handle, 0)
        struct.pack_into("=II", buf, 52, flags, attr)
        struct.pack_into("=Q", buf, 88, nbytes)
    err = ioctl(dev, iowr(VID_HEAP, 184), buf)
    return err, struct.unpack_from("=I", buf, 20)[0]


def threads_mem(dev: int, n: int, parent: int, nbytes: int, first: int) -> int:
    """N threads allocate at once (a barrier lines them up); how many were let through (ENOTTY)."""
    import threading

    barrier = threading.Barrier(n)
    results: list[int] = []

    def one(i: int) -> None:
        barrier.wait()
        results.append(mem_call(dev, parent, first + i, nbytes)[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(1 for r in results if r == 25)


def engine_call(dev: int, h_class: int, handle: int, instance: int) -> int:
    """RM_ALLOC of a video engine object with NV_BSP_ALLOCATION_PARAMETERS {size, prohibit, engineInstance}."""
    params = ctypes.create_string_buffer(12)
    struct.pack_into("=III", params, 0, 12, 0, instance)
    buf = nvos21(h_class, handle)
    struct.pack_into("=Q", buf, 16, ctypes.addressof(params))
    return ioctl(dev, iowr(RM_ALLOC, 32), buf)


def device_call(dev: int, handle: int, device_id: int, root: int = ROOT_HANDLE) -> int:
    params = ctypes.create_string_buffer(struct.pack("=III", device_id, 0, 0), 64)
    buf = nvos21(0x80, handle, root)
    struct.pack_into("=Q", buf, 16, ctypes.addressof(params))
    struct.pack_into("=I", buf, 24, len(params))
    return ioctl(dev, iowr(RM_ALLOC, 32), buf)


def foreign_program(what: str) -> bytes:
    """A filter that is not the daemon's: its program, after getppid() notified first (not even an ioctl); or its
    program with 'F'/RM_CONTROL notified too (an escape the daemon's never sends)."""
    from unisched.enforce.seccomp.abi import DATA_OFF_NR, SECCOMP_RET_USER_NOTIF
    from unisched.enforce.seccomp.filter import build_filter

    if what == "control":
        return build_filter(extra=(RM_CONTROL,))
    ld_nr = struct.pack("=HBBI", 0x20, 0, 0, DATA_OFF_NR)  # BPF_LD|W|ABS nr
    is_getppid = struct.pack("=HBBI", 0x15, 0, 1, _GETPPID_NR)  # JEQ: notify, else skip to the filter's program
    notify = struct.pack("=HBBI", 0x06, 0, 0, SECCOMP_RET_USER_NOTIF)
    return ld_nr + is_getppid + notify + build_filter()


def tenant(where: str, program: bytes | None = None) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from unisched.enforce.seccomp.abi import SeccompError
    from unisched.enforce.seccomp.filter import install_filter
    from unisched.enforce.seccomp.handover import hand_over, make_agent_message, send_fd

    if where == "-":  # already behind the filter: `unisched run` installed it and handed the listener over
        pass
    elif where.isdigit():  # an inherited socket: send and close, as runc does
        listener = install_filter(program)
        with socket.socket(fileno=int(where)) as sock:
            send_fd(sock, listener, make_agent_message(os.getpid(), metadata="test"))
        os.close(listener)  # never keep our own listener: a call notified to it would wait for ourselves
    else:  # an agent socket path: what `unisched run`'s child does before exec
        listener = install_filter()
        try:
            hand_over(listener, where, metadata="test")
        except SeccompError as e:
            print(f"refused {e}", flush=True)
            raise SystemExit(3) from None
    dev = os.open("/dev/null", os.O_RDWR)
    pipe_r, pipe_w = os.pipe()
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        op, nums = words[0], [int(w, 0) for w in words[1:]]
        extra = ""
        if op == "alloc":
            size = nums[2] if len(nums) > 2 else 32
            root = nums[3] if len(nums) > 3 else ROOT_HANDLE
            err = ioctl(dev, iowr(RM_ALLOC, size), nvos21(nums[0], nums[1], root, size))
        elif op == "alloc_eng":  # a video engine object with NV_BSP_ALLOCATION_PARAMETERS {size, prohibit, instance}
            err = engine_call(dev, nums[0], nums[1], nums[2])
        elif op == "churn_eng":
            err, refused = 0, 0
            for instance in range(1, nums[2] + 1):
                refused += engine_call(dev, nums[0], nums[1], instance) == errno.EPERM
                ioctl(dev, iowr(RM_FREE, 16), nvos00(nums[1]))
            extra = str(refused)
        elif op == "thread_alloc":
            import threading

            def alloc_apart(h_class: int, handle: int) -> None:
                err = ioctl(dev, iowr(RM_ALLOC, 32), nvos21(h_class, handle))
                out.write(f"ok {err}\n")
                out.flush()

            threading.Thread(target=alloc_apart, args=(nums[0], nums[1])).start()
            continue
        elif op == "alloc_sx":
            err = ioctl(dev, iowr(RM_ALLOC, 32), nvos21(nums[0], nums[1]), sign_extend=True)
        elif op == "aobj":  # RM_ALLOC_OBJECT (NVOS05): CLASS HANDLE
            buf = ctypes.create_string_buffer(20)
            struct.pack_into("=IIII", buf, 0, ROOT_HANDLE, ROOT_HANDLE, nums[1], nums[0])
            err = ioctl(dev, iowr(ALLOC_OBJECT, 20), buf)
        elif op == "amem":  # RM_ALLOC_MEMORY (NVOS02 with an fd): PARENT HANDLE BYTES [CLASS]
            buf = ctypes.create_string_buffer(56)
            h_class = nums[3] if len(nums) > 3 else 0x40
            struct.pack_into("=IIIII4xQQ", buf, 0, ROOT_HANDLE, nums[0], nums[1], h_class, 0, 0, nums[2] - 1)
            err = ioctl(dev, iowr(ALLOC_MEMORY, 56), buf)
            extra = str(struct.unpack_from("=I", buf, 40)[0])
        elif op == "xalloc":
            inner = nvos21(nums[0], nums[1])
            err = ioctl(dev, iowr(XFER, 16), xfer(RM_ALLOC, inner))
        elif op == "free":
            root = nums[1] if len(nums) > 1 else ROOT_HANDLE
            err = ioctl(dev, iowr(RM_FREE, 16), nvos00(nums[0], root))
        elif op == "xfree":
            inner = nvos00(nums[0])
            err = ioctl(dev, iowr(XFER, 16), xfer(RM_FREE, inner))
        elif op == "dev":
            err = device_call(dev, nums[0], nums[1], *nums[2:3])
        elif op in ("mem", "xmem"):
            root = nums[3] if len(nums) > 3 else ROOT_HANDLE
            size = nums[4] if len(nums) > 4 else 32
            err, status = mem_call(dev, nums[0], nums[1], nums[2], root, size, through_xfer=op == "xmem")
            extra = str(status)
        elif op == "chan":  # a channel group or channel (NV_CHANNEL_ALLOC_PARAMS): CLASS PARENT HANDLE CONTEXT_SHARE
            err, _status = mem_call(dev, nums[1], nums[2], nums[3], h_class=nums[0], at=24)
        elif op in ("dup", "xdup"):  # RM_DUP_OBJECT (NVOS55) into our client: parent handle source
            buf = ctypes.create_string_buffer(28)
            struct.pack_into("=IIIII", buf, 0, ROOT_HANDLE, nums[0], nums[1], ROOT_HANDLE, nums[2])
            err = ioctl(dev, iowr(XFER, 16), xfer(DUP, buf)) if op == "xdup" else ioctl(dev, iowr(DUP, 28), buf)
        elif op == "heap":  # function parent handle nbytes flags attr
            err, status = heap_call(dev, *nums[:6])
            extra = str(status)
        elif op == "threads_mem":
            err, extra = 0, str(threads_mem(dev, *nums[:4]))
        elif op == "fork_mem":
            child = os.fork()
            if child == 0:
                device_call(dev, 0xD0, nums[0], nums[2])
                os._exit(mem_call(dev, 0xD0, 0xD1, nums[1], nums[2])[0])
            _, status = os.waitpid(child, 0)
            err = os.waitstatus_to_exitcode(status)
            extra = str(child)
        elif op == "getppid":
            err = ctypes.get_errno() if _libc.syscall(ctypes.c_long(_GETPPID_NR)) < 0 else 0
        elif op == "control":
            err = ioctl(dev, iowr(RM_CONTROL, 32), nvos21(0, 0))
        elif op == "unreadable":  # 0|1|2
            err = unreadable_call(dev, nums[0])
        elif op == "fionread":
            n = ctypes.create_string_buffer(4)
            err = ioctl(pipe_r, termios.FIONREAD, n)
        elif op == "fork_alloc":
            child = os.fork()
            if child == 0:
                os._exit(ioctl(dev, iowr(RM_ALLOC, 32), nvos21(nums[0], nums[1], nums[2])))
            _, status = os.waitpid(child, 0)
            err = os.waitstatus_to_exitcode(status)
            extra = str(child)
        elif op in ("bench", "bench_plain"):
            buf = nvos21(nums[1] if op == "bench" else 0, 0x5000)
            n = ctypes.create_string_buffer(4)
            err, t0 = 0, time.perf_counter_ns()
            for _ in range(nums[0]):
                err = ioctl(dev, iowr(RM_ALLOC, 32), buf) if op == "bench" else ioctl(pipe_r, termios.FIONREAD, n)
            extra = str((time.perf_counter_ns() - t0) // nums[0])
        elif op == "exit":
            break
        else:
            raise SystemExit(f"unknown command {op}")
        out.write(f"ok {err} {extra}".rstrip() + "\n")
        out.flush()
    os.close(pipe_w)


def hold(where: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from unisched.enforce.seccomp.agent import recv_agent_message

    with socket.socket(fileno=int(where)) as sock:
        listener, _ = recv_agent_message(sock)
    print("ready", flush=True)
    select.select([listener], [], [])
    import fcntl

    fcntl.ioctl(listener, 0xC0502100, bytearray(80), True)  # SECCOMP_IOCTL_NOTIF_RECV, never answered
    print("got", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1].startswith("foreign-"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        tenant(sys.argv[2], foreign_program(sys.argv[1].removeprefix("foreign-")))
    else:
        {"tenant": tenant, "hold": hold}[sys.argv[1]](sys.argv[2])
