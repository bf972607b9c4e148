"""bench/scenarios.py without a GPU: the derived numbers, tables, plots and plan (the runs need the GPU machine)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import online_report
import online_scoring
import pairs_runs
import scenarios


def run_with(tenants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"tenants": [{"name": n, "report": r} for n, r in tenants.items()]}


def online_runs(p99_shared: float, kept_tp: float, spread: float = 0.02) -> dict[str, Any]:
    """p99s with 90% intervals +-`spread` around them (examples/online_offline.py reports p99_lo / p99_hi)."""
    def lat(p50: float, p99: float) -> dict[str, float]:
        return {"p50": p50, "p99": p99, "p99_lo": p99 * (1 - spread), "p99_hi": p99 * (1 + spread)}

    alone = run_with({"online": {"latency_ms": lat(7.0, 9.0)}})
    solo = run_with({"offline": {"throughput": 1500.0}})
    shared = run_with({"online": {"latency_ms": lat(7.5, p99_shared), "dropped": 0},
                       "offline": {"throughput": kept_tp}})
    return {"alone-online": alone, "alone-offline": solo, "unisched user": shared, "MPS": {"error": "mps failed"}}


def test_online_target_needs_both_latency_and_offline_throughput() -> None:
    ok = online_scoring.derive_online(online_runs(9.4, 1250.0))["setups"]["unisched user"]
    assert ok["p99_x_alone"] == pytest.approx(9.4 / 9.0)
    assert ok["offline_kept"] == pytest.approx(1250 / 1500)
    assert ok["target_met"] is True
    assert online_scoring.derive_online(online_runs(9.6, 1250.0))["setups"]["unisched user"]["target_met"] is False
    assert online_scoring.derive_online(online_runs(9.4, 1100.0))["setups"]["unisched user"]["target_met"] is False
    failed = online_scoring.derive_online(online_runs(9.4, 1250.0))["setups"]["MPS"]
    assert failed["target_met"] is None and failed["error"] == "mps failed"
    # the online tenant alone under MPS is a reference: its p99 against alone, no trainer and so no verdict
    floor_run = run_with({"online": {"latency_ms": {"p50": 7.7, "p99": 9.9}}})
    runs = {**online_runs(9.4, 1250.0), "online alone, MPS client": floor_run}
    floor = online_scoring.derive_online(runs)["setups"]["online alone, MPS client"]
    assert floor["p99_x_alone"] == pytest.approx(1.1) and floor["p50_x_alone"] == pytest.approx(1.1)
    assert floor["offline_kept"] is None and floor["target_met"] is None


def test_share_series_follows_the_timelines() -> None:
    # A completes 30 items/s (solo 40), B 10 items/s (solo 40): shares 0.75 / 0.25 in every second
    import plot_pairs

    a = {"window": {"timeline": [[0.5 * i, 15 * i] for i in range(9)]}}
    b = {"window": {"timeline": [[0.5 * i, 5 * i] for i in range(9)]}}
    times, (sa, sb) = plot_pairs.share_series([a, b], [40.0, 40.0])
    assert times == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sa[1:] == pytest.approx([0.75] * 4) and sb[1:] == pytest.approx([0.25] * 4)


def results_fixture() -> dict[str, Any]:
    return {"meta": {"gpu": "NVIDIA H200"}, "scenarios": {
        "online": {"rate": 20, "batches": {"1": {**online_runs(9.4, 1250.0),
                                                 "derived": online_scoring.derive_online(online_runs(9.4, 1250.0))}}},
    }}


def test_tables_and_plots_from_results(tmp_path: Path) -> None:
    made = online_report.write_outputs(results_fixture(), tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| 1 | unisched user | 7.50 | 9.40 | 1.07 | 1.04 | 1.00-1.09: cannot tell | 0.83 | **met** |" in md
    names = sorted(p.name for p in made)
    assert names == ["online-b1-latency.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in made)
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["gpu"] == "NVIDIA H200"


def test_replot_and_bad_arguments(tmp_path: Path) -> None:
    online_report.write_outputs(results_fixture(), tmp_path)
    (tmp_path / "results.md").unlink()
    cmd = [sys.executable, str(ROOT / "bench" / "scenarios.py"), "--out", str(tmp_path)]
    done = subprocess.run([*cmd, "--replot"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "results.md").exists() and "online b1 unisched user" in done.stdout
    bad = subprocess.run([*cmd, "--scenarios", "online,furmark"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown scenario furmark" in bad.stderr
    plan = subprocess.run([*cmd, "--scenarios", "online", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0 and "[12/12] online: batch 8, unisched user" in plan.stderr
    plan = subprocess.run([*cmd, "--scenarios", "online", "--online-batches", "1", "--repeat", "3", "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0 and "[18/18] online: batch 1, unisched user, round 3/3" in plan.stderr
    bad = subprocess.run([*cmd, "--repeat", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--repeat must be at least 1" in bad.stderr
    for args, says in ((["--interleave", "0.2"], "--interleave: a period over 0.2 s"),
                       (["--solo-seconds", "-1"], "--solo-seconds must be positive"),
                       (["--offline-batch", "0"], "--offline-batch must be at least 1")):
        bad = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr

    def online_plan(setups: str) -> str:
        """The dry-run plan of the online scenario at batch 1 with these --online-setups."""
        plan = subprocess.run([*cmd, "--scenarios", "online", "--online-batches", "1", "--online-setups", setups,
                               "--dry-run"], capture_output=True, text=True, timeout=60)
        assert plan.returncode == 0, plan.stderr
        return plan.stderr

    plan_text = online_plan("user,kernel")
    assert "[4/4] online: batch 1, unisched user" in plan_text
    assert "MPS" not in plan_text and "no scheduler" not in plan_text
    bad = subprocess.run([*cmd, "--online-setups", "user,slurm"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--online-setups: choose from no-scheduler, mps, mps-priority, kernel, user" in bad.stderr
    assert "[3/3] online: batch 1, MPS, trainer below normal" in online_plan("mps-priority")
    plan_text = online_plan("user-mps,mps-priority")
    assert "[3/4] online: batch 1, MPS, trainer below normal" in plan_text
    assert "[4/4] online: batch 1, unisched user, MPS, trainer below normal" in plan_text
    assert "[3/3] online: batch 1, unisched user, MPS, trainer below normal and capped" in online_plan("user-mps-cap")
    plan_text = online_plan("mps-alone,user-mps-points")
    assert "[3/4] online: batch 1, unisched user, --mps, trainer pausing, uncapped" in plan_text
    assert "[4/4] online: batch 1, online alone, MPS client" in plan_text
    assert "[3/3] online: batch 1, unisched user, --mps, offline at 60%" in online_plan("user-mps-daemon-60")


def test_each_mps_setup_starts_the_daemon_with_its_own_sm_cap() -> None:
    """The setups differ only in the daemon's arguments: a wrong cap would measure another setup under its name."""
    s = online_scoring.ONLINE_SETUPS
    assert scenarios.serve_args_for(s["user"]) == ("--mode", "preemptive")
    assert scenarios.serve_args_for(s["user-mps-daemon"])[-2:] == ("--mps-offline-sm-percent", "30")
    assert scenarios.serve_args_for(s["user-mps-points"])[-2:] == ("--mps-offline-sm-percent", "100")
    sixty = ("--mode", "preemptive", "--mps", "--mps-offline-sm-percent", "60")
    assert scenarios.serve_args_for(s["user-mps-daemon-60"]) == sixty
    assert scenarios.serve_args_for(s["user-mps-daemon-90"])[-1] == "90"


