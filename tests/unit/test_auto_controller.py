"""auto's policy (lorasync.plan.policy): measurements in, decisions out.

No process group: probe timings, windows and link changes are synthetic.
The strategy itself (hooks, switches, resume) is tested in tests/dist/test_auto.py.
"""

from __future__ import annotations

import math

import pytest

from lorasync.plan.linkfit import allreduce_model, passive_bandwidth
from lorasync.plan import policy as A
from lorasync.plan.costmodel import MODELS, Net, encode_ns, lora_matrices, predict

N = 921_600                       # SmolLM2-135M + LoRA r=8 on q/k/v/o
SMOL = lora_matrices(MODELS["smollm2-135m"], 8)
COMPUTE = 1.3                     # s per step, as measured on this machine
MB100, MB10 = 100e6 / 8 * 0.93, 10e6 / 8 * 0.93


def wl(compute=COMPUTE, **kw):
    return A.workload_for(N, compute, bucket_sizes=[262_144, 262_144, 262_144, 134_656],
                          matrices=SMOL, batch_size=4, **kw)


def timings(bw, alpha, n=2, small=A.SMALL_PROBE_BYTES, large=A.MIN_PROBE_BYTES):
    """What a ring all-reduce of each probe size takes on this link."""
    f = 2 * (n - 1) / n
    return (2 * (n - 1) * alpha + f * small / bw, 2 * (n - 1) * alpha + f * large / bw)


def probed(ts, tl, n=2):
    """The Net auto's live probe (1 KiB three times, one large) fits from these timings."""
    m = allreduce_model([A.SMALL_PROBE_BYTES, A.MIN_PROBE_BYTES], [ts, tl], n)
    return Net(alpha_s=m.alpha_s, bandwidth_Bps=m.bandwidth_Bps, world_size=n)


# --------------------------------------------------------------------------- probe fit

@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("bw,alpha", [(MB10, 2e-4), (MB100, 5e-5), (1.1e8, 1e-3)])
def test_live_probe_recovers_alpha_and_bandwidth(n, bw, alpha):
    net = probed(*timings(bw, alpha, n), n)
    assert net.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert net.bandwidth_Bps == pytest.approx(bw, rel=1e-6)


def test_probe_size_and_cadence_follow_the_budget():
    # slow link: never below 256 KiB (a shaper's burst would flatter it)
    assert A.probe_size(MB10) == A.MIN_PROBE_BYTES
    assert A.probe_size(MB100) == A.MIN_PROBE_BYTES          # 22 ms there
    # 1 Gbit/s: ~20 ms is 2.3 MB -> 2 MiB (a power of two)
    assert A.probe_size(1e9 / 8 * 0.93) == 1 << 21
    assert A.probe_size(1e10) == A.MAX_PROBE_BYTES
    # a 0.22 s probe every 10 steps of 1.3 s would be 1.7%: every second window
    assert A.probe_every(0.22, COMPUTE, 10) == 2
    assert A.probe_every(0.01, COMPUTE, 10) == 1
    # tiny steps: rarely (a drift still triggers one at once)
    assert A.probe_every(0.22, 0.02, 10) == 110


# --------------------------------------------------------------------------- decisions

def test_first_choice_prefers_lossless_within_5_percent():
    # 75 Mbit/s (what the 100 Mbit/s + 20 ms link probes at): top-k is
    # predicted fastest, fp16 less than 1% behind it
    net = Net(alpha_s=2e-4, bandwidth_Bps=75e6 / 8, world_size=2)
    d = A.decide(net, wl(), None, A.DEFAULT_CANDIDATES)
    best = d.ranking[0]
    assert d.switch
    assert d.prediction.lossless and not best.lossless
    assert d.prediction.samples_per_s >= 0.95 * best.samples_per_s
    assert "lossless" in d.rule


def test_first_choice_on_a_slow_link_is_a_compressor():
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB10, world_size=2)
    d = A.decide(net, wl(), None, A.DEFAULT_CANDIDATES)
    assert d.strategy in ("topk", "onebit", "int8", "powersgd")
    assert d.prediction.samples_per_s == max(p.samples_per_s for p in d.ranking)


def test_candidates_restrict_the_choice():
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB10, world_size=2)
    d = A.decide(net, wl(), None, ("allreduce", "fp16"))
    assert d.strategy == "fp16"


