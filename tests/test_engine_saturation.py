"""The engine's saturation gate against fake telemetry: tenants of an unsaturated GPU all run, a saturated one
is sliced by weight, paced tenants that leave their turns unused are not kept sliced, and what counts as a
used turn when utilization cannot see the work."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from test_engine import SLICE, Rig, gpu_rig

from unisched.policy import Engine
from unisched.policy.tuning import TUNING
from unisched.scheduler.config import DaemonConfig
from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample


def test_tenants_of_an_unsaturated_gpu_all_run(tmp_path: Path) -> None:
    """Paced or pipelined tenants that show demand but leave the GPU 40% busy are not made to take turns."""
    rig, _ = gpu_rig(tmp_path, 0.4)
    rig.step(200)
    assert not any(frozen for _, frozen in rig.driver.freeze_log)
    assert rig.cpu("a") == pytest.approx(rig.cpu("b"))


def test_a_saturated_gpu_is_sliced_by_weight_from_the_moment_it_saturates(tmp_path: Path) -> None:
    rig, tel = gpu_rig(tmp_path, 0.4)
    rig.step(100)  # unsaturated: both ran all the time, b far beyond its weight's share
    tel.next_samples = [GpuSample(0, 1.0, 0.0, 0.0, 0)]
    rig.step(2)
    a0, b0 = rig.cpu("a"), rig.cpu("b")
    rig.step(400)
    # 3:1 from here on, with no catch-up for the unsaturated stretch, in which nobody was deprived
    assert (rig.cpu("a") - a0) / (rig.cpu("b") - b0) == pytest.approx(3.0, rel=0.1)


def test_paced_tenants_that_leave_the_gpu_idle_a_few_percent_are_not_sliced(tmp_path: Path) -> None:
    """Sixteen paced cloud-gaming instances read 0.94 busy on the H200 (GPM, median) while each kept its 60 FPS;
    sliced, each got 1/16 of the time and 5 FPS. Saturated means never idle, sustained for 0.2 s: a busy slice
    or two in a row (a burst that fills one NVML sample) is not saturation; 0.2 s busy >= 0.98 on average is."""
    rig, tel = gpu_rig(tmp_path, 0.94)
    rig.step(200)
    assert not any(frozen for _, frozen in rig.driver.freeze_log)
    enter = math.ceil(0.2 / SLICE - 1e-9)
    for _ in range(5):
        tel.next_samples = [GpuSample(0, 1.0, 0.0, 0.0, 0)]
        rig.step(enter // 2)
        tel.next_samples = [GpuSample(0, 0.94, 0.0, 0.0, 0)]
        rig.step(enter - enter // 2)
    assert not any(frozen for _, frozen in rig.driver.freeze_log)
    for util in (1.0, 0.97, 1.0):  # never idle on average, though one slice dips below the line
        tel.next_samples = [GpuSample(0, util, 0.0, 0.0, 0)]
        rig.step(1)
    assert not any(frozen for _, frozen in rig.driver.freeze_log)
    tel.next_samples = [GpuSample(0, 0.995, 0.0, 0.0, 0)]
    rig.step(enter - 3 + 1)
    assert any(frozen for _, frozen in rig.driver.freeze_log)


def _step_with_util(rig: Rig, tel: FakeTelemetry, util: Callable[[], float], n: int) -> int:
    """Steps with the GPU's busy fraction given by the tenants' state; returns how many slices froze someone."""
    sliced = 0
    for _ in range(n):
        tel.next_samples = [GpuSample(0, util(), 0.0, 0.0, 0)]
        rig.step()
        sliced += rig.frozen("a") or rig.frozen("b")
    return sliced


def test_paced_tenants_that_leave_their_turns_unused_are_not_kept_sliced(tmp_path: Path) -> None:
    """Sixteen paced cloud instances read saturated together (94-100% busy on the H200) yet use a few ms of each
    turn: sliced, they kept 5 of 60 FPS. Slicing that leaves turns unused is stopped and tried again ever later."""
    rig, tel = gpu_rig(tmp_path, 1.0)
    rig.rate.update(a=0.1, b=0.1)  # paced: a tenth of a core each

    def busy() -> float:
        return 0.2 if rig.frozen("a") or rig.frozen("b") else 1.0  # alone, each leaves the GPU mostly idle
    sliced = _step_with_util(rig, tel, busy, 1200)  # a minute of 50 ms slices
    assert 0 < sliced < 0.05 * 1200, sliced  # tried a few times (0.5 s each), then held open for up to 30 s


def test_a_paced_render_tenant_busy_on_its_cpu_did_not_use_its_turn(tmp_path: Path) -> None:
    """Cloud instances encode on the CPU (libx264, 10 ms a frame) and catch up on frames when thawed: a whole core
    busy through their turn while the GPU idles. Their GPU work is visible, so the GPU decides for them."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000), telemetry=tel)
    rig.add("a", 100, engines=("graphics", "encode"))
    rig.add("b", 100, engines=("graphics", "encode"))

    def busy() -> float:
        return 0.2 if rig.frozen("a") or rig.frozen("b") else 1.0
    sliced = _step_with_util(rig, tel, busy, 1200)
    assert 0 < sliced < 0.05 * 1200, sliced


