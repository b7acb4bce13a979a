"""bench/sync_events.py on committed runs: the figures docs/topology.md quotes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
B = ROOT / "bench/reference/topology-4x2/b-100mbit_20ms/100mbit_20ms"


@pytest.fixture(scope="module")
def sync_events():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import sync_events
    finally:
        sys.path.pop(0)
    return sync_events


def test_outer_sync_steps_of_the_plus20ms_diloco_rows(sync_events):
    flat, node = sync_events.events(B / "diloco-flat"), sync_events.events(B / "diloco-node")
    # H=4 over 6 steps: one outer sync each, at step 4, on all 8 ranks
    assert [e["step"] for e in flat] == [4] and [e["step"] for e in node] == [4]
    assert flat[0]["ranks"] == node[0]["ranks"] == 8
    assert round(flat[0]["last_in_to_last_out_s"], 2) == 4.05
    assert round(node[0]["last_in_to_last_out_s"], 2) == 2.95
    # between the ranks' own waits: the early ranks' comm_s also counts the
    # wait for the last one (the compute skew this leaves out)
    for e in (flat[0], node[0]):
        assert e["comm_s_min"] <= e["last_in_to_last_out_s"] < e["comm_s_max"]


def test_steps_that_cross_no_node_are_left_out(tmp_path, sync_events):
    rows = [{"step": 1, "rank": r, "comm_s": 0.5, "time": 10.0 + r, "inter_bytes": 0}
            for r in range(2)]
    rows += [{"step": 2, "rank": 0, "comm_s": 1.0, "time": 20.0, "inter_bytes": 100},
             {"step": 2, "rank": 1, "comm_s": 3.0, "time": 20.5, "inter_bytes": 100},
             {"event": "switch", "step": 2, "rank": 0, "time": 20.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (ev,) = sync_events.events(tmp_path)
    # last in: rank 0 at 19.0 (rank 1 arrived at 17.5); last out: 20.5
    assert ev["step"] == 2 and ev["last_in_to_last_out_s"] == pytest.approx(1.5)


def test_a_directory_without_metrics_is_refused(tmp_path, capsys, monkeypatch, sync_events):
    monkeypatch.setattr(sys, "argv", ["sync_events.py", str(tmp_path)])
    assert sync_events.main() == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
