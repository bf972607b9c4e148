"""bench/charges.py: what the daemon charged each tenant of a pair over its window, by rule and source, beside its
measured rate (read by readers.read_gpu_pairs, shown in report.md), and the daemon logs a run keeps. The runs that
write them end to end: tests/test_bench_runner.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from benchrig import bench_module, provenance, readers, suites, summary

charges = bench_module("charges")
daemon_log = bench_module("daemon_log")
pairs_runs = bench_module("pairs_runs")


def _tenants_json(charged: dict[str, dict[str, float]], weights: dict[str, int]) -> list[dict[str, Any]]:
    """`unisched tenants --json` as the CLI prints it: `charged` per tenant as {"rule/source": seconds} on GPU 0's SMs."""
    return [{"name": name, "weight": weights[name], "gpu_seconds": sum(by.values()), "state": "running",
             "shares": [{"gpu": 0, "domain": "sm", "target_share": 0.5, "measured_share": 0.5,
                         "charges": [{"rule": k.split("/")[0], "source": k.split("/")[1], "seconds": s}
                                     for k, s in by.items()]}]}
            for name, by in charged.items()]


def _snapshot(at: float, charged: dict[str, dict[str, float]], weights: dict[str, int]) -> dict[str, Any]:
    """A charges snapshot as pairs_runs.run_group keeps it."""
    return charges.compact({"at": at, "answered": at + 0.4, "rc": 0, "stdout": "",
                            "parsed": _tenants_json(charged, weights)})


WEIGHTS = {"a-cuda": 3, "b-render": 1}


def _group(start: dict[str, Any] | None, end: dict[str, Any] | None) -> dict[str, Any]:
    """A pair's run under the daemon as results.json keeps it."""
    group: dict[str, Any] = {"label": "cuda+render 3:1", "setup": "unisched", "ok": True, "start_at": 100.0,
                             "tenants": [{"name": "a-cuda", "kind": "cuda", "weight": 3},
                                         {"name": "b-render", "kind": "render", "weight": 1}]}
    group["charges"] = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    return group


START = _snapshot(99.5, {"a-cuda": {"signal/alone": 1.0}, "b-render": {"signal/drain": 0.2}}, WEIGHTS)
END = _snapshot(119.5, {"a-cuda": {"signal/alone": 7.0, "signal/beside-drain": 6.0},
                        "b-render": {"signal/drain": 0.7, "signal/alone": 4.0}}, WEIGHTS)
DERIVED = {"pair": "cuda+render 3:1", "weights": [3, 1], "unisched": {"normalized": [0.70, 0.30]}}


def test_a_tenants_charges_over_the_window_are_the_end_snapshots_less_the_starts() -> None:
    assert START["tenants"]["a-cuda"] == {"weight": 3, "gpu_seconds": 1.0, "charges": {"gpu0/sm signal/alone": 1.0}}
    window, seconds, why = charges.over_window(START, END)
    assert why is None and seconds == {"a-cuda": pytest.approx(20.0), "b-render": pytest.approx(20.0)}
    assert window == {"a-cuda": {"gpu0/sm signal/alone": 6.0, "gpu0/sm signal/beside-drain": 6.0},
                      "b-render": {"gpu0/sm signal/drain": 0.5, "gpu0/sm signal/alone": 4.0}}


def test_each_tenants_charged_part_is_set_beside_its_weight_share_and_measured_part() -> None:
    rows, why = charges.pair_rows(_group(START, END), DERIVED)
    assert why is None
    a, b = rows
    assert (a["tenant"], a["weight_share"], a["normalized"]) == ("a-cuda", 0.75, 0.70)
    assert a["part"] == pytest.approx(0.70) and a["charged_s"] == pytest.approx(12.0)
    assert a["charged_part"] == pytest.approx(12.0 / 16.5, abs=1e-4) and b["charged_part"] == pytest.approx(4.5 / 16.5, abs=1e-4)
    assert b["by"] == {"gpu0/sm signal/alone": 4.0, "gpu0/sm signal/drain": 0.5} and b["window_s"] == pytest.approx(20.0)


