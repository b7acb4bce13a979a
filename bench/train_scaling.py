#!/usr/bin/env python3
"""Samples/s of the main job with 1 and 2 ranks, measured side by side.

    .venv/bin/python bench/train_scaling.py [--steps 20] [--model smollm2-135m]

Runs ``lorasync train`` on the embedded default with 1 worker (all cores) and
with 2 workers (cores shared: one thread each), same per-rank batch, and
prints samples/s, step time and the sync share from each run's summary.json.
Two ranks on two cores cannot beat one rank on two cores by much: the point
is the table's shape (and the sync share), not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(nproc: int, steps: int, model: str, workdir: str, extra: list[str]) -> dict:
    out = os.path.join(workdir, f"n{nproc}")
    cmd = [sys.executable, "-m", "lorasync", "train", "--model", model, "--nproc", str(nproc),
           "--max-steps", str(steps), "--eval-size", "0", "--ckpt-interval", "0",
           "--no-progress", "--output-dir", out,
           "--comm", "allreduce", *extra]   # a --comm in extra comes later and wins
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"run with {nproc} rank(s) failed:\n{p.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("extra", nargs="*", help="more `lorasync train` flags (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        res = {n: run(n, a.steps, a.model, work, a.extra) for n in (1, 2)}
    base = res[1]["samples_per_s"]
    print("| ranks | samples/s | vs 1 rank | step s (median) | sync share | wire MB/step |")
    print("|---|---|---|---|---|---|")
    for n, s in res.items():
        print(f"| {n} | {s['samples_per_s']:.2f} | {s['samples_per_s'] / base:.2f}x | "
              f"{s['step_s_median']:.3f} | {100 * s['sync_share']:.1f}% | "
              f"{s['wire_bytes_per_step'] / 1e6:.2f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({str(k): v for k, v in res.items()}, fh, indent=1)


if __name__ == "__main__":
    main()
