"""bench/run.py, the one benchmark runner: --list and --dry-run, variants, a suite end to end with CPU stand-ins and
a real daemon, time limits and stops that leave nothing running, and --rescore. What it makes of the rounds (verdicts,
readers, tables) is tests/test_bench_results.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
from benchrig import BENCH, bench_module, provenance, readers, run_py, suites, summary
from conftest import ROOT, child_env, needs_freezer, wait_until

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
    head = provenance.commit()
    mach = {"gpu": "NVIDIA H200"}
    assert summary.run_folder(mach, head, False, serve_args=("--slice-ms=10",)).name.endswith(
        f"-h200-{head['commit'][:7]}-slice-ms-10")
    assert summary.run_folder(mach, head, False).name.endswith(f"-h200-{head['commit'][:7]}")
    suite = suites.BY_NAME["cloud-gaming"]
    meta = {"command": "c", "machine": provenance.machine(), **head, "standin": True, "serve_args": [],
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
    run = bench_module("run")
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
    run = bench_module("run")
    online = suites.BY_NAME["online"]
    assert run.round_seconds(online, []) == 60 * online.round_minutes
    rounds = [{"steps": [{"wall_s": 200.0}, {"wall_s": 33.0}]}, {"steps": [{"wall_s": 190.5}]}]
    assert run.round_seconds(online, rounds) == 233.0
    assert run.round_seconds(online, [{"steps": []}]) == 60 * online.round_minutes  # nothing measured: the estimate


def test_a_first_round_is_planned_from_the_newest_earlier_run_on_the_same_gpus(tmp_path: Path) -> None:
    """A cloud-gaming round takes ~350 s on an H100 against the 8-min H200 estimate: a budget of 458 s fits it."""
    run = bench_module("run")
    cloud = suites.BY_NAME["cloud-gaming"]
    h100 = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04"}]}
    h200 = {"gpus": [{"name": "NVIDIA H200", "driver": "580.105.08"}]}

    def earlier(folder: str, machine: dict[str, Any], walls: list[float], day: str, standin: bool = False) -> None:
        (tmp_path / folder / "cloud-gaming").mkdir(parents=True)
        rounds = [{"steps": [{"wall_s": w}]} for w in walls]
        (tmp_path / folder / "cloud-gaming" / "summary.json").write_text(json.dumps(
            {"machine": machine, "rounds": rounds, "date_utc": day, "standin": standin}))

    earlier("a", h100, [400.0, 420.0], "2026-12-06 10:00:00")
    earlier("b", h100, [341.0, 355.5], "2026-12-07 10:00:00")  # the newest on this GPU
    earlier("c", h200, [300.0], "2026-12-08 10:00:00")
    earlier("d", h100, [90.0], "2026-12-09 10:00:00", standin=True)
    assert run.round_seconds(cloud, [], h100, results=tmp_path) == 355.5
    assert run.round_seconds(cloud, [], {"gpus": []}, results=tmp_path) == 60 * cloud.round_minutes
    assert run.round_seconds(cloud, [], h100, standin=True, results=tmp_path) == 90.0
    assert run.round_seconds(cloud, [{"steps": [{"wall_s": 360.0}]}], h100, results=tmp_path) == 360.0


@pytest.mark.skipif(bool(provenance.gpus()), reason="this machine has a GPU: the refusal is for machines without one")
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
        # the daemon's log, and what it charged each tenant by rule and source at the window's start and end
        log = tar.extractfile("raw/round-1/pairs/daemon-logs/cuda+cuda_3-1.log")
        assert log is not None and b'"event": "stopped"' in log.read()
        results = tar.extractfile("raw/round-1/pairs/results.json")
        assert results is not None
        snaps = json.load(results)["unisched"]["cuda+cuda 3:1"]["charges"]
    assert set(snaps) == {"start", "end"}
    if all("tenants" in x for x in snaps.values()) and "gone before" not in " ".join(rnd["notes"]):
        a, b = m["charges"]
        assert (a["tenant"], b["tenant"]) == ("a-cuda", "b-cuda") and (a["weight_share"], b["weight_share"]) == (0.75, 0.25)
        assert m["charged_part_a"] + m["charged_part_b"] == pytest.approx(1.0, abs=1e-3)
        assert all(key.startswith("gpu0/sm ") for row in m["charges"] for key in row["by"])
        assert "## What the daemon charged, by rule and source" in report
    else:  # a snapshot failed on a machine this loaded: the round says so
        assert any("no charges" in n for n in rnd["notes"]), rnd["notes"]
    assert summary.latest(tmp_path) == {}  # stand-in runs never reach the README's table


@needs_freezer
def test_the_leases_suite_measures_the_round_trip_the_floor_the_load_a_flood_and_registrations(tmp_path: Path) -> None:
    """One short round of the CPU-only leases suite against a real daemon: every step ran, the floor is a case the
    round-trip target does not judge, the load reports its probe apart from the 1000 tenants, the flood its
    probe's renewals when quiet and during the flood, and the registrations the Status calls beside them (no
    target for either)."""
    got = run_py("leases", "--rounds", "1", "--out", str(tmp_path), "--", "--seconds", "2", "--warmup", "1",
                 timeout=300)
    assert got.returncode in (0, 1), got.stdout + got.stderr  # 1: the target missed on this loaded machine
    s = json.loads((tmp_path / "leases" / "summary.json").read_text())
    (rnd,) = s["rounds"]
    assert [st["name"] for st in rnd["steps"]] == ["rtt", "rtt-library", "floor", "load", "flood", "registrations"]
    assert all(st["rc"] == 0 for st in rnd["steps"] if st["name"] != "load"), rnd["steps"]
    flood = rnd["cases"]["flood beside 200 tenants"]
    assert 0 < flood["quiet_p99_ms"] <= flood["quiet_max_ms"] and 0 < flood["flood_p99_ms"] <= flood["flood_max_ms"]
    reg = rnd["cases"]["Status while registering"]
    assert reg["registrations_per_s"] > 0 and reg["register_p50_ms"] > 0 and reg["late_warnings"] >= 0
    assert 0 < reg["quiet_p99_ms"] <= reg["quiet_max_ms"] and 0 < reg["registering_p99_ms"] <= reg["registering_max_ms"]
    burst = rnd["cases"]["Register beside another user's burst"]
    assert burst["asked_at_once"] == 1600 and burst["burst_registrations"] > 0 and burst["registrations"] > 0
    assert 0 < burst["register_p50_ms"] <= burst["register_p99_ms"] <= burst["register_max_ms"]
    floor = rnd["cases"]["bare echo (the machine's floor)"]
    assert 0 < floor["p50_ms"] <= floor["p99_ms"]
    load = rnd["cases"]["1000 tenants"]
    assert load["tenants"] == 1000 and load["probe_p99_ms"] > 0 and load["over_100ms"] >= 0
    library = rnd["cases"]["round trip, 1 tenant, client library"]
    assert library["tenants"] == 1 and 0 < library["p50_ms"] <= library["p99_ms"]
    assert library["p99_over_floor_ms"] == library["p99_ms"] - floor["p99_ms"]
    assert [v["case"] for v in s["verdicts"]] == ["round trip, 1 tenant", "round trip, 1 tenant, client library"]


# ------------------------------------------------------------------------------------------------ limits and stops


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
    run = bench_module("run")
    marker = str(tmp_path / "over-limit")
    started = tmp_path / "child-started"
    child = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(300)"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}, {marker!r}]); time.sleep(300)"
    # the limit leaves a loaded machine time to start both interpreters, so that the child is there to be ended
    step = suites.Step("slow", (sys.executable, "-c", code, marker), timeout_s=5.0)
    got = run.run_step(step, tmp_path / "slow", [], tmp_path)
    assert got["rc"] is None and got["name"] == "slow"
    assert started.exists(), "the step's child never started: nothing was tested"
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
    assert [(a["round"], a["why"]) for a in s["aborted"]] == [(2, "stopped by a signal while it ran")]
    assert not (out / "leases" / "raw").exists()


def test_a_stop_that_comes_while_a_step_starts_still_ends_the_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM delivered inside Popen, after the fork and before it returns (where a test that polls /proc for the
    step's command line can land it): the runner is stopped, and the step it had just started is ended with it."""
    run = bench_module("run")
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


