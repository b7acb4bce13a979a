"""The progressive-optimization benchmark on emulated links.

For each link profile an emulated 2-node cluster is brought up (network
namespaces, shaped veth links, a userspace delay link where delay is asked
for) and every row runs ``lorasync train`` on it through torchrun's c10d
rendezvous, the same path as real multi-node training.  Rows, each adding
one step to the one above:

    no sync (ceiling)        the same ranks with no gradient sync at all
    plain DDP                fp32, DDP's defaults (25 MB buckets, buffer
                             broadcast before every forward)
    + TCP tuning             `lorasync tune --apply` in every node
    + fp16 compression
    + best compressor        the planner's pick among int8/topk/powersgd (the
                             compressors that kept eval quality at 60 steps)
    + overlap                the same with 1 MB buckets (sync hides behind backward)
    + periodic sync          DiLoCo, fp16 outer sync streamed behind the next step
    auto                     lorasync picks (when --comm auto is available)
    torch fp16 hook, torch PowerSGD rank 1   what users would pick instead
    RDMA                     only where RDMA hardware is detected

Scaling efficiency = samples/s of a row / samples/s of the no-sync ceiling,
measured in the same invocation: the ceiling sends nothing, so it does not
depend on the link; it runs first (first profile) and last (last profile),
and the faster of the two is every profile's reference.  Every row runs
under a timeout; a row that hangs or fails is reported as such.

Each profile also checks the planner: a quick ``lorasync probe`` on the
emulated link gives the network model, the ceiling's step time gives the
compute time, and every row of a lorasync strategy gets the cost model's
predicted step time next to the measured one (issue target: within 15%).
Under each table: the plan's worst error, and ``auto`` against the best
fixed lorasync row.

The default 9 steps are 1 warm-up step and 8 measured ones, so the periodic
row (period 8, streaming) syncs exactly once inside the measured window and
its figures are the amortized ones (with fewer steps its period shrinks to
fit).  Eval loss / exact-match after so few steps say little about a
strategy's quality; ``bench/strategies.py --steps 60`` measures that.

    lorasync bench                                   # default profiles
    lorasync bench --profiles 10mbit,100mbit+20ms --steps 12

A GPU user's links (``--workload``, lorasync.bench.workloads): the profiles
are the links the user has; each is emulated dilated so that sync bytes per
second of compute match the workload (its GPU step, its adapter), from a
no-sync step measured first on an unshaped cluster.  Peers as rows, several
rounds with the spread beside every figure:

    lorasync bench --workload smollm2-h200 --profiles 100mbit --steps 30 \\
        --rows ddp,torch_fp16,torch_powersgd,auto,localsgd_8 --rounds 2

Several workers per node (``--nproc-per-node G``): flat against
hierarchical sync for each strategy on N x G workers, with the links dilated
by the measured compute slowdown (:mod:`lorasync.bench.topology`):

    lorasync bench --nodes 4 --nproc-per-node 2 --profiles 10mbit,100mbit+20ms
"""

from __future__ import annotations

import argparse
import os
import sys

from lorasync.bench.progressive import run_progressive
from lorasync.bench.topology import rescore, run_topology
from lorasync.errors import ConfigError, EnvironmentProblem

__all__ = ["add_arguments", "run"]

DEFAULT_PROFILES = "1gbit,100mbit,10mbit,100mbit+20ms"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profiles", default=DEFAULT_PROFILES,
                   help="comma-separated link profiles RATE[+DELAY], e.g. 10mbit,100mbit+20ms "
                        f"(default: {DEFAULT_PROFILES})")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="G",
                   help="workers per node (sharing its namespace); G > 1 runs the topology "
                        "bench: flat against hierarchical sync for each strategy")
    p.add_argument("--dilation", type=float, default=None, metavar="S",
                   help="topology bench: scale links by this compute slowdown instead of "
                        "measuring it (1: no dilation)")
    p.add_argument("--steps", type=int, default=9, help="optimizer steps per row (the first "
                   "is left out of throughput figures; 9 = warm-up + one DiLoCo period of 8)")
    p.add_argument("--model", default="smollm2-135m", help="model for every row")
    p.add_argument("--batch-size", type=int, default=4, help="examples per rank per step")
    p.add_argument("--eval-size", type=int, default=8,
                   help="eval examples for loss/exact-match after training (0: skip)")
    p.add_argument("--rows", default="all",
                   help="comma-separated row keys to run (ceiling is always run): "
                        "ddp,tcp,fp16,best,overlap,periodic,auto,torch_fp16,torch_powersgd, "
                        "and peers: localsgd_K (accelerate's LocalSGD every K steps), "
                        "torchft_diloco, torchft_streaming (optionally "
                        ":outer_lr=X:outer_momentum=Y; need --steps 30 or more) "
                        "(topology bench: strategy names, NAME/flat, NAME/node, auto, "
                        "torch_powersgd)")
    p.add_argument("--row-timeout", type=float, default=240.0,
                   help="seconds before a row is stopped and reported as hung")
    p.add_argument("--workload", default="", metavar="NAME",
                   help="2-node bench: the profiles are a GPU user's links for this workload "
                        "(smollm2-h200, llama2-7b-r16-h100; docs/benchmarks.md): each is "
                        "emulated at the rate and delay that keep the workload's sync bytes per "
                        "second of compute, from a no-sync step measured first")
    p.add_argument("--rounds", type=int, default=1,
                   help="2-node bench: run the rows this many times, interleaved; each figure "
                        "is then the median with its range, and a row is called ahead of "
                        "another only beyond the spread")
    p.add_argument("--row-time-limit", type=float, default=0.0, metavar="S",
                   help="2-node bench: stop a row (not a no-sync ceiling) still running after "
                        "S seconds and score it on the steps it finished (marked capped); "
                        "0: none")
    p.add_argument("--closing-ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="2-node bench: run the no-sync ceiling again at the very end (the "
                        "faster of the two is the reference); --no-closing-ceiling saves a row "
                        "(with --workload the calibration run is then the only ceiling)")
    p.add_argument("--output-dir", default="",
                   help="where results go (default: bench/results/<date>-<time>)")
    p.add_argument("--rescore", default="", metavar="DIR",
                   help="topology bench: score a saved run (DIR/results.json) again with this "
                        "version's cost model and ceiling rule, running nothing")


def run(args) -> int:
    """``--rescore``, else the topology bench for G > 1, else the progressive one."""
    if getattr(args, "rescore", ""):
        result = rescore(args.rescore)
        print("\n".join(p["markdown"] for p in result["profiles"].values()))
        print(f"\nrewritten: {args.rescore}/results.md, results.json", file=sys.stderr)
        return 0
    if os.geteuid() != 0:
        raise EnvironmentProblem("lorasync bench: emulated clusters need root (network "
                                 "namespaces); run it as root")
    if getattr(args, "nproc_per_node", 1) > 1:
        if getattr(args, "workload", ""):
            raise ConfigError("--workload", args.workload, "the topology bench dilates its "
                              "links by its own measured slowdown: drop --workload or "
                              "--nproc-per-node")
        return run_topology(args)
    return run_progressive(args)
