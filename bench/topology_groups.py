#!/usr/bin/env python3
"""Exact all-reduces across emulated nodes, timed alone: flat against
hierarchical, and one cross-node group of node leaders against G cross-node
groups that each own 1/G of the message.

    sudo .venv/bin/python bench/topology_groups.py --nodes 4 --nproc-per-node 2 \\
        --profiles 10mbit,100mbit+20ms --output bench/results/topology-groups.json
    sudo .venv/bin/python bench/topology_groups.py --profiles 100mbit+20ms --dilation 5.13 \\
        --sizes 65536,1843200 --dtype fp16 --repeats 7 --output /tmp/outer-sync.json

On an emulated cluster (N namespaces, G workers each), every worker times,
for each size, these ways of all-reducing one buffer over all N*G ranks:

    flat      one all-reduce over every rank (gloo's ring: 2(NG-1) steps,
              each waiting on the slow link)
    leaders   all-reduce inside the node; the N leaders all-reduce the whole
              buffer; broadcast inside the node        (comm/hierarchy.py)
    leaders_rd  the same with recursive doubling across the leaders
              (comm/wire.py; --allreduce-algo recursive_doubling)
    shards    all-reduce inside the node; local rank j of every node
              all-reduces chunk j (G groups at once); all-gather inside the node
    outer / outer_rd  what a hierarchical DiLoCo outer sync does: the N
              leaders all-reduce the delta, then a broadcast inside the node
              (its ranks are already identical: they all-reduce gradients
              inside the node every step).  Compare with flat: the outer
              sync of flat DiLoCo is one all-reduce over every rank.

The cross-node part of each is reported apart (``*_inter``) and the whole,
each from the last rank to enter it to the last to leave it, median of the
repeats.  The collectives run alone (no
training: no compute skew between ranks), on links of the nominal rate, or
dilated like ``lorasync bench --nodes`` (``--dilation S``: rate / S, delay x
S) to reproduce the links of a dilated bench table.  An
emulated node has one shaped link, as a node with one NIC has: G streams
share it.  With several NICs per node (one per GPU pair, as on many
8-GPU servers) the shards could use all of them; that is not emulated here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SIZES = (64 << 10, 1 << 20, 4 << 20)
REPEATS = 5
KINDS = ("flat", "leaders", "leaders_rd", "shards", "outer", "outer_rd")


def _record(times: dict, kind: str, stamps: tuple[float, float, float, float]) -> None:
    """One repeat of ``kind``, timed on the host's clock across every rank: the
    emulated nodes are processes of one host, and ``time.perf_counter`` is its
    CLOCK_MONOTONIC, so the ranks' stamps compare.  A part starts when the
    last rank enters it and ends when the last rank leaves it: each rank's own
    start would count the others' late exit from the barrier (up to a round
    trip) as collective time."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(stamps, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    t = torch.stack(every).max(dim=0).values.tolist()
    times[kind].append(t[3] - t[0])
    times[kind + "_inter"].append(t[2] - t[1])