class _Killed(BaseException):
    """A call killed in a round (SIGKILL at a device's time limit): nothing of the runner runs after it."""


def _machine(kernel: str, gpu: str = "NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    return {"host": "vm", "cpu": "Xeon", "cores": 16, "kernel": kernel, "python": "3.12", "gpu": gpu,
            "driver": "580.159.04", "gpus": [{"name": gpu, "driver": "580.159.04"}]}


def _call(run: Any, monkeypatch: pytest.MonkeyPatch, out: Path, argv: list[str], machine: dict[str, Any],
          rounds: list[float | BaseException], dirty: bool = False, code: str = "c0de") -> int:
    """run_suite for the leases suite as one call of `bench/run.py leases ARGV` on `machine`, each round measuring the
    next of `rounds` (a p99) or raising it."""
    feed = iter(rounds)

    def fake_round(suite: Any, steps: Any, k: int, folder: Path, extra: list[str], serve_args: Any = ()) -> Any:
        x = next(feed)
        if isinstance(x, BaseException):
            raise x
        return {"round": k, "date_utc": f"{machine['kernel']} {k}", "steps": [{"name": "rtt", "argv": [], "rc": 0,
                                                                                 "wall_s": 1.0}],
                "notes": [], "cases": {"round trip, 1 tenant": {"tenants": 1, "p99_ms": x}}}

    monkeypatch.setattr(run, "run_round", fake_round)
    monkeypatch.setattr(run.pv, "machine", lambda: machine)
    monkeypatch.setattr(run.pv, "commit", lambda: {"commit": "c" * 40, "dirty": dirty})
    monkeypatch.setattr(run.pv, "code_hash", lambda: code)
    args, extra = run.parse_args(["leases", "--out", str(out), *argv])
    args.argv, args.t0 = ["leases", "--out", str(out), *argv], time.monotonic()
    return int(run.run_suite(suites.BY_NAME["leases"], args, extra))


