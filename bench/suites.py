"""The benchmark suites of bench/run.py: per suite, the command(s) of one round, the reader that turns their output
into that round's cases and metrics (bench/readers.py), and the targets (bench/README.md's table). Declarations
only: each script keeps its own logic.

A command's words may hold {py} (this Python), {out} (the step's raw folder, fresh per round) and {socket} (the
socket of a fresh `unisched serve` started for that step alone, when the step names serve arguments).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mixed_pairs
from readers import (
    Reader,
    read_ad_sim,
    read_cloud,
    read_gpu_pairs,
    read_hooks,
    read_leases,
    read_memory,
    read_mixed_engines,
    read_online,
)
from scoring import (
    GUARANTEE_SLACK,
    MAX_ERROR_POINTS,
    MAX_MEDIAN_ERROR_POINTS,
    MIN_CONTENDING_EFFICIENCY,
    OVERLAP_EFFICIENCY_TOLERANCE,
)
from verdicts import Metrics, Target

STANDIN = "{py} bench/cpu_standin.py --pin-cpu 0 --kind"
"""The CPU stand-in workload: pinned to CPU 0, which the daemon's --cpu-stand-in reads as GPU 0's busy time."""
STANDIN_SERVE = ("--serve-arg=--cpu-stand-in", "--serve-arg=--saturated-util", "--serve-arg=0")
"""A stand-in daemon slices always: the host's own processes keep CPU 0 from ever reading saturated."""
TRAIN = "{py} examples/02_pytorch_training.py --model resnet50"
RENDER = "{py} examples/03_egl_render.py"
TRAIN_WARMUP_S = "25"
"""The overlap runs' warm-up without the daemon: the ResNet-50 trainer's start-up (torch import, cuDNN's search)
takes 11-21 s on an H200 VM; with gpu_pairs' default 5 s the alone and no-scheduler windows open late and score a
few seconds of a trainer still warming up."""
RENDER_ITERATIONS = "447"  # about 36 FPS alone on the H200, as gpu_pairs' calibration found: the overlap pairs' render
CLOUD_SIZES = (12, 24, 36, 48)
"""Instances per cloud-gaming run, in weight groups 1:2:4 (multiples of 3): at CLOUD_PLAYER's frame 12 players at 60
FPS about fill the H200 with no scheduler, so the sweep starts there and goes to four times as many."""
CLOUD_WEIGHTS = "1,2,4"
CLOUD_WARMUP_S = "20"
"""The cloud runs' warm-up: every player of a run starts inside it (Python, PyAV, an EGL context and, under the
daemon, `unisched run` and the session hooks), up to 48 of them on the host's cores at once; the example's own
5 s is for a few players, and a player ready over 0.5 s into the window counts as an error."""
CLOUD_PLAYER = "--width 640 --height 360 --iterations 140"
"""The players' frame: a 640x360 shader scene of 140 rounds a pixel, about 1.35 ms of the H200's GPU a frame
(12 players at 60 FPS fill it, 24 share it at half the pace). The H200 has no NVENC, so each player encodes on the
host's CPU (libx264); at 1280x720 that encode, not the GPU, set the pace once the sweep passed 24 players. At
640x360 it costs a quarter as much, and the GPU saturates first."""


@dataclass(frozen=True)
class Step:
    """One command of a round; `serve` (arguments of `unisched serve`) starts a fresh daemon for it."""

    name: str
    argv: tuple[str, ...]
    serve: tuple[str, ...] | None = None
    timeout_s: float = 600.0


@dataclass(frozen=True)
class Suite:
    name: str
    measures: str
    round_minutes: float  # one round on the H200, about (mixed: estimated from its runs' warm-up and window)
    needs_gpu: bool
    steps: tuple[Step, ...]
    read: Reader
    targets: tuple[Target, ...] = ()
    standin: tuple[Step, ...] | None = None  # the same round with CPU stand-ins, where the scripts have them
    rounds: int = 3  # the least: 3 rounds, 5 for overhead and online
    expected: tuple[str, ...] = ()  # the cases a full run (not stand-ins, not a subset) must produce: verdicts.unmeasured