def test_routine_reevaluation_keeps_current_unless_gain_exceeds_margin():
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)
    w = wl()
    ranking = {p.strategy: p for p in A.decide(net, w, None, A.DEFAULT_CANDIDATES).ranking}
    # topk in use, the lossless pick is better by less than 10%: stay (no flapping)
    d = A.decide(net, w, "topk", A.DEFAULT_CANDIDATES)
    assert not d.switch and d.strategy == "topk" and d.rule.startswith("keep topk")
    # a fresh decision (the link changed) takes the planner's pick
    f = A.decide(net, w, "topk", A.DEFAULT_CANDIDATES, fresh=True)
    assert f.switch and f.strategy == A.decide(net, w, None, A.DEFAULT_CANDIDATES).strategy
    # allreduce in use on a 10 Mbit/s link: the compressors gain far more than 10%
    slow = Net(alpha_s=2e-4, bandwidth_Bps=MB10, world_size=2)
    s = A.decide(slow, w, "allreduce", A.DEFAULT_CANDIDATES)
    assert s.switch and s.strategy != "allreduce"
    assert s.prediction.samples_per_s > 1.1 * s.current.samples_per_s
    assert ranking  # ranking is complete
    assert {p.strategy for p in s.ranking} == set(A.DEFAULT_CANDIDATES)


def test_hysteresis_does_not_flap_on_noisy_measurements():
    """Bandwidth and compute jitter +-15% around a point where two strategies
    are close: routine re-evaluations switch at most once."""
    import random

    rng = random.Random(0)
    cur = A.decide(Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2), wl(), None,
                   A.DEFAULT_CANDIDATES).strategy
    switches = 0
    for _ in range(200):
        net = Net(alpha_s=2e-4 * rng.uniform(0.85, 1.15),
                  bandwidth_Bps=MB100 * rng.uniform(0.85, 1.15), world_size=2)
        d = A.decide(net, wl(COMPUTE * rng.uniform(0.85, 1.15)), cur, A.DEFAULT_CANDIDATES)
        if d.switch:
            switches += 1
            cur = d.strategy
    assert switches <= 1


def test_current_outside_candidates_is_always_left():
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)
    d = A.decide(net, wl(), "bf16", ("allreduce", "fp16"))
    assert d.switch and d.strategy in ("allreduce", "fp16")


# --------------------------------------------------------------------------- change detection

def test_network_change_detected_from_synthetic_timings():
    """100 Mbit/s -> 10 Mbit/s: the step time of the strategy in use drifts,
    the probe timings give the new link, the decision changes, the reason
    names the bandwidth."""
    n = 2
    before = probed(*timings(MB100, 2e-4), n)
    first = A.decide(before, wl(), None, A.DEFAULT_CANDIDATES)
    p = first.prediction
    # a window on the old link: time beyond compute as predicted, no drift
    assert not A.drifted(p.step_s - p.compute_s, p.step_s - p.compute_s, p.step_s)
    # the link is cut: the same strategy now costs what the model says for 10 Mbit/s
    cut = Net(alpha_s=2e-4, bandwidth_Bps=MB10, world_size=n)
    on_cut = predict(first.strategy, cut, wl())
    assert A.drifted(on_cut.step_s - on_cut.compute_s, p.step_s - p.compute_s, p.step_s)
    after = probed(*timings(MB10, 2e-4), n)
    assert A.link_changed(before, after, N, p.step_s)
    d = A.decide(after, wl(), first.strategy, A.DEFAULT_CANDIDATES, fresh=True)
    assert d.switch and d.strategy != first.strategy
    assert d.prediction.samples_per_s > 1.2 * d.current.samples_per_s
    reason = A.describe(d, after, COMPUTE, previous=before)
    assert "bandwidth" in reason and "->" in reason and d.strategy in reason
    # and back up: the lossless choice returns
    back = A.decide(before, wl(), d.strategy, A.DEFAULT_CANDIDATES,
                    fresh=A.link_changed(after, before, N, p.step_s))
    assert back.strategy == first.strategy


def test_a_tenfold_cut_from_1gbit_is_a_link_change():
    # 0.27 s more for an fp32 sync of the adapter on a 1.4 s step: about 20%
    g = Net(alpha_s=1e-4, bandwidth_Bps=123e6, world_size=2)
    assert A.link_changed(g, Net(alpha_s=1e-4, bandwidth_Bps=12.3e6, world_size=2), N, 1.4)


