"""The training worker: one process per rank, started by torchrun.

DDP settings chosen for LoRA (and why):

* ``init_sync=False``: by default DDP broadcasts the whole module state from
  rank 0 when it is built, frozen base weights included (540 MB for
  SmolLM2-135M: ~45 s at 100 Mbit/s, over 7 minutes at 10 Mbit/s before the
  first step).  Every rank loads the same base weights itself, so only the
  adapter must be made identical: every rank initialises it from the same
  seed, a 16-byte all-reduce of a SHA-256 of the adapter's bytes checks that
  they agree, and only if they do not is the adapter broadcast from rank 0
  (3.7 MB: 3 s at 10 Mbit/s).  Start-up traffic is at most the adapter's
  size, not the model's.
* no buffer broadcast before every forward (``forward_sync_buffers=False``
  unless ``--broadcast-buffers``): the model's buffers (rotary tables) never
  change, so re-broadcasting them is a wasted round trip per step.
* ``bucket_cap_mb`` from the config (default 1 MB): DDP hands a bucket to the
  sync strategy as soon as all its gradients are ready; the 3.7 MB adapter in
  1 MB buckets lets the sync of the last layers' gradients run while the
  backward pass is still computing the first layers' (overlap), at the cost
  of one collective per bucket.  One big bucket would expose the whole sync.
* ``find_unused_parameters=False``: every adapter parameter is used in every
  forward, and the search costs a graph traversal per step.

Exposed sync time (``comm_s``): the strategy stamps the moment the last bucket
became ready (local compute done); whatever the backward pass still waits
after that, plus the waiting the strategy itself accounts for (inside
``after_step`` for periodic sync, inside earlier bucket hooks for two-phase
schemes: the growth of ``sync.stats()["comm_s"]``), is sync the step waited on.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import random
import sys
import time
import warnings

from lorasync.config import Config, config_to_dict
from lorasync.errors import DataError, LorasyncError
from lorasync.launch import worker_env

__all__ = ["train_worker", "resolve_backend"]


def resolve_backend(name: str) -> str:
    import torch

    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise LorasyncError("run.backend: 'nccl' needs CUDA GPUs, none found; use "
                            "--backend gloo (or auto)")
    return name


def _buffer_sync_kwarg(enabled: bool) -> dict:
    """DDP's per-forward buffer broadcast switch under its current name.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (the
    old name still works, with a warning); older releases only know the old one.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def _lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:  # step counts optimizer steps done, from 0
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return f


def _rng_state():
    import numpy as np
    import torch

    st = {"torch": torch.random.get_rng_state(), "python": random.getstate(),
          "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st) -> None:
    import numpy as np
    import torch

    torch.random.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


class _Log:
    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)


