"""The start probe on a long, thin link: its sizes follow the latency it measured.

Pure functions of lorasync.plan.linkfit and lorasync.plan.policy, table-driven;
the sweep is played through on a simulated link (latency + a shaper's burst at
line rate + the shaped rate) with the same decisions comm/probe.py takes.  The
real thing on an emulated 50 ms link is tests/netns/test_long_link_netns.py.
"""

from __future__ import annotations

import pytest

from lorasync.comm.probe import sweep_sizes
from lorasync.plan import policy
from lorasync.plan.linkfit import (MAX_PROBE_BYTES, MIN_PROBE_BYTES, allreduce_model,
                                   credited_bandwidth, latency_bound, sweep_estimate, sweep_step)

KiB, MiB = 1 << 10, 1 << 20
MB10, MB100, GB1 = 10e6 / 8, 100e6 / 8, 1e9 / 8


@pytest.mark.parametrize("bw, alpha, n, size", [
    (MB10, 0.0, 2, MIN_PROBE_BYTES),         # no latency known: as before
    (MB10, 2e-4, 2, MIN_PROBE_BYTES),        # a LAN's latency changes nothing
    (GB1, 1e-4, 2, 2 * MiB),                 # 20 ms of transfer, floored to a power of two
    (MB10, 0.1, 2, 1 * MiB),                 # 10 Mbit/s, 50 ms one way: 3 x 0.2 s x 1.25 MB/s -> up
    (MB10, 0.1, 4, 2 * MiB),                 # 4 ranks: 6 messages of latency, 1.5x the bus bytes
    (MB10, 0.025, 4, 512 * KiB),
    (MB100, 0.1, 2, MAX_PROBE_BYTES),        # 7.5 MB wanted: the cap
    (1e6 / 8, 0.1, 2, MIN_PROBE_BYTES),      # 1 Mbit/s: 256 KiB already 2 s
    (0.0, 0.1, 2, MIN_PROBE_BYTES),          # no bandwidth known
])
def test_probe_size_covers_the_latency(bw, alpha, n, size):
    assert policy.probe_size(bw, alpha, n) == size


@pytest.mark.parametrize("t_small, t_big, bound", [
    (0.2022, 0.2062, True),      # 64 KiB at 10 Mbit/s, 50 ms one way (measured): all latency
    (0.2024, 0.4320, True),      # 256 KiB there: 1.1x the latency
    (0.2024, 1.0417, False),     # 1 MiB there: 4.1x
    (2e-4, 3.5e-3, False),       # 4 MiB on a LAN
    (0.2, 0.8, False),           # exactly 3x: enough
])
def test_latency_bound(t_small, t_big, bound):
    assert latency_bound(t_small, t_big) is bound


@pytest.mark.parametrize("nbytes, t_small, last, expect", [
    (1 * MiB, 0.2, (64 * KiB, 0.206), 0.2 + 0.006 * 16),   # latency kept, transfer scaled
    (1 * MiB, 0.0, (64 * KiB, 0.206), 0.206 * 16),         # no latency: linear, as before
    (4 * MiB, 0.2, (1 * MiB, 1.04), 0.2 + 0.84 * 4),
    (16 * KiB, 0.3, (4 * KiB, 0.2), 0.2),                  # a smallest time above the last: no latency credit
])
def test_sweep_estimate(nbytes, t_small, last, expect):
    assert sweep_estimate(nbytes, t_small, *last) == pytest.approx(expect)


@pytest.mark.parametrize("fit, bus, t_big, t_small, expect, capped", [
    # the start probe before (measured at 10 Mbit/s, 50 ms): 4 and 64 KiB only,
    # read 15.7 MB/s (12.7x); credited at most 2x 64 KiB over its 0.206 s
    (15.68e6, 64 * KiB, 0.2062, 0.2022, 64 * KiB / 0.1031, True),
    # after: up to 1 MiB, transfer-dominated: the fit stands
    (1.222e6, 1 * MiB, 1.0417, 0.2024, 1.222e6, False),
    # a fit above the largest message's own rate less latency: that rate
    (2.0e6, 1 * MiB, 1.0417, 0.2024, 1 * MiB / (1.0417 - 0.2024), True),
    # LAN: nothing to cap
    (1.1e9, 4 * MiB, 4.0e-3, 2e-4, 1.1e9, False),
])
def test_credited_bandwidth(fit, bus, t_big, t_small, expect, capped):
    bw, was = credited_bandwidth(fit, bus, t_big, t_small)
    assert bw == pytest.approx(expect) and was is capped


def _link(bw: float, latency: float, burst: int = 64 * KiB, line: float = 1e9):
    """Seconds of a 2-rank all-reduce of B bytes: latency, the shaper's burst
    at line rate, the rest at the shaped rate (what htb does on the veths)."""
    return lambda b: latency + min(b, burst) / line + max(0, b - burst) / bw


def _play(link, budget=3.0, max_bytes=64 * MiB, repeats=3):
    """The quick sweep's decisions (comm/probe.py _sweep) on a simulated link:
    sizes x4 from 4 KiB, the first size warmed up once and timed 3 times, a
    latency-bound size once, the others as often as the budget allows."""
    points, spent = [], 0.0
    for size in sweep_sizes(max_bytes):
        step = sweep_step(size, points, budget - spent, min_reps=1, grow_past=MAX_PROBE_BYTES)
        if not step.measure:
            break
        t = link(size)
        if step.est_s is None:
            reps = 1 + repeats
        elif step.latency_only:
            reps = 1
        else:
            reps = max(1, min(repeats, int((budget - spent) / step.est_s)))
        spent += reps * t
        points.append((size, t))
    m = allreduce_model([p[0] for p in points], [p[1] for p in points], 2)
    bw, _ = credited_bandwidth(m.bandwidth_Bps, points[-1][0], points[-1][1], points[0][1])
    return bw, points, spent


@pytest.mark.parametrize("bw, latency", [
    (MB10, 0.2),          # 10 Mbit/s, 50 ms one way (a ring all-reduce: 4 one-way trips)
    (MB100, 0.2),         # 100 Mbit/s, 50 ms
    (MB10 * 2, 0.08),     # 20 Mbit/s, 20 ms
    (MB10, 4e-4),         # 10 Mbit/s, no delay
    (MB100, 4e-4),
    (GB1, 2e-4),
])
def test_the_sweep_reads_a_long_thin_link_within_2x_in_its_budget(bw, latency):
    got, points, spent = _play(_link(bw, latency))
    assert bw / 2 <= got <= 2 * bw, (got / bw, points)
    # within the 3 s budget, overrun by one call at most
    assert spent <= 3.0 + points[-1][1], (spent, points)
    # short links stop at 4 MiB as before; long ones only go past it latency-bound
    if latency < 1e-3:
        assert points[-1][0] <= 4 * MiB


def test_a_sweep_too_short_for_the_link_reads_it_slow_not_fast():
    # 1 Gbit/s with 50 ms one way: even 64 MiB is mostly latency within 1 s of
    # budget -- the figure is capped at 2x the largest message's plain rate
    link = _link(GB1, 0.2)
    got, points, _ = _play(link, budget=1.0)
    assert latency_bound(points[0][1], points[-1][1])
    assert got <= 2 * points[-1][0] / points[-1][1] and got < GB1
