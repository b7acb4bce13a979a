"""How close does `lorasync probe` get to a link of known rate?

Builds N network namespaces on a bridge (its own, independent of
lorasync.emulate.cluster), shapes every node's veth with tbf at --rate on both
ends, runs `lorasync probe` on one rank per namespace, and prints configured
vs measured: all-reduce busbw at the largest size, the fitted group
bandwidth, and the pair matrix. Passes (exit 0) when busbw is within 10% of
the rate. Needs root; removes every namespace it made, also on failure.

    sudo .venv/bin/python bench/probe_accuracy.py                 # 2 nodes, 100mbit
    sudo .venv/bin/python bench/probe_accuracy.py --rate 1gbit --nodes 3 --max-bytes 64MiB

tbf counts Ethernet frames; at MTU 1500 a TCP segment carries 1448 payload
bytes per 1514-byte frame, so about 95.6% of the rate is the ceiling for
payload (busbw) on this setup.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys

from lorasync.units import parse_rate_bps
from lorasync.units import fmt_rate

PREFIX = f"lsync-bench-pa{os.getpid()}"


def sh(*argv, check=True):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=check)


def build(n: int, rate: str, mtu: int) -> list[str]:
    names = []
    br = f"{PREFIX}-br"
    sh("ip", "netns", "add", br)
    names.append(br)
    sh("ip", "-n", br, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", br, "link", "set", "br0", "up")
    rate_bps = parse_rate_bps(rate)
    burst = max(32 << 10, int(rate_bps / 8 / 250))  # >= 4 ms of traffic: tbf needs rate/HZ
    for i in range(n):
        ns = f"{PREFIX}-n{i}"
        sh("ip", "netns", "add", ns)
        names.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", br, "link", "add", f"p{i}", "mtu", mtu, "type", "veth", "peer", "name", "eth0",
           "netns", ns, "mtu", mtu)
        sh("ip", "-n", br, "link", "set", f"p{i}", "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"10.231.9.{i + 1}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        for where, dev in ((ns, "eth0"), (br, f"p{i}")):
            sh("tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
               "burst", burst, "latency", "100ms")
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--max-bytes", default="16MiB")
    ap.add_argument("--pair-max-bytes", default="4MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--time-budget", type=float, default=120)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    rate_bps = parse_rate_bps(args.rate)
    names: list[str] = []
    procs: list[subprocess.Popen] = []
    try:
        names = build(args.nodes, args.rate, args.mtu)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="10.231.9.1",
                   MASTER_PORT="29531", WORLD_SIZE=str(args.nodes), LOCAL_WORLD_SIZE="1", LOCAL_RANK="0",
                   GLOO_SOCKET_IFNAME="eth0")
        argv = [sys.executable, "-m", "lorasync", "probe", "--json", "--max-bytes", args.max_bytes,
                "--pair-max-bytes", args.pair_max_bytes, "--repeats", str(args.repeats),
                "--time-budget", str(args.time_budget), "--timeout", "120"]
        for i in range(args.nodes):
            procs.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-n{i}", *argv],
                                          env=dict(env, RANK=str(i)), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        outs = [p.communicate(timeout=args.time_budget * 3 + 300) for p in procs]
        if any(p.returncode for p in procs):
            for p, (_, err) in zip(procs, outs):
                print(f"rank exit {p.returncode}: {err[-1500:]}", file=sys.stderr)
            return 1
        res = json.loads(outs[0][0])
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in reversed(names):
            sh("ip", "netns", "del", ns, check=False)

    wire = rate_bps / 8
    ceiling = wire * (args.mtu - 52) / (args.mtu + 14)  # TCP/IP+timestamps headers; Ethernet header
    ar = [r for r in res["sweep"] if r["collective"] == "all_reduce"]
    big = ar[-1]
    ratio = big["busbw_Bps"] / wire
    print(f"configured: {args.nodes} nodes, tbf {fmt_rate(rate_bps, unit='bit')} both ends of every veth, "
          f"MTU {args.mtu}: {fmt_rate(wire, 'bytes')} on the wire, payload ceiling {fmt_rate(ceiling, 'bytes')}")
    print(f"{'bytes':>10} {'time':>10} {'busbw':>11} {'of rate':>8}")
    for r in ar:
        print(f"{r['bytes']:>10} {r['time_s'] * 1e3:>8.2f}ms {fmt_rate(r['busbw_Bps'], 'bytes'):>11} "
              f"{r['busbw_Bps'] / wire:>8.1%}")
    m = res["model"]
    print(f"measured all_reduce busbw at {big['bytes']} B: "
          f"{fmt_rate(big['busbw_Bps'], 'bytes')} = {ratio:.1%} of the configured rate")
    print(f"fitted group bandwidth: {fmt_rate(m['bandwidth_Bps'], 'bytes')} = {m['bandwidth_Bps'] / wire:.1%}; "
          f"latency {m['latency_s'] * 1e6:.0f} us per message")
    pbw = [p["bandwidth_Bps"] for p in res["pairs"]]
    if pbw:
        print(f"pairs ({len(pbw)}): min {fmt_rate(min(pbw), 'bytes')} ({min(pbw) / wire:.1%}), median "
              f"{fmt_rate(statistics.median(pbw), 'bytes')}, max {fmt_rate(max(pbw), 'bytes')} ({max(pbw) / wire:.1%})")
    ok = abs(ratio - 1) <= 0.10
    print(f"busbw within 10% of the rate: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
