"""`lorasync bench` without a cluster: rows, the planner's column, the verdict lines."""

from __future__ import annotations

import pytest

from lorasync.bench.progressive import profile_rows, row_cell, select_rows
from lorasync.bench.rows import Row, measured_step_s, predict_rows, row_strategy
from lorasync.bench.tables import progressive_table, progressive_verdicts
from lorasync.errors import ConfigError
from lorasync.plan.costmodel import Net

N = 921_600


def _summary(sps, strategy="allreduce", world=2):
    return {"samples_per_s": sps, "world_size": world, "adapter_params": N,
            "strategy": strategy, "sync_share": 0.1, "wire_bytes_per_step": 1e6,
            "step_s_median": 8 / sps, "eval_after": None}


def test_periodic_row_syncs_inside_the_measured_steps():
    by = {r.key: r for r in select_rows("all", steps=9)}
    assert "period=8" in by["periodic"].args and "H=8" in by["periodic"].label
    # fewer steps: the period shrinks so one sync still lands after the warm-up step
    by = {r.key: r for r in select_rows("all", steps=5)}
    assert "period=4" in by["periodic"].args
    assert [r.key for r in select_rows("ddp", 9)] == ["ceiling", "ddp", "ceiling_end"]
    with pytest.raises(ConfigError, match="--rows"):
        select_rows("ddp,nope")


def test_the_ceiling_runs_first_and_last_across_profiles():
    keys = [[r.key for r in profile_rows("fp16", 3, i, 3)] for i in range(3)]
    assert keys == [["ceiling", "fp16"], ["fp16"], ["fp16", "ceiling_end"]]
    assert [r.key for r in profile_rows("fp16", 3, 0, 1)] == ["ceiling", "fp16", "ceiling_end"]


def test_row_strategy_reads_options_and_bucket():
    by = {r.key: r for r in select_rows("all", steps=9)}
    assert row_strategy(by["ddp"]) == ("allreduce", {}, 25.0)
    assert row_strategy(by["periodic"]) == (
        "diloco", {"period": 8, "streaming": True, "delta_dtype": "fp16"}, 1.0)
    assert row_strategy(by["auto"]) is None          # switches: no single prediction
    assert row_strategy(by["torch_powersgd"]) is None


def test_mean_step_counts_every_measured_step():
    # 2 ranks x 4 samples at 4 samples/s: 2 s per step, however the steps vary
    assert measured_step_s(_summary(4.0), 4) == pytest.approx(2.0)


def test_predicted_column_and_verdicts():
    rows = select_rows("ddp,fp16,periodic,auto", steps=9)
    by = {r.key: r for r in rows}
    net = Net(alpha_s=1e-4, bandwidth_Bps=1.15e6, world_size=2)   # ~10 Mbit/s
    by["ceiling"].summary = _summary(6.4, "none")
    by["ceiling_end"].summary = _summary(6.0, "none")
    by["ddp"].summary = _summary(1.8)
    by["fp16"].summary = _summary(3.0, "fp16")
    by["periodic"].summary = _summary(6.1, "diloco")
    by["auto"].summary = _summary(5.9, "diloco")
    predict_rows(rows, net, by["ceiling"].summary, "smollm2-135m", 4)
    # fp32 all-reduce of 3.69 MB at 1.15 MB/s is ~3.2 s on top of 1.25 s compute
    ddp = by["ddp"].extra
    assert ddp["predicted_step_s"] == pytest.approx(1.25 + 3.2, rel=0.1)
    assert ddp["plan_error"] == pytest.approx(ddp["measured_step_s"] / ddp["predicted_step_s"] - 1)
    assert "plan_error" not in by["auto"].extra
    cells = [row_cell(r, by["ceiling"], by["ddp"]) for r in rows]
    lines = progressive_verdicts(cells)
    assert lines[0].startswith("plan vs measured step time: ") and " 3/3 rows within 15%" in lines[0]
    assert "= 97% of the best fixed lorasync row (+ periodic sync" in lines[1]
    table = progressive_table("10mbit", cells)
    assert "| s/step measured / planned |" in table
    assert f"{ddp['measured_step_s']:.2f} / {ddp['predicted_step_s']:.2f}" in table


