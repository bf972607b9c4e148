"""The contention calibration of bench/gpu_pairs.py --calibrate-out (the file `unisched calibrate` writes too).

Runs the real orchestration with CPU stand-ins (bench/cpu_standin.py) and short windows, and checks that
the file the daemon reads (STATE_DIR/contention.json) has the agreed shape, merges, and reaches the daemon.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
STANDIN = f"{sys.executable} bench/cpu_standin.py"
GPU = "Test GPU"
ENTRY_KEYS = {"compute_kept", "graphics_kept", "measured_at", "command", "render_iterations"}


def _load(name: str) -> ModuleType:
    """Load a bench script by path (bench/ is a script folder; it puts itself on sys.path for its imports)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


gp = _load("gpu_pairs")
runs = sys.modules["pairs_runs"]  # the runs gpu_pairs makes
scoring = sys.modules["scoring"]  # the module gpu_pairs scores with
pairs_plan = sys.modules["pairs_plan"]  # its pairs and what their runs derive
pairs_calibration = sys.modules["pairs_calibration"]  # what it prepares, and the contention file


def standin_args(paced: bool = False) -> list[str]:
    """CPU stand-ins; paced ones keep a rate the host's load hardly moves (their kept fractions stay near 1, inside
    the range the calibration accepts, on a busy machine)."""
    pace = " --item-ms 5" if paced else ""
    return ["--workload-cmd-cuda", f"{STANDIN} --kind cuda{pace}", "--workload-cmd-render", f"{STANDIN} --kind render{pace}"]


def check_shape(state_dir: Path, gpu: str = GPU) -> dict[str, Any]:
    """The file as agreed with the daemon; returns this GPU's entry."""
    data = json.loads((state_dir / "contention.json").read_text())
    assert set(data) == {"version", "gpus"} and data["version"] == 1
    entry = data["gpus"][gpu]
    assert set(entry) == ENTRY_KEYS
    for key in ("compute_kept", "graphics_kept"):
        assert isinstance(entry[key], float) and entry[key] > 0
    dt.datetime.strptime(entry["measured_at"], "%Y-%m-%dT%H:%M:%SZ")
    assert entry["command"]
    assert entry["render_iterations"] is None  # a replaced render workload gets no --iterations
    # and the daemon's own reader takes it
    from unisched.scheduler.state import StateStore

    assert StateStore(state_dir).measured_contention(gpu) == (entry["compute_kept"], entry["graphics_kept"])
    return entry


# ----------------------------------------------------------------------------------- kept fractions


def _group(setup: str, *tenants: tuple[str, float | None]) -> Any:
    results = [runs.TenantResult(f"t-{k}", k, None, [], 0, None if tp is None else {"throughput": tp}, "", None)
               for k, tp in tenants]
    return runs.GroupResult("x", setup, results, 0.0, 0.0)


def test_kept_fractions() -> None:
    kept = pairs_calibration.kept_fractions(_group("alone", ("cuda", 604.6)), _group("alone", ("render", 35.9)),
                             _group("no scheduler", ("cuda", 82.9), ("render", 31.1)))
    assert kept == pytest.approx((0.13712, 0.86630), abs=1e-4)
    with pytest.raises(pairs_calibration.ContentionFileError):
        pairs_calibration.kept_fractions(_group("alone", ("cuda", 0.0)), _group("alone", ("render", 35.9)),
                          _group("no scheduler", ("cuda", 82.9), ("render", 31.1)))
    with pytest.raises(pairs_calibration.ContentionFileError):
        pairs_calibration.kept_fractions(_group("alone", ("cuda", 604.6)), _group("alone", ("render", 35.9)),
                          _group("no scheduler", ("cuda", 82.9), ("render", None)))


