"""examples/cloud_gaming.py and its modules in examples/workloads: the metric math, frame pacing and unisched
command lines on synthetic input (CPU), the orchestrator's deadline and failure handling with stand-in instances
(CPU), and end to end on the GPU machine."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from conftest import ROOT, Daemon, child_env, egl_reason
from test_gpu import _gpu_reason


def _load() -> ModuleType:
    """Load the example by path: examples/ is a script folder, not a package."""
    spec = importlib.util.spec_from_file_location("cloud_gaming", ROOT / "examples" / "cloud_gaming.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


cg = _load()
import _children as children  # noqa: E402  (examples/workloads, on the path once the example is loaded)
import _cloud_daemon as cloud_daemon  # noqa: E402
import _cloud_player as player  # noqa: E402
import _pacing as pacing  # noqa: E402
from _nvml_sampler import NvmlSampler  # noqa: E402

REPORT_KEYS = {"scenario", "instances", "unisched", "memory_cap", "fps_target", "width", "height", "encoder",
               "per_instance", "fairness_min_over_max", "fps_mean_all", "hog", "tenants", "errors"}
INSTANCE_KEYS = {"index", "tenant", "fps_mean", "fps_min", "fps_1pct_low", "frames", "encoder", "memory_bytes",
                 "refusals", "timeline", "error"}


def test_help_exits_0_and_shows_both_example_command_lines() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "cloud_gaming.py"), "--help"], capture_output=True,
                       text=True, timeout=60, env=child_env())
    assert p.returncode == 0, p.stderr
    assert "--instances 8" in p.stdout
    assert "--instances 16 --unisched-socket" in p.stdout and "--memory-cap 4GiB --hog-instance 3" in p.stdout
    for flag in ("--role", "--hog-mib", "--fps", "--iterations", "--encoder", "--grace"):
        assert flag in p.stdout


# ------------------------------------------------------------------------------------------------ metrics


def steady(start: float, end: float, fps: float) -> list[float]:
    """Completions every 1/fps from one frame before `start`, offset half a frame off the bin edges."""
    period = 1.0 / fps
    n = round((end - start) * fps)
    return [start + (k + 0.5) * period for k in range(-1, n)]


def test_fps_min_is_the_worst_second_and_a_single_hitch_does_not_move_the_1pct_low() -> None:
    times = [t for t in steady(100.0, 103.0, 50) if not 101.2 < t < 101.7]  # 0.5 s stall in the second second
    s = pacing.frame_stats(times, 100.0, 103.0)
    assert s.frames == 125
    assert s.fps_mean == pytest.approx(125 / 3)
    assert [fps for _, fps in s.timeline] == [50.0, 25.0, 50.0]
    assert s.fps_min == 25.0
    # 126 frame times (125 frames + the frame in progress): one 0.52 s stall is under 1% of them
    assert s.fps_1pct_low == pytest.approx(50.0)


def test_1pct_low_is_the_rate_of_the_99th_percentile_frame_time() -> None:
    gaps = [0.010] * 90 + [0.050] * 10
    times, t = [0.0], 0.0
    for g in gaps:
        t += g
        times.append(t)
    s = pacing.frame_stats(times, 0.0, t)
    assert s.frames == 100
    assert s.frame_time_p99_ms == pytest.approx(50.0)
    assert s.fps_1pct_low == pytest.approx(20.0)


def test_a_stall_at_the_end_of_the_window_counts() -> None:
    times = steady(0.0, 1.0, 50)  # frames stop one second into a three-second window
    s = pacing.frame_stats(times, 0.0, 3.0)
    assert s.fps_min == 0.0
    assert s.fps_1pct_low == pytest.approx(1 / (3.0 - times[-1]))


def test_no_frames_at_all() -> None:
    s = pacing.frame_stats([], 0.0, 4.0)
    assert (s.frames, s.fps_mean, s.fps_min) == (0, 0.0, 0.0)
    assert s.fps_1pct_low == pytest.approx(0.25)


def test_fairness_is_min_over_max() -> None:
    assert pacing.fairness([60.0, 30.0, 45.0]) == pytest.approx(0.5)
    assert pacing.fairness([60.0, 60.0]) == 1.0
    assert pacing.fairness([0.0, 0.0]) == 0.0
    assert pacing.fairness([]) is None


def test_a_player_gone_from_the_final_view_keeps_its_last_polled_row() -> None:
    polls = [{"t": 0.0, "tenants": {"cg-0": {"over_memory": False}, "cg-1": {"over_memory": False}}},
             {"t": 2.0, "tenants": {"cg-0": {"over_memory": True, "refusals": {"memory": 1}}}}]
    assert cg.last_polled(polls, "cg-0") == {"over_memory": True, "refusals": {"memory": 1}}
    assert cg.last_polled(polls, "cg-1") == {"over_memory": False}
    assert cg.last_polled(polls, "cg-2") is None and cg.last_polled([], "cg-0") is None


def test_a_player_ready_in_time_is_not_late_however_long_the_scheduler_held_its_first_frame() -> None:
    assert cg.ready_late({"ready_s": -3.2, "first_frame_s": 1.4, "late_s": 0.0}) == 0.0
    assert cg.ready_late({"ready_s": 0.8, "first_frame_s": 1.1, "late_s": 1.1}) == 0.8
    assert cg.ready_late({"late_s": 0.3}) == 0.3 and cg.ready_late({}) is None


def test_refusals_are_counted_for_this_run_only() -> None:
    assert cloud_daemon.refusal_delta({"memory": 2, "graphics": 1}, {"memory": 3, "graphics": 1, "nvenc": 4}) == {
        "memory": 1, "nvenc": 4}
    assert cloud_daemon.refusal_delta(None, {"memory": 1}) == {"memory": 1}


# ------------------------------------------------------------------------------------------------- pacing


@pytest.mark.parametrize(("slot", "now_in_periods", "expected"), [
    (5, 5.5, 6),   # on time: the next slot, after a sleep
    (5, 6.1, 6),   # a little late: the next slot at once
    (5, 8.3, 8),   # two slots missed: the one under way, no burst to catch up
    (-3, -2.5, -2),  # warm-up slots before t0 work the same
])
def test_next_slot(slot: int, now_in_periods: float, expected: int) -> None:
    period = 1 / 60
    assert pacing.next_slot(slot, 10.0 + now_in_periods * period, 10.0, period) == expected


def test_first_slot_is_the_next_one_to_begin() -> None:
    assert pacing.first_slot(10.0, 0.1, 9.75) == -2
    assert pacing.first_slot(10.0, 0.1, 10.0) == 0
    assert pacing.first_slot(10.0, 0.1, 10.01) == 1


class FakeClock:
    """Time that moves only when the loop sleeps or a frame runs: pacing tested without waiting."""

    def __init__(self, now: float, frame_costs: list[float]) -> None:
        self.now, self.costs, self.sleeps = now, frame_costs, 0

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s > 0
        self.sleeps += 1
        self.now += s

    def frame(self) -> None:
        self.now += self.costs.pop(0) if self.costs else 0.03


def test_paced_loop_holds_absolute_deadlines_and_skips_missed_slots() -> None:
    clock = FakeClock(9.95, [0.03, 0.03, 0.25])  # the third frame overruns two and a half periods
    p = pacing.paced_loop(clock.frame, 10.0, 11.0, 10.0, 0.1, clock=clock.time, sleep=clock.sleep)
    assert p.completions[:3] == pytest.approx([10.03, 10.13, 10.45])
    # the frame after the overrun starts at once (slot 4 began at 10.4), then the grid again: no drift
    assert p.completions[3] == pytest.approx(10.48)
    assert p.completions[4:] == pytest.approx([10.53, 10.63, 10.73, 10.83, 10.93])
    assert p.skipped_slots == 1  # slot 3 (10.3) had no frame start in it
    assert clock.now == pytest.approx(11.03)  # the last slot began at the window's end; none after it


def test_uncapped_runs_frames_back_to_back() -> None:
    clock = FakeClock(0.0, [])
    p = pacing.paced_loop(clock.frame, 0.0, 0.31, 0.0, 0.0, clock=clock.time, sleep=clock.sleep)
    assert clock.sleeps == 0
    assert p.completions == pytest.approx([0.03 * k for k in range(1, 11)])


def test_on_frame_sees_every_completion() -> None:
    seen: list[float] = []
    clock = FakeClock(0.0, [])
    p = pacing.paced_loop(clock.frame, 0.0, 0.2, 0.0, 0.05, seen.append, clock=clock.time, sleep=clock.sleep)
    assert seen == p.completions and len(seen) == 4


# ------------------------------------------------------------------------------------ orchestrator argv


def test_the_cpu_meter_counts_only_frames_in_the_window() -> None:
    """CPU seconds over wall seconds between the first and last frame done in the window; a warm-up frame before it
    counts for nothing, and fewer than two frames in it measure nothing; its user-mode part the same way."""
    cpu, user = iter([5.0, 5.5, 6.5]), iter([4.0, 4.1, 4.5])
    meter = pacing.CpuMeter(start_at=100.0, cpu=lambda: next(cpu), user=lambda: next(user))
    meter.on_frame(99.0)  # warm-up: not read
    assert meter.cores() is None
    meter.on_frame(100.0)
    assert meter.cores() is None  # one frame: no span yet
    meter.on_frame(101.0)
    meter.on_frame(102.0)
    assert meter.cores() == pytest.approx((6.5 - 5.0) / 2.0)
    assert meter.user_cores() == pytest.approx((4.5 - 4.0) / 2.0)
    assert cg.cpu_total([{"cpu_cores": 0.5}, {"cpu_cores": None}, {}]) == 0.5 and cg.cpu_total([{}]) is None


def test_run_and_set_limit_command_lines_parse_with_the_unisched_cli() -> None:
    from unisched.cli.parser import build_parser

    run = children.run_argv("py", "/tmp/u.sock", "cg-3", 100, "graphics,encode", ["py", "game.py", "--fps", "60"])
    assert run[:3] == ["py", "-m", "unisched"]
    ns = build_parser().parse_args(run[3:])
    assert (ns.command, ns.socket, ns.tenant, ns.weight) == ("run", "/tmp/u.sock", "cg-3", 100)
    assert ns.engines == ["graphics", "encode"]
    assert ns.cmd == ["--", "py", "game.py", "--fps", "60"]

    lim = cloud_daemon.set_limit_argv("py", "/tmp/u.sock", "cg-3", "4GiB")
    ns = build_parser().parse_args(lim[3:])
    assert (ns.command, ns.tenant, ns.memory) == ("set-limit", "cg-3", 4 << 30)
    assert build_parser().parse_args(cloud_daemon.set_limit_argv("py", "/s", "cg-3", "-1")[3:]).memory == -1


def orchestrator_args(*extra: str) -> argparse.Namespace:
    return cg.parse_args(["--instances", "4", "--seconds", "3", "--fps", "30", "--iterations", "7", *extra])  # type: ignore[no-any-return]


def test_instance_command_lines_share_the_window_and_only_the_hog_hogs(tmp_path: Path) -> None:
    args = orchestrator_args("--hog-instance", "2", "--hog-mib", "5000")
    argvs = [cg.instance_argv(args, i, 1234.5, tmp_path / f"{i}.json") for i in range(4)]
    parsed = [cg.parse_args(a[2:]) for a in argvs]
    assert all(p.role == "instance" and p.start_at == 1234.5 and p.seconds == 3 for p in parsed)
    assert all(p.fps == 30 and p.iterations == 7 and (p.width, p.height) == (1280, 720) for p in parsed)
    assert [p.hog_mib for p in parsed] == [0, 0, 5000, 0]
    assert [p.phase for p in parsed] == [0.0, 0.25, 0.5, 0.75]
    assert [p.report for p in parsed] == [tmp_path / f"{i}.json" for i in range(4)]
    assert all(p.player_cpus == () for p in parsed)
    pinned = cg.instance_argv(orchestrator_args("--player-cpus", "0"), 0, 1234.5, tmp_path / "0.json")
    assert cg.parse_args(pinned[2:]).player_cpus == (0,)


@pytest.mark.parametrize("bad", [
    ["--memory-cap", "4GiB"],  # nothing would enforce it
    ["--hog-instance", "1"],  # without --hog-mib
    ["--hog-mib", "100"],  # without --hog-instance
    ["--hog-instance", "4", "--hog-mib", "100"],  # out of range
    ["--unisched-socket", "/s", "--memory-cap", "lots"],
    ["--width", "1281"],  # odd: no 4:2:0 encode
    ["--player-cpus", "0,x"],
    ["--player-cpus", str(max(os.sched_getaffinity(0)) + 1)],  # a CPU this process may not run on
])
def test_bad_orchestrator_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        orchestrator_args(*bad)
    assert e.value.code == 2


# --------------------------------------------------------------------- orchestrator with stand-in players

FAKE = ("import json, sys\n"
        "fps = float(sys.argv[2])\n"
        "json.dump({'pid': 1, 'fps_mean': fps, 'fps_min': fps - 1, 'fps_1pct_low': fps - 2, 'frames': 3,\n"
        "           'encoder': 'fake264', 'timeline': [[0.0, fps]], 'window': {'late_s': 0.0}, 'cpu_cores': fps / 100},\n"
        "          open(sys.argv[1], 'w'))\n")


def run_orchestrator(tmp_path: Path, players: list[list[str]], *extra: str) -> tuple[int, dict, float]:  # type: ignore[type-arg]
    args = cg.parse_args(["--instances", str(len(players)), "--seconds", "0.2", "--warmup", "0.1", "--grace", "1",
                          "--out", str(tmp_path / "out"), "--report", str(tmp_path / "report.json"), *extra])
    t = time.monotonic()
    rc = cg.orchestrate(args, lambda a, i, start_at, report: [sys.executable, *players[i], str(report)])
    return rc, json.loads((tmp_path / "report.json").read_text()), time.monotonic() - t


def test_orchestrator_collects_reports_and_scores_fairness(tmp_path: Path) -> None:
    rc, r, _ = run_orchestrator(tmp_path, [["-c", FAKE.replace("sys.argv[2]", "'60'")],
                                           ["-c", FAKE.replace("sys.argv[2]", "'30'")]])
    assert rc == 0, r["errors"]
    assert r.keys() >= REPORT_KEYS
    assert all(e.keys() >= INSTANCE_KEYS for e in r["per_instance"])
    assert [e["fps_mean"] for e in r["per_instance"]] == [60.0, 30.0]
    assert r["fairness_min_over_max"] == pytest.approx(0.5)
    assert r["fps_mean_all"] == pytest.approx(45.0)
    assert r["encoder"] == "fake264" and r["unisched"] is False and r["hog"] is None and r["errors"] == []
    assert r["cpu_cores_total"] == pytest.approx(0.9) and r["host_cores"] == os.cpu_count()  # 0.6 + 0.3 cores
    # NVML's view of the GPU over the window, or why there is none (no driver here)
    assert (r["gpu_busy"] is None and "NVML" in r["gpu_busy_error"]) if r["gpu_busy_error"] else 0 <= r["gpu_busy"] <= 1


def test_gpu_busy_is_the_mean_of_the_samples_inside_the_window() -> None:
    s = NvmlSampler(0)
    s.samples = [[9.9, 10.0, 0.0], [10.0, 90.0, 0.0], [15.0, 100.0, 0.0], [20.0, 80.0, 0.0], [20.1, 0.0, 0.0]]
    assert s.busy(10.0, 20.0) == pytest.approx(0.9)
    assert s.busy(30.0, 40.0) is None  # no sample in the window


def test_a_failed_instance_fails_the_run_with_its_log_tail(tmp_path: Path) -> None:
    rc, r, _ = run_orchestrator(tmp_path, [["-c", FAKE.replace("sys.argv[2]", "'60'")],
                                           ["-c", "import sys; print('no EGL device here'); sys.exit(2)"]])
    assert rc == 1
    assert r["per_instance"][1]["fps_mean"] == 0.0 and r["per_instance"][1]["error"] == "exit status 2"
    assert r["fairness_min_over_max"] == 0.0
    [err] = r["errors"]
    assert err["instance"] == 1 and "no EGL device here" in err["log_tail"]


def test_a_hung_instance_is_killed_at_the_deadline(tmp_path: Path) -> None:
    rc, r, took = run_orchestrator(tmp_path, [["-c", "import time; time.sleep(120)"]])
    assert rc == 1
    assert took < 30  # 0.1 s warm-up + 0.2 s window + 1 s grace, then SIGTERM: nowhere near the 120 s it wanted
    assert r["per_instance"][0]["error"] == "killed at the deadline"
    assert r["errors"][0]["error"] == "killed at the deadline"


# ------------------------------------------------------------------- on any EGL, Mesa's software one included


egl_here = pytest.mark.skipif(egl_reason() is not None, reason=str(egl_reason()))
SMALL = ("--width", "320", "--height", "240", "--iterations", "2", "--fps", "30", "--seconds", "2")
"""Players cheap enough for a loaded 2-core machine's CPU. The warm-ups cover every player's start (Python, PyAV,
EGL and, under the daemon, `unisched run`) with room to spare, as a player ready late is an error: about 2 s alone
under two CPU hogs; under a daemon without a GPU signal, which slices the CPU by weight from the start, the weight-1
player of 1:2:4 was ready 11-14.5 s after it started, so that warm-up is twice that."""
WARMUP_S, DAEMON_WARMUP_S = "15", "30"


@egl_here
def test_players_render_encode_and_report_on_any_egl(tmp_path: Path) -> None:
    """The players' real pipeline (EGL render, read-back, H.264 encode, pacing, the report), and the hog's
    allocation and both its probes, where the EGL display may be a software one."""
    p, r = run_example(tmp_path, "--instances", "2", *SMALL, "--warmup", WARMUP_S, "--hog-instance", "1", "--hog-mib", "16",
                       "--hog-at", "0.3", "--probe-after", "0.5")
    assert p.returncode == 0, r["errors"]
    assert r.keys() >= REPORT_KEYS and r["unisched"] is False and r["gpu"]
    for e in r["per_instance"]:
        assert e.keys() >= INSTANCE_KEYS and e["error"] is None
        assert e["frames"] > 0 and e["fps_mean"] > 0 and e["encoder"] and e["cpu_cores"] > 0
        assert 0 <= e["cpu_user_cores"] <= e["cpu_cores"] + 0.05  # (the user part is read in 10 ms clock ticks)
        assert sum(1 for _, fps in e["timeline"] if fps > 0) >= 1
    hog = r["hog"]
    assert hog["allocated"] and hog["buffers"] == 1, hog
    for probe in (hog["probe_in_process"], hog["probe_new_process"]):
        software = "llvmpipe" in str(r["gpu"])  # no GPU session to refuse: the probes say a software one opened
        assert probe["opened"] is not software and (probe["error"] == player.SOFTWARE_ONLY) is software, probe


@egl_here
def test_players_as_tenants_of_a_real_daemon_get_their_weights_and_caps(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What the cloud-gaming suite runs under the daemon: each player a tenant (`unisched run`) in weight groups
    1:2:4, its memory cap set before the window, the daemon's view in the report."""
    d: Daemon = daemon_factory("--slice-ms", "50")
    p, r = run_example(tmp_path, "--instances", "3", *SMALL, "--warmup", DAEMON_WARMUP_S, "--weights", "1,2,4",
                       "--unisched-socket", d.socket,
                       "--tenant-prefix", f"{d.prefix}cg-", "--memory-cap", "1GiB")
    assert p.returncode == 0, r["errors"]
    assert r["unisched"] is True and r["memory_cap_bytes"] == 1 << 30
    names = [f"{d.prefix}cg-{i}" for i in range(3)]
    assert [e["tenant"] for e in r["per_instance"]] == names
    assert [e["weight"] for e in r["per_instance"]] == [100, 200, 400]
    assert {t["name"] for t in r["tenants"]} <= set(names) and r["daemon_timeline"]
    for e in r["per_instance"]:
        assert e["error"] is None  # frames may be 0: weight 1 of 7 on a loaded CPU, in a 2 s window
        assert e["memory_cap_applied_s"] is not None and e["memory_cap_applied_s"] < 0  # before the window
        assert e["over_memory"] is False and e["refusals"] == {}  # the daemon's view of it, final or last polled
    assert sum(e["frames"] for e in r["per_instance"]) > 0


