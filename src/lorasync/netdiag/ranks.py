"""Running a diagnostic on ranks: the options and launch shared by ``lorasync
probe`` and ``lorasync doctor --nproc/--emulate``.

Outside torchrun the command relaunches itself (:func:`relaunch`: local
workers through :func:`lorasync.launch.run_torchrun`, or an emulated cluster
with ``--emulate``); inside a worker it joins the group with a timeout
(:func:`init_group`), so a missing rank fails instead of hanging.
"""

from __future__ import annotations

import argparse
import os
import sys

from lorasync.errors import ConfigError

__all__ = ["add_launch_arguments", "launch_argv", "check_launch_args", "relaunch", "init_group"]


def add_launch_arguments(p: argparse.ArgumentParser, name: str, *, nproc_default: int | None = 2,
                         nnodes_help: str = "nodes (with --rdzv-endpoint)") -> None:
    """Options shared by the subcommands that run across ranks (probe, doctor)."""
    g = p.add_argument_group("ranks")
    g.add_argument("--nproc", type=int, default=nproc_default,
                   help="local worker processes when not already under torchrun"
                        + (f" (default {nproc_default})" if nproc_default else ""))
    g.add_argument("--nnodes", type=int, default=None, help=nnodes_help)
    g.add_argument("--node-rank", type=int, default=0, help="this node's rank (with --nnodes)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="c10d rendezvous endpoint for several nodes")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="process group backend (auto: nccl with CUDA, else gloo)")
    g.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds to wait for the other ranks (rendezvous and each collective)")
    g.add_argument("--emulate", default=None, metavar="SPEC",
                   help=f"run {name} on an emulated cluster of network namespaces (lorasync cluster), "
                        f"e.g. nodes=3,rate=100mbit,pair=0-1:20mbit; --nproc is then ranks per node")


def launch_argv(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    """This invocation's options as argv for the workers (launch options dropped)."""
    launch = {"nproc", "nnodes", "node_rank", "rdzv_endpoint", "emulate", "command", "_run", *skip}
    out = []
    for key, val in vars(args).items():
        if key in launch or key.startswith("_") or val is None or val is False:
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if val is True else [flag, str(val)]
    return out


def check_launch_args(args: argparse.Namespace, *, launching: bool = True) -> None:
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError("--nproc", args.nproc, "must be at least 1")
    if args.nnodes is not None and args.nnodes < 1:
        raise ConfigError("--nnodes", args.nnodes, "must be at least 1")
    if args.timeout <= 0:
        raise ConfigError("--timeout", args.timeout, "must be a positive number of seconds")
    if launching and (args.nnodes or 1) > 1 and not args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint", None, "needed with --nnodes > 1 (HOST:PORT of the rendezvous)")


def relaunch(args: argparse.Namespace, name: str, argv: list[str], wall_s: float | None = None) -> int:
    """Outside torchrun: start the workers (locally or on an emulated cluster).
    ``wall_s`` bounds the emulated run as a whole (the workers bound each wait)."""
    if args.emulate:
        from lorasync.emulate.launch import emulated, launch_on_cluster
        from lorasync.emulate.spec import parse_emulate

        spec = parse_emulate(args.emulate)
        with emulated(spec) as cluster:
            code = launch_on_cluster(cluster, [name, *argv], nproc_per_node=args.nproc or 1, timeout=wall_s)
        if code == 124:
            print(f"lorasync {name}: the emulated run did not finish within {wall_s:g} s", file=sys.stderr)
        return int(code or 0)
    from lorasync.launch import run_torchrun
    return run_torchrun([name, *argv], args.nproc or 2, nnodes=args.nnodes or 1, node_rank=args.node_rank,
                        rdzv_endpoint=args.rdzv_endpoint)


def init_group(args: argparse.Namespace):
    """init_process_group with a timeout, so a missing rank fails instead of hanging."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lorasync.launch.stores import init_process_group

    backend = args.backend
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    if backend == "auto":  # NCCL needs one GPU per local rank
        backend = ("nccl" if torch.cuda.is_available() and dist.is_nccl_available()
                   and torch.cuda.device_count() >= local else "gloo")
    kw = {}
    if backend == "nccl":
        lr = int(os.environ.get("LOCAL_RANK", 0))
        if lr >= torch.cuda.device_count():
            raise ConfigError("--backend", "nccl", f"local rank {lr} has no GPU of its own "
                              f"({torch.cuda.device_count()} visible): use --backend gloo or fewer --nproc")
        torch.cuda.set_device(lr)
        kw["device_id"] = torch.device("cuda", lr)  # binds the communicator: no device guessing in barrier
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    init_process_group(backend, timedelta(seconds=args.timeout), **kw)
    return dist
