"""examples/workloads/_window.py: the measurement helpers the benchmark workloads share (pure)."""

from __future__ import annotations

import math
import random
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples" / "workloads"))
from _window import percentile, quantile_interval


def test_the_p99_interval_covers_the_true_p99_nine_times_in_ten() -> None:
    rng = random.Random(7)
    true_p99 = -math.log(0.01)  # of an exponential with mean 1
    hits = 0
    for _ in range(400):
        xs = [rng.expovariate(1.0) for _ in range(240)]  # 12 s of requests at 20 req/s
        lo, hi = quantile_interval(xs, 99)
        assert lo <= percentile(xs, 99) <= hi
        hits += lo <= true_p99 <= hi
    assert 0.85 <= hits / 400 <= 0.97


def test_more_requests_narrow_the_interval() -> None:
    rng = random.Random(3)
    widths = []
    for n in (240, 2400):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        lo, hi = quantile_interval(xs, 99)
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2


def test_few_values_clamp_to_what_was_seen() -> None:
    assert quantile_interval([5.0, 1.0, 3.0], 99) == (3.0, 5.0)
    assert quantile_interval([2.0], 50) == (2.0, 2.0)
    with pytest.raises(ValueError):
        quantile_interval([], 99)