def test_a_lossless_strategy_far_behind_the_fastest_does_not_stay_for_a_small_gain():
    """1 Gbit/s cut to 100 Mbit/s with allreduce in use: fp16 (the lossless
    pick) gains less than the switch margin over it, DiLoCo more; auto takes
    the pick rather than staying."""
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)
    opts = {"diloco": {"streaming": True, "delta_dtype": "fp16"}}
    cands = ("allreduce", "fp16", "diloco")
    extra = {"allreduce": 0.08, "fp16": 0.04, "diloco": 0.0}
    w = wl(1.30, options=opts, extra_s=extra)
    rank = {p.strategy: p for p in A.decide(net, w, None, cands).ranking}
    assert rank["diloco"].samples_per_s > 1.05 * rank["allreduce"].samples_per_s
    assert rank["fp16"].samples_per_s < 1.05 * rank["allreduce"].samples_per_s
    d = A.decide(net, w, "allreduce", cands)
    assert d.switch and d.strategy == A.decide(net, w, None, cands).strategy != "allreduce"
    # the pick (fp16, 2% faster) and the fastest within the margin: it stays
    close = wl(1.30, options=opts, extra_s={"allreduce": 0.0, "fp16": 0.0, "diloco": 0.05})
    assert A.decide(net, close, None, cands).strategy == "fp16"
    assert not A.decide(net, close, "allreduce", cands).switch


def test_link_changed_ignores_noise_and_irrelevant_fast_links():
    a = Net(alpha_s=1e-4, bandwidth_Bps=MB100, world_size=2)
    assert not A.link_changed(a, Net(alpha_s=1e-4, bandwidth_Bps=MB100 * 1.3, world_size=2),
                              N, COMPUTE)
    # 1 GB/s vs 300 MB/s: 3x, but the adapter's sync moves by ~8 ms of a 1.3 s step
    assert not A.link_changed(Net(alpha_s=1e-4, bandwidth_Bps=1e9, world_size=2),
                              Net(alpha_s=1e-4, bandwidth_Bps=3e8, world_size=2), N, COMPUTE)


def test_drift_tolerance_is_looser_before_calibration():
    assert A.drifted(0.5, 0.1, 1.4, calibrated=True)
    assert not A.drifted(0.5, 0.1, 1.4, calibrated=False)
    assert A.drifted(0.9, 0.1, 1.4, calibrated=False)
    # a few ms of jitter on tiny steps never counts
    assert not A.drifted(0.0025, 0.001, 0.005)


# --------------------------------------------------------------------------- calibration

def test_load_common_to_all_strategies_does_not_change_the_choice():
    """A busy host adds the same seconds to every step: measured on a strategy
    that hides little, it is fitted as the base, charged to every strategy,
    and the pick stays.  (topk at ratio 0.01, which hides almost nothing behind
    backward: the measured extra is then clearly base, not exposed sync.)"""
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB10, world_size=2)
    sparse = {"topk": {"ratio": 0.01}}
    plain = wl(options=sparse)
    hidden = {n: A.hidden_of(predict(n, net, plain)) for n in A.DEFAULT_CANDIDATES}
    quiet = A.decide(net, plain, None, A.DEFAULT_CANDIDATES).strategy
    cur = predict(quiet, net, plain)
    extra = 0.6   # waiting on a rank the host starved, every step
    base, exposed = A.split_extra(extra, A.hidden_of(cur), cur.step_s + extra, 0.0, 0.5)
    assert base >= extra - A.hidden_of(cur) - 1e-9   # (almost) all of it is base
    busy = A.workload_for(N, COMPUTE, bucket_sizes=[262_144, 262_144, 262_144, 134_656],
                          matrices=SMOL, batch_size=4, options=sparse,
                          extra_s=A.corrections(A.DEFAULT_CANDIDATES, hidden, base, exposed))
    d = A.decide(net, busy, quiet, A.DEFAULT_CANDIDATES)
    assert not d.switch and d.strategy == quiet