def test_failed_row_shows_its_status_and_no_prediction():
    rows = [Row("ceiling", "no sync (ceiling)", ["--comm", "none"]),
            Row("ddp", "plain DDP", ["--comm", "allreduce"])]
    rows[0].summary = _summary(6.0, "none")
    rows[1].status = "hung: stopped after 240 s"
    predict_rows(rows, Net(alpha_s=0, bandwidth_Bps=1e7, world_size=2), rows[0].summary,
                 "tiny", 4)
    cells = [row_cell(r, rows[0], None) for r in rows]
    assert "| plain DDP | hung: stopped after 240 s |" in progressive_table("x", cells)
    assert progressive_verdicts(cells) == []  # ceiling alone: no plan rows, no auto


def test_auto_steady_state_after_its_last_switch(tmp_path):
    import json

    from lorasync.bench.rows import after_last_switch

    recs = []
    for step in range(1, 8):
        for rank in (0, 1):
            r = {"step": step, "rank": rank, "samples": 4,
                 "strategy": "fp16" if step < 4 else "diloco",
                 "step_s": (3.0 if step <= 4 else 1.0) + 0.5 * rank}
            if step == 4:
                r["switch"] = {"from": "fp16", "to": "diloco", "step": 4}
            recs.append(r)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = after_last_switch(str(path))
    # steps 5-7: 8 samples each, the slower rank's 1.5 s
    assert got == {"last_switch_step": 4, "final_strategy": "diloco", "steps_after_switch": 3,
                   "samples_per_s_after_switch": pytest.approx(24 / 4.5)}
    path.write_text("".join(json.dumps({**r, "switch": None}) + "\n" for r in recs))
    assert after_last_switch(str(path)) == {"final_strategy": "diloco"}   # no switch: its pick
    assert after_last_switch(str(tmp_path / "missing.jsonl")) == {}


def test_a_run_scores_every_profile_against_the_fastest_ceiling(tmp_path, monkeypatch):
    # the measuring parts stubbed (emulated clusters, probes, training): what the bench
    # does with their figures, end to end
    import argparse
    import contextlib
    import json

    import lorasync.bench.progressive as bp
    import lorasync.emulate.launch as emulate_launch

    class FakeCluster:
        def status(self, measure=True, seconds=1.0):
            return {}

    sps = {"ceiling": 6.0, "fp16": 3.2, "ceiling_end": 6.4}
    ran = []

    def fake_run_row(c, row, common, out, timeout, time_limit=0.0):
        ran.append(row.key)
        row.status, row.extra["wall_s"] = "ok", 1.0
        row.summary = _summary(sps[row.key], "none" if row.key.startswith("ceiling") else "fp16")

    net = Net(alpha_s=1e-4, bandwidth_Bps=1.15e6, world_size=2)
    monkeypatch.setattr(emulate_launch, "emulated", lambda spec: contextlib.nullcontext(FakeCluster()))
    monkeypatch.setattr(bp, "probe_link", lambda c, out, timeout: (net, "probe: stubbed"))
    monkeypatch.setattr(bp, "run_row", fake_run_row)
    monkeypatch.setattr(bp, "tune_nodes", lambda *a: None)
    monkeypatch.setattr(bp, "_available", lambda strategy: True)
    args = argparse.Namespace(nodes=2, steps=9, rows="fp16", model="tiny", batch_size=4,
                              eval_size=0, row_timeout=10, profiles="10mbit,100mbit+20ms",
                              output_dir=str(tmp_path))
    assert bp.run_progressive(args) == 0
    assert ran == ["ceiling", "fp16", "fp16", "ceiling_end"]
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    assert list(res) == ["10mbit", "100mbit+20ms"]
    for cells in res.values():
        fp16 = next(c for c in cells if c.get("key") == "fp16")
        assert fp16["efficiency"] == pytest.approx(0.5) and fp16["predicted_step_s"] > 0
    md = (tmp_path / "results.md").read_text()
    assert md.count("| + fp16 compression | 3.20 | -x | 50% |") == 2   # no DDP row: no speedup
    assert md.count("reference ceiling: 6.40 samples/s, the fastest of 2 no-sync runs") == 2
    assert (tmp_path / "chart.png").stat().st_size > 1000