def test_online_rounds_are_medians_each_against_its_own_solo_runs() -> None:
    """The solo references drift between runs on the lent H200 VM: one round's 'met' can be chance."""
    lucky = online_runs(9.4, 1250.0)  # 1.04x, 83%: met
    slow = online_runs(12.0, 1100.0)  # 1.33x, 73%
    slower = online_runs(13.5, 1000.0)
    d = online_scoring.combine_online([online_scoring.derive_online(r) for r in (lucky, slow, slower)])
    s = d["setups"]["unisched user"]
    assert d["rounds"] == 3 and s["p99_x_alone"] == pytest.approx(12.0 / 9.0)
    assert s["p99_x_alone_range"] == pytest.approx([9.4 / 9.0, 13.5 / 9.0])
    assert s["offline_kept"] == pytest.approx(1100 / 1500) and s["p50_x_alone"] == pytest.approx(7.5 / 7.0)
    assert s["target_met"] is False and s["target_met_rounds"] == 1
    assert d["setups"]["MPS"]["error"] == "mps failed" and d["setups"]["MPS"]["target_met"] is None
    table = "\n".join(online_report.online_md({"rate": 20, "batches": {"1": {"derived": d}}}))
    assert ("| 1 | unisched user | 7.50 | 12.00 | 1.07 [1.07-1.07] | 1.33 [1.04-1.50] | 1.28-1.39: above the target | "
            "0.73 [0.67-0.83] | missed (1 of 3 rounds) |") in table
    assert online_scoring.combine_online([online_scoring.derive_online(lucky)]) == online_scoring.derive_online(lucky)


