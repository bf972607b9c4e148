"""What bench/run.py makes of the rounds: verdicts computed over every round (a miss says by how much), each suite's
reader of its scripts' outputs, the raw archive's size cap, runs side by side, and the README's and docs' results
tables, which must be the ones generated from each suite's run of the newest code measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchrig import BENCH, bench_module, provenance, readers, run_py, suites, summary, verdicts
from conftest import ROOT, child_env

# ------------------------------------------------------------------------------------------------ verdicts and readers


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
    m = readers.cloud_metrics(shared, alone)
    assert m["saturated"] is True  # 40 < 0.95 * 60
    # k = 71 / 700 per unit of weight; worst |fps / (w k) - 1| is the weight-2 player: 21 / 20.29 - 1
    assert m["weight_error"] == pytest.approx(21 / (200 * 71 / 700) - 1)
    assert m["lows_vs_no_scheduler"] == pytest.approx(0.7619 - 0.9, abs=1e-4)  # median of 0.8, 0.762, 0.75 vs 0.9
    assert m["cpu_of_host_unisched"] == 6.0 / 16 and m["cpu_of_host_no_scheduler"] is None  # that run measured none
    assert m["host_bound"] is None  # unknown without the no-scheduler run's CPU
    assert "cpu_ms_a_frame_lightest" not in m  # the players reported no CPU


def test_cloud_gaming_shows_the_cpu_a_frame_of_the_lightest_and_heaviest_groups_and_its_user_part() -> None:
    def player(w: int, fps: float, cores: float, user: float | None) -> dict[str, Any]:
        return {"weight": 100 * w, "fps_mean": fps, "fps_1pct_low": fps, "cpu_cores": cores, "cpu_user_cores": user}

    per = [player(1, 10, 0.07, 0.03), player(1, 10, 0.07, 0.03), player(2, 20, 0.15, 0.06),
           player(4, 40, 0.4, 0.12), player(4, 40, 0.4, 0.12)]
    m = readers.cloud_metrics({"fps_target": 60, "fps_mean_all": 24.0, "per_instance": per}, {})
    assert (m["cpu_ms_a_frame_lightest"], m["cpu_ms_a_frame_heaviest"]) == (7.0, 10.0)
    assert (m["user_ms_a_frame_lightest"], m["user_ms_a_frame_heaviest"]) == (3.0, 3.0)
    older = readers.cloud_metrics({"per_instance": [{**e, "cpu_user_cores": None} for e in per]}, {})
    assert older["cpu_ms_a_frame_heaviest"] == 10.0 and "user_ms_a_frame_heaviest" not in older


@pytest.mark.parametrize(("total", "weights", "cap", "owed"), [
    (70.0, [1.0, 2.0, 4.0], 60.0, [10.0, 20.0, 40.0]),  # no cap binds: plain proportions
    (270.0, [1.0, 2.0, 4.0, 1.0, 2.0, 4.0], 60.0, [25.0, 50.0, 60.0, 25.0, 50.0, 60.0]),  # the weight-4s at their pace
    (300.0, [1.0, 1.0], 60.0, [60.0, 60.0]),  # more than both can take
])
def test_weighted_shares_never_owe_a_player_more_than_its_pace(total: float, weights: list[float], cap: float,
                                                               owed: list[float]) -> None:
    assert readers.weighted_shares(total, weights, cap) == pytest.approx(owed)


def test_cloud_gaming_weight_error_counts_a_player_held_to_its_pace_as_served() -> None:
    """Six players 1:2:4 sharing 270 FPS: the weight-4 ones cannot pass 60, so 25/50/60 is the weighted share."""
    per = [{"weight": 100 * w, "fps_mean": f, "fps_1pct_low": f * 0.9} for w, f in ((1, 25.0), (2, 50.0), (4, 60.0))] * 2
    m = readers.cloud_metrics({"fps_target": 60, "fps_mean_all": 45.0, "per_instance": per}, {})
    assert m["weight_error"] == pytest.approx(0.0)


def test_cloud_gaming_is_judged_only_where_the_gpu_not_the_hosts_cpu_saturated() -> None:
    """Unpinned players that used 95% of the host's cores with no scheduler, on a GPU NVML did not read 95% busy, ran
    out of CPU, which the daemon does not share: that size is reported, not judged. Players pinned to a stand-in core
    are judged as before, and so is a run whose GPU was busy (its players spun on it)."""
    def run(fps: float, cpu: float, player_cores: int, host_cores: int = 16,
            gpu_busy: float | None = None) -> dict[str, Any]:
        return {"fps_target": 60, "fps_mean_all": fps, "cpu_cores_total": cpu, "host_cores": host_cores,
                "player_cores": player_cores, "gpu_busy": gpu_busy,
                "per_instance": [{"weight": 100 * w, "fps_mean": fps, "fps_1pct_low": fps * 0.9} for w in (1, 2, 4)]}

    by_cpu = readers.cloud_metrics(run(20, 15.5, 16), run(20, 15.99, 16))
    by_gpu = readers.cloud_metrics(run(20, 15.5, 16), run(20, 11.0, 16))
    stand_in = readers.cloud_metrics(run(20, 1.0, 1, 2), run(20, 1.0, 1, 2))
    # every core used, but NVML read the GPU busy: players spinning in the driver's wait for a saturated GPU
    spinning = readers.cloud_metrics(run(20, 15.5, 16, gpu_busy=0.5), run(20, 15.99, 16, gpu_busy=0.99))
    cpu_and_idle_gpu = readers.cloud_metrics(run(20, 15.5, 16), run(20, 15.99, 16, gpu_busy=0.9))
    assert by_cpu["saturated"] is by_gpu["saturated"] is stand_in["saturated"] is True
    assert (by_cpu["host_bound"], by_gpu["host_bound"], stand_in["host_bound"]) == (True, False, False)
    assert (spinning["host_bound"], cpu_and_idle_gpu["host_bound"]) == (False, True)
    assert (spinning["gpu_busy_no_scheduler"], spinning["gpu_busy_unisched"]) == (0.99, 0.5)
    judged = {c: [v.target for v in verdicts.judge_all(suites.CLOUD_TARGETS, [{c: m}])]
              for c, m in (("cpu", by_cpu), ("gpu", by_gpu), ("stand-in", stand_in), ("spinning", spinning))}
    assert judged == {"cpu": [], "gpu": ["FPS by weight", "1% lows"], "stand-in": ["FPS by weight", "1% lows"],
                      "spinning": ["FPS by weight", "1% lows"]}


def test_cloud_gaming_reads_every_size_its_round_ran_and_its_stand_ins_pin_players_to_the_stand_in_cpu(
        tmp_path: Path) -> None:
    """The reader takes the sizes from the round's folders (the stand-ins run other sizes than the GPU's), and the
    stand-in round puts every player on CPU 1 under a daemon that takes that CPU for the GPU."""
    for name, fps in (("no-scheduler-3", 30.0), ("unisched-3", 20.0), ("unisched-6", 10.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({
            "fps_target": 60, "fps_mean_all": fps, "cpu_cores_total": 0.9, "player_cores": 1, "host_cores": 2,
            "per_instance": [{"weight": 100, "fps_mean": fps, "fps_1pct_low": fps / 2}]}))
    cases, _ = readers.read_cloud(tmp_path)
    assert list(cases) == ["N=3", "N=6"]
    assert cases["N=3"]["saturated"] is True and cases["N=3"]["cpu_of_host_unisched"] == 0.9  # of the 1 CPU
    assert cases["N=6"]["saturated"] is False  # no no-scheduler run to say so
    cloud = next(s for s in suites.SUITES if s.name == "cloud-gaming")
    assert cloud.standin and {s.name for s in cloud.standin} == {"no-scheduler-6", "unisched-6", "no-scheduler-12",
                                                                  "unisched-12"}
    for step in cloud.standin:
        assert step.argv[step.argv.index("--player-cpus") + 1] == "1"
        assert (step.serve == ("--cpu-stand-in",)) is step.name.startswith("unisched")


def test_hook_startup_pairs_alternate_drop_the_warm_up_and_bound_the_mean_difference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the daemon and the runs replaced (no GPU here): pairs alternate which run goes first, the warm-up pairs
    are not counted, and the suite reads the mean difference and the top of its 90% interval from what it wrote."""
    hs = bench_module("hook_startup")
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
    monkeypatch.setattr(hs, "start_daemon", lambda work, *extra, sample=None: (Daemon(), "sock"))
    monkeypatch.setattr(hs, "hooked_calls", lambda port, tenant, runs: {
        "runs": runs, "calls_per_start": 131.0 if tenant == "hs-cuda" else 125.0, "answer_us_mean": 40.0,
        "decisions_per_start": 4.0, "decision_us_mean": 900.0, "undecided_us_mean": 13.6, "send_us_mean": 21.0})
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
    cases, _ = readers.read_hooks(tmp_path)
    assert cases["egl start-up"]["added_ms_hi90"] == pytest.approx(got["added_ms"]["egl"]["hi90"])
    assert (cases["cuda start-up"]["calls_a_start"], cases["egl start-up"]["calls_a_start"]) == (131.0, 125.0)
    assert cases["cuda start-up"]["answer_us_in_daemon"] == 40.0
    assert (cases["cuda start-up"]["decisions_a_start"], cases["cuda start-up"]["decision_us_in_daemon"],
            cases["cuda start-up"]["other_us_in_daemon"]) == (4.0, 900.0, 13.6)
    assert cases["cuda start-up"]["send_us"] == 21.0
    assert cases["cuda start-up"]["added_ms_median"] == pytest.approx(a["median"])  # the pairs' middle, beside the mean
    assert cases["cuda start-up"]["pair_sd_ms"] == pytest.approx(a["stdev"])  # what the interval's width comes from
    (v,) = [v for v in verdicts.judge_all(suites.HOOK_TARGETS, [cases]) if v.case == "cuda start-up"]
    assert v.passed is True and v.value == pytest.approx(a["hi90"])


