#!/usr/bin/env python3
"""Every sync strategy on the embedded default: speed, bytes and quality.

    .venv/bin/python bench/strategies.py [--steps 60] [--seeds 3] [--emulate nodes=2,rate=10mbit]
        [--strategies fp16,diloco:delta_dtype=int4:fragments=4:streaming=true]

Runs ``lorasync train`` once per strategy (seed 0; ``NAME:KEY=VALUE:...``
runs it with those options) and the ``allreduce`` reference once per seed, all with the same data, steps and batch (so the same
number of samples), then prints one table: samples/s, exposed sync share,
wire MB per step, compression ratio, encode+decode time per step (and its
share of the compute step; target <= 5%), final eval loss and exact-match
with the eval-set size and standard error.

Quality rule: a strategy passes when its eval loss is no worse than the worst
of the allreduce seeds plus 5%.  Single runs and small eval sets cannot
separate strategies finely (two lossless-equivalent runs differed by 7% in
eval loss here); the seed spread printed above the table says how much.

Without ``--emulate`` ranks talk over loopback: quality and bytes are what
matter there; speed differences need a slow link (``--emulate``, root).

A strategy may carry options: ``NAME:KEY=VALUE:KEY=VALUE`` (each becomes a
``--comm-opt``); the row is labelled with the whole entry.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

STRATEGIES = ["fp16", "bf16", "int8", "onebit", "topk", "powersgd", "local", "diloco"]


def split_entry(entry: str) -> tuple[str, list[str]]:
    """``"diloco:delta_dtype=int4:fragments=4"`` -> ``("diloco", ["--comm-opt", ...])``."""
    name, *opts = entry.split(":")
    for o in opts:
        if "=" not in o:
            raise SystemExit(f"--strategies: {entry!r}: options are KEY=VALUE, got {o!r}")
    return name, [x for o in opts for x in ("--comm-opt", o)]


def train(out: str, entry: str, seed: int, a) -> dict:
    strategy, opts = split_entry(entry)
    cmd = [sys.executable, "-m", "lorasync", "train", "--comm", strategy, *opts, "--seed", str(seed),
           "--max-steps", str(a.steps), "--eval-size", str(a.eval_size), "--no-progress",
           "--ckpt-interval", "0", "--no-eval-before", "--output-dir", out, *a.extra]
    if a.emulate:
        cmd += ["--emulate", a.emulate]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"}
    with open(os.path.join(out, "summary.json")) as fh:
        s = json.load(fh)
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        recs = [json.loads(x) for x in fh]
    r0 = [r for r in recs if r["rank"] == 0 and r["step"] > 1]
    s["encode_s"] = statistics.fmean(r["encode_s"] for r in r0) if r0 else 0.0
    s["wall_s"] = time.time() - t0
    return s


def se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3, help="allreduce reference seeds")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--eval-size", type=int, default=48)
    ap.add_argument("--emulate", default="", help="run on an emulated cluster (root)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("extra", nargs="*", help="more `lorasync train` flags (after --)")
    a = ap.parse_args()
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as work:
        for seed in range(a.seeds):
            key = f"allreduce (seed {seed})"
            res[key] = train(os.path.join(work, f"ref{seed}"), "allreduce", seed, a)
            print(f"{key}: {res[key].get('error') or 'done'}", file=sys.stderr, flush=True)
        for name in [s.strip() for s in a.strategies.split(",") if s.strip()]:
            res[name] = train(os.path.join(work, name.replace(":", "_").replace("=", "-")),
                              name, 0, a)
            print(f"{name}: {res[name].get('error') or 'done'}", file=sys.stderr, flush=True)
    refs = [v["eval_after"]["eval_loss"] for k, v in res.items()
            if k.startswith("allreduce") and "error" not in v and v.get("eval_after")]
    limit = max(refs) * 1.05 if refs else None
    ok_runs = [v for v in res.values() if "error" not in v]
    load = os.getloadavg()[0]
    print(f"\nlorasync strategies, embedded default, {a.steps} steps x "
          f"{ok_runs[0]['world_size'] if ok_runs else '?'} ranks, link: "
          f"{a.emulate or 'loopback'}; load average at the end {load:.1f}")
    if refs:
        print(f"allreduce eval loss over {len(refs)} seeds: {min(refs):.4f} .. {max(refs):.4f}; "
              f"quality limit (worst + 5%): {limit:.4f}")
    print("\n| strategy | samples/s | exposed sync | wire MB/step | compression | "
          "encode+decode ms/step (% of compute) | eval loss | exact-match (n, SE) | quality |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, v in res.items():
        if "error" in v:
            print(f"| {k} | failed: {v['error']} | | | | | | | |")
            continue
        ea = v.get("eval_after") or {}
        n = ea.get("n") or 0
        p = (ea.get("correct", 0) / n) if n else float("nan")
        comp = v["fp32_bytes_per_step"] / v["wire_bytes_per_step"] if v["wire_bytes_per_step"] \
            else float("inf")
        enc_share = v["encode_s"] / v["compute_s_mean"] if v["compute_s_mean"] else 0
        verdict = "-" if limit is None or "eval_loss" not in ea else (
            "pass" if ea["eval_loss"] <= limit else "FAIL")
        print(f"| {k} | {v['samples_per_s']:.2f} | {100 * v['sync_share']:.1f}% | "
              f"{v['wire_bytes_per_step'] / 1e6:.3f} | {comp:.1f}x | "
              f"{1000 * v['encode_s']:.1f} ({100 * enc_share:.1f}%) | "
              f"{ea.get('eval_loss', float('nan')):.4f} | {100 * p:.0f}% (n={n}, "
              f"+-{100 * se(p, n):.0f}) | {verdict} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": {"steps": a.steps, "seeds": a.seeds, "eval_size": a.eval_size,
                                "emulate": a.emulate, "extra": a.extra},
                       "load_average": load, "limit": limit, "runs": res}, fh, indent=1)


if __name__ == "__main__":
    main()