def words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# ------------------------------------------------------------------------------------------------ targets

GUARANTEE = Target("guarantee", "guarantee", "every", ">=", 1.0,
                   f"each side >= its weight share - {GUARANTEE_SLACK:g} in every round")
PAIR_TARGETS = (
    Target("error, median round", "error_pts", "median", "<=", MAX_MEDIAN_ERROR_POINTS,
           f"error <= {MAX_MEDIAN_ERROR_POINTS:g} point in the median round", " pts"),
    Target("error, worst round", "error_pts", "worst", "<=", MAX_ERROR_POINTS,
           f"error <= {MAX_ERROR_POINTS:g} points in the worst round", " pts"),
    Target("sum", "sum", "worst", ">=", MIN_CONTENDING_EFFICIENCY,
           f"sum of normalized rates >= {MIN_CONTENDING_EFFICIENCY:g} in every round"),
    GUARANTEE,
)
OVERLAP_TARGETS = (
    GUARANTEE,
    Target("sum vs no scheduler", "sum_vs_no_scheduler", "worst", ">=", -OVERLAP_EFFICIENCY_TOLERANCE,
           f"sum >= the same round's no-scheduler sum - {OVERLAP_EFFICIENCY_TOLERANCE:g}"),
)


def _contended(m: Metrics) -> bool:
    return m.get("contending") is not False


def _overlapped(m: Metrics) -> bool:
    return m.get("contending") is False


PAIR_TARGETS_BY_CONTENTION = (
    *(replace(t, applies=_contended) for t in PAIR_TARGETS if t.metric != "guarantee"),
    *(t for t in PAIR_TARGETS if t.metric == "guarantee"),
    *(replace(t, applies=_overlapped) for t in OVERLAP_TARGETS if t.metric != "guarantee"),
)
"""The pairs suite's: in a round where a pair's no-scheduler run did not contend (its normalized rates summed 1.1 or
more, scoring.contends) it is an overlapping pair, and the issue's overlap targets judge that round: the guarantee,
and its sum against no scheduler's; the contending targets judge its rounds that contended (verdicts.round_values).
Two decode loops run side by side on the H200's seven NVDEC engines."""
OVERHEAD_TARGETS = (
    Target("loss", "loss", "median", "<=", 0.01, "throughput lost under the daemon <= 1% (median round)", "%", 100.0),
    Target("loss interval", "loss", "inside", "<=", 0.02, "the loss's 90% interval inside +-2%", "%", 100.0),
)
ONLINE_TARGETS = (
    Target("p99", "p99_x_alone", "worst", "<=", 1.05, "online p99 <= 1.05x alone", "x"),
    Target("p99 interval", "p99_x_alone", "interval", "<=", 1.10,
           "top of the p99 ratio's 90% interval over the rounds <= 1.10", "x"),
    Target("trainer kept", "trainer_kept", "worst", ">=", 0.85, "the trainer keeps >= 0.85 of its rate alone"),
)
"""The interval is the p99 ratio's over the rounds, as the overhead's loss interval is: the spread between runs is
what one run's point estimate hides. One run's own interval of a p99 (about 280 requests in a 15 s window) reaches
its slowest request or the one before, so it cannot be held to 1.10 by any scheduler; reports still show it per
round as p99_x_top."""


def _gpu_saturated(m: Metrics) -> bool:
    """A cloud size the targets judge: no scheduler saturated, and not on the host's CPU (readers.CLOUD_HOST_BOUND)."""
    return m.get("saturated") is True and m.get("host_bound") is not True


