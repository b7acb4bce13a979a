"""Atomic checkpoints of a run.

Layout: ``RUN/checkpoints/step-000040/{meta.json, rank0.pt, rank1.pt, ...}``.
Each rank saves its own state (adapter, optimizer, scheduler, RNG, sync
state): under local SGD or DiLoCo replicas differ between syncs, and error
feedback buffers are always per rank.  Everything is written into a hidden
``.tmp-step-N`` folder first and renamed only once every rank has finished,
so a process dying mid-write leaves no torn checkpoint: ``latest()`` only
sees complete folders.

``Checkpointer`` is the trainer's component on top of these files: it finds
the checkpoint to resume from, knows what one holds (adapter, optimizer,
scheduler, sync state, RNG, data position) and when one is due.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass

from lorasync.errors import CheckpointError

__all__ = ["save", "latest", "load_rank", "read_meta", "Checkpointer", "Progress",
           "rng_state", "set_rng_state"]

_STEP = re.compile(r"^step-(\d+)$")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, write) -> None:
    tmp = path + ".part"
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save(run_dir: str, step: int, rank_state: dict, meta: dict, *, rank: int, local_rank: int,
         world_size: int, barrier, keep: int) -> str:
    """Collective: every rank calls it at the same step. Returns the final folder."""
    import torch

    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step-{step:06d}")
    tmp = os.path.join(root, f".tmp-step-{step:06d}")
    if local_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    barrier()
    _write_atomic(os.path.join(tmp, f"rank{rank}.pt"), lambda fh: torch.save(rank_state, fh))
    barrier()
    # Who finalizes: with a file system shared by all ranks (one node, or NFS)
    # global rank 0 alone; with node-local disks each node's local rank 0
    # renames the folder holding its own ranks' files.
    shared = all(os.path.exists(os.path.join(tmp, f"rank{r}.pt")) for r in range(world_size))
    barrier()  # everyone has looked before anyone renames
    if (rank == 0) if shared else (local_rank == 0):
        meta = {**meta, "step": step, "world_size": world_size}
        _write_atomic(os.path.join(tmp, "meta.json"),
                      lambda fh: fh.write(json.dumps(meta, indent=1).encode()))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    barrier()
    return final


def _complete(path: str) -> bool:
    meta = os.path.join(path, "meta.json")
    if not os.path.isfile(meta):
        return False
    try:
        with open(meta) as fh:
            json.load(fh)
    except (OSError, ValueError):
        return False
    return True


def _steps(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP.match(name)
        if m and _complete(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def _prune(root: str, keep: int) -> None:
    for _, path in _steps(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def latest(run_dir: str) -> str | None:
    """Folder of the newest complete checkpoint of a run, or None."""
    steps = _steps(os.path.join(run_dir, "checkpoints"))
    return steps[-1][1] if steps else None


def read_meta(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "meta.json")) as fh:
        return json.load(fh)


def load_rank(ckpt: str, rank: int) -> dict:
    import torch

    path = os.path.join(ckpt, f"rank{rank}.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt}: no state for rank {rank}; resume with the same number "
                              "of ranks the run was started with")
    return torch.load(path, map_location="cpu", weights_only=False)


# ---------------------------------------------------------------- the trainer's component


def rng_state() -> dict:
    """Every random generator training draws from (dropout, data shuffles in user code)."""
    import numpy as np
    import torch

    st = {"torch": torch.random.get_rng_state(), "python": random.getstate(),
          "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st) -> None:
    import numpy as np
    import torch

    torch.random.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps done."""
    sample_offset: int = 0
    """Global samples consumed: the data position."""
    grad_accum: int = 1
    """Micro-batches per optimizer step from now on (adaptive accumulation changes it)."""


class Checkpointer:
    """Finds, writes and restores the checkpoints of one rank of a run.

    ``interval`` 0 writes only at the end; ``keep`` is how many stay on disk.
    """

    def __init__(self, run_dir: str, *, rank: int, local_rank: int, world_size: int, barrier,
                 interval: int, keep: int):
        self.run_dir, self.rank, self.local_rank = run_dir, rank, local_rank
        self.world_size, self.barrier = world_size, barrier
        self.interval, self.keep = interval, keep

    def find(self, resume: bool) -> tuple[str | None, dict]:
        """(folder, meta) of the checkpoint to resume from; (None, {}) for a new run."""
        from lorasync.errors import LorasyncError

        if not resume:
            return None, {}
        path = latest(self.run_dir)
        if path is None:
            raise LorasyncError(f"--resume: {self.run_dir} has no complete checkpoint; start a "
                                "new run without --resume")
        meta = read_meta(path)
        if meta["world_size"] != self.world_size:
            raise LorasyncError(f"--resume: {path} was written by {meta['world_size']} "
                                f"ranks, this job has {self.world_size}; resume with --nproc "
                                f"{meta['world_size']} (nodes x workers)")
        return path, meta

    def due(self, step: int, end_step: int) -> bool:
        """Whether a checkpoint is written after ``step``."""
        return step == end_step or bool(self.interval and step % self.interval == 0)

    def save(self, progress: Progress, *, model, opt, sched, sync, meta: dict) -> str:
        """Collective: every rank writes its state at ``progress.step``."""
        state = {"adapter": {n: p.detach().cpu().clone() for n, p in model.named_parameters()
                             if "lora_" in n},
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "sync": sync.state_dict(), "rng": rng_state(), "step": progress.step,
                 "sample_offset": progress.sample_offset, "grad_accum": progress.grad_accum}
        return save(self.run_dir, progress.step, state, meta, rank=self.rank,
                    local_rank=self.local_rank, world_size=self.world_size,
                    barrier=self.barrier, keep=self.keep)

    def restore(self, path: str, progress: Progress, global_batch: int, *, model, opt, sched,
                sync) -> None:
        """Load this rank's state from ``path`` into the model, optimizer, scheduler,
        strategy, RNGs and ``progress`` (whose ``step`` is already the checkpoint's)."""
        import torch

        st = load_rank(path, self.rank)
        with torch.no_grad():
            named = dict(model.named_parameters())
            for n, v in st["adapter"].items():
                named[n].copy_(v)
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        sync.load_state_dict(st["sync"])
        set_rng_state(st["rng"])
        progress.sample_offset = st.get("sample_offset", progress.step * global_batch)
        progress.grad_accum = st.get("grad_accum", progress.grad_accum)