def test_pooled_rounds_rest_the_p99_on_every_round_s_requests() -> None:
    """Three rounds of 240 requests: each round's p99 is its ~3rd highest; pooled, the ~8th of 720, with an
    interval that can settle what no single round's can."""
    def with_latencies(alone: list[float], shared: list[float]) -> dict[str, Any]:
        runs = online_runs(9.4, 1250.0)
        runs["alone-online"]["tenants"][0]["report"]["latencies_ms"] = alone
        runs["unisched user"]["tenants"][0]["report"]["latencies_ms"] = shared
        return runs

    alone = [5.0 + 0.01 * i for i in range(240)]  # 5.00 .. 7.39 ms
    rounds = [with_latencies(alone, [v * 1.2 for v in alone]) for _ in range(3)]
    pooled = online_scoring.pool_online(rounds)
    assert pooled["alone"]["n"] == 720 and pooled["setups"]["unisched user"]["n"] == 720
    s = pooled["setups"]["unisched user"]
    assert s["p99_x_alone"] == pytest.approx(1.2, rel=1e-3)
    assert s["p99_x_bounds"][0] > 1.05 and s["resolution"] == "above the target"
    assert "MPS" not in pooled["setups"]  # it failed: no requests to pool
    table = "\n".join(online_report.online_md({"rate": 20, "batches": {"1": {"derived": {
        **online_scoring.combine_online([online_scoring.derive_online(r) for r in rounds]), "pooled": pooled}}}}))
    assert "| 1 | unisched user | 720 | 8.84 (" in table and "| above the target |" in table
    assert online_scoring.pool_online([online_runs(9.4, 1250.0)]) == {"alone": None, "setups": {}}  # older reports


