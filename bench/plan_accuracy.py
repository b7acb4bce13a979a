#!/usr/bin/env python3
"""Is the planner right?  Predicted vs measured step time, every strategy, three links.

    sudo .venv/bin/python bench/plan_accuracy.py [--profiles 10mbit,100mbit,1gbit] [--steps 9]

For each link profile an emulated 2-node cluster is brought up; a quick
``lorasync probe`` on it gives the network model (as ``--comm auto`` and
``lorasync plan --probe`` get it), the no-sync row gives the compute time,
and then every strategy trains ``--steps`` steps with its default options
(1 MB buckets, the trainer's default), except that onebit's full-precision
warm-up is cut to the one step left out anyway (``STEADY_OPTS``: the model
predicts the steady state).  The cost model's step time
(:func:`lorasync.plan.costmodel.predict`) is printed next to the measured
mean step time (the first step, DDP's warm-up, left out; periodic syncs
included).  Issue target: within 15% for every strategy on every link.

The ceiling runs first and last and the faster counts, as in ``lorasync
bench``.  Not a test: a busy machine moves the measured side; compare the
errors of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lorasync.bench.rows import Row, describe_net, predict_rows, probe_link, run_row
from lorasync.emulate.launch import emulated
from lorasync.emulate.spec import parse_emulate

#: options that make a short run show the steady state the cost model predicts
STEADY_OPTS = {"onebit": ["--comm-opt", "warmup_steps=1"]}
STRATEGIES = ["allreduce", "fp16", "bf16", "int8", "onebit", "topk", "powersgd", "local",
              "diloco"]


def table(prof: str, probe_text: str, rows: list, every: list) -> str:
    """The profile's markdown table; appends each strategy's verdict to ``every``."""
    lines = [f"\n### {prof} ({probe_text}; compute "
             f"{rows[0].extra.get('measured_step_s', 0):.2f} s/step)\n",
             "| strategy | measured s/step | predicted s/step | error | within 15% |",
             "|---|---|---|---|---|"]
    for row in rows[1:-1]:
        e = row.extra
        if "plan_error" not in e:
            lines.append(f"| {row.label} | {row.status} | | | |")
            every.append(False)
            continue
        ok = abs(e["plan_error"]) <= 0.15
        every.append(ok)
        lines.append(f"| {row.label} | {e['measured_step_s']:.3f} | "
                     f"{e['predicted_step_s']:.3f} | {100 * e['plan_error']:+.1f}% | "
                     f"{'yes' if ok else 'NO'} |")
    return "\n".join(lines)


def replan(a) -> int:
    """Predictions of the current cost model for an earlier run's measurements."""
    from lorasync.plan.net import net_from_probe

    report, every = [], []
    for prof in [p.strip() for p in a.profiles.split(",") if p.strip()]:
        pdir = os.path.join(a.replan, prof.replace("+", "_"))
        keys = ["ceiling", *[s.strip() for s in a.strategies.split(",") if s.strip()],
                "ceiling_end"]
        rows = []
        for k in keys:
            comm = "none" if k.startswith("ceiling") else k
            row = Row(k, k if comm != "none" else "no sync", ["--comm", comm])
            path = os.path.join(pdir, k, "summary.json")
            if os.path.isfile(path):
                with open(path) as fh:
                    row.summary = json.load(fh)
                row.status = "ok"
            else:
                row.status = "no summary.json"
            rows.append(row)
        with open(os.path.join(pdir, "probe.json")) as fh:
            net, _ = net_from_probe(json.load(fh))
        ceiling = max((r for r in rows if r.key.startswith("ceiling") and r.summary),
                      key=lambda r: r.summary["samples_per_s"])
        predict_rows(rows, net, ceiling.summary, a.model, a.batch_size)
        report.append(table(prof, describe_net(net), rows, every))
    print(f"plan accuracy, replanned from the measurements in {a.replan}\n"
          + "\n".join(report) + f"\n\n{sum(every)}/{len(every)} strategy-link pairs within 15%")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="10mbit,100mbit,1gbit")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--row-timeout", type=float, default=240.0)
    ap.add_argument("--output-dir", default="")
    ap.add_argument("--replan", metavar="DIR", default="",
                    help="no runs: predict again for the measurements of an earlier run "
                         "(its --output-dir), e.g. after a cost-model change")
    a = ap.parse_args()
    if a.replan:
        return replan(a)
    if os.geteuid() != 0:
        print("plan_accuracy: needs root (network namespaces)", file=sys.stderr)
        return 2
    out = os.path.abspath(a.output_dir or os.path.join(
        "bench", "results", "plan-" + time.strftime("%Y%m%d-%H%M%S")))
    common = ["--model", a.model, "--max-steps", str(a.steps), "--batch-size",
              str(a.batch_size), "--eval-size", "0", "--no-eval-before", "--ckpt-interval", "0",
              "--no-progress", "--warmup-steps", "0"]
    names = [s.strip() for s in a.strategies.split(",") if s.strip()]
    t0 = time.time()
    report, every = [], []
    for prof in [p.strip() for p in a.profiles.split(",") if p.strip()]:
        rate, _, delay = prof.partition("+")
        spec = parse_emulate(f"nodes=2,rate={rate}" + (f",delay={delay}" if delay else ""))
        pdir = os.path.join(out, prof.replace("+", "_"))
        os.makedirs(pdir, exist_ok=True)
        rows = ([Row("ceiling", "no sync", ["--comm", "none"])]
                + [Row(n, n, ["--comm", n, *STEADY_OPTS.get(n, [])]) for n in names]
                + [Row("ceiling_end", "no sync (again)", ["--comm", "none"])])
        print(f"== {prof}", file=sys.stderr, flush=True)
        with emulated(spec) as cluster:
            net, probe_text = probe_link(cluster, pdir, a.row_timeout)
            print(f"   {probe_text}", file=sys.stderr, flush=True)
            for row in rows:
                run_row(cluster, row, common, pdir, a.row_timeout)
                print(f"   {row.label}: {row.status} ({row.extra['wall_s']:.0f} s)",
                      file=sys.stderr, flush=True)
        ceiling = max((r for r in rows if r.key.startswith("ceiling") and r.summary),
                      key=lambda r: r.summary["samples_per_s"], default=None)
        if net is None or ceiling is None:
            report.append(f"\n### {prof}\n\n{probe_text}; ceiling: "
                          f"{'ok' if ceiling else 'failed'}: no comparison")
            continue
        predict_rows(rows, net, ceiling.summary, a.model, a.batch_size)
        report.append(table(prof, probe_text, rows, every))
        with open(os.path.join(pdir, "rows.json"), "w") as fh:
            json.dump([{"row": r.key, "status": r.status, **r.extra} for r in rows], fh, indent=1)
        print(report[-1], flush=True)
    text = (f"plan accuracy: 2 emulated nodes, {a.model}, {a.steps} steps x batch "
            f"{a.batch_size}, load average {os.getloadavg()[0]:.1f} at the end\n"
            + "\n".join(report)
            + f"\n\n{sum(every)}/{len(every)} strategy-link pairs within 15%; "
            f"wall time {(time.time() - t0) / 60:.1f} min\n")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(text)
    print(text)
    print(f"results: {out}/results.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
