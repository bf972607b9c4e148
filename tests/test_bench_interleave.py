"""bench/interleave.py and the examples' StepPauser: the online scenario's trainer idle in every other period.

Plans, splits and rates are pure; the Alternator runs on an injected clock; the pause itself runs for real in a
child process (signals, sigwait), waited on by reading its output, not by sleeping."""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import online_report
import online_scoring
from interleave import PAUSED, RUNNING, Alternation, Alternator, paired_bootstrap, period_pairs, running_rate, split_latencies


def test_phases_alternate_from_running_with_guards_at_each_switch() -> None:
    plan = Alternation(start_at=100.0, seconds=5.0, period_s=1.0, guard_s=0.1)
    assert [plan.phase(t) for t in (0.05, 0.5, 0.95, 1.05, 1.5, 2.5, 3.5, 4.5)] == \
        [None, RUNNING, None, None, PAUSED, RUNNING, PAUSED, RUNNING]
    assert plan.phase(-0.1) is None and plan.phase(5.0) is None
    assert plan.switches() == [(1.0, True), (2.0, False), (3.0, True), (4.0, False)]
    assert Alternation.from_json(plan.to_json()) == plan
    # the pauses ended early (the final resume at 3.5 s): nothing after counts for either phase
    ended = Alternation.from_json({**plan.to_json(), "resumed_at_s": 3.5, "switches": 3})
    assert ended.until_s == 3.5 and ended.phase(3.3) is PAUSED and ended.phase(3.45) is None and ended.phase(4.5) is None
    held = Alternation.from_json({**plan.to_json(), "resumed_at_s": 5.001, "switches": 4})
    assert held == plan
    # recorded before the last pause was held to the end: an odd count of switches, the last a pause cut short
    assert Alternation.from_json({**plan.to_json(), "switches": 3}).until_s == 3.0
    assert Alternation.from_json({**plan.to_json(), "switches": 4}) == plan
    with pytest.raises(ValueError, match="guard"):
        Alternation(0.0, 5.0, 0.2, 0.1)
    with pytest.raises(ValueError, match="positive"):
        Alternation(0.0, 5.0, 0.0, 0.0)


def test_requests_split_by_the_phase_they_arrived_in() -> None:
    plan = Alternation(0.0, 4.0, 1.0, 0.1)
    arrivals = [0.2, 0.5, 0.98, 1.3, 1.7, 2.4, 3.2, 3.99]
    latencies = [7.0, 7.5, 99.0, 5.0, 5.5, 8.0, 6.0, 99.0]
    split = split_latencies(plan, arrivals, latencies)
    assert split == {RUNNING: [7.0, 7.5, 8.0], PAUSED: [5.0, 5.5, 6.0]}
    assert split_latencies(plan, arrivals, latencies, since_s=1.0) == {RUNNING: [8.0], PAUSED: [5.0, 5.5, 6.0]}


def test_offline_rate_counts_only_its_running_seconds() -> None:
    plan = Alternation(0.0, 10.0, 1.0, 0.1)  # running 0-1, 2-3, 4-5, 6-7, 8-9: 5 s
    assert running_rate(plan, 500) == pytest.approx(100.0)
    assert running_rate(plan, 400, since_s=2.0) == pytest.approx(100.0)  # started late: 4 s of running periods
    assert running_rate(Alternation(0.0, 1.0, 1.0, 0.1), 0, since_s=1.0) is None
    # pauses ended at 7 s (resumed then): it ran 0-1, 2-3, 4-5, 6-7 and 7-10: 7 s
    assert running_rate(Alternation(0.0, 10.0, 1.0, 0.1, until_s=7.0), 700) == pytest.approx(100.0)


def test_alternator_sends_pause_and_resume_on_time_and_resumes_at_the_end() -> None:
    now = [100.0]
    sent: list[tuple[float, int, int]] = []

    def wait(s: float) -> bool:
        now[0] += s + 0.002  # each switch 2 ms late
        return now[0] > 103.5  # halted before the fourth switch

    alt = Alternator(Alternation(100.0, 6.0, 1.0, 0.1), pid=42, kill=lambda pid, sig: sent.append((now[0], pid, sig)),
                     clock=lambda: now[0], wait=wait)
    alt.run()
    assert [(round(t, 3), sig) for t, _, sig in sent] == [(101.002, signal.SIGUSR1), (102.002, signal.SIGUSR2),
                                                         (103.002, signal.SIGUSR1), (104.002, signal.SIGUSR2)]
    assert all(pid == 42 for _, pid, _ in sent)
    assert alt.lags_s == pytest.approx([0.002] * 3)
    assert alt.stop()["resumed_at_s"] == pytest.approx(4.002)

    # to the end: a last pause (at 3 s of a 3.5 s window) is held until the window ends, then resumed
    now[0], sent[:] = 200.0, []
    full = Alternator(Alternation(200.0, 3.5, 1.0, 0.1), pid=7, kill=lambda pid, sig: sent.append((now[0], pid, sig)),
                      clock=lambda: now[0], wait=lambda s: bool(now.__setitem__(0, now[0] + s)))
    full.run()
    assert [(round(t - 200.0, 3), sig) for t, _, sig in sent] == [(1.0, signal.SIGUSR1), (2.0, signal.SIGUSR2),
                                                                 (3.0, signal.SIGUSR1), (3.5, signal.SIGUSR2)]
    assert full.resumed_at_s == pytest.approx(3.5)

    def gone(pid: int, sig: int) -> None:
        raise ProcessLookupError

    ended = Alternator(Alternation(0.0, 3.0, 1.0, 0.1), pid=1, kill=gone, clock=lambda: 0.0, wait=lambda s: False)
    ended.run()
    assert ended.error == "the paused tenant ended before the window did"