def test_a_holder_busy_on_its_cpu_used_its_turn_when_utilization_cannot_see_it(tmp_path: Path) -> None:
    """PyTorch's kernels are invisible to NVML utilization on the H200 VM: a render + training pair reads busy
    only while the render runs. The trainer's busy launching thread says it used its turn: the pair stays
    sliced by weight instead of opening whenever the trainer holds the GPU."""
    rig, tel = gpu_rig(tmp_path, 1.0)  # a (weight 300) trains, b (100) renders

    def busy() -> float:
        return 1.0 if not rig.frozen("b") else 0.0
    _step_with_util(rig, tel, busy, 40)
    a0, b0 = rig.cpu("a"), rig.cpu("b")
    sliced = _step_with_util(rig, tel, busy, 800)
    assert sliced > 0.95 * 800
    assert (rig.cpu("a") - a0) / (rig.cpu("b") - b0) == pytest.approx(3.0, rel=0.1)


def test_a_training_and_render_pair_stays_sliced_through_stale_samples_and_slow_thaws(tmp_path: Path) -> None:
    """What the H200 showed: NVML's 200 ms sample averages four 50 ms turns (the render's turn reads half busy;
    the trainer's reads nothing, its kernels are invisible), and a trainer's first slice after a thaw is not a
    full core. Judged slice by slice, two such slices in a row opened the pair three times in 12 s."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000), telemetry=tel)
    rig.add("a", 100)  # trains (compute)
    rig.add("b", 100, engines=("graphics",))  # renders
    render_ran: list[float] = []
    was_frozen = False
    sliced, a_frozen = 0, 0
    for i in range(1240):
        render_ran.append(0.0 if rig.frozen("b") else 1.0)
        tel.next_samples = [GpuSample(0, sum(render_ran[-4:]) / len(render_ran[-4:]), 0.0, 0.0, 0)]
        rig.rate["a"] = 0.5 if was_frozen else 1.0
        was_frozen = rig.frozen("a")
        rig.step()
        if i >= 440:
            sliced += rig.frozen("a") or rig.frozen("b")
            a_frozen += rig.frozen("a")
    assert sliced > 0.95 * 800, sliced
    assert 0.3 < a_frozen / sliced < 0.7, a_frozen / sliced  # both get turns


def test_trainers_invisible_to_utilization_are_still_sliced_by_weight(tmp_path: Path) -> None:
    """Two ResNet-50 trainers read 0-5% in NVML on the H200 VM: to the gate alone the GPU looks idle and a 3:1
    pair would run 1:1. Compute tenants keeping their CPUs busy under an idle-looking GPU mean no signal."""
    rig, _ = gpu_rig(tmp_path, 0.0)  # a (300) and b (100), compute, each a busy core
    rig.step(40)
    a0, b0 = rig.cpu("a"), rig.cpu("b")
    rig.step(400)
    assert (rig.cpu("a") - a0) / (rig.cpu("b") - b0) == pytest.approx(3.0, rel=0.1)


@pytest.mark.parametrize(("declared", "dec_util", "sliced"), [
    (("decode",), 0.3, False),  # its CPU feeds the decoder: no invisible compute work, and NVDEC has room
    (("decode",), 1.0, True),  # NVDEC saturated: sliced there by weight
    (("decode", "compute"), 0.3, True),  # decode + inference: its busy CPU stands in for kernels NVML cannot see
])
def test_hardware_decoders_are_sliced_only_where_the_gpu_shows_them_saturated(
        tmp_path: Path, declared: tuple[str, ...], dec_util: float, sliced: bool) -> None:
    """PyAV's hardware decode opens a CUDA context beside its NVDEC session and keeps a core busy feeding the
    decoder while the SMs read idle. Two such decoders keep 0.85-0.88 of their rate each side by side on the H200:
    taking turns, they would keep half."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    tel.next_samples = [GpuSample(0, 0.0, dec_util, 0.0, 0)]
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000), telemetry=tel)
    rig.add("a", 300, engines=declared)
    rig.add("b", 100, engines=declared)
    for name in ("a", "b"):
        assert rig.engine.admit_session(name, "compute", 0xCBC0) and rig.engine.admit_session(name, "nvdec", 0xB8B0)
    rig.step(40)
    a0, b0 = rig.cpu("a"), rig.cpu("b")
    rig.step(400)
    assert Engine.COMPUTE in rig.engine.snapshot("b").engines  # on the SMs too, by its context
    if sliced:
        assert (rig.cpu("a") - a0) / (rig.cpu("b") - b0) == pytest.approx(3.0, rel=0.1)
    else:
        assert not any(frozen for _, frozen in rig.driver.freeze_log)


