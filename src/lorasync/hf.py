"""lorasync in the loops LoRA users already run: transformers ``Trainer``, TRL
``SFTTrainer`` (a Trainer) and accelerate.

    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, peft_config=LoraConfig(...))
    lorasync.hf.attach(trainer, strategy="auto")      # the one extra line, on every rank
    trainer.train()

    accelerator = Accelerator()
    sync = lorasync.hf.attach(accelerator, "int8")    # before accelerator.prepare
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ...  optimizer.step(); sync.after_step()

How it fits in without patching the Trainer
-------------------------------------------
The Trainer wraps the model in DDP inside ``trainer.train()``, through
accelerate: ``accelerator.prepare(model)`` builds
``DistributedDataParallel(model, **accelerator.ddp_handler.to_kwargs())`` and
then calls ``accelerator.ddp_handler.register_comm_hook(ddp)``.  The handler is
a ``DistributedDataParallelKwargs`` that the Trainer made from its ``ddp_*``
arguments (accelerate's documented way to configure its DDP).  ``attach``
puts lorasync's own handler, a subclass, into that slot:

* its ``to_kwargs()`` returns the DDP arguments lorasync uses for LoRA
  (see ``train/trainer.py``): ``init_sync=False``, so DDP does not broadcast the
  module's state from rank 0 when it is built (every parameter and buffer,
  the frozen base included: 540 MB for SmolLM2-135M, 7 minutes at
  10 Mbit/s); no buffer broadcast before every forward; 1 MB buckets so the
  sync overlaps the backward pass; no unused-parameter search.  The user's
  explicit ``ddp_bucket_cap_mb``, ``ddp_find_unused_parameters``,
  ``ddp_broadcast_buffers`` and ``ddp_static_graph`` still win.
* its ``register_comm_hook(ddp)`` makes the adapter (the trainable
  parameters) identical on every rank: a 16-byte hash all-reduce, and a
  broadcast of the adapter alone from rank 0 only if the ranks differ
  (``train.ddp.make_identical``); then ``lorasync.attach(ddp, strategy)``.
  Every rank loaded the same base weights itself, so nothing else must move.

A ``TrainerCallback``, first in the Trainer's callback list, does the rest:

* ``on_train_begin``: hands the Trainer's optimizer to strategies that take
  it (``onebit`` runs as 1-bit Adam on the Trainer's AdamW; ``auto``), and on
  a resume loads lorasync's state from the checkpoint;
* ``on_step_begin`` / ``on_pre_optimizer_step`` / ``on_step_end``: timing of
  the exposed sync (from the last bucket's hook to the end of backward, plus
  what the strategy waited for itself), ``sync.after_step()`` once per
  optimizer step (the outer step of local/diloco; auto's measurements and
  switches), and ``sync.finish()`` after the last step, so the adapters are
  identical on every rank before the final checkpoint and ``save_model``;
* gradient accumulation needs nothing: the Trainer runs the micro-batches
  but the last under ``no_sync`` (DDP calls no hook), so the strategy sends
  once per optimizer step;
* ``on_log``: adds ``lorasync/*`` metrics (this rank's) to the Trainer's
  training logs, so they land in ``trainer.state.log_history`` and in every
  ``report_to`` integration;
* ``on_save``: writes ``lorasync/rank-R.pt`` (this rank's strategy state:
  error feedback, DiLoCo's anchor and momentum, auto's decision; for
  strategies whose replicas differ between syncs also this rank's adapter
  and optimizer moments) and ``lorasync/meta.json`` into the checkpoint.

One Trainer setting changes: ``average_tokens_across_devices`` (True by
default in transformers) all-gathers the step's label-token count across
ranks once per optimizer step, before its first forward, to divide the loss
by the global count.  That is a collective per step on the slow link and a
barrier that holds every rank to the slowest one, which is what local SGD
and DiLoCo exist to avoid (measured in docs/huggingface.md).  ``attach``
turns it off on the Trainer's ``TrainingArguments``, as ``lorasync train``
and plain DDP have it: every rank divides its loss by its own tokens and the
ranks' gradients are averaged.
``keep_token_average=True`` keeps the Trainer's global token average.

Resume: ``trainer.train(resume_from_checkpoint=...)`` restores the adapter,
optimizer and schedule itself, but callbacks are not told which checkpoint it
read.  lorasync looks in ``args.resume_from_checkpoint`` when set (TRL's
scripts pass it), in ``args.output_dir/checkpoint-<global step>`` (where
``resume_from_checkpoint=True`` points) and where the checkpoint was written
(recorded in its ``trainer_state.json``, ``stateful_callbacks["lorasync"]``,
with a token that is unique per save: files of another run or step are never
loaded).  A checkpoint moved away from all three is an error naming the fix.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
import warnings
from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from transformers import Trainer, TrainerCallback
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"lorasync.hf needs transformers and accelerate ({_exc}); install them "
                      "with: pip install 'lorasync[hf]'") from None

from lorasync.errors import LorasyncError

__all__ = ["attach", "HFSync", "AttachError", "CHECKPOINT_SUBDIR"]

#: folder inside a Trainer checkpoint that holds lorasync's state
CHECKPOINT_SUBDIR = "lorasync"
#: key of lorasync's token in ``TrainerState.stateful_callbacks``
_TOKEN_KEY = "lorasync"
#: lorasync's DDP bucket size for the Trainer path (``lorasync train``'s default)
DEFAULT_BUCKET_MB = 1.0


class AttachError(LorasyncError, ValueError):
    """``attach`` cannot work with this Trainer / accelerator / option; the
    message names what and the fix.  A ``ValueError`` (and a LorasyncError)."""


# --------------------------------------------------------------------------- helpers

def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _say(msg: str) -> None:
    """One line on stderr, from rank 0 only."""
    if _rank_world()[0] == 0:
        print(f"lorasync: {msg}", file=sys.stderr, flush=True)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a core dependency
        PeftModel = ()  # type: ignore[assignment]
    return isinstance(model, PeftModel) or bool(getattr(model, "_hf_peft_config_loaded", False))


def _raw_optimizer(opt):
    """The torch optimizer under accelerate's AcceleratedOptimizer wrapper."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(opt, AcceleratedOptimizer):
        opt = opt.optimizer
    return opt


