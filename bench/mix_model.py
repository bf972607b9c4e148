#!/usr/bin/env python3
"""Mixed slices in a model with a render's frame tail: what the period of the runs costs each side.

Why: on the H200 the first run of mixed slices (50 ms slices alternating together / compute alone) gave the render
~9 points more than planned at 1:1 and the trainer less; the explanation was the frame a paused render finishes
beside the compute after each switch (bench/results/2026-12-01-h200-e/README.md). GPU runs could not settle how
much runs at a stretch win back, because the trainer's solo reference moved by up to 60% between runs there. This
model drives the daemon's own turn-taker (unisched.policy.overlap: overlap_mix, MixTurns) over simulated time:

- the trainer always has work; it runs whenever it is not paused (its queued work after a pause is ignored:
  the plans at these weights never pause it);
- the render works in frames of --frame-ms of GPU time alone (+-30%, seeded) and starts a frame only while thawed; a paused
  render finishes the frame in flight (the tail), starting no other;
- while both run, the trainer progresses at --kept-c and the render at --kept-g of their solo rates (the
  calibration's kept rates); alone, at 1.

It prints, per weights and period, what the plan promises (OverlapMix.kept) and what the model delivers, as
normalized throughput (progress / time). Deterministic: no clock; the frames' jitter is seeded.

  python3 bench/mix_model.py                       # the H200 pair's rates, periods 50, 250, 500, 1000, 2000 ms
  python3 bench/mix_model.py --kept-c 0.2 --kept-g 0.93 --frame-ms 28 --weights 1:1,3:1 --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from unisched.policy.overlap import MixTurns, SliceKind, overlap_mix

STEP_S = 0.0005
"""The model's time step (0.5 ms: a 28 ms frame is 56 steps)."""


@dataclass(frozen=True)
class ModelResult:
    weights: str
    period_ms: float
    plan_compute: float
    plan_graphics: float
    compute: float
    graphics: float
    switches_per_s: float

    @property
    def compute_short(self) -> float:
        return self.plan_compute - self.compute


def run_model(kept_c: float, kept_g: float, share_c: float, period_s: float, frame_s: float,
              slice_s: float = 0.05, seconds: float = 60.0, jitter: float = 0.3, seed: int = 1) -> tuple[float, float, float]:
    """(compute, graphics) normalized throughput and switches per second over `seconds` of mixed slices.

    Frames vary by +-`jitter` of `frame_s` (seeded): with every frame alike, where a run ends in a frame would
    repeat run after run and decide the tail alone."""
    rng = random.Random(seed)

    def frame() -> float:
        return frame_s * (1.0 + jitter * (2.0 * rng.random() - 1.0))

    mix = overlap_mix(kept_c, kept_g, share_c)
    turns = MixTurns(period_s=period_s)
    compute = graphics = 0.0
    frame_left = 0.0  # GPU time (alone) the render's frame in flight still needs; 0: none in flight
    switches, last = 0, None
    steps_per_slice = max(1, round(slice_s / STEP_S))
    for _ in range(round(seconds / slice_s)):
        kind = turns.choose(mix)
        switches += last is not None and kind is not last
        last = kind
        compute_on = kind is not SliceKind.GRAPHICS
        render_on = kind is not SliceKind.COMPUTE
        for _ in range(steps_per_slice):
            if frame_left <= 0.0:
                frame_left = frame() if render_on else 0.0
            rendering = frame_left > 0.0
            if compute_on:
                compute += STEP_S * (kept_c if rendering else 1.0)
            if rendering:
                done = STEP_S * (kept_g if compute_on else 1.0)
                if render_on:  # frames follow each other within the step
                    graphics += done
                    frame_left -= done
                    while frame_left <= 0.0:
                        frame_left += frame()
                else:  # paused: the frame in flight ends, and nothing follows it
                    graphics += min(done, frame_left)
                    frame_left -= done
        turns.ran(kind, slice_s)
    return compute / seconds, graphics / seconds, switches / seconds


def table(kept_c: float, kept_g: float, frame_s: float, weights: list[tuple[int, int]], periods_ms: list[float],
          seconds: float) -> list[ModelResult]:
    out = []
    for wc, wg in weights:
        share = wc / (wc + wg)
        plan_c, plan_g = overlap_mix(kept_c, kept_g, share).kept(kept_c, kept_g)
        for period in periods_ms:
            c, g, sw = run_model(kept_c, kept_g, share, period / 1000.0, frame_s, seconds=seconds)
            out.append(ModelResult(f"{wc}:{wg}", period, plan_c, plan_g, c, g, sw))
    return out


def markdown(rows: list[ModelResult], args: argparse.Namespace, command: str) -> str:
    lines = [f"`{command}` ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; a model, no GPU)", "",
             f"Kept together: compute {args.kept_c:g}, graphics {args.kept_g:g}; render frame {args.frame_ms:g} ms; "
             f"50 ms slices; {args.seconds:g} s per row. Guarantee: compute >= its weight share - 0.02.", "",
             "| weights | period ms | plan compute / graphics | model compute / graphics | compute short (pts) | "
             "switches / s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.weights} | {r.period_ms:g} | {r.plan_compute:.3f} / {r.plan_graphics:.3f} | "
                     f"{r.compute:.3f} / {r.graphics:.3f} | {100 * r.compute_short:.1f} | {r.switches_per_s:.1f} |")
    return "\n".join(lines) + "\n"


def parse_weights(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition(":")
        if not (a.isdigit() and b.isdigit()) or int(a) < 1 or int(b) < 1:
            raise argparse.ArgumentTypeError(f"weights must look like 1:1,3:1, got {part!r}")
        out.append((int(a), int(b)))
    return out


def parse_periods(text: str) -> list[float]:
    try:
        periods = [float(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"periods must be numbers in ms, got {text!r}") from None
    if any(p <= 0 for p in periods):
        raise argparse.ArgumentTypeError("periods must be positive")
    return periods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kept-c", type=float, default=0.2, help="compute's kept rate beside the render (default 0.2)")
    ap.add_argument("--kept-g", type=float, default=0.92, help="graphics' kept rate beside compute (default 0.92)")
    ap.add_argument("--frame-ms", type=float, default=28.0,
                    help="the render's GPU time per frame alone (default 28: 36 frame/s on the H200)")
    ap.add_argument("--weights", type=parse_weights, default=parse_weights("1:1,3:1,1:3"),
                    help="compute:graphics weights, comma-separated (default 1:1,3:1,1:3)")
    ap.add_argument("--periods", type=parse_periods, default=parse_periods("50,250,500,1000,2000"),
                    help="--mix-period-ms values to compare (default 50,250,500,1000,2000; 50 = single slices)")
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated time per row (default 60)")
    ap.add_argument("--out", type=Path, default=None, help="also write results.md and results.json here")
    args = ap.parse_args(argv)
    if not (0.0 <= args.kept_c <= 1.0 and 0.0 <= args.kept_g <= 1.0):
        ap.error("--kept-c and --kept-g must be within 0..1")
    if args.frame_ms <= 0 or args.seconds <= 0:
        ap.error("--frame-ms and --seconds must be positive")
    rows = table(args.kept_c, args.kept_g, args.frame_ms / 1000.0, args.weights, args.periods, args.seconds)
    command = "python3 bench/mix_model.py" + ("" if argv is None and len(sys.argv) < 2 else
                                               " " + " ".join(sys.argv[1:] if argv is None else argv))
    text = markdown(rows, args, command)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps(
            {"command": command, "args": {k: v for k, v in vars(args).items() if k != "out"},
             "rows": [asdict(r) for r in rows]}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
