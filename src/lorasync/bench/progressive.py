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
and the faster of the two is every profile's reference.  Every row runs under a timeout; a row that hangs
or fails is reported as such.

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

Several workers per node (``--nproc-per-node G``): flat against
hierarchical sync for each strategy on N x G workers, with the links dilated
by the measured compute slowdown (:mod:`lorasync.bench.topology`):

    lorasync bench --nodes 4 --nproc-per-node 2 --profiles 10mbit,100mbit+20ms
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lorasync.bench.profiles import parse_profiles
from lorasync.bench.rows import (
    Row, measured_step_s, predict_rows, prepare_run, probe_link, run_row, tune_nodes,
)
from lorasync.bench.tables import progressive_table, progressive_verdicts
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
                        "ddp,tcp,fp16,best,overlap,periodic,auto,torch_fp16,torch_powersgd "
                        "(topology bench: strategy names, NAME/flat, NAME/node, auto, "
                        "torch_powersgd)")
    p.add_argument("--row-timeout", type=float, default=240.0,
                   help="seconds before a row is stopped and reported as hung")
    p.add_argument("--output-dir", default="",
                   help="where results go (default: bench/results/<date>-<time>)")
    p.add_argument("--rescore", default="", metavar="DIR",
                   help="topology bench: score a saved run (DIR/results.json) again with this "
                        "version's cost model and ceiling rule, running nothing")


def profile_rows(wanted: str, steps: int, index: int, profiles: int) -> list[Row]:
    """The rows of profile ``index`` of ``profiles``.  The no-sync ceiling does
    not depend on the link (nothing is sent): it runs at the start of the first
    profile and at the very end of the last one."""
    rows = _rows(wanted, steps)
    if index > 0:
        rows = [r for r in rows if r.key != "ceiling"]
    if index < profiles - 1:
        rows = [r for r in rows if r.key != "ceiling_end"]
    return rows


def _rows(wanted: str, steps: int = 9) -> list[Row]:
    ddp = ["--comm", "allreduce", "--bucket-mb", "25", "--broadcast-buffers"]
    # one full period inside the measured steps (all but the first)
    period = max(2, min(8, steps - 1))
    rows = [
        Row("ceiling", "no sync (ceiling)", ["--comm", "none"]),
        Row("ddp", "plain DDP (fp32, defaults)", ddp),
        Row("tcp", "+ TCP tuning", ddp, tune=True),
        Row("fp16", "+ fp16 compression", ["--comm", "fp16", "--bucket-mb", "25"], tune=True),
        Row("best", "+ best compressor", [], tune=True),       # filled from the planner
        Row("overlap", "+ overlap (1 MB buckets)", [], tune=True),
        Row("periodic", f"+ periodic sync (DiLoCo H={period}, fp16, streaming)",
            ["--comm", "diloco", "--comm-opt", f"period={period}", "--comm-opt", "streaming=true",
             "--comm-opt", "delta_dtype=fp16",
             "--bucket-mb", "1"], tune=True),
        Row("auto", "auto", ["--comm", "auto", "--bucket-mb", "1"], tune=True),
        Row("torch_fp16", "torch fp16 hook", ["--comm", "torch_fp16", "--bucket-mb", "25"]),
        Row("torch_powersgd", "torch PowerSGD hook (rank 1)",
            ["--comm", "torch_powersgd", "--bucket-mb", "25"]),
        # the ceiling again at the end: the higher of the two is the reference,
        # so a slow start (cold caches, a busy machine) cannot inflate efficiencies
        Row("ceiling_end", "no sync (ceiling, again)", ["--comm", "none"]),
    ]
    if wanted != "all":
        keys = {k.strip() for k in wanted.split(",") if k.strip()}
        unknown = keys - {r.key for r in rows}
        if unknown:
            raise ConfigError("--rows", ",".join(sorted(unknown)),
                              "use keys from: " + ", ".join(r.key for r in rows))
        rows = [r for r in rows if r.key in ("ceiling", "ceiling_end") or r.key in keys]
    return rows