def _check_strategy(strategy: str, options: dict[str, Any]) -> None:
    """What can be checked before DDP exists: the name, the option names and
    their values (the catalog's ranges; auto's ``NAME.OPTION`` ones too)."""
    from lorasync import catalog

    problem = catalog.strategy_problem(strategy, options)
    if problem:
        raise AttachError(problem)


def _ddp_kwargs(*, bucket_mb: float, find_unused: bool, buffers: bool,
                extra: dict[str, Any]) -> dict[str, Any]:
    from lorasync.train.ddp import buffer_sync_kwarg

    kw = dict(extra)
    kw.pop("broadcast_buffers", None)
    kw.update(init_sync=False, bucket_cap_mb=bucket_mb, find_unused_parameters=find_unused,
              **buffer_sync_kwarg(buffers))
    return kw


class _LorasyncDDPKwargs(DistributedDataParallelKwargs):
    """accelerate's DDP handler with lorasync's DDP arguments and, instead of a
    torch comm hook, lorasync's start-up and strategy (module docstring)."""

    def __init__(self, handle: "HFSync", ddp_kwargs: dict[str, Any]):
        super().__init__()
        # kept out of the dataclass fields: accelerate deep-copies those
        object.__setattr__(self, "_lorasync", (handle, dict(ddp_kwargs)))

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option")):
        import copy
        import dataclasses

        # the dataclass fields only (the base deep-copies __dict__, handle included)
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ignore_keys}

    def to_kwargs(self) -> dict[str, Any]:
        return dict(self._lorasync[1])

    def register_comm_hook(self, model) -> None:
        self._lorasync[0]._on_ddp(model)


# --------------------------------------------------------------------------- the handle

