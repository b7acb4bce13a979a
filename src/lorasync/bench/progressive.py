"""The progressive-optimization bench: one worker per emulated node, each row one step more.

Owns which rows run (``select_rows``, and ``profile_rows``: the no-sync
ceiling first and last across the profiles), the planner's pick for the
compressor rows, a row's cell in results.json (speedup against plain DDP,
efficiency against the fastest no-sync run), and the run over every link
profile that writes results.md, results.json and the chart.  What each row
measures and why: ``lorasync bench --help`` (:mod:`lorasync.bench.cli`).
"""

from __future__ import annotations

import json
import os
import sys
import time

from lorasync.bench.chart import efficiency_chart
from lorasync.bench.profiles import delay_s, parse_profiles, rate_bps
from lorasync.bench.rows import (
    Row, measured_step_s, predict_rows, prepare_run, probe_link, run_row, tune_nodes,
)
from lorasync.bench.tables import progressive_table, progressive_verdicts
from lorasync.errors import ConfigError

__all__ = ["select_rows", "profile_rows", "row_cell", "run_progressive"]


def select_rows(wanted: str, steps: int = 9) -> list[Row]:
    """The bench's rows in order, or those of ``wanted`` (comma-separated keys)
    with the two ceilings; the compressor rows get their arguments later, from
    the planner."""
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


def profile_rows(wanted: str, steps: int, index: int, profiles: int) -> list[Row]:
    """The rows of profile ``index`` of ``profiles``.  The no-sync ceiling does
    not depend on the link (nothing is sent): it runs at the start of the first
    profile and at the very end of the last one."""
    rows = select_rows(wanted, steps)
    if index > 0:
        rows = [r for r in rows if r.key != "ceiling"]
    if index < profiles - 1:
        rows = [r for r in rows if r.key != "ceiling_end"]
    return rows


def _rdma_devices() -> list[str]:
    """RDMA devices of this host (none: the RDMA row says so)."""
    path = "/sys/class/infiniband"
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _best_compressor(ceiling: dict, rate: str, delay: str, nodes: int, bucket_mb: float,
                     net=None, batch: int = 4) -> tuple[str, list[str], str]:
    """The planner's pick among the lossy per-step compressors that keep eval
    quality (auto's default candidates: onebit is left out) for this link, on
    the probed network where there is one, else the nominal rate."""
    from lorasync.plan.policy import DEFAULT_CANDIDATES
    from lorasync.catalog import LOSSLESS, PERIODIC
    from lorasync.plan.costmodel import GLOO_LANES, Workload
    from lorasync.plan.planner import rank, what_if_net

    if net is None:   # the bench runs gloo
        net = what_if_net(nodes, rate_bps(rate) / 8, 2 * delay_s(delay) if delay else 0.0,
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
    """Whether this lorasync has ``strategy`` (a row can name one yet to come)."""
    from lorasync.comm import strategy_names

    return strategy in strategy_names()


def row_cell(row: Row, ceiling: Row, ddp: Row | None) -> dict:
    """A row's figures as saved in results.json and shown in its table: speedup
    against ``ddp``, efficiency against ``ceiling``, the row's extra figures."""
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


def run_progressive(args) -> int:
    """The bench over every profile of ``args`` (root: the caller has checked);
    writes results.md, results.json and chart.png into its results folder."""
    from lorasync.emulate.cluster import emulated, parse_emulate

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
        cells = [row_cell(r, ceiling, ddp) for r in rows]
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
    efficiency_chart(results, os.path.join(out, "chart.png"))
    print(f"\nresults: {out}/results.md, results.json, chart.png", file=sys.stderr)
    return 0