def _rdma_devices() -> list[str]:
    path = "/sys/class/infiniband"
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _best_compressor(ceiling: dict, rate: str, delay: str, nodes: int, bucket_mb: float,
                     net=None, batch: int = 4) -> tuple[str, list[str], str]:
    """The planner's pick among the lossy per-step compressors that keep eval
    quality (auto's default candidates: onebit is left out) for this link, on
    the probed network where there is one, else the nominal rate."""
    from lorasync.emulate.cluster import parse_delay, parse_rate
    from lorasync.plan.policy import DEFAULT_CANDIDATES
    from lorasync.catalog import LOSSLESS, PERIODIC
    from lorasync.plan.costmodel import GLOO_LANES, Workload
    from lorasync.plan.planner import rank, what_if_net

    if net is None:   # the bench runs gloo
        net = what_if_net(nodes, parse_rate(rate) / 8, 2 * parse_delay(delay) if delay else 0.0,
                          lanes=GLOO_LANES)
    wl = Workload(adapter_params=int(ceiling["adapter_params"]),
                  compute_s=measured_step_s(ceiling, batch), batch_size=batch,
                  bucket_bytes=int(bucket_mb * 2 ** 20))
    preds = rank(net, wl, [c for c in DEFAULT_CANDIDATES if c not in LOSSLESS | PERIODIC])
    best = preds[0]
    args = ["--comm", best.strategy]
    for k, v in sorted(best.options.items()):
        args += ["--comm-opt", f"{k}={v}"]
    why = (f"planner: {best.samples_per_s:.2f} samples/s predicted vs "
           f"{preds[1].strategy} {preds[1].samples_per_s:.2f}")
    return best.strategy, args, why


def _available(strategy: str) -> bool:
    from lorasync.comm import strategy_names

    return strategy in strategy_names()


def _cells(row: Row, ceiling: Row, ddp: Row | None) -> dict:
    s = row.summary
    if not s:
        return {"row": row.label, "key": row.key, "status": row.status}
    sps = s["samples_per_s"]
    base = ceiling.summary["samples_per_s"] if ceiling.summary else None
    ref = ddp.summary["samples_per_s"] if ddp and ddp.summary else None
    ea = s.get("eval_after") or {}
    return {
        "row": row.label, "key": row.key, "status": row.status, "strategy": s["strategy"],
        "samples_per_s": sps,
        "speedup": sps / ref if ref else None,
        "efficiency": sps / base if base else None,
        "sync_share": s["sync_share"],
        "wire_mb": s["wire_bytes_per_step"] / 1e6,
        "eval_loss": ea.get("eval_loss"),
        "exact_match": ea.get("exact_match"), "eval_n": ea.get("n"),
        **row.extra,
    }


