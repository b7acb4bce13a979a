"""A checkpoint on disk: its layout, atomic writes, verification, pruning and loading.

Layout (the Hugging Face Trainer's ``checkpoint-N``, so that other tools find
and load it)::

    RUN/checkpoint-40/
        adapter_model.safetensors, adapter_config.json   PEFT's save_pretrained
        tokenizer.json, tokenizer_config.json, ...       the run's tokenizer
        lorasync/meta.json, rank0.pt, rank0.json, rank1.pt, ...   lorasync's state

The adapter and the tokenizer are what ``save``'s ``export`` writes
(adapter.py).  The adapter is the finalizing rank's (rank 0's on a shared
disk): under local SGD or DiLoCo, that rank's replica at this step.
Checkpoints of the layout before (``RUN/checkpoints/step-000040/{meta.json,
rank0.pt, ...}``) are still read, resumed from and pruned.

Each rank saves its own state (adapter, optimizer, scheduler, RNG, sync
state): under local SGD or DiLoCo replicas differ between syncs, and error
feedback buffers are always per rank.  Next to each ``rankR.pt`` a
``rankR.json`` holds its size and SHA-256, so a file cut short or damaged on
one node is recognised and never loaded; a file without that record is not
trusted either.  Everything is written into a hidden ``.tmp-checkpoint-N``
folder first and renamed only once every rank has finished (the PEFT
adapter and tokenizer too, by the rank that renames it), so a process dying
mid-write leaves no torn checkpoint: only complete folders count.

What stays on disk (``_prune``, after every node has finalized the new
checkpoint, so the ranks always share at least one): the one just written,
and the ``keep`` newest that verify (every state file matches its record);
a damaged or stale folder never counts toward ``keep``.  Folders of later
steps than the one being written belong to a timeline the run went back
from (it resumed from an earlier step): they go before the new one is
finalized, so they can never be resumed from.  A folder is removed by
renaming it out of sight first (``.trash-...``): a crash mid-delete leaves
no half-deleted folder that would still count.

Files hold tensors and plain Python values only and load with
``torch.load(weights_only=True)`` (a checkpoint can run no code); a file
that still fails to load is a ``CheckpointError`` naming it, never a
traceback.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil

from lorasync.errors import CheckpointError
from lorasync.train.watchdog import Pace

__all__ = ["save", "latest", "load_rank", "load_file", "read_meta", "verified", "intact",
           "STATE_DIR", "SLOW_DISK_BPS"]


_CKPT = re.compile(r"^checkpoint-(\d+)$")   # RUN/checkpoint-N
_STEP = re.compile(r"^step-(\d+)$")         # RUN/checkpoints/step-N: the layout before
_OLD_ROOT = "checkpoints"
_RANK_FILE = re.compile(r"rank(\d+)\.pt")
#: the sub-folder of ``checkpoint-N`` that holds lorasync's own state
STATE_DIR = "lorasync"


def _state(ckpt: str) -> str:
    """Where a checkpoint folder keeps lorasync's state files and meta.json."""
    return os.path.join(ckpt, STATE_DIR) if _CKPT.match(os.path.basename(ckpt)) else ckpt


#: the slowest disk a rank's checkpoint work is given time for (bytes/s), on top of
#: the watchdog's bounds: a rank writing or reading N bytes is not stuck before N /
#: this many seconds (a first checkpoint has no measured write to go by)
SLOW_DISK_BPS = 4e6


