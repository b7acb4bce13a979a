#!/usr/bin/env python3
"""How many collectives one gloo process group runs at once, on a long link.

    sudo .venv/bin/python bench/gloo_lanes.py [--nodes 2] [--rate 100mbit]
        [--delay 50ms] [--json FILE]

torch's ProcessGroupGloo runs a group's collectives on worker threads (two
by default), each collective tagged so that the ranks match them up; NCCL
runs a communicator's collectives one after another on its stream.  The
cost model takes that as ``Net.lanes`` (:func:`lorasync.plan.costmodel.lanes_of`):
it decides how much of a multi-bucket sync's latency overlaps.

On emulated nodes (one rank each, one-way ``--delay``), every rank issues
K asynchronous all-reduces back to back and waits for all of them, for K =
1, 2 and 4, with a small (4 KiB: latency-bound) and a larger (1 MiB)
message; the best of 3 repeats, after a barrier.  With L lanes, K small
all-reduces take about ceil(K / L) times one.  Root is needed (network
namespaces); everything is taken down at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

SIZES = (4096, 1 << 20)
COUNTS = (1, 2, 4)
PORT = 29561

#: the worker, run on every emulated node
WORKER = r"""
import json, os, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://%(addr)s:%(port)d",
                        rank=%(rank)d, world_size=%(world)d)
out = {}
for nbytes in %(sizes)r:
    ts = [torch.ones(nbytes // 4) for _ in range(max(%(counts)r))]
    for _ in range(2):
        dist.all_reduce(ts[0])
    for k in %(counts)r:
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for w in [dist.all_reduce(ts[i], async_op=True) for i in range(k)]:
                w.wait()
            best = min(best, time.perf_counter() - t0)
        out[f"{nbytes}:{k}"] = best
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def main() -> int:
    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import parse_emulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--delay", default="50ms", help="one-way delay between nodes")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", metavar="FILE", help="write the result JSON here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("gloo_lanes: emulated links need root (network namespaces)")
    if a.nodes < 2:
        raise SystemExit(f"--nodes {a.nodes}: use 2 or more")
    spec = parse_emulate(f"nodes={a.nodes},rate={a.rate},delay={a.delay},"
                         f"name=lanes{os.getpid() % 10000}")
    print(f"{spec.describe()}", file=sys.stderr)
    result = None
    with emulated(spec) as cluster:
        addr = cluster.node(0).address
        env = dict(os.environ, GLOO_SOCKET_IFNAME=cluster.node(0).ifname, OMP_NUM_THREADS="1")
        procs = []
        for r in range(a.nodes):
            code = WORKER % {"addr": addr, "port": PORT, "rank": r, "world": a.nodes,
                             "sizes": SIZES, "counts": COUNTS}
            procs.append(subprocess.Popen(cluster.exec_argv(r, [sys.executable, "-c", code]),
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        try:
            outs = [p.communicate(timeout=a.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, (out, err) in zip(procs, outs):
            if p.returncode != 0:
                raise SystemExit(f"gloo_lanes: a worker failed (exit {p.returncode}):\n"
                                 + "\n".join(err.strip().splitlines()[-5:]))
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    result = json.loads(line[7:])
    if result is None:
        raise SystemExit("gloo_lanes: rank 0 printed no result")
    lines = [f"gloo: K all-reduces issued together on {spec.describe()}, best of 3, "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             "| message | " + " | ".join(f"K={k}" for k in COUNTS) + " | K=2 / K=1 | K=4 / K=1 |",
             "|---|" + "---|" * (len(COUNTS) + 2)]
    rows = []
    for b in SIZES:
        t = {k: result[f"{b}:{k}"] for k in COUNTS}
        rows.append({"bytes": b, "seconds": t})
        lines.append(f"| {b} B | " + " | ".join(f"{t[k]:.3f} s" for k in COUNTS)
                     + f" | {t[2] / t[1]:.2f} | {t[4] / t[1]:.2f} |")
    text = "\n".join(lines)
    print(text)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"nodes": a.nodes, "rate": a.rate, "delay": a.delay, "rows": rows,
                       "table": text}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
