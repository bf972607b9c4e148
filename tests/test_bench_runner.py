"""bench/run.py, the one benchmark runner: --list and --dry-run, a suite end to end with CPU stand-ins and a real
daemon, verdicts computed over every round (a miss says by how much), the raw archive's size cap, and the README's
results table, which must be the one generated from the latest summaries."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import ROOT, child_env, needs_freezer, wait_until

BENCH = ROOT / "bench"


def _bench(name: str) -> ModuleType:
    """A module of bench/ (a script folder, not a package), imported as bench/run.py imports it."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


verdicts, suites, summary = _bench("verdicts"), _bench("suites"), _bench("summary")


def run_py(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / "run.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=timeout, check=False)


# ------------------------------------------------------------------------------------------------ the CLI


def test_list_says_what_each_suite_measures_its_targets_and_how_long() -> None:
    got = run_py("--list")
    assert got.returncode == 0, got.stderr
    for name in ("pairs", "mixed", "overlap", "overhead", "online", "cloud-gaming", "ad-sim", "hooks", "leases",
                 "memory"):
        assert f"\n{name}: " in "\n" + got.stdout
    assert "target: error <= 1 point in the median round" in got.stdout
    assert "target: lease renewal round trip p99 <= 0.5 ms" in got.stdout
    assert "about 7.5 min a round" in got.stdout and "CPU only" in got.stdout


def test_dry_run_prints_a_rounds_commands_and_runs_nothing(tmp_path: Path) -> None:
    got = run_py("pairs", "--dry-run", "--rounds", "4", "--out", str(tmp_path / "out"), "--", "--seconds", "20")
    assert got.returncode == 0, got.stderr
    assert "pairs: 4 rounds, about 30 min" in got.stdout
    line = next(x for x in got.stdout.splitlines() if "bench/gpu_pairs.py" in x)
    assert "--pairs cuda1:1,cuda3:1,cuda1:3,render1:1,render3:1,render1:3,nvdec1:1,nvdec3:1,nvdec1:3" in line
    assert line.endswith("--seconds 20")  # the words after `--` go to every command
    cloud = run_py("cloud-gaming", "--dry-run")
    assert "(under a fresh `unisched serve`)" in cloud.stdout and "--weights 1,2,4" in cloud.stdout
    assert not (tmp_path / "out").exists()


def test_a_variants_daemon_settings_reach_the_runners_daemons_and_are_refused_where_scripts_start_their_own(
        tmp_path: Path) -> None:
    cloud = run_py("cloud-gaming", "--cpu-standin", "--dry-run", "--serve-arg=--slice-ms=10")
    assert cloud.returncode == 0, cloud.stderr
    assert "(under a fresh `unisched serve --cpu-stand-in --slice-ms=10`)" in cloud.stdout
    pairs = run_py("pairs", "--cpu-standin", "--serve-arg=--slice-ms=10", "--out", str(tmp_path))
    assert pairs.returncode == 2 and "give their flags after `--`" in pairs.stderr
    assert not any(tmp_path.iterdir())


def test_a_variant_goes_to_a_folder_of_its_own_and_never_into_one_of_other_settings(tmp_path: Path) -> None:
    head = summary.commit()
    mach = {"gpu": "NVIDIA H200"}
    assert summary.run_folder(mach, head, False, serve_args=("--slice-ms=10",)).name.endswith(
        f"-h200-{head['commit'][:7]}-slice-ms-10")
    assert summary.run_folder(mach, head, False).name.endswith(f"-h200-{head['commit'][:7]}")
    suite = suites.BY_NAME["cloud-gaming"]
    meta = {"command": "c", "machine": summary.machine(), **head, "standin": True, "serve_args": [],
            "date_utc": "2026-01-01 10:00:00"}
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [], "cases": {}}
    summary.write(tmp_path / "cloud-gaming", summary.build(suite, [rnd], meta))
    got = run_py("cloud-gaming", "--cpu-standin", "--serve-arg=--slice-ms=10", "--out", str(tmp_path))
    assert got.returncode == 2, got.stderr
    assert "no --serve-arg, not --slice-ms=10: give another --out" in got.stderr
    assert len(json.loads((tmp_path / "cloud-gaming" / "summary.json").read_text())["rounds"]) == 1


@needs_freezer
@pytest.mark.root
def test_a_step_under_the_runners_daemon_runs_with_the_variants_settings(tmp_path: Path) -> None:
    """The daemon a step asks for gets the step's own `serve` arguments and then the variant's: its log says it
    serves with the variant's slice."""
    run = _bench("run")
    step = suites.Step("probe", (sys.executable, "-c", "import sys; sys.exit(0 if sys.argv[1] else 1)", "{socket}"),
                       serve=("--cpu-stand-in",))
    got = run.run_step(step, tmp_path / "probe", [], tmp_path, ("--slice-ms=10",))
    assert got["rc"] == 0 and got["argv"][-1].endswith(".sock")
    serving = [json.loads(x) for x in (tmp_path / "probe-daemon.log").read_text().splitlines() if '"serving"' in x]
    assert serving and serving[0]["slice_ms"] == 10.0