def _timed(kind: str, late_s: float, rate_alone: float, rate_shared: float, partner_from: float) -> Any:
    """A report whose timeline runs at `rate_alone` until its partner's first completion, then at `rate_shared`."""
    points, items, t = [], 0.0, late_s
    while t <= 12.0:
        points.append([round(t, 3), round(items)])
        items += 0.5 * (rate_alone if t < partner_from else rate_shared)
        t += 0.5
    return runs.TenantResult(f"t-{kind}", kind, None, [], 0, {"throughput": points[-1][1] / (12.0 - late_s),
                                                            "window": {"late_s": late_s, "timeline": points}}, "", None)


def test_a_late_partner_is_scored_over_the_seconds_both_ran() -> None:
    """The H200's no-scheduler trainer + render runs: the trainer's first step 4.5 s into a 12 s window, the render
    alone (35 frame/s) until then and at 31.5 beside it. Over the whole window the render 'kept' 0.93; it keeps 0.88."""
    together = runs.GroupResult("x", "no scheduler", [_timed("cuda", 4.5, 330.0, 330.0, 0.0),
                                                     _timed("render", 0.0, 35.0, 31.5, 4.5)], 0.0, 0.0)
    assert together.common_window() == (4.5, 12.0)
    cuda, render = together.throughputs()
    assert cuda == pytest.approx(330.0, rel=0.01) and render == pytest.approx(31.5, rel=0.01)
    assert together.tenants[1].throughput == pytest.approx(32.8, abs=0.3)  # what the whole window said
    kept = pairs_calibration.kept_fractions(_group("alone", ("cuda", 1650.0)), _group("alone", ("render", 35.8)), together)
    assert kept == pytest.approx((0.2, 0.88), abs=0.005)
    assert together.to_json()["common_window"] == [4.5, 12.0]
    assert runs.GroupResult.from_json(together.to_json()).throughputs() == together.throughputs()
    warnings: list[str] = []
    gp.check_group(together, warnings, [])
    assert warnings == ["no scheduler x / t-cuda: window started 4.5 s late (slow start-up; raise --warmup); the pair "
                        "is scored over the 7.5 s both ran"]
    on_time = runs.GroupResult("x", "unisched", [_timed("cuda", 0.2, 330.0, 330.0, 0.0),
                                                _timed("render", 0.0, 35.0, 31.5, 0.0)], 0.0, 0.0)
    assert on_time.common_window() is None  # within 0.5 s: the shared nominal window stands
    assert on_time.throughputs() == [t.throughput for t in on_time.tenants]


def test_a_run_that_measured_a_sliver_of_its_window_gives_no_rate() -> None:
    """The H200's first NVDEC run alone of a session: making its clip overran the warm-up, and its 15 s window held
    0.32 s (462 frames/s against 270-284 in the rounds after). As the reference it read every pair of that round at
    about 0.6; no reference is better than that one, and the round says why."""
    def decoder(seconds: float, late_s: float) -> Any:
        window = {"seconds": seconds, "start_at": 100.0, "end_at": 115.0, "late_s": late_s}
        return runs.TenantResult("a-nvdec", "nvdec", None, [], 0, {"throughput": 462.1, "window": window}, "", None)

    sliver = runs.GroupResult("nvdec", "alone", [decoder(0.32, 14.68)], 0.0, 20.6)
    assert sliver.throughputs() == [None]
    warnings: list[str] = []
    errors: list[str] = []
    gp.check_group(sliver, warnings, errors)
    assert errors == ["alone nvdec / a-nvdec: measured 0.3 s of its 15 s window (started 14.7 s late): no rate is "
                      "taken from this run"]
    assert warnings == []
    assert pairs_plan.solo_reference("nvdec", {"nvdec": sliver}, {}) is None
    (pair,) = pairs_plan.parse_pairs("nvdec1:1")
    shared = runs.GroupResult("nvdec+nvdec", "unisched", [decoder(15.0, 0.0), decoder(15.0, 0.0)], 0.0, 27.0)
    assert pairs_plan.derive_pair(pair, {"nvdec": sliver}, {}, {pair.key: shared})["unisched"] is None
    enough = runs.GroupResult("nvdec", "alone", [decoder(7.6, 7.4)], 0.0, 20.6)  # half of it and more: a rate
    assert enough.throughputs() == [462.1]


