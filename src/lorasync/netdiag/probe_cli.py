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

from lorasync.errors import ConfigError
from lorasync.netdiag.ranks import add_launch_arguments, check_launch_args, init_group, launch_argv, relaunch
from lorasync.units import fmt_bytes, fmt_duration, fmt_rate

__all__ = ["add_arguments", "run", "format_report"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_launch_arguments(p, "probe")
    p.add_argument("--quick", action="store_true",
                   help="sizes 4x apart up to 4 MiB, further on long links while latency "
                        "dominates, few repeats: a few seconds (what --comm auto uses)")
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


def run(args: argparse.Namespace) -> int:
    from lorasync.launch import in_worker
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

    from lorasync.comm.probe import run_probe
    from lorasync.netdiag.hostinfo import endpoint_facts

    dist = init_group(args)
    try:
        res = run_probe(describe_rank=endpoint_facts, quick=args.quick, max_bytes=max_bytes, repeats=args.repeats,
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


def format_report(res: dict) -> str:
    """The probe JSON as a table for people."""
    lines = [f"lorasync probe: {res['world_size']} ranks, {res['backend']}, "
             f"{'quick, ' if res.get('quick') else ''}{res.get('elapsed_s', 0):.1f} s"]
    for r in res.get("ranks") or []:
        lines.append(f"  rank {r['rank']}: {r['host']} {r.get('ifname') or '?'} "
                     f"{r.get('addr') or '?'} mtu {r.get('mtu') or '?'}")
    if res.get("sweep"):
        lines.append("")
        lines.append(f"{'collective':<11} {'bytes':>9} {'time':>10} {'min':>10} {'max':>10} "
                     f"{'algbw':>11} {'busbw':>11}")
        for r in res["sweep"]:
            lines.append(f"{r['collective']:<11} {fmt_bytes(r['bytes'], binary=True):>9} {fmt_duration(r['time_s']):>10} "
                         f"{fmt_duration(r['time_s_min']):>10} {fmt_duration(r['time_s_max']):>10} "
                         f"{fmt_rate(r['algbw_Bps'], 'bytes'):>11} {fmt_rate(r['busbw_Bps'], 'bytes'):>11}")
    m = res.get("model")
    if m:
        lines.append(f"fitted link (all_reduce, busbw-corrected): latency {fmt_duration(m['latency_s'])} per "
                     f"message, bandwidth {fmt_rate(m['bandwidth_Bps'], 'bytes')} (r2 {m['r2']:.3f})")
    pairs = res.get("pairs") or []
    if pairs:
        n = res["world_size"]
        bw = {(p["src"], p["dst"]): p for p in pairs}
        lines.append("")
        lines.append("pair bandwidth, src (row) -> dst (column):")
        lines.append("      " + "".join(f"{d:>11}" for d in range(n)))
        for s in range(n):
            cells = [fmt_rate(bw[(s, d)]["bandwidth_Bps"], 'bytes') if (s, d) in bw else "-" for d in range(n)]
            lines.append(f"{s:>5} " + "".join(f"{c:>11}" for c in cells))
        lines.append("pair latency (one way):")
        for s in range(n):
            cells = [fmt_duration(bw[(s, d)]["latency_s"]) if (s, d) in bw else "-" for d in range(n)]
            lines.append(f"{s:>5} " + "".join(f"{c:>11}" for c in cells))
        if res.get("pairs_complete") is False:
            lines.append(f"{len(pairs)} of {n * (n - 1)} pairs measured: the quick probe's "
                         "budget ran out (--time-budget S, or the full probe, for all)")
    sp = res.get("slowest_pair")
    if sp:
        ranks = {r["rank"]: r for r in res.get("ranks") or []}

        def who(r):
            i = ranks.get(r, {})
            return f"rank {r} ({i.get('host', '?')} {i.get('addr') or ''})".replace(" )", ")")
        lines.append(f"slowest pair: {who(sp['src'])} -> {who(sp['dst'])}: "
                     f"{fmt_rate(sp['bandwidth_Bps'], 'bytes')}, latency {fmt_duration(sp['latency_s'])}")
    for w in res.get("warnings") or []:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