class HFSync:
    """What :func:`attach` returns: lorasync's sync for one Trainer or accelerator.

    The strategy itself (a :class:`lorasync.comm.Sync`, ``.sync``) is built
    when the Trainer (or ``accelerator.prepare``) wraps the model in DDP, at
    the start of ``trainer.train()``; until then ``stats()`` reports zeros.
    With a Trainer the callback calls ``after_step``/``finish`` itself; with
    an accelerator, call ``sync.after_step()`` after every ``optimizer.step()``
    (it does nothing on accumulation micro-steps, when
    ``accelerator.sync_gradients`` is False) and ``sync.finish()`` at the end.
    """

    def __init__(self, strategy: str, options: dict[str, Any], *, accelerator=None):
        self.strategy = strategy
        self.options = dict(options)
        self.sync = None
        self.ddp = None
        #: bytes this rank sent to make the adapter identical at start-up
        #: (16: hash check only) and the seconds that took
        self.startup_bytes = 0
        self.startup_s = 0.0
        #: one record per optimizer step (Trainer path), fields as in metrics.jsonl
        self.records: list[dict[str, Any]] = []
        #: the sync that makes the replicas identical after the last step (DiLoCo's and
        #: local SGD's last average, a streamed sync settled): bytes sent and seconds;
        #: not part of any step record
        self.final_sync: dict[str, float] = {"wire_bytes": 0, "comm_s": 0.0}
        self.finished = False
        #: what attach changed in the Trainer's settings, said once at train begin
        self.notes: list[str] = []
        self._accelerator = accelerator
        self._optimizer_given = False

    # -- built by the DDP handler -------------------------------------------------
    def _on_ddp(self, ddp) -> None:
        import torch

        from lorasync.comm import attach
        from lorasync.train.ddp import make_identical

        if self.sync is not None:
            raise AttachError("lorasync.hf.attach: a second model was wrapped in DDP under the "
                              "same attach; call attach once per model")
        module = ddp.module
        if not _is_peft(module):
            raise AttachError(f"model: {type(module).__name__} has no PEFT adapter; lorasync "
                              "syncs the adapter only: wrap it with peft.get_peft_model(model, "
                              "LoraConfig(...)) (or pass peft_config= to SFTTrainer)")
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise AttachError("model: no parameter requires grad; give the model a trainable "
                              "PEFT adapter")
        t0 = time.perf_counter()
        dev = params[0].device
        if dev.type == "cpu" and torch.cuda.is_available():
            import torch.distributed as dist
            if dist.get_backend() == "nccl":
                dev = torch.device("cuda", torch.cuda.current_device())
        self.startup_bytes = make_identical(params, dev)
        try:
            self.sync = attach(ddp, self.strategy, **self.options)
        except ValueError as e:
            raise AttachError(f"lorasync.hf.attach: {e}") from None
        self.ddp = ddp
        self.startup_s = time.perf_counter() - t0

    def _need(self) -> Any:
        if self.sync is None:
            raise RuntimeError("lorasync: the sync does not exist yet: it is built when the model "
                               "is wrapped in DDP (trainer.train(), accelerator.prepare) with "
                               "more than one process")
        return self.sync

    # -- the Sync API ---------------------------------------------------------------
    def set_optimizer(self, optimizer) -> None:
        """For onebit (1-bit Adam) and auto: the optimizer that steps the adapter
        (accelerate's wrapper is unwrapped).  The Trainer path does this itself."""
        sync = self._need()
        if hasattr(sync, "set_optimizer") and not self._optimizer_given:
            sync.set_optimizer(_raw_optimizer(optimizer))
            self._optimizer_given = True

    def after_step(self) -> None:
        if self.sync is None:
            return
        acc = self._accelerator
        if acc is not None and not acc.sync_gradients:
            return  # an accumulation micro-step: the optimizer did not step
        self.sync.after_step()

    def finish(self) -> None:
        if self.sync is not None and not self.finished:
            self.sync.finish()
        self.finished = True

    def stats(self) -> dict[str, Any]:
        if self.sync is None:
            return {"strategy": self.strategy, "wire_bytes": 0, "fp32_bytes": 0, "comm_s": 0.0,
                    "encode_s": 0.0, "steps": 0, "syncs": 0}
        return self.sync.stats()

    def state_dict(self) -> dict[str, Any]:
        return self._need().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._need().load_state_dict(state)


# --------------------------------------------------------------------------- Trainer callback

