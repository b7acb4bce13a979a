"""auto's probe plan (lorasync.plan.policy.probe_plan): when to probe the
link at a window's boundary, with how many bytes, and when next.

One row per case: what auto knows in, the plan out.  The drift is asked
only where it decides: rows that must not ask it pass ``_unasked``.
"""

from __future__ import annotations

import pytest

from lorasync.plan import policy as A
from lorasync.plan.costmodel import MODELS, Net, lora_matrices, predict

N = 921_600                       # SmolLM2-135M + LoRA r=8 on q/k/v/o
SMOL = lora_matrices(MODELS["smollm2-135m"], 8)
COMPUTE = 1.3                     # s per step, as measured on this machine
MB100, MB10 = 100e6 / 8 * 0.93, 10e6 / 8 * 0.93
NET = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)
GBIT = Net(alpha_s=2e-4, bandwidth_Bps=1e9 / 8 * 0.93, world_size=2)
SLOW = Net(alpha_s=2e-3, bandwidth_Bps=125e3, world_size=2)      # 1 Mbit/s
WL = A.workload_for(N, COMPUTE, bucket_sizes=[262_144, 262_144, 262_144, 134_656],
                    matrices=SMOL, batch_size=4)
P = predict("fp16", NET, WL)       # the strategy in use, as predicted
AS_PREDICTED = P.step_s - P.compute_s
MOVED = (AS_PREDICTED, AS_PREDICTED + 0.5 * P.step_s)     # the window's last third moved
LOOSE = (AS_PREDICTED + 0.3 * P.step_s,)     # beyond DRIFT, within DRIFT_UNCALIBRATED
CALM = (AS_PREDICTED, AS_PREDICTED)


def _asked(net):
    return P


def _unasked(net):
    raise AssertionError("the drift was asked where it does not decide")


def row(id, want, **knows):
    """``knows`` over a routine boundary at step 20 (K = 10, a probe due at
    30, the figure NET, nothing passive, calibrated, calm); ``want``:
    ``(probe_bytes, next_probe, passive)``."""
    base = dict(step=20, net=NET, link_Bps=0.0, next_probe=30, interval=10, step_s=COMPUTE,
                initial=False, start_probed=True, in_flight=False, overheads=CALM,
                calibrated=True, in_use=_asked)
    return pytest.param({**base, **knows}, want, id=id)


MIN = A.MIN_PROBE_BYTES

ROWS = [
    # the schedule
    row("routine, not yet", (0, 30, False)),
    row("the scheduled step", (MIN, 30, False), step=30, in_use=_unasked),
    row("overdue (a deferred boundary)", (MIN, 30, False), step=31, in_use=_unasked),
    row("no figure of the link at all", (MIN, 30, False), net=None, in_use=_unasked),
    # the size follows the figure: about 20 ms of transfer, a power of two
    row("1 Gbit/s: 2 MiB", (1 << 21, 30, False), net=GBIT, step=30),
    # the window's syncs measured the link: their figure, no probe traffic
    row("the syncs timed the link", (0, 30, True), link_Bps=MB10, in_use=_unasked),
    row("... postponed to the next window", (0, 40, True), link_Bps=MB10, step=30,
        in_use=_unasked),
    row("... a later scheduled probe stays", (0, 50, True), link_Bps=MB10, next_probe=50,
        in_use=_unasked),
    row("... interval=0: windows of PROBE_WINDOW steps", (0, 30, True), link_Bps=MB10,
        interval=0, next_probe=0, in_use=_unasked),
    row("... nothing to take the latency from yet", (MIN, 30, False), link_Bps=MB10,
        net=None, in_use=_unasked),
    # a drift at a routine boundary calls a probe the schedule does not
    row("the window's last third drifted", (MIN, 30, False), overheads=MOVED),
    row("within the looser tolerance before calibration", (0, 30, False), overheads=LOOSE,
        calibrated=False),
    row("beyond the calibrated one", (MIN, 30, False), overheads=LOOSE),
    row("a routine boundary with nothing to go by", (MIN, 30, False), overheads=MOVED,
        start_probed=False),
    # never while a sync is on the link
    row("due, but a sync is in flight", (0, 30, False), step=30, in_flight=True,
        in_use=_unasked),
    row("drifted, but a sync is in flight", (0, 30, False), overheads=MOVED, in_flight=True),
    # the first choice: the start probe is the figure, nothing is calibrated yet
    row("first choice after a start probe", (0, 20, False), initial=True, step=10,
        next_probe=0, overheads=MOVED, in_use=_unasked),
    row("first choice without one (probe=none)", (MIN, 0, False), initial=True,
        start_probed=False, net=None, step=10, next_probe=0, in_use=_unasked),
    row("first choice: the drift is not asked", (0, 30, False), initial=True,
        next_probe=40, overheads=MOVED, in_use=_unasked),
    # ... and the next probe is as far as a probe on the figure costs
    row("first choice, the syncs timed the link", (0, 40, True), initial=True,
        next_probe=0, link_Bps=MB10, in_use=_unasked),
    # a probe of 2 s at 1 Mbit/s: once in many windows
    row("first choice on a slow link", (0, 190, False), initial=True, net=SLOW, step=20,
        next_probe=0, in_use=_unasked),
]


@pytest.mark.parametrize("knows, want", ROWS)
def test_probe_plan(knows, want):
    step, net = knows.pop("step"), knows.pop("net")
    plan = A.probe_plan(step, net, **knows)
    assert (plan.probe_bytes, plan.next_probe, plan.passive) == want
    if plan.passive:    # the syncs' bandwidth with the figure's latency
        assert (plan.net.bandwidth_Bps, plan.net.alpha_s) == (knows["link_Bps"], net.alpha_s)
    else:
        assert plan.net is net


@pytest.mark.parametrize("spent, want", [
    (0.01, 40),       # cheap: every window
    (0.22, 50),       # 1.7% of a window: every second one
])
def test_after_a_probe_the_next_keeps_the_budget(spent, want):
    plan = A.probe_plan(30, NET, link_Bps=0.0, next_probe=30, interval=10, step_s=COMPUTE,
                        initial=False, start_probed=True, in_flight=False, overheads=CALM,
                        calibrated=True, in_use=_unasked)
    assert plan.probe_bytes and plan.next_after(spent) == want
    assert plan.next_after(spent) == A.next_probe_step(30, spent, COMPUTE, 10)
