"""The answer path through fastcall.c: `hybrid`, its two calls through ctypes and Python between them (here only
unpacking the argument's first words, where the product would decode and book the call); `native-thread`, its
serve_all in a thread of this Python process (which has the supervisor's modules loaded, as the daemon has). Serves
the listener fd given until every caller has gone.

    python3 hybsup.py FD /tmp/fastcall.so hybrid|native-thread
"""

import ctypes
import fcntl
import struct
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import unisched.enforce.seccomp.supervisor  # noqa: F401
from unisched.enforce.seccomp.abi import FD_SYNC_WAKE_UP, NOTIF_SET_FLAGS


class Call(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("nr", ctypes.c_uint32),
                ("arch", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("args", ctypes.c_uint64 * 6),
                ("got", ctypes.c_int64)]


def main(fd: int, lib_path: str, mode: str) -> None:
    lib = ctypes.CDLL(lib_path)
    lib.next_call.argtypes = [ctypes.c_int, ctypes.POINTER(Call), ctypes.c_char_p, ctypes.c_int]
    lib.answer.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
    fcntl.ioctl(fd, NOTIF_SET_FLAGS, FD_SYNC_WAKE_UP)
    print("serving", flush=True)
    if mode == "native-thread":
        done: list[int] = []
        thread = threading.Thread(target=lambda: done.append(lib.serve_all(fd)))
        thread.start()
        thread.join()
        print(f"hybsup: {done[0]} notifications", file=sys.stderr)
        return
    call, buf, n = Call(), ctypes.create_string_buffer(256), 0
    while (got := lib.next_call(fd, ctypes.byref(call), buf, 32)) >= 0:
        if got == 0:
            continue
        if call.got >= 16:
            struct.unpack_from("=IIII", buf.raw, 0)  # (what the product's decoding would start from)
        lib.answer(fd, call.id, 0, 1)
        n += 1
    print(f"hybsup: {n} notifications", file=sys.stderr)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