class _Callback(TrainerCallback):
    """Drives the sync from the Trainer's events (module docstring)."""

    def __init__(self, handle: HFSync, trainer):
        self.h = handle
        self.trainer = trainer
        self._run_id = uuid.uuid4().hex[:12]
        self._began = False
        self._t_prev: float | None = None
        self._t_bwd: float | None = None
        self._last: dict[str, Any] | None = None
        self._logged = 0          # records already summarised in a log
        self._idle_said = False

    # -- start ------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kw):
        h = self.h
        if self._began:
            raise AttachError("lorasync.hf.attach: this Trainer already ran train() with "
                              "lorasync (its sync has finished); build a new Trainer and attach "
                              "to it for another run, e.g. to resume from a checkpoint")
        self._began = True
        rank, world = _rank_world()
        if h.sync is None:
            if world > 1:
                raise AttachError("lorasync.hf.attach: the Trainer did not wrap the model in "
                                  "DDP through accelerate (no sync was built); lorasync needs "
                                  "one process per device under torchrun or accelerate launch")
            if not self._idle_said:
                _say("one process: nothing to sync, lorasync stays idle")
                self._idle_said = True
            return
        sync = h.sync
        if hasattr(sync, "set_optimizer"):
            h.set_optimizer(self.trainer.optimizer)
        if state.global_step > 0:
            self._resume(args, state)
        self._last = sync.stats()
        self._t_prev = time.perf_counter()
        _say(f"{world} ranks, strategy {h.strategy}, adapter made identical with "
             f"{h.startup_bytes:,} bytes ({'hash check only' if h.startup_bytes <= 16 else 'broadcast from rank 0'}), "
             f"no start-up broadcast of the base model"
             + "".join(f"; {n}" for n in h.notes))

    # -- per step ---------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kw):
        if self.h.sync is not None:
            self.h.sync.last_ready_time = None
            self._t_bwd = None

    def on_pre_optimizer_step(self, args, state, control, **kw):
        # end of backward of the last micro-batch (after the Trainer's gradient
        # clipping, a millisecond): what DDP still waited for after the last
        # bucket became ready is sync the step waited on
        if self.h.sync is not None:
            self._t_bwd = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        h = self.h
        sync = h.sync
        # the token that ties this step's checkpoint files to trainer_state.json
        # (and where it is written: found again when resumed from another output_dir)
        state.stateful_callbacks[_TOKEN_KEY] = {"args": {}, "attributes": {
            "token": self._token(state.global_step),
            "dir": os.path.abspath(os.path.join(args.output_dir,
                                                f"checkpoint-{state.global_step}"))}}
        if sync is None or h.finished:
            return
        sync.after_step()
        now = time.perf_counter()
        st = sync.stats()
        last = self._last or st
        exposed = 0.0
        ready = sync.last_ready_time
        if self._t_bwd is not None and ready is not None and ready <= self._t_bwd:
            exposed = self._t_bwd - ready
        exposed += st["comm_s"] - last["comm_s"]
        step_s = now - (self._t_prev if self._t_prev is not None else now)
        rank, world = _rank_world()
        accum = int(getattr(self.trainer, "current_gradient_accumulation_steps", 0)
                    or args.gradient_accumulation_steps)
        rec = {"step": state.global_step, "rank": rank, "world_size": world,
               "strategy": st.get("strategy", h.strategy),
               "samples": args.per_device_train_batch_size * accum, "grad_accum": accum,
               "compute_s": max(0.0, step_s - exposed), "comm_s": exposed, "step_s": step_s,
               "wire_bytes": st["wire_bytes"] - last["wire_bytes"],
               "fp32_bytes": st["fp32_bytes"] - last["fp32_bytes"],
               "encode_s": st["encode_s"] - last["encode_s"],
               "syncs": st.get("syncs", 0), "time": time.time()}
        if st.get("switches", 0) != last.get("switches", 0) and st.get("last_switch"):
            rec["switch"] = dict(st["last_switch"])
        h.records.append(rec)
        self._last = st
        self._t_prev = now
        if state.max_steps and state.global_step >= state.max_steps:
            # last step: replicas identical before the final checkpoint and save_model.
            # Timed apart from the step, as `lorasync train` does: the step records
            # compare like for like, and the final sync is reported on its own.
            t0 = time.perf_counter()
            h.finish()
            end = sync.stats()
            h.final_sync = {"wire_bytes": end["wire_bytes"] - st["wire_bytes"],
                            "comm_s": time.perf_counter() - t0}
            self._last = end

    def on_train_end(self, args, state, control, **kw):
        # stopped before max_steps (early stopping, should_training_stop)
        if self.h.sync is not None and not self.h.finished:
            self.h.finish()

    # -- logs -------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kw):
        h = self.h
        if h.sync is None or logs is None:
            return
        extra: dict[str, Any] = {}
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            window = h.records[self._logged:]
            self._logged = len(h.records)
            if window:
                n = len(window)
                wire = sum(r["wire_bytes"] for r in window)
                fp32 = sum(r["fp32_bytes"] for r in window)
                step = sum(r["step_s"] for r in window)
                comm = sum(r["comm_s"] for r in window)
                extra = {"lorasync/strategy": window[-1]["strategy"],
                         "lorasync/wire_bytes": wire / n,
                         "lorasync/comm_s": comm / n,
                         "lorasync/sync_share": comm / step if step > 0 else 0.0,
                         "lorasync/step_s": step / n,
                         "lorasync/syncs": window[-1]["syncs"],
                         # all ranks' samples over this rank's step time (`lorasync report`)
                         "lorasync/samples_per_s": (sum(r["samples"] for r in window)
                                                    * window[-1]["world_size"] / step
                                                    if step > 0 else 0.0),
                         "lorasync/world_size": window[-1]["world_size"]}
                if wire:
                    extra["lorasync/compression"] = fp32 / wire
                switches = [r["switch"] for r in window if "switch" in r]
                if switches:
                    extra["lorasync/switch"] = "; ".join(
                        f"step {s.get('step')}: {s['from']} -> {s['to']}: {s['reason']}"
                        for s in switches)
            if len(h.records) == len(window) and window:   # the first training log
                extra["lorasync/startup_bytes"] = h.startup_bytes
        elif "train_runtime" in logs:
            st = h.stats()
            extra = {"lorasync/strategy": st.get("strategy", h.strategy),
                     "lorasync/wire_bytes_total": st["wire_bytes"],
                     "lorasync/syncs": st.get("syncs", 0),
                     "lorasync/startup_bytes": h.startup_bytes,
                     "lorasync/startup_s": h.startup_s,
                     "lorasync/final_sync_bytes": h.final_sync["wire_bytes"],
                     "lorasync/final_sync_s": h.final_sync["comm_s"]}
            if st.get("switches"):
                extra["lorasync/switches"] = st["switches"]
        if not extra:
            return
        logs.update(extra)   # seen by the report_to callbacks that run after this one
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    # -- checkpoints ------------------------------------------------------------------
    def _token(self, step: int) -> str:
        return f"{self._run_id}-{step}"

    def on_save(self, args, state, control, **kw):
        import torch

        h = self.h
        if h.sync is None:
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        folder = os.path.join(ckpt, CHECKPOINT_SUBDIR)
        os.makedirs(folder, exist_ok=True)
        rank, world = _rank_world()
        st: dict[str, Any] = {"format": 1, "step": state.global_step, "rank": rank,
                              "world_size": world, "strategy": h.strategy,
                              "sync": h.sync.state_dict()}
        if not getattr(h.sync, "per_step", True):
            # local SGD / DiLoCo (and auto, which may run them): replicas and
            # optimizer moments differ between syncs, but the Trainer saves
            # rank 0's alone; keep this rank's own
            st["adapter"] = {n: p.detach().cpu().clone()
                             for n, p in h.ddp.module.named_parameters() if p.requires_grad}
            st["optimizer"] = _raw_optimizer(self.trainer.optimizer).state_dict()
        path = os.path.join(folder, f"rank-{rank}.pt")
        torch.save(st, path + ".part")
        os.replace(path + ".part", path)
        if args.should_save:
            meta = {"token": self._token(state.global_step), "step": state.global_step,
                    "world_size": world, "strategy": h.strategy, "time": time.time()}
            with open(os.path.join(folder, "meta.json.part"), "w") as fh:
                json.dump(meta, fh)
            os.replace(os.path.join(folder, "meta.json.part"), os.path.join(folder, "meta.json"))

    def _find_checkpoint(self, args, state) -> str | None:
        entry = (state.stateful_callbacks or {}).get(_TOKEN_KEY)
        if isinstance(entry, list):
            entry = entry[-1] if entry else None
        attrs = (entry or {}).get("attributes") or {}
        token = attrs.get("token")
        cands = []
        if isinstance(args.resume_from_checkpoint, str) and args.resume_from_checkpoint:
            cands.append(args.resume_from_checkpoint)
        cands.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        if attrs.get("dir"):
            cands.append(attrs["dir"])   # where it was written (the token proves it is the same)
        for c in cands:
            try:
                with open(os.path.join(c, CHECKPOINT_SUBDIR, "meta.json")) as fh:
                    meta = json.load(fh)
            except (OSError, ValueError):
                continue
            if (meta.get("token") == token) if token else meta.get("step") == state.global_step:
                return c
        if token is None:
            return None
        raise AttachError(
            f"resume_from_checkpoint: the checkpoint of step {state.global_step} was written with "
            f"lorasync, but its lorasync state is in none of {', '.join(cands)} (a moved "
            "checkpoint); set TrainingArguments(resume_from_checkpoint=PATH) to the path you "
            "pass to trainer.train(), or resume from inside args.output_dir")

    def _resume(self, args, state) -> None:
        import pickle

        import torch

        from lorasync.train.checkpoint import load_file

        h = self.h
        ckpt = self._find_checkpoint(args, state)
        if ckpt is None:
            _say(f"the checkpoint of step {state.global_step} has no lorasync state (written "
                 f"without lorasync): {h.strategy} starts fresh")
            return
        rank, world = _rank_world()
        path = os.path.join(ckpt, CHECKPOINT_SUBDIR, f"rank-{rank}.pt")
        if not os.path.isfile(path):
            raise AttachError(f"resume_from_checkpoint: {ckpt} has no {CHECKPOINT_SUBDIR}/rank-{rank}.pt "
                              f"(written by fewer ranks, or cut short); resume from an earlier "
                              "checkpoint or with the same number of processes")
        try:
            st = load_file(path)   # weights_only=True: a checkpoint can run no code
        except LorasyncError as e:
            raise AttachError(f"resume_from_checkpoint: {e}") from None
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
            # cut short or damaged (the Trainer's checkpoints carry no checksums)
            raise AttachError(f"resume_from_checkpoint: {path} cannot be read "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); resume "
                              "from an earlier checkpoint") from None
        if st.get("step") != state.global_step:
            raise AttachError(f"resume_from_checkpoint: {path} is of step {st.get('step')}, the "
                              f"Trainer resumed at step {state.global_step}; the checkpoint was "
                              "modified: resume from another one")
        for key, mine in (("strategy", h.strategy), ("world_size", world)):
            if st.get(key) != mine:
                # a deliberate change: the per-rank state does not carry over
                _say(f"{ckpt} was written with {key}={st.get(key)!r}, this run has {key}="
                     f"{mine!r}: {h.strategy} starts fresh (its error feedback / outer state "
                     "from the checkpoint is not used)")
                return
        if "adapter" in st:
            named = dict(h.ddp.module.named_parameters())
            with torch.no_grad():
                for n, v in st["adapter"].items():
                    named[n].copy_(v.to(named[n].device, named[n].dtype))
            _raw_optimizer(self.trainer.optimizer).load_state_dict(st["optimizer"])
        try:
            h.sync.load_state_dict(st["sync"])
        except ValueError as e:
            raise AttachError(f"resume_from_checkpoint: {e}") from None
        _say(f"resumed {h.strategy} state from {ckpt}")