@pytest.mark.parametrize("program", ["replay", "replay-mapping", "replay-spinning"])
def test_hook_startup_replay_program_runs_on_hook_answers_cuda_context(program: str) -> None:
    """The replay programs (no GPU) run as they are, on /dev/null and without hooks here, over hook_answer's CUDA
    context, whatever shape that list has, and print their phases; replay-mapping with its mapping thread, and
    replay-spinning with a thread as busy that maps nothing."""
    hs = bench_module("hook_startup")
    p = subprocess.run([sys.executable, "-c", hs.PROGRAMS[program]], env={**os.environ, "HOOK_STARTUP_GAP_US": "0"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    phases = json.loads(p.stdout)
    assert set(phases) == {"total", "init", "context"} and phases["context"] > 0
    assert ("def remap()" in hs.PROGRAMS[program]) == (program != "replay")
    assert ("mmap.mmap(" in hs.PROGRAMS[program]) == (program == "replay-mapping")


# ------------------------------------------------------------------------------------------------ raw and tables


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
    meta = {"command": "c", "machine": provenance.machine(), "commit": "a" * 40, "dirty": False, "standin": False}
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


@pytest.mark.parametrize(("passed_on", "variant"), [
    ("", False),
    ("-- --pairs cuda1:1", False),  # part of the suite (is_subset keeps it out of the table)
    ("-- --weights=1:2", False),
    ("-- --logs /tmp/logs", True),  # the logs outside the run's archive, where the suite keeps them
    ("-- --slice-ms 10", True),
    ("-- --engine user", True),  # another workload
    ("-- --seconds 3 --unisched-warmup 0", True),  # other windows
    ("-- --online-batches 1", True),
    ("-- --rounds 3", True),  # the script's own repeats, of which its reader keeps one
    ("-- --logs /tmp/logs --serve-arg=--log-level --serve-arg=debug", True),
])
def test_any_argument_passed_on_to_a_suites_scripts_makes_a_variant_but_those_that_run_part_of_it(
        passed_on: str, variant: bool) -> None:
    assert summary.is_variant({"command": f"python3 bench/run.py pairs --rounds 3 {passed_on}"}) is variant


def test_a_run_with_no_round_yet_does_not_stand_for_its_suite(tmp_path: Path) -> None:
    """A newer commit's run stopped or killed in its first round leaves a summary with no round: the measured run
    stays in the table."""
    suite = suites.BY_NAME["leases"]
    meta = {"command": "c", "machine": provenance.machine(), "commit": "a" * 40, "dirty": False, "standin": False,
            "date_utc": "2026-01-01 10:00:00"}
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [], "cases": {"round trip, 1 tenant": {"p99_ms": 0.3}}}
    summary.write(tmp_path / "2026-01-01-h200-aaaaaaa" / "leases", summary.build(suite, [rnd] * 3, meta))
    summary.write(tmp_path / "2026-01-02-h200-bbbbbbb" / "leases",
                  summary.build(suite, [], {**meta, "commit": "b" * 40, "in_progress": {"round": 1, "date_utc": "t"}}))
    assert summary.latest(tmp_path, history=["b" * 40, "a" * 40])["leases"][0].parent.name == "2026-01-01-h200-aaaaaaa"


def test_the_table_shows_the_newest_code_measured_not_a_later_run_of_older_code(tmp_path: Path) -> None:
    """A control run of an older commit, made after the newer commit's run (an A/B on one machine), does not stand
    for the code as it is; of one commit the newest run does; commits outside the history come after."""
    suite = suites.BY_NAME["leases"]
    new, old, gone = "c" * 40, "d" * 40, "e" * 40
    runs = (("2025-12-31", new, 0.7), ("2026-01-01", new[:7], 0.6), ("2026-01-02", old[:7], 0.3),
            ("2026-01-03", gone, 0.2), ("2026-01-04", new[:3], 0.1))  # (a 3-digit prefix names no commit)
    for day, commit, p99 in runs:
        rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [],
               "cases": {"round trip, 1 tenant": {"tenants": 1, "p99_ms": p99}}}
        meta = {"command": "c", "machine": provenance.machine(), "commit": commit, "dirty": False, "standin": False,
                "date_utc": f"{day} 10:00:00"}
        summary.write(tmp_path / f"{day}-h200-{commit[:7]}" / "leases", summary.build(suite, [rnd] * 3, meta))
    pick = summary.latest(tmp_path, history=[new, old])["leases"][0]
    assert pick.parent.name == f"2026-01-01-h200-{new[:7]}"
    assert summary.latest(tmp_path, history=[old, new])["leases"][0].parent.name == f"2026-01-02-h200-{old[:7]}"
    assert summary.latest(tmp_path, history=[])["leases"][0].parent.name == f"2026-01-04-h200-{new[:3]}"


