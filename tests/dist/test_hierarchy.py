"""Hierarchical sync on 4 gloo ranks taken as 2 nodes x 2 (loopback), and
lorasync's recursive-doubling all-reduce against gloo's ring.

One subprocess per worker kind (tests/dist/_hier_worker.py) spawns the ranks
once and runs every scenario; the tests assert on what it recorded:

  train   every strategy flat and hierarchical (periodic ones with their
          outer sync in shards and by the leaders), 24 steps with batch
          shapes and backward timing different on every rank: quality,
          replicas identical, wire / intra-node / inter-node bytes per step
  first   one step's averaged gradient, flat and hierarchical, against the
          exact fp64 mean: hierarchical is as close as flat (within the
          strategy's compression error)
  mass    error feedback across nodes loses nothing
  resume  hierarchical state through a checkpoint: bit-exact continuation
  auto    auto switching between hierarchical children
  rd      recursive doubling == ring for 2, 3, 4 and 5 ranks
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _hier_worker import CONFIGS, G, RESUME  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "_hier_worker.py"
WORKER_TIMEOUT_S = 240
LABELS = [c[0] for c in CONFIGS]
OPTS = {c[0]: (c[1], c[2]) for c in CONFIGS}
NODES = 2
EXACT = {"allreduce": 1e-5, "fp16": 2e-3, "bf16": 2e-2}   # max |theta_hier - theta_flat|
PERIODIC = [c[0] for c in CONFIGS if c[1] in ("local", "diloco")]


def _run(kind: str, world: int, out: Path) -> list[dict] | str:
    proc = subprocess.Popen([sys.executable, str(WORKER), kind, str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            text=True)
    try:
        output, _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        where = {p.name: p.read_text().strip().splitlines()[-1:]
                 for p in sorted(out.glob("progress*.log"))}
        return f"{kind} worker hung (> {WORKER_TIMEOUT_S}s); last scenario per rank: {where}"
    ranks = []
    for r in range(world):
        f = out / f"rank{r}.json"
        if not f.exists():
            return f"rank {r} wrote no result (exit {proc.returncode}):\n{output[-4000:]}"
        d = json.loads(f.read_text())
        if "error" in d:
            return d["error"]
        ranks.append(d)
    return ranks


_CACHE: dict[str, object] = {}


@pytest.fixture(scope="module")
def hier(tmp_path_factory):
    if "hier" not in _CACHE:
        _CACHE["hier"] = _run("hier", 4, tmp_path_factory.mktemp("hier"))
    if isinstance(_CACHE["hier"], str):
        pytest.fail(_CACHE["hier"])
    return _CACHE["hier"]


@pytest.fixture(scope="module")
def rd(tmp_path_factory):
    if "rd" not in _CACHE:
        _CACHE["rd"] = _run("rd", 5, tmp_path_factory.mktemp("rd"))
    if isinstance(_CACHE["rd"], str):
        pytest.fail(_CACHE["rd"])
    return _CACHE["rd"]


def _mean(xs):
    xs = xs[1:]  # the first step: DDP's first bucket layout
    return sum(xs) / len(xs)


# -- training -------------------------------------------------------------------
@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("label", LABELS)
def test_hierarchical_trains_and_keeps_replicas_identical(hier, label):
    before = hier[0]["eval_before"]
    flat, node = (hier[0]["train"][f"{label}/{h}"] for h in ("flat", "node"))
    assert node["layout"] == "hierarchical" and flat["layout"] == "flat"
    # every strategy learns hierarchically (24 steps: allreduce cuts the loss
    # ~40x, the slowest, top-k at 10% of the entries, ~3x, as it does flat)
    assert node["eval_loss"] < before / 2.5, (label, node["eval_loss"], before)
    # hierarchical sends less information across nodes (one compressed node
    # mean instead of two compressed ranks' gradients): allowed to learn more
    # slowly, within the factor the flat strategy tests give lossy ones
    assert node["eval_loss"] <= 5.0 * flat["eval_loss"] + 1e-4, (label, node, flat)
    name = OPTS[label][0]
    for r in hier:
        run = r["train"][f"{label}/node"]
        if name not in ("local", "diloco"):
            assert max(run["spreads"]) == 0.0, (label, run["spreads"])  # every step
        assert max(run["node_spreads"]) == 0.0, (label, run["node_spreads"])
        assert run["spread_after_finish"] == 0.0


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
def test_sharded_wire_gives_what_the_whole_group_gives(hier):
    """ShardedWire (2 nodes x 2, sizes 1, 7, 1000: chunks padded): the sum,
    the max and every node's bytes, sync and in flight together, on every
    rank; a node's two ranks hand 1/2 each across, the gather the rest."""
    for rank, r in enumerate(hier):
        w = r["sharded_wire"]
        assert (w["size"], w["rank"]) == (NODES, rank // G)
        for n in ("1", "7", "1000"):
            assert all(w[n][k] for k in ("sum", "max_is_node1", "gather", "async", "done")), \
                (rank, n, w[n])
        # per size, chunk c = ceil(n / 2): four fp32 all-reduces hand c floats
        # across and gather them; two uint8 all-gathers hand c bytes across and
        # gather the 2 nodes' chunks (2c)
        c = sum(-(-n // G) for n in (1, 7, 1000))
        assert w["counted"] == {"cross": 4 * 4 * c + 2 * c, "local": 4 * 4 * c + 2 * 2 * c}


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("label", PERIODIC)
def test_periodic_outer_sync_in_shards_equals_the_leaders(hier, label):
    """local and diloco cross nodes in shards by default: every step the
    node's ranks hold the same adapter (each took the same outer step, none
    was broadcast), and the run ends where the leaders' outer sync ends it
    (2 nodes: each chunk is the same two-term sum as the leaders' buffer)."""
    for r in hier:
        shards, leaders = (r["train"][f"{label}/{h}"] for h in ("node", "leaders"))
        assert (shards["cross_node"], leaders["cross_node"]) == ("shards", "leaders")
        assert max(shards["node_spreads"]) == 0.0 and max(leaders["node_spreads"]) == 0.0
        assert shards["syncs"] == leaders["syncs"] > 0
        diff = max(abs(a - b) for a, b in zip(shards["params"], leaders["params"]))
        assert diff <= 1e-6, (label, diff)


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("label", [lab for lab in LABELS if lab in EXACT])
def test_exact_strategies_hierarchical_equals_flat(hier, label):
    flat, node = (hier[0]["train"][f"{label}/{h}"]["params"] for h in ("flat", "node"))
    diff = max(abs(a - b) for a, b in zip(flat, node))
    assert diff <= EXACT[label], (label, diff)


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("label", [lab for lab in LABELS if OPTS[lab][0] not in ("local",
                                                                                "diloco")])
def test_averaged_gradient_within_compression_error(hier, label):
    """One step from the same start: the hierarchical average is no further
    from the exact mean than the flat strategy's own compression error."""
    err = hier[0]["first"][label]
    assert err["node"] <= 1.5 * err["flat"] + 1e-6, (label, err)


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("label", LABELS)
def test_inter_node_bytes_counted(hier, label):
    """Leaders hand the strategy's bytes for N=2 ranks to the cross-node
    group, the others nothing; every rank hands the node group the bucket
    twice (reduce, broadcast), periodic ones once a step plus the adapter
    every period; flat ranks hand everything to the whole group.  A periodic
    outer sync in shards: every rank hands 1/G of those bytes across nodes
    and its 1/G of the result to the node's gather."""
    from lorasync.catalog import wire_bytes

    name, opts = OPTS[label]
    shapes = [tuple(s) for s in hier[0]["train"][f"{label}/node"]["shapes"]]
    numel = sum(math.prod(s) for s in shapes)
    per_step = name not in ("local", "diloco")
    period = opts.get("period", 1)
    layouts = ("node",) if per_step else ("node", "leaders")
    for rank, r in enumerate(hier):
        flat = r["train"][f"{label}/flat"]["bytes"]
        leader = rank % G == 0
        for layout in layouts:
            node = r["train"][f"{label}/{layout}"]["bytes"]
            shards = layout == "node" and not per_step
            cross = wire_bytes(name, shapes, NODES, **opts)
            want_inter = cross / G if shards else cross if leader else 0.0
            assert _mean(node["inter_bytes"]) == pytest.approx(
                want_inter, rel=0.15 if not per_step else 1e-9), (label, layout, rank)
            # the gather inside the node: the chunk of the sum, or every node's chunk
            gathered = opts.get("delta_dtype") in ("int8", "int4")
            want_intra = (2 * 4 * numel if per_step else 4 * numel + (
                cross / G * (NODES if gathered else 1) if shards else 4 * numel) / period)
            assert _mean(node["intra_bytes"]) == pytest.approx(want_intra, rel=0.15), \
                (label, layout, rank)
            assert node["wire_bytes"] == [a + b for a, b in zip(node["intra_bytes"],
                                                                node["inter_bytes"])]
        assert _mean(flat["inter_bytes"]) == pytest.approx(
            wire_bytes(name, shapes, NODES * G, **opts), rel=0.15 if not per_step else 1e-9)
        assert sum(flat["intra_bytes"]) == 0


def test_compressed_strategies_send_fewer_bytes_across_nodes(hier):
    """Per node: flat top-k hands G payloads to the cross-node all-gather,
    hierarchical one; int8's two phases shrink from G (1 + 1/NG) to 1 + 1/N."""
    def per_node(label, layout):
        return sum(_mean(hier[r]["train"][f"{label}/{layout}"]["bytes"]["inter_bytes"])
                   for r in range(G))
    assert per_node("topk", "flat") == pytest.approx(G * per_node("topk", "node"), rel=0.02)
    assert per_node("int8", "flat") / per_node("int8", "node") > 1.6


# -- error feedback, resume, auto, errors ----------------------------------------
@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("label", ["int8", "onebit", "topk", "powersgd"])
def test_error_feedback_across_nodes_loses_nothing(hier, label):
    m = hier[0]["mass"][label]
    assert m["carry_max"] > 0  # there was something to lose
    assert m["max_err"] <= 1e-6 * max(1.0, m["scale"]), m


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("label", RESUME)
def test_hierarchical_resume_is_bit_exact(hier, label):
    for r in hier:
        assert r["resume"][label]["max_diff"] == 0.0, (label, r["resume"][label])


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("way", ["leaders->shards", "shards->leaders"])
def test_resume_across_the_crossings(hier, way):
    """A streamed DiLoCo checkpoint (sync in flight) saved one way across
    nodes resumes the other way and goes on as the uninterrupted run."""
    for r in hier:
        m = r["resume_across"][way]
        assert m["in_flight"] and m["cross_node"] == way.split("->")[1], m
        assert m["max_diff"] <= 1e-6 and m["node_spread"] == 0.0, m


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
def test_auto_switches_between_hierarchical_children(hier):
    seen = hier[0]["auto"]["seen"]
    assert {tuple(x) for x in seen} >= {("diloco", "hierarchical"), ("int8", "hierarchical"),
                                        ("topk", "hierarchical")}
    for r in hier:
        assert r["auto"]["seen"] == seen          # every rank ran the same strategies
        assert r["auto"]["spread"] == 0.0
        assert r["auto"]["wire"] == r["auto"]["inter"] + r["auto"]["intra"]
    assert hier[1]["auto"]["inter"] < hier[0]["auto"]["inter"]  # the leader crosses nodes


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("cross", ["leaders", "shards"])
def test_auto_moves_diloco_into_the_layout_it_chose(hier, cross):
    """Flat -> hierarchical -> flat DiLoCo (int8 outer sync, so a residual):
    built in the new layout, handed over without crossing nodes, every rank
    ends identical after finish(); the outer sync in shards or by the leaders."""
    for rank, r in enumerate(hier):
        a = r[f"auto_layout/{cross}"]
        assert a["to_node"]["cross_node"] == cross
        for label, (frm, to) in (("to_node", ("flat", "hierarchical")),
                                 ("to_flat", ("hierarchical", "flat"))):
            m = a[label]
            assert (m["before"], m["after"], m["reported"]) == (frm, to, to), (label, m)
            assert m["switches"] == 1, (label, m)
            # nothing crossed the slow link; the node's group carried the move
            assert m["moved_inter"] == 0 and m["moved_bytes"] == m["moved_intra"] > 0, m
            # the mean adapter and the mean debt are kept; a node's ranks agree
            assert m["params_mean_diff"] < 1e-6, (label, m)
            assert m["residual_norm"] > 0 and m["residual_mean_diff"] < 1e-6, (label, m)
            assert m["node_spread"] == 0.0, (label, m)
            # the move is not an outer sync; the new child syncs on its schedule
            assert m["syncs_after"] >= 1, (label, m)
            if "anchor_same" in m:   # flat ranks and leaders hold the state
                assert m["anchor_same"] and m["momentum_same"] and m["momentum_norm"] > 0, m
        assert "anchor_same" in a["to_node"] or (rank % 2 == 1 and cross == "leaders")
        assert a["spread"] == 0.0


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
def test_errors_name_the_problem(hier):
    e = hier[0]["errors"]
    assert "torch_powersgd runs flat only" in e["torch_hook"]
    assert "none runs flat only" in e["none"]
    assert "momentum=false" in e["onebit_adam"]
    assert "auto, flat, node" in e["bad_hierarchy"]
    assert "divide the world size 4" in e["bad_rpn"]
    assert "flat" in e["flat_state"] and e["hier_state_ok"] is None
    assert e["auto_layout_onebit"] == "flat"      # 1-bit Adam stays flat under auto
    assert e["auto_layout_int8"] == "hierarchical"
    assert "shards apply to local and diloco" in e["shards_per_step"]
    assert "cross_node" in e["bad_cross_node"] and "leaders" in e["bad_cross_node"]
    assert e["cross_node_of"] == {"int8": "leaders", "diloco": "shards", "local": "shards"}
    assert e["cross_node_leaders"] == "leaders"


@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("label, tol", [("allreduce_flat", 1e-5), ("diloco_node", 1e-5),
                                        ("fp16_node", 2e-3)])
def test_strategies_run_on_recursive_doubling(hier, label, tol):
    """The same training with the ring, recursive doubling and the per-message
    choice: the same adapter up to rounding; the strategy's all-reduces (the
    leaders' across nodes) really took lorasync's algorithm."""
    for rank, r in enumerate(hier):
        a = r["algo"]
        assert a[f"{label}/rd_vs_ring"] <= tol, (label, rank, a)
        assert a[f"{label}/auto_vs_ring"] <= tol, (label, rank, a)
        if label == "allreduce_flat" or rank % G == 0:
            assert a[f"{label}/recursive_doubling/counts"]["recursive_doubling"] > 0
            assert a[f"{label}/recursive_doubling/counts"]["ring"] == 0
            assert a[f"{label}/ring/counts"]["recursive_doubling"] == 0


# -- recursive doubling --------------------------------------------------------------
@pytest.mark.timeout(WORKER_TIMEOUT_S + 30)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_recursive_doubling_equals_ring(rd, n):
    for rank in range(n):
        r = rd[rank][str(n)]
        assert r["ints"]["exact"]                       # integer-valued: no rounding at all
        for kind in ("floats", "strided"):              # another summation order
            assert r[kind]["max_rel"] <= 1e-6, (n, rank, kind)
        assert r["fp16"]["max_rel"] <= 2e-3
        for kind in ("ints", "floats", "fp16", "strided"):
            assert r[kind]["same_on_every_rank"], (n, rank, kind)
        assert r["max_op"]
        assert r["wire_async"]                          # several in flight, in order
        assert r["wire_counts"] == {"ring": 0, "recursive_doubling": 5}
