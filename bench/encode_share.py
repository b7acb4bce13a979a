#!/usr/bin/env python3
"""Encode+decode of DiLoCo's outer syncs as a share of a GPU user's step.

    flock /work/bench.lock .venv/bin/python bench/encode_share.py \
        [--workloads smollm2-h200,llama2-7b-r16-h100] [--threads 1] [--repeats 3] \
        [--device cpu|cuda] [--json bench/reference/encode/cpu.json]

A compressed outer sync saves link time only if coding it costs less than
the bytes it saves.  The issue's bar: encode+decode of the new variants at
most 5% of a GPU-equivalent step.  For each workload preset
(``lorasync.bench.workloads``: the adapter's real shapes, and the GPU step
the preset states) and each outer-sync variant, this times one whole sync's
encode and decode as ``auto`` times it at start
(``lorasync.comm.loopback.time_encode``: the strategy's own hooks, as on 2
ranks: encode its delta, decode both ranks' buffers, error feedback), on
``--device``, and divides by the sync's period and by the preset's GPU
step: the share of every step the codec costs.

On a CUDA machine ``--device cuda`` is the measurement the bar asks for
(``bench/gpu_check.py`` runs it in its ``codecs`` section).  On this CPU
host the figure is one CPU thread's (``--threads``, one per rank as when
ranks share cores), a different device from the GPU whose step it is
compared with: it says what the codec costs where no GPU encodes it, and it
is not the GPU figure.

Result: a small JSON (bench/reference/encode/; docs/bytes.md's table
``encode-share`` is generated from it by bench/tables.py).  Median and
range over ``--repeats`` timings.  Run it under ``flock /work/bench.lock``
on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from lorasync.bench.workloads import PRESETS, get_workload  # noqa: E402
from lorasync.comm.loopback import time_encode  # noqa: E402
from lorasync.plan.costmodel import lora_matrices  # noqa: E402

#: (label, DiLoCo options): the outer syncs of the bytes-to-target table
VARIANTS = [
    ("fp16, dense", {"delta_dtype": "fp16"}),
    ("int8, dense", {"delta_dtype": "int8"}),
    ("int4, dense", {"delta_dtype": "int4"}),
    ("int2, dense", {"delta_dtype": "int2"}),
    ("int4, top 3%", {"delta_dtype": "int4", "delta_topk": 0.03}),
    ("int2, top 3% (SparseLoCo-style)", {"delta_dtype": "int2", "delta_topk": 0.03,
                                         "outer_momentum": 0.0, "outer_lr": 1.0,
                                         "delta_ef_decay": 0.95}),
]
PERIOD = 8   # DiLoCo's default: one outer sync every 8 steps
BAR = 0.05   # the bar: at most 5% of a step


def measure(workload: str, device: str, repeats: int) -> dict:
    """One preset: every variant's ms per sync on ``device`` and its share of
    the preset's GPU step at one sync every PERIOD steps."""
    w = get_workload(workload)
    params = [torch.zeros(s, device=device) for s in lora_matrices(w.shape, w.lora_r, w.targets)]
    n = sum(p.numel() for p in params)
    rows = []
    for label, opts in VARIANTS:
        t = [time_encode("diloco", params, 2, options=opts, calls=2, seed=i) * n * 1e-6
             for i in range(repeats)]
        ms = statistics.median(t)
        share = ms / PERIOD / (1e3 * w.gpu_step_s)
        rows.append({"variant": label, "options": opts, "ms_per_sync": ms, "min_ms": min(t),
                     "max_ms": max(t), "share_of_step": share, "within_bar": share <= BAR})
        print(f"  {workload:20} {label:34} {ms:9.1f} ms a sync ({min(t):.1f}-{max(t):.1f}), "
              f"{100 * share:5.2f}% of a {w.gpu_step_s:g} s step at period {PERIOD}",
              file=sys.stderr, flush=True)
    return {"workload": w.as_dict(), "adapter_values": n, "tensors": len(params), "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(PRESETS),
                    help=f"comma-separated presets (default: all: {', '.join(PRESETS)})")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="FILE", help="write the result JSON here")
    a = ap.parse_args()
    names = [x for x in a.workloads.split(",") if x]
    for x in names:
        if x not in PRESETS:
            print(f"error: --workloads: {x!r} is not a preset; use {', '.join(PRESETS)}",
                  file=sys.stderr)
            return 2
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here (torch.cuda.is_available() is False); "
              "use --device cpu", file=sys.stderr)
        return 2
    if a.repeats < 1 or a.threads < 1:
        print("error: --repeats and --threads must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    t0 = time.time()
    res = {"device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
           "cpu": platform.processor() or platform.machine(), "threads": a.threads,
           "torch": torch.__version__, "period": PERIOD, "bar": BAR, "repeats": a.repeats,
           "workloads": [measure(x, a.device, a.repeats) for x in names],
           "date": time.strftime("%Y-%m-%d %H:%M")}
    res["wall_s"] = time.time() - t0
    sys.path.insert(0, HERE)
    from tables import encode_share as table
    print(table(res))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
