#!/usr/bin/env python3
"""What TRL's SFTTrainer loss costs on this host: one forward and backward of
the same LoRA model and batch, through the model's own loss (what ``lorasync
train`` runs) and through TRL's fused LM head (what ``SFTTrainer.compute_loss``
runs: ``add_fused_lm_head`` with log-probs, entropy and top-1 outputs),
alternating, one process, one thread.

    python bench/trl_step_cost.py [--model smollm2-135m] [--rounds 5] [--json FILE]

No network and no sync: the ratio is the share of the TRL script's slower
steps in bench/hf_trainer.py --sft that comes from its loss alone."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=40, help="label-masked tokens per row")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()

    import torch
    import trl
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from lorasync.train.model import EMBEDDED, ensure_embedded, resolve_model

    torch.set_num_threads(1)
    if a.model == EMBEDDED:
        ensure_embedded(log=lambda m: None)
    path = resolve_model(a.model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (a.batch_size, a.seq_len), generator=g)
    labels = ids.clone()
    labels[:, :a.prompt_len] = -100
    lora = dict(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])

    def build(fused: bool):
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if fused:   # as SFTTrainer does, before PEFT wraps the model
            add_fused_lm_head(m, outputs=("log_probs", "entropy", "is_top1"))
        m = get_peft_model(m, LoraConfig(**lora))
        m.train()
        return m

    models = {"model loss": build(False), "TRL fused head": build(True)}

    def step(name: str) -> float:
        m = models[name]
        t = time.perf_counter()
        if name == "model loss":
            loss = m(input_ids=ids, labels=labels, use_cache=False).loss
        else:
            out = m(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False)
            loss = -out.log_probs.sum() / (labels[:, 1:] != -100).sum()
        loss.backward()
        m.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {k: [] for k in models}
    for name in models:          # one warm-up step each, not counted
        step(name)
    for k in range(a.rounds):    # alternate, each round starting with another one
        order = list(models) if k % 2 == 0 else list(reversed(models))
        for name in order:
            times[name].append(step(name))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["TRL fused head"] / med["model loss"]
    print(f"model {a.model}, {a.batch_size} x {a.seq_len} tokens ({a.prompt_len} masked), "
          f"1 thread, TRL {trl.__version__}, {a.rounds} rounds alternating")
    for k, v in times.items():
        print(f"  {k}: median {med[k]:.3f} s per forward+backward ({', '.join(f'{x:.3f}' for x in v)})")
    print(f"  TRL's loss path / the model's own: {ratio:.3f}x")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({
            "model": a.model, "batch_size": a.batch_size, "seq_len": a.seq_len,
            "prompt_len": a.prompt_len, "trl": trl.__version__, "rounds": a.rounds,
            "times": times, "median_s": med, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