def test_nvdec_runs_decode_one_clip_made_before_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's clip is made before the first run (by its own make_clip, where it is not there yet) and every
    NVDEC run is given it, so no run spends its window making one; a later invocation (the runner's next round)
    decodes the same clip without making it again; a replacement command is left alone, and a clip that cannot be
    made stops the run at once."""
    clip, made = tmp_path / "clip.mp4", tmp_path / "made"

    def example(name: str, encoder: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text("from pathlib import Path\n\n"
                        f"DEFAULT_CLIP = Path({str(clip)!r})\n\n"
                        "def make_clip(path: Path) -> str:\n"
                        f"    if {encoder!r} == 'none':\n"
                        "        raise RuntimeError('no CPU H.264 encoder')\n"
                        f"    with open({str(made)!r}, 'a') as f:\n"
                        "        f.write('x')\n"
                        "    path.write_bytes(b'clip')\n"
                        f"    return {encoder!r}\n")
        return path

    monkeypatch.setitem(pairs_plan.WORKLOADS, "nvdec", example("decode", "libx264"))
    pairs = pairs_plan.parse_pairs("nvdec1:1")
    progress = runs.Progress(1)

    def config(work: Path, nvdec_cmd: str | None = None) -> Any:
        return gp.new_config(seconds=15, warmup=5, grace_s=10, work_dir=work, dry_run=False, workload_cmd_cuda=None,
                             workload_cmd_render=None, workload_cmd_nvdec=nvdec_cmd)

    cfg = config(tmp_path / "work")
    assert pairs_calibration.prepare_clip(cfg, pairs, progress) is None
    assert clip.read_bytes() == b"clip"
    argv = runs.workload_argv(cfg, "nvdec", tmp_path / "r.json", 0.0)
    assert argv[argv.index("--clip") + 1] == str(clip)
    assert "--clip" not in runs.workload_argv(cfg, "cuda", tmp_path / "r.json", 0.0)
    again = config(tmp_path / "round-2")
    assert pairs_calibration.prepare_clip(again, pairs, progress) is None
    assert again.kind_args["nvdec"] == ["--clip", str(clip)] and made.read_text() == "x"  # made once
    custom = config(tmp_path / "custom", "my-decoder --fast")
    assert pairs_calibration.prepare_clip(custom, pairs, progress) is None and "nvdec" not in custom.kind_args
    assert pairs_calibration.prepare_clip(config(tmp_path / "none"), pairs_plan.parse_pairs("cuda1:1"), progress) is None
    clip.unlink()
    monkeypatch.setitem(pairs_plan.WORKLOADS, "nvdec", example("broken", "none"))
    broken = config(tmp_path / "broken")
    why = pairs_calibration.prepare_clip(broken, pairs, progress)
    assert why is not None and why.startswith("making the NVDEC test clip failed (rc 1)") and "no CPU H.264" in why
    assert "nvdec" not in broken.kind_args


def test_pair_keys_round_trip() -> None:
    for pair in pairs_plan.parse_pairs("cuda3:1,render1:1,mixed1:3"):
        assert pairs_plan.Pair.from_key(pair.key) == pair


def test_rescore_pairs_scores_a_committed_run_over_the_seconds_both_ran(tmp_path: Path) -> None:
    rescore_pairs = _load("rescore_pairs")

    together = runs.GroupResult("cuda+render", "no scheduler", [_timed("cuda", 4.5, 330.0, 330.0, 0.0),
                                                               _timed("render", 0.0, 35.0, 31.5, 4.5)], 0.0, 0.0)
    solo = {"cuda": _group("alone", ("cuda", 1650.0)), "render": _group("alone", ("render", 35.8))}
    pair = pairs_plan.parse_pairs("mixed1:1")[0]
    as_measured = {"solo": {k: g.to_json() for k, g in solo.items()}, "no_scheduler": {"cuda+render": together.to_json()},
                   "unisched": {}, "pairs": [{"pair": pair.key, "no_scheduler": {"normalized": [0.2, 0.93], "efficiency": 1.13}}]}
    new = rescore_pairs.rescore(json.loads(json.dumps(as_measured)))
    assert new["kept"] == pytest.approx([0.2, 0.88], abs=0.005)
    assert new["pairs"][0]["no_scheduler"]["normalized"] == pytest.approx([0.2, 0.88], abs=0.005)
    assert new["common_windows"] == {"no_scheduler cuda+render": [4.5, 12.0]}
    (tmp_path / "results.json").write_text(json.dumps(as_measured))
    assert rescore_pairs.main([str(tmp_path)]) == 0
    assert "0.20 / 0.88" in (tmp_path / "rescored.md").read_text()


def test_daemon_contention_check() -> None:
    def daemon(contention: str | None, status: dict[str, Any]) -> Any:
        return SimpleNamespace(gpu_contention=lambda: contention, info={"status": status})

    warnings: list[str] = []
    gp.check_daemon_contention(daemon("shared-sm", {"rc": 0}), "shared-sm", "k", warnings)
    assert warnings == []
    gp.check_daemon_contention(daemon("separate-graphics", {"rc": 0}), "shared-sm", "k", warnings)
    assert "the daemon uses contention 'separate-graphics'" in warnings[-1]
    gp.check_daemon_contention(daemon(None, {"rc": 0, "parsed": {"gpus": []}}), "shared-sm", "k", warnings)
    assert "reports no GPU" in warnings[-1]
    gp.check_daemon_contention(daemon(None, {"rc": 1}), "shared-sm", "k", warnings)
    assert "could not read" in warnings[-1]


# ------------------------------------------------------------------------------------- the budget


def test_default_full_run_fits_one_device_call(tmp_path: Path) -> None:
    args = gp.parse_args(["--out", str(tmp_path), "--calibrate-out", str(tmp_path / "s"), "--dry-run"])
    assert (args.seconds, args.warmup, args.unisched_warmup) == (20.0, 5.0, 15.0)
    cfg = gp.make_config(args)
    # 2 alone + 3 no scheduler at 5 + 20 + 3 s, 5 unisched at 15 + 20 + 3 + 3 s, 10 s render calibration.
    est = pairs_plan.estimate_seconds(cfg, args.pair_list, unisched=True, calibrate=True)
    assert est == pytest.approx(355.0)
    assert est <= gp.TIME_BUDGET_S


def test_serve_args_reach_every_daemon_config(tmp_path: Path) -> None:
    """--serve-arg is how a GPU run gets the daemon's debug log (why a pair stays sliced)."""
    args = gp.parse_args(["--out", str(tmp_path), "--dry-run", "--serve-arg=--log-level", "--serve-arg=debug"])
    assert gp.make_config(args).serve_args == ("--log-level", "debug")
    assert gp.make_config(gp.parse_args(["--out", str(tmp_path), "--dry-run"])).serve_args == ()


def test_calibrate_out_needs_a_mixed_pair(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        gp.parse_args(["--out", str(tmp_path), "--calibrate-out", str(tmp_path), "--pairs", "cuda3:1"])


# ------------------------------------------------------------------------------- end to end, CPU


FAKE_UNISCHED = '''
"""A stand-in daemon with unisched's CLI contract: picks its contention map from STATE_DIR/contention.json."""
import json, os, signal, socket, sys, time
from pathlib import Path
from unisched.policy.contention import ContentionMap

def opt(args, name):
    return args[args.index(name) + 1]

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "serve":
    state, sock = Path(opt(args, "--state-dir")), opt(args, "--socket")
    try:
        kept = json.loads((state / "contention.json").read_text())["gpus"]["Test GPU"]
        contention = ContentionMap.from_kept(kept["compute_kept"], kept["graphics_kept"]).name  # the daemon's rule
    except FileNotFoundError:
        contention = "none"
    Path(sock + ".json").write_text(json.dumps({"gpus": [{"index": 0, "name": "Test GPU", "contention": contention}]}))
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock)
    s.listen()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(1)
elif cmd == "status":
    reply = Path(opt(args, "--socket") + ".json").read_text()
    if "--json" in args:
        print(reply)
elif cmd == "run":
    rest = args[args.index("--") + 1:]
    os.execvp(rest[0], rest)
elif cmd == "tenants":
    print("[]")
'''


def _run_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, *extra: str) -> tuple[int, dict[str, Any]]:
    fake = tmp_path / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "fakesched.py").write_text(FAKE_UNISCHED)
    monkeypatch.setenv("PYTHONPATH", f"{fake}:{ROOT}")
    out = tmp_path / name
    # start-ups get the time a loaded 2-core machine needs: under unisched two interpreters start (the wrapper, then
    # the workload), which took longer than 0.3 s there with a second test run beside it (no rate, rc 1)
    rc = gp.main(["--pairs", "mixed1:1", "--seconds", "0.5", "--warmup", "1", "--unisched-warmup", "2",
                  "--grace", "10", "--out", str(out), "--work-dir", str(tmp_path / f"work-{name}"),
                  "--unisched-module", "fakesched", *standin_args(paced=True), *extra])
    return rc, json.loads((out / "results.json").read_text())


