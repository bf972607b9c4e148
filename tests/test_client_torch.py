"""The PyTorch helper's pause points on a real model and real autograd (CPU: torch.cuda's events are replaced by
stand-ins that time nothing, the one part that needs a GPU; tests/test_examples_gpu.py runs it on the H200)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed (pip install torch==2.13.0: a CPU build)")

from test_client_gate import contended_grant, grant, offline_client, reports  # noqa: E402


class StandInEvent:
    """What TorchStep asks of torch.cuda.Event: each part is 1 ms of GPU time, and already done."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        assert self.recorded

    def elapsed_time(self, end: StandInEvent) -> float:
        return 1.0


def model() -> Any:
    """Conv -> BN -> ReLU(inplace) blocks, as ResNet-50 has them: BN outputs are changed in place."""
    nn = torch.nn
    blocks = [nn.Sequential(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
              for i in range(4)]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def train_step(net: Any) -> None:
    x = torch.randn(2, 3, 8, 8)
    loss = net(x).sum()
    loss.backward()


@pytest.mark.parametrize(("contended", "splits"), [(False, 0), (True, 4)])
def test_a_step_pauses_at_every_other_weight_layer_forward_and_backward(
        monkeypatch: pytest.MonkeyPatch, contended: bool, splits: int) -> None:
    """5 weight layers (4 convolutions, 1 linear), every 2nd: 2 points forward and 2 backward, only while contended."""
    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    client, out = offline_client(monkeypatch)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    if contended:  # a long slice: the parts may start (past its end they would wait for the daemon's renewal)
        contended_grant(client, 1, slice_left_s=60.0)
    else:
        grant(client, 1)
    step = client.step()
    net = model()
    remove = step.pause_points(net, every=2)
    with step:
        train_step(net)
    step.drain()
    assert step.flight.splits == splits
    remove()
    with step:
        train_step(net)
    step.drain()
    assert step.flight.splits == splits  # the points are gone
    gate.release()
    # two steps, the first in splits + 1 timed parts of 1 ms: charged in full, counted as two units
    assert [(r.units, round(r.gpu_seconds, 6)) for r in reports(out)] == [(2, 0.001 * (splits + 2))]


def test_points_outside_a_step_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    client, _ = offline_client(monkeypatch)
    gate = client.gate("compute")
    gate.acquire(timeout=0)
    contended_grant(client, 1)
    step = client.step()
    net = model()
    step.pause_points(net, every=1)
    train_step(net)  # e.g. an evaluation pass the app did not gate
    assert step.flight.splits == 0
    with pytest.raises(ValueError, match="every"):
        step.pause_points(net, every=0)