def test_several_suites_run_in_turn_within_one_budget_and_a_round_that_does_not_fit_leaves_nothing(
        tmp_path: Path) -> None:
    both = run_py("leases", "overhead", "--dry-run")
    assert both.returncode == 0 and "leases: 3 rounds" in both.stdout and "overhead: 5 rounds" in both.stdout
    got = run_py("leases", "--budget", "10", "--out", str(tmp_path))  # a round is about 1.4 min
    assert got.returncode == 0, got.stderr
    assert "round 1 would end after --budget 10 s: stopping (0 of 3 rounds" in got.stderr
    assert not any(tmp_path.iterdir())
    bad = run_py("leases", "nope")
    assert bad.returncode == 2 and "no suite nope" in bad.stderr


def test_the_budget_takes_a_round_as_long_as_the_longest_one_measured_else_the_estimate() -> None:
    """A budget of 540 s fits two online rounds of 233 s once one has run, where the 4-min estimate alone fits one."""
    run = _bench("run")
    online = suites.BY_NAME["online"]
    assert run.round_seconds(online, []) == 60 * online.round_minutes
    rounds = [{"steps": [{"wall_s": 200.0}, {"wall_s": 33.0}]}, {"steps": [{"wall_s": 190.5}]}]
    assert run.round_seconds(online, rounds) == 233.0
    assert run.round_seconds(online, [{"steps": []}]) == 60 * online.round_minutes  # nothing measured: the estimate


@pytest.mark.skipif(bool(summary.gpus()), reason="this machine has a GPU: the refusal is for machines without one")
def test_a_gpu_suite_refuses_clearly_without_a_gpu(tmp_path: Path) -> None:
    got = run_py("hooks", "--out", str(tmp_path))
    assert got.returncode == 2
    assert "suite hooks needs an NVIDIA GPU" in got.stderr
    assert "needs an NVIDIA GPU (nvidia-smi lists none); `--cpu-standin`" in run_py("pairs", "--out", str(tmp_path)).stderr
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------ end to end


@needs_freezer
@pytest.mark.root
def test_pairs_with_cpu_standins_writes_every_round_and_computed_verdicts(tmp_path: Path) -> None:
    """One round of cuda+cuda 3:1 (stand-ins pinned to CPU 0, a real daemon with --cpu-stand-in): summary.json holds
    the command, machine, commit, the round's references and scores, and a verdict per target that agrees with the
    numbers; report.md shows them; the raw outputs are one small archive."""
    got = run_py("pairs", "--cpu-standin", "--rounds", "1", "--out", str(tmp_path), "--",
                 "--pairs", "cuda3:1", "--seconds", "2", "--warmup", "1", "--unisched-warmup", "2", timeout=240)
    assert got.returncode in (0, 1), got.stdout + got.stderr  # 1: a target missed on this loaded machine
    folder = tmp_path / "pairs"
    s = json.loads((folder / "summary.json").read_text())
    assert s["suite"] == "pairs" and s["standin"] is True and len(s["commit"]) == 40
    assert s["command"].startswith("python3 bench/run.py pairs --cpu-standin")
    assert s["machine"]["cores"] == os.cpu_count() and s["machine"]["cpu"]
    (rnd,) = s["rounds"]
    assert rnd["steps"][0]["rc"] == 0 and "bench/gpu_pairs.py" in " ".join(rnd["steps"][0]["argv"])
    m = rnd["cases"]["cuda+cuda 3:1"]
    assert m["alone_a"] > 0 and m["no_scheduler_sum"] > 0 and isinstance(m["guarantee"], bool)
    by = {v["target"]: v for v in s["verdicts"]}
    assert by["guarantee"]["passed"] is m["guarantee"]
    if m["contending"] is not False:  # as two saturating tenants on one CPU do
        assert set(by) == {"error, median round", "error, worst round", "sum", "guarantee"}
        assert by["sum"]["passed"] is (m["sum"] >= 0.98) and by["sum"]["value"] == pytest.approx(m["sum"])
        assert by["error, worst round"]["passed"] is (m["error_pts"] <= 2.0)
    else:  # on a machine loaded enough, the round's references can read the pair as not contending (sum >= 1.1)
        assert set(by) == {"sum vs no scheduler", "guarantee"}
        assert by["sum vs no scheduler"]["value"] == pytest.approx(m["sum"] - m["no_scheduler_sum"])
    assert s["passed"] is None and s["rounds_least"] == 3  # 1 round of the 3 pairs needs: nothing settled yet
    assert "Rounds: 1 of the 3 the suite needs: not settled until then" in (folder / "report.md").read_text()
    assert s["stats"]["cuda+cuda 3:1"]["sum"]["median"] == pytest.approx(m["sum"])
    report = (folder / "report.md").read_text()
    assert "## Every round" in report and "cuda+cuda 3:1" in report and "CPU stand-ins" in report
    assert not (folder / "raw").exists()
    assert 0 < (folder / "raw.tar.xz").stat().st_size <= summary.RAW_ARCHIVE_MAX
    with tarfile.open(folder / "raw.tar.xz") as tar:
        assert "raw/round-1/pairs/results.json" in tar.getnames()
    assert summary.latest(tmp_path) == {}  # stand-in runs never reach the README's table


