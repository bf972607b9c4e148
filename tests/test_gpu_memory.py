"""On the GPU machine: per-tenant video memory caps enforced at the allocation by the session hooks, each while an
uncapped tenant burns the GPU at its normal rate. A PyTorch tenant capped at 4 GiB gets OutOfMemoryError at its
4th or 5th 1 GiB tensor, frees one, allocates again and trains on; an EGL tenant capped below its texture set
keeps its video memory under the cap (the GL driver places what is refused in system memory) and renders on;
an NVDEC decoder over its cap fails to open. The cost
test writes the hook's cost per allocation and a training step's start-up and steady-state cost, hooked and
not, to $UNISCHED_RESULTS (default: the test's tmp dir). Skipped without a GPU. bench/gpu_memory.sh runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env
from test_gpu import BURN, _gpu_reason, _torch_reason
from test_gpu_hooks import DECODE, run, tenant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))]
GIB = 1 << 30

TORCH_OOM = """
import json, torch
torch.ones(1, device="cuda")
held, out = [], {}
for i in range(8):
    try:
        held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        out["oom_at"] = i + 1
        break
del held[0]
torch.cuda.empty_cache()  # give the block back to the driver, not only to PyTorch's cache
held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(50):
    loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
torch.cuda.synchronize()
out["steps"] = 50
print("RESULT " + json.dumps(out))
"""

EGL_TEXTURES = """
import json, sys
sys.path.insert(0, "examples/workloads")
from _egl import gl_context
from OpenGL import GL
out = {"big": 0, "small": 0}
with gl_context(None):
    big = []
    for i in range(16):  # 256 MiB each: 4 GiB in all, over a 1 GiB cap
        t = GL.glGenTextures(1); GL.glBindTexture(GL.GL_TEXTURE_2D, t)
        GL.glTexStorage2D(GL.GL_TEXTURE_2D, 1, GL.GL_RGBA8, 8192, 8192)
        GL.glClearTexImage(t, 0, GL.GL_RGBA, GL.GL_UNSIGNED_BYTE, None); GL.glFinish()
        err = GL.glGetError()
        if err:
            out["error"] = int(err); GL.glDeleteTextures([t]); break
        big.append(t)
    out["big"] = len(big)
    print("HOLDING", flush=True); sys.stdin.readline()  # the test reads the tenant's video memory meanwhile
    GL.glDeleteTextures(big); GL.glFinish()
    for i in range(8):  # the smaller set (16 MiB each) renders on
        t = GL.glGenTextures(1); GL.glBindTexture(GL.GL_TEXTURE_2D, t)
        GL.glTexStorage2D(GL.GL_TEXTURE_2D, 1, GL.GL_RGBA8, 2048, 2048)
        GL.glClearTexImage(t, 0, GL.GL_RGBA, GL.GL_UNSIGNED_BYTE, None); GL.glFinish()
        out["small"] += GL.glGetError() == 0
print("RESULT " + json.dumps(out))
"""

COST = """
import json, statistics, time, torch
t0 = time.perf_counter(); torch.ones(1, device="cuda"); torch.cuda.synchronize(); init = time.perf_counter() - t0
pairs = []
for _ in range(300):  # one cudaMalloc + one cudaFree each (the cache emptied): two hooked driver calls
    t = time.perf_counter(); y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda"); del y
    torch.cuda.empty_cache(); pairs.append((time.perf_counter() - t) * 1e6)
pairs.sort()
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
opt = torch.optim.Adam(model.parameters())
steps = []
for _ in range(100):
    t = time.perf_counter()
    loss = model(torch.randn(512, 4096, device="cuda")).square().mean(); opt.zero_grad(); loss.backward(); opt.step()
    torch.cuda.synchronize(); steps.append((time.perf_counter() - t) * 1e3)
print("RESULT " + json.dumps({"init_s": init, "alloc_free_us_p50": pairs[150], "alloc_free_us_p99": pairs[296],
                              "first_step_ms": steps[0], "steady_step_ms_p50": statistics.median(steps[20:])}))
