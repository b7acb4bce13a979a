#!/usr/bin/env python3
"""Clean exits, measured: a transformers Trainer script with
``lorasync.hf.attach(trainer, S)`` run N times per strategy S under torchrun
(2 ranks, gloo on CPU, the tiny model), ending as users' scripts end (no
``destroy_process_group``); every run must exit 0 with no abort.

    .venv/bin/python bench/hf_exits.py [--runs 20] [--strategies allreduce,diloco-streaming] \\
        [--json bench/reference/hf/exits.json]

The script is ``tests/dist/_hf_clients.py``'s exit job (the one
``tests/dist/test_hf_exits.py`` runs once per strategy), 6 Trainer steps.
Strategies take turns (round-robin), so a change of the host's load falls on
all of them alike.  ``--src DIR`` runs another checkout's lorasync (e.g. one
without the exit guard, to see the aborts it fixes); ``--before DIR`` runs a
second checkout in the same rounds (each strategy: this one, then that one),
so that both see the same load.

The JSON: per strategy its spec, runs, exit codes, clean runs, and the
abort lines seen (``terminate called ...``, tracebacks, a rank that did not
reach the end); the host's CPU count and load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ROOT / "tests" / "dist" / "_hf_clients.py"
sys.path.insert(0, str(CLIENTS.parent))
from _hf_clients import EXIT_STRATEGIES, exit_clean, exit_spec  # noqa: E402


def run_once(name: str, strategy: str, src: Path, dump: Path, timeout: float):
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(CLIENTS), "exit", str(dump), exit_spec(name, strategy)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace")
    wall = time.perf_counter() - t0
    bad = exit_clean(rc if isinstance(rc, int) else -1, out)
    if rc == "timeout":
        bad.insert(0, f"timed out after {timeout:g} s")
    return rc, bad, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="runs per strategy (default 20)")
    ap.add_argument("--strategies", default="",
                    help="comma-separated ids of " + ", ".join(n for n, _ in EXIT_STRATEGIES)
                    + " (default: all)")
    ap.add_argument("--src", type=Path, default=ROOT / "src",
                    help="the lorasync source tree to run (default: this checkout's src)")
    ap.add_argument("--before", type=Path, default=None,
                    help="a second source tree run in the same rounds (e.g. a checkout without "
                    "the exit guard); its results go under 'before' in the JSON")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "hf_exits.json")
    a = ap.parse_args(argv)
    known = dict(EXIT_STRATEGIES)
    chosen = [s for s in a.strategies.split(",") if s] or list(known)
    unknown = [s for s in chosen if s not in known]
    if unknown:
        ap.error(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if a.runs < 1:
        ap.error("--runs: use 1 or more")
    import torch

    def fresh():
        return {name: {"spec": exit_spec(name, known[name]), "runs": 0, "exit_codes": [],
                       "clean": 0, "abort_lines": [], "wall_s": []} for name in chosen}

    res = fresh()
    trees = [("", a.src, res)]
    if a.before is not None:
        trees.append(("before ", a.before, fresh()))
    out = {"command": "bench/hf_exits.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "runs_per_strategy": a.runs, "ranks": 2, "torch": torch.__version__,
           "src": str(a.src.resolve()), "cpus": os.cpu_count(),
           "load_before": os.getloadavg()[0], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "strategies": res}
    if a.before is not None:
        out["before"] = {"src": str(a.before.resolve()), "strategies": trees[1][2]}
    dump = Path(os.environ.get("TMPDIR", "/tmp")) / f"hf_exits-{os.getpid()}"
    a.json.parent.mkdir(parents=True, exist_ok=True)
    for i in range(a.runs):
        for name in chosen:
            for label, src, results in trees:
                rc, bad, wall = run_once(name, known[name], src, dump / name, a.timeout)
                r = results[name]
                r["runs"] += 1
                r["exit_codes"].append(rc)
                r["clean"] += not bad
                r["wall_s"].append(round(wall, 1))
                r["abort_lines"] += [f"run {i + 1}: {line}" for line in bad[:4]]
                print(f"run {i + 1}/{a.runs} {label}{name}: exit {rc} ({wall:.1f} s)"
                      + (f" NOT CLEAN: {bad[0]}" if bad else ""), flush=True)
        # what has run so far, so that a cut-short invocation still says it
        out["load_after"] = os.getloadavg()[0]
        out["total"] = {"runs": sum(r["runs"] for r in res.values()),
                        "clean": sum(r["clean"] for r in res.values())}
        if a.before is not None:
            b = trees[1][2]
            out["before"]["total"] = {"runs": sum(r["runs"] for r in b.values()),
                                      "clean": sum(r["clean"] for r in b.values())}
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    for label, src, results in trees:
        print()
        print(f"{src}:")
        print(f"{'strategy':<18} {'runs':>5} {'clean':>6}  exit codes")
        for name, r in results.items():
            codes = ", ".join(f"{c}x{r['exit_codes'].count(c)}"
                              for c in sorted(set(r["exit_codes"]), key=str))
            print(f"{name:<18} {r['runs']:>5} {r['clean']:>6}  {codes}")
        t = {"runs": sum(r["runs"] for r in results.values()),
             "clean": sum(r["clean"] for r in results.values())}
        print(f"{'all':<18} {t['runs']:>5} {t['clean']:>6}")
    t = out["total"]
    return 0 if t["clean"] == t["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