def _chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    profiles = list(results)
    # rows by key (labels name the compressor picked, which differs by link)
    keys: dict[str, str] = {}
    for prof in profiles:
        for c in results[prof]:
            k = c.get("key") or c["row"]
            if k in ("ceiling", "ceiling_end", "RDMA"):
                continue  # the reference itself (100% by definition) and a status line
            if k not in keys:
                keys[k] = c["row"] if k not in ("best", "overlap") else \
                    c["row"].split(" (")[0] + (" (1 MB buckets)" if k == "overlap" else "")
    labels = list(keys.values())
    fig = Figure(figsize=(11, 0.6 + 0.45 * len(labels) * len(profiles) / 2 + 2))
    ax = fig.subplots()
    h = 0.8 / len(profiles)
    for i, prof in enumerate(profiles):
        by = {(c.get("key") or c["row"]): c for c in results[prof]}
        vals = [(by.get(k) or {}).get("efficiency") or 0 for k in keys]
        ax.barh([j + i * h for j in range(len(labels))], [100 * v for v in vals], height=h,
                label=prof)
    ax.set_yticks([j + 0.4 - h / 2 for j in range(len(labels))], labels)
    ax.invert_yaxis()
    ax.set_xlabel("scaling efficiency (% of the fastest no-sync run of the bench)")
    ax.axvline(100, color="grey", lw=0.8, ls="--")
    ax.legend(title="link", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("lorasync bench: 2 emulated nodes, SmolLM2-135M + LoRA r=8")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args) -> int:
    from lorasync.emulate.cluster import emulated, parse_emulate

    if getattr(args, "rescore", ""):
        from lorasync.bench.topology import rescore
        result = rescore(args.rescore)
        print("\n".join(p["markdown"] for p in result["profiles"].values()))
        print(f"\nrewritten: {args.rescore}/results.md, results.json", file=sys.stderr)
        return 0
    if os.geteuid() != 0:
        raise EnvironmentProblem("lorasync bench: emulated clusters need root (network "
                                 "namespaces); run it as root")
    if getattr(args, "nproc_per_node", 1) > 1:
        from lorasync.bench.topology import run_topology
        return run_topology(args)
    if args.steps < 3:
        raise ConfigError("--steps", args.steps, "use at least 3 (the first step is warm-up)")
    profiles = parse_profiles(args.profiles)
    # a name of its own: a user's `default` cluster (or another bench) stays untouched
    tag = f"bench{os.getpid() % 100000}"
    specs = [(label, parse_emulate(f"nodes={args.nodes},{tail},name={tag}"))
             for label, tail in profiles]
    out, common = prepare_run(args)
    results: dict[str, list[dict]] = {}
    markdown = [f"lorasync bench: {args.nodes} emulated nodes, model {args.model}, "
                f"{args.steps} steps x batch {args.batch_size} per rank, "
                f"{time.strftime('%Y-%m-%d %H:%M')}"]
    t_start = time.time()
    done = []   # (label, rows, net, probe text, cluster status) per profile
    first_ceiling: Row | None = None
    for i, ((label, spec), (_, tail)) in enumerate(zip(specs, profiles)):
        rate = label.partition("+")[0]
        delay = label.partition("+")[2]
        pdir = os.path.join(out, label.replace("+", "_"))
        os.makedirs(pdir, exist_ok=True)
        rows = profile_rows(args.rows, args.steps, i, len(specs))
        print(f"\n== {label}: {spec.describe()}", file=sys.stderr, flush=True)
        with emulated(spec) as cluster:
            status = cluster.status(measure=True, seconds=1.0)
            net, probe_text = probe_link(cluster, pdir, args.row_timeout)
            print(f"   {probe_text}", file=sys.stderr, flush=True)
            by_key = {r.key: r for r in rows}
            if first_ceiling is not None:
                by_key.setdefault("ceiling", first_ceiling)
            tuned = False
            try:
                for row in rows:
                    if row.key in ("best", "overlap"):
                        ceiling = by_key["ceiling"].summary
                        if not ceiling:
                            row.status = "skipped: no ceiling measurement"
                            continue
                        name, cargs, why = _best_compressor(ceiling, rate, delay, args.nodes,
                                                            25.0, net, args.batch_size)
                        bucket = "25" if row.key == "best" else "1"
                        row.args = cargs + ["--bucket-mb", bucket]
                        row.label = f"{row.label} ({name})" if row.key == "overlap" else row.label
                        row.extra["why"] = why
                    strategy = row.args[row.args.index("--comm") + 1]
                    if not _available(strategy):
                        row.status = f"not available ({strategy} is not a strategy yet)"
                        continue
                    # tuning is applied once for the run of tuned rows, reverted after it
                    if row.tune != tuned:
                        tune_nodes(cluster, rate, delay, pdir, "apply" if row.tune else "revert")
                        tuned = row.tune
                    print(f"   {row.label} ...", file=sys.stderr, flush=True)
                    run_row(cluster, row, common, pdir, args.row_timeout)
                    sps = row.summary["samples_per_s"] if row.summary else None
                    print(f"   {row.label}: {row.status}" + (f", {sps:.2f} samples/s" if sps
                                                              else "")
                          + f" ({row.extra['wall_s']:.0f} s)", file=sys.stderr, flush=True)
            finally:
                if tuned:
                    tune_nodes(cluster, rate, delay, pdir, "revert")
        done.append((label, rows, net, probe_text, status))
        if first_ceiling is None:
            first_ceiling = next((r for r in rows if r.key == "ceiling"), None)
    # every profile's reference: the fastest no-sync run of this invocation
    # (a slow start or a busy spell cannot inflate efficiencies)
    ceilings = [r for _, rows, *_ in done for r in rows if r.key.startswith("ceiling")]
    ceiling = max(ceilings, key=lambda r: r.summary["samples_per_s"] if r.summary else -1)
    ref_text = (f"reference ceiling: {ceiling.summary['samples_per_s']:.2f} samples/s, the "
                f"fastest of {sum(1 for r in ceilings if r.summary)} no-sync runs in this bench"
                if ceiling.summary else "no no-sync run succeeded: no efficiencies")
    for label, rows, net, probe_text, status in done:
        if net is not None and ceiling.summary:
            predict_rows(rows, net, ceiling.summary, args.model, args.batch_size)
        ddp = next((r for r in rows if r.key == "ddp"), None)
        cells = [_cells(r, ceiling, ddp) for r in rows]
        devs = _rdma_devices()
        cells.append({"row": "RDMA", "status": (f"RDMA devices {', '.join(devs)}: run on the real "
                      "fabric with NCCL (emulated links are TCP)") if devs else
                      "not available on this host (no /sys/class/infiniband devices)"})
        results[label] = cells
        m = status.get("measured") or {}
        title = label + (f" (measured node0->node1: {m['rate_bps'] / 1e6:.1f} Mbit/s TCP goodput, "
                         f"RTT {1000 * m['rtt_s']:.2f} ms)" if m else "")
        markdown.append(progressive_table(title, cells) + "\n\n" + "\n".join(
            f"- {line}" for line in [probe_text, ref_text, *progressive_verdicts(cells)]))
        print(markdown[-1], flush=True)
    text = "\n".join(markdown) + f"\n\nbench wall time: {(time.time() - t_start) / 60:.1f} min\n"
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                   "results": results}, fh, indent=1, default=str)
    _chart(results, os.path.join(out, "chart.png"))
    print(f"\nresults: {out}/results.md, results.json, chart.png", file=sys.stderr)
    return 0