# --------------------------------------------------------------------------- attach

def attach(target, strategy: str = "auto", *, keep_token_average: bool = False,
           **options: Any) -> HFSync:
    """Run a lorasync strategy inside a ``transformers.Trainer`` (TRL's
    ``SFTTrainer`` included) or an ``accelerate.Accelerator``.

    Trainer: call after building the Trainer and before ``trainer.train()``,
    on every rank (under torchrun or ``accelerate launch``); nothing else in
    the script changes.  Accelerator: call before ``accelerator.prepare(model)``;
    then ``sync.set_optimizer(optimizer)`` for onebit/auto, ``sync.after_step()``
    after every ``optimizer.step()`` and ``sync.finish()`` at the end.

    ``strategy``: allreduce, fp16, bf16, int8, onebit, topk, powersgd, local,
    diloco or auto; ``options``: the strategy's options, as for
    ``lorasync.attach`` (``period=8``, ``candidates="int8,diloco"``,
    ``topk.ratio=0.001`` ...; auto's nested ``NAME.OPTION`` keys can be
    passed with ``**{"diloco.period": 4}``).

    ``keep_token_average``: keep the Trainer's ``average_tokens_across_devices``
    (a token-count all-gather across ranks every step, on the slow link); by
    default ``attach`` turns it off and every rank averages its own tokens,
    as ``lorasync train`` does (module docstring).

    Raises :class:`AttachError` (a ValueError) naming the fix for an unknown
    strategy or option, a Trainer that is already training (or has trained),
    DeepSpeed, FSDP or tensor parallelism, several GPUs in one process, and
    (when DDP is built) a model without a PEFT adapter or a bad option value.
    """
    if isinstance(target, Trainer):
        return _attach_trainer(target, strategy, options, keep_token_average=keep_token_average)
    if isinstance(target, Accelerator):
        return _attach_accelerator(target, strategy, options)
    raise AttachError(f"target: expected a transformers.Trainer (or trl.SFTTrainer) or an "
                      f"accelerate.Accelerator, got {type(target).__name__}; for your own DDP "
                      "model use lorasync.attach(ddp_model, strategy)")