def test_measured_extra_cost_is_charged_to_the_strategy():
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)
    plain = predict("fp16", net, wl())
    slow = predict("fp16", net, wl(extra_s={"fp16": 0.2}))
    assert slow.step_s == pytest.approx(plain.step_s + 0.2, rel=1e-6)
    # periodic: the extra per step is spread over the period's syncs
    assert A.encode_ns_for("local", {"period": 8}, 0.1, N) == pytest.approx(
        encode_ns("local") + 0.1 * 1e9 * 8 / N)
    assert A.encode_ns_for("powersgd", {"rank": 2}, -1.0, N) == 0.0   # never negative


def test_corrections_are_the_base_plus_each_strategys_exposed_share():
    hidden = {"allreduce": 0.3, "fp16": 0.15, "topk": 0.01, "local": 0.0}
    got = A.corrections(list(hidden), hidden, base_s=0.03, exposed=1.0)
    assert got == pytest.approx({"allreduce": 0.33, "fp16": 0.18, "topk": 0.04, "local": 0.03})
    assert A.corrections(["topk"], {"topk": 0.01}) == {"topk": 0.0}


def test_inflation_is_what_backward_lost_to_collectives_run_inside_it():
    # 100 Mbit/s, fp16 with 1 MB buckets: 1.30 s quiet, 1.39 s with collectives inside
    assert A.inflation(1.39, 1.30) == pytest.approx(0.09)
    assert A.inflation(1.31, 1.30) == 0.0     # 1%: noise
    assert A.inflation(1.25, 1.30) == 0.0     # faster: nothing


def test_charging_the_inflation_turns_a_close_lossless_call_into_diloco():
    """What the quiet reference changes at 100 Mbit/s: from its own (inflated)
    compute fp16 looks within 5% of DiLoCo; with the quiet compute and the
    inflation charged to the per-step strategy, DiLoCo wins by more than 5%."""
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)
    cands = ("fp16", "diloco")
    opts = {"diloco": {"streaming": True, "delta_dtype": "fp16"}}
    assert A.decide(net, wl(1.39, options=opts), None, cands).strategy == "fp16"
    charged = wl(1.30, options=opts, extra_s={"fp16": A.inflation(1.39, 1.30), "diloco": 0.0})
    assert A.decide(net, charged, None, cands).strategy == "diloco"


def test_hidden_time_is_what_the_model_overlaps():
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)
    ar = predict("allreduce", net, wl())
    assert A.hidden_of(ar) == pytest.approx(ar.comm_s - ar.exposed_comm_s)
    assert A.hidden_of(ar) > 0.5 * ar.comm_s          # 4 buckets: most of it overlaps
    assert A.hidden_of(predict("local", net, wl())) == 0.0   # after the step: nothing hidden


def test_split_extra_separates_exposed_transfer_from_per_step_overhead():
    # 0.3 s the model hid, 0.33 s extra -> none of it hidden, + 0.03 base
    assert A.split_extra(0.33, 0.3, 3.0, 0.0, 0.5) == pytest.approx((0.03, 1.0))
    # half of it exposed
    assert A.split_extra(0.15, 0.3, 3.0, 0.0, 0.5) == pytest.approx((0.0, 0.5))
    # a strategy with hardly anything hidden (topk) only tells the base
    assert A.split_extra(0.02, 0.01, 3.0, 0.03, 0.5) == pytest.approx((0.015, 0.5))
    # faster than the base: all hidden, lower base
    assert A.split_extra(0.01, 0.3, 3.0, 0.03, 0.5) == pytest.approx((0.01, 0.0))


def test_fp16_is_not_charged_allreduces_exposed_transfer():
    """allreduce ran on 100 Mbit/s and nothing the model hid was hidden: fp16
    (half the bytes) is charged about half, topk (a fifth) a fifth."""
    net = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)
    plain = wl()
    hidden = {n: A.hidden_of(predict(n, net, plain)) for n in A.DEFAULT_CANDIDATES}
    ar = predict("allreduce", net, plain)
    extra = hidden["allreduce"]                        # fully exposed
    base, exposed = A.split_extra(extra, hidden["allreduce"], ar.step_s, 0.0, 0.5)
    assert (base, exposed) == pytest.approx((0.0, 1.0))
    pri = A.corrections(A.DEFAULT_CANDIDATES, hidden, base, exposed)
    assert pri["allreduce"] == pytest.approx(extra)
    # in proportion to the bytes: topk at its default ratio 0.1 sends a fifth
    assert pri["fp16"] < 0.6 * pri["allreduce"] and pri["topk"] < 0.25 * pri["allreduce"]
    assert pri["local"] == 0.0
    # with it, fp16 is predicted slower than before, by what it hides
    f = predict("fp16", net, A.workload_for(N, COMPUTE, matrices=SMOL, extra_s=pri,
                                            bucket_sizes=[262_144, 262_144, 262_144, 134_656]))
    assert f.step_s == pytest.approx(predict("fp16", net, plain).step_s + pri["fp16"], rel=1e-6)


