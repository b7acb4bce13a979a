"""Topology (pure parts), the emulated cluster's nproc_per_node, and the cost
model with several ranks per node."""

from __future__ import annotations

import dataclasses

import pytest

from lorasync.catalog import STRATEGIES, Collective
from lorasync.comm.topology import Topology, group_nodes, node_key
from lorasync.errors import ConfigError
from lorasync.emulate.spec import parse_emulate
from lorasync.plan.costmodel import (
    MODELS, Net, Workload, allreduce_choice, collective_time, lora_matrices, predict,
    rd_exchanges,
)


# --------------------------------------------------------------------------- topology

def test_nodes_group_by_key_in_rank_order():
    a, b = ("h", "boot", 1), ("h", "boot", 2)   # same host, two network namespaces
    assert group_nodes([a, a, b, b]) == ((0, 1), (2, 3))
    assert group_nodes([a, b, a, b]) == ((0, 2), (1, 3))   # leaders: the lowest ranks
    assert group_nodes([a, a, a]) == ((0, 1, 2),)


def test_ranks_per_node_overrides_the_keys():
    k = ("h", "b", 1)
    assert group_nodes([k] * 6, ranks_per_node=2) == ((0, 1), (2, 3), (4, 5))
    with pytest.raises(ConfigError, match="ranks_per_node.*divide the world size 6"):
        group_nodes([k] * 6, ranks_per_node=4)


def test_node_key_names_host_boot_and_namespace():
    host, boot, ns = node_key()
    assert host and isinstance(boot, str) and isinstance(ns, int) and ns > 0


def test_topology_places_each_rank():
    t = Topology(nodes=((0, 1), (2, 3), (4, 5)), rank=3)
    assert (t.num_nodes, t.node_index, t.local_rank, t.local_size) == (3, 1, 1, 2)
    assert t.leaders == (0, 2, 4) and not t.is_leader and t.uniform and t.multi_rank_nodes
    assert Topology(nodes=((0,), (1,)), rank=0).multi_rank_nodes is False
    assert Topology(nodes=((0, 1, 2),), rank=0).multi_rank_nodes is False
    assert "3 node(s) x 2 rank(s)" in t.describe()


def test_emulate_takes_workers_per_node():
    spec = parse_emulate("nodes=4,nproc_per_node=2,rate=10mbit")
    assert spec.nodes == 4 and spec.nproc_per_node == 2
    assert "2 workers per node" in spec.describe()
    assert parse_emulate("nodes=2").nproc_per_node == 1
    with pytest.raises(ConfigError, match="nproc_per_node"):
        parse_emulate("nodes=2,nproc_per_node=two")
    with pytest.raises(ConfigError, match="nproc_per_node"):
        parse_emulate("nodes=2,nproc_per_node=0")


# --------------------------------------------------------------------------- cost model

SMOL = lora_matrices(MODELS["smollm2-135m"])
WL = Workload(adapter_params=sum(a * b for a, b in SMOL), compute_s=1.25, head_share=0.21,
              bucket_bytes=1 << 20, matrices=SMOL)


def _net(layout="flat", bw=10e6 / 8, alpha=1e-3, n=8, g=2, **kw):
    return Net(alpha_s=alpha, bandwidth_Bps=bw, world_size=n, ranks_per_node=g,
               intra_alpha_s=5e-5, intra_bandwidth_Bps=1e9, layout=layout, **kw)


def test_one_rank_per_node_is_the_flat_model():
    base = Net(alpha_s=1e-3, bandwidth_Bps=1.25e6, world_size=4)
    for layout in ("flat", "hierarchical"):
        one = dataclasses.replace(base, intra_bandwidth_Bps=1e9, layout=layout)
        for s in STRATEGIES:
            a, b = predict(s, base, WL), predict(s, one, WL)
            assert a.step_s == b.step_s and a.wire_bytes == b.wire_bytes, s


def test_hierarchical_needs_the_intra_link_and_whole_nodes():
    with pytest.raises(ConfigError, match="intra_bandwidth_Bps"):
        Net(alpha_s=1e-3, bandwidth_Bps=1e6, world_size=8, ranks_per_node=2,
            layout="hierarchical")
    with pytest.raises(ConfigError, match="ranks_per_node"):
        Net(alpha_s=1e-3, bandwidth_Bps=1e6, world_size=8, ranks_per_node=3)
    with pytest.raises(ConfigError, match="layout"):
        Net(alpha_s=1e-3, bandwidth_Bps=1e6, world_size=8, layout="tree")


@pytest.mark.parametrize("strategy", ["topk", "int8", "onebit", "allreduce", "fp16",
                                      "powersgd", "diloco", "local"])
def test_hierarchical_sends_fewer_bytes_across_nodes(strategy):
    flat, hier = predict(strategy, _net("flat"), WL), predict(strategy, _net("hierarchical"), WL)
    assert hier.layout == "hierarchical" and flat.layout == "flat"
    assert hier.inter_bytes < flat.inter_bytes
    assert hier.intra_bytes > 0 and flat.intra_bytes == 0


def test_topk_and_int8_cross_nodes_with_a_node_level_exchange():
    # top-k: G payloads per node flat, one hierarchical
    f, h = predict("topk", _net("flat"), WL), predict("topk", _net("hierarchical"), WL)
    assert f.inter_bytes == pytest.approx(2 * h.inter_bytes, rel=0.01)
    # int8: flat G (1 + 1/NG) C against 1 + 1/N C per node
    f, h = predict("int8", _net("flat"), WL), predict("int8", _net("hierarchical"), WL)
    assert f.inter_bytes / h.inter_bytes == pytest.approx(2 * (1 + 1 / 8) / (1 + 1 / 4),
                                                          rel=0.02)


