"""Atomic checkpoints of a run.

Layout: ``RUN/checkpoints/step-000040/{meta.json, rank0.pt, rank1.pt, ...}``.
Each rank saves its own state (adapter, optimizer, scheduler, RNG, sync
state): under local SGD or DiLoCo replicas differ between syncs, and error
feedback buffers are always per rank.  Everything is written into a hidden
``.tmp-step-N`` folder first and renamed only once every rank has finished,
so a process dying mid-write leaves no torn checkpoint: ``latest()`` only
sees complete folders.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from lorasync.errors import CheckpointError

__all__ = ["save", "latest", "load_rank", "read_meta"]

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