def test_workload_from_bucket_sizes():
    w = A.workload_for(1000, 0.5, bucket_sizes=[100, 400, 400, 100])
    assert w.bucket_bytes == 1600 and w.first_bucket_bytes == 400
    w = A.workload_for(1000, 0.5, bucket_cap_bytes=1 << 20)
    assert w.bucket_bytes == 1 << 20 and w.first_bucket_bytes is None


def test_head_share_of_a_live_peft_model_counts_frozen_linears_only():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, tie_word_embeddings=False)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    head = 64 * 16
    layer = 16 * 16 + 16 * 8 + 16 * 8 + 16 * 16 + 3 * 16 * 32   # q k v o gate up down
    from lorasync.comm.auto import module_head_share

    assert module_head_share(model) == pytest.approx(head / (head + 2 * layer))
    assert A.workload_for(N, 1.0, head_share=0.25).head_share == 0.25
    # no output embedding: nothing known comes before the adapter's gradients
    assert module_head_share(torch.nn.Sequential(torch.nn.Linear(4, 4))) == 0.0


# --------------------------------------------------------------------------- accumulation

def test_accum_goes_up_when_sync_bound_and_back_down():
    # 1.3 s compute, 1.6 s sync at accum 1: 45% computing -> enough micro-batches for 90%
    up = A.suggest_accum(1, 1.3, 1.6, max_accum=64)
    assert up == math.ceil(9 * 1.6 / 1.3)
    assert up * 1.3 / (up * 1.3 + 1.6) >= 0.9
    # the sync becomes cheap (the link recovered): back down to the fewest that reach 90%
    assert A.suggest_accum(up, up * 1.3, 0.05, max_accum=64) == 1
    # bounded by the user's range
    assert A.suggest_accum(1, 1.3, 1.6, max_accum=4) == 4
    assert A.suggest_accum(8, 8 * 1.3, 0.0, max_accum=16, min_accum=2) == 2
    assert A.suggest_accum(1, 1.3, 0.0, max_accum=16, min_accum=2) == 2


def test_accum_is_stable_near_the_target():
    # 88% computing: within the slack, no change either way
    c = 1.3
    assert A.suggest_accum(3, 3 * c, 3 * c * (1 / 0.88 - 1), max_accum=16) == 3
    assert A.suggest_accum(3, 3 * c, 3 * c * (1 / 0.93 - 1), max_accum=16) == 3
    # following the advice reaches a fixed point
    a = 1
    for _ in range(5):
        a = A.suggest_accum(a, a * c, 2.0, max_accum=64)
    assert a == A.suggest_accum(a, a * c, 2.0, max_accum=64)


@pytest.mark.parametrize("kw", [dict(current=0), dict(max_accum=0), dict(min_accum=5, max_accum=4),
                                dict(target=1.0)])
def test_accum_rejects_bad_arguments(kw):
    args = dict(current=1, compute_s=1.0, overhead_s=1.0, max_accum=8)
    args.update(kw)
    with pytest.raises(ValueError):
        A.suggest_accum(**args)


# --------------------------------------------------------------------------- options

def test_parse_candidates_and_force():
    assert A.parse_candidates("allreduce, topk") == ("allreduce", "topk")
    assert A.parse_candidates(["fp16"]) == ("fp16",)
    assert A.parse_force("10:int8,20:allreduce") == {10: "int8", 20: "allreduce"}
    assert A.parse_force({5: "local"}) == {5: "local"}
    assert A.parse_force("") == {}


@pytest.mark.parametrize("value,word", [("", "empty"), ("allreduce,bogus", "bogus"),
                                        ("auto", "auto"), ("fp16,fp16", "twice"),
                                        (3, "comma")])
def test_parse_candidates_errors_name_the_problem(value, word):
    with pytest.raises(ValueError, match=word):
        A.parse_candidates(value)