# ------------------------------------------------------------------------------------------------ verdicts


@needs_freezer
def test_the_leases_suite_measures_the_round_trip_the_floor_the_load_and_a_flood(tmp_path: Path) -> None:
    """One short round of the CPU-only leases suite against a real daemon: every step ran, the floor is a case the
    round-trip target does not judge, the load reports its probe apart from the 1000 tenants, and the flood its
    probe's renewals when quiet and during the flood (no target)."""
    got = run_py("leases", "--rounds", "1", "--out", str(tmp_path), "--", "--seconds", "2", "--warmup", "1",
                 timeout=300)
    assert got.returncode in (0, 1), got.stdout + got.stderr  # 1: the target missed on this loaded machine
    s = json.loads((tmp_path / "leases" / "summary.json").read_text())
    (rnd,) = s["rounds"]
    assert [st["name"] for st in rnd["steps"]] == ["rtt", "floor", "load", "flood"]
    assert all(st["rc"] == 0 for st in rnd["steps"] if st["name"] != "load"), rnd["steps"]
    flood = rnd["cases"]["flood beside 200 tenants"]
    assert 0 < flood["quiet_p99_ms"] <= flood["quiet_max_ms"] and 0 < flood["flood_p99_ms"] <= flood["flood_max_ms"]
    floor = rnd["cases"]["bare echo (the machine's floor)"]
    assert 0 < floor["p50_ms"] <= floor["p99_ms"]
    load = rnd["cases"]["1000 tenants"]
    assert load["tenants"] == 1000 and load["probe_p99_ms"] > 0 and load["over_100ms"] >= 0
    assert [v["case"] for v in s["verdicts"]] == ["round trip, 1 tenant"]


def _running_with(text: str) -> list[int]:
    """Processes whose command line names `text` (a test's own folder)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                continue  # gone meanwhile
    return found


def test_a_step_over_its_time_limit_is_recorded_without_a_status_and_ended_with_what_it_started(
        tmp_path: Path) -> None:
    """The step starts a child of its own and outlives its limit: the runner goes on with rc None, and neither the
    step nor its child is left running."""
    run = _bench("run")
    marker = str(tmp_path / "over-limit")
    code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', "
            f"{marker!r}]); time.sleep(300)")
    step = suites.Step("slow", (sys.executable, "-c", code, marker), timeout_s=0.5)
    got = run.run_step(step, tmp_path / "slow", [], tmp_path)
    assert got["rc"] is None and got["name"] == "slow"
    assert _running_with(marker) == []


@needs_freezer
def test_a_stopped_run_keeps_the_rounds_done_drops_the_one_cut_short_and_leaves_nothing_running(
        tmp_path: Path) -> None:
    """SIGTERM in round 2 (a device's time limit): the step running and all it started end, round 1 is written
    and archived, round 2's partial outputs are gone, and the exit status says it was stopped."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(BENCH / "run.py"), "leases", "--rounds", "2", "--out", str(out), "--",
                             "--seconds", "1", "--warmup", "1"], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (out / "leases" / "raw" / "round-2" / "rtt.log").exists(), 240, "round 2 to start")
        wait_until(lambda: _running_with(str(out / "leases" / "raw" / "round-2")), 60, "round 2's step to run")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by a signal in round 2" in err
    assert _running_with(str(out)) == []
    s = json.loads((out / "leases" / "summary.json").read_text())
    assert [r["round"] for r in s["rounds"]] == [1] and (out / "leases" / "raw.tar.xz").exists()
    assert not (out / "leases" / "raw").exists()