def test_compare_sets_one_suites_runs_side_by_side_with_each_runs_verdicts(tmp_path: Path) -> None:
    suite = suites.BY_NAME["leases"]
    meta = {"command": "c", "machine": provenance.machine(), "commit": "a" * 40, "dirty": False, "standin": True,
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
    meta = {"command": "c", "machine": provenance.machine(), "commit": "a" * 40, "dirty": False, "standin": False,
            "date_utc": "2026-01-01 10:00:00"}
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [],
           "cases": {"socket a": {"tenants": 1, "p99_ms": 0.2}, "socket b": {"tenants": 1, "p99_ms": 0.45},
                     "socket c": {"tenants": 1, "p99_ms": 0.3}}}
    summary.write(tmp_path / "2026-01-01-h200-aaaaaaa" / "leases", summary.build(suite, [rnd] * 3, meta))
    row = next(x for x in summary.results_table(tmp_path, link_from=tmp_path).splitlines()
               if x.startswith("| leases |"))
    assert "3 of 3" in row and "socket b: PASS (0.45)" in row


def test_the_tables_worst_case_of_an_every_round_target_is_the_one_that_missed_in_the_most_rounds(tmp_path: Path) -> None:
    """Overlap's guarantee: 1:1 missed in 1 round of 3, 3:1 in all 3; the table names 3:1 (not the least bad)."""
    suite = suites.BY_NAME["overlap"]
    meta = {"command": "c", "machine": provenance.machine(), "commit": "a" * 40, "dirty": False, "standin": False,
            "date_utc": "2026-01-01 10:00:00"}

    def rnd(k: int, one_to_one: bool) -> dict[str, Any]:
        case = {"contending": False, "sum_vs_no_scheduler": 0.0}
        return {"round": k, "date_utc": str(k), "steps": [], "notes": [],
                "cases": {"cuda+render 1:1": {**case, "guarantee": one_to_one},
                          "cuda+render 3:1": {**case, "guarantee": False},
                          "cuda+render 1:3": {**case, "guarantee": True}}}

    summary.write(tmp_path / "2026-01-01-h200-aaaaaaa" / "overlap",
                  summary.build(suite, [rnd(1, False), rnd(2, True), rnd(3, True)], meta))
    rows = [x for x in summary.results_table(tmp_path, link_from=tmp_path).splitlines() if x.startswith("| overlap |")]
    guarantee = next(x for x in rows if "weight share" in x)
    assert "1 of 3" in guarantee and "cuda+render 3:1: FAIL: missed in 3 of 3 rounds" in guarantee
    met = {"case": "c", "target": "t", "text": "t", "value": 0.0, "passed": True, "detail": ""}
    assert summary._worst_label(met, "every") == "PASS"  # not "PASS (0)": the 0 counts rounds missed
    assert summary._worst_label(met, "worst") == "PASS (0)"