def _sharded(acc) -> str | None:
    from accelerate.utils import DistributedType

    dt = getattr(acc, "distributed_type", None)
    names = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
             DistributedType.MEGATRON_LM: "Megatron-LM"}
    if dt in names:
        return names[dt]
    pc = getattr(acc, "parallelism_config", None)
    if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)
                           or getattr(pc, "dp_shard_enabled", False)):
        return "a sharded ParallelismConfig"
    return None


def _attach_trainer(trainer, strategy: str, options: dict[str, Any], *,
                    keep_token_average: bool = False) -> HFSync:
    args = trainer.args
    _check_strategy(strategy, options)
    if trainer.is_in_train:
        raise AttachError("trainer: it is already training; call lorasync.hf.attach(trainer, ...) "
                          "after building the Trainer and before trainer.train()")
    if trainer.model_wrapped is not trainer.model:
        raise AttachError("trainer: its model is already wrapped for distributed training (a "
                          "train() call ran before); attach to a freshly built Trainer, before "
                          "its first train()")
    if any(isinstance(cb, _Callback) for cb in trainer.callback_handler.callbacks):
        raise AttachError("trainer: lorasync is already attached to this Trainer; call attach once")
    sharded = None
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(args, "deepspeed", None):
        sharded = "DeepSpeed"
    elif (getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False)
          or getattr(args, "fsdp", None)):
        sharded = "FSDP"
    elif getattr(trainer, "is_distributed_loading_by_transformers", False):
        sharded = "a model sharded at load time (tensor parallelism)"
    else:
        sharded = _sharded(trainer.accelerator)
    if sharded:
        raise AttachError(f"trainer: {sharded} is on; lorasync syncs the adapter between DDP "
                          "replicas and does not work with sharded training: remove the "
                          f"{'deepspeed' if sharded == 'DeepSpeed' else 'fsdp'} settings from "
                          "TrainingArguments (a LoRA adapter fits on every device) or drop attach")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size <= 1:
        raise AttachError(f"trainer: {launched} processes were launched but the Trainer trains "
                          "each alone (accelerate found no GPU and was not told to use the CPU): "
                          "on CPU pass use_cpu=True (--use_cpu) so that it runs DDP over gloo")
    if getattr(args, "n_gpu", 1) > 1:
        raise AttachError(f"trainer: {args.n_gpu} GPUs in one process (DataParallel); launch one "
                          "process per GPU with torchrun or accelerate launch")
    if not _is_peft(trainer.model):
        raise AttachError(f"model: trainer.model is a {type(trainer.model).__name__} without a "
                          "PEFT adapter; lorasync syncs the adapter only (and skips the start-up "
                          "broadcast of the frozen base): wrap it with peft.get_peft_model(model, "
                          "LoraConfig(...)) or pass peft_config= to SFTTrainer")
    ga_kwargs = getattr(args.accelerator_config, "gradient_accumulation_kwargs", None) or {}
    if args.gradient_accumulation_steps > 1 and ga_kwargs.get("sync_each_batch"):
        raise AttachError("accelerator_config.gradient_accumulation_kwargs: sync_each_batch=True "
                          "syncs every micro-batch; lorasync syncs once per optimizer step: "
                          "remove sync_each_batch")
    candidates = str(options.get("candidates", ""))
    if (strategy == "onebit" or "onebit" in candidates) and args.max_grad_norm and \
            options.get("momentum", True) is not False:
        warnings.warn(
            f"lorasync onebit (1-bit Adam) hands the Trainer the averaged Adam momentum as the "
            f"gradient, so max_grad_norm={args.max_grad_norm} clips the momentum and scales the "
            "update; onebit caps its steps itself (max_update_rms): set max_grad_norm=0",
            stacklevel=3)
    opts = dict(options)
    if strategy == "auto" and "batch_size" not in opts:
        # samples/s in auto's log lines
        opts["batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps
    handle = HFSync(strategy, opts)
    ddp = _ddp_kwargs(
        bucket_mb=args.ddp_bucket_cap_mb or DEFAULT_BUCKET_MB,
        find_unused=bool(args.ddp_find_unused_parameters),
        buffers=args.ddp_broadcast_buffers is True,
        extra={k: v for k, v in (("static_graph", args.ddp_static_graph),) if v is not None})
    old = trainer.accelerator.ddp_handler
    if old is not None and old.comm_hook.value != "no":
        raise AttachError("trainer: its accelerator already has a DDP comm hook "
                          f"({old.comm_hook.value}); lorasync's strategy replaces it: remove it")
    trainer.accelerator.ddp_handler = _LorasyncDDPKwargs(handle, ddp)
    if getattr(args, "average_tokens_across_devices", False) and args.world_size > 1 \
            and not keep_token_average:
        # a token-count all-gather once per optimizer step: a round trip on the
        # slow link and a barrier every step (module docstring)
        args.average_tokens_across_devices = False
        handle.notes.append("average_tokens_across_devices turned off (a token-count "
                            "all-gather every step); keep it with keep_token_average=True")
    note = logging_note(args)
    if note:
        handle.notes.append(note)
    # first, so that the metrics it adds in on_log reach the report_to callbacks
    trainer.callback_handler.callbacks.insert(0, _Callback(handle, trainer))
    _exit_guard()
    return handle


def _exit_guard() -> None:
    """The process ends cleanly (docs/huggingface.md, "Clean exits"): neither the
    Trainer nor accelerate destroys the process group, so lorasync does at exit."""
    from lorasync.comm import shutdown

    shutdown.install()


#: below this many steps between the Trainer's logs, attach says what they cost
FREQUENT_LOGGING_STEPS = 10


def logging_note(args) -> str | None:
    """A note when the Trainer logs every few steps on several ranks: each log
    all-gathers the loss and sums the FLOP count across ranks
    (``_maybe_log_save_evaluate``, ``store_flos``), a barrier that periodic
    strategies otherwise avoid (docs/huggingface.md measures its cost)."""
    every = args.logging_steps or 0
    if args.logging_strategy != "steps" or args.world_size <= 1 \
            or not 1 <= every < FREQUENT_LOGGING_STEPS:
        return None   # a float below 1 is a share of the run: not every few steps
    return (f"logging_steps={int(every)}: each log all-gathers the loss and FLOP count "
            "across ranks (a barrier); on a slow link log every 50 steps or more")


def _attach_accelerator(acc, strategy: str, options: dict[str, Any]) -> HFSync:
    _check_strategy(strategy, options)
    sharded = _sharded(acc)
    if sharded:
        raise AttachError(f"accelerator: {sharded} is on; lorasync syncs the adapter between DDP "
                          "replicas and does not work with sharded training")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and acc.num_processes <= 1:
        raise AttachError(f"accelerator: {launched} processes were launched but the Accelerator "
                          "runs each alone (no GPU found and cpu=False): on CPU build it with "
                          "Accelerator(cpu=True) so that it runs DDP over gloo")
    old = acc.ddp_handler
    if isinstance(old, _LorasyncDDPKwargs):
        raise AttachError("accelerator: lorasync is already attached to it; call attach once")
    user = old.to_kwargs() if old is not None else {}
    hook = user.pop("comm_hook", None) or (old.comm_hook if old is not None else None)
    if hook is not None and getattr(hook, "value", hook) != "no":
        raise AttachError(f"accelerator: DistributedDataParallelKwargs(comm_hook={hook}) is set; "
                          "lorasync's strategy replaces the comm hook: remove it")
    for k in ("comm_wrapper", "comm_state_option"):
        user.pop(k, None)
    handle = HFSync(strategy, options, accelerator=acc)
    ddp = _ddp_kwargs(bucket_mb=user.pop("bucket_cap_mb", DEFAULT_BUCKET_MB),
                      find_unused=bool(user.pop("find_unused_parameters", False)),
                      buffers=bool(user.pop("broadcast_buffers", False)), extra=user)
    acc.ddp_handler = _LorasyncDDPKwargs(handle, ddp)
    _exit_guard()
    return handle