@pytest.mark.parametrize("value", ["10", "x:int8", "0:int8", "5:bogus"])
def test_parse_force_errors(value):
    with pytest.raises(ValueError, match="force_switch_at"):
        A.parse_force(value)


def test_auto_is_a_registered_strategy():
    from lorasync.comm import strategy_names

    assert "auto" in strategy_names()


# --------------------------------------------------------------------------- slow links

def test_passive_bandwidth_from_the_syncs_auto_already_makes():
    bw, alpha = 125e3, 2e-3          # 1 Mbit/s
    fp16 = 2.0 * N                   # an fp16 outer all-reduce: (n-1)/n x 2 x payload on the path
    t = 2 * alpha + fp16 / bw
    assert passive_bandwidth([("all_reduce", fp16, t)], 2, alpha) == pytest.approx(bw)
    # an all-gather of P per rank: (n-1) P on the path, as the cost model counts it
    t3 = 2 * alpha + 2 * 300_000 / bw
    assert passive_bandwidth([("all_gather", 300_000, t3)], 3, alpha) == pytest.approx(bw)
    # the fastest transfer counts (the others waited for a late rank, or shared the CPU)
    got = passive_bandwidth([("all_reduce", fp16, 3 * t), ("all_reduce", fp16, t)], 2, alpha)
    assert got == pytest.approx(bw)
    # too small to tell (a shaper's burst flatters it), or nothing at all: no figure
    assert passive_bandwidth([("all_gather", 70_000, 0.6)], 2, alpha) == 0.0
    assert passive_bandwidth([], 2, alpha) == 0.0
    assert passive_bandwidth([("all_reduce", 1e6, alpha)], 2, alpha) == 0.0


def test_diloco_variants_parse_in_order_and_are_checked():
    assert A.parse_variants("fp16, int8,int4@0.03") == [
        {"delta_dtype": "fp16"}, {"delta_dtype": "int8"},
        {"delta_dtype": "int4", "delta_topk": 0.03}]
    # SparseLoCo's outer sync is a variant a user may offer auto
    assert A.parse_variants("int4@0.03,int2@0.01") == [
        {"delta_dtype": "int4", "delta_topk": 0.03}, {"delta_dtype": "int2", "delta_topk": 0.01}]
    for bad, needle in (("int3", "delta_dtype"), ("int4@x", "DTYPE@RATIO"),
                        ("int4@2", "delta_topk"), ("fp16,fp16", "twice"), ("", "empty")):
        with pytest.raises(ValueError, match=needle):
            A.parse_variants(bad)
    # the default: every one of them parses
    from lorasync import catalog
    assert len(A.parse_variants(catalog.AutoOptions().diloco_variants)) >= 2


def test_probe_cost_sets_how_rarely_a_slow_link_is_probed():
    slow, fast = Net(2e-3, 125e3, 2), Net(1e-4, MB100, 2)
    assert A.probe_cost(slow) == pytest.approx(3 * (2 * 2e-3 + 1024 / 125e3)
                                               + 2 * 2e-3 + A.MIN_PROBE_BYTES / 125e3)
    assert A.probe_cost(None) == 0.0
    # 2 s a probe at 1 Mbit/s: once in many windows; at 100 Mbit/s: every window
    assert A.probe_every(A.probe_cost(slow), COMPUTE, 10) >= 10
    assert A.probe_every(A.probe_cost(fast), COMPUTE, 10) == 1


# --------------------------------------------------------------------------- when to probe

# the whole decision (what the schedule, the syncs and a drift call for) is
# tests/unit/test_probe_plan.py's table; here the rules it is made of

NET = Net(alpha_s=2e-4, bandwidth_Bps=MB100, world_size=2)


def test_sync_drift_is_checked_on_the_window_and_its_last_third():
    p = predict("fp16", NET, wl())
    expected = p.step_s - p.compute_s
    assert not A.sync_drifted(p, (expected, expected), calibrated=True)
    # the last third moved: a change just before the boundary
    assert A.sync_drifted(p, (expected, expected + 0.5 * p.step_s), calibrated=True)
    # within the looser tolerance before calibration
    assert not A.sync_drifted(p, (expected + 0.3 * p.step_s,), calibrated=False)
    assert A.sync_drifted(p, (expected + 0.3 * p.step_s,), calibrated=True)