def _bytes_under(root: str) -> int:
    """Bytes of the files under ``root`` (0 when there is none)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_files(folder: str) -> None:
    """fsync the files directly in ``folder`` (what a library wrote there)."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".part"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save(run_dir: str, step: int, rank_state: dict, meta: dict, *, rank: int, local_rank: int,
         world_size: int, barrier, keep: int, pace: Pace | None = None, export=None,
         export_bytes: int = 0) -> str:
    """Collective: every rank calls it at the same step. Returns the final folder.

    ``export(folder)`` (the finalizing rank's) writes what other tools read
    into the folder before it counts: the PEFT adapter and the tokenizer
    (about ``export_bytes``).  ``pace`` (the watchdog) is told of every
    barrier and of the work between them, so that a rank stuck on its disk is
    named by the ranks that wait for it at the next barrier."""
    import torch

    pace = pace or Pace()
    final = os.path.join(run_dir, f"checkpoint-{step}")
    tmp = os.path.join(run_dir, f".tmp-checkpoint-{step}")
    state = os.path.join(tmp, STATE_DIR)
    if local_rank == 0:   # a stale folder of an attempt this run went back from
        shutil.rmtree(tmp, ignore_errors=True)
    with pace.waiting("the barrier before writing"):
        barrier()
    # made by every rank, after every clearing: on a file system shared by
    # several nodes each node's local rank 0 clears, and one node's clearing
    # must not remove the folder another node's rank has just made
    os.makedirs(state, exist_ok=True)
    buf = io.BytesIO()
    torch.save(rank_state, buf)
    data = buf.getvalue()
    pace.tick("write", allow_s=len(data) / SLOW_DISK_BPS)
    _write_atomic(os.path.join(state, f"rank{rank}.pt"), data)
    _write_atomic(os.path.join(state, f"rank{rank}.json"), json.dumps(
        {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}).encode())
    with pace.waiting("the barrier after writing"):
        barrier()
    # Who finalizes: with a file system shared by all ranks (one node, or NFS)
    # global rank 0 alone; with node-local disks each node's local rank 0
    # renames the folder holding its own ranks' files.
    shared = all(os.path.exists(os.path.join(state, f"rank{r}.pt")) for r in range(world_size))
    with pace.waiting("the barrier before finalizing"):
        barrier()  # everyone has looked before anyone renames
    finalizer = (rank == 0) if shared else (local_rank == 0)
    if finalizer:
        if export is not None:
            pace.tick("export", allow_s=export_bytes / SLOW_DISK_BPS)
            export(tmp)
            _fsync_files(tmp)   # on disk before the folder counts, like the state files
        pace.tick("finalize")
        meta = {**meta, "step": step, "world_size": world_size}
        _write_atomic(os.path.join(state, "meta.json"), json.dumps(meta, indent=1).encode())
        # Later steps than this one (and a stale folder of this step) were written
        # by an attempt this run went back from: gone before this one counts, they
        # could otherwise be resumed from (or kept, in place of this one).  A crash
        # in between leaves the checkpoint this run resumed from.
        for s, path in _folders(run_dir):
            if s >= step:
                _discard(path)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    # Prune only once every node has its copy of this checkpoint: a node that
    # dies while finalizing must still share an older one with the others.
    with pace.waiting("the barrier after finalizing"):
        barrier()
    if finalizer:
        # it verifies what it keeps
        pace.tick("prune", allow_s=_checkpoint_bytes(run_dir) / SLOW_DISK_BPS)
        _prune(run_dir, step, keep)
    return final


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _folders(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint folder of a run, complete or not, oldest
    first: ``checkpoint-N`` and the older layout's ``checkpoints/step-N`` (of
    one step, the older layout's comes first)."""
    old = os.path.join(run_dir, _OLD_ROOT)
    found = [(int(m.group(1)), 0, os.path.join(old, n)) for n in _listdir(old)
             if (m := _STEP.match(n))]
    found += [(int(m.group(1)), 1, os.path.join(run_dir, n)) for n in _listdir(run_dir)
              if (m := _CKPT.match(n)) and os.path.isdir(os.path.join(run_dir, n))]
    return [(s, p) for s, _, p in sorted(found)]


def _checkpoint_bytes(run_dir: str) -> int:
    """Bytes of every checkpoint folder of a run."""
    return sum(_bytes_under(p) for _, p in _folders(run_dir))


def _discard(path: str) -> None:
    """Remove the folder ``path`` atomically as far as readers go: renamed out of
    sight first, so a crash mid-delete never leaves a half-deleted folder that
    counts."""
    trash = os.path.join(os.path.dirname(path), f".trash-{os.path.basename(path)}")
    shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _complete(path: str) -> bool:
    meta = os.path.join(_state(path), "meta.json")
    if not os.path.isfile(meta):
        return False
    try:
        with open(meta) as fh:
            json.load(fh)
    except (OSError, ValueError):
        return False
    return True


def _steps(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoint folders, oldest first."""
    return [(s, p) for s, p in _folders(run_dir) if _complete(p)]


def _rank_files(path: str) -> list[int]:
    try:
        names = os.listdir(_state(path))
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _RANK_FILE.fullmatch(n)))


def intact(ckpt: str) -> bool:
    """Whether the folder ``ckpt`` is complete and every state file in it verifies
    (on this disk: with node-local disks, this node's ranks' files)."""
    ranks = _rank_files(ckpt)
    return _complete(ckpt) and bool(ranks) and all(verified(ckpt, r) for r in ranks)


def _prune(run_dir: str, step: int, keep: int) -> None:
    """Keep the checkpoint of ``step`` (just written) and the ``keep`` newest that
    verify (of either layout); remove the rest, and what crashed saves and
    deletes left behind.  Each removal is atomic, so a crash at any point
    leaves all that is kept."""
    counted = 0
    doomed, seen = [], set()
    for s, path in reversed(_folders(run_dir)):
        if s > step or s in seen:  # a disk whose folders this finalizer did not see above;
            doomed.append(path)    # the older layout's copy of a step
        elif (s == step or counted < keep) and intact(path):
            counted += 1
        elif s != step:
            doomed.append(path)
        seen.add(s)
    for path in doomed:
        _discard(path)
    # leftovers of crashed saves and deletes (a later step's folder may be in the
    # making already: under local SGD a rank can run ahead to the next save)
    for root, tmp, trash in ((run_dir, r"\.tmp-checkpoint-(\d+)", ".trash-checkpoint-"),
                             (os.path.join(run_dir, _OLD_ROOT), r"\.tmp-step-(\d+)", ".trash-")):
        names = _listdir(root)
        for name in names:
            m = re.fullmatch(tmp, name)
            if name.startswith(trash) or (m and int(m.group(1)) <= step):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        if names:
            _fsync_dir(root)
    try:   # the older layout's folder, once its last checkpoint is gone
        os.rmdir(os.path.join(run_dir, _OLD_ROOT))
    except OSError:
        pass


def latest(run_dir: str) -> str | None:
    """Folder of the newest complete checkpoint of a run that holds an intact
    state file (one a resume can start from), or None."""
    for _, path in reversed(_steps(run_dir)):
        if any(verified(path, r) for r in _rank_files(path)):
            return path
    return None


def read_meta(ckpt: str) -> dict:
    with open(os.path.join(_state(ckpt), "meta.json")) as fh:
        return json.load(fh)


def verified(ckpt: str, rank: int) -> bool:
    """Whether ``ckpt`` holds an intact state file of ``rank``: its size and
    SHA-256 match the record written beside it.  A file without a valid record
    is not trusted (a record is written with every file, inside the hidden
    folder, before the folder counts)."""
    path = os.path.join(_state(ckpt), f"rank{rank}.pt")
    try:
        size = os.path.getsize(path)
        with open(os.path.join(_state(ckpt), f"rank{rank}.json")) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return False
    if not isinstance(rec, dict) or rec.get("bytes") != size \
            or not isinstance(rec.get("sha256"), str):
        return False
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return False
    return digest.hexdigest() == rec["sha256"]


def _np_globals():
    """numpy types that checkpoints of earlier versions hold (the RNG state),
    allowed for those files only."""
    import numpy as np

    out = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            out.append(__import__(mod, fromlist=["_reconstruct"])._reconstruct)
        except (ImportError, AttributeError):
            pass
    return out


def _reason(exc: BaseException) -> str:
    """The informative part of a loading error, on one line."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # torch wraps the cause in paragraphs of advice
        text = text.split("WeightsUnpickler error:", 1)[1]
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    line = line.split(". ", 1)[0].rstrip(".")
    return f"{type(exc).__name__}: {line[:160]}" if line else type(exc).__name__


_FIX = "resume from another checkpoint or start a new run"


def load_file(path: str, fix: str = _FIX) -> dict:
    """One state file, loaded with ``weights_only=True``.  Any failure to load
    it is a ``CheckpointError`` naming the file, the cause and ``fix``."""
    import pickle
    import zipfile

    import torch

    # what torch.load raises on a file cut short or overwritten: a corrupt zip
    # (RuntimeError), an empty or cut pickle (EOFError), stray bytes read as
    # pickle opcodes (UnpicklingError, KeyError, ValueError...)
    broken = (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError,
              AttributeError, zipfile.BadZipFile, pickle.UnpicklingError)
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if "numpy" not in str(exc):
                raise CheckpointError(f"{path}: not a lorasync checkpoint that loads safely "
                                      f"({_reason(exc)}); {fix}") from None
        # written by an earlier version: numpy's own RNG tuple, those types allowed
        with torch.serialization.safe_globals(_np_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except broken as exc:
        raise CheckpointError(f"{path}: cannot be loaded, the file is damaged or unreadable "
                              f"({_reason(exc)}); {fix}") from None


def load_rank(ckpt: str, rank: int) -> dict:
    path = os.path.join(_state(ckpt), f"rank{rank}.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt}: no state for rank {rank}; resume with the same number "
                              "of ranks the run was started with")
    return load_file(path, fix=f"move {ckpt} out of {os.path.dirname(ckpt)} to resume from "
                               "the checkpoint before it, or start a new run")