def test_paced_compute_tenants_on_an_idle_gpu_all_run(tmp_path: Path) -> None:
    """Online inference at 20 requests/s next to another light compute tenant: neither keeps a core busy."""
    rig, _ = gpu_rig(tmp_path, 0.0)
    rig.rate.update(a=0.2, b=0.2)
    rig.step(200)
    assert not any(frozen for _, frozen in rig.driver.freeze_log)


def test_saturated_util_zero_always_slices(tmp_path: Path) -> None:
    rig, _ = gpu_rig(tmp_path, 0.4, saturated_util=0.0)
    rig.step(400)
    assert rig.cpu("a") / rig.cpu("b") == pytest.approx(3.0, rel=0.1)


def players(tmp_path: Path, n: int, loop: bool = False, **config: object) -> tuple[Rig, FakeTelemetry, list[str]]:
    """`n` paced players p0, p1, ... in weight groups 1:2:4 (100, 200, 400 in turn), rendering, on GPU 0 of a fake
    telemetry; `loop`: driven as the daemon's loop drives the engine (a rationed slice's steps too)."""
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-x", 1 << 30)])
    rig = Rig(tmp_path, config=DaemonConfig(slice_ms=SLICE * 1000, **config), telemetry=tel)  # type: ignore[arg-type]
    rig.loop = loop
    names = [f"p{i}" for i in range(n)]
    for i, name in enumerate(names):
        rig.add(name, 100 * (1, 2, 4)[i % 3], engines=("graphics",))
    return rig, tel, names