PAUSABLE = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, %r)
    from _window import StepPauser
    pauser = StepPauser()
    threading.Thread(target=lambda: None).start()  # a thread started after it inherits the mask
    print("ready", flush=True)
    for line in sys.stdin:  # one step per line read
        pauser.between_steps(lambda: print("paused", flush=True))
        print(f"step {line.strip()} pauses={pauser.pauses}", flush=True)
""")


def test_step_pauser_idles_between_steps_until_resumed() -> None:
    child = subprocess.Popen([sys.executable, "-c", PAUSABLE % str(ROOT / "examples" / "workloads")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"

        def step(n: int) -> None:
            assert child.stdin is not None
            child.stdin.write(f"{n}\n")
            child.stdin.flush()

        step(1)
        assert child.stdout.readline().strip() == "step 1 pauses=0"
        child.send_signal(signal.SIGUSR1)  # blocked: pending until the next step boundary, not fatal
        step(2)
        assert child.stdout.readline().strip() == "paused"
        child.send_signal(signal.SIGUSR2)
        assert child.stdout.readline().strip() == "step 2 pauses=1"
        child.send_signal(signal.SIGUSR1)
        child.send_signal(signal.SIGUSR2)  # both within one step: no pause
        step(3)
        assert child.stdout.readline().strip() == "step 3 pauses=1"
        child.send_signal(signal.SIGUSR2)  # a resume alone (the alternator's last word): nothing
        step(4)
        assert child.stdout.readline().strip() == "step 4 pauses=1"
    finally:
        child.stdin.close()
        rc = child.wait(timeout=30)
        child.stdout.close()
    assert rc == 0


def interleaved_run() -> dict[str, object]:
    """A 4 s run in 1 s periods: requests beside the trainer 8 ms, without it 6 ms; the trainer 300 items."""
    plan = Alternation(1000.0, 4.0, 1.0, 0.1)
    arrivals = [k * 0.05 for k in range(1, 80)]
    lat = [8.0 if plan.phase(a) == RUNNING else 6.0 for a in arrivals]
    online = {"latency_ms": {"p50": 7.0, "p99": 8.0}, "latencies_ms": lat, "arrivals_s": arrivals, "dropped": 0}
    offline = {"throughput": 75.0, "window": {"items": 300, "late_s": 0.0, "timeline": [[0.0, 0], [3.9, 300]]}}
    return {"tenants": [{"name": "online", "report": online}, {"name": "offline", "report": offline}],
            "alternation": {**plan.to_json(), "switches": 3, "resumed_at_s": 4.0, "max_lag_ms": 0.4, "error": None}}


def test_an_interleaved_run_is_scored_against_its_own_paused_periods() -> None:
    alone = {"tenants": [{"name": "online", "report": {"latency_ms": {"p50": 5.0, "p99": 5.5}}}]}
    solo = {"tenants": [{"name": "offline", "report": {"throughput": 200.0}}]}
    runs = {"alone-online": alone, "alone-offline": solo, "MPS": interleaved_run()}
    s = online_scoring.derive_online(runs)["setups"]["MPS"]
    assert s["p99_x_alone"] == pytest.approx(8.0 / 6.0) and s["p50_x_alone"] == pytest.approx(8.0 / 6.0)
    assert s["offline_kept"] == pytest.approx(150.0 / 200.0)  # 300 items over 2 s of running periods
    i = s["interleaved"]
    assert i["paused_p99_x_alone_run"] == pytest.approx(6.0 / 5.5) and i["switches"] == 3
    assert i["mean_x"] == pytest.approx(8.0 / 6.0) and i["mean_x_ci"] is None  # two pairs of periods: no interval
    pooled = online_scoring.pool_online([runs, runs])["setups"]["MPS"]
    assert pooled["reference"] == "paused periods" and pooled["p99_x_alone"] == pytest.approx(8.0 / 6.0)
    online_scoring.derive_batch(runs)
    md = "\n".join(online_report.online_md({"rate": 20, "batches": {"1": runs}}))
    assert "| 1 | MPS (interleaved) |" in md and "| 1 | 1 | MPS |" in md


def test_run_group_idles_the_named_tenant_in_every_other_period(tmp_path: Path) -> None:
    """End to end without a GPU: pairs_runs.run_group (the runs of gpu_pairs and scenarios) pauses a --pausable CPU
    stand-in in alternate periods of its window; its report shows the pauses, and its timeline does not move inside a
    paused period."""
    import pairs_runs as runs

    standin = [sys.executable, str(ROOT / "bench" / "cpu_standin.py"), "--kind", "cuda", "--chunk", "2000"]
    cfg = runs.Config(python=sys.executable, seconds=3.0, warmup=1.0, unisched_warmup=1.0, slice_ms=50.0, grace_s=20.0,
                    work_dir=tmp_path, workload_cmd={"cuda": [*standin, "--pausable"]}, custom_cmd={"cuda": True},
                    unisched_module="unisched", env=dict(os.environ))
    group = runs.run_group(cfg, "alt", "no scheduler", [runs.TenantSpec("offline", "cuda", None)],
                           alternate=("offline", 0.6, 0.1))
    alt = group.extra["alternation"]
    assert alt["tenant"] == "offline" and alt["switches"] == 4 and alt["error"] is None  # 0.6, 1.2, 1.8, 2.4 s
    (t,) = group.tenants
    assert t.report is not None and t.error is None
    assert t.report["pauses"] == 2
    plan = Alternation.from_json(alt)
    timeline = t.report["window"]["timeline"]
    paused = [c for at, c in timeline if plan.phase(at) == PAUSED]
    assert len(set(paused)) <= 2  # at most one count per paused period: nothing completes while idle
    assert running_rate(plan, t.report["window"]["items"]) > t.report["throughput"]


def drifting_requests(effect: float) -> tuple[Alternation, list[float], list[float]]:
    """60 s of 1 s periods, 20 requests a second; the host drifts between 5 and 9 ms from pair to pair, and a
    request beside the trainer takes `effect` times as long."""
    plan = Alternation(0.0, 60.0, 1.0, 0.1)
    rng = random.Random(7)
    arrivals, lat = [], []
    for k in range(1200):
        a = k * 0.05 + 0.025
        if plan.phase(a) is None:
            continue
        host = 5.0 + 4.0 * ((int(a) // 2 * 7919) % 13) / 12  # one level per pair of periods
        arrivals.append(a)
        lat.append(host * rng.uniform(0.9, 1.1) * (effect if plan.phase(a) == RUNNING else 1.0))
    return plan, arrivals, lat


def test_paired_bootstrap_sees_an_effect_through_the_drift_and_no_effect_where_there_is_none() -> None:
    mean = statistics.fmean
    blocks = period_pairs(*drifting_requests(1.2))
    assert len(blocks) == 30 and all(len(r) == len(q) == 16 for r, q in blocks)
    ci = paired_bootstrap(blocks, mean, reps=400)
    assert ci is not None and 1.1 < ci[0] < 1.2 < ci[1] < 1.3
    ci = paired_bootstrap(period_pairs(*drifting_requests(1.0)), mean, reps=400)
    assert ci is not None and ci[0] < 1.0 < ci[1] and ci[1] - ci[0] < 0.05
    assert paired_bootstrap(blocks[:3], mean) is None  # under 4 pairs


def test_an_interleaved_online_scenario_gets_its_own_plot(tmp_path: Path) -> None:
    alone = {"tenants": [{"name": "online", "report": {"latency_ms": {"p50": 5.0, "p99": 5.5}}}]}
    solo = {"tenants": [{"name": "offline", "report": {"throughput": 200.0}}]}
    plain = {"alone-online": alone, "alone-offline": solo}
    results = {"scenarios": {"online": {"batches": {"1": {**plain, "MPS": interleaved_run()}, "8": dict(plain)}}}}
    for runs in results["scenarios"]["online"]["batches"].values():
        online_scoring.derive_batch(runs)
    made = online_report.plots(results, tmp_path)
    assert tmp_path / "online-b1-interleaved.png" in made and tmp_path / "online-b8-interleaved.png" not in made
    assert (tmp_path / "online-b1-interleaved.png").stat().st_size > 1000


def test_replot_derives_the_verdicts_again_from_the_raw_runs(tmp_path: Path) -> None:
    """A scoring change must reach committed results: --replot recomputes what the run stored as derived."""
    alone = {"tenants": [{"name": "online", "report": {"latency_ms": {"p50": 5.0, "p99": 5.5}}}]}
    solo = {"tenants": [{"name": "offline", "report": {"throughput": 200.0}}]}
    runs = {"alone-online": alone, "alone-offline": solo, "MPS": interleaved_run(), "derived": {"setups": {}}}
    (tmp_path / "results.json").write_text(json.dumps({"meta": {}, "scenarios": {"online": {"batches": {"1": runs}}}}))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "scenarios.py"), "--out", str(tmp_path), "--replot"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    derived = json.loads((tmp_path / "results.json").read_text())["scenarios"]["online"]["batches"]["1"]["derived"]
    assert derived["setups"]["MPS"]["p99_x_alone"] == pytest.approx(8.0 / 6.0)
    assert "| 1 | MPS (interleaved) |" in (tmp_path / "results.md").read_text()