def test_workload_links_peer_rows_and_rounds(tmp_path, monkeypatch):
    # --workload: a calibration no-sync run first, every user link emulated
    # dilated by its step; peer rows and 2 interleaved rounds with their spread
    import argparse
    import contextlib
    import json

    import lorasync.bench.progressive as bp
    import lorasync.emulate.launch as emulate_launch

    class FakeCluster:
        def status(self, measure=True, seconds=1.0):
            return {}

    specs, ran = [], []
    sps = {("ceiling", 0): 2.0, ("ceiling_end", 0): 2.2, ("ddp", 0): 0.3, ("ddp", 1): 0.35,
           ("auto", 0): 2.0, ("auto", 1): 1.95, ("localsgd_8", 0): 1.6, ("localsgd_8", 1): 1.7}

    def fake_run_row(c, row, common, out, timeout, time_limit=0.0):
        ran.append((row.key, row.round, row.module))
        row.status, row.extra["wall_s"] = "ok", 1.0
        row.summary = _summary(sps[(row.key, row.round)],
                               "none" if row.key.startswith("ceiling") else "x")

    def fake_emulated(spec):
        specs.append((spec.rate_bps, spec.delay_s))
        return contextlib.nullcontext(FakeCluster())

    monkeypatch.setattr(emulate_launch, "emulated", fake_emulated)
    monkeypatch.setattr(bp, "probe_link", lambda c, out, timeout: (None, "probe: stubbed"))
    monkeypatch.setattr(bp, "run_row", fake_run_row)
    monkeypatch.setattr(bp, "tune_nodes", lambda *a: None)
    monkeypatch.setattr(bp, "_available", lambda strategy: True)
    args = argparse.Namespace(nodes=2, steps=30, rows="ddp,auto,localsgd_8", model="tiny",
                              batch_size=4, eval_size=0, row_timeout=10, rounds=2,
                              profiles="100mbit+50ms", output_dir=str(tmp_path),
                              workload="smollm2-h200", row_time_limit=0.0)
    assert bp.run_progressive(args) == 0
    # calibration (unshaped), then the one profile; ceilings once, rows interleaved
    assert specs[0] == (None, 0.0)
    assert [(k, r) for k, r, _ in ran] == [
        ("ceiling", 0), ("ddp", 0), ("auto", 0), ("localsgd_8", 0),
        ("ddp", 1), ("auto", 1), ("localsgd_8", 1), ("ceiling_end", 0)]
    assert ("localsgd_8", 0, "lorasync.bench.peers") in ran
    # no-sync step here: 2 ranks x 4 samples / 2.0 samples/s = 4 s; the workload's 0.18 s
    # with the same adapter: rate / 22.2, delay x 22.2
    rate, delay = specs[1]
    assert rate == pytest.approx(100e6 * 0.18 / 4.0, rel=1e-3)
    assert delay == pytest.approx(0.050 * 4.0 / 0.18, rel=1e-3)
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["workload"]["rate_div"] == pytest.approx(4.0 / 0.18)
    cells = {c.get("key"): c for c in res["results"]["100mbit+50ms"]["cells"]}
    assert cells["auto"]["spread"]["efficiency"]["n"] == 2
    md = (tmp_path / "results.md").read_text()
    assert "### 100mbit+50ms user link, workload smollm2-h200: emulated 4.500 Mbit/s + 1111 ms" in md
    assert "each user link is emulated at rate / 22.2 and delay x 22.2" in md
    # auto 89-91% of the 2.2 ceiling, LocalSGD 73-77%: beyond the spread
    assert "| auto | 1.98 (1.95-2.00) |" in md
    assert "auto vs the best peer (accelerate LocalSGD, every 8 steps): 90% vs 75%" in md
    assert "ahead by more than the spread; 2 and 2 rounds" in md


def test_peer_rows_need_thirty_steps_and_a_known_name():
    import argparse

    import lorasync.bench.progressive as bp

    rows = select_rows("ddp,localsgd_8,torchft_streaming", 30)
    peers = [r for r in rows if r.peer]
    assert [r.key for r in peers] == ["localsgd_8", "torchft_streaming"]
    assert rows[-1].key == "ceiling_end"
    assert peers[0].args[:4] == ["--peer", "accelerate_localsgd", "--peer-opt",
                                 "local_sgd_steps=8"]
    with pytest.raises(ConfigError, match="localsgd_K"):
        select_rows("localsgd_x")
    args = argparse.Namespace(nodes=2, steps=9, rows="localsgd_8", model="tiny", batch_size=4,
                              eval_size=0, row_timeout=10, rounds=1, profiles="10mbit",
                              output_dir="", workload="", row_time_limit=0.0)
    with pytest.raises(ConfigError, match="--steps"):
        bp.run_progressive(args)
    args.steps, args.workload = 30, "nope"
    with pytest.raises(ConfigError, match="--workload"):
        bp.run_progressive(args)


