"""The topology bench's pure parts: rows, time dilation, per-step figures, verdicts."""

from __future__ import annotations

import pytest

from lorasync.bench_topology import dilate, format_table, row_specs, summarize, verdicts
from lorasync.errors import ConfigError


def test_rows_pair_every_strategy_flat_and_hierarchical():
    rows = row_specs(9)
    keys = [r["key"] for r in rows]
    assert keys[0] == "ceiling" and "auto" in keys and "torch_powersgd" in keys
    for s in ("allreduce", "fp16", "int8", "topk", "powersgd", "diloco"):
        assert f"{s}/flat" in keys and f"{s}/node" in keys
    diloco = next(r for r in rows if r["key"] == "diloco/node")
    assert "period=4" in diloco["args"] and diloco["hierarchy"] == "node"
    # torch's PowerSGD hook in one bucket: it hangs on gloo with several
    torch_row = next(r for r in rows if r["key"] == "torch_powersgd")
    assert torch_row["args"] == ["--bucket-mb", "25"]
    assert [r["key"] for r in row_specs(9, "int8,auto")] == ["ceiling", "int8/flat",
                                                             "int8/node", "auto"]
    with pytest.raises(ConfigError, match="--rows"):
        row_specs(9, "bogus")


def test_dilation_slows_the_link_and_stretches_the_delay():
    assert dilate("10mbit", "", 4.0) == ("2500000bit", "")
    assert dilate("100mbit", "20ms", 4.0) == ("25000000bit", "80.000ms")


def _rec(step, rank, step_s, comm, inter, intra=0, samples=4):
    return {"step": step, "rank": rank, "step_s": step_s, "comm_s": comm, "compute_s": 1.0,
            "samples": samples, "wire_bytes": inter + intra, "inter_bytes": inter,
            "intra_bytes": intra, "strategy": "int8"}


def test_summary_leaves_out_the_first_step_and_counts_per_node():
    recs = [_rec(1, r, 9.0, 5.0, 999) for r in range(4)]
    recs += [_rec(s, r, 2.0 + r * 0.1, 0.5, 100 if r % 2 == 0 else 0, 50)
             for s in (2, 3) for r in range(4)]
    m = summarize(recs, ranks_per_node=2)
    assert m["steps"] == 2 and m["step_s"] == pytest.approx(2.3)   # slowest rank
    assert m["samples_per_s"] == pytest.approx(16 / 2.3)
    assert m["inter_bytes_per_node"] == pytest.approx(100)          # two nodes, leaders send
    assert m["intra_bytes_per_rank"] == pytest.approx(50)


def test_verdicts_state_each_target_with_its_number():
    ok = lambda **kw: {"status": "ok", **kw}  # noqa: E731
    cells = {"auto": ok(samples_per_s=9.2, strategy_end="diloco"),
             "topk/flat": ok(inter_bytes_per_node=200.0, eth0_bytes_per_step=700.0),
             "topk/node": ok(inter_bytes_per_node=100.0, eth0_bytes_per_step=300.0),
             "diloco/flat": ok(sync_s=0.3, plan_error=0.1),
             "diloco/node": ok(sync_s=0.1, plan_error=-0.2)}
    v = verdicts(cells, 10.0, "10mbit")
    assert any("auto: 92% of the no-sync ceiling" in x for x in v)
    assert any("topk: flat/hierarchical inter-node payload per node 2.00x, eth0 bytes 2.33x"
               in x for x in v)
    assert any("3.00x (target >= 1.5x" in x for x in v)
    assert any("1/2 rows within 15%, worst -20% (diloco/node)" in x for x in v)
    table = format_table("t", [dict(cells["topk/flat"], key="topk/flat", label="topk [flat]",
                                    samples_per_s=5.0, sync_s=0.2, step_s=1.0)], 10.0)
    assert "| topk [flat] | 5.00 | 50% | 0.200 |" in table