@pytest.mark.parametrize("ration", [True, False])
def test_paced_tenants_on_a_gpu_held_open_are_rationed_by_weight(tmp_path: Path, ration: bool) -> None:
    """Twelve paced players 1:2:4 each needing a fifth of the GPU: sliced, one alone leaves it 80% idle, so the gate
    holds it open; still saturated, the players furthest ahead of their share sit slices out, and their GPU time
    (here their CPU time, which the fake burns in step with it) follows the weights instead of being equal. With
    ration_paced off they share it equally."""
    rig, tel, names = players(tmp_path, 12, ration_paced=ration)

    def play(slices: int) -> None:  # each running player gets an equal part of the GPU, none above its fifth
        for _ in range(slices):
            running = sum(not rig.frozen(n) for n in names)
            part = min(0.2, 1.0 / running) if running else 0.0
            rig.rate.update(dict.fromkeys(names, part))
            tel.next_samples = [GpuSample(0, min(1.0, part * running), 0.0, 0.0, 0)]
            rig.step()
    play(60)  # the gate slices, finds the turns unused, and holds the GPU open
    start = {n: rig.cpu(n) for n in names}
    play(1200)
    used = {n: rig.cpu(n) - start[n] for n in names}
    by_weight = [sum(used[n] for i, n in enumerate(names) if i % 3 == k) for k in range(3)]
    expected = (2.0, 4.0) if ration else (1.0, 1.0)
    assert by_weight[1] / by_weight[0] == pytest.approx(expected[0], rel=0.15), by_weight
    assert by_weight[2] / by_weight[0] == pytest.approx(expected[1], rel=0.15), by_weight
    assert sum(by_weight) >= 0.9 * 1200 * SLICE  # the GPU kept nearly full


def _rationed_players(tmp_path: Path, loop: bool) -> tuple[list[float], float, int, int]:
    """Twelve paced players 1:2:4 on a GPU held open, a minute of it: GPU time per weight group, the longest any
    player sat out at a stretch while held open, how many calls between ticks changed who is frozen, and how many
    times the gate tried slicing again (which freezes players for the others' turns)."""
    rig, tel, names = players(tmp_path, 12, loop)
    since = dict.fromkeys(names, 0.0)
    longest = 0.0
    changed = tries = 0

    def play(seconds: float, measure: bool) -> None:
        nonlocal changed, longest, tries
        end = rig.clock.monotonic() + seconds
        while rig.clock.monotonic() < end:
            running = sum(not rig.frozen(n) for n in names)
            part = min(0.2, 1.0 / running) if running else 0.0
            rig.rate.update(dict.fromkeys(names, part))
            tel.next_samples = [GpuSample(0, min(1.0, part * running), 0.0, 0.0, 0)]
            before = [rig.frozen(n) for n in names]
            was = any(g.sliced for g in rig.engine.gate_states())
            tick_at = rig.engine.next_tick
            rig.step()
            now = rig.clock.monotonic()
            probing = any(g.sliced for g in rig.engine.gate_states())
            tries += measure and probing and not was
            for n in names:
                if not rig.frozen(n) or probing:
                    since[n] = now
                elif measure:
                    longest = max(longest, now - since[n])
            changed += measure and now <= tick_at + 1e-9 and before != [rig.frozen(n) for n in names]
    play(3.0, False)  # the gate slices, finds the turns unused, and holds the GPU open
    start = {n: rig.cpu(n) for n in names}
    play(60.0, True)
    used = {n: rig.cpu(n) - start[n] for n in names}
    return [sum(used[n] for i, n in enumerate(names) if i % 3 == k) for k in range(3)], longest, changed, tries


def test_rationed_players_sit_out_in_steps_between_ticks(tmp_path: Path) -> None:
    """Driven as the daemon's loop drives it (`advance`), a rationed slice is split into steps and who sits out is
    chosen for each: the weights hold, the GPU stays full, the gate does not try turns again while it rations (the
    try stalls every player), and no player sits out two slices in a row (here 75 ms at most); with one choice a
    slice (ticks alone) the light players sat out 150 ms at a time: frames missed in a row, felt as stutter."""
    by_weight, longest, changed, tries = _rationed_players(tmp_path / "loop", loop=True)
    assert by_weight[1] / by_weight[0] == pytest.approx(2.0, rel=0.15), by_weight
    assert by_weight[2] / by_weight[0] == pytest.approx(4.0, rel=0.15), by_weight
    assert sum(by_weight) >= 0.9 * 60.0  # the GPU kept nearly full
    _, whole, unchanged, _ = _rationed_players(tmp_path / "ticks", loop=False)
    assert changed > 0 and unchanged == 0
    assert tries == 0  # rationed when each hold ended: renewed, never tried again
    assert longest < 2 * SLICE <= whole, (longest, whole)


