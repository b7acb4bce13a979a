"""Worker for tests/dist/test_hierarchy.py: 4 gloo ranks on loopback taken as
2 nodes x 2 ranks (``ranks_per_node=2``), every strategy flat and
hierarchical; and lorasync's recursive-doubling all-reduce against gloo's
ring on groups of 2 to 5 ranks.

    python tests/dist/_hier_worker.py hier OUT_DIR      # 4 ranks
    python tests/dist/_hier_worker.py rd OUT_DIR        # 5 ranks

Each rank writes OUT_DIR/rank<rank>.json (and progress<rank>.log as it goes).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _strat_model as M  # noqa: E402

G = 2            # ranks per "node"
STEPS = 24
LR = 1e-2
BUCKET_MB = 0.001
#: (label, strategy, options)
CONFIGS = [
    ("allreduce", "allreduce", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("onebit", "onebit", {"block": 32, "warmup_steps": 0, "momentum": False}),
    ("topk", "topk", {"ratio": 0.1}),
    ("powersgd", "powersgd", {"rank": 1}),
    ("local", "local", {"period": 4}),
    ("diloco", "diloco", {"period": 4}),
    ("diloco_streaming", "diloco", {"period": 4, "streaming": True, "delta_dtype": "fp16"}),
    ("diloco_int8", "diloco", {"period": 4, "delta_dtype": "int8"}),
]
RESUME = ["int8", "topk", "diloco_streaming", "powersgd"]
RESUME_AT, RESUME_END = 6, 14


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(
        model, init_sync=False, broadcast_buffers=False, bucket_cap_mb=BUCKET_MB)


def _opt(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def _spread(flat):
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return max(float((o - out[0]).abs().max()) for o in out)


def _attach(model, name, opts, hierarchy):
    """``hierarchy``: flat, node, or leaders (node, a periodic strategy's
    outer sync carried by the node leaders instead of in shards)."""
    import lorasync
    ddp = _ddp(model)
    cross = "leaders" if hierarchy == "leaders" else "auto"
    return ddp, lorasync.attach(ddp, name, hierarchy="flat" if hierarchy == "flat" else "node",
                                ranks_per_node=G, cross_node=cross, **opts)


def _step(ddp, opt, sync, s, rank, teach, variable=True):
    x, y = M.batch(s, rank, variable, teach)
    ddp.module.jitter_s = M.jitter(s, rank) if variable else None
    ((ddp(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync.after_step()


def scenario_train(rank, name, opts, hierarchy, teach, ev):
    model = M.build(0)
    ddp, sync = _attach(model, name, opts, hierarchy)
    opt = _opt(model)
    keys = ("wire_bytes", "intra_bytes", "inter_bytes")
    per_step = {k: [] for k in keys}
    spreads, node_spreads = [], []
    last = sync.stats()
    for s in range(1, STEPS + 1):
        _step(ddp, opt, sync, s, rank, teach)
        st = sync.stats()
        for k in keys:
            per_step[k].append(st[k] - last[k])
        last = st
        spreads.append(_spread(_flat(model)))
        node_spreads.append(_node_spread(_flat(model)))
    sync.finish()
    with torch.no_grad():
        loss = float(((model(ev[0]) - ev[1]) ** 2).mean())
    return {"params": _flat(model).tolist(), "eval_loss": loss, "bytes": per_step,
            "spreads": spreads, "spread_after_finish": _spread(_flat(model)),
            "node_spreads": node_spreads, "cross_node": st.get("cross_node"),
            "layout": st.get("layout", "flat"), "syncs": st["syncs"],
            "shapes": [list(p.shape) for p in model.parameters() if p.requires_grad]}


def scenario_first_gradient(rank, name, opts, teach):
    """The averaged gradient of one step: hierarchical, flat and exact (fp64)."""
    out = {}
    for hierarchy in ("flat", "node"):
        model = M.build(0)
        ddp, sync = _attach(model, name, opts, hierarchy)
        x, y = M.batch(1, rank, False, teach)
        ((ddp(x) - y) ** 2).mean().backward()
        out[hierarchy] = torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                    if p.requires_grad]).double()
        sync.finish()
    ref = M.build(0)
    x, y = M.batch(1, rank, False, teach)
    ((ref(x) - y) ** 2).mean().backward()
    g = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.requires_grad]).double()
    dist.all_reduce(g)
    g /= dist.get_world_size()
    # relative L2 error of the averaged gradient (max-norm is the one dropped
    # entry for top-k, the same whatever the layout)
    return {k: float((v - g).norm() / g.norm()) for k, v in out.items()}


def scenario_mass(rank, name, opts, teach, steps=8):
    """Error feedback across nodes loses nothing: the applied (synced)
    gradients plus what the strategy still owes (auto's carry: the leaders'
    residuals in node units) sum to the true mean gradients."""
    from lorasync.comm.auto.switch import residual_owed

    n = dist.get_world_size()
    model, ref = M.build(0), M.build(0)
    ddp, sync = _attach(model, name, opts, "node")
    applied = torch.zeros(sync.numel, dtype=torch.float64)
    true = torch.zeros_like(applied)
    for s in range(1, steps + 1):
        x, y = M.batch(s, rank, True, teach)
        ((ddp(x) - y) ** 2).mean().backward()
        applied += torch.cat([p.grad.reshape(-1) for p in model.parameters()
                              if p.requires_grad]).double()
        model.zero_grad(set_to_none=True)
        ((ref(x) - y) ** 2).mean().backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.requires_grad]).double()
        ref.zero_grad(set_to_none=True)
        dist.all_reduce(g)
        true += g / n
        sync.after_step()
    carry = residual_owed(sync).double()
    dist.all_reduce(carry)
    carry /= n
    return {"max_err": float((applied + carry - true).abs().max()),
            "scale": float(true.abs().max()), "carry_max": float(carry.abs().max())}


def scenario_resume(rank, name, opts, teach):
    model = M.build(0)
    ddp, sync = _attach(model, name, opts, "node")
    opt = _opt(model)
    for s in range(1, RESUME_AT + 1):
        _step(ddp, opt, sync, s, rank, teach)
    ckpt = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
            copy.deepcopy(sync.state_dict()))
    for s in range(RESUME_AT + 1, RESUME_END + 1):
        _step(ddp, opt, sync, s, rank, teach)
    uninterrupted = _flat(model)
    model2 = M.build(0)
    model2.load_state_dict(ckpt[0])
    ddp2, sync2 = _attach(model2, name, opts, "node")
    opt2 = _opt(model2)
    opt2.load_state_dict(ckpt[1])
    sync2.load_state_dict(ckpt[2])
    for s in range(RESUME_AT + 1, RESUME_END + 1):
        _step(ddp2, opt2, sync2, s, rank, teach)
    return {"max_diff": float((uninterrupted - _flat(model2)).abs().max())}


def scenario_resume_across(rank, teach):
    """Streamed DiLoCo (a sync in flight at the checkpoint) saved by the
    leaders and resumed in shards, and the other way: the run goes on as if
    never interrupted (2 nodes: the two crossings add the same two terms)."""
    name, opts = "diloco", {"period": 4, "streaming": True, "delta_dtype": "fp16"}
    out = {}
    for saved, resumed in (("leaders", "shards"), ("shards", "leaders")):
        def build(cross, sd=None):
            import lorasync
            m = M.build(0)
            if sd is not None:
                m.load_state_dict(sd)
            ddp = _ddp(m)
            return m, ddp, lorasync.attach(ddp, name, hierarchy="node", ranks_per_node=G,
                                           cross_node=cross, **opts)
        model, ddp, sync = build(saved)
        opt = _opt(model)
        cut = 8     # the outer sync launched after step 8 is applied after step 9
        for s in range(1, cut + 1):
            _step(ddp, opt, sync, s, rank, teach)
        ckpt = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                copy.deepcopy(sync.state_dict()))
        in_flight = bool(sync.in_flight)
        for s in range(cut + 1, RESUME_END + 1):
            _step(ddp, opt, sync, s, rank, teach)
        uninterrupted = _flat(model)
        model2, ddp2, sync2 = build(resumed, ckpt[0])
        opt2 = _opt(model2)
        opt2.load_state_dict(ckpt[1])
        sync2.load_state_dict(ckpt[2])
        for s in range(cut + 1, RESUME_END + 1):
            _step(ddp2, opt2, sync2, s, rank, teach)
        out[f"{saved}->{resumed}"] = {
            "max_diff": float((uninterrupted - _flat(model2)).abs().max()),
            "in_flight": in_flight, "cross_node": sync2.cross_node,
            "node_spread": _node_spread(_flat(model2))}
    return out


def scenario_auto(rank, teach):
    """auto on 2 x 2: both layouts measured, hierarchical children switched
    between (forced) without a hang; replicas identical at the end."""
    import lorasync

    model = M.build(0)
    ddp = _ddp(model)
    opt = _opt(model)
    sync = lorasync.attach(ddp, "auto", hierarchy="node", ranks_per_node=G, probe="live",
                           measure_steps=2, interval=4, log=False, encode_probe=False,
                           force_switch_at="5:int8,9:diloco,13:topk")
    sync.set_optimizer(opt)
    seen = []
    for s in range(1, 17):
        _step(ddp, opt, sync, s, rank, teach)
        st = sync.stats()
        seen.append([st["strategy"], st["layout"]])
    sync.finish()
    st = sync.stats()
    return {"seen": seen, "spread": _spread(_flat(model)), "inter": st["inter_bytes"],
            "intra": st["intra_bytes"], "wire": st["wire_bytes"]}


def _mean(t):
    t = t.detach().clone().float()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _diloco_state(child):
    """(anchor, outer momentum, residual) of a flat DiLoCo or a hierarchical
    one's leader, or with shards of every rank (None on a node's other ranks
    with leaders)."""
    d = getattr(child, "inner", child)
    if d is None:
        return None
    return d._anchor.clone(), d._momentum.clone(), d._residual.clone()


def scenario_auto_layout(rank, teach, cross_node):
    """auto moving DiLoCo from the layout it measured in (flat) to the
    hierarchical one and back: the child is built anew there (reconfigured in
    place it stayed flat while auto reported hierarchical), and handed over
    without averaging across nodes: anchor and outer momentum carried, the
    mean over all ranks of the adapter and of the residual kept, every byte
    of the move inside a node.  A hierarchical DiLoCo's residual is in
    node-mean units: on the leader only (``leaders``: G times it on the
    leader is the node's debt) or on every rank (``shards``)."""
    import lorasync

    model = M.build(0)
    ddp = _ddp(model)
    opt = _opt(model)
    opts = {"period": 2, "delta_dtype": "int8", "streaming": False}
    sync = lorasync.attach(ddp, "auto", hierarchy="auto", ranks_per_node=G, probe="live",
                           measure_steps=100, log=False, encode_probe=False,
                           candidates="diloco", cross_node=cross_node,
                           **{f"diloco.{k}": v for k, v in opts.items()})
    units = G if cross_node == "leaders" else 1
    sync.set_optimizer(opt)
    out = {}
    for s in (1, 2, 3):      # an outer sync at 2 (anchor, momentum, residual), 3 on its own
        _step(ddp, opt, sync, s, rank, teach)
    for label, layout, steps in (("to_node", "hierarchical", (4, 5, 6)),
                                 ("to_flat", "flat", (7, 8, 9))):
        old = sync._child
        before_layout = old.layout
        state = _diloco_state(old)
        mean_params = _mean(_flat(model))
        mean_res = _mean(getattr(old, "inner", old)._residual if state is not None
                         else torch.zeros_like(mean_params))
        if label == "to_flat":   # the node's residual, in node-mean units
            mean_res = mean_res * units
        st0 = sync.stats()
        sync._switcher.layout = layout    # what the first choice decides
        sync._switch("diloco", opts, f"test: {label}")
        st1 = sync.stats()
        new = sync._child
        moved = _diloco_state(new)
        res_now = moved[2] if moved is not None else torch.zeros_like(mean_params)
        if label == "to_node" and moved is not None:
            res_now = res_now * units
        r = {"before": before_layout, "after": new.layout, "reported": st1["layout"],
             "params_mean_diff": float((_mean(_flat(model)) - mean_params).abs().max()),
             "residual_mean_diff": float((_mean(res_now) - mean_res).abs().max()),
             "residual_norm": float(mean_res.abs().max()),
             "node_spread": _node_spread(_flat(model)),
             "moved_bytes": st1["wire_bytes"] - st0["wire_bytes"],
             "moved_intra": st1["intra_bytes"] - st0["intra_bytes"],
             "moved_inter": st1["inter_bytes"] - st0["inter_bytes"],
             "switches": st1["switches"] - st0["switches"],
             "cross_node": getattr(new, "cross_node", None)}
        if state is not None and moved is not None:
            r["anchor_same"] = bool(torch.equal(state[0], moved[0]))
            r["momentum_same"] = bool(torch.equal(state[1], moved[1]))
            r["momentum_norm"] = float(state[1].abs().max())
        for s in steps:
            _step(ddp, opt, sync, s, rank, teach)
        r["syncs_after"] = new.stats()["syncs"]
        out[label] = r
    sync.finish()
    out["spread"] = _spread(_flat(model))
    return out


def _node_spread(flat):
    """The largest difference between two ranks of one node."""
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    node = dist.get_rank() // G
    mine = out[node * G:(node + 1) * G]
    return max(float((o - mine[0]).abs().max()) for o in mine)


def scenario_algo(rank, teach):
    """The strategy's all-reduces with lorasync's recursive doubling (and the
    per-message choice) give what the ring gives, flat and across leaders."""
    import lorasync

    out = {}
    for label, name, opts, hierarchy in (("allreduce_flat", "allreduce", {}, "flat"),
                                         ("diloco_node", "diloco", {"period": 2}, "node"),
                                         ("fp16_node", "fp16", {}, "node")):
        params = {}
        for algo in ("ring", "recursive_doubling", "auto"):
            model = M.build(0)
            ddp = _ddp(model)
            opt = _opt(model)
            sync = lorasync.attach(ddp, name, hierarchy=hierarchy, ranks_per_node=G,
                                   allreduce_algo=algo, **opts)
            for s in range(1, 7):
                _step(ddp, opt, sync, s, rank, teach)
            sync.finish()
            wire = sync.inner.wire if getattr(sync, "inner", None) is not None else sync.wire
            params[algo] = _flat(model)
            out[f"{label}/{algo}/counts"] = dict(wire.algo_counts)
        out[f"{label}/rd_vs_ring"] = float((params["recursive_doubling"] - params["ring"])
                                           .abs().max())
        out[f"{label}/auto_vs_ring"] = float((params["auto"] - params["ring"]).abs().max())
    return out


def scenario_sharded_wire(rank):
    """ShardedWire on 2 nodes x 2, for sizes that do not split evenly: every
    rank gets the sum (and the max) over the nodes and every node's bytes in
    node order, synchronous and in flight together."""
    from lorasync.comm.topology import detect
    from lorasync.comm.wire import ShardedWire, Wire

    topo = detect(None, G).build_groups(shards=True)
    counted = {"cross": 0, "local": 0}

    def counter(k):
        return lambda n: counted.__setitem__(k, counted[k] + n)

    wire = ShardedWire(Wire(topo.shard_group, counter("cross")),
                       Wire(topo.local_group, counter("local")))
    node = rank // G
    out = {"size": wire.size, "rank": wire.rank}
    for n in (1, 7, 1000):
        # the same on both ranks of a node, different between nodes
        x = torch.arange(n, dtype=torch.float32) * (node + 1) + node
        want = sum(torch.arange(n, dtype=torch.float32) * (k + 1) + k for k in range(2))
        got = x.clone()
        assert wire.all_reduce(got) is None
        mx = x.clone()
        wire.all_reduce(mx, op=dist.ReduceOp.MAX)
        b = torch.arange(n, dtype=torch.uint8) + 10 * node
        gathered = torch.empty(2 * n, dtype=torch.uint8)
        wire.all_gather(gathered, b)
        # in flight together, waited in issue order
        a1, a2 = x.clone(), x.clone() * 2
        w1 = wire.all_reduce(a1, async_op=True)
        g2 = torch.empty(2 * n, dtype=torch.uint8)
        w2 = wire.all_gather(g2, b, async_op=True)
        w3 = wire.all_reduce(a2, async_op=True)
        for w in (w1, w2, w3):
            w.wait()
        w1.wait()    # a second wait does nothing
        out[str(n)] = {
            "sum": bool(torch.equal(got, want)),
            "max_is_node1": bool(torch.equal(mx, torch.arange(n, dtype=torch.float32) * 2 + 1)),
            "gather": bool(torch.equal(gathered, torch.cat([torch.arange(n, dtype=torch.uint8)
                                                            + 10 * k for k in range(2)]))),
            "async": bool(torch.equal(a1, want) and torch.equal(a2, 2 * want)
                          and torch.equal(g2, gathered)),
            "done": w1.is_completed()}
    out["counted"] = counted
    return out


def scenario_errors(rank):
    import lorasync

    out = {}

    def attempt(fn):
        try:
            fn()
            return None
        except ValueError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - a wrong error type
            return f"NOT A ValueError: {type(e).__name__}: {e}"

    def make(name, hierarchy="node", **opts):
        return lorasync.attach(_ddp(M.build(0)), name, hierarchy=hierarchy, ranks_per_node=G,
                               **opts)

    out["torch_hook"] = attempt(lambda: make("torch_powersgd"))
    out["none"] = attempt(lambda: make("none"))
    out["onebit_adam"] = attempt(lambda: make("onebit"))
    out["bad_hierarchy"] = attempt(lambda: make("allreduce", hierarchy="tree"))
    out["bad_rpn"] = attempt(lambda: lorasync.attach(_ddp(M.build(0)), "allreduce",
                                                     ranks_per_node=3))
    flat_sd = make("int8", hierarchy="flat").state_dict()
    out["flat_state"] = attempt(lambda: make("int8").load_state_dict(flat_sd))
    hier_sd = make("int8").state_dict()
    out["hier_state_ok"] = attempt(lambda: make("int8").load_state_dict(hier_sd))
    # auto hierarchy leaves 1-bit Adam flat, and picks the layout for the others
    out["auto_layout_onebit"] = make("onebit", hierarchy="auto").layout
    out["auto_layout_int8"] = make("int8", hierarchy="auto").layout
    out["shards_per_step"] = attempt(lambda: make("int8", cross_node="shards"))
    out["bad_cross_node"] = attempt(lambda: make("diloco", cross_node="ring", period=2))
    out["cross_node_of"] = {n: make(n, **o).cross_node for n, o in
                            (("int8", {}), ("diloco", {"period": 2}), ("local", {"period": 2}))}
    out["cross_node_leaders"] = make("diloco", cross_node="leaders", period=2).cross_node
    return out


def run_hier(rank, world, out_dir, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    log = open(os.path.join(out_dir, f"progress{rank}.log"), "a", buffering=1)
    teach = M.teacher(0)
    ev = M.eval_set(teach)
    res: dict = {"train": {}, "first": {}, "mass": {}, "resume": {}}
    with torch.no_grad():
        res["eval_before"] = float(((M.build(0)(ev[0]) - ev[1]) ** 2).mean())
    try:
        log.write("errors\n")
        res["errors"] = scenario_errors(rank)
        log.write("sharded wire\n")
        res["sharded_wire"] = scenario_sharded_wire(rank)
        for label, name, opts in CONFIGS:
            for hierarchy in ("flat", "node") + (("leaders",) if name in ("local", "diloco")
                                                 else ()):
                log.write(f"train {label} {hierarchy}\n")
                res["train"][f"{label}/{hierarchy}"] = scenario_train(rank, name, opts,
                                                                     hierarchy, teach, ev)
            if name not in ("local", "diloco"):
                log.write(f"first {label}\n")
                res["first"][label] = scenario_first_gradient(rank, name, opts, teach)
        for label, name, opts in CONFIGS:
            if name in ("int8", "onebit", "topk", "powersgd"):
                log.write(f"mass {label}\n")
                res["mass"][label] = scenario_mass(rank, name, opts, teach)
        for label, name, opts in CONFIGS:
            if label in RESUME:
                log.write(f"resume {label}\n")
                res["resume"][label] = scenario_resume(rank, name, opts, teach)
        log.write("resume across crossings\n")
        res["resume_across"] = scenario_resume_across(rank, teach)
        log.write("auto\n")
        res["auto"] = scenario_auto(rank, teach)
        for cross in ("leaders", "shards"):
            log.write(f"auto layout {cross}\n")
            res[f"auto_layout/{cross}"] = scenario_auto_layout(rank, teach, cross)
        log.write("algo\n")
        res["algo"] = scenario_algo(rank, teach)
        log.write("done\n")
    except Exception:
        res["error"] = traceback.format_exc()
        log.write("error\n" + res["error"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    log.close()
    dist.destroy_process_group()


def run_rd(rank, world, out_dir, port):
    """lorasync's recursive doubling against gloo's ring on ranks 0..k-1, k = 2..5."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from lorasync.comm.wire import Wire, recursive_doubling

    res: dict = {}
    try:
        groups = {k: dist.new_group(list(range(k))) for k in range(2, world + 1)}
        for k, grp in groups.items():
            if rank >= k:
                continue
            g = torch.Generator().manual_seed(100 * k + rank)
            r: dict = {}
            ints = torch.randint(-1000, 1000, (1003,), generator=g).float()
            floats = torch.randn(4099, generator=g)
            halves = torch.randn(257, generator=g).half()
            # a strided view: reduced in a contiguous copy, written back in place
            strided = torch.randn(33, 8, generator=g)[:, ::2]
            for label, t in (("ints", ints), ("floats", floats), ("fp16", halves),
                             ("strided", strided)):
                ring, rd = t.clone(), t
                dist.all_reduce(ring, group=grp)
                assert recursive_doubling(rd, group=grp) is rd
                every = [torch.empty_like(rd) for _ in range(k)]
                dist.all_gather(every, rd.contiguous(), group=grp)
                r[label] = {"exact": bool(torch.equal(ring, rd)),
                            "max_rel": float((ring.double() - rd.double()).abs().max()
                                             / ring.double().abs().max()),
                            "same_on_every_rank": all(torch.equal(e, rd) for e in every)}
            mx = floats.clone()
            recursive_doubling(mx, op=dist.ReduceOp.MAX, group=grp)
            ref = floats.clone()
            dist.all_reduce(ref, op=dist.ReduceOp.MAX, group=grp)
            r["max_op"] = bool(torch.equal(mx, ref))
            # through a Wire: several in flight at once, issued in order, and a
            # native all-reduce between them on the same group
            wire = Wire(grp, lambda n: None, algo="recursive_doubling")
            ts = [torch.full((64 * (i + 1),), float(rank + i), device="cpu") for i in range(5)]
            works = [wire.all_reduce(t, async_op=True) for t in ts[:3]]
            native = torch.ones(16)
            dist.all_reduce(native, group=grp)
            works += [wire.all_reduce(t, async_op=True) for t in ts[3:]]
            vals = [w.get_future().wait()[0] for w in works]
            r["wire_async"] = all(float(v[0]) == sum(q + i for q in range(k)) and v is t
                                  for i, (v, t) in enumerate(zip(vals, ts)))
            r["wire_counts"] = dict(wire.algo_counts)
            res[str(k)] = r
    except Exception:
        res["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    kind, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    world = {"hier": 4, "rd": 5}[kind]
    fn = {"hier": run_hier, "rd": run_rd}[kind]
    mp.spawn(fn, args=(world, out_dir, _free_port()), nprocs=world, join=True)
