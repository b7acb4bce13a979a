"""Configured vs measured rate and RTT of emulated cluster links (root only).

    sudo .venv/bin/python bench/cluster_links.py [--seconds 2] [--repeats 3] [--json]

Brings up a 2-node cluster per profile, measures node0 -> node1 with a short
TCP transfer (steady-state goodput, 1-byte round trips), prints the ratios
side by side and takes the cluster down.  No assertions: this is the place to
see how faithful the emulation is on this machine.  TCP goodput at MTU 1500 is
at most about 95% of the line rate (headers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from lorasync.emulate.launch import emulated
from lorasync.emulate.spec import parse_emulate
from lorasync.units import fmt_rate

PROFILES = [
    "rate=10mbit",
    "rate=100mbit",
    "rate=1gbit",
    "rate=100mbit,delay=20ms",
    "rate=100mbit,delay=20ms,loss=0.1%",
    "rate=1gbit,delay=5ms",  # the forwarder is one Python process: its ceiling shows here
    "rate=100mbit,pair=0-1:10mbit",
    "",  # unshaped veth, for scale
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0, help="bulk transfer per sample")
    p.add_argument("--repeats", type=int, default=3, help="samples per profile (median, min-max shown)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    for profile in PROFILES:
        spec = parse_emulate(",".join(filter(None, ["nodes=2", f"name=bench{os.getpid() % 10000}", profile])))
        with emulated(spec) as c:
            ms = [c.measure(0, 1, seconds=args.seconds) for _ in range(args.repeats)]
            conf_rate = c.path_rate(0, 1)
        rates = [m.rate_bps for m in ms]
        rtts = [m.rtt_s for m in ms]
        rows.append({
            "profile": profile or "unshaped", "mtu": spec.link_mtu,
            "rate_conf_bps": conf_rate, "rate_meas_bps": statistics.median(rates),
            "rate_min_bps": min(rates), "rate_max_bps": max(rates),
            "rtt_conf_s": 2 * spec.delay_s, "rtt_meas_s": statistics.median(rtts),
            "connect_s": statistics.median(m.connect_s for m in ms),
        })
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'profile':36} {'mtu':>5} {'rate conf':>10} {'measured (min-max)':>28} {'ratio':>6} "
          f"{'RTT conf':>9} {'RTT meas':>9}")
    for r in rows:
        ratio = f"{r['rate_meas_bps'] / r['rate_conf_bps']:.2f}" if r["rate_conf_bps"] else "-"
        meas = (f"{r['rate_meas_bps'] / 1e6:.1f} ({r['rate_min_bps'] / 1e6:.1f}-"
                f"{r['rate_max_bps'] / 1e6:.1f}) Mbit/s")
        print(f"{r['profile']:36} {r['mtu']:>5} {fmt_rate(r['rate_conf_bps'], 'tc', unit='bit'):>10} {meas:>28} {ratio:>6} "
              f"{r['rtt_conf_s'] * 1e3:>7.1f}ms {r['rtt_meas_s'] * 1e3:>7.3f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
