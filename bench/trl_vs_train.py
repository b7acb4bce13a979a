#!/usr/bin/env python3
"""``lorasync train`` against TRL's ``SFTTrainer`` on the same task, on one machine.

    flock /work/bench.lock env PYTHONPATH=$PWD/src .venv/bin/python bench/trl_vs_train.py \\
        [--steps 50] [--rounds 3] [--json bench/reference/trl/trl_vs_train.json]

Both sides train the embedded default (SmolLM2-135M-Instruct, GGUF-converted)
with LoRA r=8, alpha 16, dropout 0 on q/k/v/o, on the demo task, 2 ranks on
this machine (torchrun, gloo, one torch thread per rank), plain all-reduce of
the gradient (TRL: the Trainer's DDP as users get it; lorasync: ``--comm
allreduce``), with the same:

* data and order: the same tokenized examples (``lorasync.train.data.
  encode_rows``: chat template, completion-only labels, ``--seq-len``), and
  TRL's dataset is ordered so that the Trainer's sequential sampler, sharded
  by accelerate, hands every rank in every step the batch ``lorasync train``
  draws for that seed (``train.data.batches_at``);
* adapter init: PEFT's, seeded with the run's seed (``train.model.add_lora``);
* optimizer and schedule: AdamW (lr ``--lr``, weight decay 0), cosine with
  ``--warmup`` linear warm-up steps; the learning rate of step k is the same
  on both sides (TRL gets lorasync's schedule function as its LambdaLR: the
  Trainer's own cosine starts its warm-up at lr 0, lorasync at lr/warmup);
* gradient clipping to 1.0, 4 examples x <= ``--seq-len`` tokens per rank per
  step, no accumulation, the loss as the token mean over the global batch;
* evaluation: the same function (``lorasync.train.evaluate.evaluate``) on the
  same held-out examples after the last step: eval loss per label token.

TRL runs with its SFTConfig defaults otherwise (its loss, its metrics: token
accuracy and entropy gathered every step), except those that change the
comparison: ``bf16`` and ``gradient_checkpointing`` off unless a row asks for
them (TRL turns both on by default), one log at the end (each log is a
collective), no checkpoint.

Rows (each round interleaves them, starting with another row each time):

* quality and speed: ``--rounds`` rounds, round k with seed k, of TRL,
  ``lorasync train --comm allreduce`` and ``lorasync train`` with its default
  strategy (no ``--comm``).  Quality rule (docs/benchmarks.md): lorasync's
  eval loss must be no worse than the worst of TRL's seeds + 5%; samples/s
  must be at least TRL's (means over the rounds); the default strategy must
  not cost samples/s against ``--comm allreduce``;
* peak memory per rank (``ru_maxrss``, the process's peak resident set at the
  end of each step, as ``lorasync train`` records ``peak_mem_bytes`` on a CPU)
  in fp32 (from the rounds), ``--bf16`` and ``--gradient-checkpointing``
  (``--mem-steps`` steps, seed 0, one run each).

samples/s = samples of all ranks in steps 2..N / rank 0's wall time from the
end of step 1 to the end of step N (bench/hf_trainer.py's definition).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_trainer import samples_per_s  # noqa: E402  (the same samples/s definition)


def _rss_bytes() -> int:
    # Linux: ru_maxrss in KiB (what lorasync train records on a CPU)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- TRL worker

def _ordered(train, *, steps: int, world: int, batch: int, seed: int) -> list[dict]:
    """Training examples in the order that gives every rank, under the Trainer's
    sequential sampler and accelerate's round-robin batch sharding, the batches
    of ``lorasync train --seed SEED`` (no accumulation)."""
    from lorasync.train.data import batches_at

    out = []
    for s in range(steps):
        for r in range(world):
            (idx,) = batches_at(s * world * batch, n=len(train), seed=seed, rank=r, world=world,
                                batch_size=batch, grad_accum=1)
            out += [{"input_ids": train[i].input_ids, "labels": train[i].labels} for i in idx]
    return out


def worker(a) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import SFTConfig, SFTTrainer

    from lorasync.config import LoraSettings
    from lorasync.train.data import demo_rows, encode_rows
    from lorasync.train.evaluate import evaluate
    from lorasync.train.schedule import lr_lambda
    from lorasync.train.model import ModelSource, add_lora, load_base

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    base, tok = load_base(ModelSource.resolve(a.model), log=lambda m: None)
    # the rows lorasync train uses: demo_rows(--demo-size, --eval-size)
    train_rows, eval_rows = demo_rows(4000, a.eval_size)
    train = encode_rows(train_rows, tok, a.seq_len)
    evals = encode_rows(eval_rows, tok, a.seq_len) if a.eval_size else []
    data = Dataset.from_list(_ordered(train, steps=a.steps, world=world, batch=a.batch_size,
                                      seed=a.seed))
    model = add_lora(base, LoraSettings(), a.seed)   # r=8, alpha 16, q/k/v/o; seeded init
    args = SFTConfig(
        output_dir=os.path.join(a.out, "trainer"), max_steps=a.steps,
        per_device_train_batch_size=a.batch_size, learning_rate=a.lr, weight_decay=0.0,
        max_grad_norm=1.0, max_length=a.seq_len, packing=False,
        bf16=a.bf16, gradient_checkpointing=a.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=a.steps, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=True, seed=a.seed, train_sampling_strategy="sequential",
        dataloader_num_workers=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("cosine", a.warmup, a.steps))
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                         optimizers=(opt, sched))
    times: dict = {"records": []}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times["records"].append({"step": state.global_step, "time": time.time(),
                                     "peak_mem_bytes": _rss_bytes()})

    trainer.add_callback(Clock())
    t0 = time.time()
    trainer.train()
    rank = dist.get_rank()
    res = {"rank": rank, "world_size": world, "batch_size": a.batch_size,
           "train_s": time.time() - t0, "records": times["records"],
           "peak_mem_bytes": max(r["peak_mem_bytes"] for r in times["records"]),
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if evals:
        loss, correct, n = evaluate(trainer.model, evals, tok, torch.device("cpu"), rank=rank,
                                    world=world, max_new_tokens=a.max_new_tokens)
        res["eval_after"] = {"eval_loss": loss, "correct": correct, "n": n}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)


# --------------------------------------------------------------------------- runs

def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get(
        "PYTHONPATH", ""), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _run(cmd: list[str], log: str, timeout: float) -> int:
    with open(log, "w") as fh:
        try:
            return subprocess.run(cmd, env=_env(), stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def run_trl(a, work: str, label: str, seed: int, steps: int, *, bf16=False, gc=False,
            eval_size: int | None = None) -> dict:
    out = os.path.join(work, label)
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.abspath(__file__), "--worker", "--seed", str(seed), "--steps", str(steps),
           "--warmup", str(a.warmup), "--lr", str(a.lr), "--batch-size", str(a.batch_size),
           "--seq-len", str(a.seq_len), "--model", a.model, "--out", out,
           "--eval-size", str(a.eval_size if eval_size is None else eval_size),
           "--max-new-tokens", str(a.max_new_tokens)]
    cmd += ["--bf16"] if bf16 else []
    cmd += ["--gradient-checkpointing"] if gc else []
    t0 = time.time()
    rc = _run(cmd, os.path.join(work, f"{label}.log"), a.run_timeout)
    res = {"label": label, "side": "trl", "seed": seed, "steps": steps, "rc": rc,
           "wall_s": time.time() - t0}
    if rc != 0:
        res["error"] = f"exit {rc}; see {label}.log"
        return res
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    r0 = ranks[0]
    res["samples_per_s"] = samples_per_s([(x["step"], x["time"]) for x in r0["records"]],
                                         r0["world_size"] * r0["batch_size"])
    res["peak_mem_bytes"] = [r["peak_mem_bytes"] for r in ranks]
    res["loss_last"] = r0["losses"][-1] if r0["losses"] else None
    if "eval_after" in r0:
        res["eval_loss"] = r0["eval_after"]["eval_loss"]
        res["eval_n"] = r0["eval_after"]["n"]
    return res


def _auto_lines(log: str) -> list[str]:
    try:
        return [x.strip() for x in Path(log).read_text().splitlines() if x.startswith("auto:")]
    except OSError:
        return []


def run_train(a, work: str, label: str, seed: int, steps: int, *, comm: str | None,
              bf16=False, gc=False, eval_size: int | None = None) -> dict:
    run = os.path.join(work, label)
    cmd = [sys.executable, "-m", "lorasync", "train", "--model", a.model, "--nproc", "2",
           "--threads", "1", "--max-steps", str(steps), "--warmup-steps", str(a.warmup),
           "--lr", str(a.lr), "--schedule", "cosine", "--max-grad-norm", "1.0",
           "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--seed", str(seed),
           "--eval-size", str(a.eval_size if eval_size is None else eval_size),
           "--max-new-tokens", str(a.max_new_tokens), "--no-eval-before",
           "--ckpt-interval", "0", "--no-progress", "--output-dir", run]
    cmd += ["--comm", comm] if comm else []
    cmd += ["--bf16"] if bf16 else []
    cmd += ["--gradient-checkpointing"] if gc else []
    t0 = time.time()
    rc = _run(cmd, os.path.join(work, f"{label}.log"), a.run_timeout)
    res = {"label": label, "side": "lorasync", "seed": seed, "steps": steps, "rc": rc,
           "wall_s": time.time() - t0, "comm": comm or "default"}
    if rc != 0:
        res["error"] = f"exit {rc}; see {label}.log"
        return res
    summary = json.loads(Path(run, "summary.json").read_text())
    recs = [json.loads(x) for x in Path(run, "metrics.jsonl").read_text().splitlines() if x]
    r0 = sorted((r for r in recs if r["rank"] == 0), key=lambda r: r["step"])
    res["samples_per_s"] = samples_per_s([(r["step"], r["time"]) for r in r0],
                                         summary["world_size"] * a.batch_size)
    res["peak_mem_bytes"] = summary.get("peak_mem_bytes")
    res["loss_last"] = r0[-1]["loss"]
    res["strategies"] = sorted({r["strategy"] for r in r0})
    res["final_strategy"] = r0[-1]["strategy"]
    # launch -> end of step 1: start-up (torchrun, model load, DDP, the strategy's set-up)
    res["to_first_step_s"] = r0[0]["time"] - t0
    ea = summary.get("eval_after")
    if ea:
        res["eval_loss"] = ea["eval_loss"]
        res["eval_n"] = ea.get("n")
    # auto's own start-up and decisions (its encode timing, probe, choice), from rank 0's log
    res["auto_log"] = _auto_lines(os.path.join(work, f"{label}.log"))
    cfg = Path(run, "config.yaml")
    if cfg.is_file():
        import yaml

        res["strategy_resolved"] = (yaml.safe_load(cfg.read_text()).get("comm") or {}).get(
            "strategy")
    return res


# --------------------------------------------------------------------------- report

def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def report(rows: list[dict], a, load: tuple[float, float], default: str) -> dict:
    ok = [r for r in rows if "error" not in r]
    by: dict[str, list[dict]] = {}
    for r in ok:
        by.setdefault(r["label"].rsplit("-s", 1)[0], []).append(r)
    trl, ar, df = by.get("trl", []), by.get("train-allreduce", []), by.get("train-default", [])
    out: dict = {"args": {k: getattr(a, k) for k in ("steps", "rounds", "warmup", "lr",
                                                       "batch_size", "seq_len", "eval_size",
                                                       "max_new_tokens", "mem_steps", "model")},
                 "default_strategy": default, "load_before": load[0], "load_after": load[1],
                 "rows": rows}
    refs = [r["eval_loss"] for r in trl if r.get("eval_loss") is not None]
    limit = max(refs) * 1.05 if refs else None
    out["quality"] = {"trl_eval_losses": refs, "limit": limit}
    for name, rs in (("allreduce", ar), ("default", df)):
        losses = [r.get("eval_loss") for r in rs]
        out["quality"][name] = {"eval_losses": losses, "pass": None if not (limit and losses)
                                else all(x is not None and x <= limit for x in losses)}
    sps = {k: [r["samples_per_s"] for r in v] for k, v in
           (("trl", trl), ("allreduce", ar), ("default", df))}
    out["speed"] = {"rounds": sps, "mean": {k: _mean(v) for k, v in sps.items()}}
    m = out["speed"]["mean"]
    if m["trl"] and m["allreduce"]:
        out["speed"]["allreduce_vs_trl"] = m["allreduce"] / m["trl"]
    if m["default"] and m["allreduce"]:
        out["speed"]["default_vs_allreduce"] = m["default"] / m["allreduce"]
        # paired by round (same seed, same stretch of host load)
        pairs = [d["samples_per_s"] / x["samples_per_s"] for d in df for x in ar
                 if d["seed"] == x["seed"]]
        out["speed"]["default_vs_allreduce_rounds"] = pairs
        out["speed"]["default_to_first_step_s"] = [r.get("to_first_step_s") for r in df]
        out["speed"]["allreduce_to_first_step_s"] = [r.get("to_first_step_s") for r in ar]
        out["speed"]["default_wall_s"] = [r["wall_s"] for r in df]
        out["speed"]["allreduce_wall_s"] = [r["wall_s"] for r in ar]
    mem = {}
    for mode, trl_label, tr_label in (("fp32", "trl", "train-allreduce"),
                                      ("bf16", "trl-bf16", "train-allreduce-bf16"),
                                      ("gradient checkpointing", "trl-gc", "train-allreduce-gc")):
        t, lo = by.get(trl_label, []), by.get(tr_label, [])
        if t or lo:
            mem[mode] = {"trl": t[0]["peak_mem_bytes"] if t else None,
                         "lorasync": lo[0]["peak_mem_bytes"] if lo else None,
                         "trl_samples_per_s": t[0].get("samples_per_s") if t else None,
                         "lorasync_samples_per_s": lo[0].get("samples_per_s") if lo else None,
                         "steps": (t or lo)[0]["steps"], "seed": (t or lo)[0]["seed"]}
    out["memory"] = mem

    print(f"\nlorasync train vs TRL SFTTrainer, {a.model}, 2 ranks x 1 thread, {a.steps} steps, "
          f"{a.batch_size} x <= {a.seq_len} tokens per rank per step; load average "
          f"{load[0]:.1f} before, {load[1]:.1f} after\n")
    print("| run | seed | samples/s | eval loss | peak MiB r0/r1 | strategies | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | {r['seed']} | failed: {r['error']} | | | | |")
            continue
        pm = "/".join(f"{p / 2**20:.0f}" for p in r.get("peak_mem_bytes") or [])
        el = r.get("eval_loss")
        print(f"| {r['label']} | {r['seed']} | {r['samples_per_s']:.3f} | "
              f"{'-' if el is None else f'{el:.4f}'} | {pm} | "
              f"{','.join(r.get('strategies', ['trl']))} | {r['wall_s']:.0f} |")
    q = out["quality"]
    if limit:
        verdict = {True: "pass", False: "FAIL", None: "-"}
        print(f"\nquality limit (worst TRL seed + 5%): {limit:.4f}; allreduce "
              f"{verdict[q['allreduce']['pass']]}, default {verdict[q['default']['pass']]}")
    s = out["speed"]
    if "allreduce_vs_trl" in s:
        print(f"samples/s means: TRL {m['trl']:.3f}, lorasync allreduce {m['allreduce']:.3f} "
              f"({s['allreduce_vs_trl']:.3f}x)")
    if "default_vs_allreduce" in s:
        print(f"default ({default}) vs --comm allreduce: {s['default_vs_allreduce']:.3f}x "
              f"(rounds {', '.join(f'{x:.3f}' for x in s['default_vs_allreduce_rounds'])})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-size", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=1,
                    help="generation for exact-match after training (1: cheap; the bench "
                         "compares eval loss)")
    ap.add_argument("--mem-steps", type=int, default=4,
                    help="steps of the bf16 and gradient-checkpointing rows (0: leave them out)")
    ap.add_argument("--no-default", action="store_true",
                    help="leave out the default-strategy rows")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--run-timeout", type=float, default=900)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--keep", metavar="DIR", help="keep the runs' directories and logs here")
    # worker side (started by torchrun)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return

    from lorasync.config import CommConfig
    from lorasync.train.model import EMBEDDED, ensure_embedded

    if a.model == EMBEDDED:
        ensure_embedded(log=lambda m: print(m, file=sys.stderr))   # convert once, outside timing
    default = CommConfig().strategy
    load0 = os.getloadavg()[0]
    rows: list[dict] = []
    work = a.keep or tempfile.mkdtemp(prefix="trlbench-")
    os.makedirs(work, exist_ok=True)
    plan = []
    for k in range(a.rounds):
        kinds = ["trl", "train-allreduce"] + ([] if a.no_default else ["train-default"])
        plan += [(kind, k, a.steps, {}) for kind in kinds[k % len(kinds):] + kinds[:k % len(kinds)]]
    if a.mem_steps:
        for suffix, kw in (("bf16", {"bf16": True}), ("gc", {"gc": True})):
            plan += [("trl-" + suffix, 0, a.mem_steps, kw),
                     ("train-allreduce-" + suffix, 0, a.mem_steps, kw)]
    for kind, seed, steps, kw in plan:
        label = f"{kind}-s{seed}"
        print(f"running {label} ...", file=sys.stderr, flush=True)
        mem_row = bool(kw)
        ev = 0 if mem_row else None
        if kind.startswith("trl"):
            r = run_trl(a, work, label, seed, steps, eval_size=ev, **kw)
        else:
            comm = None if kind == "train-default" else "allreduce"
            r = run_train(a, work, label, seed, steps, comm=comm, eval_size=ev, **kw)
        el = r.get("eval_loss")
        print(f"   {label}: {r.get('error') or format(r['samples_per_s'], '.3f') + ' samples/s'}"
              f"{'' if el is None else f', eval loss {el:.4f}'} ({r['wall_s']:.0f} s)",
              file=sys.stderr, flush=True)
        rows.append(r)
    res = report(rows, a, (load0, os.getloadavg()[0]), default)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
