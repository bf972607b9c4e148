"""bench/mix_model.py: the daemon's turn-taker over a modelled render frame tail (pure, deterministic)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import mix_model

H200 = (0.2, 0.92)
FRAME_S = 0.028


@pytest.mark.parametrize("share", [0.5, 0.75])
def test_single_slices_lose_the_trainer_its_share_and_runs_of_a_period_keep_it(share: float) -> None:
    """What the H200 showed (50 ms alternation at 1:1: trainer 0.44, render 0.70 against a plan of 0.50 / 0.61),
    and the fix: runs of a 1 s period keep the trainer within the guarantee's 2 points."""
    single, _, fast = mix_model.run_model(*H200, share, period_s=0.05, frame_s=FRAME_S, seconds=20)
    runs, _, slow = mix_model.run_model(*H200, share, period_s=1.0, frame_s=FRAME_S, seconds=20)
    assert share - single > 0.05  # the frame finished after each of many switches
    assert share - runs < 0.02
    assert slow < fast / 4


def test_no_tail_no_loss() -> None:
    """With frames far shorter than a slice the tail vanishes, and the model gives what the plan promises."""
    c, g, _ = mix_model.run_model(*H200, 0.5, period_s=1.0, frame_s=0.001, seconds=20)
    plan_c, plan_g = mix_model.overlap_mix(*H200, 0.5).kept(*H200)
    assert c == pytest.approx(plan_c, abs=0.01) and g == pytest.approx(plan_g, abs=0.01)


def test_cli_writes_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mix_model.main(["--weights", "1:1", "--periods", "50,1000", "--seconds", "5", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.md").read_text()
    assert text == capsys.readouterr().out and text.count("| 1:1 |") == 2


@pytest.mark.parametrize("bad", [["--weights", "1:0"], ["--periods", "0"], ["--kept-c", "1.5"], ["--frame-ms", "-1"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        mix_model.main(bad)
    assert e.value.code == 2