def test_gpu_pairs_calibrate_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cal = tmp_path / "cal"
    rc, results = _run_pairs(tmp_path, monkeypatch, "with", "--calibrate-out", str(cal), "--gpu-name", GPU)
    assert rc == 0, results["errors"]
    entry = check_shape(cal)
    assert results["contention"]["entry"] == entry and results["contention"]["gpu"] == GPU
    verdict = results["contention"]["verdict"]
    assert verdict == scoring.contention_verdict(entry["compute_kept"], entry["graphics_kept"])
    # the daemon started on a copy of that file, only that file, and took the map it implies
    daemon = results["unisched"]["cuda+render 1:1"]["daemon"]
    state = Path(daemon["state_dir"])
    assert sorted(p.name for p in state.iterdir()) == ["contention.json"]
    assert (state / "contention.json").read_text() == (cal / "contention.json").read_text()
    assert daemon["status"]["parsed"]["gpus"][0]["contention"] == verdict
    assert not [w for w in results["warnings"] if "contention" in w]
    assert "Contention calibration" in (tmp_path / "with" / "results.md").read_text()


def test_gpu_pairs_scores_a_late_starting_pair_over_the_seconds_both_ran(tmp_path: Path) -> None:
    """End to end with stand-ins on one CPU: the cuda one starts ~1.5 s into a 4 s window; the render one runs alone
    (its full rate) until then and at about half after. The pair is scored over the seconds both ran."""
    out = tmp_path / "late"
    rc = gp.main(["--pairs", "mixed1:1", "--no-unisched", "--seconds", "4", "--warmup", "0.5", "--grace", "10",
                  "--out", str(out), "--work-dir", str(tmp_path / "work"),
                  "--workload-cmd-cuda", f"{STANDIN} --kind cuda --pin-cpu 0 --start-up-s 2",
                  "--workload-cmd-render", f"{STANDIN} --kind render --pin-cpu 0"])
    results = json.loads((out / "results.json").read_text())
    assert rc == 0, results["errors"]
    group = results["no_scheduler"]["cuda+render"]
    lo, hi = group["common_window"]
    assert 1.0 < lo < 2.5 and hi > 2.5
    (pair,) = results["pairs"]
    render = pair["no_scheduler"]["normalized"][1]
    whole = group["tenants"][1]["report"]["throughput"] / pair["solo"][1]
    # the render's figure is its rate over [lo, hi] by its own timeline (linear between points), not its whole
    # window's. (Not its level: on a loaded 2-core runner the render alone before the cuda one starts ran at 0.66-1.2
    # of its solo run, so "about half" and "well under the whole window's" both failed there, 5 times in 8.)
    timeline = group["tenants"][1]["report"]["window"]["timeline"]

    def items(t: float) -> float:
        for (t0, n0), (t1, n1) in itertools.pairwise(timeline):
            if t0 <= t <= t1:
                return n0 + (n1 - n0) * (t - t0) / (t1 - t0) if t1 > t0 else n1
        raise AssertionError(f"{t} outside the timeline")

    assert render == pytest.approx((items(hi) - items(lo)) / (hi - lo) / pair["solo"][1], rel=1e-6), (render, whole)
    assert render != pytest.approx(whole, rel=1e-3)  # (what the nominal window would give)
    assert any("scored over the" in w for w in results["warnings"])


