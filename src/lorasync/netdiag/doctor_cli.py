"""Find host and network problems that slow or break distributed training, with fixes.

This host only (static checks: hostname, interfaces, MTU, TCP, RDMA, rendezvous):

    lorasync doctor
    lorasync doctor --nnodes 4 --rate 10gbit --rtt 2ms --rdzv-endpoint 10.0.0.1:29400

Across ranks (static checks on every rank, plus versions, config, MTU and
the slowest link from a short probe):

    lorasync doctor --nproc 2
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 10.0.0.1:29400 -m lorasync doctor --config run.yaml

Exit status: 0 when nothing is worse than a warning, 1 when something is an
error, 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lorasync.errors import ConfigError
from lorasync.netdiag.ranks import add_launch_arguments, check_launch_args, init_group, launch_argv, relaunch

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_launch_arguments(p, "doctor", nproc_default=None,
                         nnodes_help="nodes the job spans: decides whether a loopback hostname is an error; "
                                     "with --nproc and --rdzv-endpoint, launches across nodes")
    p.add_argument("--json", action="store_true", help="print findings as JSON")
    p.add_argument("--verbose", action="store_true", help="show why/fix for ok findings too")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="read /proc/sys, /sys/class/net, /sys/class/infiniband under DIR (static only)")
    p.add_argument("--rate", default=None, help="link rate to size TCP settings for, e.g. 10gbit")
    p.add_argument("--rtt", default=None, help="round-trip time to size TCP settings for, e.g. 2ms")
    p.add_argument("--from-probe", default=None, metavar="FILE",
                   help="take rate and RTT from `lorasync probe --output FILE`")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="training config; live checks compare its hash across ranks")
    p.add_argument("--no-probe", action="store_true", help="live: skip the short pair probe")
    p.add_argument("--peer", action="append", default=[], metavar="ADDR",
                   help="probe the path MTU to ADDR (a black hole: large packets lost, small ones "
                        "pass); repeatable; live checks probe the other nodes' addresses unless --no-probe")
    p.add_argument("--nccl", action="store_true",
                   help="the job uses NCCL: advise NCCL_ALGO where the cost model predicts a "
                        "gain (needs --nnodes and --rate/--rtt or --from-probe)")
    p.add_argument("--gpus-per-node", type=int, default=1, metavar="G",
                   help="with --nccl: GPUs (ranks) per node (default 1)")


def _link(args, host):
    from lorasync.netdiag.tune import link_from_options

    return link_from_options(host, args.rate, args.rtt, args.from_probe)


def _nccl(args, link) -> list:
    from lorasync.netdiag.nccl_advice import nccl_findings

    if link is None or not args.nnodes:
        raise ConfigError("--nccl", True, "give --nnodes and the link (--rate and --rtt, or "
                          "--from-probe) to advise NCCL_ALGO")
    if args.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", args.gpus_per_node, "use an integer >= 1")
    return nccl_findings(nnodes=args.nnodes, ranks_per_node=args.gpus_per_node,
                         rate_bps=link.rate_bps, rtt_s=link.rtt_s)


def _print(findings, args, world=None, extra=None) -> None:
    from lorasync.netdiag.doctor import exit_code, format_findings, worst

    if args.json:
        out = {"findings": [f.to_dict() for f in findings], "worst": worst(findings),
               "exit_code": exit_code(findings), **(extra or {})}
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_findings(findings, verbose=args.verbose, world=world))
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from lorasync.launch import in_worker
    from lorasync.netdiag.doctor import exit_code, static_checks
    from lorasync.netdiag.hostinfo import HostInfo

    live = in_worker() or args.nproc is not None or args.emulate is not None
    check_launch_args(args, launching=live and not in_worker())
    if not os.path.isdir(args.root):
        raise ConfigError("--root", args.root, "not a directory")
    if live and args.root != "/":
        raise ConfigError("--root", args.root, "live checks (--nproc, --emulate, torchrun) read the real host")
    if args.config and not os.path.isfile(args.config):
        raise ConfigError("--config", args.config, "no such file")
    host = HostInfo(root=args.root)
    link = _link(args, host)
    if not live:
        findings = static_checks(host, nnodes=args.nnodes, link=link, rdzv_endpoint=args.rdzv_endpoint,
                                 peers=args.peer)
        if args.nccl:
            findings += _nccl(args, link)
        _print(findings, args, extra={"host": host.summary()})
        return exit_code(findings)
    if not in_worker():
        return relaunch(args, "doctor", launch_argv(args), wall_s=args.timeout + 180)
    return _worker(args, host, link)


def _worker(args, host, link) -> int:
    from lorasync.launch import worker_env
    from lorasync.netdiag.doctor import (Finding, exit_code, live_checks, merge_findings, rank_facts,
                                     static_checks)
    from lorasync.comm.probe import run_probe
    from lorasync.netdiag.hostinfo import endpoint_facts
    from lorasync.netdiag.tune import link_from_probe_data

    env = worker_env()
    try:
        dist = init_group(args)
    except Exception as exc:  # the finding is the point: say what we saw here, then fail
        nn = max(args.nnodes or 1, env["world_size"] // max(1, env["local_world_size"]))
        findings = static_checks(host, nnodes=nn, link=link, exposure=False) + [Finding(
            "reachable", "error",
            f"rank {env['rank']} could not join the other {env['world_size'] - 1} rank(s) within "
            f"{args.timeout:g} s: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            "training cannot start; the usual cause is an address other ranks cannot reach "
            "(see hostname-loopback / gloo-ifname above) or a firewall",
            "fix the findings above; check that MASTER_ADDR:MASTER_PORT is reachable from every node")]
        _print(findings, args)
        return 1
    try:
        me, world = dist.get_rank(), dist.get_world_size()
        facts = rank_facts(host, args.config)
        all_facts: list = [None] * world
        dist.all_gather_object(all_facts, facts)
        nnodes = max(len({f["node"] for f in all_facts}), args.nnodes or 1)
        probe = None
        if not args.no_probe and world > 1:
            probe = run_probe(describe_rank=endpoint_facts, quick=True, max_bytes=1 << 20, pair_max_bytes=1 << 20,
                              time_budget_s=8.0)
        if link is None and probe and probe.get("model") and probe["model"].get("bandwidth_Bps"):
            link = link_from_probe_data(probe, "measured by a quick probe")
        others = [f["addr"] for f in all_facts if f["node"] != facts["node"] and f.get("addr")]
        mine = static_checks(host, nnodes=nnodes, link=link, exposure=False,
                             peers=[*args.peer, *([] if args.no_probe else others)])
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, mine)
        findings = merge_findings(per_rank) + live_checks(all_facts, probe)
        code = exit_code(findings)
        if me == 0:
            _print(findings, args, world=world,
                   extra={"ranks": all_facts, "probe": probe, "nnodes": nnodes})
        return code
    finally:
        dist.destroy_process_group()
