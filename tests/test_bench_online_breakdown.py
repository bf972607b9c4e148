"""bench/online_breakdown.py: an online request's latency split into its own service time and its wait behind the
request before it (the online example times requests from their arrival)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import online_breakdown as ob


def test_a_request_that_arrives_during_the_previous_answer_waits_for_it() -> None:
    # 5 ms answers: the second arrives 1 ms after the first, so it ends at 10 ms (latency 9 ms, service 5 ms)
    b = ob.breakdown([0.0, 0.001, 0.100], [5.0, 9.0, 5.0])
    assert b.queued == 1
    assert b.service_ms == pytest.approx((5.0, 5.0, 5.0))
    with pytest.raises(ValueError, match="2 arrivals but 1 latencies"):
        ob.breakdown([0.0, 0.1], [5.0])


def report(arrivals: list[float], latencies: list[float]) -> dict[str, object]:
    return {"tenants": [{"report": {"arrivals_s": arrivals, "latencies_ms": latencies}}]}


def test_the_table_pools_rounds_and_compares_each_setup_with_alone(tmp_path: Path) -> None:
    arrivals = [0.05 * i for i in range(200)]
    alone, slow = [5.0] * 200, [6.0] * 200
    results = {"scenarios": {"online": {"batches": {"1": {
        "alone-online": report(arrivals, alone), "MPS": report(arrivals, slow),
        "alone-offline": {"tenants": [{"report": {"throughput": 1.0}}]},  # no latencies: not an online run
        "more_rounds": [{"alone-online": report(arrivals, alone), "MPS": report(arrivals, slow)}]}}}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    runs = ob.pooled([path])
    assert sorted(runs) == ["MPS", "alone-online"] and len(runs["MPS"]) == 2
    assert "| MPS | 2 | 400 | 0.0% | 6.00 / 6.00 | 1.20x | 6.00 / 6.00 | 1.20x |" in ob.table(runs)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "online_breakdown.py"), str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "| alone-online | 2 | 400 |" in out.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "online_breakdown.py"), str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_interleaved_runs_of_several_files_pool_their_pairs_of_periods(tmp_path: Path) -> None:
    from interleave import RUNNING, Alternation

    plan = Alternation(0.0, 20.0, 1.0, 0.1)  # 10 pairs of periods a run
    arrivals = [0.05 * i + 0.025 for i in range(400)]
    lat = [8.0 if plan.phase(a) == RUNNING else 6.0 for a in arrivals]
    run = {"tenants": [{"name": "online", "report": {"arrivals_s": arrivals, "latencies_ms": lat}}],
           "alternation": plan.to_json()}
    paths = []
    for k in range(2):
        paths.append(tmp_path / f"r{k}.json")
        # each file's derivation scored its trainer against its own solo run (the first call's had none)
        derived = {"per_round": [{"setups": {"no scheduler": {"interleaved": {"p50_x": 1.33},
                                                              "offline_kept": [None, 0.9][k]}}}]}
        batches = {"8": {"alone-online": report(arrivals, [6.0] * 400), "no scheduler": run, "derived": derived}}
        paths[-1].write_text(json.dumps({"scenarios": {"online": {"batches": batches}}}))
    assert ob.interleaved_table(paths, batch=1) == ""  # another batch size: nothing read
    table = ob.interleaved_table(paths, batch=8)
    assert ("| no scheduler | 20 | 320 / 320 | 1.33 [1.33-1.33] | 1.33 [1.33-1.33] | 1.33 [1.33-1.33] | n/a, 0.90 |"
            in table)
