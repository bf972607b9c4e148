"""On the GPU machine: the kernel hooks against the real NVIDIA driver. A render cap of 0 makes EGL context
creation fail cleanly (class 0xCB97 refused) while CUDA in the same tenant still works; a cap of 1 lets one
context through and counts it; device admission is attached to a tenant pinned to a GPU; a graphics tenant
over its memory cap is reported and refused new sessions. Skipped without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import ROOT, Daemon, child_env, wait_until
from test_gpu import BURN, _gpu_reason, _torch_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))]
RENDER = [sys.executable, str(ROOT / "examples/workloads/egl_render.py"), "--iterations", "50", "--warmup", "0"]


def run(d: Daemon, tenant: str, *cmd: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", tenant, "--keep",
                           *extra, "--", *cmd], capture_output=True, text=True, timeout=120, cwd=ROOT, env=child_env())


def tenant(d: Daemon, name: str) -> dict:  # type: ignore[type-arg]
    return next(t for t in d.tenants() if t["name"] == name)


def test_render_cap_refuses_egl_but_not_cuda(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    if _torch_reason():
        pytest.skip(str(_torch_reason()))
    d: Daemon = daemon_factory(nvml=True)
    name = f"{d.prefix}gfx"
    assert run(d, name, "true").returncode == 0
    d.cli("set-limit", "--tenant", name, "--render", "0", check=True)
    t0 = time.monotonic()
    refused = run(d, name, *RENDER, "--seconds", "1")
    print("render with cap 0:", refused.returncode, refused.stderr[-800:], f"{time.monotonic() - t0:.1f}s")
    assert refused.returncode != 0, "EGL rendering ran although render cap is 0"
    assert tenant(d, name)["refusals"].get("graphics", 0) >= 1
    cuda = run(d, name, sys.executable, "-c", BURN.format(s=2))
    assert cuda.returncode == 0, cuda.stderr[-2000:]
    d.cli("set-limit", "--tenant", name, "--render", "1", check=True)
    ok = run(d, name, *RENDER, "--seconds", "2")
    print("render with cap 1:", ok.returncode, ok.stdout[-300:])
    assert ok.returncode == 0, ok.stderr[-2000:]
    log = [json.loads(x) for x in d.log_path.read_text().splitlines() if x.startswith("{")]
    print("refusals logged:", [e for e in log if e["event"] == "session refused"][:3])
    print("tenant:", json.dumps(tenant(d, name)))


def test_pinned_tenant_gets_device_admission_and_its_exact_memory_is_reported(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A hooked render tenant pinned to GPU 0: the device filter admits that GPU, its video memory is counted
    exactly from its allocations (EGL's heap calls included), and under a cap below what it uses a new render's
    allocations are refused (the GL driver may then place them in system memory and render on)."""
    d: Daemon = daemon_factory(nvml=True)
    if d.status()["device_admission"] != "on":
        pytest.skip(f"device admission unavailable: {d.status()['device_admission']}")
    name = f"{d.prefix}pin"
    proc = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", name,
                             "--keep", "--gpus", "0", "--", *RENDER, "--seconds", "8"], cwd=ROOT, env=child_env())
    try:
        t = wait_until(lambda: (x := next((t for t in d.tenants() if t["name"] == name), None)) and x["devices"] and x,
                       30, "device admission to be attached")
        print("devices:", t["devices"])
        assert "GPU 0" in t["devices"]
        t = wait_until(lambda: any(m["used_bytes"] for m in tenant(d, name)["gpu_memory"]) and tenant(d, name), 30,
                       "the render tenant's video memory to be counted")
        print("render video memory:", t["gpu_memory"])
        d.cli("set-limit", "--tenant", name, "--memory", "1MiB", check=True)
        again = run(d, name, *RENDER, "--seconds", "1")
        print("render under a 1 MiB cap:", again.returncode, again.stderr[-500:])
        assert sum(m["refused"] for m in tenant(d, name)["gpu_memory"]) >= 1
    finally:
        proc.wait(timeout=60)


DECODE = [sys.executable, str(ROOT / "examples/04_nvdec_decode.py"), "--warmup", "0"]


def test_decode_cap_counts_one_pyav_decoder_as_one_session(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A PyAV NVDEC decoder allocates 7 NVDEC objects (one per engine): they must count as one session, so a
    decode cap of 1 lets one decoder run, and a cap of 0 refuses it cleanly."""
    pytest.importorskip("av", reason="PyAV not installed (source .devcache/setup.sh on the GPU machine)")
    d: Daemon = daemon_factory(nvml=True)
    name = f"{d.prefix}dec"
    assert run(d, name, "true").returncode == 0
    d.cli("set-limit", "--tenant", name, "--decode", "1", check=True)
    ok = run(d, name, *DECODE, "--seconds", "3")
    print("decode with cap 1:", ok.returncode, ok.stdout[-300:], ok.stderr[-600:])
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert tenant(d, name)["refusals"].get("nvdec", 0) == 0
    d.cli("set-limit", "--tenant", name, "--decode", "0", check=True)
    refused = run(d, name, *DECODE, "--seconds", "2")
    print("decode with cap 0:", refused.returncode, refused.stderr[-600:])
    assert refused.returncode != 0, "NVDEC decode ran although the decode cap is 0"
    assert tenant(d, name)["refusals"].get("nvdec", 0) >= 1
    print("tenant:", json.dumps(tenant(d, name)))


def test_second_concurrent_decoder_is_refused_while_another_tenant_decodes(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Decode cap 1: the tenant's first decoder runs, its second concurrent one fails with a clear error, another
    tenant's decoder is unaffected, and the counts go back to 0 when the processes exit."""
    pytest.importorskip("av", reason="PyAV not installed (source .devcache/setup.sh on the GPU machine)")
    d: Daemon = daemon_factory(nvml=True)
    a, b = f"{d.prefix}deca", f"{d.prefix}decb"
    assert run(d, b, *DECODE, "--seconds", "1").returncode == 0  # also makes the test clip
    assert run(d, a, "true").returncode == 0
    d.cli("set-limit", "--tenant", a, "--decode", "1", check=True)

    def start(name: str, seconds: int) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", name, "--",
                                 *DECODE, "--seconds", str(seconds)], cwd=ROOT, env=child_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    first, other = start(a, 12), start(b, 10)
    try:
        wait_until(lambda: tenant(d, a)["sessions"].get("nvdec", 0) == 1 and tenant(d, b)["sessions"].get("nvdec", 0) == 1,
                   60, "both tenants to hold a decoder")
        second = run(d, a, *DECODE, "--seconds", "2")
        print("second decoder at cap 1:", second.returncode, second.stdout[-300:], second.stderr[-400:])
        print("daemon on nvdec:", *[line[:300] for line in d.log_path.read_text().splitlines()
                                    if "nvdec" in line.lower() or "refus" in line.lower()][-15:], sep="\n  ")
        assert second.returncode != 0 and "hardware decode failed" in second.stderr
        assert tenant(d, a)["refusals"].get("nvdec", 0) >= 1
    finally:
        out_first, err_first = first.communicate(timeout=120)
        out_other, err_other = other.communicate(timeout=120)
    assert first.returncode == 0, err_first[-1000:]
    assert other.returncode == 0, err_other[-1000:]
    print("first:", out_first[-200:], "other:", out_other[-200:])
    wait_until(lambda: tenant(d, a)["sessions"].get("nvdec", 0) == 0 and tenant(d, b)["sessions"].get("nvdec", 0) == 0,
               20, "decode session counts back to 0 after exit")
