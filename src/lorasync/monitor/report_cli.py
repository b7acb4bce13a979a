"""HTML report of one or more runs: throughput, compute vs sync, wire bytes, loss.

One run (writes runs/fp16/report.html):

    lorasync report runs/fp16

Several runs side by side (writes ./lorasync-report.html; speedups are
relative to the first run):

    lorasync report runs/allreduce runs/fp16 runs/powersgd -o compare.html

The file is self-contained (plots are embedded PNGs): open it in any browser,
offline, or attach it to an issue.  A run that has not finished (no
metrics.jsonl yet) is reported from its per-rank streams in RUN_DIR/ranks/.

A transformers Trainer's output_dir is one more kind of run (its
trainer_state.json, or the newest checkpoint-N/trainer_state.json, with the
lorasync/* log entries when lorasync.hf.attach was used; '-' for what its logs
lack), e.g. the same script with and without lorasync on an emulated link:

    lorasync report runs/plain-trainer runs/fp16-trainer runs/train-fp16
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directory (the --output-dir of `lorasync train`, or a "
                        "transformers Trainer's output_dir); several are compared, the "
                        "first is the baseline")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="where to write the HTML (default: RUN_DIR/report.html for one run, "
                        "./lorasync-report.html for several)")
    p.add_argument("--title", help="page title (default: the run's name)")


def run(args) -> int:
    from lorasync.monitor.report import write_report

    path = write_report(args.run_dirs, args.output, title=args.title)
    print(f"report: {path}")
    return 0
