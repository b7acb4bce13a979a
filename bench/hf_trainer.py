#!/usr/bin/env python3
"""transformers Trainer with and without lorasync, and against ``lorasync train``,
on one emulated slow link.

    flock /work/bench.lock .venv/bin/python bench/hf_trainer.py [--rate 10mbit] [--steps 30] \\
        [--json bench/reference/hf/hf_trainer_10mbit.json]

An emulated 2-node cluster (network namespaces, ``--rate`` per node; root),
one worker per node, the embedded default (SmolLM2-135M-Instruct + LoRA r=8 on
q/k/v/o, 921,600 adapter parameters), the demo task, 4 examples x up to 128
tokens per rank per step, lr 2e-3 cosine, ``--steps`` steps.  Rows, run one
after the other in this invocation (compare ratios, not absolute times):

* ``lorasync train --comm S`` and a ``transformers.Trainer`` script with
  ``lorasync.hf.attach(trainer, S)``, for S in ``--pairs`` (default int8,
  diloco, auto): the Trainer path should be within 5% of ``lorasync train``
  in samples/s.  Both see the very same batches: the Trainer's dataset is
  ordered so that its sequential sampler, sharded by accelerate, hands every
  rank the batches ``lorasync train`` draws (``train.data.batches_at``).
* the Trainer as users run it today: plain DDP (the Trainer's defaults: one
  25 MB bucket, unused-parameter search, buffer broadcast, and DDP's start-up
  broadcast of the whole model from rank 0), and plain DDP with torch's
  ``fp16_compress_hook`` registered on the Trainer's DDP model.  The fp16 row
  starts on a 1 Gbit/s link and is cut to ``--rate`` before its first step
  (its start-up is the plain row's; this saves one more slow broadcast).

``--sft`` (docs/integrations.md, "Measured"): instead, one TRL ``SFTTrainer``
script that never imports lorasync (``sft_worker``, the same batches), run
three ways, and ``lorasync train --comm S`` beside it:

    flock /work/bench.lock .venv/bin/python bench/hf_trainer.py --sft [--switch-strategy auto] \\
        --json bench/reference/hf/switch_10mbit.json

* plain: the Trainer's own DDP (fp32 all-reduce);
* accelerate_fp16: ``DistributedDataParallelKwargs(comm_hook=FP16)`` on the
  Trainer's accelerator (accelerate registers torch's ``fp16_compress_hook``);
* switch: ``LORASYNC_STRATEGY=S`` in the workers' environment, nothing else:
  lorasync's start-up hook file attaches it (the rows run with a Python whose
  site-packages holds that file: ``switch_python``).
Targets: switch >= 1.5x plain, and within 5% of ``lorasync train --comm S``.
plain and accelerate_fp16 start on ``--startup-rate`` and are cut to
``--rate`` before step 1 (DDP's start-up broadcast of the whole model would
take ~8 minutes each); about 12 minutes at 10 Mbit/s.

samples/s = samples of all ranks in steps 2..N / rank 0's wall time from the
end of step 1 to the end of step N (the first step pays DDP's bucket rebuild).
Neither path counts the sync after step N that leaves the replicas identical
(DiLoCo's last average): ``lorasync train`` runs it after its last step record,
and the Trainer rows report it apart (``final_sync_s``, ``final_sync_bytes``):
their step clock runs after lorasync's step-end callback, whose ``finish()``
holds that sync, so its time is taken out of step N's.  The switch row's
s/step and sync share cover steps 2..N, as ``lorasync train``'s.  The --sft
rows also time the accelerator's ``gather_for_metrics`` per step (TRL's
``compute_loss`` all-gathers its entropy, token accuracy and token count on
every micro-batch: synchronous round trips on the link), and every run
records the host's CPU pressure (``host_cpu``) so that a run slowed by other
work on the host shows it.
Start-up = ``trainer.train()`` called -> first step about to run (DDP built,
start-up sync, strategy attached: auto's probe included).

Needs root.  Takes about 20 minutes at 10 Mbit/s (the plain row's start-up
broadcast alone is ~8 minutes).  Run it under ``flock /work/bench.lock``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


# --------------------------------------------------------------------------- worker

def _ordered_examples(tok, steps: int, world: int, batch: int, seq_len: int):
    """The demo examples in the order that gives every rank, under the Trainer's
    sequential sampler and accelerate's round-robin batch sharding, the batches
    of ``lorasync train`` (seed 0, no accumulation)."""
    from lorasync.train.data import batches_at, demo_rows, encode_rows

    rows, _ = demo_rows(4000, 0)          # lorasync train --eval-size 0: the same rows
    exs = encode_rows(rows, tok, seq_len)
    out = []
    for s in range(steps):
        for r in range(world):
            (idx,) = batches_at(s * world * batch, n=len(exs), seed=0, rank=r, world=world,
                                batch_size=batch, grad_accum=1)
            out += [{"input_ids": exs[i].input_ids, "labels": exs[i].labels} for i in idx]
    return out


def _add_clock(trainer, gate: str, on_begin, per_step=None) -> dict:
    """A callback on ``trainer`` that fills the dict it returns: ``begin`` (train()
    reached its first step's set-up), ``records`` (step, wall time) at each step's
    end, and with ``gate`` the wait for the bench to cut the link (``gate_s``).
    ``on_begin(times)`` runs at train begin, before the gate (DDP exists then);
    ``per_step()``, a dict merged into each step's record.  ``threads``: the torch
    threads the training loop runs with (intra-op, inter-op), read at train begin.

    The clock runs after lorasync's callback (attach puts that one first), so
    the last step's time includes lorasync's final sync (``finish()``): the
    bench takes it out (``samples_per_s``'s ``tail_s``), as ``lorasync train``
    writes its last step record before its final sync."""
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    times: dict = {"records": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times["begin"] = time.time()
            times["threads"] = [torch.get_num_threads(), torch.get_num_interop_threads()]
            on_begin(times)
            if gate:   # the bench cuts the link now; wait for it
                Path(gate, f"ready-{dist.get_rank()}").touch()
                while not Path(gate, "go").exists():
                    time.sleep(0.05)
                dist.barrier()
                times["gate_s"] = time.time() - times["begin"]

        def on_step_end(self, args, state, control, **kw):
            times["records"].append({"step": state.global_step, "time": time.time(),
                                     **(per_step() if per_step else {})})

    trainer.add_callback(Clock())
    return times


def worker(a) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    import lorasync.hf
    from lorasync.config import parse_options
    from lorasync.train.data import Example, collate
    from lorasync.train.model import ModelSource, load_base

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    world = int(os.environ["WORLD_SIZE"])
    base, tok = load_base(ModelSource.resolve(a.model))
    data = _ordered_examples(tok, a.steps, world, a.batch_size, a.seq_len)
    torch.manual_seed(0)   # lorasync train seeds the adapter init the same way
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    # what DDP's start-up sync broadcasts from rank 0: every parameter and buffer
    state_bytes = sum(t.numel() * t.element_size()
                      for t in [*model.parameters(), *model.buffers()])

    def collate_fn(batch):
        return collate([Example(b["input_ids"], b["labels"]) for b in batch], tok.pad_token_id)

    args = TrainingArguments(
        output_dir=os.path.join(a.out, "trainer"), max_steps=a.steps,
        per_device_train_batch_size=a.batch_size, learning_rate=2e-3,
        lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.0,
        logging_steps=a.logging_steps,
        save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
        train_sampling_strategy="sequential", remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate_fn)
    handle = None
    if a.mode == "lorasync":
        handle = lorasync.hf.attach(trainer, a.strategy, keep_token_average=a.keep_token_average,
                                    **parse_options(a.option))
    def fp16_hook(times):
        if a.mode == "torch_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            trainer.model_wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)

    times = _add_clock(trainer, a.gate, fp16_hook)
    t_train = time.time()
    trainer.train()
    res = {"mode": a.mode, "strategy": a.strategy, "rank": dist.get_rank(), "world_size": world,
           "startup_s": times["begin"] - t_train, "gate_s": times.get("gate_s", 0.0),
           "records": times["records"], "base_state_bytes": state_bytes,
           "batch_size": a.batch_size, "threads": times.get("threads"),
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if handle is not None:
        st = handle.stats()
        recs = handle.records
        # the same figures as lorasync train's summary: steps after the first (DDP's
        # bucket rebuild), the final sync after the last step reported on its own
        steady = recs[1:] or recs
        res.update(startup_bytes=handle.startup_bytes, lorasync_startup_s=handle.startup_s,
                   final_strategy=st["strategy"], switches=st.get("switches", 0),
                   wire_bytes_per_step=sum(r["wire_bytes"] for r in steady) / max(1, len(steady)),
                   sync_share=(sum(r["comm_s"] for r in steady) /
                               max(1e-9, sum(r["step_s"] for r in steady))),
                   final_sync_bytes=handle.final_sync["wire_bytes"],
                   final_sync_s=handle.final_sync["comm_s"])
    else:
        res["startup_bytes"] = state_bytes   # DDP's start-up broadcast: every param and buffer
    with open(os.path.join(a.out, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(res, fh)


# --------------------------------------------------------------------------- TRL script

def sft_worker(a) -> None:
    """The TRL ``SFTTrainer`` script of the ``--sft`` rows, as a user writes it:
    nothing of lorasync is imported here (the switch row gets lorasync from the
    start-up hook and ``LORASYNC_STRATEGY`` alone).  Only the bench's clock (a
    ``TrainerCallback``) and, in the accelerate_fp16 row, torch's fp16 hook
    handed to the Trainer's accelerator are added."""
    import warnings

    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from trl import SFTConfig, SFTTrainer

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    with open(a.data) as fh:
        rows = json.load(fh)   # input_ids + labels, in the order the bench wrote them
    torch.manual_seed(0)
    peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")
    args = SFTConfig(
        output_dir=os.path.join(a.out, "trainer"), max_steps=a.steps,
        per_device_train_batch_size=a.batch_size, learning_rate=2e-3,
        lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.0, max_length=a.seq_len,
        logging_steps=a.logging_steps, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=True, seed=0, train_sampling_strategy="sequential")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, peft_config=peft)
    if a.mode == "accelerate_fp16":
        # accelerate's way: DistributedDataParallelKwargs(comm_hook=FP16).  The Trainer
        # builds that handler itself (find_unused_parameters, bucket size ... from its
        # arguments) and has no argument for a hook, so set the field on the handler
        # its accelerator holds; accelerate registers the hook when it wraps the model.
        from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

        handler = trainer.accelerator.ddp_handler
        assert isinstance(handler, DistributedDataParallelKwargs), handler
        handler.comm_hook = DDPCommunicationHookType.FP16
    def ddp_facts(times):
        # the hook DDP runs, as DDP's own logging data names it ("" for its all-reduce)
        ddp = trainer.model_wrapped
        times["comm_hook"] = (ddp._get_ddp_logging_data().get("comm_hook", "")
                              if hasattr(ddp, "_get_ddp_logging_data") else None)
        # what DDP's start-up sync broadcasts from rank 0: every parameter and buffer
        m = trainer.model
        times["state_bytes"] = sum(t.numel() * t.element_size()
                                   for t in [*m.parameters(), *m.buffers()])

    # the bench's read-out, not part of the script: the time the training loop spends in
    # the accelerator's gather_for_metrics (SFTTrainer.compute_loss all-gathers its
    # metrics, entropy, token accuracy and token count, on every micro-batch)
    gathers = {"s": 0.0, "n": 0}
    gather = trainer.accelerator.gather_for_metrics

    def timed_gather(*args, **kw):
        t0 = time.perf_counter()
        try:
            return gather(*args, **kw)
        finally:
            gathers["s"] += time.perf_counter() - t0
            gathers["n"] += 1

    trainer.accelerator.gather_for_metrics = timed_gather
    times = _add_clock(trainer, a.gate, ddp_facts,
                       per_step=lambda: {"gather_s": gathers["s"], "gathers": gathers["n"]})
    t_train = time.time()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    last_ls = next(({k: v for k, v in h.items() if k.startswith("lorasync/")}
                    for h in reversed(trainer.state.log_history)
                    if any(k.startswith("lorasync/") for k in h)), {})
    res = {"mode": a.mode, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
           "startup_s": times["begin"] - t_train, "gate_s": times.get("gate_s", 0.0),
           "records": times["records"], "base_state_bytes": times["state_bytes"],
           "batch_size": a.batch_size, "losses": [h["loss"] for h in logs],
           "trainer_class": type(trainer).__name__,
           "ddp_comm_hook": times.get("comm_hook"),
           "examples_given": len(rows), "examples_trained_on": len(trainer.train_dataset),
           "lorasync_modules": sorted(m for m in sys.modules if m.split(".")[0] == "lorasync"),
           "lorasync_log": last_ls, "threads": times.get("threads"),
           # lorasync's final sync (after the last step): taken out of samples/s
           "final_sync_s": last_ls.get("lorasync/final_sync_s", 0.0),
           "final_sync_bytes": last_ls.get("lorasync/final_sync_bytes", 0),
           # lorasync's per-window figures (step_s, comm_s ...) of the last log: with
           # logging_steps = steps, means over every step
           "lorasync_window": next(({k: v for k, v in h.items() if k.startswith("lorasync/")}
                                    for h in reversed(logs) if "lorasync/step_s" in h), {})}
    # the bench's read-out: lorasync's per-step records (the handle the switch left on the
    # Trainer), so that its step and sync times cover steps 2..N as lorasync train's do
    handle = getattr(trainer, "_lorasync_switch", None)
    steady = (getattr(handle, "records", None) or [])[1:]
    if steady:
        res["steady"] = {"step_s": sum(r["step_s"] for r in steady) / len(steady),
                         "comm_s": sum(r["comm_s"] for r in steady) / len(steady)}
    with open(os.path.join(a.out, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(res, fh)


# --------------------------------------------------------------------------- bench

def samples_per_s(times_r0: list[tuple[int, float]], samples_per_step: int,
                  tail_s: float = 0.0) -> float | None:
    """Samples of steps 2..N over rank 0's time from the end of step 1 to the end
    of step N; ``tail_s``: seconds at the end of step N's record that are not the
    step's (lorasync's final sync, which the Trainer's last step-end callback runs
    and ``lorasync train`` runs after its last step record)."""
    t = dict(times_r0)
    last = max(t) if t else 0
    if 1 not in t or last < 2:
        return None
    return samples_per_step * (last - 1) / (t[last] - tail_s - t[1])


def _gather_per_step(records: list[dict]) -> dict | None:
    """The TRL metric gathers' seconds per step over steps 2..N (mean, worst)."""
    if not records or "gather_s" not in records[0]:
        return None
    g = [b["gather_s"] - a["gather_s"] for a, b in zip(records, records[1:])]
    return {"gather_s": sum(g) / len(g), "gather_max_s": max(g),
            "gathers_per_step": (records[-1]["gathers"] - records[0]["gathers"]) / len(g),
            "gather_steps": [round(x, 4) for x in g]} if g else None


def _launch_gated(cluster, a, argv: list, out: str, gate: bool, env: dict | None = None
                  ) -> tuple[int | None, float]:
    """Run ``argv`` (after torchrun's options) on the cluster; (exit code, wall s).
    With ``gate`` the link runs at ``--startup-rate`` until every worker has
    reached ``on_train_begin`` (DDP built, its start-up broadcast done), then
    at ``--rate``: the workers wait for the cut before their first step."""
    from lorasync.emulate.launch import launch_on_cluster

    gate_dir = None
    if gate:
        gate_dir = os.path.join(out, "gate")
        os.makedirs(gate_dir)
        argv = [*argv, "--gate", gate_dir]
        cluster.set_rate(a.startup_rate)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("rc", launch_on_cluster(
        cluster, argv, module=None, timeout=a.run_timeout, env=env,
        log_dir=os.path.join(out, "logs"))))
    t0 = time.time()
    t.start()
    while t.is_alive():
        if gate_dir and not os.path.exists(os.path.join(gate_dir, "go")) and \
                all(os.path.exists(os.path.join(gate_dir, f"ready-{r}")) for r in range(2)):
            cluster.set_rate(a.rate)
            Path(gate_dir, "go").touch()
        time.sleep(0.05)
    t.join()
    cluster.set_rate(a.rate)
    return box.get("rc"), time.time() - t0


def run_trainer(cluster, a, work: str, mode: str, strategy: str = "", gate: bool = False,
                keep_avg: bool = False) -> dict:
    label = f"trainer-{mode}" + (f"-{strategy}" if strategy else "") + (
        "-token_average" if keep_avg else "")
    out = os.path.join(work, label)
    os.makedirs(out, exist_ok=True)
    argv = [os.path.abspath(__file__), "--worker", "--mode", mode, "--strategy",
            strategy or "none", "--steps", str(a.steps), "--batch-size", str(a.batch_size),
            "--seq-len", str(a.seq_len), "--model", a.model, "--out", out,
            "--logging-steps", str(a.logging_steps)]
    if keep_avg:
        argv.append("--keep-token-average")
    rc, wall = _launch_gated(cluster, a, argv, out, gate)
    res = {"label": label, "kind": "trainer", "mode": mode, "strategy": strategy or None,
           "rc": rc, "wall_s": wall}
    if res["rc"] != 0:
        res["error"] = f"exit {res['rc']}; see {out}/logs"
        return res
    with open(os.path.join(out, "rank0.json")) as fh:
        r0 = json.load(fh)
    res.update({k: r0[k] for k in ("startup_s", "startup_bytes", "base_state_bytes", "losses")})
    for k in ("final_strategy", "switches", "wire_bytes_per_step", "sync_share",
              "lorasync_startup_s", "final_sync_bytes", "final_sync_s"):
        if k in r0:
            res[k] = r0[k]
    if gate:
        res["startup_note"] = f"start-up on {a.startup_rate}, cut to {a.rate} before step 1"
    res["threads"] = r0.get("threads")
    res["samples_per_s"] = samples_per_s([(r["step"], r["time"]) for r in r0["records"]],
                                         r0["world_size"] * r0["batch_size"],
                                         tail_s=r0.get("final_sync_s") or 0.0)
    return res


def run_lorasync_train(cluster, a, work: str, strategy: str) -> dict:
    from lorasync.emulate.launch import launch_on_cluster

    label = f"lorasync-train-{strategy}"
    run = os.path.join(work, label)
    argv = ["train", "--model", a.model, "--comm", strategy, "--max-steps", str(a.steps),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--eval-size", "0",
            "--no-eval-before", "--ckpt-interval", "0", "--no-progress", "--output-dir", run]
    t0 = time.time()
    rc = launch_on_cluster(cluster, argv, timeout=a.run_timeout,
                           log_dir=os.path.join(work, f"{label}-logs"))
    res = {"label": label, "kind": "lorasync train", "strategy": strategy, "rc": rc,
           "wall_s": time.time() - t0}
    if rc != 0:
        res["error"] = f"exit {rc}; see {label}-logs"
        return res
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        recs = [json.loads(x) for x in fh]
    with open(os.path.join(run, "summary.json")) as fh:
        summary = json.load(fh)
    r0 = sorted((r for r in recs if r["rank"] == 0), key=lambda r: r["step"])
    res["samples_per_s"] = samples_per_s([(r["step"], r["time"]) for r in r0],
                                         summary["world_size"] * a.batch_size)
    steady = r0[1:] or r0
    res.update(step_s=sum(r["step_s"] for r in steady) / len(steady),
               compute_s=sum(r["compute_s"] for r in steady) / len(steady))
    res.update(startup_bytes=summary["startup_broadcast_bytes"], final_strategy=r0[-1]["strategy"],
               switches=sum(1 for r in r0 if "switch" in r),
               wire_bytes_per_step=summary["wire_bytes_per_step"],
               sync_share=summary["sync_share"])
    return res


SFT_MODES = ("plain", "accelerate_fp16", "switch")


def switch_python(work: str) -> str:
    """A Python whose site-packages runs lorasync's start-up hook file.

    This environment's own when the package installed the hook there;
    otherwise (an editable install of another checkout, say) a throwaway venv
    in ``work`` that reaches this environment's packages through a ``.pth``
    file and holds the hook file as the package ships it.  Every ``--sft`` row
    runs with it; without ``LORASYNC_STRATEGY`` the hook imports nothing."""
    import subprocess

    from lorasync.integrations import switch

    if switch.hook_installed():
        return sys.executable
    venv = os.path.join(work, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shared = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    # "00-": before the hook in site's (alphabetical) order, as in a real install
    Path(site, "00-shared.pth").write_text("\n".join(shared) + "\n")
    Path(site, switch.HOOK_FILE).write_text(Path(switch.hook_source()).read_text())
    return python


def write_sft_data(a, work: str) -> tuple[str, str]:
    """(model directory, data file) for the TRL script.  The data: the ordered
    examples (``_ordered_examples``: the batches of ``lorasync train``) as a
    JSON list of ``input_ids``/``labels`` rows; TRL takes a dataset with
    ``input_ids`` as tokenized and uses its ``labels`` as they are.  The model:
    the embedded default's converted directory, a directory as given, or
    another name (``tiny``) saved once into ``work``."""
    from lorasync.train.model import EMBEDDED, ModelSource, ensure_embedded, load_base

    base, tok = load_base(ModelSource.resolve(a.model))
    if a.model == EMBEDDED:
        model_dir = ensure_embedded(log=lambda m: print(m, file=sys.stderr))
    elif os.path.isdir(a.model):
        model_dir = a.model
    else:
        model_dir = os.path.join(work, "model")
        base.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    path = os.path.join(work, "sft-data.json")
    with open(path, "w") as fh:
        json.dump(_ordered_examples(tok, a.steps, 2, a.batch_size, a.seq_len), fh)
    return model_dir, path


def run_sft(cluster, a, work: str, mode: str, python: str, data: str, model_dir: str,
            strategy: str | None = None) -> dict:
    """One row of the TRL script (``sft_worker``), started with ``python``
    (torchrun ``--no-python``).  plain and accelerate_fp16 start on
    ``--startup-rate`` (their start-up is DDP's broadcast of the whole model,
    ~8 minutes at 10 Mbit/s) and are cut to ``--rate`` before step 1; the
    switch row runs on ``--rate`` throughout (its start-up sync is a hash
    check, and auto's probe must see the slow link).  ``strategy``: the switch
    row's LORASYNC_STRATEGY (default ``--switch-strategy``; ``none`` is the
    script's own no-sync ceiling)."""
    strategy = strategy or a.switch_strategy
    label = f"sft-{mode}" + (f"-{strategy}" if mode == "switch" else "")
    out = os.path.join(work, label)
    os.makedirs(out, exist_ok=True)
    argv = ["--no-python", python, os.path.abspath(__file__), "--sft-worker", "--mode", mode,
            "--steps", str(a.steps), "--batch-size", str(a.batch_size),
            "--seq-len", str(a.seq_len), "--model-dir", model_dir, "--data", data, "--out", out,
            "--logging-steps", str(a.sft_logging_steps or a.steps)]
    env = {k: v for k, v in os.environ.items() if k not in ("LORASYNC_STRATEGY", "LORASYNC_OPTIONS")}
    if mode == "switch":
        env["LORASYNC_STRATEGY"] = strategy
    gate = mode != "switch"
    rc, wall = _launch_gated(cluster, a, argv, out, gate, env=env)
    res = {"label": label, "kind": "trl sft", "mode": mode, "rc": rc, "wall_s": wall,
           "strategy": strategy if mode == "switch" else None}
    if rc != 0:
        res["error"] = f"exit {rc}; see {out}/logs"
        return res
    with open(os.path.join(out, "rank0.json")) as fh:
        r0 = json.load(fh)
    res.update({k: r0[k] for k in ("startup_s", "base_state_bytes", "losses", "trainer_class",
                                   "ddp_comm_hook", "lorasync_modules", "examples_given",
                                   "examples_trained_on")})
    ls = r0["lorasync_log"]
    if mode == "switch":
        if not ls:   # the switch did not attach: say so rather than report plain DDP as auto
            res["error"] = "no lorasync/* metrics in the Trainer's logs: the switch did not attach"
            return res
        res.update(final_strategy=ls.get("lorasync/strategy"),
                   switches=ls.get("lorasync/switches", 0),
                   startup_bytes=ls.get("lorasync/startup_bytes"),
                   lorasync_startup_s=ls.get("lorasync/startup_s"),
                   wire_bytes_total=ls.get("lorasync/wire_bytes_total"))
        res.update(final_sync_s=r0.get("final_sync_s", 0.0),
                   final_sync_bytes=r0.get("final_sync_bytes", 0))
        st = r0.get("steady")
        if st:   # steps 2..N, as lorasync train's
            res.update(step_s=st["step_s"], compute_s=st["step_s"] - st["comm_s"],
                       sync_share=st["comm_s"] / st["step_s"] if st["step_s"] else 0.0)
    else:
        res["startup_bytes"] = r0["base_state_bytes"]   # DDP's start-up broadcast
        res["startup_note"] = f"start-up on {a.startup_rate}, cut to {a.rate} before step 1"
    res["threads"] = r0.get("threads")
    g = _gather_per_step(r0["records"])
    if g:
        res.update(g)
    res["samples_per_s"] = samples_per_s([(r["step"], r["time"]) for r in r0["records"]],
                                         r0["world_size"] * r0["batch_size"],
                                         tail_s=r0.get("final_sync_s") or 0.0)
    return res


def report_sft(rows: list[dict], a, load: tuple[float, float]) -> dict:
    """The ``--sft`` table and its two targets: the switch row >= 1.5x plain,
    and within 5% of ``lorasync train --comm S``."""
    by = {r["label"]: r for r in rows}
    s = a.switch_strategy
    print(f"\nTRL SFTTrainer, one script three ways, and lorasync train; model {a.model}, "
          f"{a.steps} steps x 2 ranks, {a.batch_size} x <= {a.seq_len} tokens per rank per step, "
          f"link {a.rate}; load average {load[0]:.1f} before, {load[1]:.1f} after\n")
    print("| run | samples/s | vs plain | start-up | start-up sync | strategy at the end |")
    print("|---|---|---|---|---|---|")
    plain = by.get("sft-plain", {}).get("samples_per_s")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | failed: {r['error']} | | | | |")
            continue
        sps = r["samples_per_s"]
        start = "-" if "startup_s" not in r else (
            f"({r['startup_s']:.1f} s at {a.startup_rate})" if r.get("startup_note")
            else f"{r['startup_s']:.1f} s")
        print(f"| {r['label']} | {_fmt(sps)} | {_fmt(sps / plain if plain and sps else None)}x | "
              f"{start} | {_fmt_bytes(r['startup_bytes']) if r.get('startup_bytes') is not None else '-'} | "
              f"{r.get('final_strategy') or ('fp16 hook' if r.get('mode') == 'accelerate_fp16' else 'allreduce')} |")
    sw, tr = by.get(f"sft-switch-{s}"), by.get(f"lorasync-train-{s}")
    ok = lambda r: r is not None and "error" not in r and r.get("samples_per_s")  # noqa: E731
    targets: dict = {}
    if ok(sw) and plain:
        x = sw["samples_per_s"] / plain
        targets["speedup_vs_plain"] = {"ratio": x, "target": 1.5, "met": x >= 1.5}
        print(f"\nswitch ({s}) vs plain: {x:.2f}x (target >= 1.5x) -> "
              f"{'met' if x >= 1.5 else 'NOT met'}")
    if ok(sw) and ok(tr):
        x = sw["samples_per_s"] / tr["samples_per_s"]
        mean = _mean_ratio(sw, tr)
        several = len(sw.get("rounds") or []) > 1
        targets["parity_vs_lorasync_train"] = {"ratio": x, "target": 0.05}
        if several:   # the verdict on the means: a best round is a row's luckiest
            targets["parity_vs_lorasync_train"].update(
                mean_ratio=mean, rounds_switch=sw["rounds"], rounds_train=tr["rounds"])
            print(f"switch ({s}) vs lorasync train, best rounds {x:.3f}; means of the rounds "
                  f"{mean:.3f} (switch {_rounds(sw)}; lorasync train {_rounds(tr)})")
            x = mean
        targets["parity_vs_lorasync_train"]["met"] = abs(x - 1) <= 0.05
        print(f"switch ({s}) vs lorasync train --comm {s}: {x:.3f} (target within 5%) -> "
              f"{'met' if abs(x - 1) <= 0.05 else 'NOT met'}"
              + ("" if sw.get("final_strategy") == tr.get("final_strategy") else
                 f" (ended on different strategies: switch {sw.get('final_strategy')}, "
                 f"lorasync train {tr.get('final_strategy')})"))
    cs, ct = by.get("sft-switch-none"), by.get("lorasync-train-none")
    if ok(sw) and ok(tr) and ok(cs) and ok(ct):
        # the same parity with each path's own compute taken out: the share of its
        # no-sync ceiling each reaches (the TRL script computes more per step than
        # lorasync train: its loss path, not the sync)
        share_sw = (_mean_of(sw) or sw["samples_per_s"]) / (_mean_of(cs) or cs["samples_per_s"])
        share_tr = (_mean_of(tr) or tr["samples_per_s"]) / (_mean_of(ct) or ct["samples_per_s"])
        x = share_sw / share_tr
        ceil = (_mean_of(cs) or cs["samples_per_s"]) / (_mean_of(ct) or ct["samples_per_s"])
        targets["parity_of_ceiling_shares"] = {
            "switch_share": share_sw, "train_share": share_tr, "ratio": x, "target": 0.05,
            "met": abs(x - 1) <= 0.05, "ceiling_ratio": ceil}
        print(f"no-sync ceilings (means of the rounds): the TRL script {_rounds(cs)}, "
              f"lorasync train {_rounds(ct)} samples/s: the script's own ceiling is "
              f"{ceil:.3f} of lorasync train's")
        print(f"share of its own ceiling: switch ({s}) {share_sw:.3f}, lorasync train --comm {s} "
              f"{share_tr:.3f}: ratio {x:.3f} (within 5%) -> "
              f"{'met' if abs(x - 1) <= 0.05 else 'NOT met'}")
    for r in rows:
        if "error" not in r and r.get("compute_s") is not None:
            print(f"{r['label']}: rank 0 {r['step_s']:.3f} s/step, of which computing "
                  f"{r['compute_s']:.3f} s (sync share {100 * r['sync_share']:.1f}%)")
    for r in rows:
        if "error" in r:
            continue
        bits = []
        if r.get("gather_s") is not None:
            bits.append(f"TRL's metric gathers {r['gather_s']:.3f} s/step on average "
                        f"({r['gathers_per_step']:.0f} per step), worst step {r['gather_max_s']:.3f} s")
        if r.get("final_sync_s"):
            bits.append(f"final sync {r['final_sync_s']:.2f} s after the last step "
                        f"({_fmt_bytes(r.get('final_sync_bytes') or 0)}), not counted")
        if r.get("threads"):
            bits.append(f"torch threads {r['threads'][0]} (inter-op {r['threads'][1]})")
        if bits:
            print(f"{r['label']}: " + "; ".join(bits))
    return {"rate": a.rate, "startup_rate": a.startup_rate, "steps": a.steps,
            "batch_size": a.batch_size, "seq_len": a.seq_len, "model": a.model,
            "switch_strategy": s, "load_before": load[0], "load_after": load[1],
            "rows": [{k: v for k, v in r.items() if k != "losses"} | (
                {"loss_first": r["losses"][0], "loss_last": r["losses"][-1]}
                if r.get("losses") else {}) for r in rows],
            "targets": targets}


def host_cpu(start: dict | None = None) -> dict:
    """The host's CPU counters now (``start=None``), or what they did since
    ``start``: ``cpu_pressure``, the share of the wall time in which some task
    waited for a CPU (/proc/pressure/cpu), and ``host_busy_cores``, the cores
    busy on average (/proc/stat).  Two one-thread workers on this 2-core host
    keep both cores busy; a run that other work slowed shows more pressure."""
    now = {"t": time.time()}
    try:
        with open("/proc/pressure/cpu") as fh:
            some = fh.readline().split()
        now["some_us"] = int(next(x for x in some if x.startswith("total=")).split("=")[1])
    except (OSError, StopIteration, ValueError):
        pass
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        now["busy"], now["all"] = sum(f) - f[3] - f[4], sum(f)   # minus idle, iowait
        now["hz"] = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    if start is None:
        return now
    wall = now["t"] - start["t"]
    out: dict = {}
    if "some_us" in now and "some_us" in start and wall > 0:
        out["cpu_pressure"] = (now["some_us"] - start["some_us"]) / 1e6 / wall
    if "busy" in now and "busy" in start and wall > 0:
        out["host_busy_cores"] = (now["busy"] - start["busy"]) / now["hz"] / wall
    return out


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n:,} B"


def _fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def _rounds(r: dict) -> str:
    return ", ".join(_fmt(x) for x in r.get("rounds") or [r.get("samples_per_s")])


def _mean_of(r: dict) -> float | None:
    xs = [x for x in r.get("rounds") or [] if x]
    return sum(xs) / len(xs) if xs else None


def _mean_ratio(a: dict, b: dict) -> float | None:
    ra = [x for x in a.get("rounds") or [] if x]
    rb = [x for x in b.get("rounds") or [] if x]
    if not ra or not rb:
        return None
    return (sum(ra) / len(ra)) / (sum(rb) / len(rb))


def report(rows: list[dict], a, load: tuple[float, float]) -> dict:
    by = {r["label"]: r for r in rows}
    print(f"\nTrainer vs lorasync train, model {a.model}, {a.steps} steps x 2 ranks, "
          f"{a.batch_size} x <= {a.seq_len} tokens per rank per step, link {a.rate}; "
          f"load average {load[0]:.1f} before, {load[1]:.1f} after\n")
    print("| run | samples/s | vs plain Trainer DDP | start-up | start-up sync | "
          "wire MB/step | sync share | strategy at the end |")
    print("|---|---|---|---|---|---|---|---|")
    plain = by.get("trainer-plain", {}).get("samples_per_s")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | failed: {r['error']} | | | | | | |")
            continue
        sps = r["samples_per_s"]
        start = "-" if r["kind"] != "trainer" else (
            f"({r['startup_s']:.1f} s at {a.startup_rate})" if r.get("startup_note")
            else f"{r['startup_s']:.1f} s")
        print(f"| {r['label']} | {_fmt(sps)} | "
              f"{_fmt(sps / plain if plain and sps else None, '.2f')}x | {start} | "
              f"{_fmt_bytes(r['startup_bytes'])} | "
              f"{_fmt(r.get('wire_bytes_per_step', None) and r['wire_bytes_per_step'] / 1e6, '.3f')} | "
              f"{_fmt(r.get('sync_share') and 100 * r['sync_share'], '.1f')}"
              f"{'%' if r.get('sync_share') is not None else ''} | "
              f"{r.get('final_strategy', r.get('strategy') or 'allreduce')} |")
    parity = {}
    print("\nParity (target: the Trainer path within 5% of lorasync train in samples/s):")
    for s in a.pairs:
        t, l = by.get(f"trainer-lorasync-{s}"), by.get(f"lorasync-train-{s}")
        if not t or not l or "error" in t or "error" in l or not t["samples_per_s"] \
                or not l["samples_per_s"]:
            print(f"  {s}: n/a (a run failed)")
            continue
        ratio = t["samples_per_s"] / l["samples_per_s"]
        mean = _mean_ratio(t, l)
        # with several rounds the verdict rests on the means: a row's best round
        # is its luckiest, and one lucky round on one side decides a best-of ratio
        verdict = mean if mean is not None and len(t.get("rounds") or []) > 1 else ratio
        same = t.get("final_strategy") == l.get("final_strategy")
        parity[s] = {"ratio": ratio, "met": abs(verdict - 1) <= 0.05, "verdict_ratio": verdict,
                     "trainer_final": t.get("final_strategy"),
                     "train_final": l.get("final_strategy")}
        if mean is not None:
            parity[s]["mean_ratio"] = mean
        note = "" if same else (f" (ended on different strategies: Trainer "
                                f"{t.get('final_strategy')}, lorasync train {l.get('final_strategy')})")
        print(f"  {s}: best rounds: Trainer {t['samples_per_s']:.2f} vs lorasync train "
              f"{l['samples_per_s']:.2f} samples/s = {ratio:.3f}")
        if mean is not None:
            print(f"  {s}: means of the rounds: {mean:.3f} (rounds: Trainer "
                  f"{_rounds(t)}, lorasync train {_rounds(l)})")
        print(f"  {s}: {verdict:.3f} -> {'met' if parity[s]['met'] else 'NOT met'}{note}")
        k = by.get(f"trainer-lorasync-{s}-token_average")
        if k and "error" not in k and k.get("samples_per_s"):
            parity[s]["token_average_ratio"] = k["samples_per_s"] / l["samples_per_s"]
            parity[s]["token_average_mean_ratio"] = _mean_ratio(k, l)
            print(f"  {s}, keep_token_average=True (the Trainer's token-count all-gather every "
                  f"step): {k['samples_per_s']:.2f} samples/s = "
                  f"{parity[s]['token_average_ratio']:.3f} of lorasync train (best rounds), "
                  f"{_fmt(parity[s]['token_average_mean_ratio'], '.3f')} by the means "
                  f"(rounds: {_rounds(k)})")
    saved = None
    p, lo = by.get("trainer-plain"), next((by[f"trainer-lorasync-{s}"] for s in a.pairs
                                           if f"trainer-lorasync-{s}" in by
                                           and "error" not in by[f"trainer-lorasync-{s}"]), None)
    if p and lo and "error" not in p:
        saved = {"plain_startup_s": p["startup_s"], "lorasync_startup_s": lo["startup_s"],
                 "lorasync_row": lo["label"], "saved_s": p["startup_s"] - lo["startup_s"],
                 "plain_broadcast_bytes": p["startup_bytes"],
                 "lorasync_startup_bytes": lo["startup_bytes"]}
        print(f"\nStart-up: plain Trainer DDP {p['startup_s']:.1f} s (broadcasts "
              f"{p['startup_bytes'] / 1e6:.0f} MB: every parameter and buffer from rank 0), "
              f"{lo['label']} {lo['startup_s']:.1f} s ({lo['startup_bytes']} bytes): "
              f"{saved['saved_s']:.1f} s saved")
    return {"rate": a.rate, "steps": a.steps, "batch_size": a.batch_size, "seq_len": a.seq_len,
            "model": a.model, "load_before": load[0], "load_after": load[1],
            "rows": [{k: v for k, v in r.items() if k != "losses"} | (
                {"loss_first": r["losses"][0], "loss_last": r["losses"][-1]}
                if r.get("losses") else {}) for r in rows],
            "parity": parity, "startup": saved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="10mbit")
    ap.add_argument("--startup-rate", default="1gbit",
                    help="link rate during the fp16-hook row's start-up")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", default="int8,diloco,auto",
                    help="strategies run both as lorasync train and through the Trainer")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every lorasync pair N times, each round starting with another "
                         "row; keep each row's best samples/s (a shared host's load comes and "
                         "goes) and report the mean too")
    ap.add_argument("--token-average-rows", action="store_true",
                    help="also run each Trainer + lorasync pair with keep_token_average=True "
                         "(the Trainer's per-step token-count all-gather kept)")
    ap.add_argument("--logging-steps", type=int, default=500,
                    help="the Trainer's logging_steps (transformers' default 500: in a short "
                         "run, one log at the end): each log all-gathers the loss and sums the "
                         "FLOPs across ranks (_maybe_log_save_evaluate, store_flos), a barrier "
                         "that lorasync train does not have")
    ap.add_argument("--skip-plain", action="store_true",
                    help="leave out the two plain Trainer rows (saves ~10 minutes)")
    ap.add_argument("--sft", action="store_true",
                    help="instead of the rows above: one TRL SFTTrainer script (no lorasync in "
                         "it) run plain, with accelerate's fp16 comm hook, and with "
                         "LORASYNC_STRATEGY=--switch-strategy (the start-up hook attaches "
                         "lorasync), and lorasync train --comm --switch-strategy")
    ap.add_argument("--switch-strategy", default="auto",
                    help="the --sft switch row's LORASYNC_STRATEGY")
    ap.add_argument("--sft-rows", default="train,plain,accelerate_fp16,switch",
                    help="the --sft rows to run: train (lorasync train), plain, "
                         "accelerate_fp16, switch, ceilings (lorasync train --comm none "
                         "and the script with LORASYNC_STRATEGY=none: each path's no-sync "
                         "ceiling, so that the parity can be read as shares of the ceilings)")
    ap.add_argument("--sft-logging-steps", type=int, default=0,
                    help="the --sft script's logging_steps (0: --steps, one log at the end)")
    ap.add_argument("--run-timeout", type=float, default=1800)
    ap.add_argument("--json", metavar="FILE")
    # worker side (started by the bench on every node)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="lorasync", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--option", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--keep-token-average", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--gate", help=argparse.SUPPRESS)
    ap.add_argument("--sft-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    if a.sft_worker:
        sft_worker(a)
        return
    a.pairs = [s.strip() for s in a.pairs.split(",") if s.strip()]

    import tempfile

    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import parse_emulate
    from lorasync.train.model import EMBEDDED, ensure_embedded

    if a.model == EMBEDDED:
        ensure_embedded(log=lambda m: print(m, file=sys.stderr))   # convert once, outside timing
    load0 = os.getloadavg()[0]
    rows: list[dict] = []
    spec = parse_emulate(f"nodes=2,rate={a.rate},name=hfbench")
    with tempfile.TemporaryDirectory() as work, emulated(spec) as cluster:
        plan = []
        for k in range(max(1, a.rounds)):
            for s in a.pairs:
                kinds = [("train", s), ("trainer-lorasync", s)]
                if a.token_average_rows:
                    kinds.append(("trainer-lorasync-keepavg", s))
                # each round starts with another row: no row always runs first or last
                # (a host's load drifts over an invocation)
                plan += kinds[k % len(kinds):] + kinds[:k % len(kinds)]
        if not a.skip_plain:
            plan += [("trainer-torch_fp16", ""), ("trainer-plain", "")]
        if a.sft:
            python = switch_python(work)
            model_dir, data = write_sft_data(a, work)
            want = {x.strip() for x in a.sft_rows.split(",") if x.strip()}
            kinds = [("train", a.switch_strategy)] if "train" in want else []
            kinds += [("sft", m) for m in SFT_MODES if m in want]
            if "ceilings" in want:   # each path's own no-sync ceiling (--comm none)
                kinds += [("train", "none"), ("sft", "switch:none")]
            plan = []
            for k in range(max(1, a.rounds)):
                plan += kinds[k % len(kinds):] + kinds[:k % len(kinds)]
        for kind, s in plan:
            print(f"running {kind} {s} ...", file=sys.stderr, flush=True)
            host0 = host_cpu()
            if kind == "sft":
                mode, _, strat = s.partition(":")
                r = run_sft(cluster, a, work, mode, python, data, model_dir, strat or None)
            elif kind == "train":
                r = run_lorasync_train(cluster, a, work, s)
            else:
                mode = kind.split("-")[1]
                r = run_trainer(cluster, a, work, mode, s, gate=(mode == "torch_fp16"),
                                keep_avg=kind.endswith("-keepavg"))
            r.update(host_cpu(host0))
            print(f"   {r['label']}: {r.get('error') or _fmt(r.get('samples_per_s')) + ' samples/s'}"
                  f" ({r['wall_s']:.0f} s; host: CPU pressure {_fmt(r.get('cpu_pressure'), '.2f')}, "
                  f"{_fmt(r.get('host_busy_cores'), '.2f')} cores busy)", file=sys.stderr, flush=True)
            rows.append(r)
    runs = [{k: r.get(k) for k in ("label", "samples_per_s", "final_strategy", "cpu_pressure",
                                   "host_busy_cores", "wall_s", "gather_s", "final_sync_s")}
            for r in rows]   # every run in order: a slow round can be told apart
    best: dict[str, dict] = {}
    for r in rows:   # one row per configuration: its best round
        b = best.get(r["label"])
        if b is None or "error" in b or ("error" not in r and (r.get("samples_per_s") or 0)
                                         > (b.get("samples_per_s") or 0)):
            best[r["label"]] = dict(r, rounds=[x.get("samples_per_s") for x in rows
                                               if x["label"] == r["label"]])
    res = (report_sft if a.sft else report)(list(best.values()), a, (load0, os.getloadavg()[0]))
    res["runs"] = runs
    print("\nevery run in order (host CPU pressure: share of the run's wall time in which some "
          "task on this host waited for a CPU):")
    for x in runs:
        print(f"  {x['label']}: {_fmt(x['samples_per_s'])} samples/s, CPU pressure "
              f"{_fmt(x['cpu_pressure'])}, {_fmt(x['host_busy_cores'])} cores busy")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
