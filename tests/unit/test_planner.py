"""The planner: sanity targets, the choice rule, advice, probe input, units, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorasync.cli import main
from lorasync.errors import ConfigError
from lorasync.catalog import LOSSLESS, PERIODIC, STRATEGIES
from lorasync.plan.costmodel import MODELS, MiB, Net, Workload, head_share, lora_matrices, predict
from lorasync.plan.advice import plan
from lorasync.plan.net import (
    DEFAULT_TCP_WINDOW, Link, ProbeModel, ProbeResult, net_from_probe, what_if_net,
)
from lorasync.plan.ranking import Measurements, choose, rank
from lorasync.units import parse_count, parse_size

N = 921_600
SMOL = lora_matrices(MODELS["smollm2-135m"], 8)
# 4 samples per rank at ~3.2 samples/s per rank
COMPUTE = 1.25


def wl(**kw):
    base = dict(adapter_params=N, compute_s=COMPUTE, batch_size=4, matrices=SMOL)
    base.update(kw)
    return Workload(**base)


def eff(strategy, net, w=None):
    return predict(strategy, net, w or wl()).efficiency


# --------------------------------------------------------------------------- sanity targets

SLOW = [  # 10 Mbit/s between 2 nodes, as a probe would measure it and as a what-if
    Net(alpha_s=1e-4, bandwidth_Bps=10e6 / 8, world_size=2),
    what_if_net(2, 10e6 / 8, 0.5e-3),
]


@pytest.mark.parametrize("net", SLOW)
@pytest.mark.parametrize("strategy, lo, hi", [
    ("allreduce", 0.27, 0.45),    # measured 29% (lorasync bench, compute 1.25 s/step)
    ("onebit", 0.85, 1.0),         # measured 0.90 (plan_accuracy: 1.39 s/step, compute 1.25)
    ("topk", 0.60, 0.75),          # default ratio 0.1: a fifth of fp32's bytes
    ("diloco", 0.70, 0.85),        # fp32 adapter every 8 steps, not overlapped
])
def test_slow_link_targets(net, strategy, lo, hi):
    assert lo <= eff(strategy, net) <= hi


@pytest.mark.parametrize("net", SLOW)
def test_slow_link_overlap_and_sparsity_targets(net):
    """What reaches the 10 Mbit/s target: DiLoCo's outer sync streamed behind
    the next steps (fp16 delta: ~1.5 s of transfer hides behind the next
    step's compute; fp32 and delay 1 leaves ~1.7 s of 3 exposed), or top-k at 1%."""
    assert eff("diloco", net, wl(options={"diloco": {"streaming": True}})) < 0.9
    assert eff("diloco", net, wl(options={"diloco": {"streaming": True,
                                                     "delta_dtype": "fp16"}})) >= 0.95
    assert eff("diloco", net, wl(options={"diloco": {"streaming": True, "delay": 3}})) >= 0.95
    assert eff("topk", net, wl(options={"topk": {"ratio": 0.01}})) >= 0.90


@pytest.mark.parametrize("net", SLOW)
def test_slow_link_periodic_sync_with_long_enough_period(net):
    for s in ("local", "diloco"):
        assert eff(s, net, wl(options={s: {"period": 32}})) > 0.90
        # streaming hides the sync behind the next `delay` steps' compute (3 x 1.25 s > 3 s)
        stream = wl(options={s: {"period": 8, "streaming": True, "delay": 3}})
        assert eff(s, net, stream) > 0.99
        assert predict(s, net, stream).exposed_comm_s == 0


@pytest.mark.parametrize("net", SLOW)
def test_slow_link_compression_beats_plain_allreduce_and_recommendation_compresses(net):
    base = eff("allreduce", net)
    for s in STRATEGIES:
        if s != "allreduce":
            assert eff(s, net) > base, s
    rec = choose(Measurements(net, wl()))
    assert rec.strategy not in LOSSLESS
    assert rec.prediction.efficiency > 0.85


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fast_lan_recommends_lossless(n):
    net = what_if_net(n, 1e9 / 8, 0.2e-3)
    rec = choose(Measurements(net, wl()))
    assert rec.strategy in ("allreduce", "fp16")
    assert rec.prediction.lossless


# measured scaling efficiency on 2 namespaces (tbf, + 40 ms RTT via TUN) by the first
# `lorasync bench` runs, on a machine computing the embedded default's step in 1.25 s
# (those runs predate bench/reference/; the committed run is bench/reference/bench)
@pytest.mark.parametrize("rate_bit, rtt, ceiling, measured", [
    (100e6, 1e-4, 6.36, {"allreduce": 0.80, "fp16": 0.92, "powersgd": 0.98}),
    (10e6, 1e-4, 6.37, {"allreduce": 0.29, "fp16": 0.50, "powersgd": 0.78}),
    (100e6, 40e-3, 6.63, {"allreduce": 0.80, "fp16": 0.84, "powersgd": 0.82}),
])
def test_reproduces_design_measurements_within_8_points(rate_bit, rtt, ceiling, measured):
    net = what_if_net(2, rate_bit / 8, rtt)
    w = wl(compute_s=8 / ceiling, options={"powersgd": {"rank": 1}})
    for strategy, m in measured.items():
        assert eff(strategy, net, w) == pytest.approx(m, abs=0.08), strategy


# --------------------------------------------------------------------------- choose

def test_ranking_is_sorted_and_complete():
    r = rank(SLOW[0], wl())
    assert [p.samples_per_s for p in r] == sorted((p.samples_per_s for p in r), reverse=True)
    assert {p.strategy for p in r} == set(STRATEGIES)


def test_lossless_within_margin_is_preferred():
    net = what_if_net(2, 1e9 / 8, 0.2e-3)
    m = Measurements(net, wl())
    best = rank(net, wl())[0]
    assert not best.lossless  # periodic sync is marginally faster on paper
    assert choose(m).prediction.lossless
    # with no tolerance the fastest wins
    assert choose(m, lossless_margin=0.0, exact_margin=0.0).strategy == best.strategy


def test_exact_allreduce_preferred_when_within_exact_margin():
    net = what_if_net(2, 10e9 / 8, 0.05e-3, tcp_window_bytes=None)
    rec = choose(Measurements(net, wl()))
    assert rec.strategy == "allreduce", rec.reason


def test_candidates_restrict_the_choice():
    rec = choose(Measurements(SLOW[0], wl(), candidates=("allreduce", "fp16")))
    assert rec.strategy == "fp16"
    with pytest.raises(ConfigError):
        choose(Measurements(SLOW[0], wl(), candidates=()))


def test_hysteresis_keeps_current_unless_clearly_better():
    net = SLOW[0]
    r = rank(net, wl())
    first, second = r[0], r[1]
    gap = first.samples_per_s / second.samples_per_s - 1
    keep = choose(Measurements(net, wl(), current=second.strategy), switch_margin=gap + 0.01)
    assert keep.strategy == second.strategy
    switch = choose(Measurements(net, wl(), current=second.strategy), switch_margin=gap / 2)
    assert switch.strategy == first.strategy
    # a lossless pick is never dropped for a lossy current strategy by hysteresis
    fast = what_if_net(2, 1e9 / 8, 0.2e-3)
    rec = choose(Measurements(fast, wl(), current="topk"), switch_margin=0.5)
    assert rec.prediction.lossless


# --------------------------------------------------------------------------- advice

def _chain_ok(steps):
    done = [s for s in steps if s.samples_per_s_after is not None]
    for a, b in zip(done, done[1:]):
        if a.worthwhile:
            assert b.samples_per_s_before == pytest.approx(a.samples_per_s_after)


def test_slow_link_advice_compresses_first():
    pl = plan(SLOW[1], wl(), Link(rtt_s=0.5e-3, rate_Bps=10e6 / 8))
    todo = [s for s in pl.steps if s.worthwhile]
    assert todo[0].action == "compression"
    assert todo[0].gain > 1.0  # more than doubles throughput
    assert all(s.action != "rdma" for s in pl.steps)
    tcp = next(s for s in pl.steps if s.action == "tcp_tuning")
    assert not tcp.worthwhile  # 10 Mbit/s x 0.5 ms fits any window
    _chain_ok(pl.steps)
    assert pl.ceiling.efficiency == 1.0


def test_long_fat_pipe_advice_tunes_tcp_first():
    rate, rtt = 10e9 / 8, 30e-3
    net = what_if_net(4, rate, rtt)
    assert net.bandwidth_Bps == pytest.approx(DEFAULT_TCP_WINDOW / rtt)
    pl = plan(net, wl(adapter_params=30 * N, matrices=None, compute_s=2.0),
              Link(rtt_s=rtt, rate_Bps=rate))
    assert pl.steps[0].action == "tcp_tuning" and pl.steps[0].worthwhile
    assert pl.steps[0].gain > 0.05
    _chain_ok(pl.steps)


def test_probe_without_line_rate_flags_window_limit_with_unknown_gain():
    rtt = 20e-3
    net = Net(alpha_s=rtt, bandwidth_Bps=DEFAULT_TCP_WINDOW / rtt, world_size=2)
    pl = plan(net, wl(), Link(rtt_s=rtt, source="probe"))
    tcp = pl.steps[0]
    assert tcp.action == "tcp_tuning" and tcp.worthwhile and tcp.gain is None


def test_rdma_step_only_when_present_and_lowers_latency():
    net = what_if_net(8, 25e9 / 8, 10e-3, tcp_window_bytes=None)
    w = wl(compute_s=0.3)
    # per-step strategies only: a streamed periodic sync would hide the latency
    # RDMA removes (the plan then gains nothing from it, rightly)
    per_step = tuple(c for c in STRATEGIES if c not in PERIODIC)
    without = plan(net, w, Link(rtt_s=10e-3, rate_Bps=25e9 / 8), candidates=per_step)
    assert all(s.action != "rdma" for s in without.steps)
    with_rdma = plan(net, w, Link(rtt_s=10e-3, rate_Bps=25e9 / 8, rdma=True),
                     candidates=per_step)
    step = with_rdma.steps[-1]
    assert step.action == "rdma" and step.worthwhile and step.gain > 0


def test_overlap_step_suggests_smaller_buckets_on_a_slow_link():
    pl = plan(SLOW[0], wl(), Link(), candidates=("allreduce", "fp16"))
    ov = next(s for s in pl.steps if s.action == "overlap")
    assert ov.worthwhile and ov.bucket_mb < 4


def test_periodic_step_picks_smallest_sufficient_period():
    pl = plan(SLOW[0], wl(), Link(), candidates=("allreduce", "fp16", "local"))
    per = next(s for s in pl.steps if s.action == "periodic_sync")
    assert per.worthwhile and per.strategy == "local"
    h = per.options["period"]
    o = {k: per.options[k] for k in ("period", "streaming", "delay")}
    assert predict("local", SLOW[0], wl(options={"local": o})).efficiency >= 0.95
    if h > 2:   # with half the period, no delay hides the sync well enough
        for d in range(1, h // 2):
            smaller = predict("local", SLOW[0], wl(options={"local": {
                "period": h // 2, "streaming": True, "delay": d}}))
            assert smaller.efficiency < 0.95


def test_plan_to_dict_is_json():
    pl = plan(SLOW[0], wl(), Link(rtt_s=1e-3))
    d = json.loads(json.dumps(pl.to_dict()))
    assert d["recommendation"]["strategy"] == pl.recommendation.strategy
    assert len(d["ranking"]) == len(STRATEGIES)
    assert d["workload"]["matrices"] == len(SMOL)


# --------------------------------------------------------------------------- probe input

def _probe(n=2, alpha=1e-3, bw=1.25e6, **extra):
    d = {"world_size": n, "backend": "gloo", "sweep": [],
         "pairs": [{"src": 0, "dst": 1, "latency_s": 0.5e-3, "bandwidth_Bps": bw}],
         "model": {"alpha_s": alpha, "beta_s_per_byte": 1 / bw, "bandwidth_Bps": bw,
                   "latency_s": alpha},
         "slowest_pair": {"src": 0, "dst": 1, "bandwidth_Bps": bw}}
    d.update(extra)
    return d


def test_net_from_probe_model():
    net, link = net_from_probe(_probe())
    assert (net.alpha_s, net.bandwidth_Bps, net.world_size) == (1e-3, 1.25e6, 2)
    assert link.rtt_s == pytest.approx(1e-3) and not link.rdma and link.source == "probe"
    net8, _ = net_from_probe(_probe(), world_size=8)
    assert net8.world_size == 8
    assert net_from_probe(_probe(rdma=True))[1].rdma
    # the probe's backend: gloo runs two collectives of a group at once
    assert net_from_probe({**_probe(), "backend": "gloo"})[0].lanes == 2
    assert net_from_probe({**_probe(), "backend": "nccl"})[0].lanes == 1


def test_net_from_probe_fits_the_sweep_without_a_model():
    n, a, bw = 4, 2e-4, 1e8
    sweep = [{"collective": "all_reduce", "bytes": b,
              "time_s": 2 * (n - 1) * a + 2 * (n - 1) / n * b / bw}
             for b in (4096, 65536, 1 << 20, 4 << 20)]
    net, _ = net_from_probe({"world_size": n, "sweep": sweep})
    assert net.alpha_s == pytest.approx(a, rel=1e-6)
    assert net.bandwidth_Bps == pytest.approx(bw, rel=1e-6)


@pytest.mark.parametrize("probe, field", [
    ({"world_size": 0}, "probe.world_size"),
    ({"world_size": 2}, "probe.model"),
    ({"world_size": 2, "model": {"alpha_s": "x", "bandwidth_Bps": 1}}, "probe.model.alpha_s"),
    ([], "probe"),
])
def test_bad_probe_names_the_field(probe, field):
    with pytest.raises(ConfigError) as e:
        net_from_probe(probe)
    assert e.value.field == field


def _measured(**extra):
    """A probe as the measurement builds it (no file, no validator)."""
    bw = 1.25e6
    pair = {"src": 0, "dst": 1, "latency_s": 0.5e-3, "bandwidth_Bps": bw, "max_bytes": 1 << 20}
    base = dict(world_size=2, backend="gloo", quick=True, time=1.7e9,
                ranks=({"rank": 0, "host": "a", "ifname": None, "addr": None, "mtu": None},),
                sweep=({"collective": "all_reduce", "bytes": 4096, "time_s": 1e-3},),
                pairs=(pair,), pairs_complete=False,
                model=ProbeModel(alpha_s=1e-3, beta_s_per_byte=1.0 / bw, bandwidth_Bps=bw,
                                 allreduce_alpha_s=2e-3, r2=0.99, bandwidth_from="fit"),
                slowest_pair={"src": 0, "dst": 1, "bandwidth_Bps": bw, "latency_s": 0.5e-3},
                warnings=("all_reduce 4 KiB: spread 60% of the median (noisy)",), elapsed_s=3.0)
    base.update(extra)
    return ProbeResult(**base)


def test_probe_json_keeps_the_contract():
    # the keys and their order are what `lorasync probe --json` has always written
    d = _measured().to_json()
    assert list(d) == ["world_size", "backend", "quick", "time", "ranks", "sweep", "pairs",
                       "pairs_complete", "model", "slowest_pair", "warnings", "elapsed_s"]
    assert list(d["model"]) == ["alpha_s", "beta_s_per_byte", "bandwidth_Bps", "latency_s",
                                "allreduce_alpha_s", "r2", "formula", "bandwidth_from"]
    assert d["model"]["latency_s"] == d["model"]["alpha_s"]
    assert _measured(model=None).to_json()["model"] is None
    d["pairs"][0]["latency_s"] = 9.0          # a copy: the result itself stays as measured
    assert _measured().pairs[0]["latency_s"] == 0.5e-3


def test_a_measured_probe_plans_as_its_file_does():
    res = _measured()
    text = json.dumps(res.to_json(), indent=1)
    assert res.net() == net_from_probe(json.loads(text), strict=True)
    assert res.net(8) == net_from_probe(json.loads(text), world_size=8)
    assert ProbeResult.from_json(json.loads(text)).net() == res.net()


def test_a_measured_probe_is_not_held_to_the_file_bounds():
    # auto plans from its start probe: a noisy fit (a slope near zero) must not stop the run
    res = _measured(model=ProbeModel(alpha_s=1e-5, beta_s_per_byte=1 / 5e14,
                                     bandwidth_Bps=5e14))
    assert res.net()[0].bandwidth_Bps == pytest.approx(5e14)
    with pytest.raises(ConfigError, match="probe.model.bandwidth_Bps"):
        ProbeResult.from_json(res.to_json())
    with pytest.raises(ValueError, match="no model"):
        _measured(model=None).net()


def test_probe_from_json_keeps_what_the_plan_reads():
    res = ProbeResult.from_json({**_probe(), "rdma": True, "ranks": [{"rank": 0}]})
    assert (res.world_size, res.backend, res.rdma) == (2, "gloo", True)
    assert res.model == ProbeModel(alpha_s=1e-3, beta_s_per_byte=1 / 1.25e6,
                                   bandwidth_Bps=1.25e6)
    assert res.latencies() == [0.5e-3] and res.ranks == ({"rank": 0},)
    # a probe that does not say how many ranks it measured reads as the ranks planned for
    assert ProbeResult.from_json({"model": _probe()["model"]}, world_size=4).world_size == 4


# --------------------------------------------------------------------------- units

# Rates and durations: the table for every command is in test_units.py.

def test_parse_size_and_count():
    assert parse_size("3MiB") == 3 * MiB
    assert parse_size("4MB") == 4e6
    assert parse_count("921_600") == N
    assert parse_count("0.9216M") == N
    with pytest.raises(ConfigError):
        parse_count("lots")


# --------------------------------------------------------------------------- CLI

def test_cli_what_if_table(capsys):
    assert main(["plan", "--nodes", "2", "--rate", "10mbit", "--rtt", "1ms"]) == 0
    out = capsys.readouterr().out
    assert "Recommendation:" in out and "allreduce" in out and "ceiling (no sync)" in out
    assert "Steps on this network" in out


def test_cli_json(capsys):
    assert main(["plan", "--nodes", "8", "--rate", "1gbit", "--rtt", "30ms", "--lora-r", "16",
                 "--compute-s", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["workload"]["adapter_params"] == 2 * N
    assert d["net"]["world_size"] == 8
    assert {p["strategy"] for p in d["ranking"]} == set(STRATEGIES)


def test_cli_probe_file_and_metrics(tmp_path, capsys):
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(_probe(rdma=True)))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, "rank": r, "compute_s": 9.0 if s == 1
                                             else 1.0, "samples": 2})
                                 for s in (1, 2, 3) for r in (0, 1)) + "\n")
    assert main(["plan", "--probe", str(probe), "--metrics", str(metrics), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["workload"]["compute_s"] == 1.0 and d["workload"]["batch_size"] == 2
    assert d["link"]["rdma"] is True
    assert any(s["action"] == "rdma" for s in d["steps"])


def test_cli_adapter_params_and_options(capsys):
    assert main(["plan", "--rate", "100mbit", "--rtt", "10ms", "--adapter-params", "4M",
                 "--compute-s", "0.5", "--opt", "topk.ratio=0.001", "--encode-ns", "int8=20",
                 "--strategies", "allreduce,topk,int8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["workload"]["adapter_params"] == 4_000_000
    topk = next(p for p in d["ranking"] if p["strategy"] == "topk")
    assert topk["options"]["ratio"] == 0.001
    assert len(d["ranking"]) == 3
    assert d["workload"]["head_share"] == 0.0   # no model shape behind --adapter-params


def test_cli_head_share_comes_from_the_model_unless_given(capsys):
    assert main(["plan", "--rate", "10mbit", "--compute-s", "1", "--json"]) == 0
    wl = json.loads(capsys.readouterr().out)["workload"]
    assert wl["head_share"] == pytest.approx(head_share(MODELS["smollm2-135m"]))
    assert wl["backward_share"] == 0.5
    assert main(["plan", "--rate", "10mbit", "--compute-s", "1", "--head-share", "0.3",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["head_share"] == 0.3
    assert main(["plan", "--rate", "10mbit", "--compute-s", "1"]) == 0
    assert "before any adapter gradient" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["plan"], "--probe/--rate"),
    (["plan", "--rate", "fast"], "--rate"),
    (["plan", "--rate", "10mbit", "--rtt", "30"], "--rtt"),
    (["plan", "--rate", "10mbit", "--model", "gpt-9"], "--model"),
    (["plan", "--rate", "10mbit", "--adapter-params", "1000"], "--compute-s"),
    (["plan", "--rate", "10mbit", "--strategies", "zip"], "--strategies"),
    (["plan", "--rate", "10mbit", "--opt", "topk.ratio=7"], "topk.ratio"),
    (["plan", "--rate", "10mbit", "--opt", "topk"], "--opt"),
    (["plan", "--probe", "/nonexistent/probe.json"], "--probe"),
    (["plan", "--rate", "10mbit", "--nodes", "0"], "--nodes"),
    (["plan", "--rate", "10mbit", "--head-share", "1"], "--head-share"),
    (["plan", "--rate", "10mbit", "--backward-share", "1.5"], "--backward-share"),
])
def test_cli_bad_input_exits_2_naming_the_field(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err


def test_cli_model_from_config_json(tmp_path, capsys):
    cfg = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--rate", "10mbit", "--model", str(tmp_path), "--compute-s", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["adapter_params"] == N


def test_periodic_and_lossless_sets_are_disjoint():
    assert not (PERIODIC & LOSSLESS)


def test_nodes_behind_nat_share_the_hubs_link(capsys):
    """Two NAT'd nodes reach each other through the hub, whose link then carries
    two ring legs: the what-if ring runs at half the rate (measured through
    the overlay: 4.85 against 8.69 MB/s, bench/reference/overlay/relay.json)."""
    assert main(["plan", "--nodes", "3", "--rate", "100mbit", "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)["net"]["bandwidth_Bps"]
    assert main(["plan", "--nodes", "3", "--rate", "100mbit", "--behind-nat", "2", "--json"]) == 0
    relayed = json.loads(capsys.readouterr().out)
    assert relayed["net"]["bandwidth_Bps"] == pytest.approx(direct / 2)
    assert any("behind NAT" in n for n in relayed["input_notes"])
    assert main(["plan", "--nodes", "3", "--rate", "100mbit", "--behind-nat", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["net"]["bandwidth_Bps"] == pytest.approx(direct)
    assert main(["plan", "--nodes", "3", "--rate", "100mbit", "--behind-nat", "3"]) == 2


def _plan_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


REGIONS = ["--nodes", "16", "--ranks-per-node", "8", "--rate", "10gbit", "--rtt", "40ms",
           "--intra-rate", "1200gbit", "--intra-latency", "5us", "--compute-s", "0.52",
           "--model", "llama-3-8b", "--lora-r", "16", "--lora-targets", "q,k,v,o,gate,up,down",
           "--batch-size", "4", "--backend", "nccl"]


def test_recommendation_ends_where_the_steps_end(capsys):
    """16 x 8 GPUs across regions: plain DDP is latency-bound (TCP tuning gains
    it 0.2%), the periodic sync the steps end on is bandwidth-bound (it gains
    85%): TCP tuning is judged for the latter, and the ranking and the
    recommendation assume the worthwhile steps, so they match the last step."""
    pl = _plan_json(capsys, *REGIONS)
    todo = [s for s in pl["steps"] if s["worthwhile"]]
    assert todo[0]["action"] == "tcp_tuning" and todo[0]["gain"] > 0.5
    assert "where the steps end" in todo[0]["detail"]
    rec = pl["recommendation"]["prediction"]
    assert rec["samples_per_s"] == pytest.approx(todo[-1]["samples_per_s_after"], rel=1e-6)
    assert any(w.startswith("TCP buffers raised") for w in pl["ranked_with"])


def test_a_step_not_worth_it_is_not_taken(capsys):
    """4 x 8 V100 on InfiniBand: allreduce reaches 99.7% of the ceiling; local
    SGD would gain nothing and is listed as not worth it, so the ranking keeps
    every strategy's defaults and the recommendation stays allreduce."""
    pl = _plan_json(capsys, "--nodes", "4", "--ranks-per-node", "8", "--rate", "100gbit",
                    "--rtt", "10us", "--rdma", *REGIONS[8:12], "--compute-s", "1.5",
                    *REGIONS[14:])
    assert not any(s["worthwhile"] for s in pl["steps"])
    per = next(s for s in pl["steps"] if s["action"] == "periodic_sync")
    assert "beat allreduce" in per["detail"]
    assert pl["ranked_with"] == [] and pl["recommendation"]["strategy"] == "allreduce"
    local = next(p for p in pl["ranking"] if p["strategy"] == "local")
    assert local["options"]["period"] == 8   # the default, not the untaken step's 32


# --------------------------------------------------------------------------- hiding outer syncs

from lorasync.plan.periodic import HIDE_MARGIN, hide_sync, margin_net, tune_periodic  # noqa: E402

VARIANTS = [{"delta_dtype": "fp16"}, {"delta_dtype": "int8"}, {"delta_dtype": "int4"},
            {"delta_dtype": "int4", "delta_topk": 0.03}]


def _dl(**opts):
    return wl(options={"diloco": opts})


@pytest.mark.parametrize("mbit", [1, 3, 10, 100])
@pytest.mark.parametrize("variant", VARIANTS)
def test_hide_sync_takes_the_fewest_steps_late_then_the_fewest_fragments(mbit, variant):
    x = what_if_net(2, mbit * 1e6 / 8, 1e-3)
    slow = margin_net(x)      # hidden means: hidden on a link HIDE_MARGIN times slower
    assert slow.bandwidth_Bps == pytest.approx(x.bandwidth_Bps / HIDE_MARGIN)
    opts, p = hide_sync(x, _dl(**variant))
    assert opts["streaming"] and opts["delta_dtype"] == variant["delta_dtype"]
    o = {k: opts[k] for k in ("delay", "fragments")}
    chosen = _dl(**variant, streaming=True, **o)
    assert p.step_s == pytest.approx(predict("diloco", x, chosen).step_s)   # on x itself
    def hides(net, d, f):
        q = predict("diloco", net, _dl(**variant, streaming=True, delay=d, fragments=f))
        return q.exposed_comm_s <= 0.005 * q.compute_s

    choices = [(d, f) for d in range(1, 8) for f in (1, 2, 4, 8)]
    earlier = [c for c in choices if c < (o["delay"], o["fragments"])]
    if hides(slow, *o.values()):
        # nothing with fewer steps late hides it there, nor fewer fragments at this delay
        assert not any(hides(slow, *c) for c in earlier), o
    elif hides(x, *o.values()):
        # nothing hides it with the margin: the first choice hidden without
        assert not any(hides(slow, *c) for c in choices), o
        assert not any(hides(x, *c) for c in earlier), o
    else:   # the link cannot carry one sync a period: the least exposure
        assert not any(hides(x, *c) for c in choices), o
        for d, f in choices:
            q = predict("diloco", x, _dl(**variant, streaming=True, delay=d, fragments=f))
            assert q.step_s >= p.step_s - 1e-9


def test_hide_sync_leaves_a_margin(monkeypatch):
    # 1 Mbit/s, 5 s of compute a step: int8 in 2 fragments, 1 step late, hides on the
    # link as modelled, with little to spare; on a link HIDE_MARGIN times slower it
    # would not, so 4 fragments are taken
    import lorasync.plan.periodic as periodic

    x, w = what_if_net(2, 1e6 / 8, 1e-3), wl(compute_s=5.0, options={"diloco": {
        "delta_dtype": "int8"}})
    opts, p = hide_sync(x, w)
    assert (opts["delay"], opts["fragments"]) == (1, 4) and p.exposed_comm_s == 0
    two = _dl(delta_dtype="int8", streaming=True, delay=1, fragments=2)
    two = wl(compute_s=5.0, options=two.options)
    assert predict("diloco", x, two).exposed_comm_s <= 0.005 * 5.0
    assert predict("diloco", margin_net(x), two).exposed_comm_s > 0.005 * 5.0
    monkeypatch.setattr(periodic, "HIDE_MARGIN", 1.0)     # no margin: 2 fragments do
    opts, _ = hide_sync(x, w)
    assert (opts["delay"], opts["fragments"]) == (1, 2)
    # a link the margin's slower copy cannot keep up with: hidden as modelled still counts
    monkeypatch.setattr(periodic, "HIDE_MARGIN", 50.0)
    opts, p = hide_sync(x, w)
    assert opts["delay"] == 1 and p.exposed_comm_s <= 0.005 * 5.0


def test_hide_sync_keeps_what_was_given():
    x = what_if_net(2, 1e6 / 8, 1e-3)
    opts, _ = hide_sync(x, _dl(delta_dtype="int8", fragments=2), fixed={"fragments"})
    assert opts["fragments"] == 2 and opts["delay"] == 4     # 2 x 4.2 s: 4 steps of 1.25 s
    opts, p = hide_sync(x, _dl(delta_dtype="int8", streaming=False), fixed={"streaming"})
    assert not opts["streaming"] and p.exposed_comm_s > 0
    opts, _ = hide_sync(x, _dl(delta_dtype="int8", period=1))   # too short to stream
    assert not opts["streaming"]


def test_tune_periodic_picks_the_least_lossy_variant_that_keeps_up():
    slow = what_if_net(2, 1.3e6 / 8, 1e-3)      # 1.3 Mbit/s: fp16 cannot keep up, int8 can
    opts, p, i = tune_periodic(slow, wl(), "diloco", VARIANTS)
    assert i == 1 and opts["delta_dtype"] == "int8" and p.efficiency > 0.98
    # 1 Mbit/s: int8 keeps up only with no room to spare, int4 with it
    assert tune_periodic(what_if_net(2, 1e6 / 8, 1e-3), wl(), "diloco", VARIANTS)[2] == 2
    fast = what_if_net(2, 10e6 / 8, 1e-3)       # 10 Mbit/s: fp16 in 2 fragments, 1 step late
    opts, p, i = tune_periodic(fast, wl(), "diloco", VARIANTS)
    assert (i, opts["fragments"], opts["delay"]) == (0, 2, 1) and p.efficiency > 0.98
    # a measured encode cost counts: int8 priced far above the others loses to int4
    opts, _, i = tune_periodic(slow, wl(), "diloco", VARIANTS, encode_ns=[None, 400.0, None, None])
    assert i == 2
    with pytest.raises(ConfigError):
        tune_periodic(slow, wl(), "diloco", [])


def test_tune_periodic_prefers_a_variant_that_hides_with_the_margin():
    # a link on which fp16 keeps up only with no room to spare (its outer
    # sync fills ~90% of a period's compute): it hides on the link as
    # measured, not on one HIDE_MARGIN times slower; int8 hides on both
    x = what_if_net(2, 1.76e6 / 8, 1e-3)
    fp16, p16 = hide_sync(x, _dl(delta_dtype="fp16"))
    assert p16.exposed_comm_s <= 0.005 * p16.compute_s          # hidden as measured
    m16 = predict("diloco", margin_net(x), _dl(**fp16))
    assert m16.exposed_comm_s > 0.05 * m16.compute_s           # not with the margin
    opts, p, i = tune_periodic(x, wl(), "diloco", VARIANTS)
    assert i == 1 and opts["delta_dtype"] == "int8"
    assert p.samples_per_s == pytest.approx(p16.samples_per_s, rel=0.01)  # a tie as measured



@pytest.mark.parametrize("mbit", [1, 10])
def test_plan_streams_the_periodic_sync_and_compresses_it_before_lengthening_the_period(mbit):
    x = what_if_net(2, mbit * 1e6 / 8, 1e-3)
    pl = plan(x, wl(), Link())
    per = next(s for s in pl.steps if s.action == "periodic_sync")
    assert per.strategy in PERIODIC and per.options["streaming"]
    p = predict(per.strategy, x, wl(options={per.strategy: {k: v for k, v in per.options.items()
                                                            if k in ("period", "streaming",
                                                                     "delay", "fragments",
                                                                     "delta_dtype",
                                                                     "delta_topk")}}))
    assert p.efficiency >= 0.95 and p.exposed_comm_s <= 0.005 * p.compute_s
    if mbit == 1:   # fp32 would need 32 local steps: a compressed outer sync at 8 instead
        assert per.strategy == "diloco" and per.options["period"] == 8
        assert per.options["delta_dtype"] != "fp32" and "compressed" in per.detail
    else:           # fp32 every 4 steps, streamed, is enough
        assert per.options["period"] <= 8
    given = plan(x, wl(options={"diloco": {"delta_dtype": "fp16"}}), Link(),
                 candidates=("allreduce", "fp16", "diloco"))
    per = next(s for s in given.steps if s.action == "periodic_sync")
    assert per.options["delta_dtype"] == "fp16"   # a codec the user chose stays


def test_tune_periodic_takes_each_variant_as_given():
    # the workload's options (a sparse variant in use) do not leak into the others
    slow = what_if_net(2, 1e6 / 8, 1e-3)
    w = wl(options={"diloco": {"delta_dtype": "int4", "delta_topk": 0.03, "fragments": 2}})
    opts, _, i = tune_periodic(slow, w, "diloco", [{"delta_dtype": "int8"}])
    assert (i, opts["delta_dtype"], opts["delta_topk"]) == (0, "int8", 1.0)


def test_tune_periodic_takes_the_2_bit_sparse_variant_only_where_the_others_fall_behind():
    # issue 33: SparseLoCo's outer sync (1% of the delta, 2-bit values) as a variant
    sparse = [*VARIANTS, {"delta_dtype": "int2", "delta_topk": 0.01}]
    slow = what_if_net(2, 1.3e6 / 8, 1e-3)      # int8 keeps up: the least lossy still wins
    assert tune_periodic(slow, wl(), "diloco", sparse)[2] == 1
    # 30 kbit/s: 3% top-k with int4 values cannot keep up; 1% with int2 ones can
    thin = what_if_net(2, 30e3 / 8, 1e-3)
    _, p4 = hide_sync(thin, _dl(delta_dtype="int4", delta_topk=0.03))
    opts, p, i = tune_periodic(thin, wl(), "diloco", sparse)
    assert (i, opts["delta_dtype"], opts["delta_topk"]) == (4, "int2", 0.01)
    assert p.samples_per_s > p4.samples_per_s * 1.05


def test_nodes_on_the_tcp_path_are_relayed_by_the_hub_and_priced(capsys):
    """A node on the overlay's SSH path reaches every other node through the
    hub: on 3 nodes the leg node1 -> node2 loads the hub's link too (half the
    rate), and the rate is scaled by what the SSH path kept of the direct link
    (bench/reference/connectivity/throughput.json).  On 2 nodes nothing is
    relayed (every leg ends at the hub); node 0 cannot be the TCP node."""
    from lorasync.plan.cli import TCP_PATH_SHARE

    assert main(["plan", "--nodes", "3", "--rate", "100mbit", "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)["net"]["bandwidth_Bps"]
    assert main(["plan", "--nodes", "3", "--rate", "100mbit", "--tcp-nodes", "1", "--json"]) == 0
    tcp = json.loads(capsys.readouterr().out)
    assert tcp["net"]["bandwidth_Bps"] == pytest.approx(direct / 2 * TCP_PATH_SHARE)
    assert any("TCP path" in n for n in tcp["input_notes"])
    assert main(["plan", "--nodes", "2", "--rate", "100mbit", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)["net"]["bandwidth_Bps"]
    assert main(["plan", "--nodes", "2", "--rate", "100mbit", "--tcp-nodes", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["net"]["bandwidth_Bps"] == \
        pytest.approx(two * TCP_PATH_SHARE)
    assert main(["plan", "--nodes", "2", "--rate", "100mbit", "--tcp-nodes", "2"]) == 2
    assert "--tcp-nodes" in capsys.readouterr().err


def test_the_measured_tcp_share_is_the_committed_one():
    from lorasync.plan.cli import TCP_PATH_SHARE

    ref = json.loads((Path(__file__).resolve().parents[2] / "bench" / "reference"
                      / "connectivity" / "throughput.json").read_text())
    ssh = next(r for r in ref["rows"] if r["kind"] == "ssh")
    assert TCP_PATH_SHARE == pytest.approx(ssh["busbw_share"], abs=0.005)