def test_a_late_trainer_counts_only_the_requests_that_met_it() -> None:
    """The H200's freezer enforcement round 2 of 12-01: the trainer's first step 5.3 s into the 12 s window. Requests
    before it met no trainer (fast), and the trainer is scored over the seconds the online tenant also ran."""
    runs = online_runs(9.4, 1250.0)
    arrivals = [0.05 * i for i in range(240)]  # 0 .. 11.95 s
    latencies = [5.0 if a < 5.3 else 11.0 + 0.01 * i for i, a in enumerate(arrivals)]
    online = runs["unisched user"]["tenants"][0]["report"]
    online.update({"latencies_ms": latencies, "arrivals_s": arrivals,
                   "window": {"timeline": [[0.05 + 0.5 * k, 10 * k] for k in range(24)]}})
    offline = runs["unisched user"]["tenants"][1]["report"]
    offline["window"] = {"late_s": 5.3, "timeline": [[5.3 + 0.5 * k, 600 * k] for k in range(14)]}  # 1200 img/s
    s = online_scoring.derive_online(runs)["setups"]["unisched user"]
    assert s["common_window"] == [5.3, pytest.approx(11.55)]
    assert s["offline_kept"] == pytest.approx(1200 / 1500)
    assert s["p50_ms"] > 11.0 and s["p99_ms"] > 13.0  # no 5 ms request left (all 240: p50 ~5 ms)
    runs["alone-online"]["tenants"][0]["report"]["latencies_ms"] = [5.0] * 240
    pooled = online_scoring.pool_online([runs])
    assert pooled["setups"]["unisched user"]["n"] == sum(1 for a in arrivals if 5.3 <= a <= 11.55)


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_explains_itself_without_a_gpu(name: str) -> None:
    """Each example runs on its own with --help (no GPU, no daemon needed to read it)."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-800:]
    assert "usage:" in done.stdout and "--seconds" in done.stdout


def test_online_batches_run_in_separate_invocations_add_up(tmp_path: Path) -> None:
    """A device call fits one batch size; the next call's batch 8 must not drop the batch-1 results."""
    (tmp_path / "results.json").write_text(json.dumps(results_fixture()))
    opts = scenarios.Options(out=tmp_path, seconds=10, warmup=8, unisched_warmup=12, slice_ms=50, rate=20,
                             online_batches=(8,), work_dir=tmp_path, max_total=60, dry_run=True)
    h = scenarios.Harness(opts, ["online"])
    h.save("online", {"rate": 20, "batches": {"8": {"derived": {}}}})
    saved = json.loads((tmp_path / "results.json").read_text())["scenarios"]
    assert sorted(saved["online"]["batches"]) == ["1", "8"]


@pytest.mark.parametrize(("p99", "spread", "says"), [(9.0, 0.01, "below the target"), (9.4, 0.2, "cannot tell"),
                                                     (12.0, 0.05, "above the target")])
def test_p99_bounds_say_whether_the_runs_can_tell(p99: float, spread: float, says: str) -> None:
    s = online_scoring.derive_online(online_runs(p99, 1250.0, spread))["setups"]["unisched user"]
    lo, hi = s["p99_x_bounds"]
    assert lo == pytest.approx(p99 * (1 - spread) / (9.0 * (1 + spread)))
    assert hi == pytest.approx(p99 * (1 + spread) / (9.0 * (1 - spread)))
    assert online_scoring.p99_resolution(s["p99_x_bounds"]) == says


def test_reports_without_intervals_have_no_bounds() -> None:
    runs = online_runs(9.4, 1250.0)
    for run in (runs["alone-online"], runs["unisched user"]):
        for t in run["tenants"]:
            (t["report"].get("latency_ms") or {}).pop("p99_lo", None)
    assert online_scoring.derive_online(runs)["setups"]["unisched user"]["p99_x_bounds"] is None