def test_a_run_measured_by_several_calls_names_each_rounds_call_and_takes_rounds_only_of_the_same_measurement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 1 on one VM, rounds 2-3 on another of the same GPU and driver (its kernel build differs): both calls are
    named, round by round. Rounds measured on other GPUs, by another command, or from a tree with uncommitted changes
    are refused, and a merge already recorded stays recorded."""
    run = bench_module("run")
    assert _call(run, monkeypatch, tmp_path, ["--rounds", "1"], _machine("v1272"), [0.4]) == 0
    folder = tmp_path / "leases"
    first = json.loads((folder / "summary.json").read_text())
    summary.write(folder, {**first, "merged": [{"rounds": [1], "date_utc": "x", "why": "a test's record"}]})
    assert _call(run, monkeypatch, tmp_path, ["--rounds", "3", "--budget", "500"], _machine("v1294"), [0.3, 0.7]) == 1
    s = json.loads((folder / "summary.json").read_text())
    assert [r["call"]["kernel"] for r in s["rounds"]] == ["v1272", "v1294", "v1294"]
    assert s["command"] == first["command"] and s["date_utc"] == first["date_utc"]  # the run's first call
    assert s["merged"] == [{"rounds": [1], "date_utc": "x", "why": "a test's record"}]
    report = (folder / "report.md").read_text()
    assert f"Round 1 measured by `python3 bench/run.py leases --out {tmp_path} --rounds 1`" in report
    assert "Rounds 2, 3 measured by `python3 bench/run.py leases" in report and "kernel v1294" in report
    for argv, machine, dirty, why in (
            (["--rounds", "4"], _machine("v1294", gpu="NVIDIA H200"), False, "measured on NVIDIA H100"),
            (["--rounds", "4", "--", "--seconds", "3"], _machine("v1294"), False, "another command"),
            (["--rounds", "4"], _machine("v1294"), True, "uncommitted changes")):
        assert _call(run, monkeypatch, tmp_path, argv, machine, [0.1], dirty=dirty) == 2, why
        assert len(json.loads((folder / "summary.json").read_text())["rounds"]) == 3, why
    refused = _call(run, monkeypatch, tmp_path, ["--rounds", "4"], _machine("v1294"), [0.1], code="other")
    assert refused == 2  # a tree whose code differs, though it names the same commit
    assert _call(run, monkeypatch, tmp_path, ["--rounds", "4"], _machine("v1294"), [0.1]) == 1  # the same code: added
    assert len(json.loads((folder / "summary.json").read_text())["rounds"]) == 4


def test_a_round_cut_short_is_kept_out_of_the_record_but_its_attempt_is_in_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop in round 2 and a kill in round 3 (the next call finds the round it left under way): neither round's
    numbers count, both attempts are in the summary and the report, so a round that went badly cannot be dropped
    unseen by stopping it."""
    run = bench_module("run")
    with pytest.raises(run.Stopped):
        _call(run, monkeypatch, tmp_path, ["--rounds", "3"], _machine("v1"), [0.4, run.Stopped("SIGTERM")])
    with pytest.raises(_Killed):
        _call(run, monkeypatch, tmp_path, ["--rounds", "3"], _machine("v1"), [_Killed()])
    left = json.loads((tmp_path / "leases" / "summary.json").read_text())
    assert left["in_progress"]["round"] == 2 and len(left["rounds"]) == 1
    assert _call(run, monkeypatch, tmp_path, ["--rounds", "3"], _machine("v1"), [0.3, 0.35]) == 0
    s = json.loads((tmp_path / "leases" / "summary.json").read_text())
    assert [r["cases"]["round trip, 1 tenant"]["p99_ms"] for r in s["rounds"]] == [0.4, 0.3, 0.35]
    assert [(a["round"], a["why"].split(" ")[0]) for a in s["aborted"]] == [(2, "stopped"), (2, "the")]
    assert "in_progress" not in s
    report = (tmp_path / "leases" / "report.md").read_text()
    assert report.count("cut short, so it is not in the record") == 2


