#!/usr/bin/env python3
"""The steps of a run that crossed the nodes, timed across its ranks.

    python bench/sync_events.py bench/reference/topology-4x2/b-100mbit_20ms/100mbit_20ms/diloco-*

A run's "sync s/step" (``comm_s``) is what each rank waited, so one slow
rank's late arrival counts as the others' sync time: on 8 workers sharing 2
cores that skew is seconds.  For every step in which some rank sent
inter-node bytes (a periodic strategy's outer sync), this prints the time
from the last rank's arrival at the sync to the last rank's exit, as
``bench/topology_groups.py`` times a collective alone: the exit is the
step's record (``time``, the host's clock, which the emulated nodes share)
and the arrival that minus the rank's ``comm_s``.  That is an estimate
where a step's sync is not one contiguous wait (a hierarchical step also
waits inside the backward pass for its node's gradient reduce): it counts
those waits as if they ran back to back just before the step's end.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from lorasync.monitor.metrics import read_jsonl_records  # noqa: E402


def events(run: Path) -> list[dict]:
    """One entry per step that crossed the nodes, in step order."""
    steps: dict[int, list[dict]] = collections.defaultdict(list)
    for r in read_jsonl_records(str(run / "metrics.jsonl")):
        if "step" in r and "event" not in r and "comm_s" in r:
            steps[r["step"]].append(r)
    out = []
    for step, rs in sorted(steps.items()):
        if not any(r.get("inter_bytes", 0) for r in rs):
            continue
        arrive = max(r["time"] - r["comm_s"] for r in rs)
        leave = max(r["time"] for r in rs)
        out.append({"step": step, "ranks": len(rs), "last_in_to_last_out_s": leave - arrive,
                    "comm_s_min": min(r["comm_s"] for r in rs),
                    "comm_s_max": max(r["comm_s"] for r in rs),
                    "inter_bytes": max(r.get("inter_bytes", 0) for r in rs)})
    return out


def _size(n: int) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 10_000 else f"{n} B"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (with metrics.jsonl)")
    a = p.parse_args()
    for run in a.runs:
        if not (run / "metrics.jsonl").is_file():
            print(f"{run}: no metrics.jsonl; name a run directory", file=sys.stderr)
            return 2
        ev = events(run)
        print(f"{run}: {len(ev)} step(s) crossed the nodes")
        for e in ev:
            print(f"  step {e['step']:>4}: last rank in -> last rank out {e['last_in_to_last_out_s']:.2f} s"
                  f" (ranks' comm_s {e['comm_s_min']:.2f}-{e['comm_s_max']:.2f} s,"
                  f" {_size(e['inter_bytes'])} inter-node on the busiest rank)")
        if len(ev) > 1:
            print(f"  median: {statistics.median(e['last_in_to_last_out_s'] for e in ev):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
