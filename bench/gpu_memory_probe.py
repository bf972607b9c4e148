#!/usr/bin/env python3
"""GPU machine probe for memory enforcement: which RM calls CUDA/PyTorch and EGL make for their memory, what
sizes they carry, and how the libraries take an allocation refused (a) with NV_ERR_NO_MEMORY written into the
call's status field and the ioctl answered 0 without running, or (b) with errno ENOMEM from the hook.

Each workload runs in a child that installs the session filter (plus RM_VID_HEAP_CONTROL 0x4A and
RM_ALLOC_MEMORY 0x27, to see whether they are used) and hands its listener over a socketpair; a thread here
logs every notified call (escape, class, parent, handle, the memory size read from the parameters) to
OUT/calls.jsonl (one line per call, with the workload's name) and, with a cap, refuses the
NV01_MEMORY_LOCAL_USER allocation that would cross it.

    python3 bench/gpu_memory_probe.py OUT      (about a minute on an H200; bench/gpu_memory.sh runs it)
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import os
import select
import socket
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import save_json

from unisched.enforce.seccomp.abi import FLAG_CONTINUE, NOTIF_FORMAT, NOTIF_RECV, NOTIF_SEND, NOTIF_SIZE, RESP_FORMAT
from unisched.enforce.seccomp.filter import build_filter

RM_ALLOC, RM_FREE, XFER, VID_HEAP, ALLOC_MEMORY = 0x2B, 0x29, 0xD3, 0x4A, 0x27
NO_MEMORY = 0x51
GIB = 1 << 30

TORCH_CAP = r"""
import json, time, torch
out = {}
x = torch.ones(1, device="cuda"); torch.cuda.synchronize()
held, t0 = [], time.monotonic()
for i in range(8):
    try:
        held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        out["oom_at"] = i + 1; out["oom"] = str(e)[:200]; break
    except Exception as e:
        out["other_error_at"] = i + 1; out["other"] = f"{type(e).__name__}: {e}"[:300]; break
out["held"] = len(held)
try:
    del held[0]; torch.cuda.empty_cache()
    held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda")); out["realloc_after_free"] = True
    m = torch.nn.Linear(1024, 1024).cuda(); opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(20):
        loss = m(torch.randn(256, 1024, device="cuda")).square().mean(); opt.zero_grad(); loss.backward(); opt.step()
    torch.cuda.synchronize(); out["train_ok"] = True
except Exception as e:
    out["after_error"] = f"{type(e).__name__}: {e}"[:300]
print("RESULT " + json.dumps(out), flush=True)
"""

TORCH_COST = r"""
import json, time, statistics, torch
out = {}
t0 = time.perf_counter(); x = torch.ones(1, device="cuda"); torch.cuda.synchronize(); out["init_s"] = time.perf_counter() - t0
ts = []
for _ in range(200):
    t = time.perf_counter(); y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda"); del y; torch.cuda.empty_cache()
    ts.append((time.perf_counter() - t) * 1e6)
ts.sort(); out["alloc_free_us_p50"] = ts[100]; out["alloc_free_us_p99"] = ts[198]
m = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
opt = torch.optim.Adam(m.parameters())
steps = []
for i in range(60):
    t = time.perf_counter()
    loss = m(torch.randn(512, 4096, device="cuda")).square().mean(); opt.zero_grad(); loss.backward(); opt.step()
    torch.cuda.synchronize(); steps.append((time.perf_counter() - t) * 1e3)
out["first_step_ms"] = steps[0]; out["steady_step_ms_p50"] = statistics.median(steps[10:])
print("RESULT " + json.dumps(out), flush=True)
"""

EGL_TEX = r"""
import json, sys
sys.path.insert(0, "examples/workloads")
from _egl import gl_context
from OpenGL import GL
out = {"errors": []}
with gl_context(None):
    texs = []
    for i in range(12):
        t = GL.glGenTextures(1); GL.glBindTexture(GL.GL_TEXTURE_2D, t)
        GL.glTexStorage2D(GL.GL_TEXTURE_2D, 1, GL.GL_RGBA8, 8192, 8192)  # 256 MiB
        GL.glClearTexImage(t, 0, GL.GL_RGBA, GL.GL_UNSIGNED_BYTE, None) if hasattr(GL, "glClearTexImage") else None
        GL.glFinish(); err = GL.glGetError()
        if err:
            out["errors"].append([i, int(err)]); GL.glDeleteTextures([t]); break
        texs.append(t)
    out["textures"] = len(texs)
    GL.glDeleteTextures(texs[:2]); GL.glFinish()
    t = GL.glGenTextures(1); GL.glBindTexture(GL.GL_TEXTURE_2D, t)
    GL.glTexStorage2D(GL.GL_TEXTURE_2D, 1, GL.GL_RGBA8, 4096, 4096); GL.glFinish(); out["smaller_err"] = int(GL.glGetError())
