"""monitor.metrics.steady_state: the one reduction of step records to run-level figures."""

import pytest

from lorasync.monitor.metrics import FIRST_STEP, KEEP_ALL, KEEP_NONE, steady_state


def rec(step, step_s, samples=4, comm_s=0.5, compute_s=1.0, wire=100, **more):
    return {"step": step, "step_s": step_s, "samples": samples, "comm_s": comm_s,
            "compute_s": compute_s, "wire_bytes": wire, "fp32_bytes": 400,
            "loss": 1.0 / step, **more}


#: rank 0 and rank 1; rank 1 is the slower from step 2 on
TWO_RANKS = [[rec(1, 9.0), rec(2, 2.0), rec(3, 2.0, comm_s=1.0), rec(4, 4.0, wire=300)],
             [rec(1, 8.0), rec(2, 3.0), rec(3, 3.0), rec(4, 3.0)]]

CASES = [
    # (name, per_rank, leave_out, when_none_left, expected figures)
    ("first step left out; each step as slow as its slowest rank", TWO_RANKS, FIRST_STEP,
     KEEP_ALL, {"steps": 4, "counted": (2, 3, 4), "wall_s": 10.0, "samples": 24,
                "samples_per_s": 2.4, "step_s_median": 2.0, "compute_s_mean": 1.0,
                "comm_s_mean": 2 / 3, "sync_share": 2.0 / 8.0, "wire_bytes_per_step": 500 / 3,
                "fp32_bytes_per_step": 400, "final_loss": 0.25}),
    ("every step up to a switch left out", TWO_RANKS, 2, KEEP_NONE,
     {"steps": 4, "counted": (3, 4), "wall_s": 7.0, "samples": 16, "samples_per_s": 16 / 7,
      "step_s_median": 3.0, "sync_share": 1.5 / 6.0, "final_loss": 0.25}),
    ("rank 0's records in any order", [list(reversed(TWO_RANKS[0])), TWO_RANKS[1]],
     FIRST_STEP, KEEP_ALL, {"counted": (2, 3, 4), "samples_per_s": 2.4, "final_loss": 0.25}),
    ("a one-step run measured all the same", [[rec(1, 2.0)], [rec(1, 4.0)]], FIRST_STEP,
     KEEP_ALL, {"steps": 1, "counted": (1,), "samples_per_s": 2.0, "step_s_median": 2.0,
                "sync_share": 0.25}),
    ("a one-step run without steady figures", [[rec(1, 2.0)], [rec(1, 4.0)]], FIRST_STEP,
     KEEP_NONE, {"steps": 1, "counted": (), "wall_s": 0, "samples_per_s": None,
                 "step_s_median": None, "sync_share": None, "compute_s_mean": None,
                 "final_loss": 1.0}),
    ("nothing after the switch", TWO_RANKS, 4, KEEP_NONE,
     {"counted": (), "samples_per_s": None, "wire_bytes_per_step": None}),
    ("a field a record lacks has no figure",
     [[rec(1, 1.0), rec(2, 1.0), {k: v for k, v in rec(3, 1.0).items() if k != "fp32_bytes"}]],
     FIRST_STEP, KEEP_ALL, {"fp32_bytes_per_step": None, "wire_bytes_per_step": 100}),
    ("records with only steps, times and samples",
     [[{"step": s, "step_s": 2.0, "samples": 4} for s in (1, 2, 3)]], FIRST_STEP, KEEP_ALL,
     {"samples_per_s": 2.0, "step_s_median": 2.0, "compute_s_mean": None, "sync_share": None,
      "final_loss": None}),
    ("zero time: no rate", [[rec(1, 0.0), rec(2, 0.0)]], FIRST_STEP, KEEP_ALL,
     {"samples_per_s": None, "sync_share": None, "step_s_median": 0.0}),
    ("no records", [[]], FIRST_STEP, KEEP_ALL,
     {"steps": 0, "counted": (), "samples_per_s": None, "step_s_median": None,
      "final_loss": None}),
    ("no ranks", [], FIRST_STEP, KEEP_ALL, {"steps": 0, "samples_per_s": None}),
]


@pytest.mark.parametrize("per_rank, leave_out, when_none_left, want",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_steady_state(per_rank, leave_out, when_none_left, want):
    got = steady_state(per_rank, leave_out=leave_out, when_none_left=when_none_left)
    for key, value in want.items():
        assert getattr(got, key) == (value if value is None or isinstance(value, tuple)
                                     else pytest.approx(value)), key


def test_rank0_holds_its_steady_records():
    got = steady_state(TWO_RANKS, leave_out=FIRST_STEP, when_none_left=KEEP_ALL)
    assert got.rank0 == tuple(TWO_RANKS[0][1:])


@pytest.mark.parametrize("leave_out, when_none_left", [("first", KEEP_ALL), (True, KEEP_ALL),
                                                       (1.5, KEEP_ALL), (FIRST_STEP, "some")])
def test_an_unknown_rule_is_refused(leave_out, when_none_left):
    with pytest.raises(ValueError, match="leave_out|when_none_left"):
        steady_state(TWO_RANKS, leave_out=leave_out, when_none_left=when_none_left)