@pytest.mark.parametrize(("start", "end", "why"), [
    (None, END, "no charges: the snapshot at the window's start (rc None) failed"),
    (START, {"asked": 1.0, "answered": None, "rc": None, "error": "timed out after 10 s"},
     "no charges: the snapshot at the window's end (timed out after 10 s) failed"),
    (START, _snapshot(119.5, {"a-cuda": {"signal/alone": 7.0}}, WEIGHTS),
     "no charges: b-render gone before the snapshot at the window's end, and not in the log"),
])
def test_a_pair_without_both_snapshots_has_no_charges_and_says_why(
        start: dict[str, Any] | None, end: dict[str, Any], why: str) -> None:
    assert charges.pair_rows(_group(start, end), DERIVED) == ([], why)


def test_a_tenant_removed_before_the_end_snapshot_is_charged_to_its_removal_as_the_daemons_log_says(
        tmp_path: Path) -> None:
    """The end snapshot came after b-render's workload ended and the daemon removed it: its charges then are the
    `tenant removed` line's, and its row says it runs to the removal."""
    log = tmp_path / "daemon.log"
    log.write_text("\n".join(json.dumps(e) for e in [
        {"event": "tenant added", "tenant": "b-render", "timestamp": "2026-01-01T10:00:00Z"},
        {"event": "tenant removed", "tenant": "b-render", "reason": "its last process exited",
         "charged": {"gpu0/sm": {"signal/alone": 4.0, "signal/drain": 0.7}}, "timestamp": "2026-01-01T10:00:20Z"},
        {"event": "stopped", "timestamp": "2026-01-01T10:00:21Z"}]) + "\n")
    removed = daemon_log.removed_charges(log)
    at = removed["b-render"][0]
    assert removed == {"b-render": (at, {"gpu0/sm signal/alone": 4.0, "gpu0/sm signal/drain": 0.7})}
    end = _snapshot(119.5, {"a-cuda": {"signal/alone": 7.0, "signal/beside-drain": 6.0}}, WEIGHTS)
    rows, why = charges.pair_rows(_group(START, end), DERIVED, removed)
    assert why is None and [r["to"] for r in rows] == ["end", "removal"]
    assert rows[1]["by"] == {"gpu0/sm signal/alone": 4.0, "gpu0/sm signal/drain": 0.5}
    assert rows[1]["window_s"] == pytest.approx(at - 99.9) and rows[0]["window_s"] == pytest.approx(20.0)
    assert daemon_log.removed_charges(tmp_path / "none.log") == {}


def _results(folder: Path, group: dict[str, Any]) -> Path:
    """A round's raw folder whose gpu_pairs results.json holds one pair under the daemon."""
    step = folder / "overlap"
    step.mkdir(parents=True)
    pair = {**DERIVED, "solo": [600.0, 700.0], "contending": False,
            "no_scheduler": {"normalized": [0.4, 0.9], "efficiency": 1.3},
            "unisched": {"normalized": [0.70, 0.30], "error_pts": 5.0, "efficiency": 1.0, "guarantee": True}}
    (step / "results.json").write_text(json.dumps({"pairs": [pair], "unisched": {pair["pair"]: group}}))
    return folder


