#!/usr/bin/env python3
"""GPU figures for the planner and the README (run on a CUDA machine).

    python bench/gpu_check.py [--steps 10]

1. Compute time of one training step of the embedded default's architecture
   (SmolLM2-135M config, random weights: the weights do not change the
   timing) + LoRA r=8 on q/k/v/o, batch 4 x 64 tokens, fp32 and bf16
   autocast: the compute_s a GPU node brings to the cost model.  Measured on
   an H200: 0.18 s (fp32 and bf16 alike: this small batch is bound by kernel
   launches), against ~1.3 s on one CPU thread, so the same 3.7 MB sync
   dominates sooner.
2. Encode+decode time of every strategy on the embedded default's adapter
   (921,600 values in 240 tensors) on the GPU, as ``auto`` times it at start
   (``lorasync.comm.loopback.time_encode``: the strategy's hooks alone, as on
   2 ranks), in ms per sync, and the catalog's CPU figure next to it.
Medians over repeats, CUDA-synchronised.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from lorasync import catalog  # noqa: E402
from lorasync.comm.loopback import time_encode  # noqa: E402
from lorasync.config import LoraSettings  # noqa: E402
from lorasync.plan.costmodel import MODELS, encode_ns, lora_matrices  # noqa: E402
from lorasync.train.model import add_lora  # noqa: E402


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def step_time(steps: int, bf16: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_json_file(os.path.join(os.path.dirname(__file__), "assets",
                                                  "smollm2-135m-config.json"))
    torch.manual_seed(0)
    model = add_lora(LlamaForCausalLM(cfg), LoraSettings(), seed=0).cuda()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (4, 64), device="cuda")

    def one():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    timed(one, 3)  # warm-up
    t = timed(one, steps)
    return {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}


def codecs(repeats: int) -> dict:
    params = [torch.zeros(m, device="cuda") for m in lora_matrices(MODELS["smollm2-135m"], 8)]
    n = sum(p.numel() for p in params)
    res = {}
    for name in catalog.STRATEGIES:
        t = [time_encode(name, params, 2, bucket_cap_bytes=1 << 20, seed=i) * n * 1e-6
             for i in range(repeats)]
        res[name] = {"gpu_ms": statistics.median(t), "cpu_figure_ms": encode_ns(name) * n * 1e-6}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "step_fp32": step_time(a.steps, False), "step_bf16": step_time(a.steps, True),
           "encode_ms_per_sync": codecs(5)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