def _evaluate(model, examples, tok, device, *, rank, world, max_new_tokens, batch=16):
    """(eval loss per token, exact-match count, examples checked): sharded over ranks."""
    import torch
    import torch.distributed as dist

    from lorasync.train.data import collate

    mine = examples[rank::world]
    was_training = model.training
    model.eval()
    loss_sum = tok_count = correct = checked = 0.0
    with torch.no_grad():
        for i in range(0, len(mine), batch):
            chunk = mine[i:i + batch]
            b = {k: v.to(device) for k, v in collate(chunk, tok.pad_token_id).items()}
            out = model(**b)
            # out.loss is a mean over the label tokens of the batch: weight it back
            n = int((b["labels"][:, 1:] != -100).sum())
            loss_sum += float(out.loss) * n
            tok_count += n
            gen = [e for e in chunk if e.gen_prompt_ids is not None]
            if not gen:
                continue
            width = max(len(e.gen_prompt_ids) for e in gen)
            ids = torch.full((len(gen), width), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, e in enumerate(gen):  # left padding for generation
                ids[j, width - len(e.gen_prompt_ids):] = torch.tensor(e.gen_prompt_ids)
                mask[j, width - len(e.gen_prompt_ids):] = 1
            outs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            for j, e in enumerate(gen):
                text = tok.decode(outs[j, width:], skip_special_tokens=True).strip()
                correct += float(text == e.answer)
                checked += 1
    # on the model's device: NCCL reduces only GPU tensors (32 bytes, once per evaluation)
    t = torch.tensor([loss_sum, tok_count, correct, checked], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    if was_training:
        model.train()
    loss_sum, tok_count, correct, checked = t.tolist()
    return (loss_sum / tok_count if tok_count else float("nan")), int(correct), int(checked)


def prepare_run_dir(cfg: Config, resume: bool) -> None:
    """Rank 0: create the run directory (after validation) and write config.yaml."""
    import yaml

    out = cfg.run.output_dir
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.yaml")
    tmp = path + ".part"
    with open(tmp, "w") as fh:
        yaml.safe_dump(config_to_dict(cfg), fh, sort_keys=False)
    os.replace(tmp, path)


def train_worker(cfg: Config, resume: bool = False) -> int:
    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    env = worker_env()
    rank, local_rank = env["rank"], env["local_rank"]
    log = _Log(rank)
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation chatter
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # --threads, else OMP_NUM_THREADS (an emulated cluster runs every node's worker on
    # this one machine and sets it to 1), else the cores shared by this node's workers
    threads = (cfg.run.threads or int(os.environ.get("OMP_NUM_THREADS") or 0)
               or max(1, (os.cpu_count() or 1) // env["local_world_size"]))
    torch.set_num_threads(threads)
    backend = resolve_backend(cfg.run.backend)
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=_dt.timedelta(minutes=10),
                            device_id=device if backend == "nccl" else None)
    try:
        return _train(cfg, resume, env, device, backend, log)
    finally:
        dist.destroy_process_group()


def _train(cfg: Config, resume: bool, env, device, backend, log) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lorasync.comm import attach
    from lorasync.monitor.metrics import RankStream, write_merged
    from lorasync.monitor.sinks import open_sinks
    from lorasync.train import checkpoint as ckpt
    from lorasync.train.data import batches_at, collate, load_datasets, steps_per_epoch
    from lorasync.train.model import adapter_param_count, add_lora, load_base

    rank, world, local_rank = env["rank"], env["world_size"], env["local_rank"]
    tc = cfg.train
    barrier = (lambda: dist.barrier(device_ids=[device.index])) if backend == "nccl" \
        else dist.barrier

    t_load = time.time()
    base, tok = load_base(cfg.model.name, cfg.model.dtype, log=log)
    train_set, eval_set = load_datasets(cfg.data, tok)
    global_batch = world * tc.batch_size * tc.grad_accum
    if len(train_set) < global_batch:
        raise DataError(f"data.path: {len(train_set)} training examples is fewer than one global "
                        f"batch ({world} ranks x batch_size {tc.batch_size} x grad_accum "
                        f"{tc.grad_accum} = {global_batch}); add data or lower --batch-size")
    spe = steps_per_epoch(len(train_set), global_batch)
    total_steps = tc.max_steps or max(1, int(tc.epochs * spe))
    run_dir = cfg.run.output_dir

    resume_from = ckpt.latest(run_dir) if resume else None
    if resume and resume_from is None:
        raise LorasyncError(f"--resume: {run_dir} has no complete checkpoint; start a new run "
                            "without --resume")
    start_step = 0
    sample_offset = 0  # global samples consumed: the data position
    accum = tc.grad_accum
    meta: dict = {}
    if resume_from:
        meta = ckpt.read_meta(resume_from)
        if meta["world_size"] != world:
            raise LorasyncError(f"--resume: {resume_from} was written by {meta['world_size']} "
                                f"ranks, this job has {world}; resume with --nproc "
                                f"{meta['world_size']} (nodes x workers)")
        start_step = meta["step"]
    model = add_lora(base, cfg.lora, tc.seed).to(device)
    model.train()
    # Make the adapter identical on every rank: rank 0's init is the truth.
    # This (a few MB at most) replaces DDP's start-up broadcast of the whole model.
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    startup_bytes = 16
    if not same_on_every_rank(lora, device):
        with torch.no_grad():
            for p in lora:
                dist.broadcast(p.data, src=0)
                startup_bytes += p.numel() * p.element_size()
    n_adapter = adapter_param_count(model)
    log(f"lorasync: {world} rank(s), backend {backend}, model {cfg.model.name}, "
        f"{n_adapter:,} trainable adapter parameters, strategy {cfg.comm.strategy}, "
        f"{len(train_set)} train / {len(eval_set)} eval examples, loaded in "
        f"{time.time() - t_load:.1f} s")

    ddp = DDP(model, device_ids=[device.index] if backend == "nccl" else None,
              init_sync=False, bucket_cap_mb=cfg.comm.bucket_mb, find_unused_parameters=False,
              **_buffer_sync_kwarg(cfg.comm.broadcast_buffers))
    try:
        sync = attach(ddp, cfg.comm.strategy, hierarchy=cfg.comm.hierarchy,
                      ranks_per_node=cfg.comm.ranks_per_node or None,
                      allreduce_algo=cfg.comm.allreduce_algo, **cfg.comm.options)
    except ValueError as exc:
        raise LorasyncError(f"comm: {exc}") from None
    # Everything the user could get wrong has been checked: only now write.
    if rank == 0:
        prepare_run_dir(cfg, resume)
    barrier()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, _lr_lambda(tc.schedule, tc.warmup_steps, total_steps))
    if hasattr(sync, "set_optimizer"):
        # auto: lets it average rank-local optimizer moments when it leaves local/diloco
        sync.set_optimizer(opt)
    adaptive_accum = tc.max_grad_accum > tc.grad_accum and hasattr(sync, "suggested_accum")
    if tc.max_grad_accum > tc.grad_accum and not adaptive_accum:
        log(f"note: --max-grad-accum needs --comm auto; keeping grad_accum {tc.grad_accum}")

    eval_before = meta.get("eval_before")
    if resume_from:
        st = ckpt.load_rank(resume_from, rank)
        with torch.no_grad():
            named = dict(model.named_parameters())
            for n, v in st["adapter"].items():
                named[n].copy_(v)
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        sync.load_state_dict(st["sync"])
        _set_rng_state(st["rng"])
        sample_offset = st.get("sample_offset", start_step * global_batch)
        accum = st.get("grad_accum", accum)
        log(f"resumed from {resume_from} at step {start_step}")

    if not resume_from:
        # dropout masks differ per rank (like independent data) but repeat per seed
        torch.manual_seed(tc.seed * 1000 + rank)
        random.seed(tc.seed * 1000 + rank)
        import numpy as np
        np.random.seed(tc.seed * 1000 + rank)
    stream = RankStream(run_dir, rank, keep_until_step=start_step)
    sinks = open_sinks(run_dir, rank=rank, world_size=world, tensorboard=cfg.run.tensorboard,
                       metrics_port=cfg.run.metrics_port, metrics_host=cfg.run.metrics_host,
                       store=dist.distributed_c10d._get_default_store())
    evals_path = os.path.join(run_dir, "evals.jsonl")
    if rank == 0 and resume_from:  # evaluations after the checkpoint will run again
        from lorasync.monitor.metrics import read_jsonl_records
        kept = [r for r in read_jsonl_records(evals_path) if r["step"] <= start_step]
        with open(evals_path, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in kept)

    def run_eval(step: int):
        loss, correct, n = _evaluate(model, eval_set, tok, device, rank=rank, world=world,
                                     max_new_tokens=tc.max_new_tokens)
        rec = {"step": step, "eval_loss": loss, "exact_match": correct / n if n else None,
               "correct": correct, "n": n, "time": time.time()}
        if rank == 0:
            with open(evals_path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            if sinks is not None:
                sinks.write(rec)
        return rec

    if eval_before is None and tc.eval_before and cfg.data.eval_size and eval_set:
        log("evaluating the base adapter ...")
        eval_before = run_eval(0)

    def checkpoint(step: int):
        state = {"adapter": {n: p.detach().cpu().clone() for n, p in model.named_parameters()
                             if "lora_" in n},
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "sync": sync.state_dict(), "rng": _rng_state(), "step": step,
                 "sample_offset": sample_offset, "grad_accum": accum}
        ckpt.save(run_dir, step, state, {"eval_before": eval_before, "total_steps": total_steps},
                  rank=rank, local_rank=local_rank, world_size=world, barrier=barrier,
                  keep=tc.keep_ckpts)

    bar = None
    if rank == 0 and cfg.run.progress:
        from tqdm import tqdm
        bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                   dynamic_ncols=True, file=sys.stderr)
    last_stats = sync.stats()
    end_step = min(total_steps, tc.stop_after) if tc.stop_after else total_steps
    ema_sps = None
    try:
        for step in range(start_step + 1, end_step + 1):
            t0 = time.perf_counter()
            micro = batches_at(sample_offset, n=len(train_set), seed=tc.seed, rank=rank,
                               world=world, batch_size=tc.batch_size, grad_accum=accum)
            sample_offset += world * tc.batch_size * accum
            losses, samples, tokens, data_s, exposed = [], 0, 0, 0.0, 0.0
            for i, idx in enumerate(micro):
                td = time.perf_counter()
                batch = collate([train_set[j] for j in idx], tok.pad_token_id)
                batch = {k: v.to(device) for k, v in batch.items()}
                data_s += time.perf_counter() - td
                last = i == len(micro) - 1
                sync.last_ready_time = None
                if last:
                    loss = ddp(**batch).loss
                    (loss / len(micro)).backward()
                else:
                    with ddp.no_sync():  # accumulate locally; sync once per step
                        loss = ddp(**batch).loss
                        (loss / len(micro)).backward()
                if last and sync.last_ready_time is not None:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    exposed += max(0.0, time.perf_counter() - sync.last_ready_time)
                losses.append(float(loss.detach()))
                samples += len(idx)
                tokens += int(batch["attention_mask"].sum())
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            sync.after_step()
            step_s = time.perf_counter() - t0
            stats = sync.stats()
            # what the backward pass could not see: waits inside after_step (periodic
            # sync) and inside hooks before the last bucket was ready (two-phase)
            exposed += stats["comm_s"] - last_stats["comm_s"]
            rec = {"step": step, "rank": rank, "world_size": world,
                   "strategy": stats.get("strategy", cfg.comm.strategy),
                   "loss": sum(losses) / len(losses), "lr": sched.get_last_lr()[0],
                   "samples": samples, "tokens": tokens, "grad_accum": len(micro),
                   "compute_s": max(0.0, step_s - exposed - data_s), "comm_s": exposed,
                   "step_s": step_s,
                   "wire_bytes": stats["wire_bytes"] - last_stats["wire_bytes"],
                   "intra_bytes": stats["intra_bytes"] - last_stats["intra_bytes"],
                   "inter_bytes": stats["inter_bytes"] - last_stats["inter_bytes"],
                   "fp32_bytes": stats["fp32_bytes"] - last_stats["fp32_bytes"],
                   "encode_s": stats["encode_s"] - last_stats["encode_s"],
                   "time": time.time()}
            if adaptive_accum:
                nxt = sync.suggested_accum(accum, tc.max_grad_accum, tc.grad_accum)
                if nxt != accum:
                    log(f"step {step}: {nxt} micro-batches per sync from now on (was {accum}): "
                        f"sync share {100 * exposed / step_s:.0f}%")
                    accum = nxt
            if stats.get("switches", 0) != last_stats.get("switches", 0):
                rec["switch"] = stats.get("last_switch")  # {"from", "to", "reason"} (auto)
            last_stats = stats
            stream.write(rec)
            sinks.write(rec)
            if bar is not None:
                sps = world * samples / step_s
                ema_sps = sps if ema_sps is None else 0.8 * ema_sps + 0.2 * sps
                bar.set_postfix_str(f"loss {rec['loss']:.3f} | {ema_sps:.2f} samples/s | "
                                    f"sync {100 * exposed / step_s:.0f}% | {rec['strategy']}",
                                    refresh=False)
                bar.update(1)
            if tc.eval_interval and step % tc.eval_interval == 0 and step < total_steps:
                r = run_eval(step)
                log(f"step {step}: eval loss {r['eval_loss']:.4f}, exact-match "
                    f"{r['correct']}/{r['n']}")
            if step == end_step or (tc.ckpt_interval and step % tc.ckpt_interval == 0):
                checkpoint(step)
    finally:
        if bar is not None:
            bar.close()
        stream.close()
        sinks.close()

    if end_step < total_steps:
        log(f"stopped after step {end_step} of {total_steps} (--stop-after); continue with "
            f"--resume --output-dir {run_dir}")
        return 0

    sync.finish()
    eval_after = run_eval(total_steps) if cfg.data.eval_size and eval_set else None
    if rank == 0:
        model.save_pretrained(os.path.join(run_dir, "adapter"))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(stream.records, gathered, dst=0)
    if rank == 0:
        write_merged(os.path.join(run_dir, "metrics.jsonl"), gathered)
        summary = _summarize(gathered, cfg, world, n_adapter, startup_bytes, eval_before,
                             eval_after)
        with open(os.path.join(run_dir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        print(format_summary(summary, run_dir))
    barrier()
    return 0


def same_on_every_rank(tensors, device) -> bool:
    """True when ``tensors`` hold the same bytes on every rank (16 bytes on the
    wire: the MIN all-reduce of (h, -h) for a 63-bit prefix h of a SHA-256)."""
    import hashlib

    import torch
    import torch.distributed as dist

    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h = int.from_bytes(digest.digest()[:8], "little") >> 1     # fits in int64
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    return int(both[0]) == h and -int(both[1]) == h


def _summarize(per_rank, cfg, world, n_adapter, startup_bytes, eval_before, eval_after) -> dict:
    import statistics

    r0 = sorted(per_rank[0], key=lambda r: r["step"])
    # the first step includes DDP's bucket rebuild and allocator warm-up
    steady = r0[1:] if len(r0) > 1 else r0
    by_step: dict[int, list[dict]] = {}
    for recs in per_rank:
        for r in recs:
            by_step.setdefault(r["step"], []).append(r)
    steady_steps = [s for s in sorted(by_step) if s != r0[0]["step"]] or sorted(by_step)
    # a step is as slow as its slowest rank; samples are summed over ranks
    wall = sum(max(r["step_s"] for r in by_step[s]) for s in steady_steps)
    samples = sum(sum(r["samples"] for r in by_step[s]) for s in steady_steps)
    return {
        "world_size": world, "strategy": cfg.comm.strategy, "model": cfg.model.name,
        "adapter_params": n_adapter, "steps": len(r0), "startup_broadcast_bytes": startup_bytes,
        "samples_per_s": samples / wall if wall else None,
        "step_s_median": statistics.median(r["step_s"] for r in steady),
        "compute_s_mean": statistics.fmean(r["compute_s"] for r in steady),
        "comm_s_mean": statistics.fmean(r["comm_s"] for r in steady),
        "sync_share": (sum(r["comm_s"] for r in steady) / sum(r["step_s"] for r in steady)),
        "wire_bytes_per_step": statistics.fmean(r["wire_bytes"] for r in steady),
        "fp32_bytes_per_step": statistics.fmean(r["fp32_bytes"] for r in steady),
        "final_loss": r0[-1]["loss"],
        "eval_before": eval_before, "eval_after": eval_after,
    }


def _em(e) -> str:
    if not e or not e.get("n"):
        return "n/a"
    p = e["correct"] / e["n"]
    se = math.sqrt(p * (1 - p) / e["n"])
    return f"{100 * p:.1f}% +- {100 * se:.1f} ({e['correct']}/{e['n']})"


def format_summary(s: dict, run_dir: str) -> str:
    eb, ea = s["eval_before"], s["eval_after"]
    rows = [
        ("ranks x strategy", f"{s['world_size']} x {s['strategy']}"),
        ("adapter parameters", f"{s['adapter_params']:,}"),
        ("eval exact-match before", _em(eb)),
        ("eval exact-match after", _em(ea)),
        ("eval loss before -> after",
         f"{eb['eval_loss']:.4f} -> {ea['eval_loss']:.4f}" if eb and ea else "n/a"),
        ("train loss (last step)", f"{s['final_loss']:.4f}"),
        ("samples/s (all ranks)", f"{s['samples_per_s']:.2f}"),
        ("step time median", f"{s['step_s_median']:.3f} s"),
        ("compute vs sync per step",
         f"{s['compute_s_mean']:.3f} s vs {s['comm_s_mean']:.3f} s "
         f"({100 * s['sync_share']:.1f}% waiting on sync)"),
        ("sent per step per rank",
         f"{s['wire_bytes_per_step'] / 1e6:.3f} MB (fp32 all-reduce: "
         f"{s['fp32_bytes_per_step'] / 1e6:.3f} MB)"),
        ("start-up broadcast", f"{s['startup_broadcast_bytes'] / 1e6:.2f} MB" + (
            " (adapter only)" if s["startup_broadcast_bytes"] > 16 else
            " (adapters identical on every rank: hash checked, nothing broadcast)")),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"\nlorasync run summary ({run_dir})", "-" * (w + 40)]
    lines += [f"{k.ljust(w)}  {v}" for k, v in rows]
    lines += ["-" * (w + 40),
              f"adapter: {os.path.join(run_dir, 'adapter')}   metrics: "
              f"{os.path.join(run_dir, 'metrics.jsonl')}"]
    return "\n".join(lines)