def worker(out: str, sizes: list[int], dtype: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from lorasync.comm.topology import detect
    from lorasync.comm.wire import _all_gather, recursive_doubling

    dist.init_process_group("gloo")
    topo = detect().build_groups(shards=True)
    g, local = topo.local_size, topo.local_group
    dt = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    res = {}
    for size in sizes:
        buf = torch.ones(size // dt.itemsize, dtype=dt)
        times = {k: [] for kind in KINDS for k in (kind, kind + "_inter")}
        for rep in range(repeats + 1):
            for kind in KINDS:
                buf.fill_(1.0)   # sums of ones stay finite in fp16
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "flat":
                    dist.all_reduce(buf)
                    t1 = t0
                    t2 = t3 = time.perf_counter()
                    if rep:
                        _record(times, kind, (t0, t1, t2, t3))
                    continue
                if not kind.startswith("outer"):
                    dist.all_reduce(buf, group=local)
                t1 = time.perf_counter()
                if kind.startswith(("leaders", "outer")):
                    if topo.is_leader:
                        if kind.endswith("_rd"):
                            recursive_doubling(buf, group=topo.leader_group)
                        else:
                            dist.all_reduce(buf, group=topo.leader_group)
                    t2 = time.perf_counter()
                    dist.broadcast(buf, src=topo.node_ranks[0], group=local)
                else:
                    chunk = buf.view(g, -1)[topo.local_rank].clone()
                    dist.all_reduce(chunk, group=topo.shard_group)
                    t2 = time.perf_counter()
                    _all_gather(buf, chunk, group=local)
                t3 = time.perf_counter()
                if rep:  # the first round opens the connections
                    _record(times, kind, (t0, t1, t2, t3))
        res[size] = {k: statistics.median(v) for k, v in times.items()}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"topology": topo.describe(), "dtype": dtype, "sizes": res}, fh, indent=1)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--profiles", default="10mbit,100mbit+20ms")
    p.add_argument("--dilation", type=float, default=1.0,
                   help="emulate every link at rate / S and delay x S (default 1: nominal)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                   help="message sizes in bytes, comma-separated")
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--output", default="bench/results/topology-groups.json")
    a = p.parse_args()
    step = a.nproc_per_node * (2 if a.dtype == "fp16" else 4)
    sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    if not sizes or any(x <= 0 or x % step for x in sizes):
        p.error(f"--sizes: every size must be a positive multiple of {step} bytes (the "
                f"shards split a message into {a.nproc_per_node} equal {a.dtype} chunks)")
    from lorasync.bench.profiles import dilate
    from lorasync.emulate.launch import emulated, launch_on_cluster
    from lorasync.emulate.spec import parse_emulate

    results = {}
    tmp = os.path.abspath(a.output) + ".part"
    for prof in [x.strip() for x in a.profiles.split(",") if x.strip()]:
        rate, _, delay = prof.partition("+")
        rate, delay = dilate(rate, delay, a.dilation) if a.dilation != 1 else (rate, delay)
        spec = parse_emulate(f"nodes={a.nodes},nproc_per_node={a.nproc_per_node},rate={rate}"
                             + (f",delay={delay}" if delay else "") + f",name=tg{os.getpid() % 10000}")
        with emulated(spec) as c:
            rc = launch_on_cluster(c, [os.path.abspath(__file__), "--worker", tmp, a.sizes,
                                       a.dtype, str(a.repeats)], module=None, timeout=1800)
        if rc != 0:
            print(f"{prof}: failed (exit {rc})", file=sys.stderr)
            continue
        with open(tmp) as fh:
            results[prof] = json.load(fh)
        os.unlink(tmp)
        results[prof]["link"] = spec.describe()
        print(f"\n{prof}, emulated as {spec.describe()} (dilation x{a.dilation:g}; "
              f"{results[prof]['topology']}): seconds from the last rank's entry to the last "
              f"rank's exit, median of {a.repeats}, {a.dtype}")
        print(f"{'size':>10} {'flat':>7} {'leaders':>8} {'leaders_rd':>10} {'shards':>7} "
              f"{'outer':>7} {'outer_rd':>8}  flat/outer  flat/outer_rd  leaders x-node  "
              f"shards x-node")
        for size, r in results[prof]["sizes"].items():
            print(f"{int(size):>10} {r['flat']:7.3f} {r['leaders']:8.3f} {r['leaders_rd']:10.3f} "
                  f"{r['shards']:7.3f} {r['outer']:7.3f} {r['outer_rd']:8.3f}  "
                  f"{r['flat'] / r['outer']:10.2f}  {r['flat'] / r['outer_rd']:13.2f}  "
                  f"{r['leaders_inter']:14.3f}  {r['shards_inter']:13.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    with open(a.output, "w") as fh:
        json.dump({"nodes": a.nodes, "nproc_per_node": a.nproc_per_node, "repeats": a.repeats,
                   "dilation": a.dilation, "dtype": a.dtype, "profiles": results}, fh, indent=1)
    print(f"\nwritten: {a.output}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(sys.argv[2], [int(x) for x in sys.argv[3].split(",")], sys.argv[4],
               int(sys.argv[5]))
        sys.exit(0)
    sys.exit(main())
