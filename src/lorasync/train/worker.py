"""The training worker's lifecycle: one process per rank, started by torchrun.

``train_worker`` owns the process group (set up, and torn down in
``finally``), the start's own bound (a rank that does not arrive is named
before the watchdog runs), the watchdog, and the fatal markers that stop a
restarted group at once after a user error; the run itself is the
``Trainer``'s (train/trainer.py).
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
import uuid
import warnings

from lorasync.config import Config
from lorasync.errors import LorasyncError
from lorasync.launch import worker_env
from lorasync.launch.stores import init_process_group, master_endpoint
from lorasync.train.trainer import Trainer

__all__ = ["train_worker", "resolve_backend", "start_bound", "START_BOUND_MIN_S"]


def resolve_backend(name: str) -> str:
    import torch

    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise LorasyncError("run.backend: 'nccl' needs CUDA GPUs, none found; use "
                            "--backend gloo (or auto)")
    return name


class _Log:
    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)


def train_worker(cfg: Config, resume: bool = False, trainer_cls=None, source=None) -> int:
    """One rank's run; ``trainer_cls``: a :class:`Trainer` subclass in its place
    (a bench's peer row: lorasync's run with another system's sync); ``source``:
    the model as the launcher resolved it (``ModelSource``; None: resolved here)."""
    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from lorasync.train.recovery import next_action
    from lorasync.train.watchdog import (StartGuard, Watchdog, bounded_call, describe_self,
                                         stall_here)

    spawned = time.time()
    env = worker_env()
    rank, local_rank = env["rank"], env["local_rank"]
    log = _Log(rank)
    _stop_if_fatal_before(rank)
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
    # Until the watchdog runs (it needs the store and every rank's description) the
    # start has a bound of its own: a rank that does not arrive is named.
    store_addr, store_port = master_endpoint()
    guard = StartGuard(rank=rank, world=env["world_size"], store_addr=store_addr,
                       store_port=store_port, bound_s=start_bound(cfg.run.fault_timeout),
                       bound_text=f"max({START_BOUND_MIN_S:g} s, 2 x --fault-timeout "
                       f"{cfg.run.fault_timeout:g} s)",
                       next_action=lambda: next_action(cfg.run.output_dir)).start()
    try:
        stall_here("init")  # test hook (off unless LORASYNC_TEST_STALL names this rank)
        guard.connecting()
        # the group's store on this node's address only, never every interface
        store = init_process_group(backend, _dt.timedelta(minutes=10),
                                   device_id=device if backend == "nccl" else None,
                                   on_store=lambda st: guard.reached("store", st))
        guard.reached("group", store)
    except BaseException:
        guard.done()
        raise
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and \
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0:
        log("note: torchrun shares one c10d store between restarts here; set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node (lorasync's launchers do): a "
            "restarted group can otherwise read the previous one's keys and fail to connect")
    watchdog = trainer = None
    try:
        # who is who (to name a peer that fails), and a key prefix of this attempt
        members: list = [None] * env["world_size"]
        me = describe_self(rank)
        me["token"] = uuid.uuid4().hex if rank == 0 else None
        dist.all_gather_object(members, me)
        guard.reached("members", store)
        watchdog = Watchdog(rank=rank, members=members, store_addr=store_addr,
                            store_port=store_port,
                            prefix=f"lorasync/watchdog/{members[0]['token']}/",
                            min_timeout_s=cfg.run.fault_timeout, steps=cfg.run.fault_steps,
                            on_fault=lambda e: trainer.record_event(e) if trainer else None,
                            next_action=lambda: next_action(cfg.run.output_dir))
        watchdog.start()
        # every rank's first beat is in the store before anyone watches
        dist.barrier(device_ids=[device.index]) if backend == "nccl" else dist.barrier()
        guard.done()
        trainer = (trainer_cls or Trainer)(cfg, resume, env, device, backend, log,
                                           watchdog=watchdog, spawned=spawned, source=source)
        trainer.setup()
        return trainer.run()
    except LorasyncError as exc:
        _mark_fatal(rank, str(exc))
        raise
    except Exception as exc:
        if watchdog is not None and _is_comm_failure(exc):
            watchdog.connection_lost(exc)  # names the peer, records it, exits
        raise
    finally:
        guard.done()
        if watchdog is not None:
            watchdog.stop()
        # a peer stuck in its own teardown must not keep this worker: it ends anyway
        if not bounded_call(lambda: (stall_here("destroy"), dist.destroy_process_group()),
                            cfg.run.fault_timeout, "lorasync-destroy"):
            print(f"lorasync: rank {rank}: destroy_process_group did not return within "
                  f"{cfg.run.fault_timeout:g} s (--fault-timeout); this worker ends without it",
                  file=sys.stderr, flush=True)


#: the least time the start of a group (store, process group, first gather) gets
START_BOUND_MIN_S = 20.0


def start_bound(fault_timeout: float) -> float:
    """Seconds the start of a group may take before the ranks that did not
    arrive are named: max(20 s, 2 x --fault-timeout)."""
    return max(START_BOUND_MIN_S, 2 * float(fault_timeout))


def _is_comm_failure(exc: BaseException) -> bool:
    """A collective failed because a peer went away (not a bug of ours)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in (
        "Connection reset", "Connection closed", "Broken pipe", "Connection refused",
        "gloo/transport", "pair.cc", "Socket Timeout", "NCCL communicator was aborted"))


def _fatal_dir() -> str | None:
    return os.environ.get("LORASYNC_FATAL_DIR") or None


def _mark_fatal(rank: int, msg: str) -> None:
    """A user error is the same on every try: tell restarted workers to stop at once."""
    folder = _fatal_dir()
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, f"rank{rank}"), "w") as fh:
            fh.write(msg)


def _stop_if_fatal_before(rank: int) -> None:
    """Stop a restarted worker at once (exit 2, nothing loaded or written) when an
    earlier try of this group ended with a user error.  Rank 0 says it once: when
    it reported the error itself (its mark is there) the restarts stop silently."""
    folder = _fatal_dir()
    if not folder or not os.path.isdir(folder) or not os.listdir(folder):
        return
    if os.path.exists(os.path.join(folder, "rank0")):
        raise SystemExit(2)
    with open(os.path.join(folder, sorted(os.listdir(folder))[0])) as fh:
        msg = fh.read() or "an earlier try of this run failed with a user error"
    if rank == 0:  # rank 0 says it now (another rank's error): later restarts stay silent
        _mark_fatal(rank, msg)
    raise LorasyncError(msg)