@pytest.mark.parametrize(("setup", "trainer_var", "value"), [("MPS", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30"),
                                                             ("MPS, trainer below normal", "CUDA_MPS_CLIENT_PRIORITY", "1")])
def test_mps_setups_give_the_trainer_its_cap_or_its_low_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 setup: str, trainer_var: str, value: str) -> None:
    """The online tenant is an MPS client as it is; only the trainer carries the setup's variable."""
    seen: list[Any] = []

    @contextlib.contextmanager
    def fake_mps(work: Path) -> Iterator[dict[str, str]]:
        (work / "mps-log").mkdir(parents=True)
        (work / "mps-log" / "server.log").write_text("[server] client connected\n")
        yield {"CUDA_MPS_PIPE_DIRECTORY": str(work / "pipe")}

    def fake_run_group(cfg: Any, label: str, setup_name: str, tenants: list[Any], *a: Any, **k: Any) -> Any:
        seen.extend(tenants)
        assert re.fullmatch(r"b1-[A-Za-z0-9-]+", label), label  # a folder name: no spaces or commas
        return pairs_runs.GroupResult(label=label, setup=setup_name, tenants=[], start_at=0.0, wall_s=0.0)

    monkeypatch.setattr(scenarios, "mps_daemon", fake_mps)
    monkeypatch.setattr(scenarios, "run_group", fake_run_group)
    opts = scenarios.Options(out=tmp_path, seconds=10, warmup=8, unisched_warmup=12, slice_ms=50, rate=20,
                             online_batches=(1,), work_dir=tmp_path, max_total=60, dry_run=False)
    run = scenarios.Harness(opts, ["online"]).online_run(1, setup)
    env = {t.name: dict(t.env) for t in seen}
    assert env["offline"][trainer_var] == value and trainer_var not in env["online"]
    assert env["online"]["CUDA_MPS_PIPE_DIRECTORY"] == env["offline"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert "client connected" in run["mps_log"]["server.log"]


def test_the_online_clients_lease_wait_is_shown_and_kept() -> None:
    """Where a user-engine request's time goes: the lease round trip, apart from the GPU work."""
    runs = online_runs(9.4, 1250.0)
    online = next(t for t in runs["unisched user"]["tenants"] if t["name"] == "online")
    online["report"]["lease_wait_ms"] = {"p50": 0.41, "p99": 1.2}
    assert "(lease wait p50 0.41 p99 1.20 ms)" in online_report.online_line(runs["unisched user"])
    assert online_scoring.derive_online(runs)["setups"]["unisched user"]["lease_wait_ms"]["p99"] == 1.2
    assert "lease wait" not in online_report.online_line(runs["alone-online"])


def test_the_pausing_setup_runs_the_user_engine_with_a_pausing_trainer(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    class FakeDaemon:
        def __init__(self, cfg: Any, label: str, serve_args: tuple[str, ...] = ()) -> None:
            self.info: dict[str, Any] = {}
            seen["serve_args"] = serve_args

        def start(self) -> None: ...

        def stop(self) -> None: ...

    def fake_run_group(cfg: Any, label: str, setup_name: str, tenants: list[Any], *a: Any, **k: Any) -> Any:
        seen.update(engine=cfg.engine, cmd=cfg.workload_cmd, label=label)
        return pairs_runs.GroupResult(label=label, setup=setup_name, tenants=[], start_at=0.0, wall_s=0.0)

    monkeypatch.setattr(scenarios, "Daemon", FakeDaemon)
    monkeypatch.setattr(scenarios, "run_group", fake_run_group)
    opts = scenarios.Options(out=tmp_path, seconds=10, warmup=8, unisched_warmup=12, slice_ms=50, rate=20,
                             online_batches=(1,), work_dir=tmp_path, max_total=60, dry_run=False)
    h = scenarios.Harness(opts, ["online"])
    h.online_run(1, "unisched user, trainer pausing")
    assert seen["engine"] == "user" and seen["serve_args"] == ("--mode", "preemptive")
    assert seen["cmd"]["offline"][-2:] == ["--pause-every", str(scenarios.PAUSE_EVERY)]
    assert seen["label"] == "b1-unisched-user-trainer-pausing"
    h.online_run(1, "unisched user")
    assert "--pause-every" not in seen["cmd"]["offline"]


def test_plot_pairs_draws_each_round_of_a_committed_rounds_folder(tmp_path: Path) -> None:
    """bench/plot_pairs.py on a copy of a committed rounds folder: one bar chart per round and one share plot per
    unisched pair, titled with the workload the round ran (a matmul pair here, not "training")."""
    import shutil

    src = ROOT / "bench/results/2026-12-01-h200-g/call-d-kernel-matmul/rounds-kernel-matmul"
    dst = tmp_path / "rounds"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("plots"))
    p = subprocess.run([sys.executable, str(ROOT / "bench/plot_pairs.py"), str(dst)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    made = sorted(Path(line).relative_to(dst).as_posix() for line in p.stdout.split())
    assert made == [f"round-{r}/plots/mixed-kernel-{name}.png" for r in (1, 2)
                    for name in ("cuda-render-1-1-share", "cuda-render-1-3-share", "normalized")]
    assert all((dst / m).stat().st_size > 5000 for m in made)
    import plot_pairs

    assert plot_pairs.workloads(json.loads((src / "round-1/results.json").read_text())["meta"])[1] == ("matmul", "render")
    bad = subprocess.run([sys.executable, str(ROOT / "bench/plot_pairs.py"), str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "no results.json" in bad.stderr
