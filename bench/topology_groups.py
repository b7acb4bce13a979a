#!/usr/bin/env python3
"""One cross-node group of node leaders, or G cross-node groups that each own
1/G of the message: which all-reduces a buffer across nodes faster?

    sudo .venv/bin/python bench/topology_groups.py --nodes 4 --nproc-per-node 2 \\
        --profiles 10mbit,100mbit+20ms --output bench/results/topology-groups.json

On an emulated cluster (N namespaces, G workers each), every worker times,
for each size, the three parts of a hierarchical exact all-reduce:

    leaders  all-reduce inside the node; the N leaders all-reduce the whole
             buffer; broadcast inside the node        (comm/hierarchy.py)
    shards   all-reduce inside the node; local rank j of every node
             all-reduces chunk j (G groups at once); all-gather inside the node

The cross-node part is what differs; both the cross-node time and the
whole are reported (median of the repeats, the slowest rank's).  The
collectives run alone (no training), on links of the nominal rate.  An
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


def worker(out: str) -> None:
    import torch
    import torch.distributed as dist

    from lorasync.comm.topology import detect

    dist.init_process_group("gloo")
    topo = detect().build_groups(shards=True)
    g, local = topo.local_size, topo.local_group
    res = {}
    for size in SIZES:
        n = size // 4
        buf = torch.ones(n)
        times = {"leaders": [], "shards": [], "leaders_inter": [], "shards_inter": []}
        for rep in range(REPEATS + 1):
            for kind in ("leaders", "shards"):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(buf, group=local)
                t1 = time.perf_counter()
                if kind == "leaders":
                    if topo.is_leader:
                        dist.all_reduce(buf, group=topo.leader_group)
                    t2 = time.perf_counter()
                    dist.broadcast(buf, src=topo.node_ranks[0], group=local)
                else:
                    chunk = buf.view(g, -1)[topo.local_rank].clone()
                    dist.all_reduce(chunk, group=topo.shard_group)
                    t2 = time.perf_counter()
                    dist.all_gather_into_tensor(buf, chunk, group=local)
                t3 = time.perf_counter()
                if rep:  # the first round opens the connections
                    times[kind].append(t3 - t0)
                    times[kind + "_inter"].append(t2 - t1)
        med = {k: statistics.median(v) for k, v in times.items()}
        t = torch.tensor([med[k] for k in sorted(med)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[size] = dict(zip(sorted(med), t.tolist()))
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"topology": topo.describe(), "sizes": res}, fh, indent=1)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--profiles", default="10mbit,100mbit+20ms")
    p.add_argument("--output", default="bench/results/topology-groups.json")
    a = p.parse_args()
    from lorasync.net.cluster import emulated, launch_on_cluster, parse_emulate

    results = {}
    tmp = os.path.abspath(a.output) + ".part"
    for prof in [x.strip() for x in a.profiles.split(",") if x.strip()]:
        rate, _, delay = prof.partition("+")
        spec = parse_emulate(f"nodes={a.nodes},nproc_per_node={a.nproc_per_node},rate={rate}"
                             + (f",delay={delay}" if delay else "") + f",name=tg{os.getpid() % 10000}")
        with emulated(spec) as c:
            rc = launch_on_cluster(c, [os.path.abspath(__file__), "--worker", tmp], module=None,
                                   timeout=900)
        if rc != 0:
            print(f"{prof}: failed (exit {rc})", file=sys.stderr)
            continue
        with open(tmp) as fh:
            results[prof] = json.load(fh)
        os.unlink(tmp)
        print(f"\n{prof} ({results[prof]['topology']}): seconds, slowest rank, median of "
              f"{REPEATS}")
        print(f"{'size':>8} {'leaders x-node':>15} {'shards x-node':>14} {'leaders':>9} "
              f"{'shards':>9}  shards/leaders")
        for size, r in results[prof]["sizes"].items():
            print(f"{int(size) >> 10:>6}KiB {r['leaders_inter']:15.3f} {r['shards_inter']:14.3f} "
                  f"{r['leaders']:9.3f} {r['shards']:9.3f}  {r['shards'] / r['leaders']:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    with open(a.output, "w") as fh:
        json.dump({"nodes": a.nodes, "nproc_per_node": a.nproc_per_node, "repeats": REPEATS,
                   "profiles": results}, fh, indent=1)
    print(f"\nwritten: {a.output}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