def test_the_overlap_report_shows_each_tenants_charges_by_rule_next_to_its_measured_share(tmp_path: Path) -> None:
    cases, notes = readers.read_gpu_pairs(_results(tmp_path / "round-1", _group(START, END)))
    m = cases["cuda+render 3:1"]
    assert notes == [] and m["charged_part_a"] + m["charged_part_b"] == pytest.approx(1.0)
    assert [row["tenant"] for row in m["charges"]] == ["a-cuda", "b-render"]
    meta = {"command": "c", "machine": provenance.machine(), "commit": "c" * 40, "dirty": False, "standin": True,
            "date_utc": "2026-01-01 10:00:00"}
    s = summary.build(suites.BY_NAME["overlap"], [{"round": 1, "date_utc": "d", "steps": [], "notes": notes,
                                                    "cases": cases}], meta)
    report = summary.report_md(s)
    assert "## What the daemon charged, by rule and source" in report
    assert ("| 1 | cuda+render 3:1 | a-cuda | 0.75 | 0.7 | 0.7 | 0.7273 | 12 | gpu0/sm signal/alone 6, "
            "gpu0/sm signal/beside-drain 6 | 20 |") in report
    assert "charges [" not in report and "charged_part_a 0.7273" in report  # the rows in their table, not as a metric
    assert "charges" not in s["stats"]["cuda+render 3:1"] and "charged_part_b" in s["stats"]["cuda+render 3:1"]


def test_a_round_without_snapshots_reads_as_before_and_one_whose_snapshot_failed_says_so(tmp_path: Path) -> None:
    cases, notes = readers.read_gpu_pairs(_results(tmp_path / "old", {**_group(None, None), "charges": {}}))
    assert "charges" not in cases["cuda+render 3:1"] and notes == []
    cases, notes = readers.read_gpu_pairs(_results(tmp_path / "failed", _group(START, None)))
    assert "charged_part_a" not in cases["cuda+render 3:1"]
    assert notes == ["cuda+render 3:1: no charges: the snapshot at the window's end (rc None) failed"]
    # ... unless the daemon's log kept with the run says what it charged the tenants it removed
    logs = tmp_path / "failed" / "overlap" / charges.DAEMON_LOGS
    logs.mkdir()
    (logs / charges.log_name("cuda+render 3:1")).write_text("\n".join(json.dumps(
        {"event": "tenant removed", "tenant": name, "charged": {"gpu0/sm": {"signal/alone": s}},
         "timestamp": "2026-01-01T10:00:20Z"}) for name, s in (("a-cuda", 13.0), ("b-render", 4.2))) + "\n")
    cases, notes = readers.read_gpu_pairs(tmp_path / "failed")
    assert notes == [] and cases["cuda+render 3:1"]["charged_part_a"] == pytest.approx(12 / 16.2, abs=1e-4)


def test_a_long_daemon_log_is_kept_as_its_start_and_end(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    lines = [json.dumps({"event": "line", "n": n}) for n in range(1000)]
    log.write_text("\n".join(lines) + "\n")
    assert charges.keep_log(log, tmp_path / "short" / "whole.log")  # within the limit: as it is
    assert (tmp_path / "short" / "whole.log").read_text() == log.read_text()
    kept = tmp_path / "kept.log"
    assert charges.keep_log(log, kept, head=300, tail=600)
    got = kept.read_text().splitlines()
    assert got[0] == lines[0] and got[-1] == lines[-1] and len(kept.read_bytes()) < 1000
    (cut,) = [line for line in got if "left out" in line]
    assert all(json.loads(line) for line in got if line != cut)  # whole lines only
    assert not charges.keep_log(tmp_path / "none.log", tmp_path / "none-kept.log")
    assert charges.log_name("cuda+render 1:3") == "cuda+render_1-3.log"


def test_every_snapshot_is_taken_at_its_time_on_its_own_even_once_the_tenants_have_ended() -> None:
    """A window's snapshots start when due, each on its own: one the daemon is slow to answer (here: one that waits
    for the next) holds up neither the next one nor the run. One due after every tenant ended (its run cut short) is
    still taken, so a run always says what it could."""
    taken: dict[str, bool] = {}
    later = threading.Event()
    now = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", "pass"])]
    actions = [(now + 3600, lambda: (taken.update(end=True), later.set())),
               (now - 1, lambda: taken.update(start=later.wait(timeout=30)))]
    assert pairs_runs.wait_all(procs, now + 60, actions)
    assert taken == {"start": True, "end": True}