# --------------------------------------------------------------------------------------------- on the GPU

def run_example(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:  # type: ignore[type-arg]
    pytest.importorskip("OpenGL", reason="PyOpenGL not installed (source .devcache/setup.sh on the GPU machine)")
    pytest.importorskip("av", reason="PyAV not installed (source .devcache/setup.sh on the GPU machine)")
    report = tmp_path / "cg.json"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "cloud_gaming.py"), *args, "--report", str(report),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=child_env())
    print(p.stdout[-3000:], p.stderr[-2000:])
    assert report.exists(), p.stderr[-2000:]
    return p, json.loads(report.read_text())


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_two_players_without_a_scheduler(tmp_path: Path) -> None:
    p, r = run_example(tmp_path, "--instances", "2", "--seconds", "4", "--warmup", "8")
    assert p.returncode == 0, r["errors"]
    assert r.keys() >= REPORT_KEYS and r["unisched"] is False
    assert "NVIDIA" in (r["gpu"] or ""), r["gpu"]  # the GPU, not a software rasterizer
    for e in r["per_instance"]:
        assert e.keys() >= INSTANCE_KEYS
        assert e["fps_mean"] > 0 and e["frames"] > 0 and e["encoder"] and e["fps_1pct_low"] > 0
        assert 0 < e["cpu_cores"] < 2  # one player: its render loop and one encoder thread
    assert 0 < r["fairness_min_over_max"] <= 1 and 0 < r["cpu_cores_total"] <= r["host_cores"]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_over_cap_player_is_refused_a_new_session_others_play_on(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d: Daemon = daemon_factory("--slice-ms", "50", nvml=True)
    p, r = run_example(tmp_path, "--instances", "2", "--seconds", "8", "--warmup", "12", "--unisched-socket", d.socket,
                       "--tenant-prefix", f"{d.prefix}cg-", "--memory-cap", "1GiB", "--hog-instance", "1",
                       "--hog-mib", "2048")
    assert p.returncode == 0, r["errors"]
    assert r["unisched"] is True and r["memory_cap_bytes"] == 1 << 30
    assert {t["name"] for t in r["tenants"]} == {f"{d.prefix}cg-0", f"{d.prefix}cg-1"}
    hog, other = r["hog"], r["per_instance"][0]
    assert hog["allocated"], hog
    assert hog["daemon_over_memory"], hog  # the daemon saw it over its cap (NVML per-process memory)
    assert (hog["daemon_refusals"] or {}).get("memory", 0) >= 1, hog
    assert hog["probe_new_process"] and not hog["probe_new_process"]["opened"], hog
    assert other["fps_mean"] > 0 and other["over_memory"] is False