print("RESULT " + json.dumps(out), flush=True)
"""


class Probe:
    """Serves one listener: logs calls, books NV01_MEMORY_LOCAL_USER sizes, refuses over `cap` by `mode`."""

    def __init__(self, fd: int, log: Path, name: str, cap: int | None, mode: str) -> None:
        self.fd, self.cap, self.mode, self.name = fd, cap, mode, name
        self.log = log.open("a")
        self.live: dict[tuple[int, int], int] = {}
        self.used = 0
        self.lat_ns: list[int] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.refused = 0

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            ev = dict(poller.poll(1000)).get(self.fd, 0)
            if ev & select.POLLIN:
                self.one()
            elif ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                break
        self.log.close()
        os.close(self.fd)

    def one(self) -> None:
        buf = bytearray(NOTIF_SIZE)
        try:
            fcntl.ioctl(self.fd, NOTIF_RECV, buf, True)
        except OSError:
            return
        t0 = time.perf_counter_ns()
        nid, pid, _f, _nr, _arch, _ip, *args = struct.unpack(NOTIF_FORMAT, buf)
        req, addr = args[1] & 0xFFFFFFFF, args[2]
        enr, size = req & 0xFF, (req >> 16) & 0x3FFF
        rec: dict[str, object] = {"w": self.name, "t": time.monotonic(), "tid": pid, "esc": hex(enr), "size": size}
        error, answer_val, write = 0, None, None
        try:
            with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
                def rd(a: int, n: int) -> bytes:
                    mem.seek(a)
                    return mem.read(n)
                if enr == XFER:
                    enr, size, addr = struct.unpack("=IIQ", rd(addr, 16))
                    rec.update(inner=hex(enr), isize=size)
                if enr == RM_ALLOC and size in (32, 48):
                    h_root, h_par, h_new, h_cls, params = struct.unpack("=IIIIQ", rd(addr, 24))
                    psize = struct.unpack("=I", rd(addr + (24 if size == 32 else 32), 4))[0]
                    rec.update(root=hex(h_root), parent=hex(h_par), new=hex(h_new), cls=hex(h_cls), psize=psize)
                    nbytes = None
                    if h_cls in (0x40, 0x3E, 0x70) and params and psize >= 72:
                        nbytes = struct.unpack("=Q", rd(params + 64, 8))[0]
                        attr, surface = struct.unpack("=I", rd(params + 24, 4))[0], struct.unpack("=I", rd(params + 4, 4))[0]
                        rec.update(attr=hex(attr), type=surface)
                    elif h_cls == 0xF8 and params:
                        nbytes = struct.unpack("=Q", rd(params + 8, 8))[0]
                    elif h_cls == 0x80 and params:
                        rec["device_id"] = struct.unpack("=I", rd(params, 4))[0]
                    if nbytes is not None:
                        rec["bytes"] = nbytes
                    if h_cls == 0x40 and nbytes is not None:
                        if self.cap is not None and self.used + nbytes > self.cap:
                            self.refused += 1
                            rec["refused"] = self.mode
                            if self.mode == "status":
                                write = (addr + (28 if size == 32 else 40), struct.pack("=I", NO_MEMORY))
                                answer_val = 0
                            else:
                                error = -errno.ENOMEM
                        else:
                            old = self.live.pop((h_root, h_new), 0)
                            self.live[(h_root, h_new)] = nbytes
                            self.used += nbytes - old
                elif enr == RM_FREE and size == 16:
                    h_root, h_par, h_old = struct.unpack("=III", rd(addr, 12))
                    rec.update(root=hex(h_root), free=hex(h_old))
                    self.used -= self.live.pop((h_root, h_old), 0)
                    if h_old == h_root:
                        for k in [k for k in self.live if k[0] == h_root]:
                            self.used -= self.live.pop(k)
                elif enr == VID_HEAP and size >= 96:
                    h_root, h_par, function = struct.unpack("=III", rd(addr, 12))
                    rec.update(root=hex(h_root), function=function, bytes=struct.unpack("=Q", rd(addr + 88, 8))[0])
                if write is not None:
                    mem.seek(write[0])
                    mem.write(write[1])
        except OSError as e:
            rec["read_error"] = str(e)
        rec["used"] = self.used
        self.counts[f"{rec.get('inner', rec['esc'])}:{rec.get('cls', '')}"] += 1
        flags = 0 if (error or answer_val is not None) else FLAG_CONTINUE
        resp = struct.pack(RESP_FORMAT, nid, 0, error, flags)
        try:
            fcntl.ioctl(self.fd, NOTIF_SEND, resp)
        except OSError:
            rec["gone"] = True
        self.lat_ns.append(time.perf_counter_ns() - t0)
        self.log.write(json.dumps(rec) + "\n")


def run_workload(out: Path, name: str, code: str, cap: int | None, mode: str, hooked: bool = True) -> dict[str, object]:
    parent, child = socket.socketpair()
    argv = [sys.executable, "-c", code]
    pid = os.fork()
    if pid == 0:
        try:
            parent.close()
            if hooked:
                from unisched.enforce.seccomp.filter import install_filter
                listener = install_filter(build_filter(extra=(VID_HEAP, ALLOC_MEMORY)))
                socket.send_fds(child, [b"l"], [listener])
                os.close(listener)
            child.close()
            os.execv(sys.executable, argv)
        finally:
            os._exit(127)
    child.close()
    probe = None
    thread = None
    if hooked:
        _msg, fds, _f, _a = socket.recv_fds(parent, 16, 1)
        probe = Probe(fds[0], out / "calls.jsonl", name, cap, mode)
        thread = threading.Thread(target=probe.serve, daemon=True)
        thread.start()
    parent.close()
    t0 = time.monotonic()
    deadline = t0 + 120
    status = None
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    res: dict[str, object] = {"name": name, "cap": cap, "mode": mode, "hooked": hooked,
                              "exit": status, "wall_s": round(time.monotonic() - t0, 2)}
    if probe is not None and thread is not None:
        thread.join(10)
        lat = sorted(probe.lat_ns)
        res.update(calls=dict(probe.counts), refused=probe.refused, used_end=probe.used,
                   hook_us_p50=lat[len(lat) // 2] / 1e3 if lat else None,
                   hook_us_p99=lat[int(len(lat) * 0.99)] / 1e3 if lat else None, notified=len(lat))
    return res


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(Path(__file__).resolve().parents[1])
    results = []
    plan = [
        ("torch_cap_status", TORCH_CAP, 4 * GIB, "status", True),
        ("torch_cap_errno", TORCH_CAP, 4 * GIB, "errno", True),
        ("torch_cost_hooked", TORCH_COST, None, "status", True),
        ("torch_cost_plain", TORCH_COST, None, "status", False),
        ("egl_log", EGL_TEX, None, "status", True),
        ("egl_cap_status", EGL_TEX, 1 * GIB, "status", True),
    ]
    log = out / "workload.out"
    for name, code, cap, mode, hooked in plan:
        # the child's stdout/stderr go to a file so the RESULT line can be read back (appended to outputs.txt)
        with open(log, "w") as so:
            saved = os.dup(1), os.dup(2)
            os.dup2(so.fileno(), 1)
            os.dup2(so.fileno(), 2)
            try:
                res = run_workload(out, name, code, cap, mode, hooked)
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        text = log.read_text()
        with open(out / "outputs.txt", "a") as all_out:
            all_out.write(f"=== {name}\n{text}\n")
        res["result"] = next((json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT ")), text[-600:])
        print(json.dumps(res), flush=True)
        results.append(res)
    save_json(out / "results.json", results)
    log.unlink()


if __name__ == "__main__":
    main()