"""


def result(proc: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"no result (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(line[7:])  # type: ignore[no-any-return]


@contextmanager
def uncapped_burner(d: Daemon, seconds: int = 120) -> Iterator[None]:
    """Another tenant training at its normal rate meanwhile, without a cap."""
    proc = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant",
                             f"{d.prefix}free", "--", sys.executable, "-c", BURN.format(s=seconds)],
                            cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.kill()
        proc.wait(30)


def capped_tenant(d: Daemon, suffix: str, memory: str) -> str:
    name = f"{d.prefix}{suffix}"
    assert run(d, name, "true").returncode == 0
    d.cli("set-limit", "--tenant", name, "--memory", memory, check=True)
    return name


def refused(d: Daemon, name: str) -> int:
    return sum(m["refused"] for m in tenant(d, name)["gpu_memory"])


def test_pytorch_capped_at_4gib_gets_oom_frees_and_trains_on(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    if _torch_reason():
        pytest.skip(str(_torch_reason()))
    d: Daemon = daemon_factory(nvml=True)
    name = capped_tenant(d, "torch", "4GiB")
    with uncapped_burner(d):
        out = result(run(d, name, sys.executable, "-c", TORCH_OOM))
    print("pytorch capped at 4 GiB:", out, json.dumps(tenant(d, name)["gpu_memory"]))
    assert out.get("oom_at") in (4, 5), out  # the CUDA context's own memory counts too
    assert out["steps"] == 50
    assert refused(d, name) >= 1


def test_egl_over_cap_stays_under_it_and_renders_on(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The NVIDIA GL driver answers a heap allocation refused as out of memory the way it answers a full GPU: it
    places the texture in system memory, with no GL error. So the cap holds (video memory stays under it while
    the whole texture set is held) and the app renders on; GL_OUT_OF_MEMORY would also pass."""
    d: Daemon = daemon_factory(nvml=True)
    name = capped_tenant(d, "egl", "1GiB")
    with uncapped_burner(d):
        proc = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", name,
                                 "--keep", "--", sys.executable, "-c", EGL_TEXTURES], cwd=ROOT, env=child_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line.startswith("HOLDING"), f"{line!r} {proc.stderr.read()[-2000:] if proc.stderr else ''}"
        holding = tenant(d, name)["gpu_memory"]
        proc.stdin.write("\n")
        proc.stdin.flush()
        stdout, stderr = proc.communicate(timeout=120)
    out = result(subprocess.CompletedProcess(proc.args, proc.returncode, line + stdout, stderr))
    used = sum(m["used_bytes"] for m in holding)
    print("EGL capped at 1 GiB:", out, "video memory while holding the set:", used, json.dumps(holding))
    assert 0 < used <= GIB, holding  # counted (the heap path is followed) and held under the cap
    assert out.get("error") in (None, 0x0505), out  # none (placed in system memory) or GL_OUT_OF_MEMORY
    assert out["big"] >= 1 and out["small"] == 8
    assert refused(d, name) >= 1


def test_nvdec_over_cap_fails_to_open(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("av", reason="PyAV not installed (source .devcache/setup.sh on the GPU machine)")
    d: Daemon = daemon_factory(nvml=True)
    name = capped_tenant(d, "dec", "32MiB")
    with uncapped_burner(d):
        proc = run(d, name, *DECODE, "--seconds", "2")
    print("NVDEC capped at 32 MiB:", proc.returncode, proc.stderr[-800:])
    assert proc.returncode != 0, "the decoder opened although it is over its memory cap"
    assert "Traceback" not in proc.stderr or "Error" in proc.stderr
    assert refused(d, name) >= 1


def test_hook_cost_per_allocation_and_per_training_step(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if _torch_reason():
        pytest.skip(str(_torch_reason()))
    d: Daemon = daemon_factory(nvml=True)
    name = capped_tenant(d, "cost", "64GiB")  # hooked and capped (every allocation is charged), never reached
    hooked = result(run(d, name, sys.executable, "-c", COST))
    plain = result(subprocess.run([sys.executable, "-c", COST], capture_output=True, text=True, timeout=300,
                                  cwd=ROOT, env=child_env()))
    sup = d.status().get("session_hooks", {})
    report = {"date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename, "hooked": hooked, "plain": plain,
              "hook_latency": sup, "command": "bash bench/gpu_memory.sh"}
    print("cost:", json.dumps(report))
    out = Path(os.environ.get("UNISCHED_RESULTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_hook_cost.json").write_text(json.dumps(report, indent=1))
    # steady state: the caching allocator makes no driver call per step, so the hooks cost nothing there
    assert hooked["steady_step_ms_p50"] < plain["steady_step_ms_p50"] * 1.05 + 0.05