CLOUD_TARGETS = (
    Target("FPS by weight", "weight_error", "worst", "<=", 0.05, "per-instance FPS proportional to weight within 5%",
           "%", 100.0, applies=_gpu_saturated),
    Target("1% lows", "lows_vs_no_scheduler", "worst", ">=", 0.0, "1% lows (over mean FPS) no worse than no scheduler",
           applies=_gpu_saturated),
)
HOOK_TARGETS = (Target("start-up", "added_ms_hi90", "worst", "<", 10.0, "the hooks add < 10 ms to a context's "
                       "start-up, by the top of its 90% interval (over a round's pairs), in every round", " ms"),)
LEASE_TARGETS = (Target("round trip p99", "p99_ms", "worst", "<=", 0.5, "lease renewal round trip p99 <= 0.5 ms", " ms",
                        applies=lambda m: m.get("tenants") == 1),)
MEMORY_TARGETS = (Target("tests", "tests_pass", "every", ">=", 1.0, "tests/test_gpu_memory.py passes on the GPU"),)


# ------------------------------------------------------------------------------------------------ suites

PAIRS = "cuda1:1,cuda3:1,cuda1:3,render1:1,render3:1,render1:3,nvdec1:1,nvdec3:1,nvdec1:3"
PAIR_CASES = tuple(f"{kind}+{kind} {w}" for kind in ("cuda", "render", "nvdec") for w in ("1:1", "3:1", "1:3"))
"""The cases of PAIRS, as readers.read_gpu_pairs names them (pairs_plan.Pair.key)."""
OVERLAP_CASES = ("cuda+render 1:1", "cuda+render 3:1", "cuda+render 1:3")
OVERHEAD_CASES = ("cuda alone", "render alone")
MIXED_CASES = tuple(f"{a.spec}+{b.spec} {w[0]}:{w[1]}" for a, b, w in mixed_pairs.plan(
    mixed_pairs.parse_pairs(mixed_pairs.DEFAULT_PAIRS), mixed_pairs.parse_weights(mixed_pairs.DEFAULT_WEIGHTS)))
"""mixed_engines.py's default plan, named as its results.json keys its runs (A+A at 1:3 is its 3:1, not run)."""
ONLINE_CASES = tuple(f"b{batch} unisched {setup}" for batch in (1, 8) for setup in ("kernel", "user"))
CLOUD_CASES = tuple(f"N={n}" for n in CLOUD_SIZES)
"""Every size the sweep runs, whether or not a round saturates it (whether the targets judge it is each round's)."""


def cloud_steps(sizes: tuple[int, ...] = CLOUD_SIZES, more: str = CLOUD_PLAYER, serve: tuple[str, ...] = ()) -> tuple[Step, ...]:
    """Per size, the players with no scheduler, then under a fresh daemon (its `serve` arguments)."""
    steps: list[Step] = []
    for n in sizes:
        common = f"{{py}} examples/cloud_gaming.py --instances {n} --weights {CLOUD_WEIGHTS} --warmup {CLOUD_WARMUP_S} " \
                 f"--out {{out}}/players --report {{out}}/report.json {more}"
        steps.append(Step(f"no-scheduler-{n}", words(common)))
        steps.append(Step(f"unisched-{n}", (*words(common), "--unisched-socket", "{socket}"), serve=serve))
    return tuple(steps)


CLOUD_STANDIN = cloud_steps((6, 12), "--player-cpus 1 --width 320 --height 240 --iterations 12 --seconds 8",
                            ("--cpu-stand-in",))
"""Players on Mesa's software EGL, all on CPU 1, which the daemon takes for the GPU (--cpu-stand-in; its saturation
gate as on a GPU). As on the GPU, each player needs a small part of it: at 320x240 and 12 rounds a frame costs
about 3.8 ms of the core on a 2-core machine, so a player at 60 FPS uses under a quarter of it and 6 need more
than the core."""