def test_gpu_pairs_without_calibrate_out_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, results = _run_pairs(tmp_path, monkeypatch, "without")
    assert rc == 0, results["errors"]
    assert "contention" not in results
    daemon = results["unisched"]["cuda+render 1:1"]["daemon"]
    assert "status" not in daemon and "contention_file" not in daemon
    assert list(Path(daemon["state_dir"]).iterdir()) == []


def test_gpu_pairs_rounds_each_against_their_own_solo_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--repeat 2 --solo-after: two rounds, each with solo runs before and after; a summary of both."""
    rc, summary = _run_pairs(tmp_path, monkeypatch, "rounds", "--repeat", "2", "--solo-after", "--overhead")
    assert rc == 0, summary["errors"]
    out = tmp_path / "rounds"
    rounds = [json.loads((out / f"round-{k}" / "results.json").read_text()) for k in (1, 2)]
    for r in rounds:
        assert set(r["solo_after"]) == {"cuda", "render"}
        (pair,) = r["pairs"]
        before = r["solo"]["cuda"]["tenants"][0]["report"]["throughput"]
        after = r["solo_after"]["cuda"]["tenants"][0]["report"]["throughput"]
        assert pair["solo"][0] == pytest.approx((before + after) / 2)  # the reference is their mean
    assert [round(t, 6) for t in summary["solo"]["cuda"]] == [
        round(r["solo"]["cuda"]["tenants"][0]["report"]["throughput"], 6) for r in rounds]
    (pair,) = summary["pairs"]
    norms = sorted(r["pairs"][0]["unisched"]["normalized"][0] for r in rounds)
    assert pair["unisched"]["rounds"] == 2
    assert pair["unisched"]["normalized"][0]["min"] == norms[0] and pair["unisched"]["normalized"][0]["max"] == norms[1]
    assert pair["unisched"]["passed"] == sum(r["pairs"][0]["unisched"]["verdict"]["passed"] for r in rounds)
    losses = sorted(r["overhead"]["cuda"]["loss"] for r in rounds)
    assert summary["overhead"]["cuda"] == {"median": pytest.approx(sum(losses) / 2), "min": losses[0], "max": losses[1]}
    text = (out / "results.md").read_text()
    assert "loss per round: cuda" in text
    assert "2 rounds" in text and "Alone, per round: cuda" in text and "cuda (after)" in text


def test_solo_reference_is_the_mean_of_before_and_after() -> None:
    def group(tp: float | None) -> runs.GroupResult:
        report = None if tp is None else {"throughput": tp}
        return runs.GroupResult("x", "alone", [runs.TenantResult("t", "cuda", None, [], 0, report, "", None)], 0.0, 1.0)

    assert pairs_plan.solo_reference("cuda", {"cuda": group(1300.0)}, {"cuda": group(2100.0)}) == 1700.0
    assert pairs_plan.solo_reference("cuda", {"cuda": group(1300.0)}, {}) == 1300.0
    assert pairs_plan.solo_reference("cuda", {"cuda": group(1300.0)}, {"cuda": group(None)}) == 1300.0  # a failed rerun
    assert pairs_plan.solo_drift("cuda", {"cuda": group(1300.0)}, {"cuda": group(2100.0)}) == pytest.approx(0.615, abs=1e-3)


def test_repeat_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        gp.parse_args(["--out", str(tmp_path), "--repeat", "0"])
