"""Mixed precision, gradient checkpointing, clipping and the token-weighted
loss on real 2-rank gloo groups.

* every strategy under bf16 autocast with gradient checkpointing, 1-bit
  Adam, and fp16 with a loss scaler where --fp16 is allowed (one spawn of 2
  ranks, this file run as a script, loops over them): the adapter's
  gradients stay fp32, the strategy puts on the wire the dtypes below
  (recorded at its Wire), and DDP's hooks run once per gradient (no
  "marked ready twice");
* ``lorasync train`` with gradient accumulation: step 1's loss is each
  rank's token mean and its grad_norm the norm of the global batch's
  token-mean gradient, computed here in one process;
* ``lorasync train --fp16 --gradient-checkpointing --comm local``: the loss
  scaler runs, each replica clips its own gradient, the checkpoint keeps
  the scale.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import run_cli  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

#: strategy -> (options, dtypes of what it hands to collectives in a step's sync)
#: under bf16 autocast.  The adapter is fp32 under autocast, so are its
#: gradients; each strategy encodes them as it would in fp32.
WIRE = {
    "allreduce": ({}, {"float32"}),
    "fp16": ({}, {"float16"}),
    "bf16": ({}, {"bfloat16"}),
    "int8": ({"block": 32}, {"uint8"}),        # codes + fp32 scales packed as bytes
    "onebit": ({"block": 32, "warmup_steps": 0}, {"uint8"}),   # signs + scales, as bytes
    "topk": ({"ratio": 0.1}, {"int32"}),   # int32 indices + the fp32 values' bits, one tensor
    "powersgd": ({"rank": 1}, {"float32"}),                    # the factors P, Q
    "local": ({"period": 2}, {"float32"}),                     # the adapter's weights
    "diloco": ({"period": 2}, {"float32"}),                    # the outer delta
}
#: (label, strategy, options, autocast dtype): every strategy under bf16; 1-bit
#: Adam (fp32 all-reduce for one warm-up step, then momentum as signs); fp16
#: with a loss scaler where --fp16 is allowed
SCENARIOS = [(name, name, opts, "bfloat16") for name, (opts, _) in WIRE.items()] + [
    ("onebit_adam", "onebit", {"block": 32, "warmup_steps": 1}, "bfloat16"),
    ("fp16_allreduce", "allreduce", {}, "float16"),
    ("fp16_fp16", "fp16", {}, "float16"),
    ("fp16_local", "local", {"period": 2}, "float16"),
]
STEPS = 2


# ----------------------------------------------------------------------------- worker

def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lorasync.comm import attach
    from lorasync.comm.wire import Wire
    from lorasync.config import LoraSettings
    from lorasync.train.trainer import _enable_checkpointing
    from lorasync.train.model import ModelSource, add_lora, load_base

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    sent: list[str] = []
    plain_run = Wire._run

    def recording_run(self, kind, t, count, async_op, call, timed=True):
        if count:
            sent.append(str(t.dtype).replace("torch.", ""))
        return plain_run(self, kind, t, count, async_op, call, timed)

    Wire._run = recording_run
    results = {}
    try:
        for label, name, opts, dtype in SCENARIOS:
            base, _tok = load_base(ModelSource.resolve("tiny"))
            _enable_checkpointing(base, "tiny")   # the trainer's: non-reentrant
            model = add_lora(base, LoraSettings(), seed=0)
            model.train()
            ddp = DDP(model, init_sync=False, bucket_cap_mb=0.005,
                      find_unused_parameters=False)
            sync = attach(ddp, name, hierarchy="flat", **opts)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-3)
            if label == "onebit_adam":
                sync.set_optimizer(opt)
            # the trainer's order: backward (the sync runs in it), unscale, norm, step
            scaler = torch.amp.GradScaler("cpu") if dtype == "float16" else None
            g = torch.Generator().manual_seed(100 + rank)
            grad_dtypes, param_dtypes, momentum = set(), set(), []
            sent.clear()
            for _ in range(STEPS):
                ids = torch.randint(3, 90, (2, 24), generator=g)
                with torch.autocast("cpu", dtype=getattr(torch, dtype)):
                    out_ = ddp(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
                (scaler.scale(out_.loss) if scaler else out_.loss).backward()
                grad_dtypes |= {str(p.grad.dtype).replace("torch.", "") for p in params}
                param_dtypes |= {str(p.dtype).replace("torch.", "") for p in params}
                momentum.append(sync.grads_hold_momentum)
                if scaler:
                    scaler.unscale_(opt)
                norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                sync.after_step()
            sync.finish()
            results[label] = {"wire": sorted(set(sent)), "grad": sorted(grad_dtypes),
                              "param": sorted(param_dtypes), "momentum": momentum,
                              "logits_dtype": str(out_.logits.dtype), "norm": norm,
                              "finite": math.isfinite(norm),
                              "scale": scaler.get_scale() if scaler else None}
            dist.barrier()
    finally:
        Wire._run = plain_run
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                       text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", list(WIRE))
def test_bf16_autocast_and_checkpointing_per_strategy(bf16_runs, name):
    r0, r1 = bf16_runs[0][name], bf16_runs[1][name]
    for r in (r0, r1):
        assert r["param"] == ["float32"] and r["grad"] == ["float32"], r
        assert r["logits_dtype"] == "torch.bfloat16", r   # autocast was on
        assert set(r["wire"]) == WIRE[name][1], (name, r["wire"])
        assert r["finite"] and r["momentum"] == [False] * STEPS
    if name not in ("local", "diloco"):   # synced every step: the same gradient on both ranks
        assert r0["norm"] == pytest.approx(r1["norm"], rel=1e-6)
    else:                                  # each replica's own gradient
        assert r0["norm"] != pytest.approx(r1["norm"], rel=1e-6)


def test_one_bit_adam_hands_back_momentum_after_its_warm_up(bf16_runs):
    for r in (bf16_runs[0]["onebit_adam"], bf16_runs[1]["onebit_adam"]):
        assert r["momentum"] == [False, True]   # step 1: fp32 all-reduce; step 2: signs
        assert set(r["wire"]) == {"float32", "uint8"}


@pytest.mark.parametrize("label, wire", [("fp16_allreduce", "float32"),
                                         ("fp16_fp16", "float16"), ("fp16_local", "float32")])
def test_fp16_syncs_the_scaled_gradient_and_unscales_after(bf16_runs, label, wire):
    r0, r1 = bf16_runs[0][label], bf16_runs[1][label]
    for r in (r0, r1):
        assert r["logits_dtype"] == "torch.float16" and r["grad"] == ["float32"], r
        assert r["wire"] == [wire] and r["finite"] and r["scale"] > 1
    if label != "fp16_local":   # the same scaled gradient on both ranks, the same unscaled norm
        assert r0["norm"] == pytest.approx(r1["norm"], rel=1e-6)
        assert r0["scale"] == r1["scale"]


# ----------------------------------------------------------------------- the CLI's step

TINY = ["--model", "tiny", "--nproc", "2", "--no-progress", "--threads", "1",
        "--demo-size", "64", "--eval-size", "0", "--ckpt-interval", "0"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def test_token_weighted_loss_and_grad_norm_of_the_synced_gradient(tmp_path):
    """grad_accum 2 on 2 ranks: rank r's loss is the token mean of its own
    micro-batches; grad_norm is the norm of the gradient of the token mean
    over all 4 micro-batches (what the all-reduced gradient is), before clipping."""
    import torch

    from lorasync.config import load_config
    from lorasync.train.data import IGNORE, batches_at, collate, load_datasets
    from lorasync.train.model import ModelSource, add_lora, load_base

    out = tmp_path / "run"
    p = run_cli("train", *TINY, "--max-steps", "1", "--batch-size", "2", "--grad-accum", "2",
                "--max-grad-norm", "0.01", "--comm", "allreduce", "--output-dir", out)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = {r["rank"]: r for r in _records(out) if r.get("step") == 1}
    # 5 warm-up steps (the default) in a 1-step run: said once, by rank 0
    assert p.stderr.count("note: the learning rate never reaches its peak") == 1, p.stderr

    cfg = load_config(None, {"model": {"name": "tiny"}, "data": {"demo_size": 64,
                                                                 "eval_size": 0}})
    base, tok = load_base(ModelSource.resolve("tiny"))
    model = add_lora(base, cfg.lora, seed=cfg.train.seed)
    train, _ = load_datasets(cfg.data, tok)
    total, sums, counts = 0.0, {}, {}
    for rank in range(2):
        for idx in batches_at(0, n=len(train), seed=cfg.train.seed, rank=rank, world=2,
                              batch_size=2, grad_accum=2):
            batch = collate([train[j] for j in idx], tok.pad_token_id)
            n = int((batch["labels"][:, 1:] != IGNORE).sum())
            s = model(**batch).loss * n                      # summed token losses
            sums[rank] = sums.get(rank, 0.0) + float(s.detach())
            counts[rank] = counts.get(rank, 0) + n
            total = total + s
    (total / sum(counts.values())).backward()
    norm = float(torch.nn.utils.get_total_norm(
        [p.grad for p in model.parameters() if p.requires_grad]))
    for rank in range(2):
        assert recs[rank]["loss"] == pytest.approx(sums[rank] / counts[rank], rel=1e-4)
        assert recs[rank]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # the plain mean of micro-batch means would differ here (micro-batches differ in length)
    assert counts[0] != counts[1]


def test_fp16_with_local_sgd_clips_each_replica(tmp_path):
    out = tmp_path / "run"
    p = run_cli("train", *TINY, "--max-steps", "3", "--fp16", "--gradient-checkpointing",
                "--comm", "local",
                "--comm-opt", "period=2", "--output-dir", out)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [r for r in _records(out) if "step" in r and "loss" in r]
    assert {r["step"] for r in recs} == {1, 2, 3}
    for r in recs:
        assert r["loss_scale"] > 0 and math.isfinite(r["loss"])
        assert r["peak_mem_bytes"] > 0
    norms = {(r["step"], r["rank"]): r["grad_norm"] for r in recs}
    assert norms[(1, 0)] != norms[(1, 1)]   # each replica's own gradient, not a synced one
    # the checkpoint keeps the loss scale reached (a resume does not start over at 2**16)
    meta = json.loads((out / "checkpoint-3" / "lorasync" / "meta.json").read_text())
    r0 = next(r for r in recs if (r["step"], r["rank"]) == (3, 0))
    assert meta["grad_scaler"]["scale"] == r0["loss_scale"]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["peak_mem_bytes"]) == 2 and all(summary["peak_mem_bytes"])


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    mp.spawn(_worker, args=(2, _free_port(), sys.argv[1]), nprocs=2, join=True)