SUITES: tuple[Suite, ...] = (
    Suite("pairs", "contending pairs CUDA+CUDA, render+render and NVDEC+NVDEC at 1:1, 3:1 and 1:3 under the kernel "
          "engine, each round with its own alone and no-scheduler runs (bench/gpu_pairs.py); a pair that does not "
          "contend without a scheduler (its rates sum 1.1 or more) is judged by the overlap targets", 7.5, True,
          (Step("pairs", words(f"{{py}} bench/gpu_pairs.py --out {{out}} --pairs {PAIRS} --seconds 15 "
                               "--unisched-warmup 12")),),
          read_gpu_pairs, PAIR_TARGETS_BY_CONTENTION, expected=PAIR_CASES,
          standin=(Step("pairs", (*words("{py} bench/gpu_pairs.py --out {out} --pairs cuda1:1,cuda3:1,cuda1:3 "
                                         "--render-fps 0 --seconds 5 --warmup 1 --unisched-warmup 3 "
                                         "--workload-cmd-cuda"), f"{STANDIN} cuda", *STANDIN_SERVE)),)),
    Suite("mixed", "a cooperative client beside an unmodified app and two clients, at 1:1, 3:1 and 1:3, for CUDA "
          "(client.step() against `unisched run`) and render (frames under FrameGate against an unmodified render) "
          "(bench/mixed_engines.py, its own alone runs per round; `-- --pairs frame+render,frame+frame` runs a "
          "subset)", mixed_pairs.default_round_minutes(), True,
          (Step("mixed", words("{py} bench/mixed_engines.py --out {out} --logs {out}/logs --rounds 1")),),
          read_mixed_engines, PAIR_TARGETS, expected=MIXED_CASES,
          standin=(Step("mixed", (*words("{py} bench/mixed_engines.py --out {out} --logs {out}/logs --rounds 1 "
                                         "--seconds 3 --warmup 2 "
                                         "--workload"), f"{STANDIN} cuda", "--render-workload", f"{STANDIN} render",
                                  *STANDIN_SERVE)),)),
    Suite("overlap", "ResNet-50 training + EGL render at 1:1, 3:1 and 1:3, which an H100 or H200 overlaps in hardware: "
          "the guarantee, and the overlap kept against no scheduler, by a daemon calibrated as `unisched calibrate` "
          "does from the round's no-scheduler run (bench/gpu_pairs.py --calibrate-out)", 5.0, True,
          (Step("overlap", (*words("{py} bench/gpu_pairs.py --out {out} --pairs mixed1:1,mixed3:1,mixed1:3 "
                                   f"--warmup {TRAIN_WARMUP_S} --render-iterations {RENDER_ITERATIONS} "
                                   "--calibrate-out {out}/state --workload-cmd-cuda"), TRAIN,
                            "--workload-cmd-render", RENDER)),),
          read_gpu_pairs, OVERLAP_TARGETS, expected=OVERLAP_CASES,
          standin=(Step("overlap", (*words("{py} bench/gpu_pairs.py --out {out} --pairs mixed1:1,mixed3:1 "
                                           "--render-fps 0 --seconds 5 --warmup 1 --unisched-warmup 3 "
                                           "--workload-cmd-cuda"), f"{STANDIN} cuda", "--workload-cmd-render",
                                    "{py} bench/cpu_standin.py --pin-cpu 1 --kind render", *STANDIN_SERVE)),)),
    Suite("overhead", "CUDA and render each alone, without and with the daemon, back to back in every round "
          "(bench/gpu_pairs.py --overhead --overhead-only)", 2.0, True,
          (Step("overhead", words("{py} bench/gpu_pairs.py --out {out} --pairs cuda1:1,render1:1 --overhead "
                                  "--overhead-only")),),
          read_gpu_pairs, OVERHEAD_TARGETS, expected=OVERHEAD_CASES,
          standin=(Step("overhead", (*words("{py} bench/gpu_pairs.py --out {out} --pairs cuda1:1 --overhead "
                                            "--overhead-only --render-fps 0 --seconds 5 --warmup 1 "
                                            "--workload-cmd-cuda"), f"{STANDIN} cuda", *STANDIN_SERVE)),),
          rounds=5),
    Suite("online", "ResNet-50 requests (b1, b8) at 20/s beside ResNet-50 training, under `unisched run` (kernel) and "
          "as clients (user), in preemptive mode, against alone runs without the daemon (bench/scenarios.py online)",
          4, True,
          (Step("online", words("{py} bench/scenarios.py --out {out} --scenarios online --online-batches 1,8 "
                                "--online-setups kernel,user")),),
          read_online, ONLINE_TARGETS, rounds=5, expected=ONLINE_CASES),
    Suite("cloud-gaming", f"game-streaming players (640x360 render + read-back + encode, 60 FPS pace) in weight groups "
          "1:2:4, "
          f"N = {', '.join(map(str, CLOUD_SIZES))}, with no scheduler and under the daemon "
          "(examples/cloud_gaming.py); targets where no scheduler saturates the GPU (not where the players ran out of "
          "the host's CPU); --cpu-standin: N = 6 and 12, on one CPU", 8.0, True, cloud_steps(),
          read_cloud, CLOUD_TARGETS, standin=CLOUD_STANDIN, expected=CLOUD_CASES),
    Suite("ad-sim", "the driving simulation (render -> encode -> NVDEC -> perception, examples/ad_sim.py): the stages "
          "one after another, co-located with no scheduler and under the daemon at 1:1; no target set. "
          "One after another, a frame waits in the file for the whole clip, so that end-to-end latency is the clip's",
          2.3, True,
          (Step("sequential", words("{py} examples/ad_sim.py --mode sequential --report {out}/report.json")),
           Step("colocated", words("{py} examples/ad_sim.py --mode colocated --report {out}/report.json")),
           Step("unisched-1-1", words("{py} examples/ad_sim.py --mode colocated --weights 1:1 --report "
                                      "{out}/report.json --unisched-socket {socket}"), serve=())),
          read_ad_sim),
    Suite("hooks", "the session hooks: what they add to a CUDA and an EGL context's start-up (bench/hook_startup.py), "
          "and the per-call answer cost with an idle loop (bench/hook_answer.py)", 2.3, True,
          (Step("startup", words("{py} bench/hook_startup.py --out {out}")),
           Step("answer", words("{py} bench/hook_answer.py --loads idle --out {out}"))),
          read_hooks, HOOK_TARGETS),
    Suite("leases", "a lease renewal's round trip with one tenant every 25 ms, as the lease protocol and as the client "
          "library's Client.renew() (what an app waits), the same exchange between two bare "
          "processes (the machine's floor), and 1000 tenants renewing every 100 ms with one more tenant probing "
          "beside them, one connection flooding wants and releases beside 200 tenants, Status calls while one "
          "process registers every 20 ms, and one user's registrations beside another's burst "
          "(bench/lease_load.py, bench/echo_floor.py, bench/lease_flood.py, bench/registration_load.py; CPU only, "
          "no GPU needed)", 2.5, False,
          (Step("rtt", words("{py} bench/lease_load.py --tenants 1 --seconds 15 --warmup 3 --renew-ms 25 --out {out}")),
           Step("rtt-library", words("{py} bench/lease_load.py --tenants 1 --seconds 15 --warmup 3 --renew-ms 25 "
                                     "--client library --out {out}")),
           Step("floor", words("{py} bench/echo_floor.py --seconds 15 --warmup 3 --every-ms 25 --out {out}")),
           Step("load", words("{py} bench/lease_load.py --tenants 1000 --seconds 30 --probe --out {out}")),
           Step("flood", words("{py} bench/lease_flood.py --out {out}")),
           Step("registrations", words("{py} bench/registration_load.py --out {out}"))),
          read_leases, LEASE_TARGETS),
    Suite("memory", "GPU memory accounting and refusal at the allocation: bench/gpu_memory.sh (the RM-call probe, then "
          "tests/test_gpu_memory.py on the GPU)", 5.0, True,
          (Step("memory", ("env", "OUT={out}", "bash", "bench/gpu_memory.sh")),), read_memory, MEMORY_TARGETS),
)
BY_NAME = {s.name: s for s in SUITES}
