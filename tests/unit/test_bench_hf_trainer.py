"""bench/hf_trainer.py's measurement helpers: the Trainer rows are timed as
``lorasync train`` is (steps 2..N, lorasync's final sync after step N left
out), and TRL's per-step metric gathers are read per step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_trainer():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import hf_trainer
    finally:
        sys.path.pop(0)
    return hf_trainer


def test_the_final_sync_in_the_last_step_end_is_left_out(hf_trainer):
    # steps of 1.5 s; the Trainer's step-end clock at step 30 runs after lorasync's
    # callback, whose finish() (DiLoCo's last average) took 3 s more
    times = [(s, 100.0 + 1.5 * s) for s in range(1, 31)]
    times[-1] = (30, times[-1][1] + 3.0)
    plain = [(s, 100.0 + 1.5 * s) for s in range(1, 31)]
    want = 8 * 29 / (1.5 * 29)
    assert hf_trainer.samples_per_s(plain, 8) == pytest.approx(want)
    assert hf_trainer.samples_per_s(times, 8) < 0.95 * want   # what the bench measured before
    assert hf_trainer.samples_per_s(times, 8, tail_s=3.0) == pytest.approx(want)


def test_samples_per_s_needs_two_steps(hf_trainer):
    assert hf_trainer.samples_per_s([(1, 5.0)], 8) is None
    assert hf_trainer.samples_per_s([], 8) is None


def test_gathers_per_step_cover_steps_2_to_n(hf_trainer):
    recs = [{"step": 1, "time": 1.0, "gather_s": 0.5, "gathers": 4},
            {"step": 2, "time": 2.0, "gather_s": 0.51, "gathers": 8},
            {"step": 3, "time": 3.0, "gather_s": 0.91, "gathers": 12}]
    g = hf_trainer._gather_per_step(recs)
    assert g["gather_steps"] == [0.01, 0.4]
    assert g["gather_s"] == pytest.approx(0.205)
    assert g["gather_max_s"] == pytest.approx(0.4)
    assert g["gathers_per_step"] == 4
    assert hf_trainer._gather_per_step([{"step": 1, "time": 1.0}]) is None


def test_host_cpu_counts_a_wall_time_share(hf_trainer):
    start = hf_trainer.host_cpu()
    out = hf_trainer.host_cpu(dict(start, t=start["t"] - 1.0))
    if "cpu_pressure" in out:   # kernels without PSI have none
        assert 0.0 <= out["cpu_pressure"] <= 1.5
    if "host_busy_cores" in out:
        assert out["host_busy_cores"] >= 0.0
