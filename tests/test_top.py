"""`unisched top`: the frame as text (pure rendering), and the command against a real in-process daemon."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

from conftest import ROOT, child_env, cli
from inproc import in_process_server
from rich.console import Console

from unisched.cli.top import BAR_WIDTH, gpu_line, render_frame, share_bar
from unisched.transport.client import DaemonClient
from unisched_wire import unisched_pb2 as pb


def _text(renderable: object) -> str:
    console = Console(record=True, width=120, color_system=None)
    console.print(renderable)
    return console.export_text()


def _tenant(name: str, weight: int, state: str, shares: list[tuple[str, float, float]], **kw: object) -> pb.Tenant:
    return pb.Tenant(
        name=name, weight=weight, base_weight=int(kw.pop("base_weight", weight)), state=state,  # type: ignore[call-overload]
        shares=[pb.ResourceShare(gpu=0, domain=d, target_share=t, measured_share=m) for d, t, m in shares],
        target_share=shares[0][1] if shares else 0.0, measured_share=shares[0][2] if shares else 0.0, **kw,
    )


def test_share_bar_shows_measured_cells_and_the_target_mark() -> None:
    assert share_bar(0.5, 0.5).plain == "█" * 10 + "┃" + "·" * 9
    assert share_bar(0.25, 0.75).plain == "█" * 5 + "┃" + "█" * 9 + "·" * 5
    assert share_bar(0.0, 0.0).plain == "·" * BAR_WIDTH  # no target: no mark
    assert share_bar(1.0, 1.0).plain == "█" * (BAR_WIDTH - 1) + "┃"
    assert share_bar(0.5, 3.0).plain.count("█") == BAR_WIDTH - 1  # clamped, mark kept
    assert len(share_bar(0.3, -1.0).plain) == BAR_WIDTH


def test_frame_has_a_row_per_tenant_and_domain() -> None:
    status = pb.StatusReply(version="0.1.0", mode="tidal", slice_ms=50, tenants=2, uptime_s=12, nvml=True,
                            gpus=[pb.Gpu(index=0, name="NVIDIA H200", contention="shared-sm", sm_util=0.9,
                                         dec_util=0.25, memory_used=2 * 2**30, memory_total=140 * 2**30)])
    tenants = [
        _tenant("inference", 800, "running", [("sm", 0.75, 0.74), ("nvdec", 1.0, 0.5)], base_weight=400,
                sessions={"nvdec": 2, "compute": 1}, refusals={"nvdec": 3}),
        _tenant("render", 100, "frozen", [("sm", 0.25, 0.26)]),
    ]
    text = _text(render_frame(tenants, status))
    assert "unisched 0.1.0: mode tidal, slice 50 ms, 2 tenants, up 12 s" in text
    assert "gpu0 NVIDIA H200 [shared-sm]  sm 90%  dec 25%  enc 0%  mem 2.0/140.0 GiB" in text
    lines = text.splitlines()
    header = next(line for line in lines if "TENANT" in line)
    for col in ("WEIGHT", "STATE", "DOMAIN", "SHARE", "TARGET", "MEASURED", "GPU-S", "SESSIONS", "REFUSED"):
        assert col in header
    inf = next(line for line in lines if line.startswith("inference"))
    assert "800 (400)" in inf and "running" in inf and "gpu0/sm" in inf
    assert "75.0%" in inf and "74.0%" in inf
    assert "compute:1 nvdec:2" in inf and "nvdec:3" in inf
    video = next(line for line in lines if "gpu0/nvdec" in line)
    assert not video.startswith("inference")  # a continuation row of the same tenant
    assert "100.0%" in video and "50.0%" in video and "█" * 10 in video
    ren = next(line for line in lines if line.startswith("render"))
    assert " 100 " in ren and "frozen" in ren and "25.0%" in ren and "26.0%" in ren
    assert ren.rstrip().endswith("-")  # no refusals
    assert "measured share" in text and "target share" in text


def test_frame_without_tenants_or_daemon() -> None:
    assert "no tenants" in _text(render_frame([], None))
    text = _text(render_frame([], None, error="cannot reach the unisched daemon at unix:/x", hint="q quits"))
    assert "cannot reach the unisched daemon" in text and "q quits" in text


def test_top_once_against_a_daemon(tmp_path: Path) -> None:
    with in_process_server(tmp_path / "state") as srv:
        with DaemonClient(srv.socket) as c:
            c.register(pb.RegisterRequest(tenant="trainer", weight=300, engines=["compute", "encode"]))
        out = cli("top", "--once", "--socket", srv.socket)
    assert out.returncode == 0, out.stderr
    assert "1 tenants" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("trainer"))
    assert " 300 " in row and "idle" in row
    assert "gpu0/sm" in out.stdout and "gpu0/nvenc" in out.stdout  # one row per domain


def test_top_once_names_an_unreachable_daemon(tmp_path: Path) -> None:
    out = cli("top", "--once", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1 and "cannot reach the unisched daemon" in out.stderr
    out = cli("top", "--interval", "0", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 2 and "interval must be in 0.1..3600" in out.stderr


def _read_until(fd: int, text: bytes, timeout: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {text!r}; got {seen[-500:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side closed
                break
            seen += chunk
    return seen


def test_q_quits_the_live_view_and_restores_the_terminal(tmp_path: Path) -> None:
    with in_process_server(tmp_path / "state") as srv:
        with DaemonClient(srv.socket) as c:
            c.register(pb.RegisterRequest(tenant="live", weight=100))
        master, slave = pty.openpty()
        before = termios.tcgetattr(slave)
        proc = subprocess.Popen([sys.executable, "-m", "unisched", "top", "--socket", srv.socket, "--interval", "0.2"],
                                stdin=slave, stdout=slave, stderr=subprocess.PIPE, cwd=ROOT,
                                env={**child_env(), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "30"})
        try:
            _read_until(master, b"q quits", 20)
            _read_until(master, b"live", 5)
            os.write(master, b"q")
            _, err = proc.communicate(timeout=10)
            assert proc.returncode == 0, err
            assert termios.tcgetattr(slave)[3] == before[3]  # echo and canonical mode are back
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
            os.close(master)
            os.close(slave)


def test_ctrl_c_ends_the_view_when_stdin_is_not_a_terminal(tmp_path: Path) -> None:
    with in_process_server(tmp_path / "state") as srv:
        with DaemonClient(srv.socket) as c:
            c.register(pb.RegisterRequest(tenant="batch", weight=100))
        proc = subprocess.Popen([sys.executable, "-m", "unisched", "top", "--socket", srv.socket, "--interval", "0.2"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                env=child_env())
        try:
            assert proc.stdout is not None
            frames = _read_until(proc.stdout.fileno(), b"Ctrl-C quits", 20)
            frames += _read_until(proc.stdout.fileno(), b"Ctrl-C quits", 5)  # a second frame follows the first
            assert frames.count(b"batch") >= 2  # ready: its handler is in place and it is redrawing
            proc.send_signal(signal.SIGINT)
            # generous for "it ends" (a loaded 2-core CI machine); whatever the view was doing when the signal
            # came, it must end, and with 0
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def test_a_gpu_with_mixed_slices_shows_them() -> None:
    g = pb.Gpu(index=0, name="NVIDIA H200", contention="partial-overlap", sm_util=1.0, memory_total=140 * 2**30,
               mix=pb.MixedSlices(together=0.605, compute_alone=0.395, graphics_alone=0.0, now="compute"))
    assert gpu_line(g).endswith("mixed: together 60% / compute 40% / graphics 0% (now compute)")
    assert "mixed" not in gpu_line(pb.Gpu(index=0, name="NVIDIA H200", contention="partial-overlap"))
