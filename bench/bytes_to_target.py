#!/usr/bin/env python3
"""Bytes to target: bytes each node sends until the target eval loss, as a ratio to fp32 DDP's.

    flock /work/bench.lock .venv/bin/python bench/bytes_to_target.py [--model smollm2-135m]
        [--steps 32] [--max-steps 48] [--candidates fp32,int8,int4,int4@0.03,int2@0.01,auto]
        [--refs FILE] [--json FILE]

A compressed sync is worth its bytes only if it still reaches the loss exact
sync reaches: fewer bytes per step that need many more steps save nothing.
Bytes do not depend on the link, so everything trains over loopback (no
namespaces, no root): ``--nodes`` ranks of ``lorasync train --nproc``, one a
node.

1. The target (bench/time_to_quality.py's rule, its functions imported):
   fp32 all-reduce (``--comm allreduce``, lorasync's DDP hook) trains
   ``--steps`` steps of a ``--max-steps`` cosine schedule; seed 0's eval loss
   there is the target, and the bytes its ranks handed to collectives up to
   the evaluation where it first got there are fp32 DDP's bytes to target.
   Two more seeds give the quality rule: a candidate's eval loss after
   ``--steps`` steps at most the worst of the three + 5%.
2. Every candidate trains with the same schedule, seed and data order,
   evaluated every ``--eval-interval`` steps, until its eval loss reaches
   the target (and at least ``--steps`` steps, for the quality rule) or
   ``--max-steps``.  Its bytes to target: the most any rank handed to
   collectives (``wire_bytes`` of its metrics, the counted Wire) up to the
   first evaluation at or under the target.  With 2 nodes these payload
   bytes are also what crosses the link (a ring all-reduce and an
   all-gather of 2 ranks send each rank's payload once).

Candidates: ``DTYPE[@TOPK][/BLOCK]`` is DiLoCo (``--period``, default 8,
outer step every 8 inner steps) with its outer delta in ``delta_dtype``
DTYPE, ``delta_topk`` TOPK and ``delta_block`` BLOCK: ``int2@0.01`` is the
SparseLoCo-style outer sync (1% of each tensor's delta entries, 2-bit values,
error feedback).  DiLoCo rows are not streamed and the evaluation interval is
a multiple of the period, so an evaluation sees replicas an outer step has
just made identical: the model evaluated is the one the bytes counted paid
for, with no final average owed.  ``auto`` is ``--comm auto``; it chooses for
the link it measures (here loopback, where time, not bytes, binds), and where
it ends on a periodic sync one fp32 average of the adapter (the final
average it would owe) is added to its bytes.

Result: a table and a small JSON (``--json``; bench/reference/bytes/ keeps
one, docs/bytes.md's table is generated from it by bench/tables.py).  The
issue's target: >= 500x fewer bytes than fp32 DDP with the quality rule met
(anchors: DiLoCo 500x in pre-training, Covenant-72B 146x, Fed-SB 230x for
LoRA, CocktailSGD 117x in fine-tuning).  ``--refs FILE`` takes the target
and the references from an earlier run's JSON (same flags; its
``--eval-interval`` or a multiple of it), and keeps its candidates that are
not run again, so the candidates can run in a second session and the JSON
holds them all.  A longer DiLoCo period than ``--period`` is a candidate
option (``int2:period=16``); it must divide ``--eval-interval``.  Run it under ``flock
/work/bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import time_to_quality as ttq  # noqa: E402
from tables import bytes_to_target as table  # noqa: E402  (the docs' table, one renderer)

from lorasync.monitor.metrics import read_jsonl_records  # noqa: E402

DEFAULT_CANDIDATES = "fp32,int8,int4,int4@0.03,int2@0.1,int2@0.03,int2@0.01,auto"
#: the issue's target and the published anchors (x fewer bytes than fp32 DDP)
TARGET_RATIO = 500.0
ANCHORS = {"DiLoCo (pre-training)": 500, "Fed-SB (LoRA)": 230, "Covenant-72B": 146,
           "CocktailSGD (fine-tuning)": 117}


def parse_candidate(text: str, period: int) -> tuple[str, list[str], dict]:
    """``DTYPE[@TOPK][/BLOCK][:OPTION=VALUE...]`` or ``auto`` -> (label, train
    args, options); ``:outer_momentum=0`` e.g. drops DiLoCo's outer momentum
    (SparseLoCo's error feedback takes its place)."""
    if text == "auto":
        return "auto", ["--comm", "auto", "--comm-opt", "batch_size=4"], {}
    head, *extra = text.split(":")
    head, _, block = head.partition("/")
    dtype, at, ratio = head.partition("@")
    opts: dict = {"period": period, "delta_dtype": dtype}
    if at:
        opts["delta_topk"] = float(ratio)
    if block:
        opts["delta_block"] = int(block)
    for kv in extra:
        k, eq, v = kv.partition("=")
        if not eq:
            raise ValueError(f"{kv!r}: write OPTION=VALUE")
        opts[k] = int(v) if v.isdigit() else float(v) if v.replace(".", "", 1).isdigit() else v
    from lorasync import catalog
    parsed = catalog.parse_options("diloco", opts)   # a bad candidate fails here, not in a run
    opts = {k: getattr(parsed, k) for k in opts}
    label = (f"DiLoCo {dtype}" + (f", top {100 * float(ratio):g}%" if at else "")
             + (f", blocks of {block}" if block else "") + f", every {opts['period']} steps"
             + "".join(f", {k}={v:g}" if isinstance(v, float) else f", {k}={v}"
                       for k, v in opts.items()
                       if k not in ("period", "delta_dtype", "delta_topk", "delta_block")))
    if dtype == "int2" and at:
        label += " (SparseLoCo-style)"
    args = ["--comm", "diloco"] + [x for k, v in opts.items() for x in ("--comm-opt", f"{k}={v}")]
    return label, args, opts


def rank_records(run_dir: str, world: int) -> list[dict[int, dict]]:
    """Per rank, its step records by step (the latest of a step run twice)."""
    return [{r["step"]: r for r in read_jsonl_records(os.path.join(run_dir, "ranks",
                                                                   f"rank{i}.jsonl"))
             if "event" not in r} for i in range(world)]


def bytes_upto(per: list[dict[int, dict]], step: int) -> int:
    """The most bytes any rank handed to collectives in steps 1..step."""
    return max(sum(int(r.get("wire_bytes") or 0) for s, r in p.items() if s <= step)
               for p in per)


def train(args: list[str], run_dir: str, a, stop) -> tuple[str, float]:
    """Run ``lorasync train`` over loopback until it ends or ``stop(steps,
    evals)`` names a reason (then its process group, which this started, gets
    SIGTERM)."""
    cmd = [sys.executable, "-m", "lorasync", "train", *ttq.common_args(a), "--nproc",
           str(a.nodes), *args, "--output-dir", run_dir]
    t0 = time.time()
    log = open(run_dir + ".log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    why = None
    try:
        while p.poll() is None:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
            if why is None and p.poll() is None:
                why = stop(*ttq.read_progress(run_dir, a.nodes))
                if why:
                    os.killpg(p.pid, signal.SIGTERM)
            if time.time() - t0 > a.row_timeout:
                why = why or f"timed out after {a.row_timeout:.0f} s"
                os.killpg(p.pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.close()
    status = f"stopped: {why}" if why else "ok" if p.returncode == 0 else \
        f"failed (exit {p.returncode}), see {run_dir}.log"
    return status, time.time() - t0


def run_references(a, out: str) -> dict:
    refs = []
    for seed in range(a.seeds):
        print(f"reference: allreduce seed {seed}, {a.steps} of {a.max_steps} steps ...",
              file=sys.stderr, flush=True)
        r = ttq.run_reference(seed, a, out)
        refs.append(r)
        print(f"   {r.status} ({r.extra['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    losses = [ttq.eval_at(r.evals, a.steps) for r in refs]
    if losses[0] is None:
        raise SystemExit(f"reference seed 0 has no eval at step {a.steps}: {refs[0].status}")
    target = losses[0]
    reach = ttq.first_reach(refs[0].evals, target)
    per = rank_records(os.path.join(out, refs[0].key), a.nodes)
    return {"target": target, "quality_limit": max(x for x in losses if x is not None) * 1.05,
            "reference": [{"seed": i, "eval_at_steps": x, "status": r.status,
                           "wall_s": r.extra["wall_s"]}
                          for i, (r, x) in enumerate(zip(refs, losses))],
            "ddp_reached_step": reach["step"], "eval_interval": a.eval_interval,
            "ddp_bytes_to_target": bytes_upto(per, reach["step"]),
            "ddp_bytes_per_step": bytes_upto(per, 1),
            "fp32_bytes_per_step": max(int(p[1].get("fp32_bytes") or 0) for p in per)}


def run_candidate(key: str, a, out: str, ref: dict) -> dict:
    label, args, opts = parse_candidate(key, a.period)
    run_dir = os.path.join(out, "cand-" + key.replace("@", "_top").replace("/", "_b")
                           .replace(":", "_").replace("=", ""))
    target = ref["target"]

    def stop(steps, evals):
        hit = ttq.first_reach(evals, target)
        if hit and any(e["step"] >= a.steps for e in evals):
            return f"reached the target at step {hit['step']}"
        return None

    print(f"   {label} ...", file=sys.stderr, flush=True)
    status, wall = train([*args, "--seed", "0"], run_dir, a, stop)
    steps, evals = ttq.read_progress(run_dir, a.nodes)
    per = rank_records(run_dir, a.nodes)
    hit = ttq.first_reach(evals, target)
    at = ttq.eval_at(evals, a.steps)
    cell = {"key": key, "label": label, "options": opts, "status": status, "wall_s": wall,
            "eval_interval": a.eval_interval,
            "steps_run": len(steps), "eval_at_steps": at,
            "quality": None if at is None else at <= ref["quality_limit"],
            "final_strategy": steps[-1]["strategy"] if steps else None,
            "evals": [[e["step"], e["eval_loss"]] for e in sorted(evals, key=lambda e: e["step"])
                      if e.get("eval_loss") is not None],
            "bytes_per_step": (bytes_upto(per, steps[-1]["step"]) / len(steps)
                               if steps else None)}
    if hit:
        b = bytes_upto(per, hit["step"])
        closing = 0
        strat = str(per[0].get(hit["step"], {}).get("strategy", ""))
        if key == "auto" and ("diloco" in strat or "local" in strat):
            closing = ref["fp32_bytes_per_step"]   # the fp32 average a periodic sync owes
        cell.update(reached_step=hit["step"], strategy_at_target=strat,
                    closing_bytes=closing, bytes_to_target=b + closing,
                    ratio=ref["ddp_bytes_to_target"] / (b + closing) if b + closing else None)
    else:
        done = steps[-1]["step"] if steps else 0
        cell.update(reached_step=None, bytes_to_target=None, ratio=None,
                    bytes_spent=bytes_upto(per, done) if steps else 0)
    print(f"   {label}: {status}; reached {cell['reached_step']}, ratio "
          f"{cell['ratio'] if cell['ratio'] is None else round(cell['ratio'], 1)}, "
          f"quality {cell['quality']} ({wall:.0f} s)", file=sys.stderr, flush=True)
    return cell


def verdict(res: dict) -> str:
    ok = [c for c in res["cells"] if c["ratio"] and c["quality"]]
    anchors = ", ".join(f"{k} {v}x" for k, v in ANCHORS.items())
    if not ok:
        return (f"no candidate reached the target with the quality rule met; target >= "
                f"{TARGET_RATIO:.0f}x: NOT met (anchors: {anchors})")
    best = max(ok, key=lambda c: c["ratio"])
    return (f"best ratio with the quality rule met: {best['ratio']:.0f}x fewer bytes than "
            f"fp32 DDP ({best['label']}); target >= {TARGET_RATIO:.0f}x: "
            f"{'met' if best['ratio'] >= TARGET_RATIO else 'NOT met'} (anchors: {anchors})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32,
                    help="the reference's steps: its eval loss there is the target")
    ap.add_argument("--max-steps", type=int, default=48,
                    help="every run's schedule length and a candidate's cap in steps")
    ap.add_argument("--period", type=int, default=8, help="DiLoCo's inner steps per outer step")
    ap.add_argument("--eval-interval", type=int, default=8)
    ap.add_argument("--eval-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3, help="reference seeds (quality rule)")
    ap.add_argument("--candidates", default=DEFAULT_CANDIDATES,
                    help="DTYPE[@TOPK][/BLOCK][:OPTION=VALUE] (DiLoCo) or auto, "
                         "comma-separated")
    ap.add_argument("--refs", metavar="FILE",
                    help="take the target and references from this earlier JSON")
    ap.add_argument("--row-timeout", type=float, default=900.0)
    ap.add_argument("--output-dir", default="")
    ap.add_argument("--json", metavar="FILE", help="write the small result JSON here")
    a = ap.parse_args()
    a.eval_replicas = "mean"   # ttq.common_args: evaluate the mean of the ranks' adapters
    if a.steps % a.eval_interval or a.eval_interval % a.period:
        raise SystemExit(f"--steps ({a.steps}) must be a multiple of --eval-interval "
                         f"({a.eval_interval}), and that of --period ({a.period}): the target "
                         "is an evaluation, and DiLoCo is evaluated right after an outer step")
    if a.max_steps < a.steps:
        raise SystemExit("--max-steps must be at least --steps")
    keys = [k.strip() for k in a.candidates.split(",") if k.strip()]
    for k in keys:
        try:
            _, _, opts = parse_candidate(k, a.period)
        except ValueError as e:
            raise SystemExit(f"--candidates: {k!r}: {e}") from None
        if opts.get("period") and a.eval_interval % opts["period"]:
            raise SystemExit(f"--candidates: {k!r}: its period ({opts['period']}) must divide "
                             f"--eval-interval ({a.eval_interval}): DiLoCo is evaluated right "
                             "after an outer step")
    out = os.path.abspath(a.output_dir or os.path.join(
        "bench", "results", "bytes-" + time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    if a.model == "smollm2-135m":
        from lorasync.train.model import ensure_embedded
        ensure_embedded(log=lambda m: print(m, file=sys.stderr))
    t0 = time.time()
    if a.refs:
        with open(a.refs) as fh:
            old = json.load(fh)
        same = ("model", "nodes", "steps", "max_steps", "eval_size", "batch_size", "seeds")
        diff = [k for k in same if old["args"].get(k) != getattr(a, k)]
        # a coarser evaluation grid than the references' may use them: the target
        # (their eval at --steps) is on both grids, and fp32 DDP's step to target,
        # found on the finer grid, can only be earlier (its bytes fewer, the
        # candidates' ratios lower) than the coarser grid would find it
        # (the references' own grid: a file whose last session ran on a coarser
        # one still holds references evaluated on theirs)
        oi = old["references"].get("eval_interval") or old["args"].get("eval_interval")
        if not oi or a.eval_interval % oi:
            diff.append("eval_interval (give a multiple of theirs)")
        if diff:
            raise SystemExit(f"--refs {a.refs}: made with other {', '.join(diff)}")
        ref = old["references"]
        # an earlier session's candidates stay, unless run again now
        kept = [c for c in old.get("cells", []) if c["key"] not in keys]
    else:
        ref, kept = run_references(a, out), []
    print(f"target: eval loss {ref['target']:.4f} (seed 0 at step {a.steps}); quality limit "
          f"{ref['quality_limit']:.4f}; fp32 DDP: {ref['ddp_bytes_to_target'] / 1e6:.2f} MB "
          f"to step {ref['ddp_reached_step']}", file=sys.stderr, flush=True)
    cells = kept + [run_candidate(k, a, out, ref) for k in keys]
    res = {"args": {k: v for k, v in vars(a).items() if k not in ("json", "output_dir")},
           "references": ref, "cells": cells, "target_ratio": TARGET_RATIO, "anchors": ANCHORS,
           "date": time.strftime("%Y-%m-%d %H:%M"), "wall_min": (time.time() - t0) / 60}
    res["verdict"] = verdict(res)
    text = (f"bytes to target: {a.nodes} ranks over loopback, {a.model}, batch {a.batch_size} "
            f"per rank, schedule {a.max_steps} steps, target = fp32 all-reduce's eval loss at "
            f"step {a.steps} ({ref['target']:.4f}; quality limit {ref['quality_limit']:.4f} = "
            f"worst of {len(ref['reference'])} seeds + 5%)\n\n{table(res)}\n")
    print(text)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(text)
    for path in (os.path.join(out, "results.json"), a.json):
        if path:
            with open(path, "w") as fh:
                json.dump(res, fh, indent=1)
    print(f"results: {out}/results.md, results.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