def test_a_stop_that_comes_while_a_step_starts_still_ends_the_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM delivered inside Popen, after the fork and before it returns (where a test that polls /proc for the
    step's command line can land it): the runner is stopped, and the step it had just started is ended with it."""
    run = _bench("run")
    real = subprocess.Popen

    def popen_then_stopped(*args: Any, **kw: Any) -> Any:
        proc = real(*args, **kw)
        os.kill(os.getpid(), signal.SIGTERM)  # handled before this returns, as inside the real Popen
        return proc

    monkeypatch.setattr(run.subprocess, "Popen", popen_then_stopped)
    marker = str(tmp_path / "marker")
    step = suites.Step("sleep", (sys.executable, "-c", "import sys, time; time.sleep(600)", marker))
    before = signal.signal(signal.SIGTERM, run._stop)
    try:
        with pytest.raises(run.Stopped):
            run.run_step(step, tmp_path / "out", [], tmp_path)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert _running_with(marker) == []


def target(**kw: Any) -> Any:
    base = {"name": "t", "metric": "x", "stat": "worst", "op": "<=", "limit": 2.0, "text": "x <= 2", "unit": " pts"}
    return verdicts.Target(**{**base, **kw})


def test_a_missed_target_says_by_how_much() -> None:
    v = verdicts.judge(target(), "cuda 3:1", [0.5, 2.5, 1.0])
    assert v.passed is False and v.value == 2.5
    assert v.label() == "FAIL: 2.5 pts > 2 pts, by 0.5 pts"
    low = verdicts.judge(target(op=">=", limit=0.98, unit=""), "c", [0.99, 0.951])
    assert low.passed is False and low.detail == "0.951 < 0.98, by 0.029"
    assert verdicts.judge(target(), "c", [0.5, 2.0]).passed is True


def test_median_every_and_intervals_over_the_rounds() -> None:
    assert verdicts.judge(target(stat="median", limit=1.0), "c", [0.2, 3.0, 0.9]).passed is True
    every = verdicts.judge(target(stat="every", op=">=", limit=1.0), "c", [True, False, True])
    assert every.passed is False and every.detail == "missed in 1 of 3 rounds"
    # mean 0.005, sd 0.01: half width 2.132 * 0.01 / sqrt(5) = 0.00953 (t, 4 degrees of freedom)
    losses = [0.005 - 0.01 * k for k in (-1.2649, -0.6325, 0.0, 0.6325, 1.2649)]
    lo, hi = verdicts.mean_interval(losses)
    assert (lo, hi) == (pytest.approx(0.005 - 0.00953, abs=2e-5), pytest.approx(0.005 + 0.00953, abs=2e-5))
    inside = verdicts.judge(target(stat="inside", limit=0.01, unit="%", scale=100.0), "cuda", losses)
    assert inside.passed is False and inside.detail.endswith("outside +-1% by 0.453%")
    assert verdicts.judge(target(stat="interval", op="<", limit=10.0), "c", [4.0]).passed is None  # one round
    assert verdicts.judge(target(), "c", [None, None]).detail == "not measured"
    assert verdicts.judge(target(), "c", [1.0, None]).label() == "FAIL: 1 of 2 rounds did not measure it"


def test_targets_apply_to_their_cases_only() -> None:
    rounds = [{"N=12": {"saturated": False, "weight_error": 0.2}, "N=36": {"saturated": True, "weight_error": 0.03}}]
    got = verdicts.judge_all(suites.CLOUD_TARGETS[:1], rounds)
    assert [(v.case, v.passed) for v in got] == [("N=36", True)]
    assert verdicts.overall(got) is True and verdicts.overall([]) is None


def test_a_pair_that_did_not_contend_is_judged_by_the_overlap_targets() -> None:
    """Two decode loops run side by side on the H200's NVDEC engines: the error against a weight split means nothing
    there, and the sum is kept against no scheduler's, as the issue's overlap targets say."""
    both = {"guarantee": True, "error_pts": 6.0, "sum": 0.9}
    rounds = [{"cuda 3:1": {**both, "contending": True, "sum_vs_no_scheduler": 0.05},
               "nvdec 3:1": {**both, "contending": False, "sum_vs_no_scheduler": -0.8},
               "nvdec 1:1": {**both, "contending": False, "sum_vs_no_scheduler": 0.01}}]
    got = {(v.case, v.target): v.passed for v in verdicts.judge_all(suites.BY_NAME["pairs"].targets, rounds)}
    assert got == {("cuda 3:1", "error, median round"): False, ("cuda 3:1", "error, worst round"): False,
                   ("cuda 3:1", "sum"): False, ("cuda 3:1", "guarantee"): True,
                   ("nvdec 3:1", "guarantee"): True, ("nvdec 3:1", "sum vs no scheduler"): False,
                   ("nvdec 1:1", "guarantee"): True, ("nvdec 1:1", "sum vs no scheduler"): True}


def test_cloud_gaming_weights_and_lows_from_the_players_reports() -> None:
    def player(w: int, fps: float, low: float) -> dict[str, Any]:
        return {"weight": 100 * w, "fps_mean": fps, "fps_1pct_low": low}

    shared = {"fps_target": 60, "fps_mean_all": 20.0, "cpu_cores_total": 6.0, "host_cores": 16,
              "per_instance": [player(1, 10, 8), player(2, 21, 16), player(4, 40, 30)]}
    alone = {"fps_target": 60, "fps_mean_all": 40.0, "per_instance": [player(1, 40, 36)] * 3}
    m = suites.cloud_metrics(shared, alone)
    assert m["saturated"] is True  # 40 < 0.95 * 60
    # k = 71 / 700 per unit of weight; worst |fps / (w k) - 1| is the weight-2 player: 21 / 20.29 - 1
    assert m["weight_error"] == pytest.approx(21 / (200 * 71 / 700) - 1)
    assert m["lows_vs_no_scheduler"] == pytest.approx(0.7619 - 0.9, abs=1e-4)  # median of 0.8, 0.762, 0.75 vs 0.9
    assert m["cpu_of_host_unisched"] == 6.0 / 16 and m["cpu_of_host_no_scheduler"] is None  # that run measured none


def test_cloud_gaming_reads_every_size_its_round_ran_and_its_stand_ins_pin_players_to_the_stand_in_cpu(
        tmp_path: Path) -> None:
    """The reader takes the sizes from the round's folders (the stand-ins run other sizes than the GPU's), and the
    stand-in round puts every player on CPU 1 under a daemon that takes that CPU for the GPU."""
    for name, fps in (("no-scheduler-3", 30.0), ("unisched-3", 20.0), ("unisched-6", 10.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({
            "fps_target": 60, "fps_mean_all": fps, "cpu_cores_total": 0.9, "player_cores": 1, "host_cores": 2,
            "per_instance": [{"weight": 100, "fps_mean": fps, "fps_1pct_low": fps / 2}]}))
    cases, _ = suites.read_cloud(tmp_path)
    assert list(cases) == ["N=3", "N=6"]
    assert cases["N=3"]["saturated"] is True and cases["N=3"]["cpu_of_host_unisched"] == 0.9  # of the 1 CPU
    assert cases["N=6"]["saturated"] is False  # no no-scheduler run to say so
    cloud = next(s for s in suites.SUITES if s.name == "cloud-gaming")
    assert cloud.standin and {s.name for s in cloud.standin} == {"no-scheduler-3", "unisched-3", "no-scheduler-6",
                                                                  "unisched-6"}
    for step in cloud.standin:
        assert step.argv[step.argv.index("--player-cpus") + 1] == "1"
        assert (step.serve == ("--cpu-stand-in",)) is step.name.startswith("unisched")


def test_hook_startup_pairs_alternate_drop_the_warm_up_and_bound_the_mean_difference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the daemon and the runs replaced (no GPU here): pairs alternate which run goes first, the warm-up pairs
    are not counted, and the suite reads the mean difference and the top of its 90% interval from what it wrote."""
    hs = _bench("hook_startup")
    calls: list[tuple[str, bool]] = []
    base = {"cuda": 0.300, "egl": 0.600}

    def one_run(sock: str, name: str, hooks: bool, env: dict[str, str]) -> dict[str, float]:
        calls.append((name, hooks))
        k = sum(1 for c in calls if c == (name, hooks))  # this run's number for its program and side
        init = base[name] + (0.5 if k == 1 else 0.0)  # the first start of each: driver files from disk
        context = 0.1 + (0.004 + 0.001 * (k % 3) if hooks else 0.0)
        return {"total": init + context, "init": init, "context": context}

    class Daemon:
        def terminate(self) -> None: ...
        def wait(self, timeout: float) -> int: return 0

    monkeypatch.setattr(hs, "one_run", one_run)
    monkeypatch.setattr(hs, "start_daemon", lambda work: (Daemon(), "sock"))
    monkeypatch.setattr(sys, "argv", ["hook_startup.py", "--out", str(tmp_path / "startup"), "--repeat", "6"])
    assert hs.main() == 0
    assert calls[:4] == [("cuda", True), ("cuda", False), ("cuda", False), ("cuda", True)]
    assert len(calls) == 2 * 2 * 7
    got = json.loads((tmp_path / "startup" / "results.json").read_text())
    pairs = got["added_ms_pairs"]["cuda"]
    assert pairs == pytest.approx([4 + (k % 3) for k in range(2, 8)])  # the warm-up pair (k = 1) left out
    a = got["added_ms"]["cuda"]
    assert a["mean"] == pytest.approx(5.0) and a["lo90"] < 5.0 < a["hi90"] < 6.0
    phases = got["added_ms_by_phase"]["cuda"]
    assert phases["init"]["mean"] == pytest.approx(0.0) and phases["context"]["mean"] == pytest.approx(5.0)
    cases, _ = suites.read_hooks(tmp_path)
    assert cases["egl start-up"]["added_ms_hi90"] == pytest.approx(got["added_ms"]["egl"]["hi90"])
    (v,) = [v for v in verdicts.judge_all(suites.HOOK_TARGETS, [cases]) if v.case == "cuda start-up"]
    assert v.passed is True and v.value == pytest.approx(a["hi90"])


# ------------------------------------------------------------------------------------------------ raw and table


def test_the_raw_archive_leaves_out_its_largest_files_to_stay_under_a_megabyte(tmp_path: Path) -> None:
    raw = tmp_path / "raw" / "round-1"
    raw.mkdir(parents=True)
    (raw / "results.json").write_text('{"ok": 1}')
    (raw / "huge.log").write_bytes(os.urandom(1_200_000))  # random: does not compress
    said = summary.archive_raw(tmp_path)
    assert "left out for size: raw/round-1/huge.log" in said and not (tmp_path / "raw").exists()
    assert (tmp_path / "raw.tar.xz").stat().st_size <= summary.RAW_ARCHIVE_MAX
    summary.unpack_raw(tmp_path)
    assert (raw / "results.json").read_text() == '{"ok": 1}'


def test_the_table_is_built_from_the_latest_summary_of_each_suite(tmp_path: Path) -> None:
    suite = suites.BY_NAME["leases"]
    meta = {"command": "c", "machine": summary.machine(), "commit": "a" * 40, "dirty": False, "standin": False}
    for day, p99 in (("2026-01-01", 0.3), ("2026-02-01", 0.62)):
        rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [],
               "cases": {"round trip, 1 tenant": {"tenants": 1, "p99_ms": p99}}}
        summary.write(tmp_path / f"{day}-h200-aaaaaaa" / "leases",
                      summary.build(suite, [rnd] * 3, {**meta, "date_utc": f"{day} 10:00:00"}))
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [],  # newer, but of part of the suite: not shown
           "cases": {"round trip, 1 tenant": {"tenants": 1, "p99_ms": 0.1}}}
    summary.write(tmp_path / "2026-03-01-h200-bbbbbbb" / "leases",
                  summary.build(suite, [rnd] * 3, {**meta, "command": "python3 bench/run.py leases -- --weights 3:1",
                                               "date_utc": "2026-03-01 10:00:00"}))
    for day, variant in (("2026-03-02", {"serve_args": ["--slice-ms=10"]}),  # newer, but variants: not shown
                         ("2026-03-03", {"command": "python3 bench/run.py leases -- --slice-ms 10"})):
        summary.write(tmp_path / f"{day}-h200-bbbbbbb" / "leases",
                      summary.build(suite, [rnd] * 3, {**meta, "date_utc": f"{day} 10:00:00", **variant}))
    table = summary.results_table(tmp_path, link_from=tmp_path)
    row = next(x for x in table.splitlines() if x.startswith("| leases |"))
    assert "0 of 1" in row and "FAIL: 0.62 ms > 0.5 ms, by 0.12 ms" in row
    assert "[2026-02-01-h200-aaaaaaa](2026-02-01-h200-aaaaaaa/leases/report.md), 3 rounds" in row
    assert f"| pairs | {suites.PAIR_TARGETS[0].text}" in table and summary.NOT_MEASURED in table
    readme = f"intro\n{summary.README_BEGIN}\nold\n{summary.README_END}\nrest\n"
    assert summary.readme_table(summary.with_table(readme, table)) == table


def test_compare_sets_one_suites_runs_side_by_side_with_each_runs_verdicts(tmp_path: Path) -> None:
    suite = suites.BY_NAME["leases"]
    meta = {"command": "c", "machine": summary.machine(), "commit": "a" * 40, "dirty": False, "standin": True,
            "date_utc": "2026-01-01 10:00:00"}
    for name, p99, serve in (("base", 0.62, []), ("short", 0.3, ["--slice-ms=10"])):
        rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [],
               "cases": {"round trip, 1 tenant": {"tenants": 1, "p99_ms": p99}}}
        summary.write(tmp_path / name / "leases", summary.build(suite, [rnd] * 3, {**meta, "serve_args": serve}))
    got = subprocess.run([sys.executable, str(BENCH / "run.py"), "leases", "--compare", ".", "../short"],
                         capture_output=True, text=True, cwd=tmp_path / "base", env=child_env(), timeout=60, check=False)
    assert got.returncode == 0, got.stderr
    head, *rows = got.stdout.splitlines()
    assert "defaults, [base](leases/report.md), 3 rounds" in head
    assert "`--slice-ms=10`, [short](../short/leases/report.md), 3 rounds" in head
    assert "| lease renewal round trip p99 <= 0.5 ms | round trip, 1 tenant | 0.62: missed | 0.3: met |" in rows
    assert "| round trip, 1 tenant | p99_ms | 0.62 | 0.3 |" in rows
    summary.write(tmp_path / "other" / "hooks", summary.build(suites.BY_NAME["hooks"], [], meta))
    with pytest.raises(ValueError, match="compare runs of one suite"):
        summary.compare_table([(tmp_path / "base" / "leases", summary.load(tmp_path / "base" / "leases")),
                               (tmp_path / "other" / "hooks", summary.load(tmp_path / "other" / "hooks"))])
    absent = run_py("leases", "--compare", str(tmp_path / "other"))
    assert absent.returncode == 2 and "no leases summary in" in absent.stderr


def test_the_tables_worst_case_is_the_one_nearest_its_limit_where_all_pass(tmp_path: Path) -> None:
    """Where every case met a target, the table names the one with least margin and its value, not the first."""
    suite = suites.BY_NAME["leases"]
    meta = {"command": "c", "machine": summary.machine(), "commit": "a" * 40, "dirty": False, "standin": False,
            "date_utc": "2026-01-01 10:00:00"}
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [],
           "cases": {"socket a": {"tenants": 1, "p99_ms": 0.2}, "socket b": {"tenants": 1, "p99_ms": 0.45},
                     "socket c": {"tenants": 1, "p99_ms": 0.3}}}
    summary.write(tmp_path / "2026-01-01-h200-aaaaaaa" / "leases", summary.build(suite, [rnd] * 3, meta))
    row = next(x for x in summary.results_table(tmp_path, link_from=tmp_path).splitlines()
               if x.startswith("| leases |"))
    assert "3 of 3" in row and "socket b: PASS (0.45)" in row


def test_a_run_with_fewer_rounds_than_its_suite_needs_is_not_settled(tmp_path: Path) -> None:
    """Overhead needs 5 rounds: after 1 that met every target, neither the report nor the table says it passed."""
    suite = suites.BY_NAME["overhead"]
    meta = {"command": "c", "machine": summary.machine(), "commit": "a" * 40, "dirty": False, "standin": False,
            "date_utc": "2026-01-01 10:00:00"}
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [], "cases": {"cuda alone": {"loss": 0.001}}}
    folder = tmp_path / "2026-01-01-h200-aaaaaaa" / "overhead"
    summary.write(folder, summary.build(suite, [rnd], meta))
    s = json.loads((folder / "summary.json").read_text())
    assert s["passed"] is None and any(v["passed"] is True for v in s["verdicts"])
    assert "Verdict: **not settled**" in (folder / "report.md").read_text()
    rows = [x for x in summary.results_table(tmp_path, link_from=tmp_path).splitlines() if x.startswith("| overhead |")]
    assert rows and all("not settled (" in x and ", 1 of 5 rounds |" in x for x in rows)
    summary.write(folder, summary.build(suite, [rnd] * 5, meta))
    assert json.loads((folder / "summary.json").read_text())["passed"] is True
    rows = [x for x in summary.results_table(tmp_path, link_from=tmp_path).splitlines() if x.startswith("| overhead |")]
    assert all("not settled" not in x and ", 5 rounds |" in x for x in rows)


def test_the_readme_table_is_the_generated_one() -> None:
    text = (ROOT / "README.md").read_text()
    found = summary.readme_table(text)
    if found is None:
        pytest.skip(f"README.md has no {summary.README_BEGIN} / {summary.README_END} markers yet")
    assert found == summary.results_table(), "stale: run `python3 bench/run.py --update-readme README.md`"


def test_the_results_page_is_the_generated_one() -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    found = summary.readme_table(text)
    assert found is not None, f"docs/results.md lost its {summary.README_BEGIN} / {summary.README_END} markers"
    assert found == summary.results_page(link_from=ROOT / "docs"), \
        "stale: run `python3 bench/run.py --update-results docs/results.md`"


def test_the_results_page_lists_every_verdict_of_each_latest_run(tmp_path: Path) -> None:
    suite = suites.BY_NAME["leases"]
    meta = {"command": "python3 bench/run.py leases", "machine": summary.machine(), "commit": "c" * 40,
            "dirty": False, "standin": False, "date_utc": "2026-01-01 10:00:00"}
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [],
           "cases": {"round trip, 1 tenant": {"tenants": 1, "p99_ms": 0.62}}}
    summary.write(tmp_path / "2026-01-01-h200-ccccccc" / "leases", summary.build(suite, [rnd], meta))
    page = summary.results_page(tmp_path, link_from=tmp_path)
    assert page.startswith(summary.results_table(tmp_path, link_from=tmp_path).rstrip("\n"))
    assert "### leases" in page and "### pairs" not in page  # only suites that ran
    assert "Command: `python3 bench/run.py leases`" in page
    assert "| round trip, 1 tenant | lease renewal round trip p99 <= 0.5 ms | 0.62 | FAIL: 0.62 ms > 0.5 ms" in page


def test_the_online_suite_reads_what_scenarios_writes(tmp_path: Path) -> None:
    """From the online harness's own derivation of a round (derive_batch, as it writes results.json) to the runner's cases:
    per batch and setup the p99 against alone, the top of that ratio's interval and the trainer's rate kept."""
    _bench("scenarios")  # puts examples/workloads on the path, as the online suite's command does
    online_scoring = _bench("online_scoring")

    def run(online: dict[str, Any] | None, offline: float | None) -> dict[str, Any]:
        tenants = ([{"name": "online", "report": {"latency_ms": online}}] if online else []) + (
            [{"name": "offline", "report": {"throughput": offline}}] if offline else [])
        return {"tenants": tenants}

    def lat(p99: float) -> dict[str, float]:
        return {"p50": 7.0, "p99": p99, "p99_lo": p99 * 0.98, "p99_hi": p99 * 1.02}

    batches: dict[str, Any] = {}
    for batch, p99 in (("1", 9.4), ("8", 12.0)):
        runs = {"alone-online": run(lat(9.0), None), "alone-offline": run(None, 1500.0),
                "unisched kernel": run(lat(p99), 1300.0), "unisched user": run(lat(p99 * 0.95), 1250.0)}
        online_scoring.derive_batch(runs)
        batches[batch] = runs
    step = tmp_path / "online"
    step.mkdir()
    (step / "results.json").write_text(json.dumps({"scenarios": {"online": {"rate": 20, "batches": batches}}}))
    cases, notes = suites.read_online(tmp_path)
    assert sorted(cases) == ["b1 unisched kernel", "b1 unisched user", "b8 unisched kernel", "b8 unisched user"]
    assert notes == []
    b1 = cases["b1 unisched kernel"]
    assert b1["p99_x_alone"] == pytest.approx(9.4 / 9.0) and b1["trainer_kept"] == pytest.approx(1300 / 1500)
    assert b1["alone_p99_ms"] == 9.0 and b1["p99_ms"] == 9.4
    assert b1["p99_x_top"] == pytest.approx(9.4 * 1.02 / (9.0 * 0.98), rel=0.02)
    judged = {(v.case, v.target): v.passed for v in verdicts.judge_all(suites.BY_NAME["online"].targets, [cases])}
    assert judged[("b1 unisched kernel", "p99")] is True and judged[("b8 unisched kernel", "p99")] is False
    assert judged[("b1 unisched user", "trainer kept")] is False  # 1250 / 1500 = 0.83 < 0.85


def test_the_online_interval_is_the_p99_ratios_over_the_rounds_not_one_runs_order_statistics() -> None:
    """Steady ratios pass though each run's own interval reaches its slowest request (p99_x_top 2); ratios that
    spread between rounds fail though every one of them is below 1.10."""
    targets = suites.BY_NAME["online"].targets

    def judged(ratios: list[float]) -> bool | None:
        rounds = [{"b1 unisched kernel": {"p99_x_alone": r, "p99_x_top": 2.0, "trainer_kept": 0.95}} for r in ratios]
        return next(v.passed for v in verdicts.judge_all(targets, rounds) if v.target == "p99 interval")

    assert judged([1.00, 1.02, 1.01, 0.99, 1.03]) is True
    assert judged([0.70, 0.65, 1.00, 1.07, 1.09]) is False  # the mean's interval tops 1.10
    assert judged([1.0]) is None  # one round has no interval


def test_rescore_judges_the_rounds_again_by_the_current_targets_and_says_so(tmp_path: Path) -> None:
    suite = suites.BY_NAME["leases"]
    meta = {"command": "python3 bench/run.py leases --out X", "machine": summary.machine(), "commit": "c" * 40,
            "dirty": False, "standin": False, "date_utc": "2026-01-01 10:00:00", "raw": "raw.tar.xz (1 bytes)"}
    rnd = {"round": 1, "date_utc": "d", "steps": [{"name": "rtt", "argv": ["x"], "rc": 0, "wall_s": 1.0}],
           "notes": [], "cases": {"round trip, 1 tenant": {"tenants": 1, "p99_ms": 0.62}}}
    stale = summary.build(suite, [rnd] * 3, meta)
    stale["verdicts"], stale["passed"] = [], True  # as judged by targets that no longer stand
    out = tmp_path / "2026-01-01-h200-ccccccc"
    folder = out / "leases"
    summary.write(folder, stale)
    got = run_py("leases", "--rescore", "--out", str(out))
    assert got.returncode == 1, got.stderr  # the current target is missed
    assert "round trip, 1 tenant: round trip p99: FAIL: 0.62 ms > 0.5 ms" in got.stdout
    s = json.loads((folder / "summary.json").read_text())
    assert s["passed"] is False and [r["cases"] for r in s["rounds"]] == [rnd["cases"]] * 3
    assert {k: s[k] for k in meta} == json.loads(json.dumps(meta))  # the run's own record is kept
    assert s["rescored"]["command"] == f"python3 bench/run.py leases --rescore --out {out}"
    assert "Rescored: `python3 bench/run.py leases --rescore" in (folder / "report.md").read_text()
    head = summary.commit()["commit"][:7]
    assert f"Verdicts rescored by the targets of commit {head}" in summary.results_page(tmp_path, link_from=tmp_path)
    empty = run_py("leases", "--rescore", "--out", str(tmp_path / "none"))
    assert empty.returncode == 2 and "holds no rounds to rescore" in empty.stderr
    assert run_py("leases", "--rescore").returncode == 2  # --out is needed