def test_a_rationed_slice_is_logged_with_who_sits_out(tmp_path: Path) -> None:
    """At --log-level debug each tick of a rationed GPU logs its steps, budget and the leads that chose them: what
    a share that misses its weight on a real GPU is read from."""
    with capture_logs() as logs:
        _rationed_players(tmp_path, loop=True)
    sliced = [e for e in logs if e["event"] == "rationed slice"]
    assert sliced, "no rationed slice logged"
    last = sliced[-1]
    assert set(last["leads"]) == {f"p{i}" for i in range(12)} and set(last["charged"]) == set(last["leads"])
    assert last["sit_out"]["gpu0/sm"] >= 1 and any(last["steps"])


@pytest.mark.parametrize(("left_out", "frame_s"), [(0, 0.0), (2, 0.0), (0, 0.2 / 60)])
def test_paced_players_that_spin_are_rationed_by_their_gpu_time(tmp_path: Path, left_out: int, frame_s: float) -> None:
    """Twelve paced players 1:2:4 whose CPU time is no measure of their GPU time: each waits for the busy GPU by
    spinning, the more so the more often it runs (its CPU a GPU second 1, 1.5 and 2 by group, as players at 14, 18
    and 22 ms of CPU a frame were). Here NVML's per-process samples show each one's GPU time, and the daemon weighs
    their CPU by it: their GPU time follows the weights. Split by CPU time alone they got 1:1.4:2. (On a GPU the
    samples show only a few processes a second, so with many players the split falls back to CPU time; that is why
    governed processes wait for the GPU by sleeping: policy.waits.) `left_out`: each
    second NVML's samples leave out that many players, chosen at random: their last rates stand meanwhile (without
    that, every tick beside one fell back to the CPU split, and they got 1:1.4:2). `frame_s`: the GPU time of the frame a
    player has queued when it is frozen (a frame at its pace: a fifth of the GPU at 60 FPS), which the GPU still runs
    while it sits out: the busy time of that drain is charged to the players thawed beside it, but NVML's samples
    show it as the frozen player's, so its rate, and the weights, hold."""
    rig, tel, names = players(tmp_path, 12)
    pick = random.Random(7)
    queued = random.Random(3)  # how much of its frame a player still has queued when it is frozen
    left = dict.fromkeys(names, 0.0)
    thawed = dict.fromkeys(names, True)
    step = SLICE  # the length of the rig's last step (a tick or a rationed step)
    spin = {n: (1.0, 1.5, 2.0)[i % 3] for i, n in enumerate(names)}
    pid = {n: rig.driver.groups[f"/unisched/{n}"].pids[0] for n in names}
    for n in names:
        rig.engine._c.tenants[n].hooked = True  # under the session hooks, as `unisched run` players are
    used = dict.fromkeys(names, 0.0)
    shown: dict[int, float] = {}
    window = dict.fromkeys(names, 0.0)
    window_start = rig.clock.monotonic()

    def play(seconds: float) -> None:
        nonlocal shown, window_start, step
        end = rig.clock.monotonic() + seconds
        while rig.clock.monotonic() < end:
            for n in names:
                if rig.frozen(n) and thawed[n]:
                    left[n] = queued.uniform(0.0, frame_s)
                thawed[n] = not rig.frozen(n)
            running = [n for n in names if not rig.frozen(n)]
            draining = [n for n in names if rig.frozen(n) and left[n] > 0]
            # the GPU's time-slicing: a draining player gets at most an equal part of the step (the last one's length
            # standing for this one's), the thawed share what the drain leaves
            even = 1.0 / (len(running) + len(draining)) if running or draining else 0.0
            ran = {n: min(even, left[n] / step) for n in draining}
            drained = sum(ran.values())
            part = min(0.2, (1.0 - drained) / len(running)) if running else 0.0
            rig.rate.update({n: part * spin[n] for n in names})
            tel.next_samples = [GpuSample(0, min(1.0, part * len(running) + drained), 0.0, 0.0, 0, process_sm=shown)]
            t0 = rig.clock.monotonic()
            rig.step()
            step = rig.clock.monotonic() - t0
            for n in running:
                used[n] += part * step
                window[n] += part * step
            for n, fraction in ran.items():
                seconds = min(left[n], fraction * step)
                left[n] -= seconds
                used[n] += seconds
                window[n] += seconds
            if rig.clock.monotonic() - window_start >= 1.0:  # NVML's per-process samples: a second's mean
                span = rig.clock.monotonic() - window_start
                out = set(pick.sample(names, left_out))
                shown = {pid[n]: window[n] / span for n in names if n not in out}
                window.update(dict.fromkeys(names, 0.0))
                window_start = rig.clock.monotonic()
    play(5.0)  # the gate slices, finds the turns unused, and holds the GPU open; the rates are taken
    start = dict(used)
    play(60.0)
    split = {rule: s for _, rule, s in rig.engine.charged_by_rule()}  # what unisched_gpu_charged_seconds shows
    assert split["process-rate"] > 0.8 * sum(split.values()), split
    by_weight = [sum(used[n] - start[n] for i, n in enumerate(names) if i % 3 == k) for k in range(3)]
    assert by_weight[1] / by_weight[0] == pytest.approx(2.0, rel=0.15), by_weight
    assert by_weight[2] / by_weight[0] == pytest.approx(4.0, rel=0.15), by_weight
    assert sum(by_weight) >= 0.9 * 60.0  # the GPU kept nearly full


