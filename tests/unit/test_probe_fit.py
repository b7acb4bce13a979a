"""Pure parts of the probe: the alpha/beta fit, nccl-tests' bus factors, sizes."""

import math
import random

import pytest

from lorasync.comm.probe import sweep_sizes
from lorasync.netdiag.probe_cli import format_report
from lorasync.plan.linkfit import allreduce_model, busbw_factor, fit_alpha_beta


def test_fit_recovers_exact_line():
    alpha, beta = 50e-6, 1 / 1.25e9  # 50 us, 10 Gbit/s
    sizes = sweep_sizes(64 << 20)
    fit = fit_alpha_beta(sizes, [alpha + beta * s for s in sizes])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(1.25e9, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.predict(1 << 20) == pytest.approx(alpha + beta * (1 << 20))


def test_fit_keeps_latency_under_noise():
    """5% multiplicative noise: the plain intercept would be the 64 MB
    point's jitter (50 ms +- 2.5 ms) against a 50 us alpha."""
    rng = random.Random(0)
    alpha, beta = 50e-6, 1 / 1.25e9
    sizes = sweep_sizes(64 << 20) * 3
    times = [(alpha + beta * s) * (1 + rng.uniform(-0.05, 0.05)) for s in sizes]
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.15)
    assert fit.bandwidth_Bps == pytest.approx(1.25e9, rel=0.1)


def test_fit_bandwidth_ignores_token_bucket_burst():
    """Measured on a 20 Mbit/s htb link: 4 KiB fits in the bucket and
    arrives at line rate; the slope must still be the shaped 2.4 MB/s."""
    sizes = [4096, 16384, 65536, 262144]
    times = [0.14e-3, 6.96e-3, 27.56e-3, 109.76e-3]
    fit = fit_alpha_beta(sizes, times)
    assert fit.bandwidth_Bps == pytest.approx(2.4e6, rel=0.05)


def test_fit_clamps_negative_alpha_and_beta():
    fit = fit_alpha_beta([1000, 2000, 4000], [1.0e-3, 2.1e-3, 4.3e-3])  # line through < 0
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte > 0
    flat = fit_alpha_beta([1000, 2000, 4000], [3e-3, 2e-3, 1e-3])  # time falling with size
    assert flat.beta_s_per_byte == 0.0 and flat.bandwidth_Bps is None
    assert flat.alpha_s > 0


@pytest.mark.parametrize("sizes,times,word", [
    ([1, 2], [1.0], "length"),
    ([4096], [1e-3], "2 distinct"),
    ([4096, 4096], [1e-3, 1e-3], "2 distinct"),
    ([1, 2], [1e-3, 0.0], "positive"),
    ([1, 2], [1e-3, math.inf], "positive"),
    ([-1, 2], [1e-3, 2e-3], ">= 0"),
])
def test_fit_rejects_bad_input(sizes, times, word):
    with pytest.raises(ValueError, match=word):
        fit_alpha_beta(sizes, times)


def test_busbw_factor_is_nccl_tests():
    assert busbw_factor("all_reduce", 2) == 1.0
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_reduce", 8) == 2 * 7 / 8
    assert busbw_factor("all_gather", 4) == 0.75
    assert busbw_factor("broadcast", 4) == 1.0
    with pytest.raises(ValueError, match="collective"):
        busbw_factor("alltoall", 2)


def test_allreduce_model_flat_times_give_a_lower_bound_not_infinity():
    # a very fast link: the large all-reduce was not slower (timer noise)
    m = allreduce_model([1024, 1 << 20], [1e-3, 0.9e-3], 2)
    assert math.isfinite(m.bandwidth_Bps) and m.bandwidth_Bps == pytest.approx((1 << 20) / 0.9e-3)
    assert m.alpha_s >= 0 and m.bandwidth_from.startswith("largest busbw")


@pytest.mark.parametrize("sizes, times, n", [([1024, 1024], [1e-3, 2e-3], 2),
                                             ([1024, 4096], [0, 1e-3], 2),
                                             ([1024, 4096], [1e-3, 2e-3], 1)])
def test_allreduce_model_rejects_nonsense(sizes, times, n):
    with pytest.raises(ValueError):
        allreduce_model(sizes, times, n)


def test_sweep_sizes():
    assert sweep_sizes(64 << 20) == [4096 * 4 ** i for i in range(8)]
    assert sweep_sizes(1 << 20)[-1] == 1 << 20
    assert sweep_sizes(100_000) == [4096, 16384, 65536, 100_000]
    assert sweep_sizes(1000) == [1000]


def test_format_report_names_slowest_pair():
    res = {
        "world_size": 2, "backend": "gloo", "elapsed_s": 1.0,
        "ranks": [{"rank": 0, "host": "a", "ifname": "eth0", "addr": "10.0.0.1", "mtu": 1500},
                  {"rank": 1, "host": "b", "ifname": "eth0", "addr": "10.0.0.2", "mtu": 1500}],
        "sweep": [{"collective": "all_reduce", "bytes": 4096, "time_s": 1e-4, "time_s_min": 9e-5,
                   "time_s_max": 2e-4, "algbw_Bps": 4.1e7, "busbw_Bps": 4.1e7}],
        "pairs": [{"src": 0, "dst": 1, "latency_s": 5e-5, "bandwidth_Bps": 1e8},
                  {"src": 1, "dst": 0, "latency_s": 5e-5, "bandwidth_Bps": 2e6}],
        "model": {"latency_s": 2e-5, "bandwidth_Bps": 1.2e8, "r2": 0.99},
        "slowest_pair": {"src": 1, "dst": 0, "bandwidth_Bps": 2e6, "latency_s": 5e-5},
    }
    text = format_report(res)
    assert "slowest pair: rank 1 (b 10.0.0.2) -> rank 0 (a 10.0.0.1): 2 MB/s" in text
    assert "41 MB/s" in text
