"""Encode/decode cost of each sync strategy on a realistic adapter.

    python bench/strategies_micro.py [--steps 20] [--threads 1] [--json]

The adapter has the shapes of SmolLM2-135M with LoRA r=8 on q/k/v/o (30
layers, 921,600 parameters).  Three measurements:

* ``strategy``: the real hook code (``stats()["encode_s"]`` per step: all
  compression and decompression a rank does, index plumbing included) on a
  1-rank gloo group, so no network time is involved.  With n ranks a rank
  encodes the same number of elements in phase 1 and 1/n of them in phase 2,
  so this is close to the per-rank cost at any world size.
* ``loopback``: what ``auto`` times at start for the strategies it has not
  run (``lorasync.comm.loopback.time_encode``: the hooks alone, as on 2
  ranks, wall time per step), in ms per step for this adapter; for DiLoCo
  (and its outer-sync variants) one whole sync, i.e. ``period`` steps' worth.
* ``codec``: the bare compressor round trip on the flat 921,600 values
  (``torch.utils.benchmark``), for comparison.

Median and spread over steps; never part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.utils.benchmark as tb

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import lorasync  # noqa: E402
from lorasync.comm import compress as C  # noqa: E402
from lorasync.comm.loopback import time_encode  # noqa: E402

LAYER = [(8, 576), (576, 8), (8, 576), (192, 8), (8, 576), (192, 8), (8, 576), (576, 8)]
SHAPES = LAYER * 30

STRATEGIES = [
    ("allreduce", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("onebit", {}),
    ("topk", {"ratio": 0.01}), ("powersgd", {"rank": 1}), ("powersgd", {"rank": 2}),
]


#: DiLoCo's outer syncs (one whole sync each: divide by the period for a step)
DILOCO_VARIANTS = [
    ("diloco", {"delta_dtype": "fp16"}), ("diloco", {"delta_dtype": "int8"}),
    ("diloco", {"delta_dtype": "int4"}), ("diloco", {"delta_dtype": "int4", "delta_topk": 0.03}),
    ("diloco", {"delta_dtype": "int8", "fragments": 8}),
]


class Adapter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in SHAPES)

    def forward(self, gs):
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


def bench_strategies(steps: int) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(s, generator=gen) * 1e-3 for s in SHAPES] for _ in range(4)]
    for name, opts in STRATEGIES:
        model = Adapter()
        ddp = torch.nn.parallel.DistributedDataParallel(model, init_sync=False,
                                                        broadcast_buffers=False)
        sync = lorasync.attach(ddp, name, **opts)
        per_step = []
        for s in range(steps + 2):
            before = sync.stats()["encode_s"]
            ddp(grads[s % len(grads)]).backward()
            model.zero_grad(set_to_none=True)
            sync.after_step()
            if s >= 2:  # skip DDP's first iteration and its bucket rebuild
                per_step.append(sync.stats()["encode_s"] - before)
        label = name + "".join(f" {k}={v}" for k, v in opts.items())
        out.append({"what": "strategy", "name": label, "median_ms": 1e3 * statistics.median(per_step),
                    "min_ms": 1e3 * min(per_step), "max_ms": 1e3 * max(per_step), "n": len(per_step),
                    "buckets": len(sync.bucket_sizes)})
    return out


def bench_loopback(calls: int) -> list[dict]:
    params = [torch.zeros(s) for s in SHAPES]
    n = sum(p.numel() for p in params)
    out = []
    for name, opts in STRATEGIES + [("local", {}), ("diloco", {})] + DILOCO_VARIANTS:
        runs = [time_encode(name, params, 2, options=opts, bucket_cap_bytes=1 << 20,
                            calls=calls, seed=i) * n * 1e-6 for i in range(3)]
        label = name + "".join(f" {k}={v}" for k, v in opts.items())
        out.append({"what": "loopback", "name": label, "median_ms": statistics.median(runs),
                    "min_ms": min(runs), "max_ms": max(runs), "n": len(runs)})
    return out


def bench_codecs() -> list[dict]:
    n = sum(torch.Size(s).numel() for s in SHAPES)
    x = torch.randn(n)
    k = n // 100
    cases = {  # equal blocks: the reshape path (n is a multiple of both block sizes)
        "int8 blockwise (256) encode+decode": lambda: C.int8_decode(*C.int8_encode(x, 256, n // 256), 256),
        "onebit (512) encode+decode": lambda: C.onebit_decode(*C.onebit_encode(x, 512, n // 512), 512),
        "topk 1% encode+decode": lambda: C.topk_decode(*C.topk_encode(x, k), n),
        "fp16 cast there and back": lambda: x.half().float(),
    }
    out = []
    for label, fn in cases.items():
        m = tb.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5)
        out.append({"what": "codec", "name": label, "median_ms": 1e3 * m.median,
                    "min_ms": 1e3 * min(m.times), "max_ms": 1e3 * max(m.times), "n": len(m.times)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            rows = bench_strategies(args.steps) + bench_loopback(5) + bench_codecs()
        finally:
            dist.destroy_process_group()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    n = sum(torch.Size(s).numel() for s in SHAPES)
    print(f"adapter: {n:,} parameters ({len(SHAPES)} tensors), {args.threads} thread(s)")
    print(f"{'':8} {'name':38} {'median ms':>10} {'min':>8} {'max':>8}")
    for r in rows:
        print(f"{r['what']:8} {r['name']:38} {r['median_ms']:10.2f} {r['min_ms']:8.2f} {r['max_ms']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