def test_a_case_the_suite_runs_that_no_round_measured_fails_in_the_summary_and_the_table(tmp_path: Path) -> None:
    """Overlap runs three pairs; rounds that hold two read as missing the third, not as all met. A part of the
    suite (`-- --pairs`) is not held to the cases it left out."""
    suite = suites.BY_NAME["overlap"]
    meta = {"command": "python3 bench/run.py overlap", "machine": provenance.machine(), "commit": "a" * 40,
            "dirty": False, "standin": False, "date_utc": "2026-01-01 10:00:00"}
    case = {"contending": False, "guarantee": True, "sum_vs_no_scheduler": 0.0}
    rnd = {"round": 1, "date_utc": "1", "steps": [], "notes": [],
           "cases": {"cuda+render 1:1": case, "cuda+render 3:1": case}}
    s = summary.build(suite, [rnd] * 3, meta)
    assert s["passed"] is False
    assert [(v["case"], v["detail"]) for v in s["verdicts"] if not v["passed"]] == \
        [("cuda+render 1:3", "not measured in any round")]
    summary.write(tmp_path / "2026-01-01-h200-aaaaaaa" / "overlap", s)
    row = next(x for x in summary.results_table(tmp_path, link_from=tmp_path).splitlines() if "every case" in x)
    assert "0 of 1" in row and "cuda+render 1:3: FAIL: not measured in any round" in row
    part = summary.build(suite, [rnd] * 3, {**meta, "command": "python3 bench/run.py overlap -- --pairs cuda1:1"})
    assert part["passed"] is True