def test_one_dip_in_the_gpu_reading_does_not_hold_rationing_down(tmp_path: Path) -> None:
    """Twenty-four paced players 1:2:4 on a GPU held open and rationed. One NVML sample that reads it 60% busy is
    seen by the four ticks it spans: the cap on how many sit out falls by one, not four, and rises back within
    seconds; their GPU time over the next half minute still follows the weights. Lowered at each tick and never
    raised, the cap held rationing down for as long as the GPU stayed open (on an H100, 5 sitting out where 10-12
    had kept the weights)."""
    rig, tel, names = players(tmp_path, 24, loop=True)
    ctx = rig.engine._c

    def play(seconds: float, dip: bool = False) -> None:
        end = rig.clock.monotonic() + seconds
        while rig.clock.monotonic() < end:
            running = sum(not rig.frozen(n) for n in names)
            part = min(0.08, 1.0 / running) if running else 0.0
            rig.rate.update(dict.fromkeys(names, part))
            util = 0.6 if dip else min(1.0, part * running)
            tel.next_samples = [GpuSample(0, util, 0.0, 0.0, 0)]
            rig.step()
    play(10.0)
    sm = next(iter(ctx.plan.sit_out))
    before = ctx.plan.sit_out[sm]
    assert before >= 4, ctx.plan.sit_out  # rationing: 1.9x the GPU wanted
    for _ in range(4 * TUNING.ration_steps):  # one NVML sample, read at each tick and step it spans
        play(1e-9, dip=True)
    dipped = ctx.plan.sit_out_cap[sm].most
    assert dipped >= before - 2, (before, dipped)
    play(12.0)
    start = {n: rig.cpu(n) for n in names}
    play(30.0)
    used = {n: rig.cpu(n) - start[n] for n in names}
    by_weight = [sum(used[n] for i, n in enumerate(names) if i % 3 == k) for k in range(3)]
    assert by_weight[1] / by_weight[0] == pytest.approx(2.0, rel=0.1), by_weight
    assert by_weight[2] / by_weight[0] == pytest.approx(4.0, rel=0.1), by_weight
