"""Compute beside graphics in the engine: overlapped where calibration measured it, sliced where it measured
contention or nothing, and mixed slices for a pair that overlaps partly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_engine import SLICE, Rig

from unisched.policy.overlap import SliceKind
from unisched.policy.tuning import TUNING
from unisched.scheduler.config import ConfigError, DaemonConfig
from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample


def _mixed_pair_freezes(tmp_path: Path, kept: tuple[float, float] | None) -> bool:
    if kept is not None:
        (tmp_path / "state").mkdir()
        (tmp_path / "state" / "contention.json").write_text(json.dumps(
            {"version": 1, "gpus": {"NVIDIA H200": {"compute_kept": kept[0], "graphics_kept": kept[1]}}}))
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    tel.next_samples = [GpuSample(0, 1.0, 0.0, 0.0, 0)]  # saturated: slicing is the question
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("cuda", 100, engines=("compute",))
    rig.add("render", 100, engines=("graphics",))
    rig.step(100)
    return any(frozen for _, frozen in rig.driver.freeze_log)


def test_compute_and_graphics_overlap_where_calibration_measured_it(tmp_path: Path) -> None:
    assert not _mixed_pair_freezes(tmp_path, (0.9, 0.97))


def test_compute_and_graphics_are_sliced_where_they_were_measured_to_contend(tmp_path: Path) -> None:
    assert _mixed_pair_freezes(tmp_path, (0.14, 0.87))


def test_compute_and_graphics_are_sliced_when_never_measured(tmp_path: Path) -> None:
    assert _mixed_pair_freezes(tmp_path, None)


def _partial_overlap_pair(tmp_path: Path, weights: tuple[int, int], util: float,
                          contention: str = "auto", kept: tuple[float, float] = (0.22, 0.92)) -> dict[str, float]:
    """A trainer beside a render on a GPU whose calibration measured partial overlap (the H200's ResNet-50 +
    render: 22% and 92% of their solo rates kept together). Returns the part of 400 slices each ran."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "contention.json").write_text(json.dumps(
        {"version": 1, "gpus": {"NVIDIA H200": {"compute_kept": kept[0], "graphics_kept": kept[1]}}}))
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    tel.next_samples = [GpuSample(0, util, 0.0, 0.0, 0)]
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000, contention=contention), telemetry=tel)
    rig.add("cuda", weights[0], engines=("compute",))
    rig.add("render", weights[1], engines=("graphics",))
    rig.step(40)
    mixed = rig.engine.mixed_slices(0)
    partial = contention == "partial-overlap" or (contention == "auto" and sum(kept) >= TUNING.mix_sum)
    if util >= 0.98 and partial:  # what `unisched status` shows for the GPU
        assert mixed is not None and (mixed[0].both > 0 or sum(kept) < 1) and mixed[1] in SliceKind
    else:
        assert mixed is None
    ran = {"cuda": 0.0, "render": 0.0, "both": 0.0}
    for _ in range(400):
        rig.step()
        ran["cuda"] += not rig.frozen("cuda")
        ran["render"] += not rig.frozen("render")
        ran["both"] += not rig.frozen("cuda") and not rig.frozen("render")
    return {k: v / 400 for k, v in ran.items()}


@pytest.mark.parametrize(("weights", "both"), [((100, 100), 0.64), ((300, 100), 0.32), ((100, 300), 0.96)])
def test_a_partly_overlapping_pair_runs_together_as_much_as_the_weights_allow(
        tmp_path: Path, weights: tuple[int, int], both: float) -> None:
    """Sliced against each other the pair does 1.0 solos of work; left alone, 1.14, with the trainer at 0.22
    whatever its weight. Mixed: together for `both` of the time, the trainer alone for the rest."""
    ran = _partial_overlap_pair(tmp_path, weights, util=1.0)
    assert ran["both"] == pytest.approx(both, abs=0.03)
    assert ran["render"] == pytest.approx(both, abs=0.03)  # the render never runs alone: its share needs no more
    share = weights[0] / sum(weights)
    assert 0.22 * ran["both"] + (ran["cuda"] - ran["both"]) >= share - 0.02  # the trainer's guarantee, by the rates


def test_a_partial_overlap_is_sliced_when_contention_is_named(tmp_path: Path) -> None:
    ran = _partial_overlap_pair(tmp_path, (100, 100), util=1.0, contention="shared-sm")
    assert ran["both"] < 0.05 and ran["cuda"] == pytest.approx(0.5, abs=0.05)


def test_partial_overlap_named_mixes_a_calibration_auto_would_slice(tmp_path: Path) -> None:
    """Kept 0.06 + 0.88 = 0.94, under Tuning.mix_sum: auto slices the pair as one domain (no mixed plan, checked by the
    helper); named, the operator's word stands and the pair gets the mixed plan. A sum under 1 gains nothing
    together, so the plan is each side alone for its share, in runs of a period."""
    ran = _partial_overlap_pair(tmp_path, (100, 100), util=1.0, contention="partial-overlap", kept=(0.06, 0.88))
    assert ran["both"] < 0.05 and ran["cuda"] == pytest.approx(0.5, abs=0.05)
    (tmp_path / "auto").mkdir()
    sliced = _partial_overlap_pair(tmp_path / "auto", (100, 100), util=1.0, kept=(0.06, 0.88))
    assert sliced["both"] < 0.05


def test_partial_overlap_without_a_calibration_stops_the_start(tmp_path: Path) -> None:
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    with pytest.raises(ConfigError, match="there is none for NVIDIA H200"):
        Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000, contention="partial-overlap"), telemetry=tel)


def test_a_partly_overlapping_pair_on_an_unsaturated_gpu_is_not_mixed(tmp_path: Path) -> None:
    ran = _partial_overlap_pair(tmp_path, (100, 100), util=0.4)
    assert ran["both"] == 1.0