def test_a_capped_row_is_scored_on_its_finished_steps(tmp_path):
    import json

    from lorasync.bench.rows import partial_summary

    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for rank in (0, 1):
        recs = [{"event": "start"}] + [
            {"step": s, "samples": 4, "step_s": 10.0 + rank, "comm_s": 8.0, "wire_bytes": 3e6,
             "strategy": "allreduce"} for s in (1, 2, 3, 4)]
        if rank == 0:
            recs.append({"step": 5, "samples": 4, "step_s": 1.0, "comm_s": 0.0,
                         "wire_bytes": 0, "strategy": "allreduce"})   # rank 1 never finished it
        (ranks / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = partial_summary(str(tmp_path), 2)
    # steps 2-4 of both ranks: 8 samples each, 11 s each (the slower rank)
    assert s["steps"] == 4 and s["samples_per_s"] == pytest.approx(24 / 33)
    assert s["wire_bytes_per_step"] == pytest.approx(3e6) and s["partial"]
    (ranks / "rank1.jsonl").write_text(json.dumps({"step": 1, "samples": 4, "step_s": 1,
                                                   "comm_s": 0}) + "\n")
    assert partial_summary(str(tmp_path), 2) is None


def test_a_peer_stopped_before_its_first_sync_is_not_the_best_peer():
    from lorasync.bench.tables import peer_share_verdict

    auto = {"key": "auto", "row": "auto", "efficiency": 0.23}
    lsgd = {"key": "localsgd_8", "row": "accelerate LocalSGD, every 8 steps", "peer": True,
            "efficiency": 0.89, "capped_steps": 7}
    got = peer_share_verdict([auto, lsgd])
    assert len(got) == 1 and got[0].startswith("accelerate LocalSGD, every 8 steps: stopped after 7 steps, "
                                               "before its first sync (at step 8)")
    # one that synced at least once is compared, the other still named
    tf = {"key": "torchft_diloco", "row": "torchft DiLoCo, every 8 steps", "peer": True,
          "efficiency": 0.10, "capped_steps": 9}
    got = peer_share_verdict([auto, lsgd, tf])
    assert got[1].startswith("auto vs the best peer (torchft DiLoCo, every 8 steps): 23% vs 10%")
    # uncapped, or capped after its first sync: an ordinary peer
    assert peer_share_verdict([auto, dict(lsgd, capped_steps=None)])[0].startswith(
        "auto vs the best peer (accelerate LocalSGD")


def test_a_torchft_row_may_set_its_outer_optimizer():
    """torchft_streaming:outer_lr=0.8:outer_momentum=0.5: the row's peer gets
    those values, its label says so, and a bad item is one clear error."""
    from lorasync.bench.peers import parse_peer_options, peer_row
    from lorasync.bench.tables import _first_sync

    rows = select_rows("auto,torchft_streaming,torchft_streaming:outer_lr=0.8:outer_momentum=0.5",
                       30)
    tuned = [r for r in rows if r.peer][1]
    assert tuned.label.endswith("1 step late, outer lr 0.8, momentum 0.5")
    label, args, opts = peer_row(tuned.key, "http://10.0.0.1:29510")
    def peer_opts(args):
        return parse_peer_options("torchft_diloco", [args[i + 1] for i, a in enumerate(args)
                                                     if a == "--peer-opt"])

    got = peer_opts(args)
    assert (got["outer_lr"], got["outer_momentum"], got["fragments"]) == (0.8, 0.5, 2)
    paper = peer_opts(peer_row("torchft_streaming", "http://10.0.0.1:29510")[1])
    assert (paper["outer_lr"], paper["outer_momentum"]) == (0.7, 0.9)   # the paper's, by default
    assert _first_sync(tuned.key) == 4   # 2 fragments: the first lands at step 8 / 2
    assert _first_sync("torchft_diloco") == 8 and _first_sync("localsgd_16") == 16
    for bad, why in (("torchft_streaming:outer_lr", "OPTION=NUMBER"),
                     ("torchft_streaming:lr=0.8", "OPTION=NUMBER"),
                     ("torchft_diloco:outer_lr=x", "OPTION=NUMBER"),
                     ("torchft_streaming:outer_momentum=-1", "0 <= outer_momentum < 1"),
                     ("torchft_streaming:outer_momentum=1", "0 <= outer_momentum < 1"),
                     ("torchft_streaming:outer_lr=0", "outer_lr=0: give a learning rate > 0"),
                     ("torchft_streaming:outer_lr=nan", "outer_lr=nan: give a learning rate"),
                     ("torchft_streaming:outer_lr=1:outer_lr=2", "outer_lr is given twice")):
        with pytest.raises(ConfigError, match=why):
            select_rows(bad, 30)