# ------------------------------------------------------------------------------------------------ rescore


def test_rescore_judges_the_rounds_again_by_the_current_targets_and_says_so(tmp_path: Path) -> None:
    suite = suites.BY_NAME["leases"]
    meta = {"command": "python3 bench/run.py leases --out X", "machine": provenance.machine(), "commit": "c" * 40,
            "dirty": False, "standin": False, "date_utc": "2026-01-01 10:00:00", "raw": "raw.tar.xz (1 bytes)",
            "in_progress": {"round": 4, "date_utc": "2026-01-01 11:00:00"}}
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
    assert s["in_progress"] == meta["in_progress"]  # a round a killed call left under way stays on record
    assert s["rescored"]["command"] == f"python3 bench/run.py leases --rescore --out {out}"
    assert "Rescored: `python3 bench/run.py leases --rescore" in (folder / "report.md").read_text()
    head = provenance.commit()["commit"][:7]
    assert f"Verdicts rescored by the targets of commit {head}" in summary.results_page(tmp_path, link_from=tmp_path)
    empty = run_py("leases", "--rescore", "--out", str(tmp_path / "none"))
    assert empty.returncode == 2 and "holds no rounds to rescore" in empty.stderr
    assert run_py("leases", "--rescore").returncode == 2  # --out is needed


def test_add_rounds_keeps_every_round_of_another_run_of_the_same_command_and_says_so(tmp_path: Path) -> None:
    suite = suites.BY_NAME["leases"]
    meta = {"command": "python3 bench/run.py leases --out X --budget 500", "machine": provenance.machine(),
            "commit": "c" * 40, "dirty": False, "standin": False, "date_utc": "2026-01-01 10:00:00"}

    def run(out: Path, p99s: list[float], **changed: Any) -> Path:
        rounds = [{"round": i + 1, "date_utc": f"{out.name} {i}", "steps": [{"name": "rtt", "argv": [f"raw/round-{i + 1}/rtt"],
                                                               "rc": 0, "wall_s": 1.0}],
                   "notes": [], "cases": {"round trip, 1 tenant": {"tenants": 1, "p99_ms": x}}} for i, x in enumerate(p99s)]
        folder = out / "leases"
        for r in rounds:
            (folder / "raw" / f"round-{r['round']}").mkdir(parents=True)
            (folder / "raw" / f"round-{r['round']}" / "out.txt").write_text(f"p99 {p99s[r['round'] - 1]}")
        summary.write(folder, {**summary.build(suite, rounds, {**meta, **changed}), "raw": summary.archive_raw(folder)})
        return out

    first = run(tmp_path / "a", [0.4, 0.45])
    second = run(tmp_path / "b", [0.3, 0.7], command="python3 bench/run.py leases --out X --budget 300")
    got = run_py("leases", "--out", str(first), "--add-rounds", str(second), "--why", "the call lost the folder")
    assert got.returncode == 1, got.stderr  # round 4's 0.7 ms misses the target that rounds 1-2 met
    s = json.loads((first / "leases" / "summary.json").read_text())
    assert [(r["round"], r["cases"]["round trip, 1 tenant"]["p99_ms"]) for r in s["rounds"]] == \
        [(1, 0.4), (2, 0.45), (3, 0.3), (4, 0.7)]
    assert s["rounds"][3]["steps"][0]["argv"] == ["raw/round-4/rtt"]
    assert s["merged"] == [{"rounds": [3, 4], "date_utc": meta["date_utc"], "why": "the call lost the folder"}]
    assert "Rounds 3, 4 were measured by another run of the same command" in (first / "leases" / "report.md").read_text()
    with tarfile.open(first / "leases" / "raw.tar.xz") as tar:
        assert tar.extractfile("raw/round-4/out.txt").read() == b"p99 0.7"  # type: ignore[union-attr]
    other_commit = run(tmp_path / "c", [0.3], commit="d" * 40)
    refused = run_py("leases", "--out", str(first), "--add-rounds", str(other_commit), "--why", "x")
    assert refused.returncode == 2 and "not a run of the same command, machine and commit" in refused.stderr
    assert run_py("leases", "--out", str(first), "--add-rounds", str(second)).returncode == 2  # --why is needed
    for again in (second, first):  # a round is counted once: not the same rounds again, nor the folder itself
        twice = run_py("leases", "--out", str(first), "--add-rounds", str(again), "--why", "x")
        assert twice.returncode == 2 and "a round is counted once" in twice.stderr
    assert len(json.loads((first / "leases" / "summary.json").read_text())["rounds"]) == 4
    elsewhere = run(tmp_path / "e", [0.3], command="python3 bench/run.py leases --out Y --rounds 5",
                    aborted=[{"round": 1, "date_utc": "t", "why": "stopped by a signal while it ran"}])
    assert run_py("leases", "--out", str(first), "--add-rounds", str(elsewhere), "--why", "x").returncode == 1  # added
    s = json.loads((first / "leases" / "summary.json").read_text())
    assert [a["round"] for a in s["aborted"]] == [5]  # its round cut short comes with it, numbered as its rounds
    for unfit, words in (({"dirty": True}, "uncommitted changes"), ({"in_progress": {"round": 1, "date_utc": "t"}}, "under way")):
        other = run(tmp_path / f"u{len(words)}", [0.3], **unfit)
        refused = run_py("leases", "--out", str(first), "--add-rounds", str(other), "--why", "x")
        assert refused.returncode == 2 and words in refused.stderr