def test_flat_all_to_all_shares_each_nodes_link():
    c = Collective("all_to_all", 1e6)
    one = Net(alpha_s=0.0, bandwidth_Bps=1e6, world_size=8)
    two = Net(alpha_s=0.0, bandwidth_Bps=1e6, world_size=8, ranks_per_node=2)
    assert collective_time(c, one) == pytest.approx(7 / 8)
    assert collective_time(c, two) == pytest.approx(2 * 3 / 4)


def test_latency_bound_sync_waits_on_fewer_round_trips_hierarchically():
    """DiLoCo's outer all-reduce over a 40 ms link: 2(NG-1) ring steps of the
    slow link flat, 2(N-1) hierarchical."""
    wl = dataclasses.replace(WL, options={"diloco": {"delta_dtype": "fp16"}})
    fast_bw = 1e9
    f = predict("diloco", _net("flat", bw=fast_bw, alpha=0.04, n=32, g=8), wl)
    h = predict("diloco", _net("hierarchical", bw=fast_bw, alpha=0.04, n=32, g=8), wl)
    assert f.messages == pytest.approx(2 * 31 / 8)
    assert h.messages == pytest.approx(2 * 3 / 8)
    assert h.exposed_comm_s < f.exposed_comm_s / 5


def test_recursive_doubling_exchanges():
    assert [rd_exchanges(n) for n in (1, 2, 3, 4, 5, 8, 12, 16)] == [0, 1, 3, 2, 4, 3, 5, 4]


def test_the_algorithm_is_chosen_per_message():
    # 40 ms per message, 1.25 GB/s: a small message is latency-bound
    assert allreduce_choice(4096, 16, 0.04, 1.25e9) == "recursive_doubling"
    # a large one on a slow link is bandwidth-bound: the ring
    assert allreduce_choice(64 << 20, 16, 1e-4, 1.25e6) == "ring"
    assert allreduce_choice(1e6, 1, 0.04, 1e6) == "ring"
    auto = Net(alpha_s=0.04, bandwidth_Bps=1.25e9, world_size=16, allreduce_algo="auto")
    ring = dataclasses.replace(auto, allreduce_algo="ring")
    rd = dataclasses.replace(auto, allreduce_algo="recursive_doubling")
    c = Collective("all_reduce", 4096)
    assert collective_time(c, auto) == min(collective_time(c, ring), collective_time(c, rd))


# --------------------------------------------------------------------------- plan, doctor

def test_plan_ranks_both_layouts_and_advises_the_hierarchy(capsys):
    import json

    from lorasync.cli import main

    assert main(["plan", "--nodes", "4", "--ranks-per-node", "2", "--rate", "10mbit", "--rtt",
                 "1ms", "--intra-rate", "8gbit", "--compute-s", "1.25", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["net"]["ranks_per_node"] == 2 and d["net"]["world_size"] == 8
    layouts = {(p["strategy"], p["layout"]) for p in d["ranking"]}
    assert ("int8", "flat") in layouts and ("int8", "hierarchical") in layouts
    # 1-bit Adam (onebit's default) runs flat only: never ranked hierarchical
    assert ("onebit", "hierarchical") not in layouts and ("onebit", "flat") in layouts
    step = next(s for s in d["steps"] if s["action"] == "hierarchy")
    assert step["worthwhile"] and step["gain"] > 0.05
    assert any("intra-node latency assumed" in n for n in d["input_notes"])
    assert main(["plan", "--nodes", "4", "--ranks-per-node", "2", "--rate", "10mbit",
                 "--compute-s", "1.25", "--layout", "flat"]) == 0
    out = capsys.readouterr().out
    assert "4 nodes x 2 ranks" in out and "hierarchical" not in out.split("Steps")[0]


def test_plan_rejects_intra_options_without_several_ranks_per_node():
    from lorasync.cli import main

    assert main(["plan", "--nodes", "4", "--rate", "10mbit", "--intra-rate", "1gbit"]) == 2


def test_nccl_advice_only_where_the_model_predicts_a_gain():
    from lorasync.netdiag.nccl_advice import nccl_findings

    far = nccl_findings(nnodes=16, ranks_per_node=8, rate_bps=10e9, rtt_s=0.04)
    near = nccl_findings(nnodes=4, ranks_per_node=8, rate_bps=100e9, rtt_s=1e-5)
    assert far[0].severity == "info" and "NCCL_ALGO=Tree" in far[0].fix
    assert "predicted" in far[0].found
    assert near[0].severity == "ok" and "leave NCCL_ALGO unset" in near[0].found
    assert nccl_findings(nnodes=1, ranks_per_node=1, rate_bps=1e9, rtt_s=1e-3)[0].severity == "ok"


def test_plan_nccl_backend_adds_the_advice(capsys):
    import json

    from lorasync.cli import main

    assert main(["plan", "--nodes", "16", "--ranks-per-node", "8", "--rate", "10gbit", "--rtt",
                 "40ms", "--intra-rate", "1200gbit", "--compute-s", "2", "--backend", "nccl",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert any(s["action"] == "nccl_algo" for s in d["steps"])
