"""examples/ad_sim.py and its modules in examples/workloads, the driving-simulation pipeline: its help, the
packet framing between the stages, the window and summary arithmetic, the `unisched run` command lines, and that
a failing stage fails the run without hanging. On the GPU machine: both modes end to end, and colocated under a
real daemon."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import ROOT, Daemon, child_env, egl_reason
from test_gpu import _gpu_reason

SCRIPT = ROOT / "examples" / "ad_sim.py"
REPORT_KEYS = {"scenario", "mode", "unisched", "weights", "width", "height", "model", "encoder", "decoder", "frames",
               "seconds", "fps_end_to_end", "latency_ms", "gpu_util_mean", "decoder_util_mean", "gpu_util_samples",
               "timeline", "errors"}
STAGES = {"render", "readback_encode", "transfer", "decode", "infer", "end_to_end"}


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ad_sim", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


ad = _load()
import _ad_stream as ads  # noqa: E402  (examples/workloads, on the path once the example is loaded)


def record(fid: int, t0: float, stages: tuple[float, ...], flags: int = 0) -> list[float]:
    """A perception record whose six stage boundaries follow t0 by the given durations (render .. infer)."""
    times = [t0]
    for d in stages:
        times.append(times[-1] + d)
    return [fid, flags, *times]


def test_help_exits_0_and_explains_the_modes_and_where_things_run() -> None:
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    for word in ("colocated", "sequential", "--unisched-socket", "--weights", "NVDEC", "libx264", "no NVENC",
                 "--role", "ad-perception"):
        assert word in p.stdout, word


def test_packet_framing_round_trips() -> None:
    msgs = [(0, (1.0, 1.25, 1.5), b"\x00\x00\x00\x01idr", ads.FLAG_MEASURED), (1, (2.0, 2.5, 2.75), b"p" * 70000, 0),
            (2**40, (3.0, 3.0, 3.0), b"", 0)]
    stream = io.BytesIO(b"".join(ads.pack_packet(f, t, p, fl) for f, t, p, fl in msgs) + ads.end_of_stream())
    for fid, times, payload, flags in msgs:
        got = ads.read_message(stream)
        assert got is not None
        header, data = got
        assert (header.frame_id, header.flags, header.length) == (fid, flags, len(payload))
        assert (header.t_render_start, header.t_render_end, header.t_encode_end) == times
        assert data == payload
    eos = ads.read_message(stream)
    assert eos is not None and eos[0].flags & ads.FLAG_EOS and eos[1] == b""
    assert ads.read_message(stream) is None  # a clean end between messages


def test_framing_rejects_a_cut_or_foreign_stream() -> None:
    whole = ads.pack_packet(7, (1.0, 2.0, 3.0), b"abcdef")
    with pytest.raises(EOFError, match="payload"):
        ads.read_message(io.BytesIO(whole[:-2]))
    with pytest.raises(EOFError, match="header"):
        ads.read_message(io.BytesIO(whole[:10]))
    with pytest.raises(ValueError, match="magic"):
        ads.read_message(io.BytesIO(b"XXXX" + whole[4:]))


def test_window_starts_warmup_after_the_first_completion_or_at_start_at() -> None:
    clock = ads.WindowClock(seconds=10, warmup=5)
    assert not clock.counted(100.0) and not clock.finished(1e12)  # no completion seen yet: no window
    clock.observe(100.0)
    clock.observe(101.0)  # only the first completion fixes it
    assert (clock.start, clock.end) == (105.0, 115.0)
    assert not clock.counted(105.0) and clock.counted(105.001) and clock.counted(115.0) and not clock.counted(115.001)
    assert clock.finished(115.001) and not clock.finished(115.0)
    on_time = ads.WindowClock(seconds=10, warmup=5, start_at=200.0)
    on_time.observe(150.0)
    assert (on_time.start, on_time.late_s) == (200.0, 0.0)
    late = ads.WindowClock(seconds=10, warmup=5, start_at=200.0)
    late.observe(203.0)
    assert (late.start, late.end, late.late_s) == (203.0, 213.0, 3.0)


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert ads.percentile(values, 50) == pytest.approx(50.5)
    assert ads.percentile(values, 99) == pytest.approx(99.01)
    assert ads.percentile(values, 0) == 1.0 and ads.percentile(values, 100) == 100.0
    assert ads.percentile([7.0], 99) == 7.0


def test_latency_per_stage_from_synthetic_timestamps() -> None:
    # frame i: render 10 ms, readback+encode 5 ms, transfer i ms, decode 2 ms, infer 3 ms
    records = [record(i, 100.0 + i, (0.010, 0.005, 0.001 * i, 0.002, 0.003)) for i in range(1, 101)]
    lat = ads.latency_ms(records)
    assert set(lat) == STAGES
    assert lat["render"] == {"p50": pytest.approx(10.0, abs=1e-3), "p99": pytest.approx(10.0, abs=1e-3),
                             "mean": pytest.approx(10.0, abs=1e-3)}
    assert lat["transfer"]["p50"] == pytest.approx(50.5, abs=1e-3)
    assert lat["transfer"]["p99"] == pytest.approx(99.01, abs=1e-3)
    assert lat["transfer"]["mean"] == pytest.approx(50.5, abs=1e-3)
    assert lat["end_to_end"]["p50"] == pytest.approx(20.0 + 50.5, abs=1e-3)
    assert lat["infer"]["mean"] == pytest.approx(3.0, abs=1e-3)
    assert ads.latency_ms([])["decode"] == {"p50": None, "p99": None, "mean": None}


def test_colocated_counts_frames_finished_in_the_window_with_a_half_second_timeline() -> None:
    # inference ends at 10.0, 10.1, ..., 13.0; the window is (10.0, 12.0]
    records = [record(i, 9.9 + 0.1 * i, (0.02, 0.02, 0.02, 0.02, 0.02)) for i in range(31)]
    ends = [r[ads.T_INFER_END] for r in records]
    assert ends[0] == pytest.approx(10.0) and ends[-1] == pytest.approx(13.0)
    counted, segments = ads.colocated_view(records, 10.0, 12.0)
    s = ads.summarize(counted, segments)
    assert s["frames"] == 20 and s["seconds"] == 2.0 and s["fps_end_to_end"] == 10.0
    assert [p[0] for p in s["timeline"]] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [p[1] for p in s["timeline"]] == [0, 5, 10, 15, 20]
    assert s["latency_ms"]["end_to_end"]["p50"] == pytest.approx(100.0, abs=1e-3)
    gpu = ads.gpu_view([[9.0, 99.0, 99.0], [10.5, 40.0, 10.0], [11.5, 60.0, 20.0], [12.5, 99.0, 99.0]], segments)
    assert gpu["gpu_util_mean"] == 50.0 and gpu["decoder_util_mean"] == 15.0
    assert gpu["gpu_util_samples"] == [[0.5, 40.0, 10.0], [1.5, 60.0, 20.0]]


def test_sequential_throughput_is_frames_over_both_stage_times() -> None:
    # the sim's window is (100, 110]; it flagged 30 frames; perception reads the first at 200 and infers the last at 205
    measured = [[i, ads.FLAG_MEASURED, 100.0 + i / 3, 100.01 + i / 3, 100.02 + i / 3, 200.0 + i / 6, 200.0 + i / 6,
                 200.0 + (i + 1) / 6] for i in range(30)]
    warm = [[100 + i, 0, 95.0, 95.01, 95.02, 199.0, 199.01, 199.02] for i in range(5)]
    counted, segments = ads.sequential_view(warm + measured, 100.0, 110.0)
    s = ads.summarize(counted, segments)
    assert s["frames"] == 30 and s["seconds"] == pytest.approx(15.0)
    assert s["fps_end_to_end"] == pytest.approx(2.0)
    assert [s.end - s.start for s in segments] == pytest.approx([10.0, 5.0])
    timeline = dict((t, n) for t, n in s["timeline"])
    assert timeline[10.0] == 0 and timeline[12.5] == 15 and timeline[15.0] == 30  # nothing ends until stage 2 runs
    assert s["latency_ms"]["transfer"]["p50"] > 90_000  # waited in the file between the stages: said, not hidden
    gpu = ads.gpu_view([[105.0, 30.0, 0.0], [150.0, 0.0, 0.0], [202.0, 70.0, 40.0]], segments)
    assert gpu["gpu_util_samples"] == [[5.0, 30.0, 0.0], [12.0, 70.0, 40.0]]  # the gap between stages is left out


def test_weights_scale_so_the_smaller_is_the_default_100() -> None:
    assert ad.parse_weights("1:1") == (100, 100)
    assert ad.parse_weights("3:1") == (300, 100)
    assert ad.parse_weights("100:300") == (100, 300)
    for bad in ("1", "a:b", "0:1", "200:1"):
        with pytest.raises(Exception, match="weights"):
            ad.parse_weights(bad)


def test_unisched_command_lines_carry_tenant_weight_and_engines() -> None:
    args = ad.parse_args(["--unisched-socket", "/run/u.sock", "--weights", "3:1", "--seconds", "7"])
    work = Path("/w")
    sim = ad.stage_command(args, "sim", work, 1234.5)
    perception = ad.stage_command(args, "perception", work, 1234.5)
    me = [sys.executable, str(SCRIPT.resolve())]
    assert sim[:sim.index("--") + 5] == [sys.executable, "-m", "unisched", "run", "--socket", "/run/u.sock",
                                         "--tenant", "ad-sim", "--weight", "300", "--engines", "graphics,encode",
                                         "--", *me, "--role", "sim"]
    assert perception[:perception.index("--") + 5] == [
        sys.executable, "-m", "unisched", "run", "--socket", "/run/u.sock", "--tenant", "ad-perception",
        "--weight", "100", "--engines", "decode,compute", "--", *me, "--role", "perception"]
    assert "--connect" in sim and sim[sim.index("--connect") + 1] == "/w/frames.sock"
    assert "--listen" in perception and perception[perception.index("--listen") + 1] == "/w/frames.sock"
    for cmd in (sim, perception):
        assert cmd[cmd.index("--seconds") + 1] == "7.0" and cmd[cmd.index("--deadline") + 1] == "1234.500"
    # parseable by the stage itself (what `unisched run` will exec)
    inner = ad.parse_args(sim[sim.index("--") + 3:])
    assert (inner.role, inner.connect, inner.width, inner.height) == ("sim", work / "frames.sock", 1280, 720)


def test_sequential_and_plain_command_lines_use_the_file_and_no_unisched() -> None:
    args = ad.parse_args(["--mode", "sequential", "--tenant-prefix", "x"])
    sim = ad.stage_command(args, "sim", Path("/w"), 1.0)
    perception = ad.stage_command(args, "perception", Path("/w"), 1.0)
    assert sim[:2] == [sys.executable, str(SCRIPT.resolve())] and "unisched" not in sim
    assert sim[sim.index("--output") + 1] == "/w/frames.h264" and "--connect" not in sim
    assert perception[perception.index("--input") + 1] == "/w/frames.h264" and "--listen" not in perception
    prefixed = ad.stage_command(ad.parse_args(["--unisched-socket", "/s", "--tenant-prefix", "t1"]), "sim", Path("/w"), 1.0)
    assert prefixed[prefixed.index("--tenant") + 1] == "t1ad-sim"


def test_a_failing_stage_fails_the_run_with_its_log_tail(tmp_path: Path) -> None:
    """--gpu 99 makes perception fail everywhere (no torch, no CUDA, or no such device); the orchestrator must stop
    the sim (waiting to connect) and exit 1 with the tail in the report, well before its own deadline."""
    report = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "2", "--warmup", "1", "--gpu", "99",
                        "--workdir", str(tmp_path / "work"), "--report", str(report)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT, env=child_env())
    assert p.returncode == 1, (p.stdout, p.stderr)
    r = json.loads(report.read_text())
    assert set(r) >= REPORT_KEYS and r["frames"] == 0
    failures = [e for e in r["errors"] if "stage failed (exit" in e]
    assert failures and "error" in failures[0].lower(), r["errors"]
    assert "FAILED" in p.stdout
    assert (tmp_path / "work" / "perception.log").exists()


# --------------------------------------------------------------- the sim stage on any EGL, Mesa's software one included


@pytest.mark.skipif(egl_reason() is not None, reason=str(egl_reason()))
def test_the_sim_stage_renders_and_encodes_a_whole_stream(tmp_path: Path) -> None:
    """The sim's real pipeline (EGL render, read-back, H.264 encode, framing) into a file, as the sequential mode
    writes it: one packet per frame, each with its times in order, the frames of its window flagged, then the end."""
    out, report = tmp_path / "frames.h264", tmp_path / "sim.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--role", "sim", "--output", str(out), "--seconds", "1",
                        "--warmup", "0.5", "--width", "320", "--height", "240", "--iterations", "2", "--report",
                        str(report)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=child_env())
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(report.read_text())
    with out.open("rb") as f:
        messages = list(iter(lambda: ads.read_message(f), None))
    *frames, (eos, _) = messages
    assert eos.flags & ads.FLAG_EOS and r["encoder"]
    assert len(frames) == r["packets_sent"] == r["frames_rendered"] > 0  # no B-frames: a packet per frame
    assert all(h.t_render_start <= h.t_render_end <= h.t_encode_end and data for h, data in frames)
    measured = [h for h, _ in frames if h.flags & ads.FLAG_MEASURED]
    window = r["window"]
    assert len(measured) == r["measured_frames"] > 0
    assert all(window["start"] < h.t_encode_end <= window["end"] for h in measured)


# ------------------------------------------------------------------------------------------------ GPU machine

no_gpu_here = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))


def _gpu_stack() -> None:
    for module in ("torch", "torchvision", "av", "OpenGL", "numpy"):
        pytest.importorskip(module, reason=f"{module} not installed (source .devcache/setup.sh on the GPU machine)")


def _run_e2e(tmp_path: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    report = tmp_path / "ad.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "4", "--warmup", "2", "--report", str(report), *extra],
                       capture_output=True, text=True, timeout=500, cwd=ROOT, env=child_env())
    print(p.stdout[-1500:], p.stderr[-3000:])
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(report.read_text())
    assert set(r) >= REPORT_KEYS
    assert r["fps_end_to_end"] > 0 and r["frames"] > 0
    assert set(r["latency_ms"]) == STAGES and all(v["p50"] is not None for v in r["latency_ms"].values())
    assert r["encoder"] and "NVDEC" in r["decoder"]
    assert r["gpu_util_samples"] and r["timeline"][-1][1] == r["frames"]
    assert "frames/s end to end" in p.stdout
    return r  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["colocated", "sequential"])
@pytest.mark.gpu
@no_gpu_here
def test_pipeline_runs_end_to_end_on_the_gpu(tmp_path: Path, mode: str) -> None:
    _gpu_stack()
    r = _run_e2e(tmp_path, "--mode", mode)
    assert r["mode"] == mode and not r["unisched"]
    if mode == "sequential":
        assert len(r["stage_seconds"]) == 2 and r["seconds"] == pytest.approx(sum(r["stage_seconds"]), abs=0.01)


@pytest.mark.gpu
@no_gpu_here
def test_pipeline_colocated_under_unisched(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _gpu_stack()
    d: Daemon = daemon_factory(nvml=True)
    r = _run_e2e(tmp_path, "--mode", "colocated", "--unisched-socket", d.socket, "--tenant-prefix", d.prefix)
    assert r["unisched"] and r["tenant_weights"] == {f"{d.prefix}ad-sim": 100, f"{d.prefix}ad-perception": 100}
    engines = {t["name"]: set(t.get("engines", [])) for t in d.tenants()}
    assert {"graphics", "encode"} <= engines[f"{d.prefix}ad-sim"], engines
    assert {"decode", "compute"} <= engines[f"{d.prefix}ad-perception"], engines