@pytest.mark.parametrize("step, probe_s, step_s, interval, want", [
    (10, 0.01, COMPUTE, 10, 20),     # cheap: every window
    (10, 0.22, COMPUTE, 10, 30),     # 1.7% of a window: every second one
    (4, 0.22, COMPUTE, 0, 24),       # interval=0: windows of PROBE_WINDOW steps
    (10, 0.22, 0.0, 10, 20),         # no step time yet: the next window
])
def test_next_probe_keeps_the_budget(step, probe_s, step_s, interval, want):
    assert A.next_probe_step(step, probe_s, step_s, interval) == want


@pytest.mark.parametrize("in_flight, deferred, period, want", [
    (True, 0, 4, True),
    (True, 3, 4, True),
    (True, 4, 4, False),     # not forever: fragments may always have one in flight
    (False, 0, 4, False),
])
def test_a_decision_waits_while_a_streamed_sync_is_in_flight(in_flight, deferred, period, want):
    assert A.defer_decision(in_flight, deferred, period) is want


@pytest.mark.parametrize("switch, fresh, pending, pick, want", [
    (True, False, None, "fp16", True),     # a routine switch: wait for the next window
    (True, False, "fp16", "fp16", False),  # the second window agrees: switch
    (True, False, "topk", "fp16", True),   # it picked another: wait again
    (True, True, None, "fp16", False),     # first choice or a new link: at once
    (False, False, None, "fp16", False),   # no switch
])
def test_a_routine_switch_needs_two_windows(switch, fresh, pending, pick, want):
    assert A.wait_for_confirmation(switch, fresh, pending, pick) is want


# --------------------------------------------------------------------------- start

@pytest.mark.parametrize("candidates, usable, start, hierarchical, want", [
    (A.DEFAULT_CANDIDATES, A.DEFAULT_CANDIDATES, "", False, "diloco"),
    (("allreduce", "fp16", "local"), ("allreduce", "fp16", "local"), "", False, "local"),
    (("allreduce", "fp16", "topk"), ("allreduce", "fp16", "topk"), "", False, "fp16"),
    (("topk", "int8"), ("topk", "int8"), "", False, "topk"),
    (("topk",), ("topk",), "int8", False, "int8"),         # outside the candidates: as given
    (("fp16", "diloco"), ("fp16",), "", False, "fp16"),    # a candidate the layout cannot run
    (("fp16",), ("fp16",), "onebit", True, "fp16"),        # 1-bit Adam runs flat only
    (("fp16",), ("fp16",), "onebit", False, "onebit"),
])
def test_start_strategy(candidates, usable, start, hierarchical, want):
    assert A.start_strategy(candidates, usable, start, hierarchical=hierarchical) == want


def test_candidate_options_put_the_users_over_the_defaults():
    assert A.child_options({})["diloco"] == A.DEFAULT_CHILD_OPTIONS["diloco"]
    got = A.child_options({"diloco": {"period": 4}, "topk": {"ratio": 0.2}})
    assert got["diloco"] == {**A.DEFAULT_CHILD_OPTIONS["diloco"], "period": 4}
    assert got["topk"] == {"ratio": 0.2}
    # period=1 leaves no room to stream: the user's options stand alone
    assert A.child_options({"diloco": {"period": 1}})["diloco"] == {"period": 1}


def test_variant_options_keep_the_users_diloco_options_and_drop_repeats():
    variants = A.parse_variants("fp16,int8,fp16@0.5")
    got = A.variant_options(variants, {"diloco": {"delta_dtype": "int8"}})
    assert got == [{**A.DEFAULT_CHILD_OPTIONS["diloco"], "delta_dtype": "int8"},
                   {**A.DEFAULT_CHILD_OPTIONS["diloco"], "delta_dtype": "int8",
                    "delta_topk": 0.5}]
    assert A.variant_options(variants, {"diloco": {"period": 1}}) == []


def test_prediction_text():
    p = predict("fp16", NET, wl())
    assert A.prediction_text(p) == (f"fp16 {p.step_s:.3g} s/step "
                                    f"({p.efficiency:.0%} of no-sync)")


def test_policy_is_pure():
    import subprocess
    import sys

    code = ("import sys, lorasync.plan.policy; bad = [m for m in sys.modules if m == 'torch' or "
            "m.startswith(('lorasync.comm', 'lorasync.train', 'lorasync.netdiag', "
            "'lorasync.overlay', 'lorasync.emulate'))]; sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
