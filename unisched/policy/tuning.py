"""The derived constants that shape scheduling: one frozen value, one set of defaults, each with its reason.

Not settable (the knob table, scheduler.config, holds what an operator sets); each number here was derived from a
measurement or an argument, given beside it. The engine uses `TUNING`; tests may build another value. The
saturation gate's configuration is derived here from two knobs (saturated_util, slice_ms) and these numbers, so
the gate has no defaults of its own (policy.saturation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unisched.policy.saturation import SaturationConfig

__all__ = ["TUNING", "Tuning"]


@dataclass(frozen=True)
class Tuning:
    saturation_enter_s: float = 0.4
    """The window over which an engine's mean busy fraction must reach `saturated_util` before its tenants are sliced:
    two of NVML's 200 ms samples on the H200 (one is noise: paced loads that fit can fill a sample)."""
    saturation_leave_s: float = 0.4
    """How long the holders must leave their turns unused before slicing stops. Not one or two slices: NVML's 200 ms
    sample mixes four 50 ms turns, so a render's turn can read half busy, and a trainer's first slice after a thaw
    is not a full core: two such slices in a row would open a saturated render + training pair every few seconds."""
    saturation_hold_s: float = 2.0
    """How long an engine stays open after slicing left its turns unused (paced tenants), doubling each time it
    happens again; also how long slicing with used turns must last to reset the hold to this."""
    saturation_max_hold_s: float = 30.0
    """The most the doubling hold reaches: a paced set that turns greedy waits at most this long to be sliced (unless
    it is rationed when the hold ends: then the hold is renewed, and rationing keeps the weights)."""
    ration_cap_settle_s: float = 0.2
    """While rationing, the cap on how many may sit out (`policy.rationing.sit_out_budget`) is lowered at most once
    in this long: one NVML sample on the H200 (1/6 s) spans about four 50 ms slices, and one dip of it, read at each,
    would lower the cap once a slice."""
    ration_cap_release_s: float = 5.0
    """While rationing, a cap not lowered for this long rises by one, so that a resource held open for hours
    recovers from a dip: a cap that only falls can hold too few sitting out for the weights, for as long as the
    resource stays open. Tenants that fill the GPU only together then try rationing once in this long,
    and each try leaves it partly idle for about one NVML sample: in the policy model, two tenants 1:3 that each need
    55% keep at least 0.98 of the GPU busy (tests/policy/test_rationing.py); a shorter release tries more often."""
    used_turn_margin: float = 0.3
    """A slice busier than `saturated_util` less this used its turn. NVML's 200 ms sample mixes four 50 ms turns, so
    a turn that was used beside a hand-over reads well under saturated; an unused one reads near idle."""
    ration_lead_slices: float = 0.25
    """On a resource held open while saturated (paced tenants that fill the GPU only together), a tenant more than
    this many slices of GPU time ahead of its weight share may sit out until the others catch up. A larger lead lets
    a light tenant run ahead for longer, which shows as an error of its share over a window of seconds; a smaller one
    freezes and thaws for leads within the noise of one slice's charge."""
    rate_min_cpu_cores: float = 0.02
    """A tenant's GPU seconds per CPU second (`policy.charging.gpu_per_cpu`) are taken only over a second in which it
    used at least this much of a core: a ratio over less is mostly noise, and a tenant frozen all second has none."""
    rate_keep_s: float = 3.0
    """A tenant's GPU seconds per CPU second stand this long through seconds that give no new one (`policy.charging.
    kept_rate`): NVML's per-process samples leave out a process that was not busy when they were taken, and the split
    weighs the tenants' CPU by their rates only where every one that ran has one, so one missing sample would put
    every tenant beside it back on CPU time for a second. A longer keep follows a change of a tenant's rate later."""
    ration_steps: int = 4
    """A rationed slice is split into this many steps, and who sits out is chosen anew for each
    (policy.rationing.step_schedule): a tenant that must sit out most of the time does so in short stretches between
    which its frames go on, not for whole slices at a time. Whole 50 ms slices out, in a model of paced tenants, left
    a player's 1% low at a third to a half of its mean frame rate; steps of a quarter slice, at two thirds or more."""
    ration_run_steps: int = 8
    """A rationed tenant that has sat out this many steps in a row (100 ms at the default slice) yields its place in
    the next step to another tenant ahead of its share, if there is one (policy.rationing.step_schedule): the number
    sitting out stays, only who. Charges that come in lumps (a tenant charged for a slice several times its usual
    use) otherwise make one tenant pay back in one long stretch, the frames due meanwhile felt as stutter. In the
    policy model, 24 players 1:2:4 charged per slice as unevenly as on an H100 (lognormal, cv 0.8): the weight-1
    players' longest stretch out fell from 93 steps to 17, their GPU time within 5% of the weights either way
    (tests/policy/test_rationing.py); with even charges, once settled, no stretch reaches it."""
    gate_min_slices: int = 2
    """The gate's windows span at least this many slices, whatever the slice length: one slice's busy fraction is
    one sample, which a paced load can fill."""
    turn_cpu_cores: float = 0.7
    """A compute holder this busy on its CPUs used its turn even when GPU utilization does not show it: PyTorch's
    kernels are invisible to NVML utilization on the H200 while its launching thread stays busy. Only tenants that
    declared compute: a graphics or codec tenant's GPU work is visible, and a paced one can be CPU-busy all turn
    (cloud instances encode with libx264, 10 ms a frame, and catch up on their frames when thawed) while leaving the
    GPU idle; a hardware decoder's CUDA context does not make its decode loop compute work."""
    run_units: int = 8
    """A cooperative compute holder whose units (steps) are long keeps the engine for at least this many of them
    (up to `lease_max_run_ms`). Every hand-over costs a pair of CUDA tenants: an app that pipelines its steps leaves
    them queued to run beside the next holder's first, which two time-sliced contexts pay for (two ResNet-50 b128
    trainers lose ~8% running together on an H200), and one that waits for each step leaves the GPU idle until the
    next holder's first launch. With 30 ms steps and 50 ms slices a pair changes hands ~10 times a second and loses
    up to a tenth of the GPU. Eight units a turn leave about one hand-over per eight units of work. Not for frames:
    two renders time-slice at no loss, so longer turns would only stall each render's frames."""
    handover_share: float = 0.0
    """When above 0, a cooperative holder keeps the engine long enough that the measured hand-over gap before its
    turn (the yield, the grant, the next app's wake-up; scheduler.handovers) costs at most this share of the turn.
    Off: sizing turns so (0.01) does not win back what two clients of 1.7 ms steps lose between them, so the gap is
    not where that goes; and where a Python client's wake-up is slow (a loaded 2-core machine) it makes the turns
    ~500 ms, too coarse for shares over seconds. The gap is still measured and logged ("lease turns": handover_ms)."""
    handover_grant_slices: float = 0.1
    """A grant this soon after a yield (in slices) is that yield's hand-over, whose gap the grant's first report
    measures. A later one followed someone else's turn (a freezer-governed tenant's), and its gap would hold that turn."""
    unit_ewma: float = 0.25
    """Weight of a new report's mean unit length in the running estimate: a step-length change (a new phase of
    training) is followed within a few reports, one odd report moves it by a quarter."""
    overrun_window_slices: int = 4
    """A cooperative tenant's reported GPU time is compared with the time it held its lease over windows of this many
    slices, with a slice of slack per window (the work in flight at a hand-over): over several slices that slack is a
    small part of the window, and a report that arrives a little late still falls in it (policy.leases)."""
    strikes_to_enforce: int = 3
    """Overrun windows in a row before the freezer backs a cooperative tenant's leases: one window over (a long step,
    a report delayed on a loaded host) is not an app that ignores its lease."""
    overlap_kept: float = 0.75
    """Compute and graphics that each keep at least this much of their solo rate together are not sliced against
    each other: left unsliced, each still gets at least its weight share for weights up to 3:1 (3:1 asks 0.75)."""
    mix_sum: float = 0.97
    """Kept rates summing to at least this get mixed slices (policy.overlap); below it they are sliced as one domain.
    Where the sum is 1 or more, running together some of the time gains (or, at 1, costs nothing) and the mix pauses
    each side once a period instead of at every slice: a matmul trainer + render that keep 0.125 + 0.875 together
    lose a pause per slice sliced, one per period mixed. The margin under 1 covers one calibration's noise for such a
    pair; a sum between it and 1 plans no time together (exclusive runs, as sliced). Well under 1 (every SM
    renders, as on graphics-class GPUs) the closed-loop slicing of one domain stays."""

    def gate_slices(self, seconds: float, slice_ms: float, least: int | None = None) -> int:
        """A gate window of `seconds` in slices of `slice_ms`, rounded up (at least `least`, by default
        gate_min_slices)."""
        return max(self.gate_min_slices if least is None else least, math.ceil(seconds * 1000.0 / slice_ms - 1e-9))

    def gate(self, saturated_util: float, slice_ms: float) -> SaturationConfig:
        """The saturation gate of a daemon with these knobs (saturated_util, slice_ms)."""
        hold = self.gate_slices(self.saturation_hold_s, slice_ms)
        return SaturationConfig(
            high=saturated_util, low=min(saturated_util, max(0.0, saturated_util - self.used_turn_margin)),
            enter_slices=self.gate_slices(self.saturation_enter_s, slice_ms),
            leave_slices=self.gate_slices(self.saturation_leave_s, slice_ms),
            hold_slices=hold, max_hold_slices=self.gate_slices(self.saturation_max_hold_s, slice_ms),
            reset_slices=hold, cap_settle_slices=self.gate_slices(self.ration_cap_settle_s, slice_ms, least=1),
            cap_release_slices=self.gate_slices(self.ration_cap_release_s, slice_ms, least=1))


TUNING = Tuning()
"""The daemon's tuning."""
