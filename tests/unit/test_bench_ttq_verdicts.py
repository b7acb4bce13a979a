"""bench/time_to_quality.py's verdict of auto against the peers, including a
peer that never reached the target within its budget (a GPU user's 1 Mbit/s,
where one fp32 average of LocalSGD takes longer than the budget)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ttq():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import time_to_quality
    finally:
        sys.path.pop(0)
    return time_to_quality


def _cell(key, label, rnd, reached_s=None, ran_s=None):
    c = {"key": key, "label": label, "options": {}, "round": rnd, "status": "ok",
         "efficiency": 0.9, "sync_share": 0.1, "eval_at_steps": 0.5}
    if reached_s is not None:
        c.update(reached_step=30, time_to_target_s=reached_s, ratio_to_ideal=reached_s / 20)
    else:
        c.update(reached_step=None, time_to_target_s=None, ratio_to_ideal=None,
                 ratio_lower_bound=ran_s / 20, time_lower_bound_s=ran_s)
    return c


def test_a_peer_that_never_reached_gives_an_upper_bound(ttq):
    rows = ttq.aggregate([_cell("auto", "auto", 0, reached_s=30), _cell("auto", "auto", 1, reached_s=34),
                          _cell("localsgd_8", "LocalSGD/8", 0, ran_s=60),
                          _cell("localsgd_8", "LocalSGD/8", 1, ran_s=62)])
    (line,) = ttq.peer_verdicts("1mbit", rows)
    assert "no peer reached" in line and "at least 60 s" in line
    assert "auto <= 0.57x" in line and ": met)" in line        # slowest auto round / 60 s


def test_an_upper_bound_above_the_target_is_not_claimed(ttq):
    rows = ttq.aggregate([_cell("auto", "auto", 0, reached_s=55),
                          _cell("localsgd_8", "LocalSGD/8", 0, ran_s=60)])
    (line,) = ttq.peer_verdicts("1mbit", rows)
    assert "not shown" in line and "met)" not in line


def test_auto_not_reaching_is_said(ttq):
    rows = ttq.aggregate([_cell("auto", "auto", 0, ran_s=60),
                          _cell("localsgd_8", "LocalSGD/8", 0, ran_s=60)])
    (line,) = ttq.peer_verdicts("1mbit", rows)
    assert "neither auto (0/1 rounds)" in line


def test_a_peer_that_reached_is_compared_as_before(ttq):
    rows = ttq.aggregate([_cell("auto", "auto", 0, reached_s=20), _cell("auto", "auto", 1, reached_s=21),
                          _cell("localsgd_8", "LocalSGD/8", 0, reached_s=50),
                          _cell("localsgd_8", "LocalSGD/8", 1, reached_s=51)])
    (line,) = ttq.peer_verdicts("10mbit", rows)
    assert "= 0.41x (ahead by more than the spread" in line and "met)" in line
