"""The trainer's checkpoint component: ``Checkpointer`` and the ``Progress`` it saves.

``Checkpointer`` sits on top of the files (format.py): it agrees on the
checkpoint to resume from (resume.py), knows what one holds and when one is
due, writes it (with the adapter export of adapter.py) and restores it,
random generators included.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from lorasync.errors import CheckpointError
from lorasync.train.checkpoint.adapter import export_adapter
from lorasync.train.checkpoint.format import (SLOW_DISK_BPS, _bytes_under, _checkpoint_bytes,
                                              _folders, _rank_files, _reason, load_rank,
                                              read_meta, save, verified)
from lorasync.train.checkpoint.resume import ResumePlan, choose, inventory
from lorasync.train.watchdog import Pace

__all__ = ["Checkpointer", "Progress", "rng_state", "set_rng_state", "seed_rngs",
           "REPLICATED_SYNC_STATE"]


def rng_state() -> dict:
    """Every random generator training draws from (dropout, data shuffles in user
    code), as tensors and plain values (numpy's state as a tensor of its keys)."""
    import numpy as np
    import torch

    name, keys, pos, has_gauss, cached = np.random.get_state()
    st = {"torch": torch.random.get_rng_state(), "python": random.getstate(),
          "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                    "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st) -> None:
    import numpy as np
    import torch

    torch.random.set_rng_state(st["torch"])
    random.setstate(_tuples(st["python"]))
    n = st["numpy"]
    if isinstance(n, dict):
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
    else:  # written by an earlier version: numpy's own tuple
        np.random.set_state(n)
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _tuples(v):
    """random.setstate wants the nested tuples getstate gave (a list after some loaders)."""
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def seed_rngs(seed: int, rank: int, step: int = 0) -> None:
    """Dropout masks differ per rank (like independent data) but repeat per seed;
    ``step`` > 0 for a rank that resumes without its own RNG state."""
    import numpy as np
    import torch

    s = seed * 1000 + rank + 7919 * step
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps done."""
    sample_offset: int = 0
    """Global samples consumed: the data position."""
    grad_accum: int = 1
    """Micro-batches per optimizer step from now on (adaptive accumulation changes it)."""


#: strategies whose state is the same on every rank (so a rank may take a peer's);
#: the others keep per-rank error-feedback residuals or per-rank decisions, which a
#: rank without its own state starts afresh
REPLICATED_SYNC_STATE = frozenset({"allreduce", "fp16", "bf16", "none", "local", "diloco",
                                   "torch_fp16"})


class Checkpointer:
    """Agrees on, restores and writes the checkpoints of one rank of a run.

    ``interval`` 0 writes only at the end; ``keep`` is how many stay on disk;
    ``pace`` (the watchdog) is told of every collective and of the disk work
    between them.
    """

    def __init__(self, run_dir: str, *, rank: int, local_rank: int, world_size: int, barrier,
                 interval: int, keep: int, pace: Pace | None = None, tokenizer=None,
                 base_ref: str | None = None):
        self.run_dir, self.rank, self.local_rank = run_dir, rank, local_rank
        self.world_size, self.barrier = world_size, barrier
        self.interval, self.keep = interval, keep
        self.pace = pace or Pace()
        # what a checkpoint's PEFT adapter names as its base (ModelSource.ref), and the
        # tokenizer beside it
        self.tokenizer = tokenizer
        self.base_ref = base_ref

    def agree(self, *, resume: bool, history: dict) -> tuple[ResumePlan, dict, list[dict]]:
        """Collective: (plan, meta of the checkpoint, every rank's ``history``).

        The group resumes when any rank asks (``--resume``, or torchrun
        restarted it); then every rank's inventory decides (``choose``)."""
        import torch.distributed as dist

        # the inventory verifies every checkpoint file this disk holds
        self.pace.tick("inventory", allow_s=_checkpoint_bytes(self.run_dir) / SLOW_DISK_BPS)
        mine = {"resume": bool(resume), "history": history,
                "held": {str(k): v for k, v in inventory(self.run_dir).items()}}
        everyone: list = [None] * self.world_size
        with self.pace.waiting("the gather of every rank's checkpoints"):
            dist.all_gather_object(everyone, mine)
        histories = [e["history"] for e in everyone]
        if not any(e["resume"] for e in everyone):
            return ResumePlan(note="new run"), {}, histories
        plan = choose([e["held"] for e in everyone], self.world_size)
        if not plan.step:
            return plan, {}, histories
        # the checkpoint's meta (eval_before, total_steps), from a rank that has the folder
        src = plan.source if plan.source is not None else plan.own[0]
        box = [read_meta(self.folder(plan.step)) if self.rank == src else None]
        with self.pace.waiting("the broadcast of the checkpoint's meta"):
            dist.broadcast_object_list(box, src=src)
        return plan, box[0], histories

    def folder(self, step: int) -> str:
        """The checkpoint folder of ``step`` on this disk (either layout)."""
        found = [p for s, p in _folders(self.run_dir) if s == step]
        return found[-1] if found else os.path.join(self.run_dir, f"checkpoint-{step}")

    def due(self, step: int, end_step: int) -> bool:
        """Whether a checkpoint is written after ``step``."""
        return step == end_step or bool(self.interval and step % self.interval == 0)

    def save(self, progress: Progress, *, model, opt, sched, sync, meta: dict) -> str:
        """Collective: every rank writes its state at ``progress.step``."""
        from lorasync.train.model import adapter_named_params

        state = {"adapter": {n: p.detach().cpu().clone() for n, p in adapter_named_params(model)},
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "sync": sync.state_dict(), "rng": rng_state(), "step": progress.step,
                 "sample_offset": progress.sample_offset, "grad_accum": progress.grad_accum}
        adapter_bytes = sum(v.numel() * v.element_size() for v in state["adapter"].values())
        return save(self.run_dir, progress.step, state, meta, rank=self.rank,
                    local_rank=self.local_rank, world_size=self.world_size,
                    barrier=self.barrier, keep=self.keep, pace=self.pace,
                    export=None if not hasattr(model, "peft_config") else
                    lambda folder: export_adapter(model, folder, tokenizer=self.tokenizer,
                                                  base_ref=self.base_ref),
                    export_bytes=adapter_bytes + (4 << 20))   # + a tokenizer's files

    def restore(self, plan: ResumePlan, progress: Progress, global_batch: int, *, model, opt,
                sched, sync, seed: int) -> list[str]:
        """Collective: load the agreed state into the model, optimizer, scheduler,
        strategy, RNGs and ``progress``.  Returns what a rank without its own
        state started afresh (for the restart record).

        A state that cannot be loaded or does not fit this run raises the same
        ``CheckpointError`` on every rank (the first rank's message): the group
        stops together, before anything is written."""
        import torch.distributed as dist

        folder = self.folder(plan.step)
        st = err = None
        self.pace.tick("load", allow_s=_bytes_under(folder) / SLOW_DISK_BPS)
        try:
            if self.rank in plan.own:
                st = load_rank(folder, self.rank)
            if plan.peer and self.rank == plan.source and st is None:
                st = self._any_state(plan.step)
        except CheckpointError as exc:
            st, err = None, str(exc)
        self._all_ok(err)
        if plan.peer:
            box = [None]
            if self.rank == plan.source:
                box = [{k: v for k, v in st.items() if k != "rng"}]
            with self.pace.waiting("the broadcast of the replicated state"):
                dist.broadcast_object_list(box, src=plan.source)
            if self.rank in plan.peer:
                st = box[0]
        reset: list[str] = []
        try:
            self._apply(st, plan, progress, global_batch, model=model, opt=opt, sched=sched,
                        sync=sync, seed=seed, reset=reset)
        except CheckpointError as exc:
            err = str(exc)
        self._all_ok(err)
        return reset

    def _all_ok(self, err: str | None) -> None:
        """Collective: raise the first rank's error on every rank, if any rank has one."""
        import torch.distributed as dist

        errs: list = [None] * self.world_size
        with self.pace.waiting("the gather of every rank's restore result"):
            dist.all_gather_object(errs, err)
        first = next((e for e in errs if e), None)
        if first is not None:
            raise CheckpointError(first)

    def _apply(self, st: dict, plan: ResumePlan, progress: Progress, global_batch: int, *,
               model, opt, sched, sync, seed: int, reset: list[str]) -> None:
        import torch

        folder = self.folder(plan.step)
        fix = ("resume with the settings its checkpoints were written with, "
               "or start a new run in another --output-dir")
        from lorasync.train.model import adapter_named_params

        named = dict(adapter_named_params(model))
        saved = st.get("adapter") if isinstance(st, dict) else None
        if not isinstance(saved, dict):
            raise CheckpointError(f"{folder}: holds no adapter state; {fix}")
        missing, extra = sorted(set(named) - set(saved)), sorted(set(saved) - set(named))
        shapes = [n for n in saved if n in named and tuple(saved[n].shape) != tuple(named[n].shape)]
        if missing or extra or shapes:
            what = (f"{len(missing)} adapter tensor(s) of this model not in it, e.g. {missing[0]}"
                    if missing else f"{len(extra)} tensor(s) this model lacks, e.g. {extra[0]}"
                    if extra else f"{shapes[0]} is {tuple(saved[shapes[0]].shape)} there, "
                    f"{tuple(named[shapes[0]].shape)} here")
            raise CheckpointError(f"{folder}: the checkpoint's adapter does not fit this run's "
                                  f"model ({what}: model.name, lora.r or lora.targets changed); "
                                  f"{fix}")
        try:
            with torch.no_grad():
                for n, v in saved.items():
                    named[n].copy_(v)
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            if self.rank in plan.own:
                sync.load_state_dict(st["sync"])
                set_rng_state(st["rng"])
            else:
                if sync.name in REPLICATED_SYNC_STATE:
                    # the same on every rank: only the group's shape differs
                    sync.load_state_dict({**st["sync"], "world_size": sync.world_size,
                                          "rank": sync.rank})
                else:
                    reset.append(f"{sync.name} sync state (per-rank residuals) started afresh")
                seed_rngs(seed, self.rank, plan.step)
                reset.append("RNG reseeded")
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
            raise CheckpointError(f"{folder}: its state does not fit this run "
                                  f"({_reason(exc)}); {fix}") from None
        progress.step = plan.step
        progress.sample_offset = st.get("sample_offset", plan.step * global_batch)
        progress.grad_accum = st.get("grad_accum", progress.grad_accum)

    def _any_state(self, step: int) -> dict:
        folder = self.folder(step)
        for r in _rank_files(folder):
            if verified(folder, r):
                return load_rank(folder, r)
        raise CheckpointError(f"{folder}: no intact state file left to resume from")
