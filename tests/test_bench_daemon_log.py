"""bench/daemon_log.py: how long the daemon's saturation gate kept the GPU sliced over a window, read from its log,
and the cloud-gaming reader that reports it per size."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from benchrig import bench_module, readers

daemon_log = bench_module("daemon_log")
T0 = 1_800_000_000.0


def line(t: float, event: str, **fields: object) -> str:
    stamp = datetime.fromtimestamp(T0 + t, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": event, "level": "info", "timestamp": stamp, **fields})


def write_log(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


UNUSED = "turns left unused (paced tenants): every tenant runs for 2.0 s"


def test_sliced_time_is_clipped_to_the_window_and_unused_openings_counted(tmp_path: Path) -> None:
    log = write_log(tmp_path / "d.log",
                    line(-5, "serving"),
                    line(-3, "slicing", gpu=0, domain="sm", reason="saturated"),
                    line(1, "lending", gpu=0, domain="sm", util=0.07, reason=UNUSED),  # 1 s of it in the window
                    "not json: a traceback line",
                    line(4, "slicing", gpu=0, domain="sm", reason="saturated"),
                    line(6.5, "lending", gpu=0, domain="sm", reason="unsaturated: every tenant runs"),
                    line(8, "slicing", gpu=0, domain="sm", reason="saturated"),
                    line(12, "lending", gpu=0, domain="sm", util=0.5, reason=UNUSED))  # after the window: not counted
    gate = daemon_log.gate_over(log, T0, T0 + 10)
    assert gate == daemon_log.Gate(sliced_s=1.0 + 2.5 + 2.0, unused_openings=1, opening_util=0.07)


def test_a_daemon_that_stops_sliced_counts_to_its_stop_and_overlapping_resources_once(tmp_path: Path) -> None:
    log = write_log(tmp_path / "d.log",
                    line(2, "slicing", gpu=0, domain="sm"), line(3, "slicing", gpu=0, domain="graphics"),
                    line(5, "lending", gpu=0, domain="graphics", reason="unsaturated: every tenant runs"),
                    line(7, "all managed cgroups thawed"))
    assert daemon_log.gate_over(log, T0, T0 + 10) == daemon_log.Gate(sliced_s=5.0, unused_openings=0)
    killed = write_log(tmp_path / "k.log", line(6, "slicing", gpu=0, domain="sm"))  # no word after: to the end
    assert daemon_log.gate_over(killed, T0, T0 + 10) == daemon_log.Gate(sliced_s=4.0, unused_openings=0)
    assert daemon_log.gate_over(tmp_path / "missing.log", T0, T0 + 10) is None


def test_the_cloud_reader_reports_the_share_of_the_window_the_daemon_sliced(tmp_path: Path) -> None:
    for name in ("no-scheduler-24", "unisched-24"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({
            "fps_target": 60, "fps_mean_all": 30.0, "start_at": T0, "seconds": 20,
            "per_instance": [{"weight": 100, "fps_mean": 30.0, "fps_1pct_low": 25.0}]}))
    write_log(tmp_path / "unisched-24-daemon.log", line(1, "slicing", gpu=0, domain="sm"),
              line(1.5, "lending", gpu=0, domain="sm", reason=UNUSED),
              line(30, daemon_log.CHARGED, charged={"gpu0/sm": {"process-rate": 9.0, "signal": 2.0},
                                                    "gpu0/nvenc": {"cpu-time": 1.0}}))
    case = readers.read_cloud(tmp_path)[0]["N=24"]
    assert (case["sliced_of_window"], case["unused_openings"], case["util_at_unused_openings"]) == (0.025, 1, None)
    assert case["process_rate_of_charged"] == 0.75  # of all the busy time charged over the run, every resource
    (tmp_path / "unisched-24-daemon.log").unlink()
    gone = readers.read_cloud(tmp_path)[0]["N=24"]
    assert "sliced_of_window" not in gone and "process_rate_of_charged" not in gone  # no log: not measured, not zero


def test_the_daemon_logs_how_it_split_the_busy_time_as_it_stops(tmp_path: Path) -> None:
    """The line charged_by_rule reads, from a real daemon's shutdown: its rules are the engine's (policy.plan.Rule)."""
    from structlog.testing import capture_logs
    from test_engine import Rig

    from unisched.policy.plan import Rule
    from unisched.scheduler.config import DaemonConfig
    from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample

    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=50), telemetry=tel)
    rig.add("a", 100, engines=("graphics",))
    rig.rate["a"] = 0.5
    tel.next_samples = [GpuSample(0, 0.9, 0.0, 0.0, 0)]
    rig.step(10)
    with capture_logs() as logs:
        rig.engine.shutdown()
    line_ = next(e for e in logs if e["event"] == daemon_log.CHARGED)
    assert set(line_["charged"]["gpu0/sm"]) <= {r.value for r in Rule} and line_["charged"]["gpu0/sm"]["signal"] > 0
    log = write_log(tmp_path / "d.log", json.dumps({"event": daemon_log.CHARGED, "charged": line_["charged"]}))
    assert daemon_log.charged_by_rule(log) == {"signal": line_["charged"]["gpu0/sm"]["signal"]}
