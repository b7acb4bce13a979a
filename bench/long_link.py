#!/usr/bin/env python3
"""auto's first look at a long, thin link: the start probe, before and after.

    sudo .venv/bin/python bench/long_link.py --json bench/reference/slow-links/long_link.json
    sudo .venv/bin/python bench/long_link.py --parts probe --profiles 10mbit/50ms,100mbit/50ms
    sudo .venv/bin/python bench/long_link.py --parts train --train-profile 10mbit/50ms --steps 30

About 10 minutes with the defaults (3 probe profiles, 3 training runs).

"before" is the package as it was at ``--before`` (a git revision of this
repository, extracted with ``git archive`` into a temporary directory and put
first on the workers' PYTHONPATH); "after" is this checkout's ``src``.  Both
run in the same invocation, alternating, on the same emulated clusters.

* ``probe``: for each profile (RATE/ONE-WAY-DELAY) an emulated 2-node cluster
  (htb on the veths, the userspace delay link), and on it, for each version,
  the figure ``--comm auto`` starts from (``Links.start_probe`` with
  ``probe=quick``, the default, and ``probe=live``) and the time it took; then the link's real rate: an all-reduce about
  ``--ref-seconds`` long at the configured rate, timed twice, bus bytes over
  its time less the small all-reduce's (the latency).
* ``train``: ``lorasync train --comm auto`` on the embedded default for
  ``--steps`` steps on one profile, with each version, and ``--comm none``
  (the no-sync ceiling), ``--rounds`` times alternating.  Per run: the
  bandwidth auto started from (its log line), the exposed sync of the steps
  between its first choice and its next decision (the max over ranks of
  each step's ``comm_s``: the largest is "the first sync's exposed time"),
  and samples/s of steps 2..N against the ceiling's (best round each).

Needs root (namespaces, tc, TUN).  Figures from one invocation only compare
with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r'''
import json, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
from lorasync.comm.auto.measure import Links
from lorasync.comm.wire import Wire
out = {"src": __import__("lorasync").__file__}
links = Links(Wire(None, lambda n: None), None, torch.device("cpu"), lambda n: None, lambda s: None)
for mode in ("quick", "live"):
    t0 = time.perf_counter()
    net = links.start_probe(mode, "flat")
    out[mode] = {"start_Bps": net.bandwidth_Bps, "alpha_s": net.alpha_s,
                 "start_s": time.perf_counter() - t0}
ref_bytes = int(sys.argv[2])
def timed(nbytes, reps):
    buf = torch.ones(nbytes // 4)
    ts = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(buf)
        ts.append(time.perf_counter() - t)
    t = torch.tensor([min(ts)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t)
small = timed(1024, 5)
big = timed(ref_bytes, 2)
n = dist.get_world_size()
out["real_Bps"] = ref_bytes * 2 * (n - 1) / n / max(big - small, 1e-9)
out["ref_bytes"], out["ref_s"], out["small_s"] = ref_bytes, big, small
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh)
dist.destroy_process_group()
'''


def _profile(text: str) -> tuple[str, str]:
    rate, _, delay = text.partition("/")
    return rate.strip(), (delay.strip() or "0ms")


def _extract(rev: str, into: str) -> str:
    """``src`` of ``rev`` (git archive) under ``into``; returns its path."""
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True,
                          check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=arch, check=True)
    return os.path.join(into, "src")


def _env(src: str) -> dict:
    return dict(os.environ, PYTHONPATH=src)


def probe_part(args, versions: dict, tmp: str) -> list[dict]:
    from lorasync.emulate.launch import emulated, launch_on_cluster
    from lorasync.emulate.spec import ClusterSpec
    from lorasync.units import parse_rate_bps

    script = os.path.join(tmp, "probe_worker.py")
    Path(script).write_text(WORKER)
    rows = []
    for prof in args.profiles.split(","):
        rate, delay = _profile(prof)
        rate_Bps = parse_rate_bps(rate) / 8
        ref_bytes = int(min(64 << 20, max(1 << 20, rate_Bps * args.ref_seconds)))
        spec = ClusterSpec(nodes=2, rate_bps=rate, delay_s=delay,
                           name=f"llp{os.getpid() % 100000}")
        with emulated(spec) as cluster:
            for rnd in range(args.rounds):
                for ver, src in versions.items():
                    res_path = os.path.join(tmp, f"probe-{ver}.json")
                    if os.path.exists(res_path):
                        os.unlink(res_path)
                    rc = launch_on_cluster(cluster, [script, res_path, str(ref_bytes)], module=None,
                                           timeout=300, env=_env(src),
                                           log_dir=os.path.join(tmp, f"logs-{ver}"))
                    row = {"profile": f"{rate}/{delay}", "version": ver, "round": rnd + 1,
                           "rate_Bps": rate_Bps, "rc": rc}
                    if rc == 0:
                        row.update(json.loads(Path(res_path).read_text()))
                        for mode in ("quick", "live"):
                            row[mode]["over_real"] = row[mode]["start_Bps"] / row["real_Bps"]
                    rows.append(row)
                    print(f"   probe {prof} {ver}: "
                          + (", ".join(f"{mode} {row[mode]['start_Bps'] * 8 / 1e6:.2f} Mbit/s in "
                                       f"{row[mode]['start_s']:.1f} s "
                                       f"({row[mode]['over_real']:.2f}x)" for mode in ("quick", "live"))
                             + f", real {row['real_Bps'] * 8 / 1e6:.2f} Mbit/s"
                             if rc == 0 else f"exit {rc}"),
                          file=sys.stderr, flush=True)
    return rows


_START = re.compile(r"auto: probe (.+?), alpha")


def _records(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        return [json.loads(x) for x in fh if x.strip()]


def _summary(recs: list[dict], measure_steps: int, interval: int) -> dict:
    steps = [r for r in recs if "step" in r and "event" not in r]
    r0 = {r["step"]: r for r in steps if r["rank"] == 0}
    last = max(r0)
    samples = sum(r["samples"] for r in steps if 2 <= r["step"] <= last)
    out = {"steps": last, "samples_per_s": samples / (r0[last]["time"] - r0[1]["time"]),
           "sequence": [(r["step"], r["switch"]["to"]) for r in sorted(r0.values(),
                                                                    key=lambda r: r["step"])
                        if r.get("switch")]}
    first, end = measure_steps + 1, measure_steps + interval
    per_step = {}
    for r in steps:
        if first <= r["step"] <= end:
            per_step[r["step"]] = max(per_step.get(r["step"], 0.0), r.get("comm_s", 0.0))
    out["first_window_exposed_s"] = sum(per_step.values())
    out["first_sync_exposed_s"] = max(per_step.values(), default=0.0)
    out["exposed_share"] = (sum(r["comm_s"] for r in r0.values() if r["step"] >= 2)
                            / sum(r["step_s"] for r in r0.values() if r["step"] >= 2))
    return out


def train_part(args, versions: dict, tmp: str) -> list[dict]:
    from lorasync.emulate.launch import emulated, launch_on_cluster
    from lorasync.emulate.spec import ClusterSpec

    if args.model == "smollm2-135m":
        from lorasync.train.model import ensure_embedded
        ensure_embedded(log=lambda m: print(m, file=sys.stderr))
    rate, delay = _profile(args.train_profile)
    runs = [("ceiling", "after", ["--comm", "none"])] + [
        (f"auto-{ver}", ver, ["--comm", "auto"]) for ver in versions]
    rows = []
    spec = ClusterSpec(nodes=2, rate_bps=rate, delay_s=delay, name=f"llt{os.getpid() % 100000}")
    with emulated(spec) as cluster:
        for rnd in range(args.rounds):
            for label, ver, comm in runs:
                if label == "ceiling" and rnd and not args.ceiling_every_round:
                    continue
                run = os.path.join(tmp, f"{label}-{rnd + 1}")
                logs = run + "-logs"
                argv = ["train", "--model", args.model, "--max-steps", str(args.steps),
                        "--batch-size", str(args.batch_size), "--eval-size", "0",
                        "--no-eval-before", "--ckpt-interval", "0", "--no-progress", *comm,
                        "--output-dir", run]
                t0 = time.time()
                rc = launch_on_cluster(cluster, argv, timeout=args.run_timeout,
                                       env=_env(versions[ver]), log_dir=logs)
                row = {"label": label, "version": ver, "round": rnd + 1, "rc": rc,
                       "wall_s": time.time() - t0, "profile": f"{rate}/{delay}"}
                if rc == 0:
                    try:
                        row.update(_summary(_records(run), args.measure_steps, args.interval))
                    except (OSError, ValueError, KeyError) as e:   # keep the other runs
                        row.update(rc=f"summary failed: {e!r}")
                        rows.append(row)
                        continue
                    log = Path(logs, "node0.log").read_text(errors="replace")
                    m = _START.search(log)
                    row["start_figure"] = m.group(1) if m else None
                    row["auto_log"] = [x for x in log.splitlines() if x.startswith("auto:")][:8]
                rows.append(row)
                print(f"   train {label} round {rnd + 1}: "
                      + (f"{row['samples_per_s']:.2f} samples/s, start {row.get('start_figure')}, "
                         f"first sync exposed {row['first_sync_exposed_s']:.2f} s, "
                         f"{row['sequence']}" if rc == 0 else f"exit {rc}, logs {logs}"),
                      file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="probe,train", help="probe, train or both")
    ap.add_argument("--before", default="fde491a",
                    help="git revision whose src is 'before' (default: the commit before the change)")
    ap.add_argument("--profiles", default="10mbit/50ms,100mbit/50ms,10mbit/0ms",
                    help="RATE/ONE-WAY-DELAY profiles of the probe part")
    ap.add_argument("--ref-seconds", type=float, default=2.5,
                    help="the real-rate all-reduce lasts about this long at the configured rate")
    ap.add_argument("--train-profile", default="10mbit/50ms")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ceiling-every-round", action="store_true")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--measure-steps", type=int, default=4, help="auto's (its default)")
    ap.add_argument("--interval", type=int, default=10, help="auto's (its default)")
    ap.add_argument("--run-timeout", type=float, default=600)
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("long_link: the emulated cluster needs root (network namespaces, tc, TUN)")

    import signal

    def _stop(signum, _frame):  # unwind, so the emulated clusters are taken down
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    t_start = time.time()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="long_link-") as tmp:
        before_dir = os.path.join(tmp, "before")
        os.makedirs(before_dir)
        versions = {"before": _extract(args.before, before_dir), "after": str(ROOT / "src")}
        out = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"),
               "cores": os.cpu_count()}
        if "probe" in parts:
            out["probe"] = probe_part(args, versions, tmp)
        if "train" in parts:
            out["train"] = train_part(args, versions, tmp)
    out["load_before"], out["load_after"] = load_before, os.getloadavg()
    out["wall_min"] = (time.time() - t_start) / 60
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    sys.path.insert(0, str(ROOT / "bench"))
    from tables import long_link_text
    print(long_link_text(out))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
