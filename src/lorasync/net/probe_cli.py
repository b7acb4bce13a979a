"""Measure the links training will use: all-reduce sweep, pair matrix, alpha/beta fit.

One node, 2 local ranks (relaunches itself under torchrun):

    lorasync probe --nproc 2
    lorasync probe --nproc 4 --quick --json > probe.json

Several nodes (run on each node; same endpoint everywhere):

    GLOO_SOCKET_IFNAME=eth1 lorasync probe --nnodes 2 --nproc 1 \\
        --rdzv-endpoint 10.0.0.1:29400 --output probe.json

or directly under torchrun:

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 10.0.0.1:29400 -m lorasync probe --output probe.json

Rank 0 prints the table (or the JSON with --json) and writes --output; the
JSON is what ``lorasync plan`` and ``lorasync tune --from-probe`` read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lorasync.errors import ConfigError, EnvironmentProblem

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_launch_arguments(p, "probe")
    p.add_argument("--quick", action="store_true",
                   help="a few sizes up to 4 MiB, few repeats: a few seconds (what --comm auto uses)")
    p.add_argument("--max-bytes", default="64MiB", metavar="SIZE",
                   help="largest all-reduce size (default 64MiB; e.g. 4MiB on a slow link)")
    p.add_argument("--pair-max-bytes", default=None, metavar="SIZE",
                   help="largest message of the pair matrix (default 4MiB, 1MiB with --quick)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per size (default 10, 3 with --quick)")
    p.add_argument("--collectives", default="all_reduce",
                   help="comma list of all_reduce, all_gather, broadcast (default all_reduce)")
    p.add_argument("--no-pairs", action="store_true", help="skip the pair matrix")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="seconds for sweep + pairs (default 120, 6 with --quick)")
    p.add_argument("--json", action="store_true", help="print the probe JSON instead of the table")
    p.add_argument("--output", metavar="FILE", help="write the probe JSON here (rank 0)")


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
                   help=f"run {name} on an emulated cluster of network namespaces (lorasync.net.cluster), "
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
        try:
            from lorasync.net.cluster import emulated, launch_on_cluster, parse_emulate
        except ImportError as exc:
            raise EnvironmentProblem(
                f"--emulate needs lorasync.net.cluster, which this build lacks ({exc}); "
                f"use --nproc N, or torchrun in namespaces you built yourself") from None
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
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout), **kw)
    return dist


def run(args: argparse.Namespace) -> int:
    from lorasync.launch import in_worker
    from lorasync.net.probe import format_report, run_probe
    from lorasync.units import parse_size

    check_launch_args(args)
    max_bytes = parse_size(args.max_bytes, "--max-bytes", minimum=4)
    pair_max = parse_size(args.pair_max_bytes, "--pair-max-bytes", minimum=4) if args.pair_max_bytes else None
    if max_bytes < 4096:
        raise ConfigError("--max-bytes", args.max_bytes, "must be at least 4K")
    if args.repeats is not None and args.repeats < 1:
        raise ConfigError("--repeats", args.repeats, "must be at least 1")
    if args.time_budget is not None and args.time_budget <= 0:
        raise ConfigError("--time-budget", args.time_budget, "must be a positive number of seconds")
    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    bad = [c for c in collectives if c not in ("all_reduce", "all_gather", "broadcast")]
    if bad or not collectives:
        raise ConfigError("--collectives", args.collectives, "use a comma list of all_reduce, all_gather, broadcast")
    if args.output:
        d = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(d):
            raise ConfigError("--output", args.output, f"directory {d} does not exist")

    if not in_worker():
        budget = args.time_budget or (6 if args.quick else 120)
        return relaunch(args, "probe", launch_argv(args), wall_s=args.timeout + 3 * budget + 120)

    dist = init_group(args)
    try:
        res = run_probe(quick=args.quick, max_bytes=max_bytes, repeats=args.repeats,
                        pairs=False if args.no_pairs else None, pair_max_bytes=pair_max,
                        time_budget_s=args.time_budget, collectives=collectives)
        if dist.get_rank() == 0:
            if args.output:
                with open(args.output, "w", encoding="utf-8") as f:
                    json.dump(res, f, indent=1)
                    f.write("\n")
            if args.json:
                json.dump(res, sys.stdout, indent=1)
                sys.stdout.write("\n")
            else:
                print(format_report(res))
                if args.output:
                    print(f"wrote {args.output}")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0
