"""The cost model: collective times, buckets and overlap, monotonicity.  The byte
formula it prices is the catalog's (tests/unit/test_catalog.py)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from lorasync import catalog
from lorasync.errors import ConfigError
from lorasync.catalog import PERIODIC, STRATEGIES, Collective
from lorasync.plan.costmodel import (
    GLOO_LANES, MODELS, MiB, Net, Workload, adapter_shapes, bucket_layout, collective_time,
    head_share, lanes_of, lora_matrices, predict,
)

N = 921_600  # SmolLM2-135M, LoRA r=8 on q/k/v/o
SMOL = lora_matrices(MODELS["smollm2-135m"], 8)


def net(bw=1.25e6, alpha=1e-3, n=2, **kw):
    return Net(alpha_s=alpha, bandwidth_Bps=bw, world_size=n, **kw)


def wl(**kw):
    base = dict(adapter_params=N, compute_s=1.25, batch_size=4, matrices=SMOL)
    base.update(kw)
    return Workload(**base)


# --------------------------------------------------------------------------- adapters

@pytest.mark.parametrize("r, targets, freeze_a, expected", [
    (8, ("q", "k", "v", "o"), False, 921_600),   # 30 x 8 x (1152 + 768 + 768 + 1152)
    (16, ("q", "k", "v", "o"), False, 1_843_200),
    (8, ("q_proj", "v_proj"), False, 30 * 8 * (1152 + 768)),
    (8, ("q", "k", "v", "o"), True, 30 * 8 * (576 + 192 + 192 + 576)),  # B only
])
def test_lora_param_count(r, targets, freeze_a, expected):
    mx = lora_matrices(MODELS["smollm2-135m"], r, targets, freeze_a)
    assert sum(m * k for m, k in mx) == expected


def test_unknown_lora_target_names_the_field():
    with pytest.raises(ConfigError, match="lora targets"):
        lora_matrices(MODELS["smollm2-135m"], 8, ("qkv",))


# --------------------------------------------------------------------------- collectives

@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_collective_times_follow_alpha_beta_formulas(n):
    a, bw, p = 2e-3, 1e8, 3e6
    b = 1 / bw
    x = net(bw=bw, alpha=a, n=n)
    # ring all-reduce: n-1 reduce-scatter and n-1 all-gather steps of p/n each
    assert collective_time(Collective("all_reduce", p), x) == pytest.approx(
        2 * (n - 1) * a + 2 * (n - 1) / n * p * b)
    # all-gather: p per rank, (n-1) p received; all-to-all of a p-byte send
    # buffer: every pair's message at once (gloo posts them all, then waits)
    assert collective_time(Collective("all_gather", p), x) == pytest.approx(
        (n - 1) * a + (n - 1) * p * b)
    assert collective_time(Collective("all_to_all", p), x) == pytest.approx(
        a + (n - 1) / n * p * b)
    rd = net(bw=bw, alpha=a, n=n, allreduce_algo="recursive_doubling")
    rb = net(bw=bw, alpha=a, n=n, allreduce_algo="reduce_broadcast")
    L = math.ceil(math.log2(n))
    # recursive doubling: log2 n exchanges of the whole vector, and where n is
    # not a power of two floor(log2 n) plus two (fold in, hand back: what
    # lorasync's own implementation in comm/wire.py does); binomial
    # reduce then broadcast: twice as many rounds
    R = int(math.log2(n)) if 2 ** int(math.log2(n)) == n else int(math.log2(n)) + 2
    assert collective_time(Collective("all_reduce", p), rd) == pytest.approx(R * (a + p * b))
    assert collective_time(Collective("all_reduce", p), rb) == pytest.approx(2 * L * (a + p * b))
    # without a native all-to-all the fallback all-gathers the whole buffer: slower
    fb = net(bw=bw, alpha=a, n=n, alltoall=False)
    assert collective_time(Collective("all_to_all", p), fb) > collective_time(
        Collective("all_to_all", p), x)


def test_one_rank_costs_nothing():
    x = net(n=1)
    for s in STRATEGIES:
        p = predict(s, x, wl())
        assert p.comm_s == 0 and p.exposed_comm_s == 0


# --------------------------------------------------------------------------- adapter shapes

def test_adapter_shapes_are_the_matrices_or_lora_factors():
    assert adapter_shapes(wl()) == SMOL
    # a 1-D remainder outside the matrices (biases, norms) travels too
    assert adapter_shapes(wl(adapter_params=N + 100))[-1] == (100,)
    # no shapes known: r x 1024 LoRA factors, close to the real ones for PowerSGD
    guess = adapter_shapes(wl(matrices=None))
    assert guess[0] == (8, 1024) and sum(math.prod(s) for s in guess) == N
    x = net()
    real = predict("powersgd", x, wl(options={"powersgd": {"rank": 1}}))
    rough = predict("powersgd", x, wl(matrices=None, options={"powersgd": {"rank": 1}}))
    assert rough.wire_bytes == pytest.approx(real.wire_bytes, rel=0.02)


def test_predicted_bytes_are_the_catalogs():
    from lorasync.catalog import wire_bytes

    x = net()
    for s in STRATEGIES:
        assert predict(s, x, wl()).wire_bytes == pytest.approx(wire_bytes(s, SMOL, 2)), s
    # a bucket hands over its share of the sync, so buckets change no bytes
    for s in ("topk", "int8", "powersgd"):
        assert predict(s, x, wl(bucket_bytes=MiB // 4)).wire_bytes == pytest.approx(
            wire_bytes(s, SMOL, 2)), s


# --------------------------------------------------------------------------- buckets, overlap

@pytest.mark.parametrize("bucket, first, expected", [
    (4 * MiB, None, [N]),                              # the trainer's default: one bucket
    (1 * MiB, None, [262_144] * 3 + [N - 3 * 262_144]),
    (25 * MiB, 1 * MiB, [262_144, N - 262_144]),       # plain DDP defaults
])
def test_bucket_layout(bucket, first, expected):
    assert bucket_layout(N, bucket, first) == expected


def test_single_bucket_hides_nothing_and_more_buckets_hide_some():
    x = net(bw=1.25e6, alpha=1e-4)
    one = predict("allreduce", x, wl())
    assert one.buckets == 1 and one.exposed_comm_s == pytest.approx(one.comm_s)
    many = predict("allreduce", x, wl(bucket_bytes=MiB // 4))
    assert many.buckets > 1
    assert many.exposed_comm_s < many.comm_s
    # what the backward can hide is bounded by the backward pass
    backward = 1.25 * 0.5
    assert many.comm_s - many.exposed_comm_s <= backward + 1e-9
    # the last bucket's sync can never hide
    last = collective_time(Collective("all_reduce", 4 * bucket_layout(N, MiB // 4)[-1]), x)
    assert many.exposed_comm_s >= last - 1e-12
    # no backward share: nothing to overlap with
    flat = predict("allreduce", x, wl(bucket_bytes=MiB // 4, backward_share=0.0))
    assert flat.exposed_comm_s == pytest.approx(flat.comm_s)


def _bucket_ends(x: Net, nbuckets: int) -> float:
    """Exposed sync of ``nbuckets`` equal all-reduce buckets all ready at the
    end of backward (no backward share to hide behind)."""
    return predict("allreduce", x, wl(bucket_bytes=4 * N // nbuckets + 4,
                                      backward_share=0.0)).exposed_comm_s


def test_two_lanes_overlap_latency_not_bytes():
    # latency-bound (gloo on a long link): two buckets' all-reduces in flight
    # together cost one bucket's latency, four cost two (bench/gloo_lanes.py)
    lat = net(bw=1e12, alpha=0.1, n=8)
    one = collective_time(Collective("all_reduce", 4.0 * N / 4), lat)
    assert _bucket_ends(lat, 4) == pytest.approx(4 * one, rel=1e-6)
    assert _bucket_ends(dataclasses.replace(lat, lanes=2), 4) == pytest.approx(2 * one, rel=1e-3)
    assert _bucket_ends(dataclasses.replace(lat, lanes=4), 4) == pytest.approx(one, rel=1e-3)
    # bandwidth-bound: the bytes share the link, however many run at once
    bw = net(bw=1.25e6, alpha=0.0, n=8)
    assert _bucket_ends(dataclasses.replace(bw, lanes=2), 4) == pytest.approx(
        _bucket_ends(bw, 4), rel=1e-9)
    # one bucket: nothing to overlap
    assert _bucket_ends(dataclasses.replace(lat, lanes=2), 1) == pytest.approx(
        _bucket_ends(lat, 1))


def test_lanes_never_slow_a_step_and_follow_the_backend():
    assert lanes_of("gloo") == GLOO_LANES == 2 and lanes_of("nccl") == lanes_of(None) == 1
    for alpha, bw in ((0.1, 1e12), (0.02, 2.5e6), (1e-4, 1.25e6)):
        for layout in ("flat", "hierarchical"):
            x = net(bw=bw, alpha=alpha, n=8, ranks_per_node=2, intra_bandwidth_Bps=1e9,
                    layout=layout)
            for s in ("allreduce", "fp16", "powersgd", "int8", "topk", "diloco"):
                a = predict(s, x, wl(bucket_bytes=MiB))
                b = predict(s, dataclasses.replace(x, lanes=2), wl(bucket_bytes=MiB))
                assert b.step_s <= a.step_s + 1e-9, (s, layout, alpha)
                assert (b.wire_bytes, b.link_bytes) == (a.wire_bytes, a.link_bytes)


def test_small_comm_is_fully_hidden_but_for_the_last_bucket():
    x = net(bw=1.25e9, alpha=1e-5)
    p = predict("allreduce", x, wl(bucket_bytes=MiB // 4))
    last = collective_time(Collective("all_reduce", 4 * bucket_layout(N, MiB // 4)[-1]), x)
    assert p.exposed_comm_s == pytest.approx(last)


def test_periodic_strategies_amortize_one_sync_over_the_period():
    x = net()
    ar = collective_time(Collective("all_reduce", 4 * N), x)
    for name, period in (("local", 8), ("diloco", 8)):
        p = predict(name, x, wl())
        assert p.periodic and not p.lossless
        assert p.exposed_comm_s == pytest.approx(ar / period)
        assert p.syncs_per_step == pytest.approx(1 / period)
    p = predict("local", x, wl(options={"local": {"period": 2}}))
    assert p.exposed_comm_s == pytest.approx(ar / 2)


def test_step_time_is_compute_plus_encode_plus_exposed():
    x = net()
    for s in STRATEGIES + ("none",):
        p = predict(s, x, wl())
        assert p.step_s == pytest.approx(p.compute_s + p.encode_s + p.exposed_comm_s)
        assert p.efficiency == pytest.approx(1.25 / p.step_s)
        assert p.samples_per_s == pytest.approx(2 * 4 / p.step_s)
    assert predict("none", x, wl()).efficiency == 1.0


def test_encode_cost_is_overridable():
    x = net()
    base = predict("int8", x, wl())
    slow = predict("int8", x, wl(encode_ns={"int8": 100.0}))
    assert slow.encode_s == pytest.approx(100e-9 * N)
    assert slow.step_s > base.step_s


# --------------------------------------------------------------------------- monotonicity

BANDWIDTHS = [1.25e5, 1.25e6, 1.25e7, 1.25e8, 1.25e9, 1.25e10]
ALPHAS = [0.0, 1e-5, 1e-4, 1e-3, 1e-2, 5e-2]
NODES = [1, 2, 3, 4, 8, 16, 64]
WORKLOADS = [wl(), wl(bucket_bytes=MiB // 4), wl(bucket_bytes=25 * MiB, first_bucket_bytes=MiB)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("w", range(len(WORKLOADS)))
def test_more_bandwidth_never_slower(strategy, w):
    for alpha in (1e-4, 2e-2):
        for n in (2, 8):
            steps = [predict(strategy, net(bw=b, alpha=alpha, n=n), WORKLOADS[w]).step_s
                     for b in BANDWIDTHS]
            assert all(b <= a + 1e-12 for a, b in zip(steps, steps[1:])), steps


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("w", range(len(WORKLOADS)))
def test_more_latency_never_faster(strategy, w):
    for bw in (1.25e6, 1.25e9):
        for n in (2, 8):
            steps = [predict(strategy, net(bw=bw, alpha=a, n=n), WORKLOADS[w]).step_s
                     for a in ALPHAS]
            assert all(b >= a - 1e-12 for a, b in zip(steps, steps[1:])), steps


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_more_nodes_never_fewer_bytes_on_the_link(strategy):
    link = [predict(strategy, net(n=n), wl()).link_bytes for n in NODES]
    assert all(b >= a - 1e-9 for a, b in zip(link, link[1:])), link


def test_more_nodes_never_fewer_wire_bytes_for_all_gather_strategies():
    # topk hands the same payload to a growing all-gather
    for opts in ({}, {"ratio": 0.1}):
        wb = [predict("topk", net(n=n), wl(options={"topk": opts})).wire_bytes for n in NODES]
        assert all(b >= a for a, b in zip(wb, wb[1:])), wb
    # and what a rank receives from an all-gather grows with n
    for name in ("topk", "int8", "onebit"):
        t = [predict(name, net(n=n), wl()).comm_s for n in NODES[1:]]
        assert all(b >= a for a, b in zip(t, t[1:])), (name, t)


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, field", [
    (dict(alpha_s=-1, bandwidth_Bps=1, world_size=2), "alpha_s"),
    (dict(alpha_s=0, bandwidth_Bps=0, world_size=2), "bandwidth_Bps"),
    (dict(alpha_s=0, bandwidth_Bps=1, world_size=0), "world_size"),
    (dict(alpha_s=0, bandwidth_Bps=1, world_size=2, allreduce_algo="bcube"), "allreduce_algo"),
    (dict(alpha_s=0, bandwidth_Bps=1, world_size=2, lanes=0), "lanes"),
    (dict(alpha_s=0, bandwidth_Bps=1, world_size=2, lanes=1.5), "lanes"),
])
def test_net_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        Net(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    (dict(adapter_params=0), "adapter_params"),
    (dict(compute_s=0), "compute_s"),
    (dict(batch_size=0), "batch_size"),
    (dict(backward_share=1.5), "backward_share"),
    (dict(head_share=1.0), "head_share"),
    (dict(head_share=-0.1), "head_share"),
    (dict(options={"topk": {"ratio": 2}}), "topk.ratio"),
    (dict(options={"topk": {"rank": 2}}), "topk.rank"),
    (dict(options={"diloco": {"delta_dtype": "int3"}}), "diloco.delta_dtype"),
    (dict(options={"local": {"dtype": "fp16"}}), "local.dtype"),
    (dict(options={"local": {"streaming": True, "delay": 8}}), "local.delay"),
    (dict(encode_ns={"zstd": 1.0}), "encode_ns"),
])
def test_workload_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        wl(**kwargs)
    assert e.value.field == field


def test_unknown_strategy():
    with pytest.raises(ConfigError, match="strategy"):
        predict("zip", net(), wl())
    with pytest.raises(ConfigError, match="strategy"):  # not one the planner prices
        predict("torch_powersgd", net(), wl())
    assert PERIODIC <= set(STRATEGIES)


def test_plan_package_does_not_import_torch():
    code = ("import sys, lorasync.plan, lorasync.plan.cli, lorasync.plan.costmodel; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_two_phase_hook_holds_backward_up():
    """int8/onebit: the hook of bucket k waits for phase 1 of bucket k-1, and
    phase 2 of k-1 queues ahead of phase 1 of k (measured at 10 Mbit/s: int8
    1.92 s/step; the free-overlap model said 1.56, the pipeline with
    backward at 2/3 of compute 1.73, with backward at 1/2 and the LM head
    first 1.85)."""
    net = Net(alpha_s=0.0, bandwidth_Bps=9.48e6 / 8, world_size=2)
    one = Workload(adapter_params=N, compute_s=1.41, bucket_bytes=64 * MiB, matrices=SMOL)
    p = predict("int8", net, one)
    # one bucket: both phases run after the backward pass, nothing hides
    assert p.exposed_comm_s == pytest.approx(p.comm_s)
    four = Workload(adapter_params=N, compute_s=1.41, bucket_bytes=MiB, matrices=SMOL,
                    head_share=head_share(MODELS["smollm2-135m"]))
    p4 = predict("int8", net, four)
    assert 0.3 < p4.exposed_comm_s < p4.comm_s
    assert p4.step_s == pytest.approx(1.85, abs=0.02)
    old = Workload(adapter_params=N, compute_s=1.41, bucket_bytes=MiB, matrices=SMOL,
                   backward_share=2 / 3)
    assert predict("int8", net, old).step_s == pytest.approx(1.73, abs=0.02)
    # a per-step strategy with the same bytes per bucket would hide more: it never blocks
    assert predict("topk", net, four).exposed_comm_s < p4.exposed_comm_s


def test_head_share_follows_the_weights_backward_multiplies():
    # frozen base: one input-gradient matmul per projection; the head comes first
    smol = MODELS["smollm2-135m"]
    head = 49152 * 576
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert head_share(smol) == pytest.approx(head / (head + 30 * layer))
    assert 0.20 < head_share(smol) < 0.22   # measured: 0.22 on one CPU thread
    # a big model spends less of its backward in the head
    assert head_share(MODELS["llama-3-8b"]) < head_share(smol)
    unknown = dataclasses.replace(smol, vocab=0)
    assert head_share(unknown) == 0.0


def test_the_head_delays_every_bucket_by_its_share_of_backward():
    """Four equal buckets, each all-reduce 0.15 s; compute 1 s, backward 0.5 s.
    Without a head the buckets are ready at 0.125, 0.25, 0.375, 0.5 and the
    chain ends at 0.725 (0.225 exposed); with the head taking 0.2 of backward
    (0.1 s) they are ready at 0.2, 0.3, 0.4, 0.5 and it ends at 0.8 (0.3)."""
    elems = MiB // 4
    x = Net(alpha_s=0.0, bandwidth_Bps=MiB / 0.15, world_size=2)
    base = dict(adapter_params=4 * elems, compute_s=1.0, backward_share=0.5, bucket_bytes=MiB,
                encode_ns={"allreduce": 0.0})
    flat = predict("allreduce", x, Workload(**base))
    assert flat.buckets == 4 and flat.comm_s == pytest.approx(0.6)
    assert flat.exposed_comm_s == pytest.approx(0.225)
    headed = predict("allreduce", x, Workload(**base, head_share=0.2))
    assert headed.exposed_comm_s == pytest.approx(0.3)
    assert headed.step_s == pytest.approx(1.3)
    # one bucket: it waits for the whole backward either way
    one = dict(base, bucket_bytes=4 * MiB)
    assert predict("allreduce", x, Workload(**one, head_share=0.2)).exposed_comm_s == \
        pytest.approx(predict("allreduce", x, Workload(**one)).exposed_comm_s)


def test_ring_link_load_counts_relayed_legs_twice_on_the_hub():
    from lorasync.plan.costmodel import ring_link_load

    assert ring_link_load([0, 1, 2], {}) == 1
    # nodes 1 and 2 behind NAT: their leg goes through hub 0, whose links carry two legs
    assert ring_link_load([0, 1, 2], {(1, 2): 0, (2, 1): 0}) == 2
    assert ring_link_load([0, 2, 1], {(1, 2): 0, (2, 1): 0}) == 2   # any ring order of 3
    # four nodes, legs 1->2 and 2->3 relayed through 0: its links carry its own leg and both
    assert ring_link_load([0, 1, 2, 3], {(1, 2): 0, (2, 3): 0}) == 3
    assert ring_link_load([0], {}) == 1


# --------------------------------------------------------------------------- streamed outer syncs

def _diloco(x, **opts):
    return predict("diloco", x, wl(options={"diloco": opts}))


def test_one_streamed_sync_exposes_what_its_delay_does_not_cover():
    x = net(bw=125e3)   # 1 Mbit/s: an fp16 sync of the adapter takes ~15 s
    sync = collective_time(Collective("all_reduce", 2 * N), x)
    for delay in (1, 3, 7):
        p = _diloco(x, streaming=True, delta_dtype="fp16", delay=delay)
        # the period's compute (8 x 1.25 s) does not cover it either: the
        # steps wait for the link, whatever the delay
        assert p.exposed_comm_s == pytest.approx(max(sync - delay * 1.25, sync - 8 * 1.25) / 8)
    fast = net(bw=1.25e6)   # 10 Mbit/s: 1.5 s, under two steps
    sync = collective_time(Collective("all_reduce", 2 * N), fast)
    for delay in (1, 2):
        p = predict("diloco", fast, wl(options={"diloco": {"streaming": True,
                                                           "delta_dtype": "fp16",
                                                           "delay": delay}}))
        assert p.exposed_comm_s == pytest.approx(max(0.0, sync - delay * 1.25) / 8)
    assert _diloco(fast, streaming=False, delta_dtype="fp16").exposed_comm_s == \
        pytest.approx(sync / 8)


def test_fragments_hide_what_one_sync_cannot():
    x = net(bw=125e3)
    whole = _diloco(x, streaming=True, delta_dtype="int4")                 # 4.1 s, 1 step late
    frags = _diloco(x, streaming=True, delta_dtype="int4", fragments=4)    # 4 x 1.04 s
    assert whole.exposed_comm_s > 0.25 and frags.exposed_comm_s == 0.0
    assert frags.wire_bytes == pytest.approx(whole.wire_bytes)
    assert frags.comm_s > whole.comm_s   # 4 collectives pay 4 latencies
    # the same hiding with the whole sync 4 steps late
    assert _diloco(x, streaming=True, delta_dtype="int4", delay=4).exposed_comm_s == 0.0


def test_fragments_queue_on_the_link():
    # 8 fragments, 1 a step, each 1.5 steps long: the link cannot keep up with
    # the schedule, so the steps wait for it (what the period's compute leaves)
    x = net(bw=125e3)
    o = {"streaming": True, "delta_dtype": "fp16", "fragments": 8}
    p = _diloco(x, **o)
    per = [collective_time(c, x) for c in catalog.collectives("diloco", SMOL, 2, o)]
    assert p.exposed_comm_s == pytest.approx((sum(per) - 8 * 1.25) / 8, rel=1e-6)
    assert p.exposed_comm_s > _diloco(x, **{**o, "delta_dtype": "int8"}).exposed_comm_s


def test_a_late_update_does_not_hide_a_link_that_cannot_keep_up():
    # int8 in 8 fragments at 0.67 Mbit/s: each fragment ~1.5 s against 1.25 s of
    # compute a step, so the link falls behind every period; 7 steps late only
    # postpones the wait, the steady state still waits for the link's excess
    x = net(bw=0.67e6 / 8)
    o = {"streaming": True, "delta_dtype": "int8", "fragments": 8}
    per = [collective_time(c, x) for c in catalog.collectives("diloco", SMOL, 2, o)]
    assert sum(per) > 8 * 1.25
    for delay in (1, 4, 7):
        p = _diloco(x, **o, delay=delay)
        # (the encode, spent on the compute thread, gives the link that much more time)
        assert p.exposed_comm_s >= (sum(per) - 8 * (1.25 + p.encode_s)) / 8 - 1e-9, delay
        assert p.exposed_comm_s > 0.15


def test_gathered_deltas_cost_n_minus_1_shares_of_the_link():
    # an all-gather of P bytes moves (n-1) P per rank: int8 stays ahead of an
    # fp16 all-reduce (2 (n-1)/n x 2N) up to 4 ranks and falls behind past them
    for n, int8_wins in ((2, True), (3, True), (8, False)):
        x = net(bw=1.25e6, n=n)
        a = _diloco(x, delta_dtype="int8").link_bytes
        b = _diloco(x, delta_dtype="fp16").link_bytes
        assert (a < b) == int8_wins, (n, a, b)
