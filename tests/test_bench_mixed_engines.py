"""bench/mixed_engines.py's render pairs: frames under `FrameGate` (egl_render.py --client) against the
same render unmodified under `unisched run`, and two frame clients, beside the CUDA pairs, at the same weights.

No GPU here: the pair list, the command line each member runs, the estimate the suite takes from it, verdicts
computed for the render pairs from a synthetic round, and the suite end to end with CPU stand-ins (a real daemon
with --cpu-stand-in, `unisched run` and a stand-in client on the lease protocol)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from benchrig import bench_module, readers, run_py, suites, verdicts
from conftest import ROOT, child_env, needs_freezer

mixed_pairs = bench_module("mixed_pairs")
RENDER_PAIRS = "frame+render,frame+frame"
WEIGHTS = "1:1,3:1,1:3"
RENDER_KEYS = ["frame+render 1:1", "frame+render 3:1", "frame+render 1:3", "frame+frame 1:1", "frame+frame 3:1"]


def planned(pairs: str, weights: str = WEIGHTS) -> list[str]:
    return [f"{a.spec}+{b.spec} {w[0]}:{w[1]}"
            for a, b, w in mixed_pairs.plan(mixed_pairs.parse_pairs(pairs), mixed_pairs.parse_weights(weights))]


def test_the_suite_runs_the_render_pairs_at_every_weight_beside_the_cuda_ones() -> None:
    assert planned(RENDER_PAIRS) == RENDER_KEYS  # frame+frame at 1:3 is the 3:1 run again
    default = planned(mixed_pairs.DEFAULT_PAIRS, mixed_pairs.DEFAULT_WEIGHTS)
    assert set(RENDER_KEYS) <= set(default) and "client8+app 1:1" in default and "client240+app 1:3" in default
    assert [m.spec for m in mixed_pairs.members_of(mixed_pairs.parse_pairs(RENDER_PAIRS))] == ["frame", "render"]


def test_a_frame_client_and_an_unmodified_render_run_the_same_render() -> None:
    w = mixed_pairs.Workloads(cuda=("py", "cuda.py"), render=("py", "render.py"), render_iterations=447)
    frame, render = mixed_pairs.parse_pairs("frame+render")[0]
    window = ["--start-at", "100.000", "--seconds", "8", "--report", "r.json"]
    assert frame.command("t-0", 300, "/s", 100.0, 8.0, Path("r.json"), w) == [
        "py", "render.py", "--iterations", "447", *window, "--client", "t-0", "--weight", "300", "--socket", "/s"]
    assert render.command("t-1", 100, "/s", 100.0, 8.0, Path("r.json"), w) == [
        sys.executable, "-m", "unisched", "run", "--socket", "/s", "--tenant", "t-1", "--weight", "100",
        "--engines", "graphics", "--", "py", "render.py", "--iterations", "447", *window]
    assert (frame.unit, render.unit, frame.engine) == ("frames/s", "frames/s", "graphics")
    client8, app = mixed_pairs.parse_pairs("client8+app")[0]  # the CUDA members keep their commands
    assert client8.command("c", 100, "/s", 100.0, 8.0, Path("r.json"), w)[:6] == [
        "py", "cuda.py", "--size", "4096", "--sync-every", "8"]
    assert app.command("a", 100, "/s", 100.0, 8.0, Path("r.json"), w)[10:14] == ["--engines", "compute", "--", "py"]


@pytest.mark.parametrize(("pairs", "says"), [
    ("client8+render", "pairs compute with graphics, which do not contend"),
    ("frames+render", "'frames' is none of app, clientK"),
    ("client0+app", "'client0' is none of"),
    ("frame", "'frame' is not A+B"),
])
def test_pairs_across_engines_and_unknown_members_are_refused(pairs: str, says: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(says)):
        mixed_pairs.parse_pairs(pairs)


def test_the_render_workload_takes_a_client_tenant_weight_and_socket() -> None:
    if str(ROOT / "examples" / "workloads") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples" / "workloads"))
    import egl_render  # type: ignore[import-not-found]

    args = egl_render.parse_args(["--client", "r", "--weight", "300", "--socket", "/s", "--iterations", "447"])
    assert (args.client, args.weight, args.socket, args.iterations) == ("r", 300, "/s", 447)
    assert egl_render.parse_args([]).client is None  # without --client it stays the unmodified render
    with pytest.raises(SystemExit):
        egl_render.parse_args(["--client", "r", "--calibrate-fps", "36"])


def test_dry_run_prints_the_render_plan_each_members_command_and_the_estimate(tmp_path: Path) -> None:
    got = subprocess.run([sys.executable, str(ROOT / "bench" / "mixed_engines.py"), "--out", str(tmp_path / "o"),
                          "--rounds", "3", "--pairs", RENDER_PAIRS, "--dry-run"], capture_output=True, text=True,
                         cwd=ROOT, env=child_env(), timeout=60, check=False)
    assert got.returncode == 0, got.stderr
    # 3 rounds x 7 runs (2 alone + 5 pairs) x (6 s warm-up + 8 s window + 2 s start/stop) = 336 s
    assert "3 rounds x (2 alone + 5 pairs), about 5.6 min" in got.stdout
    assert "  frame+render at 1:3, a 8.0 s window\n" in got.stdout and "frame+frame at 1:3" not in got.stdout
    lines = {line.split(" ", 3)[2]: line.split(": ", 1)[1] for line in got.stdout.splitlines()
             if line.startswith("  ") and ", at weight 1: " in line}
    frame, render = shlex.split(lines["frame"]), shlex.split(lines["render"])
    assert frame[1].endswith("examples/workloads/egl_render.py") and "--client" in frame and "unisched" not in frame
    assert render[1:4] == ["-m", "unisched", "run"] and render[render.index("--") + 2] == frame[1]
    assert not (tmp_path / "o").exists()


def test_the_suite_estimate_counts_the_render_pairs() -> None:
    suite = suites.BY_NAME["mixed"]
    # 5 members alone + 13 pairs (client8+app, client240+app, frame+render at 3 weights; two A+A pairs at 2), each
    # with 6 s of warm-up and the overhead; windows of 8 s, but client240+app's of 24 cycles of ~0.4 s turns:
    # 19.0 s at 1:1, 12.7 at 3:1, 38.0 at 1:3
    windows = 15 * 8 + 19.0 + 12.7 + 38.0
    assert suite.round_minutes == pytest.approx((18 * (6 + mixed_pairs.RUN_OVERHEAD_S) + windows) / 60, abs=0.05)
    got = run_py("mixed", "--dry-run", "--rounds", "3")
    assert got.returncode == 0, got.stderr
    assert f"mixed: 3 rounds, about {3 * suite.round_minutes:g} min" in got.stdout
    assert "FrameGate" in run_py("--list").stdout


def synthetic_round(k: int) -> dict[str, Any]:
    """results.json of one round of the render pairs as mixed_engines.py writes it: alone rates, then each pair's
    rates; frame+render 3:1 over-serves the frame client by 3 points in round 2."""
    me = bench_module("mixed_engines")
    alone = {"frame": 36.0, "render": 37.0}
    runs: dict[str, list[dict[str, Any]]] = {}
    for key in planned(RENDER_PAIRS):
        pair, weights = key.split(" ")
        a, b = pair.split("+")
        wa, wb = (int(x) for x in weights.split(":"))
        share = wa / (wa + wb) + (0.03 if key == "frame+render 3:1" and k == 2 else 0.0)
        rates = [0.99 * share * alone[a], 0.99 * (1 - share) * alone[b]]
        runs[key] = [me.score(rates, [alone[a], alone[b]], (wa, wb))]
    return {"meta": {}, "solo": [alone], "runs": runs, "verdicts": {k: me.verdict(r) for k, r in runs.items()}}


def test_verdicts_are_computed_for_the_render_pairs_from_every_round(tmp_path: Path) -> None:
    rounds = []
    for k in (1, 2, 3):
        folder = tmp_path / f"round-{k}" / "mixed"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(synthetic_round(k)))
        cases, _ = readers.read_mixed_engines(folder.parent)
        rounds.append(cases)
    got = verdicts.judge_all(suites.PAIR_TARGETS, rounds)
    assert sorted({v.case for v in got}) == sorted(RENDER_KEYS)
    assert len(got) == 4 * len(RENDER_KEYS)
    by = {(v.case, v.target): v for v in got}
    miss = by[("frame+render 3:1", "error, worst round")]
    assert miss.passed is False and miss.value == pytest.approx(3.0) and "by 1 pts" in miss.detail
    assert by[("frame+render 3:1", "error, median round")].passed is True
    assert by[("frame+render 3:1", "guarantee")].passed is False  # the render side fell 3 points under its share
    assert by[("frame+frame 1:1", "sum")].passed is True and by[("frame+frame 1:1", "sum")].value == pytest.approx(0.99)


@needs_freezer
@pytest.mark.root
def test_the_render_pairs_with_cpu_standins_run_end_to_end(tmp_path: Path) -> None:
    """frame+render at 3:1 through bench/run.py mixed --cpu-standin: a stand-in frame client on the graphics lease
    beside a stand-in render under `unisched run --engines graphics`, a real daemon per run. What is checked is that
    every round is scored and judged, not the split (a loaded 2-core host is no GPU)."""
    got = run_py("mixed", "--cpu-standin", "--rounds", "1", "--out", str(tmp_path), "--", "--pairs", "frame+render",
                 "--weights", "3:1", "--seconds", "2", "--warmup", "1.5", timeout=240)
    assert got.returncode in (0, 1), got.stdout + got.stderr  # 1: a target missed on this loaded machine
    s = json.loads((tmp_path / "mixed" / "summary.json").read_text())
    (rnd,) = s["rounds"]
    assert rnd["steps"][0]["rc"] in (0, 1) and "--render-workload" in rnd["steps"][0]["argv"]
    m = rnd["cases"]["frame+render 3:1"]
    assert m["normalized_a"] > 0 and m["normalized_b"] > 0 and isinstance(m["guarantee"], bool)
    assert rnd["cases"]["alone"]["frame (round 1)"] > 0 and rnd["cases"]["alone"]["render (round 1)"] > 0
    by = {v["target"]: v for v in s["verdicts"] if v["case"] == "frame+render 3:1"}
    assert by["sum"]["value"] == pytest.approx(m["sum"]) and by["guarantee"]["passed"] is m["guarantee"]
    with tarfile.open(tmp_path / "mixed" / "raw.tar.xz") as tar:  # each run's daemon log kept, for diagnosis
        logs = [n for n in tar.getnames() if n.endswith("daemon.log")]
    assert any("frame+render-3_1" in n for n in logs) and len(logs) == 3  # frame and render alone, then the pair


@pytest.mark.gpu
def test_the_render_workload_as_a_frame_client_on_the_gpu(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """On the GPU machine: egl_render.py --client renders every frame inside FrameGate, governed by a real daemon,
    and reports the GPU time its GL queries measured."""
    from test_gpu import _gpu_reason

    if _gpu_reason() is not None:
        pytest.skip(str(_gpu_reason()))
    pytest.importorskip("OpenGL", reason="PyOpenGL not installed (source .devcache/setup.sh on the GPU machine)")
    d = daemon_factory(nvml=True)
    report, tenant = tmp_path / "frame.json", f"{d.prefix}frame"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "workloads" / "egl_render.py"), "--iterations", "50",
                        "--seconds", "3", "--warmup", "10", "--report", str(report), "--client", tenant,
                        "--weight", "300", "--socket", d.socket], capture_output=True, text=True, timeout=240,
                       cwd=ROOT, env=child_env())
    assert p.returncode == 0, p.stdout[-1000:] + p.stderr[-2000:]
    r = json.loads(report.read_text())
    assert r["throughput"] > 0 and r["client"] == tenant and r["weight"] == 300
    assert r["governed"] is True and r["gpu_seconds_reported"] > 0


def test_the_bench_takes_the_turns_the_daemon_gives_by_default() -> None:
    """The window of a long-step pair is sized from the turns its client earns: the daemon's defaults, copied (the
    bench runs before the package is importable)."""
    from unisched.policy.tuning import TUNING
    from unisched.scheduler.config import DaemonConfig

    assert DaemonConfig().slice_ms / 1000 == mixed_pairs.SLICE_S
    assert DaemonConfig().lease_max_run_ms / 1000 == mixed_pairs.MAX_RUN_S
    assert TUNING.run_units == mixed_pairs.RUN_UNITS


def test_short_step_pairs_keep_the_window_and_long_step_pairs_hold_enough_cycles() -> None:
    m = mixed_pairs.Member
    assert mixed_pairs.window_s(m("client8"), m("app"), (1, 3), 8.0) == 8.0  # turns of a slice: no longer window
    assert mixed_pairs.window_s(m("frame"), m("render"), (1, 3), 8.0) == 8.0
    turn = mixed_pairs.turn_s(m("client240"))
    assert 0.35 < turn < 0.45  # 8 steps of ~50 ms
    for w, share in (((1, 1), 0.5), ((3, 1), 0.75), ((1, 3), 0.25)):
        cycle = turn / share  # the client's turn, then the app's time to match its weight
        assert mixed_pairs.window_s(m("client240"), m("app"), w, 8.0) == pytest.approx(24 * cycle)


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_where_a_window_cuts_the_cycles_moves_a_share_by_at_most_the_stated_bound(share: float) -> None:
    """WINDOW_CYCLES' docstring: a side of share s that runs in turns reads at most s(1-s)/N off over N cycles,
    whatever the phase. An 8 s window holds 4-5 cycles of 50 ms steps at 1:3: enough for the cut alone to move a
    share by several points."""
    def read(window: float, cycle: float, phase: float) -> float:
        turn, steps = share * cycle, 4000
        work = 0.0
        for k in range(steps):  # the side runs at full rate in [n*cycle, n*cycle + turn)
            t = phase + window * (k + 0.5) / steps
            work += (t % cycle) < turn
        return work / steps
    n = mixed_pairs.WINDOW_CYCLES
    worst = max(abs(read(n * 1.0, 1.0, p / 50) - share) for p in range(50))
    assert worst <= share * (1 - share) / n + 2e-3
    assert share * (1 - share) / n <= 0.0105  # the bar's worst round is 2 points: a cut leaves most of it
    short = max(abs(read(4.5, 1.0, p / 50) - share) for p in range(50))
    assert short > 0.02  # with few cycles the cut alone can take a share out of the bar


def test_a_late_member_is_scored_over_the_seconds_both_ran_and_a_sliver_stops_the_run() -> None:
    """As gpu_pairs scores a pair: the client's first frame 2 s into an 8 s window, the render alone (36 frames/s)
    until then and at 27 beside it; over its whole window the render would read 29.25. A member that measured under
    half its window gives no rate at all."""
    engines = bench_module("mixed_engines")

    def report(late_s: float, before: float, after: float, changes_at: float) -> dict[str, Any]:
        timeline, items, t = [], 0.0, late_s
        while t <= 8.0:
            timeline.append([t, items])
            items += 0.5 * (before if t < changes_at else after)
            t += 0.5
        window = {"seconds": 8.0 - late_s, "start_at": 100.0, "end_at": 108.0, "late_s": late_s, "timeline": timeline}
        return {"throughput": timeline[-1][1] / (8.0 - late_s), "window": window}

    client, render = report(2.0, 9.0, 9.0, 0.0), report(0.0, 36.0, 27.0, 2.0)
    assert render["throughput"] == pytest.approx(29.25, abs=0.3)
    rates = engines.rates_of([client, render], "t")
    assert rates == pytest.approx([9.0, 27.0], rel=0.01)
    on_time = [report(0.2, 9.0, 9.0, 0.0), report(0.0, 27.0, 27.0, 0.0)]
    assert engines.rates_of(on_time, "t") == [r["throughput"] for r in on_time]
    with pytest.raises(SystemExit, match=r"t: member 0 measured 0\.5 s of its 8 s window \(started 7\.5 s late\)"):
        engines.rates_of([report(7.5, 9.0, 9.0, 0.0), render], "t")