def test_rescore_reads_each_round_again_from_its_raw_outputs(tmp_path: Path) -> None:
    """A round judged by an older reader (no host_bound in its case): rescore reads its raw outputs with the current
    one, so the host-bound size is no longer judged; the archive itself is left as it was."""
    suite = suites.BY_NAME["cloud-gaming"]
    raw = tmp_path / "build" / "raw" / "round-1"
    for name, cpu in (("no-scheduler-24", 15.99), ("unisched-24", 15.2)):
        (raw / name).mkdir(parents=True)
        players = [{"weight": 100 * w, "fps_mean": 40.0, "fps_1pct_low": 36.0} for w in (1, 2, 4)]
        (raw / name / "report.json").write_text(json.dumps({
            "fps_target": 60, "fps_mean_all": 40.0, "cpu_cores_total": cpu, "host_cores": 16, "player_cores": 16,
            "per_instance": players}))
    folder = tmp_path / "run" / "cloud-gaming"
    folder.mkdir(parents=True)
    with tarfile.open(folder / "raw.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "build" / "raw", arcname="raw")
    archived = (folder / "raw.tar.xz").read_bytes()
    old_case = {k: v for k, v in readers.read_cloud(raw)[0]["N=24"].items() if k != "host_bound"}
    meta = {"command": "c", "machine": provenance.machine(), "commit": "c" * 40, "dirty": False, "standin": False,
            "date_utc": "2026-01-01 10:00:00"}
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [], "cases": {"N=24": old_case}}
    summary.write(folder, summary.build(suite, [rnd], meta))
    # (N=12, 36 and 48 not measured: a FAIL of their own, target "measured", beside what this test is about)
    assert {v["target"] for v in summary.load(folder)["verdicts"]} == {"FPS by weight", "1% lows", "measured"}
    got = run_py("cloud-gaming", "--rescore", "--out", str(tmp_path / "run"))
    assert got.returncode == 0, got.stderr
    s = summary.load(folder)
    assert s["rounds"][0]["cases"]["N=24"]["host_bound"] is True
    assert [v["case"] for v in s["verdicts"]] == ["N=12", "N=36", "N=48"]  # only the sizes never measured
    assert (folder / "raw.tar.xz").read_bytes() == archived and not (folder / "raw").exists()


def test_a_stop_between_two_rounds_cuts_no_round_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop after round 1 ended and before round 2 began (here while the runner weighs round 2 against --budget):
    round 1 is kept and no round is recorded as cut short, for none was."""
    run = bench_module("run")
    real = run.round_seconds
    calls = iter([False, True])

    def stopped_before_round_2(*a: Any, **kw: Any) -> float:
        if next(calls):
            raise run.Stopped("SIGTERM")
        return float(real(*a, **kw))

    monkeypatch.setattr(run, "round_seconds", stopped_before_round_2)
    with pytest.raises(run.Stopped):
        _call(run, monkeypatch, tmp_path, ["--rounds", "3", "--budget", "100000"], _machine("v1"), [0.4, 0.3])
    s = json.loads((tmp_path / "leases" / "summary.json").read_text())
    assert [r["round"] for r in s["rounds"]] == [1]
    assert not s.get("aborted") and "in_progress" not in s