def test_the_reports_statistics_say_how_many_rounds_each_is_over() -> None:
    """ad-sim has no target: a round without a metric would narrow its statistics unseen."""
    meta = {"command": "c", "machine": provenance.machine(), "commit": "a" * 40, "dirty": False, "standin": False,
            "date_utc": "2026-01-01 10:00:00"}
    rounds = [{"round": k, "date_utc": str(k), "steps": [], "notes": [],
               "cases": {"stages": {"fps": 30.0 + k} if k != 2 else {}}} for k in (1, 2, 3)]
    report = summary.report_md(summary.build(suites.BY_NAME["ad-sim"], rounds, meta))
    assert "| stages | fps | 2 of 3 | 32 | 31 | 33 |" in report


def test_a_run_with_fewer_rounds_than_its_suite_needs_is_not_settled(tmp_path: Path) -> None:
    """Overhead needs 5 rounds: after 1 that met every target, neither the report nor the table says it passed."""
    suite = suites.BY_NAME["overhead"]
    meta = {"command": "c", "machine": provenance.machine(), "commit": "a" * 40, "dirty": False, "standin": False,
            "date_utc": "2026-01-01 10:00:00"}
    rnd = {"round": 1, "date_utc": "d", "steps": [], "notes": [], "cases": {"cuda alone": {"loss": 0.001},
                                                                          "render alone": {"loss": -0.002}}}
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


def test_every_run_the_table_shows_holds_the_verdicts_its_rounds_give_by_the_current_targets() -> None:
    """The table trusts each summary's stored verdicts: a verdict edited by hand, or judged by targets since changed,
    would stand unseen. Each run it shows is judged again from its stored rounds (`bench/run.py --rescore` brings a
    run to the current targets)."""
    if (gap := summary.history_gap()) is not None:
        pytest.skip(gap)
    shown = summary.latest()
    assert shown, "no run to check"
    for name, (folder, s) in shown.items():
        meta = {k: s[k] for k in summary.RUN_META if k in s}
        again = summary.build(suites.BY_NAME[name], s["rounds"], meta)
        for key in ("targets", "verdicts", "passed"):
            assert again[key] == s[key], f"{folder}: its stored {key} are not what its rounds give: rescore it"


