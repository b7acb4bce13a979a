"""One rank's training run: the ``Trainer``.

``setup`` builds the model, strategy and optimizer, ``run`` is the train
loop.  Its parts live in their own modules, each with its state:
``Checkpointer`` (train/checkpoint/: what to resume from, when and what to
save), ``Evaluator`` (train/evaluate.py: eval loss, exact-match,
evals.jsonl) and ``StepLog`` (train/steplog.py: the step records, their
streams, sinks and the progress bar); train/summary.py reduces the records
to summary.json.  The process around it (group, watchdog, exit) is
train/worker.py's.

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
  sync strategy as soon as all its gradients are ready; an adapter of a few
  MB in 1 MB buckets lets the sync of the last layers' gradients run while the
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

import json
import math
import os
import time

from lorasync.config import Config
from lorasync.errors import DataError, LorasyncError
from lorasync.train.ddp import buffer_sync_kwarg as _buffer_sync_kwarg
from lorasync.train.ddp import make_identical
from lorasync.train.precision import check_precision
from lorasync.train.schedule import lr_lambda, schedule_note
from lorasync.train.summary import format_summary
from lorasync.train.summary import summarize as _summarize
from lorasync.train.watchdog import Pace

__all__ = ["Trainer", "peak_memory_bytes", "prepare_run_dir"]


def peak_memory_bytes(device) -> int:
    """This process's peak memory so far: the CUDA caching allocator's peak
    allocation on a GPU, the peak resident set size (ru_maxrss) on a CPU."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _accepts_loss_kwargs(model) -> bool:
    """Whether the model's forward takes ``num_items_in_batch`` (transformers'
    causal LMs do, through their ``**kwargs``; the HF Trainer asks the same)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False
    return "num_items_in_batch" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _enable_checkpointing(base, name: str) -> None:
    """transformers' gradient checkpointing on the base model, non-reentrant:
    the recomputation runs inside the one autograd pass, so DDP sees each
    adapter gradient become ready once (the reentrant variant runs a second
    backward per block, which DDP reports as a variable marked ready twice),
    and the frozen embedding's output needs no ``enable_input_require_grads``
    (only the reentrant variant loses the graph when a block's input does not
    require grad)."""
    from lorasync.errors import ConfigError

    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError("train.gradient_checkpointing", True, f"{name} does not support "
                          "gradient checkpointing in transformers; drop "
                          "--gradient-checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):   # its name from transformers 5.x on
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class _LabelTokens:
    """``[j]``: the label tokens of training example ``j`` that the causal-LM
    loss counts (labels shifted by one), counted once, when first asked."""

    def __init__(self, examples, ignore: int):
        self.examples, self.ignore, self.known = examples, ignore, {}

    def __getitem__(self, j: int) -> int:
        n = self.known.get(j)
        if n is None:
            n = self.known[j] = sum(t != self.ignore for t in self.examples[j].labels[1:])
        return n


def prepare_run_dir(cfg: Config, resume: bool) -> None:
    """Rank 0: create the run directory (after validation and any restore) and
    write config.yaml, with the checksum ``--resume`` checks."""
    from lorasync.train.runconfig import write_run_config

    out = cfg.run.output_dir
    os.makedirs(out, exist_ok=True)
    write_run_config(cfg, os.path.join(out, "config.yaml"))


class Trainer:
    """One rank's training run.

    ``setup()`` loads the model and data, agrees with the other ranks on the
    checkpoint to resume from (when resuming or restarted), builds DDP, the
    sync strategy, optimizer and schedule, and restores or seeds their
    state; ``run()`` trains to the end (or ``--stop-after``), then writes the
    adapter, metrics.jsonl and summary.json.  Collectives run in the same
    order on every rank.  ``watchdog`` (train/watchdog.py) is told what the
    rank does, so that a failing peer is named within its bound.  ``source``: the
    model as the launcher resolved it (``ModelSource``); None: ``setup`` resolves it.
    """

    def __init__(self, cfg: Config, resume: bool, env: dict, device, backend: str, log, *,
                 watchdog=None, spawned: float | None = None, source=None):
        import torch.distributed as dist

        self.cfg, self.tc, self.resume, self.device, self.backend = \
            cfg, cfg.train, resume, device, backend
        self.log = log
        self.rank, self.world, self.local_rank = env["rank"], env["world_size"], env["local_rank"]
        self.run_dir = cfg.run.output_dir
        self.barrier = (lambda: dist.barrier(device_ids=[device.index])) if backend == "nccl" \
            else dist.barrier
        self.watchdog = watchdog
        # what the main thread tells the watchdog about its progress (no-ops without one)
        self.pace = watchdog if watchdog is not None else Pace()
        self.spawned = spawned if spawned is not None else time.time()
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.source = source
        self.steplog = None
        self._restart_field: dict | None = None
        self._eval_owed = False   # an evaluation due at an earlier step, deferred
        self._eval_now = False    # evaluate after this step

    def _mark(self, phase: str, step: int | None = None) -> None:
        self.pace.mark(phase, self.progress.step if step is None else step)

    def _barrier(self, what: str) -> None:
        with self.pace.waiting(what):
            self.barrier()

    def record_event(self, event: dict) -> None:
        """An event of this rank (a fault verdict) into its stream, once it is open."""
        if self.steplog is not None:
            self.steplog.stream.write({**event, "attempt": self.attempt.number})

    # -- setup ----------------------------------------------------------------

    def setup(self) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from lorasync.comm import attach
        from lorasync.train.checkpoint import Checkpointer, Progress
        from lorasync.train.data import IGNORE, load_datasets, steps_per_epoch
        from lorasync.train.model import (ModelSource, adapter_named_params,
                                          adapter_param_count, add_lora, load_base)
        from lorasync.errors import CheckpointError
        from lorasync.train.recovery import Attempt, classify, history

        cfg, tc, rank, world, device = self.cfg, self.tc, self.rank, self.world, self.device
        self.progress = Progress(grad_accum=tc.grad_accum)
        self.attempt = Attempt()
        self._mark("setup")
        check_precision(cfg, device.type)   # a run started by torchrun directly
        t_load = time.time()
        # the one stage without a bound of its own: a first download may take any time
        self.pace.tick("load", allow_s=math.inf)
        # a worker torchrun started directly (no launcher resolved it) resolves it here
        self.source = self.source or ModelSource.resolve(cfg.model.name)
        base, self.tok = load_base(self.source, cfg.model.dtype, self.log, quantize=cfg.model,
                                   device=device)
        if tc.gradient_checkpointing:
            _enable_checkpointing(base, cfg.model.name)
        self.train_set, self.eval_set = load_datasets(cfg.data, self.tok, warn=self.log)
        self.pace.tick("loaded")
        self.global_batch = world * tc.batch_size * tc.grad_accum
        if len(self.train_set) < self.global_batch:
            raise DataError(f"data.path: {len(self.train_set)} training examples is fewer than "
                            f"one global batch ({world} ranks x batch_size {tc.batch_size} x "
                            f"grad_accum {tc.grad_accum} = {self.global_batch}); add data or "
                            "lower --batch-size")
        spe = steps_per_epoch(len(self.train_set), self.global_batch)
        self.total_steps = tc.max_steps or max(1, int(tc.epochs * spe))
        self.end_step = min(self.total_steps, tc.stop_after) if tc.stop_after \
            else self.total_steps
        note = schedule_note(tc.schedule, tc.lr, tc.warmup_steps, self.total_steps)
        if note:
            self.log(note)

        self.ckpt = Checkpointer(self.run_dir, rank=rank, local_rank=self.local_rank,
                                 world_size=world, barrier=self.barrier,
                                 interval=tc.ckpt_interval, keep=tc.keep_ckpts, pace=self.pace,
                                 tokenizer=self.tok, base_ref=self.source.ref)
        # A restarted group resumes by itself; the ranks agree on the checkpoint.
        self.history = history(self.run_dir, rank)
        self.plan, meta, histories = self.ckpt.agree(
            resume=self.resume or self.restart_count > 0, history=self.history)
        self.attempt = classify(histories, self.history, resumed_from=self.plan.step,
                                world=world, restart_count=self.restart_count,
                                run_dir=self.run_dir, rank=rank)
        if self.resume and not self.plan.step and self.attempt.cause != "recover":
            raise CheckpointError(f"--resume: {self.run_dir} has no complete checkpoint; start "
                                  "a new run without --resume")
        if self.attempt.cause == "recover":
            self.log(self.attempt.describe(self.plan.step, world))
        self.eval_before = meta.get("eval_before")
        self._scaler_state = meta.get("grad_scaler")   # --fp16: the loss scale reached
        # an evaluation deferred past the checkpoint's step runs after the next
        self._eval_owed = bool(meta.get("eval_owed", False))

        model = self.model = add_lora(base, cfg.lora, tc.seed).to(device)
        if cfg.run.init_adapter and not self.plan.step:   # every rank loads the same file
            from lorasync.train.checkpoint import load_init_adapter
            load_init_adapter(model, cfg.run.init_adapter)
        model.train()
        # Make the adapter identical on every rank: rank 0's init is the truth.
        # This (a few MB at most) replaces DDP's start-up broadcast of the whole model.
        lora = [p for _, p in adapter_named_params(model)]   # modules_to_save copies too
        with self.pace.waiting("the check that every rank's adapter is the same"):
            self.startup_bytes = make_identical(lora, device)
        self.n_adapter = adapter_param_count(model)
        self.log(f"lorasync: {world} rank(s), backend {self.backend}, model {cfg.model.name}, "
                 f"{self.n_adapter:,} trainable adapter parameters, strategy "
                 f"{cfg.comm.strategy}, {len(self.train_set)} train / {len(self.eval_set)} eval "
                 f"examples, loaded in {time.time() - t_load:.1f} s")

        with self.pace.waiting("DDP's check of the parameters across ranks"):
            self.ddp = DDP(model, device_ids=[device.index] if self.backend == "nccl" else None,
                           init_sync=False, bucket_cap_mb=cfg.comm.bucket_mb,
                           find_unused_parameters=False,
                           **_buffer_sync_kwarg(cfg.comm.broadcast_buffers))
        try:
            with self.pace.waiting("the set-up of the sync strategy"):
                self.sync = attach(self.ddp, cfg.comm.strategy, hierarchy=cfg.comm.hierarchy,
                                   ranks_per_node=cfg.comm.ranks_per_node or None,
                                   allreduce_algo=cfg.comm.allreduce_algo,
                                   cross_node=cfg.comm.cross_node, **cfg.comm.options)
        except ValueError as exc:
            raise LorasyncError(f"comm: {exc}") from None
        params = self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
        # mixed precision: autocast on the device; the adapter stays fp32, so do its
        # gradients, what the strategies sync, and the optimizer (docs/training.md)
        self.amp_dtype = torch.bfloat16 if tc.bf16 else torch.float16 if tc.fp16 else None
        self.scaler = torch.amp.GradScaler(device.type) if tc.fp16 else None
        self.loss_kwargs = _accepts_loss_kwargs(model)
        # label tokens of an example (what the shifted causal-LM loss counts), counted
        # when first drawn: every rank knows every rank's batch, so the step's token
        # total needs no collective
        self.label_tokens = _LabelTokens(self.train_set, IGNORE)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(tc.schedule, tc.warmup_steps, self.total_steps))
        if hasattr(self.sync, "set_optimizer"):
            # auto: lets it average rank-local optimizer moments when it leaves local/diloco
            self.sync.set_optimizer(self.opt)
        self.adaptive_accum = (tc.max_grad_accum > tc.grad_accum
                               and hasattr(self.sync, "suggested_accum"))
        if tc.max_grad_accum > tc.grad_accum and not self.adaptive_accum:
            self.log(f"note: --max-grad-accum needs --comm auto; keeping grad_accum "
                     f"{tc.grad_accum}")

        self.reset: list[str] = []
        if self.plan.step:
            self.reset = self.ckpt.restore(self.plan, self.progress, self.global_batch,
                                           model=model, opt=self.opt, sched=self.sched,
                                           sync=self.sync, seed=tc.seed)
            folder = self.ckpt.folder(self.plan.step)
            self.log(f"resumed from {folder} at step {self.progress.step}"
                     + (f" ({self.plan.note})" if self.plan.peer else ""))
        else:
            from lorasync.train.checkpoint import seed_rngs
            seed_rngs(tc.seed, rank)
        if self.scaler is not None and self.plan.step and self._scaler_state:
            self.scaler.load_state_dict(self._scaler_state)
        # Everything the user could get wrong has been checked and the checkpoint
        # restored on every rank (a failed resume stops every rank in restore):
        # only now write.
        if rank == 0:
            self.pace.tick("run directory")
            prepare_run_dir(cfg, self.resume)
        self._barrier("the barrier after the run directory is written")
        if self.local_rank == 0 and not os.path.isfile(os.path.join(self.run_dir, "config.yaml")):
            # node-local disks: every node gets the config, so `--resume` works on each
            prepare_run_dir(cfg, self.resume)

    # -- the loop ---------------------------------------------------------------

    def run(self) -> int:
        import torch.distributed as dist

        from lorasync.train.evaluate import Evaluator
        from lorasync.train.steplog import StepLog

        cfg, tc = self.cfg, self.tc
        self.steplog = StepLog(self.run_dir, rank=self.rank, world=self.world,
                               strategy=cfg.comm.strategy, run_cfg=cfg.run,
                               store=dist.distributed_c10d._get_default_store())
        self.steplog.stream.write(self._start_event())
        at = self.attempt
        if at.cause == "recover":
            self._restart_field = {"attempt": at.number, "from_step": self.plan.step,
                                   "steps_redone": at.steps_redone,
                                   "restart_count": at.restart_count, "reason": at.reason}
        self.evaluate = Evaluator(self.model, self.eval_set, self.tok, self.device,
                                  rank=self.rank, world=self.world,
                                  max_new_tokens=tc.max_new_tokens, run_dir=self.run_dir,
                                  sinks=self.steplog.sinks, sync=lambda: self.sync,
                                  mean_replicas=tc.eval_mean, pace=self.pace)
        try:
            if self.plan.step:  # evaluations after the checkpoint will run again
                self.evaluate.forget_after(self.progress.step)
            if self.eval_before is None and tc.eval_before and cfg.data.eval_size \
                    and self.eval_set:
                self.log("evaluating the base adapter ...")
                self._mark("eval")
                self.eval_before = self.evaluate(0)
            self.steplog.start(self.sync, start_step=self.progress.step,
                               total_steps=self.total_steps, progress=cfg.run.progress)
            for step in range(self.progress.step + 1, self.end_step + 1):
                self._mark("train", step)
                self._step(step)
                if self._eval_now:
                    self._mark("eval")
                    r = self.evaluate(step)
                    self.log(f"step {step}: eval loss {r['eval_loss']:.4f}, exact-match "
                             f"{r['correct']}/{r['n']}")
                if self.ckpt.due(step, self.end_step):
                    self._mark("checkpoint")
                    self.ckpt.save(self.progress, model=self.model, opt=self.opt,
                                   sched=self.sched, sync=self.sync,
                                   meta={"eval_before": self.eval_before,
                                         "total_steps": self.total_steps,
                                         "eval_owed": self._eval_owed,
                                         # rank 0's (the same on every rank under per-step
                                         # strategies, which sync before the scaler looks)
                                         "grad_scaler": self.scaler.state_dict()
                                         if self.scaler is not None else None})
            if self.end_step >= self.total_steps:
                return self._finish()   # its final evaluation still reaches the trackers
            self._end_event("stopped")
        finally:
            self.steplog.close()
        self.log(f"stopped after step {self.end_step} of {self.total_steps} (--stop-after); "
                 f"continue with --resume --output-dir {self.run_dir}")
        return 0

    def _start_event(self) -> dict:
        from lorasync.train.watchdog import describe_self

        me, at = describe_self(self.rank), self.attempt
        return {"event": "start", "attempt": at.number, "rank": self.rank,
                "world_size": self.world, "cause": at.cause, "resumed_from": self.plan.step,
                "restart_count": at.restart_count,
                "state": ("own" if self.rank in self.plan.own else "peer") if self.plan.step
                else "new", "reset": self.reset, "plan": self.plan.note, "reason": at.reason,
                "steps_redone": at.steps_redone, "resume_point_time": at.resume_point_time,
                "membership": at.membership, "spawn": self.spawned, "time": time.time(),
                "node": me["node"], "host": me["host"], "addr": me["addr"], "pid": me["pid"]}

    def _end_event(self, how: str) -> None:
        self.steplog.stream.write({"event": "end", "attempt": self.attempt.number,
                                   "rank": self.rank, "step": self.progress.step, "how": how,
                                   "time": time.time()})

    def _step(self, step: int) -> None:
        """One optimizer step: micro-batches, optimizer, strategy, record."""
        import contextlib

        import torch

        from lorasync.train.data import batch_tokens, batches_at, collate

        tc, sync, ddp, device, pg = self.tc, self.sync, self.ddp, self.device, self.progress
        t0 = time.perf_counter()
        micro = batches_at(pg.sample_offset, n=len(self.train_set), seed=tc.seed, rank=self.rank,
                           world=self.world, batch_size=tc.batch_size, grad_accum=pg.grad_accum)
        denom, factor, mine = self._loss_norm(pg.sample_offset, micro, pg.grad_accum)
        pg.sample_offset += self.world * tc.batch_size * pg.grad_accum
        loss_sum, samples, tokens, data_s, hook_wait = 0.0, 0, 0, 0.0, 0.0
        amp = (lambda: torch.autocast(device.type, dtype=self.amp_dtype)) if self.amp_dtype \
            else contextlib.nullcontext
        for i, idx in enumerate(micro):
            td = time.perf_counter()
            examples = [self.train_set[j] for j in idx]
            batch = collate(examples, self.tok.pad_token_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            data_s += time.perf_counter() - td
            last = i == len(micro) - 1
            sync.last_ready_time = None
            # accumulate locally (no_sync); sync once per step, in the last backward.
            # _micro_loss runs the forward with use_cache=False: no KV cache to build, and
            # transformers masks attention between packed examples (--packing) only then
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = self._micro_loss(ddp, batch, denom, amp)
                back = loss * factor
                (self.scaler.scale(back) if self.scaler is not None else back).backward()
            if last and sync.last_ready_time is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                hook_wait += max(0.0, time.perf_counter() - sync.last_ready_time)
            loss_sum += float(loss.detach()) * denom   # this micro-batch's summed token losses
            samples += len(idx)
            tokens += batch_tokens(examples)
        grad_norm = self._clip()
        if self.scaler is not None:
            self.scaler.step(self.opt)   # skipped when the unscaled gradient is not finite
            self.scaler.update()
        else:
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        # a common point: a periodic strategy's average waits here on every rank, and on a
        # slow link one rank may leave it long after another (the watchdog allows that)
        with self.pace.waiting("the step's sync (after_step)"):
            sync.after_step()
        self._eval_now = self._evaluation_due(step, sync)
        if self._eval_now:
            # an evaluation must not give a streamed sync free link time:
            # what is in flight arrives now, as this step's exposed sync
            sync.settle()
        step_s = time.perf_counter() - t0
        rec = self.steplog.record(step=step, stats=sync.stats(),
                                  loss=loss_sum / max(1, mine),
                                  lr=self.sched.get_last_lr()[0], samples=samples,
                                  tokens=tokens, grad_accum=len(micro), step_s=step_s,
                                  hook_wait_s=hook_wait, data_s=data_s, grad_norm=grad_norm)
        rec["peak_mem_bytes"] = peak_memory_bytes(device)
        if self.scaler is not None:
            rec["loss_scale"] = float(self.scaler.get_scale())
        if self.adaptive_accum:
            nxt = sync.suggested_accum(pg.grad_accum, tc.max_grad_accum, tc.grad_accum)
            if nxt != pg.grad_accum:
                self.log(f"step {step}: {nxt} micro-batches per sync from now on (was "
                         f"{pg.grad_accum}): sync share {100 * rec['comm_s'] / step_s:.0f}%")
                pg.grad_accum = nxt
        if self._restart_field is not None:  # the first step after a recovery
            t0 = self.attempt.resume_point_time
            lost = (rec["time"] - step_s - t0) if t0 else None
            rec["restart"] = {**self._restart_field, "lost_s": lost}
            self._restart_field = None
        pg.step = step
        self.steplog.write(rec)
        if self.watchdog is not None:
            self.watchdog.step_done(step_s)

    def _loss_norm(self, offset: int, micro: list[list[int]], accum: int
                   ) -> tuple[int, float, int]:
        """(denominator, factor, this rank's label tokens) of the step's loss.

        The loss of a step is the sum of its token losses over the label
        tokens of the whole accumulated batch (as transformers >= 4.46 and
        its Trainer compute it with ``num_items_in_batch``), not a mean of
        micro-batch means, so that a micro-batch of short completions weighs
        what its tokens weigh.  Where the strategy averages the gradient over
        the ranks every step, the denominator is every rank's label tokens
        and the factor the world size (the average divides by it again):
        the synced gradient is that of the global batch's token mean, the
        HF Trainer's ``average_tokens_across_devices``.  It costs no
        collective: every rank holds the data and knows every rank's
        examples.  Under local SGD, DiLoCo and ``none`` a replica's gradient
        is its own: the denominator is this rank's tokens, the factor 1."""
        from lorasync import catalog
        from lorasync.train.data import batches_at

        mine = sum(self.label_tokens[j] for mb in micro for j in mb)
        name = getattr(self.sync, "strategy", None) or self.sync.name
        averaged = name in catalog.SPECS and catalog.SPECS[name].per_step \
            and name != catalog.NONE
        if not averaged or self.world == 1:
            return max(1, mine), 1.0, mine
        tc = self.tc
        every = batches_at(offset, n=len(self.train_set), seed=tc.seed, rank=0, world=1,
                           batch_size=self.world * tc.batch_size * accum, grad_accum=1)[0]
        return max(1, sum(self.label_tokens[j] for j in every)), float(self.world), mine

    def _micro_loss(self, ddp, batch: dict, denom: int, amp):
        """The micro-batch's summed token losses / ``denom``."""
        if self.loss_kwargs:
            with amp():
                return ddp(**batch, num_items_in_batch=denom, use_cache=False).loss
        # a model without the loss kwargs: its token mean, re-weighted
        from lorasync.train.data import IGNORE

        n = int((batch["labels"][:, 1:] != IGNORE).sum())
        with amp():
            loss = ddp(**batch, use_cache=False).loss
        return loss * (n / denom) if n else loss * 0.0

    def _clip(self) -> float | None:
        """The gradient's global L2 norm before clipping (None when there is
        none to measure), clipped to ``--max-grad-norm`` unless that is 0.

        Called after backward, i.e. after a per-step strategy's hooks have
        synced the gradient: every rank holds the same synced gradient, so
        every rank computes the same norm and clips alike.  Under local SGD
        and DiLoCo (and ``none``) ``.grad`` is the replica's own gradient and
        is clipped as such.  Error-feedback residuals (int8, onebit, topk,
        powersgd) keep what compression did not deliver, unclipped; clipping
        scales only what the optimizer takes this step.  Under fp16 the
        scaler unscales first.  1-bit Adam's momentum steps leave the averaged
        momentum in ``.grad``, stepped by the strategy itself with its own
        update clipping (``max_update_rms``): neither measured nor clipped."""
        import torch

        if self.sync.grads_hold_momentum:
            return None
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if self.tc.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.tc.max_grad_norm, norm)
        value = float(norm)
        return value if math.isfinite(value) else None

    def _evaluation_due(self, step: int, sync) -> bool:
        """Whether to evaluate after ``step`` (every rank agrees).  Every
        ``eval_interval`` steps, but one step later when a streamed sync is
        in flight now and nothing will be after the next step: the link then
        carries it under the next step's compute, as it would with no
        evaluation, where settling it now would expose all of it (each launch
        step of DiLoCo's outer sync is a multiple of its period, and so of an
        even interval).  Where one still will be (a delay of 2 or more, a
        fragment launched every step) it settles on time.  Never later
        than the session's last step; the final evaluation (after
        ``finish``) is separate."""
        tc = self.tc
        if not tc.eval_interval or step >= self.total_steps:
            return False
        if step % tc.eval_interval and not self._eval_owed:
            return False
        if not self._eval_owed and sync.in_flight and not sync.in_flight_next_step \
                and step < self.end_step:
            self._eval_owed = True
            return False
        self._eval_owed = False
        return True

    # -- the end ------------------------------------------------------------------

    def _finish(self) -> int:
        """All steps done: final average, last evaluation, adapter, metrics, summary."""
        import torch.distributed as dist

        from lorasync.monitor.metrics import effective_records, write_merged
        from lorasync.train.checkpoint import SLOW_DISK_BPS
        from lorasync.train.recovery import fault_summary

        cfg, rank, world, run_dir = self.cfg, self.rank, self.world, self.run_dir
        self._mark("finish")
        with self.pace.waiting("the final sync"):
            self.sync.finish()
        eval_after = self.evaluate(self.total_steps) if cfg.data.eval_size and self.eval_set \
            else None
        self.steplog.close()   # trackers have the final evaluation; the bar ends before the summary
        if rank == 0:
            self.pace.tick("adapter", allow_s=(self.n_adapter * 4 + (4 << 20)) / SLOW_DISK_BPS)
            from lorasync.train.checkpoint import export_adapter
            export_adapter(self.model, os.path.join(run_dir, "adapter"), tokenizer=self.tok,
                           base_ref=self.source.ref)
        self.pace.tick("end event")
        self._end_event("done")
        gathered = [None] * world if rank == 0 else None
        with self.pace.waiting("the gather of every rank's records"):
            dist.gather_object(self.steplog.records, gathered, dst=0)
        if rank == 0:
            # metrics.jsonl and summary.json: about half a kB per record
            self.pace.tick("summary", allow_s=sum(map(len, gathered)) * 512 / SLOW_DISK_BPS)
            steps = effective_records(gathered)
            write_merged(os.path.join(run_dir, "metrics.jsonl"), steps)
            summary = _summarize(steps, cfg, world, self.n_adapter, self.startup_bytes,
                                 self.eval_before, eval_after)
            summary["faults"] = fault_summary(gathered)
            # per rank: the highest of its records (a high-water mark since the worker started)
            summary["peak_mem_bytes"] = [max((r.get("peak_mem_bytes") or 0 for r in recs),
                                             default=0) or None for recs in gathered]
            summary["peak_mem_kind"] = "cuda_allocated" if self.device.type == "cuda" \
                else "max_rss"
            with open(os.path.join(run_dir, "summary.json"), "w") as fh:
                json.dump(summary, fh, indent=1)
            print(format_summary(summary, run_dir))
        self._barrier("the final barrier")
        return 0
