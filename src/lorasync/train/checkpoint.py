"""Atomic, verified checkpoints of a run, and which one a restarted group resumes from.

Layout (the Hugging Face Trainer's ``checkpoint-N``, so that other tools find
and load it)::

    RUN/checkpoint-40/
        adapter_model.safetensors, adapter_config.json   PEFT's save_pretrained
        tokenizer.json, tokenizer_config.json, ...       the run's tokenizer
        lorasync/meta.json, rank0.pt, rank0.json, rank1.pt, ...   lorasync's state

``adapter_config.json`` names the base model by ``ModelSource.ref`` (its Hub
id, or the directory the user gave), never a cache path, so
``PeftModel.from_pretrained(base, "RUN/checkpoint-40")`` loads it on another
machine.  The adapter is the finalizing rank's (rank 0's on a shared disk):
under local SGD or DiLoCo, that rank's replica at this step.  Checkpoints of
the layout before (``RUN/checkpoints/step-000040/{meta.json, rank0.pt, ...}``)
are still read, resumed from and pruned.

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

Which checkpoint to resume from is agreed (``choose``): every rank lists
what its own disk holds (``inventory``), the lists are gathered, and the
group takes the newest step that every rank with any checkpoint holds and
that some rank holds intact.  A rank loads its own state file when it
verifies; a rank whose own file is damaged or absent (a node that joins
later, a node-local disk that was lost) and, after a change of world size,
every rank, takes the replicated state (adapter, optimizer, schedule, data
position) from the lowest rank that holds an intact file.

``Checkpointer`` is the trainer's component on top of these files: it agrees
on the checkpoint to resume from, knows what one holds and when one is due.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field

from lorasync.errors import CheckpointError
from lorasync.train.model import EMBEDDED_REF, base_model_ref
from lorasync.train.watchdog import Pace

__all__ = ["save", "latest", "load_rank", "read_meta", "verified", "intact", "inventory", "choose",
           "ResumePlan", "Checkpointer", "Progress", "rng_state", "set_rng_state",
           "export_adapter", "check_init_adapter", "load_init_adapter",
           "STATE_DIR"]

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


def inventory(run_dir: str) -> dict[int, dict]:
    """What this disk holds: ``{step: {"world_size": n, "ranks": [intact rank files],
    "damaged": [rank files that exist but fail verification]}}`` for every complete
    checkpoint folder with at least one state file (intact or not: a rank whose own
    file is damaged still holds the step and may take a peer's state)."""
    out = {}
    for step, path in _steps(run_dir):
        try:
            world = int(read_meta(path)["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        ranks, damaged = [], []
        for r in _rank_files(path):
            (ranks if verified(path, r) else damaged).append(r)
        if ranks or damaged:
            out[step] = {"world_size": world, "ranks": ranks, "damaged": damaged}
    return out


@dataclass
class ResumePlan:
    """The agreed way a (re)started group continues; the same on every rank."""

    step: int = 0
    """Checkpoint step to resume from (0: start from the beginning)."""
    own: list = field(default_factory=list)
    """Ranks that load their own state file of that checkpoint."""
    peer: list = field(default_factory=list)
    """Ranks that take the replicated state from ``source`` (and start their
    rank-local state afresh)."""
    source: int | None = None
    """The lowest rank holding an intact file of the checkpoint; it sends the
    replicated state."""
    note: str = ""
    """Why, in words (shown on restart)."""


def _ranks_text(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def choose(held: list[dict[int, dict]], world: int) -> ResumePlan:
    """The checkpoint a group of ``world`` ranks resumes from, given each rank's
    ``inventory`` (``held[r]``, with string or int step keys).  Pure.

    The newest step that every rank with any checkpoint holds (its disk has
    the complete folder) and of which some rank holds an intact file: a
    checkpoint only some of them finalized (a crash while saving, on
    node-local disks) or of which no file verifies is never chosen.  A rank
    loads its own file when it verifies and the checkpoint was written by a
    group of the same size; every other rank (its own file damaged or not on
    its disk, or the group's size changed) takes the replicated state from
    the lowest rank that holds an intact file.
    """
    held = [{int(k): v for k, v in h.items()} for h in held]
    with_history = [r for r, h in enumerate(held) if h]
    if not with_history:
        return ResumePlan(note="no checkpoint on any rank")

    def holders(step: int) -> list[int]:
        return [r for r in with_history if held[r].get(step, {}).get("ranks")]

    common = set.intersection(*(set(held[r]) for r in with_history))
    usable = [s for s in common if holders(s)]
    if not usable:
        newest = {r: max(held[r]) for r in with_history}
        return ResumePlan(note=f"no checkpoint held by every rank with an intact file "
                               f"(newest per rank: "
                               f"{', '.join(f'rank {r}: step {s}' for r, s in newest.items())})")
    step = max(usable)
    own, peer = [], []
    for r in range(world):
        entry = held[r].get(step)
        if entry and entry["world_size"] == world and r in entry["ranks"]:
            own.append(r)
        else:
            peer.append(r)
    source = min(holders(step))
    why = f"step {step}, the newest checkpoint every rank with one holds"
    if peer:
        sizes = {held[r][step]["world_size"] for r in with_history}
        joined = [r for r in peer if not held[r]]
        damaged = [r for r in peer if held[r] and r in held[r][step].get("damaged", ())]
        absent = [r for r in peer if r not in joined and r not in damaged]
        if sizes != {world}:
            why += (f"; written by {'/'.join(map(str, sorted(sizes)))} ranks, now {world}: "
                    f"every rank takes rank {source}'s replicated state")
        else:
            if joined:
                why += f"; {_ranks_text(joined)} hold none and take rank {source}'s"
            if damaged:
                why += (f"; {_ranks_text(damaged)}: own file damaged (size or SHA-256 does not "
                        f"match its record), taking rank {source}'s replicated state")
            if absent:
                why += f"; {_ranks_text(absent)} take rank {source}'s state"
    return ResumePlan(step=step, own=own, peer=peer, source=source if peer else None,
                      note=why)


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


# ---------------------------------------------------------------- the trainer's component


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


# ---------------------------------------------------------------- what other tools read


def export_adapter(model, folder: str, *, tokenizer=None, base_ref: str | None = None) -> None:
    """Write ``model``'s adapter with PEFT's ``save_pretrained`` (safetensors)
    into ``folder``, its ``adapter_config.json`` naming ``base_ref`` as the base
    model (not the local path it was loaded from), and the tokenizer beside it:
    ``PeftModel.from_pretrained(base, folder)`` and
    ``AutoTokenizer.from_pretrained(folder)`` load them anywhere."""
    configs = getattr(model, "peft_config", {})
    before = {k: c.base_model_name_or_path for k, c in configs.items()}
    try:
        if base_ref:
            for c in configs.values():
                c.base_model_name_or_path = base_ref
        # the vocabulary is never resized: no base embedding to save, and "auto" would
        # ask the Hub whether the base's config exists
        model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
    finally:
        for k, c in configs.items():
            c.base_model_name_or_path = before[k]
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _same_base(theirs: str, ours: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names this run's base
    model (``ModelSource.ref``), also when it is the local directory lorasync
    versions before named (the embedded default's cache) or the same directory
    by another path."""
    def norm(x: str) -> str:
        path = os.path.expanduser(x)
        if os.path.isdir(path):
            real = os.path.realpath(path)
            try:
                from lorasync.train.model import _embedded_dir
                cache = os.path.realpath(_embedded_dir())
            except ImportError:
                cache = None
            return EMBEDDED_REF if real == cache else real
        if x.rstrip("/").endswith("/smollm2-135m-instruct") and "lorasync" in x:
            return EMBEDDED_REF   # the embedded default's cache on the machine that saved it
        return x
    return norm(theirs) == norm(ours)


def check_init_adapter(cfg) -> dict | None:
    """``run.init_adapter`` against this run, before any worker starts: a PEFT
    LoRA adapter directory whose r, target modules, alpha and base model are
    the run's.  Returns its ``adapter_config.json``; a ``ConfigError`` naming
    the field that differs, with the fix."""
    from lorasync.errors import ConfigError

    given = cfg.run.init_adapter
    if not given:
        return None
    path = os.path.expanduser(given)
    fix_dir = ("give a PEFT adapter directory (adapter_config.json + "
               "adapter_model.safetensors), e.g. RUN/checkpoint-40 or RUN/adapter")
    if not os.path.isdir(path):
        raise ConfigError("run.init_adapter", given, f"no such directory; {fix_dir}")
    conf_path = os.path.join(path, "adapter_config.json")
    try:
        with open(conf_path, encoding="utf-8") as fh:
            conf = json.load(fh)
    except FileNotFoundError:
        raise ConfigError("run.init_adapter", given, f"has no adapter_config.json; "
                          f"{fix_dir}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("run.init_adapter", given, f"its adapter_config.json cannot be read "
                          f"({_reason(exc)}); {fix_dir}") from None
    if not isinstance(conf, dict) or str(conf.get("peft_type", "")).upper() != "LORA":
        kind = conf.get("peft_type") if isinstance(conf, dict) else type(conf).__name__
        raise ConfigError("run.init_adapter", given, f"holds a {kind} adapter, not LoRA; "
                          f"{fix_dir}")
    if not any(os.path.isfile(os.path.join(path, f))
               for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ConfigError("run.init_adapter", given, f"has no adapter_model.safetensors; "
                          f"{fix_dir}")
    where = f"the adapter in {given} (--init-adapter) has"
    other = "or start from another --init-adapter"
    if conf.get("r") != cfg.lora.r:
        raise ConfigError("lora.r", cfg.lora.r, f"{where} r={conf.get('r')}: pass --lora-r "
                          f"{conf.get('r')}, {other}")
    targets = conf.get("target_modules")
    if isinstance(targets, str) or sorted(targets or []) != sorted(cfg.lora.targets):
        shown = targets if isinstance(targets, str) else ",".join(sorted(targets or []))
        raise ConfigError("lora.targets", ",".join(cfg.lora.targets),
                          f"{where} target modules {shown}: pass --lora-targets {shown}, "
                          f"{other}")
    alpha = conf.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or float(alpha) != float(cfg.lora.alpha):
        raise ConfigError("lora.alpha", cfg.lora.alpha, f"{where} lora_alpha={alpha} (the "
                          f"scale of its weights): pass --lora-alpha {alpha}, {other}")
    base = conf.get("base_model_name_or_path")
    ours = base_model_ref(cfg.model.name)   # ModelSource.ref: checked before the model resolves
    if base and not _same_base(str(base), ours):
        raise ConfigError("model.name", cfg.model.name, f"{where} base model {base}, this run "
                          f"{ours}: pass --model with its base, {other}")
    return conf


def load_init_adapter(model, path: str) -> int:
    """Load the PEFT adapter in ``path`` into ``model``'s fresh adapter (PEFT's
    own loader); returns the tensors loaded.  A ``ModelError`` when it does not
    fit (``check_init_adapter`` refuses most of that before launch)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    from lorasync.errors import ModelError

    path = os.path.expanduser(path)
    try:
        weights = load_peft_weights(path, device="cpu")
        result = set_peft_model_state_dict(model, weights)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelError(f"run.init_adapter: {path} does not load into this run's adapter "
                         f"({_reason(exc)}); start from an adapter of the same model, r "
                         "and targets") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        what = (f"{len(missing)} adapter tensor(s) missing, e.g. {missing[0]}" if missing
                else f"{len(result.unexpected_keys)} tensor(s) this model lacks, e.g. "
                f"{result.unexpected_keys[0]}")
        raise ModelError(f"run.init_adapter: {path} does not fit this run's adapter ({what}); "
                         "start from an adapter of the same model, r and targets")
    return len(weights)