def test_the_code_hash_of_a_clean_tree_is_its_commits() -> None:
    """What a run records of the tree it measured (`code`) is what the commit it names holds, so a test can hold a
    run's `--commit` to its code."""
    if (gap := summary.history_gap()) is not None:
        pytest.skip(gap)
    changed = subprocess.run(["git", "status", "--porcelain", "--", *provenance.CODE_DIRS], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    if changed.strip():
        pytest.skip(f"the tree's code has uncommitted changes: {changed.splitlines()[0]}")
    assert provenance.code_hash() == provenance.code_hash_at("HEAD")
    assert provenance.code_hash_at("HEAD~1") is not None and provenance.code_hash_at("no-such-commit") is None


def test_stale_says_per_suite_whether_the_run_shown_measured_this_code() -> None:
    """The table names each run's commit; --stale says which runs' code has moved on since, and how (product code
    named first), and which suites have no run or a commit git does not know."""
    run = bench_module("run")
    s = {"rounds": [{}, {}, {}]}
    runs = {"pairs": (Path("r/2026-12-06-h100-aaaaaaa/pairs"), {**s, "commit": "aaaaaaa"}),
            "mixed": (Path("r/2026-12-06-h100-bbbbbbb/mixed"), {**s, "commit": "bbbbbbb"}),
            "overlap": (Path("r/2026-12-06-h100-ccccccc/overlap"), {**s, "commit": "ccccccc"})}
    changed = {"aaaaaaa": [], "bbbbbbb": ["bench/x.py", "unisched/policy/plan.py"], "ccccccc": None}
    lines = run.stale(runs, changed.__getitem__).splitlines()
    by = {line.split(":")[0]: line for line in lines}
    assert set(by) == {x.name for x in suites.SUITES}
    assert by["pairs"].endswith("2026-12-06-h100-aaaaaaa (3 rounds): the code it measured is this checkout's")
    assert "(unisched/ 1, bench/ 1): unisched/policy/plan.py, bench/x.py" in by["mixed"]
    assert "is unknown" in by["overlap"] and by["hooks"] == "hooks: no run"
    assert provenance.code_changed_since("no-such-commit") is None


def test_every_run_the_table_shows_measured_the_code_of_the_commit_it_names() -> None:
    if (gap := summary.history_gap()) is not None:
        pytest.skip(gap)
    for folder, s in summary.latest().values():
        if s.get("code"):  # (runs before the runner recorded it have none)
            assert provenance.code_hash_at(s["commit"]) == s["code"], f"{folder}: its code is not {s['commit']}'s"


def test_the_readme_table_is_the_generated_one() -> None:
    if (gap := summary.history_gap()) is not None:
        pytest.skip(gap)
    text = (ROOT / "README.md").read_text()
    found = summary.readme_table(text)
    if found is None:
        pytest.skip(f"README.md has no {summary.README_BEGIN} / {summary.README_END} markers yet")
    assert found == summary.results_table(), "stale: run `python3 bench/run.py --update-readme README.md`"


def test_the_results_page_is_the_generated_one() -> None:
    if (gap := summary.history_gap()) is not None:
        pytest.skip(gap)
    text = (ROOT / "docs" / "results.md").read_text()
    found = summary.readme_table(text)
    assert found is not None, f"docs/results.md lost its {summary.README_BEGIN} / {summary.README_END} markers"
    assert found == summary.results_page(link_from=ROOT / "docs"), \
        "stale: run `python3 bench/run.py --update-results docs/results.md`"


def test_the_results_page_lists_every_verdict_of_each_latest_run(tmp_path: Path) -> None:
    suite = suites.BY_NAME["leases"]
    meta = {"command": "python3 bench/run.py leases", "machine": provenance.machine(), "commit": "c" * 40,
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
    bench_module("scenarios")  # puts examples/workloads on the path, as the online suite's command does
    online_scoring = bench_module("online_scoring")

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
    cases, notes = readers.read_online(tmp_path)
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
