#!/usr/bin/env python3
"""``--comm auto`` against fixed strategies when the link changes mid-run.

    sudo .venv/bin/python bench/auto_adapt.py                    # defaults below
    sudo .venv/bin/python bench/auto_adapt.py --steps 80 --cut-at 30 \\
        --fixed fp16,topk,onebit,powersgd,diloco:streaming=true:delta_dtype=fp16

An emulated 2-node cluster (network namespaces, htb-shaped veth links) starts
at ``--rate`` (100mbit); every run is ``lorasync train`` on the embedded
default model (SmolLM2-135M + LoRA r=8, demo task), and once a run's rank 0
has written step ``--cut-at`` the bench cuts the link to ``--cut-rate``
(10mbit) with ``Cluster.set_rate`` (the same ``tc class change`` an operator
would do; connections stay open), then restores it before the next run.
The same schedule is run for ``auto`` and for each fixed strategy, one after
the other in this invocation, so the ratios compare like with like.

Throughput of a step range = samples of both ranks / wall time between the
end of the step before the range and the end of its last step (rank 0's
record times: everything the job spent, probes and switches included).
Efficiency of a range = sum of compute_s / sum of step_s (rank 0's records):
the share of the step spent computing, which a shared host's load changes
far less than samples/s (that load came and went by 2x between runs here);
the ratios are printed for both.  ``--rounds N`` runs every configuration N
times, alternating, and keeps each one's best figure per range.

Printed:

* before the cut (steps 2..cut): auto vs the best fixed strategy at that
  rate (target: within 5%);
* after the cut, steady (steps cut+21..end): auto vs the best fixed on the
  new link (target: within 5%);
* adaptation (steps cut+1..cut+50, or to the end): auto's throughput on the
  new link, detection and switch included, vs the best fixed strategy's over
  the same steps (target: >= 80%);
* every run's strategy sequence (auto's switches with their step).

Needs root (namespaces, tc).  The machine is shared: the load average before
and after is printed; compare ratios measured in the same invocation only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _records(run: str) -> list[dict]:
    path = Path(run) / "ranks" / "rank0.jsonl"
    try:
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []
    return [r for r in recs if "event" not in r]   # step records, not start/end events


def run_one(cluster, label: str, comm: list[str], args, out: str) -> dict:
    from lorasync.emulate.launch import launch_on_cluster

    label = label.replace(":", "_").replace("=", "-")   # a plain directory name
    run = os.path.join(out, label)
    argv = ["train", "--model", args.model, "--max-steps", str(args.steps), "--batch-size",
            str(args.batch_size), "--eval-size", "0", "--no-eval-before", "--ckpt-interval", "0",
            "--no-progress", "--bucket-mb", str(args.bucket_mb), *comm, "--output-dir", run]
    cluster.set_rate(args.rate)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("rc", launch_on_cluster(
        cluster, argv, timeout=args.run_timeout, log_dir=os.path.join(out, f"{label}-logs"))))
    t0 = time.time()
    t.start()
    cut = None
    while t.is_alive():
        if cut is None:
            recs = _records(run)
            if recs and recs[-1]["step"] >= args.cut_at:
                cluster.set_rate(args.cut_rate)
                cut = recs[-1]["step"]
                print(f"   {label}: link cut to {args.cut_rate} after step {cut}",
                      file=sys.stderr, flush=True)
        time.sleep(0.05)
    t.join()
    cluster.set_rate(args.rate)
    rc = box.get("rc")
    res = {"label": label, "comm": comm, "rc": rc, "cut_after": cut, "wall_s": time.time() - t0}
    if rc != 0:
        res["error"] = f"exit {rc}; see {label}-logs"
        return res
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        recs = [json.loads(x) for x in fh]
    res["records"] = recs
    return res


def throughput(recs: list[dict], first: int, last: int) -> float | None:
    """Samples/s of steps first..last: both ranks' samples over rank 0's wall time."""
    r0 = {r["step"]: r for r in recs if r["rank"] == 0}
    if first - 1 not in r0 or last not in r0:
        return None
    samples = sum(r["samples"] for r in recs if first <= r["step"] <= last)
    return samples / (r0[last]["time"] - r0[first - 1]["time"])


def efficiency(recs: list[dict], first: int, last: int) -> float | None:
    """Share of steps first..last spent computing (rank 0)."""
    r0 = [r for r in recs if r["rank"] == 0 and first <= r["step"] <= last]
    if not r0:
        return None
    return sum(r["compute_s"] for r in r0) / sum(r["step_s"] for r in r0)


def sequence(recs: list[dict]) -> str:
    r0 = sorted((r for r in recs if r["rank"] == 0), key=lambda r: r["step"])
    if not r0:
        return "-"
    parts = [r0[0]["strategy"]]
    for r in r0:
        if r.get("switch"):
            parts.append(f"{r['switch']['to']}@{r['step']}")
    return " -> ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--cut-at", type=int, default=30, help="cut the link after this step")
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--cut-rate", default="10mbit")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times (alternating), keep the best")
    ap.add_argument("--fixed", default="fp16,topk,powersgd,diloco:streaming=true:delta_dtype=fp16",
                    help="fixed strategies to run against auto (comma-separated; options "
                         "after the name as :KEY=VALUE)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--auto-opt", action="append", default=[],
                    help="extra --comm-opt for the auto run, e.g. interval=10")
    ap.add_argument("--run-timeout", type=float, default=900)
    ap.add_argument("--output-dir", default="")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("auto_adapt: the emulated cluster needs root (network namespaces, tc)")
    if args.cut_at < 3 or args.steps <= args.cut_at + 5:
        sys.exit("auto_adapt: need 3 <= --cut-at and --steps > --cut-at + 5")

    import signal

    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import ClusterSpec

    def _stop(signum, _frame):  # unwind, so the emulated cluster is taken down
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)

    if args.model == "smollm2-135m":
        from lorasync.train.model import ensure_embedded
        ensure_embedded(log=lambda m: print(m, file=sys.stderr))
    out = os.path.abspath(args.output_dir or os.path.join(
        ROOT, "bench", "results", "auto_adapt-" + time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    runs = [("auto", ["--comm", "auto"] + [x for o in args.auto_opt for x in ("--comm-opt", o)])]
    for item in [s.strip() for s in args.fixed.split(",") if s.strip()]:
        name, *opts = item.split(":")
        runs.append((item, ["--comm", name] + [x for o in opts for x in ("--comm-opt", o)]))
    load_before = os.getloadavg()
    t_start = time.time()
    results = []
    spec = ClusterSpec(nodes=2, rate_bps=args.rate, name=f"aad{os.getpid() % 100000}")
    with emulated(spec) as cluster:
        for rnd in range(args.rounds):
            for label, comm in runs:
                print(f"== {label} ({' '.join(comm)}), round {rnd + 1}", file=sys.stderr,
                      flush=True)
                r = run_one(cluster, f"{label}-{rnd + 1}" if args.rounds > 1 else label, comm,
                            args, out)
                r["label"] = label
                results.append(r)
                print(f"   {label}: {r.get('error') or 'ok'} in {r['wall_s']:.0f} s",
                      file=sys.stderr, flush=True)
    load_after = os.getloadavg()

    c, end = args.cut_at, args.steps
    ranges = {"before": (2, c), "adapt": (c + 1, min(end, c + 50)),
              "steady": (min(end, c + 21), end)}
    rows = []
    for label, _ in runs:
        mine = [r for r in results if r["label"] == label]
        ok = [r for r in mine if "records" in r]
        row = {"label": label, "error": None if ok else mine[-1].get("error"),
               "cut_after": [r.get("cut_after") for r in mine]}
        if ok:
            for k, v in ranges.items():
                got = [throughput(r["records"], *v) for r in ok]
                eff = [efficiency(r["records"], *v) for r in ok]
                row[k] = max((g for g in got if g), default=None)
                row[k + "_eff"] = max((e for e in eff if e), default=None)
            row["sequence"] = " ; ".join(sequence(r["records"]) for r in ok)
        rows.append(row)
    fixed = [x for x in rows if x["label"] != "auto" and not x["error"]]
    auto = rows[0]

    def best(key):
        ok = [x for x in fixed if x.get(key)]
        return max(ok, key=lambda x: x[key]) if ok else None

    lines = [f"auto_adapt: 2 emulated nodes, {args.rate} -> {args.cut_rate} after step {c}, "
             f"{end} steps, model {args.model}, batch {args.batch_size}/rank, "
             f"bucket {args.bucket_mb} MB, {time.strftime('%Y-%m-%d %H:%M')}",
             f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
             f"({os.cpu_count()} cores); wall {(time.time() - t_start) / 60:.1f} min", "",
             "samples/s (efficiency = compute share of the step)", "",
             f"| run | strategies | {args.rate} (steps {ranges['before'][0]}-{ranges['before'][1]}) "
             f"| {args.cut_rate} adapt ({ranges['adapt'][0]}-{ranges['adapt'][1]}) "
             f"| {args.cut_rate} steady ({ranges['steady'][0]}-{ranges['steady'][1]}) |",
             "|---|---|---|---|---|"]

    def f(x, k):
        v, e = x.get(k), x.get(k + "_eff")
        return "-" if v is None else f"{v:.2f} ({e:.0%})"

    for x in rows:
        if x["error"]:
            lines.append(f"| {x['label']} | {x['error']} | | | |")
            continue
        lines.append(f"| {x['label']} | {x['sequence']} | {f(x, 'before')} | {f(x, 'adapt')} "
                     f"| {f(x, 'steady')} |")
    lines.append("")
    verdicts = {}
    for key, what, target in (("before", f"at {args.rate}", 0.95),
                              ("steady", f"at {args.cut_rate} (steady)", 0.95),
                              ("adapt", "on the new link within 50 steps of the cut", 0.80)):
        for metric, unit in ((key, "samples/s"), (key + "_eff", "efficiency")):
            b = best(metric)
            if b is None or not auto.get(metric):
                lines.append(f"{what} ({unit}): not measured")
                continue
            ratio = auto[metric] / b[metric]
            verdicts[metric] = ratio
            lines.append(f"auto {what}, {unit}: {auto[metric]:.2f} vs best fixed {b['label']} "
                         f"{b[metric]:.2f}: {ratio:.1%} (target >= {target:.0%}: "
                         f"{'met' if ratio >= target else 'NOT met'})")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"args": vars(args), "rows": rows, "ratios": verdicts,
                   "load_before": load_before, "load_after": load_after}, fh, indent=1)
    print(f"\nresults: {out}/results.md, results.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
