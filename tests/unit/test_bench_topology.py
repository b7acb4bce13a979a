"""The topology bench's pure parts: rows, per-step figures, verdicts, rescoring."""

from __future__ import annotations

import pytest

from lorasync.bench.tables import topology_table, topology_verdicts
from lorasync.bench.topology import row_specs, summarize
from lorasync.errors import ConfigError


def test_rows_pair_every_strategy_flat_and_hierarchical():
    rows = row_specs(9)
    keys = [r["key"] for r in rows]
    assert keys[0] == "ceiling" and "auto" in keys and "torch_powersgd" in keys
    for s in ("allreduce", "fp16", "int8", "topk", "powersgd", "diloco"):
        assert f"{s}/flat" in keys and f"{s}/node" in keys
    diloco = next(r for r in rows if r["key"] == "diloco/node")
    assert "period=4" in diloco["args"] and diloco["hierarchy"] == "node"
    assert "--cross-node" not in diloco["args"]          # shards, the default
    leaders = next(r for r in rows if r["key"] == "diloco/node+leaders")
    assert leaders["args"][-2:] == ["--cross-node", "leaders"]
    # torch's PowerSGD hook in one bucket: it hangs on gloo with several
    torch_row = next(r for r in rows if r["key"] == "torch_powersgd")
    assert torch_row["args"] == ["--bucket-mb", "25"]
    assert [r["key"] for r in row_specs(9, "int8,auto")] == ["ceiling", "int8/flat",
                                                             "int8/node", "auto"]
    with pytest.raises(ConfigError, match="--rows"):
        row_specs(9, "bogus")


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
    v = topology_verdicts(cells, 10.0, "10mbit")
    assert any("auto: 92% of the no-sync ceiling" in x for x in v)
    assert any("topk: flat/hierarchical inter-node payload per node 2.00x, eth0 bytes 2.33x"
               in x for x in v)
    assert any("3.00x (target >= 1.5x" in x for x in v)
    assert any("1/2 rows within 15%, worst -20% (diloco/node)" in x for x in v)
    table = topology_table("t", [dict(cells["topk/flat"], key="topk/flat", label="topk [flat]",
                                      samples_per_s=5.0, sync_s=0.2, step_s=1.0)], 10.0)
    assert "| topk [flat] | 5.00 | 50% | 0.200 |" in table


def _saved_run(unshaped_sps, profile_sps):
    def nosync(sps):
        return {"status": "ok", "samples_per_s": sps, "step_s": 32 / sps}
    row = {"key": "fp16/flat", "label": "fp16 [flat]", "status": "ok", "samples_per_s": 1.5,
           "step_s": 32 / 1.5, "sync_s": 5.0, "inter_bytes_per_node": 3.7e6,
           "eth0_bytes_per_step": 1.3e7, "strategy_end": "fp16"}
    return {"nodes": 4, "nproc_per_node": 2, "model": "smollm2-135m", "steps": 6,
            "batch_size": 4, "dilation": 5.0, "dilation_how": "--dilation 5",
            "adapter_params": 921600, "ceiling": nosync(unshaped_sps),
            "intra_link": [5e-4, 1e9], "profiles": {"10mbit": {
                "emulated_rate": "2mbit", "emulated_delay": "", "inter_link": [3e-3, 2.4e5],
                "baseline": nosync(profile_sps), "rows": [row]}}}


@pytest.mark.parametrize("unshaped,profile", [(2.6, 3.7), (3.7, 2.6)])
def test_the_faster_no_sync_run_is_the_ceiling_and_the_models_compute(tmp_path, unshaped,
                                                                      profile):
    # 8 workers on 2 cores vary by 20% and more between no-sync runs minutes apart: a slow
    # one put rows over 100% and every prediction 30% slow; the faster counts
    import json
    from lorasync.bench.topology import rescore
    (tmp_path / "results.json").write_text(json.dumps(_saved_run(unshaped, profile)))
    result = rescore(str(tmp_path))
    prof = result["profiles"]["10mbit"]
    assert prof["ceiling"]["samples_per_s"] == 3.7
    cell = prof["rows"][0]
    fast = _saved_run(3.7, 3.7)
    (tmp_path / "results.json").write_text(json.dumps(fast))
    same = rescore(str(tmp_path))["profiles"]["10mbit"]["rows"][0]
    assert cell["predicted_step_s"] == pytest.approx(same["predicted_step_s"])
    assert "| fp16 [flat] | 1.50 | 41% |" in (tmp_path / "results.md").read_text()
    assert cell["plan_error"] == pytest.approx(cell["step_s"] / cell["predicted_step_s"] - 1)


def test_rescore_names_a_directory_without_results(tmp_path):
    from lorasync.bench.topology import rescore
    with pytest.raises(ConfigError, match="--rescore"):
        rescore(str(tmp_path))


def test_a_run_scores_each_profile_and_writes_its_results(tmp_path, monkeypatch):
    # the measuring parts stubbed (emulated clusters, training, probes): what the bench
    # does with their figures, end to end
    import argparse
    import contextlib
    import json
    import lorasync.bench.topology as bt
    import lorasync.emulate.launch as emulate_launch

    def fake_train(c, row, common, out, timeout):
        nosync = row["strategy"] == "none"
        sps = (3.7 if "baseline" in out else 2.6) if nosync else 1.5
        return {"key": row["key"], "label": row["label"], "status": "ok", "wall_s": 1.0,
                "samples_per_s": sps, "step_s": 32 / sps, "sync_s": 0.0 if nosync else 5.0,
                "inter_bytes_per_node": 0 if nosync else 3.7e6, "strategy_end": row["strategy"],
                "total_steps": 6, "eth0_bytes_per_node": [1e6] * 4}

    monkeypatch.setattr(bt.os, "geteuid", lambda: 0)
    monkeypatch.setattr(emulate_launch, "emulated", lambda spec: contextlib.nullcontext(None))
    monkeypatch.setattr(bt, "_train", fake_train)
    monkeypatch.setattr(bt, "_probe", lambda c, out, name, timeout, node_only=False:
                        (5e-4, 1e9) if node_only else (3e-3, 2.4e5))
    monkeypatch.setattr(bt, "_adapter_params", lambda d: 921600)
    args = argparse.Namespace(nodes=4, nproc_per_node=2, steps=6, rows="fp16", model="tiny",
                              batch_size=4, eval_size=0, row_timeout=10, dilation=5.0,
                              profiles="10mbit,100mbit+20ms", output_dir=str(tmp_path))
    assert bt.run_topology(args) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert list(result["profiles"]) == ["10mbit", "100mbit+20ms"]
    for prof in result["profiles"].values():
        assert prof["ceiling"] == {"samples_per_s": 3.7, "step_s": 32 / 3.7,
                                   "from": "on this profile"}
        assert [c["key"] for c in prof["rows"]] == ["fp16/flat", "fp16/node"]
    md = (tmp_path / "results.md").read_text()
    assert md.count("| fp16 [flat] | 1.50 | 41% |") == 2 and "dilation x5.00" in md
