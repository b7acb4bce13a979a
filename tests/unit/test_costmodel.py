"""The cost model: collective formulas, the wire-byte table, overlap, monotonicity."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from lorasync.errors import ConfigError
from lorasync.plan.costmodel import (
    MODELS, PERIODIC, STRATEGIES, Collective, MiB, Net, Workload, allgather_s, alltoall_s,
    bucket_layout, collective_time, collectives, head_share, lora_matrices, predict,
    recursive_doubling_allreduce_s, reduce_broadcast_s, ring_allreduce_s, strategy_options,
    wire_bytes,
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
    assert collective_time(Collective("all_reduce", p), x) == pytest.approx(
        2 * (n - 1) * a + 2 * (n - 1) / n * p * b)
    assert ring_allreduce_s(p, a, b, n) == pytest.approx(
        collective_time(Collective("all_reduce", p), x))
    # all-gather: p per rank, n*p in all
    assert collective_time(Collective("all_gather", p), x) == pytest.approx(
        allgather_s(n * p, a, b, n))
    assert allgather_s(n * p, a, b, n) == pytest.approx((n - 1) * a + (n - 1) * p * b)
    assert collective_time(Collective("all_to_all", p), x) == pytest.approx(alltoall_s(p, a, b, n))
    rd = net(bw=bw, alpha=a, n=n, allreduce_algo="recursive_doubling")
    rb = net(bw=bw, alpha=a, n=n, allreduce_algo="reduce_broadcast")
    L = math.ceil(math.log2(n))
    assert collective_time(Collective("all_reduce", p), rd) == pytest.approx(L * (a + p * b))
    assert recursive_doubling_allreduce_s(p, a, b, n) == pytest.approx(L * (a + p * b))
    assert collective_time(Collective("all_reduce", p), rb) == pytest.approx(
        reduce_broadcast_s(p, a, b, n))
    # without a native all-to-all the fallback all-gathers the whole buffer: slower
    fb = net(bw=bw, alpha=a, n=n, alltoall=False)
    assert collective_time(Collective("all_to_all", p), fb) > collective_time(
        Collective("all_to_all", p), x)


def test_one_rank_costs_nothing():
    x = net(n=1)
    for s in STRATEGIES:
        p = predict(s, x, wl())
        assert p.comm_s == 0 and p.exposed_comm_s == 0


# --------------------------------------------------------------------------- wire bytes

def _two_phase(numel, n, bits, block=256):
    # n x ceil(numel / (n block)) blocks of equal size (a multiple of 8 for bits),
    # the whole compressed vector in phase 1, 1/n of it in phase 2
    nb = n * math.ceil(numel / (n * block))
    bs = math.ceil(numel / nb)
    if bits == 1:
        bs = 8 * math.ceil(bs / 8)
    c = nb * bs * bits / 8 + 4 * nb
    return c * (1 + 1 / n)


@pytest.mark.parametrize("name, n, opts, expected", [
    ("none", 2, {}, 0),
    ("allreduce", 2, {}, 4 * N),
    ("allreduce", 8, {}, 4 * N),
    ("fp16", 2, {}, 2 * N),
    ("bf16", 4, {}, 2 * N),
    ("int8", 2, {}, _two_phase(N, 2, 8)),
    ("int8", 4, {"block": 64}, _two_phase(N, 4, 8, 64)),
    ("onebit", 2, {}, _two_phase(N, 2, 1, 512)),
    ("onebit", 3, {"block": 256, "warmup_steps": 5}, _two_phase(N, 3, 1, 256)),
    ("topk", 2, {}, 8 * math.ceil(0.1 * N)),
    ("topk", 8, {"ratio": 0.001}, 8 * math.ceil(0.001 * N)),
    ("local", 2, {}, 4 * N / 8),
    ("local", 2, {"period": 4}, 4 * N / 4),
    ("diloco", 2, {}, 4 * N / 8),
    ("diloco", 2, {"period": 16, "delta_dtype": "bf16", "outer_lr": 0.5}, 2 * N / 16),
])
def test_wire_bytes_table(name, n, opts, expected):
    assert wire_bytes(name, N, n, **opts) == pytest.approx(expected)


def test_powersgd_wire_bytes_from_matrix_shapes():
    # rank 1 per layer: q (8x576, 576x8) -> 2 x 584, k/v (8x576, 192x8) -> 584 + 200, o like q
    per_layer = 2 * 584 + 2 * (584 + 200) + 2 * 584
    assert wire_bytes("powersgd", N, 2, matrices=SMOL, rank=1) == 4 * 30 * per_layer
    assert wire_bytes("powersgd", N, 2, matrices=SMOL, rank=2) == 2 * 4 * 30 * per_layer
    # the default, rank 3, still compresses every matrix (k/v's B: 600 of 1536 values)
    assert wire_bytes("powersgd", N, 2, matrices=SMOL) == 3 * 4 * 30 * per_layer
    # rank 4 no longer halves any r=8 LoRA matrix (4608 < 2 x 584 x 4): all sent whole
    assert wire_bytes("powersgd", N, 2, matrices=SMOL, rank=4) == 4 * N
    assert wire_bytes("powersgd", N, 2, matrices=SMOL, rank=4, min_compression_rate=1.5) < 4 * N
    # without shapes: LoRA r x 1024 assumed, close to the real shapes
    approx = wire_bytes("powersgd", N, 2, lora_r=8, rank=1)
    assert approx == pytest.approx(4 * 30 * per_layer, rel=0.02)
    assert [c.kind for c in collectives("powersgd", N, 2)] == ["all_reduce", "all_reduce"]


def test_two_phase_and_topk_collectives():
    assert [c.kind for c in collectives("int8", N, 4)] == ["all_to_all", "all_gather"]
    assert [c.kind for c in collectives("topk", N, 4)] == ["all_gather"]


def test_per_tensor_bytes_with_shapes():
    # topk keeps k per tensor; two-phase blocks are cut per tensor
    k = sum(max(1, math.ceil(0.1 * m * c)) for m, c in SMOL)
    assert wire_bytes("topk", N, 2, matrices=SMOL) == 8 * k
    assert wire_bytes("int8", N, 2, matrices=SMOL) == pytest.approx(
        sum(_two_phase(m * c, 2, 8) for m, c in SMOL))
    # a bucket holding part of the adapter gets its share
    assert wire_bytes("topk", N // 2, 2, matrices=SMOL) == pytest.approx(4 * k)


def _comm_formula():
    try:
        from lorasync.comm import wire_bytes_formula
    except ImportError:
        return None
    return wire_bytes_formula


@pytest.mark.skipif(_comm_formula() is None,
                    reason="lorasync.comm.wire_bytes_formula not available yet")
def test_byte_table_agrees_with_comm_module():
    """The planner's byte table and the strategies' own formula, at the defaults,
    for one flat tensor and for the real SmolLM2 LoRA shapes."""
    formula = _comm_formula()
    wrong = []
    for name in STRATEGIES + ("none",):
        for numel, n in ((N, 2), (N, 3), (262_144, 4), (100_000, 8)):
            if name == "powersgd":  # a flat tensor says nothing about matrix shapes
                continue
            theirs, ours = formula(name, numel, n), wire_bytes(name, numel, n)
            if theirs != pytest.approx(ours, rel=1e-9):
                wrong.append((name, numel, n, theirs, ours))
        for n in (2, 3, 4, 8):
            theirs = formula(name, [list(m) for m in SMOL], n)
            ours = wire_bytes(name, N, n, matrices=SMOL)
            if theirs != pytest.approx(ours, rel=1e-9):
                wrong.append((name, "smollm2 shapes", n, theirs, ours))
    assert not wrong, "plan/costmodel.py _COLLECTIVES disagrees with lorasync.comm: " + repr(wrong)


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
    (dict(options={"diloco": {"delta_dtype": "int4"}}), "diloco.delta_dtype"),
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
        strategy_options("zip")
    with pytest.raises(ConfigError):
        predict("zip", net(), wl())


def test_every_strategy_has_a_table_entry():
    for s in STRATEGIES + ("none",):
        assert isinstance(wire_bytes(s, 1000, 2), float | int)
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
