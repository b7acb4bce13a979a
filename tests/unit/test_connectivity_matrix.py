"""bench/connectivity.py's matrix helpers: the cells a run picks, each cell's
share of the direct link, and the generated matrix table (bench/tables.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


conn = _bench("connectivity")
tables = _bench("tables")


def test_cells_pick_indices_and_ranges():
    assert conn._cells("") == list(range(len(conn.CELLS)))
    assert conn._cells("0-3") == [0, 1, 2, 3]
    assert conn._cells("6,4,4") == [4, 6]
    for bad in ("7", "3-1", "a", "1-x"):
        with pytest.raises(SystemExit, match="--cells"):
            conn._cells(bad)


def _direct(bw_mbit: float, sps: float | None) -> dict:
    return {"cell": "direct", "when": "before the cells", "allreduce": {"busbw_Bps": bw_mbit * 1e6 / 8},
            "train": {"samples_per_s": sps} if sps is not None else {"status": "failed (exit 1)"}}


def _row(k: int, bw_mbit: float | None, sps: float | None) -> dict:
    return {"cell": conn.CELLS[k][0], "index": k, "trained": True, "steps": 3,
            "transports": {"node1": {"transport": "wireguard"}, "node2": {"transport": "ssh"}},
            "allreduce": {} if bw_mbit is None else {"busbw_Bps": bw_mbit * 1e6 / 8},
            "train": {"samples_per_s": sps} if sps is not None else {"status": "hung: stopped after 9 s"}}


def test_shares_are_of_the_mean_direct_run():
    direct = [_direct(90, 5.0), dict(_direct(110, 6.0), when="after the cells")]
    rows = [_row(0, 50, 5.3), _row(1, 100, 5.0), _row(2, None, None)]
    got = conn.shares(rows, direct)
    assert got["busbw_Bps_mean"] == pytest.approx(100e6 / 8)
    assert got["busbw_spread"] == pytest.approx(0.2)
    assert got["samples_per_s_mean"] == pytest.approx(5.5)
    assert got["samples_per_s_spread"] == pytest.approx(1 / 5.5)
    assert rows[0]["busbw_share"] == pytest.approx(0.5)
    assert rows[0]["train_share"] == pytest.approx(5.3 / 5.5)
    assert rows[0]["train_within"] is True      # 0.964 >= 0.95
    assert rows[1]["train_within"] is False     # 0.909
    assert rows[2]["busbw_share"] is None and rows[2]["train_within"] is None
    assert (got["train_within"], got["train_measured"]) == (1, 2)


def test_shares_without_a_direct_figure_give_none():
    rows = [_row(0, 50, 5.0)]
    got = conn.shares(rows, [_direct(90, None)])
    assert got["samples_per_s_mean"] is None and got["samples_per_s_spread"] is None
    assert rows[0]["train_share"] is None and rows[0]["busbw_share"] == pytest.approx(50 / 90)


def _part(rows: list[dict], direct: list[dict]) -> dict:
    return {"rows": rows, "direct": direct, "direct_figures": conn.shares(rows, direct),
            "trained": sum(r["trained"] for r in rows), "allreduce_rate": "100mbit",
            "train_rate": "10mbit"}


def test_matrix_table_renders_cells_controls_and_direct_runs():
    sym = _row(3, 40, 5.4)
    sym["negative"] = {"check": "node0 connects to node1 behind NAT", "failed": True,
                       "mapping": {"node": "node1", "seen_ports": [61659, 64639]}}
    nat = _row(1, 95, 4.0)
    nat["negative"] = {"check": "node0 connects to node1 behind NAT", "failed": True,
                       "mapping": {"node": "node1", "seen_ports": [29670, 29670]}}
    broken = dict(_row(5, None, None), trained=False, error="RuntimeError: no hub")
    text = tables.connectivity_matrix_targets([
        _part([_row(0, 100, 5.5), nat], [_direct(100, 5.5)]),
        _part([sym, broken], [_direct(80, 6.0), dict(_direct(100, 5.0), when="after the cells")])])
    lines = text.splitlines()
    assert "at 100 Mbit/s (share of direct)" in lines[0] and "at 10 Mbit/s, samples/s" in lines[0]
    assert "within 5% of direct" in lines[0]
    open_row = next(x for x in lines if x.startswith("| open / open |"))
    assert "| none (nothing is forbidden) | 100.0 Mbit/s (1.00) | 5.50 (1.00) | yes |" in open_row
    assert "4.00 (0.73) | no |" in next(x for x in lines if x.startswith("| NAT / open |"))
    sym_row = next(x for x in lines if x.startswith("| symmetric NAT"))
    assert "one UDP socket reached two ports of node0 from ports 61659 and 64639)" in sym_row and "40.0 Mbit/s (0.44)" in sym_row
    assert "from port 29670 both times)" in text
    assert "| NO (RuntimeError: no hub) |" in text and "hung: stopped after 9 s | - |" in text
    assert "| 2 (3, 5) | mean (spread) | 90.0 Mbit/s (22%) | 5.50 (18%) |" in text
    # the second invocation's direct runs are 18% apart: no verdict at 5% there
    assert "5.40 (0.98) | unresolved (direct runs 18% apart) |" in sym_row
    assert lines[-1] == ("3 of 4 cell runs trained; auto within 5% of the direct link (a cell run "
                         "in several invocations: every run with a verdict): yes in 1, no in 1, "
                         "unresolved in 1 of 3 cells; all-reduce share of the direct link 0.44 to 1.00.")


def test_a_cell_run_twice_is_shown_per_invocation_and_judged_on_every_verdict():
    """A cell rerun in a later invocation keeps both rows, each against its own
    invocation's direct runs; the cell is "yes" only if every run with a verdict
    is, "no" if any is, "unresolved" if none has a verdict."""
    first = _part([_row(2, 40, 5.1)], [_direct(90, 5.5)])                       # 0.93: no
    second = _part([_row(4, 35, 5.6)], [_direct(90, 5.5), dict(_direct(90, 6.6), when="after")])
    third = _part([_row(2, 40, 5.4), _row(4, 35, 5.4)], [_direct(90, 5.5)])     # 0.98: yes
    text = tables.connectivity_matrix_targets([first, second, third])
    lines = text.splitlines()
    cell2 = [x for x in lines if x.startswith(f"| {_row(2, 1, 1)['cell']} (invocation")]
    assert [x.split(" | ")[0].rsplit("(", 1)[1] for x in cell2] == ["invocation 1)", "invocation 3)"]
    assert cell2[0].endswith("| no |") and cell2[1].endswith("| yes |")
    # cell 4: unresolved in the second invocation (direct runs 18% apart), yes in the third
    cell4 = [x for x in lines if x.startswith(f"| {_row(4, 1, 1)['cell']} (invocation")]
    assert "unresolved" in cell4[0] and cell4[1].endswith("| yes |")
    assert "yes in 1, no in 1, unresolved in 0 of 2 cells" in lines[-1]


def test_matrix_table_is_registered():
    assert tables.renderer("connectivity-matrix-targets") is tables.connectivity_matrix_targets


def test_rounds_are_summarised_as_means_with_every_run_kept():
    import argparse

    a = argparse.Namespace(matrix_train_rate="10mbit", rank_cores=1.75)
    runs = [{"status": "ok", "samples_per_s": 4.0, "compute_s_mean": 2.0, "steps": 16, "world_size": 3},
            {"status": "ok", "samples_per_s": 5.0, "compute_s_mean": 1.0, "steps": 16, "world_size": 3},
            {"status": "hung: stopped after 9 s"}]
    got = conn._rounds_summary(runs, a)
    assert got["rounds"] == runs and got["rank_cores"] == 1.75
    assert got["samples_per_s"] == pytest.approx(4.5) and got["compute_s_mean"] == pytest.approx(1.5)
    assert got["samples_per_s_spread"] == pytest.approx(1 / 4.5)
    assert got["status"].startswith("1 of 3 runs failed: hung")
    one = conn._rounds_summary(runs[:1], a)   # one run: its figures as they are
    assert "rounds" not in one and one["samples_per_s"] == 4.0


def test_a_capped_cell_is_judged_on_its_mean_with_two_standard_errors():
    direct = [5.0, 5.2, 4.8, 5.0]
    assert tables.matrix_share([4.9, 5.0, 5.1], direct)["verdict"] == "yes"        # 1.00
    short = tables.matrix_share([4.0, 4.1, 3.9], direct)                               # 0.80 +- small
    assert short["verdict"] == "no" and short["share"] == pytest.approx(0.8)
    noisy = tables.matrix_share([3.5, 5.5, 4.3], direct)                              # 0.89 +- 0.27
    assert noisy["verdict"] == "unresolved" and noisy["share"] + noisy["two_se"] >= 0.95
    assert tables.matrix_share([], direct)["verdict"] == "-"


def test_the_capped_matrix_table_shows_runs_shares_and_verdicts():
    def train(*sps):
        return {"rank_cores": 1.75, "compute_s_mean": 2.0, "samples_per_s": sum(sps) / len(sps),
                "rounds": [{"samples_per_s": x} for x in sps]}
    m = _part([dict(_row(0, 88, None), train=train(4.0, 4.1, 3.9), busbw_share=0.96),
               dict(_row(3, 40, None), train=train(4.9, 5.0, 5.1), busbw_share=0.44)],
              [dict(_direct(92, None), train=train(5.0, 5.2)),
               dict(_direct(92, None), train=train(4.8, 5.0), when="after the cells")])
    m["direct_figures"]["busbw_Bps_mean"] = 92e6 / 8
    lines = tables.connectivity_matrix_capped(m).splitlines()
    assert lines[0].startswith("Every training run's ranks held to 1.75 of the host's cores")
    assert "3 runs per cell, 4 on the direct link" in lines[0]
    assert "| 4.00 (3.90-4.10) | 0.80 ± 0.0" in lines[4] and lines[4].endswith("| no |")
    assert "| 5.00 (4.90-5.10) | 1.00 ± 0.0" in lines[5] and lines[5].endswith("| yes |")
    assert lines[6].startswith("| direct link |") and "5.00 (4.80-5.20)" in lines[6]
    assert lines[-1] == ("2 of 2 cells trained; auto within 5% of the direct link: yes in 1, no in 1, "
                         "unresolved (the margin within two standard errors) in 0 of 2 cells.")
