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
from lorasync.bench.peers import (
    LIGHTHOUSE_PORT, LOCALSGD_PREFIX, TORCHFT_ROWS, is_peer_row, peer_row, start_lighthouse,
    torchft_row,
)
from lorasync.bench.profiles import delay_s, dilate, parse_profiles, rate_bps
from lorasync.bench.rows import (
    Row, measured_step_s, predict_rows, prepare_run, probe_link, run_row, tune_nodes,
)
from lorasync.bench.tables import (
    median_range, peer_share_verdict, progressive_table, progressive_verdicts,
)
from lorasync.errors import ConfigError, EnvironmentProblem

__all__ = ["select_rows", "profile_rows", "round_rows", "row_cell", "aggregate_cells",
           "run_progressive"]


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
        keys = [k.strip() for k in wanted.split(",") if k.strip()]
        unknown = set(keys) - {r.key for r in rows} - {k for k in keys if is_peer_row(k)}
        if unknown:
            raise ConfigError("--rows", ",".join(sorted(unknown)),
                              "use keys from: " + ", ".join(r.key for r in rows)
                              + f", or a peer: {LOCALSGD_PREFIX}K (accelerate's LocalSGD every "
                              "K steps), " + ", ".join(TORCHFT_ROWS)
                              + " (optionally :outer_lr=X:outer_momentum=Y)")
        peers = []
        for k in keys:
            if is_peer_row(k):
                # the lighthouse URL is filled in on the cluster (torchft rows)
                try:
                    label, args, _ = peer_row(k)
                except ValueError as exc:   # a torchft row's bad :OPTION=VALUE
                    raise ConfigError("--rows", k, str(exc)) from None
                peers.append(Row(k, label, args, module="lorasync.bench.peers", peer=True))
        rows = [r for r in rows if r.key in ("ceiling", "ceiling_end") or r.key in keys]
        rows = rows[:-1] + peers + rows[-1:]   # peers before the closing ceiling
    return rows


def has_peers(rows: list[Row]) -> bool:
    return any(r.peer for r in rows)


def round_rows(rows: list[Row], rounds: int) -> list[Row]:
    """``rows`` interleaved over ``rounds``: every row once, then every row
    again (each run its own Row and folder); the no-sync ceilings run once."""
    import copy

    out = list(rows)
    for i in range(1, rounds):
        for r in rows:
            if not r.key.startswith("ceiling"):
                c = copy.deepcopy(r)
                c.round = i
                out.append(c)
    end = [r for r in out if r.key == "ceiling_end"]
    return [r for r in out if r.key != "ceiling_end"] + end


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
    from lorasync.plan.net import what_if_net
    from lorasync.plan.ranking import rank

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
        return {"row": row.label, "key": row.key, "status": row.status, "round": row.round + 1,
                "peer": row.peer}
    sps = s["samples_per_s"]
    base = ceiling.summary["samples_per_s"] if ceiling.summary else None
    ref = ddp.summary["samples_per_s"] if ddp and ddp.summary else None
    ea = s.get("eval_after") or {}
    return {
        "row": row.label, "key": row.key, "status": row.status, "strategy": s["strategy"],
        "round": row.round + 1, "peer": row.peer,
        "samples_per_s": sps,
        "speedup": sps / ref if ref else None,
        "efficiency": sps / base if base else None,
        "sync_share": s["sync_share"],
        "wire_mb": s["wire_bytes_per_step"] / 1e6,
        "eval_loss": ea.get("eval_loss"),
        "exact_match": ea.get("exact_match"), "eval_n": ea.get("n"),
        **row.extra,
    }


#: figures of a row given as median (min-max) over interleaved rounds
SPREAD_FIGURES = ("samples_per_s", "speedup", "efficiency", "sync_share", "wire_mb",
                  "samples_per_s_after_switch")


def aggregate_cells(cells: list[dict]) -> list[dict]:
    """One cell per row over its rounds: the medians in the cell's figures, each
    figure's :func:`median_range` under ``spread``, the rounds that ran and
    those that gave figures, and every round's status."""
    out: dict[str, dict] = {}
    for c in cells:
        out.setdefault(c["key"], []).append(c)
    agg = []
    for key, mine in out.items():
        ok = [c for c in mine if "samples_per_s" in c]
        base = dict(ok[len(ok) // 2] if ok else mine[0])
        base.update(rounds=len(mine), rounds_ok=len(ok),
                    statuses=[c["status"] for c in mine])
        if len(mine) > 1 and ok:
            base["spread"] = {f: median_range(c.get(f) for c in ok) for f in SPREAD_FIGURES}
            for f, fig in base["spread"].items():
                if fig is not None:
                    base[f] = fig["median"]
        agg.append(base)
    return agg


def _calibrate(args, tag: str, out: str, common: list[str]):
    """``--workload``: the no-sync ceiling on an unshaped 2-node cluster, then
    the dilation of every user link (lorasync.bench.workloads) from its step."""
    from lorasync.bench.workloads import dilation, get_workload
    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import parse_emulate

    w = get_workload(args.workload)
    row = Row("ceiling", "no sync (ceiling; calibration, unshaped)", ["--comm", "none"])
    print("\n== calibration: no sync, unshaped (the compute step of this host)",
          file=sys.stderr, flush=True)
    with emulated(parse_emulate(f"nodes={args.nodes},name={tag}")) as cluster:
        run_row(cluster, row, common, os.path.join(out, "calibration"), args.row_timeout)
    if not row.summary:
        raise EnvironmentProblem(f"--workload: the calibration no-sync run {row.status} "
                                 f"(see {out}/calibration)")
    d = dilation(w, measured_step_s(row.summary, args.batch_size),
                 int(row.summary["adapter_params"]))
    print(f"   {d.text()}", file=sys.stderr, flush=True)
    return row, d


def run_progressive(args) -> int:
    """The bench over every profile of ``args`` (root: the caller has checked);
    writes results.md, results.json and the chart into its results folder.

    ``--workload NAME``: every profile is a user's link for that workload; it
    is emulated dilated (lorasync.bench.workloads) after a no-sync calibration
    run on an unshaped cluster, which is also the first ceiling.  ``--rounds
    N``: the rows run N times interleaved, each figure a median with its
    range.  ``--row-time-limit S``: a row still running after S s is stopped
    and scored on the steps it finished (said in its status)."""
    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import parse_emulate

    if args.steps < 3:
        raise ConfigError("--steps", args.steps, "use at least 3 (the first step is warm-up)")
    rounds = getattr(args, "rounds", 1) or 1
    if rounds < 1:
        raise ConfigError("--rounds", rounds, "give 1 or more")
    workload = getattr(args, "workload", "") or ""
    if workload:
        from lorasync.bench.workloads import get_workload
        get_workload(workload)   # a bad name stops here, before any cluster
    if has_peers(select_rows(args.rows, args.steps)) and args.steps < 30:
        raise ConfigError("--steps", args.steps, "peer rows sync every 8 or more steps: use "
                          "--steps 30 or more so a row covers several outer syncs")
    time_limit = getattr(args, "row_time_limit", 0.0) or 0.0
    profiles = parse_profiles(args.profiles)
    # a name of its own: a user's `default` cluster (or another bench) stays untouched
    tag = f"bench{os.getpid() % 100000}"
    out, common = prepare_run(args)
    results: dict[str, list[dict]] = {}
    markdown = [f"lorasync bench: {args.nodes} emulated nodes, model {args.model}, "
                f"{args.steps} steps x batch {args.batch_size} per rank"
                + (f", {rounds} rounds interleaved" if rounds > 1 else ", 1 round")
                + (f", rows capped at {time_limit:g} s" if time_limit else "")
                + f", {time.strftime('%Y-%m-%d %H:%M')}"]
    t_start = time.time()
    done = []   # (label, rows, net, probe text, cluster status, link text) per profile
    first_ceiling: Row | None = None
    dil = None
    if workload:
        first_ceiling, dil = _calibrate(args, tag, out, common)
        markdown.append(f"\n{dil.text()}.")
    for i, (label, _) in enumerate(profiles):
        rate = label.partition("+")[0]
        delay = label.partition("+")[2]
        if dil is not None:
            # the link this host needs for the user's `label` under the workload
            rate, delay = dilate(rate, delay, dil.rate_div, dil.delay_mul)
        spec = parse_emulate(f"nodes={args.nodes},rate={rate}"
                             + (f",delay={delay}" if delay else "") + f",name={tag}")
        link_text = (f"user link {label}, emulated as {rate_bps(rate) / 1e6:.3f} Mbit/s"
                     + (f" + {delay_s(delay) * 1000:.0f} ms one way" if delay else "")
                     if dil is not None else "")
        pdir = os.path.join(out, label.replace("+", "_"))
        os.makedirs(pdir, exist_ok=True)
        rows = profile_rows(args.rows, args.steps, i + (1 if workload else 0),
                            len(profiles) + (1 if workload else 0))
        if not getattr(args, "closing_ceiling", True):
            rows = [r for r in rows if r.key != "ceiling_end"]
        rows = round_rows(rows, rounds)
        print(f"\n== {label}: {spec.describe()}" + (f" ({link_text})" if link_text else ""),
              file=sys.stderr, flush=True)
        with emulated(spec) as cluster:
            status = cluster.status(measure=True, seconds=1.0)
            net, probe_text = probe_link(cluster, pdir, args.row_timeout)
            print(f"   {probe_text}", file=sys.stderr, flush=True)
            by_key = {r.key: r for r in rows if not r.round}
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
                        if row.key == "overlap" and not row.label.endswith(")"):
                            row.label = f"{row.label} ({name})"
                        row.extra["why"] = why
                    if row.module == "lorasync":
                        strategy = row.args[row.args.index("--comm") + 1]
                        if not _available(strategy):
                            row.status = f"not available ({strategy} is not a strategy yet)"
                            continue
                    # tuning is applied once for the run of tuned rows, reverted after it
                    if row.tune != tuned:
                        tune_nodes(cluster, rate, delay, pdir, "apply" if row.tune else "revert")
                        tuned = row.tune
                    print(f"   {row.label}" + (f" (round {row.round + 1})" if rounds > 1 else "")
                          + " ...", file=sys.stderr, flush=True)
                    _run(cluster, row, common, pdir, args, time_limit)
                    sps = row.summary["samples_per_s"] if row.summary else None
                    print(f"   {row.label}: {row.status}" + (f", {sps:.2f} samples/s" if sps
                                                              else "")
                          + f" ({row.extra['wall_s']:.0f} s)", file=sys.stderr, flush=True)
            finally:
                if tuned:
                    tune_nodes(cluster, rate, delay, pdir, "revert")
        done.append((label, rows, net, probe_text, status, link_text))
        if first_ceiling is None:
            first_ceiling = next((r for r in rows if r.key == "ceiling"), None)
    # every profile's reference: the fastest no-sync run of this invocation
    # (a slow start or a busy spell cannot inflate efficiencies)
    ceilings = [r for _, rows, *_ in done for r in rows if r.key.startswith("ceiling")]
    if first_ceiling is not None and first_ceiling not in ceilings:
        ceilings.insert(0, first_ceiling)
    ceiling = max(ceilings, key=lambda r: r.summary["samples_per_s"] if r.summary else -1)
    ref_text = (f"reference ceiling: {ceiling.summary['samples_per_s']:.2f} samples/s, the "
                f"fastest of {sum(1 for r in ceilings if r.summary)} no-sync runs in this bench"
                if ceiling.summary else "no no-sync run succeeded: no efficiencies")
    for label, rows, net, probe_text, status, link_text in done:
        if net is not None and ceiling.summary:
            predict_rows(rows, net, ceiling.summary, args.model, args.batch_size)
        cells = []
        for r in rows:
            ddp = next((x for x in rows if x.key == "ddp" and x.round == r.round), None)
            cells.append(row_cell(r, ceiling, ddp))
        runs = cells
        if rounds > 1:
            cells = aggregate_cells(cells)
        if dil is not None and first_ceiling is not None:
            # the calibration run (unshaped) is this profile's no-sync ceiling too
            cells.insert(0, row_cell(first_ceiling, ceiling, None))
        devs = _rdma_devices()
        cells.append({"row": "RDMA", "status": (f"RDMA devices {', '.join(devs)}: run on the real "
                      "fabric with NCCL (emulated links are TCP)") if devs else
                      "not available on this host (no /sys/class/infiniband devices)"})
        results[label] = {"cells": cells, "reference": ref_text,
                          **({"runs": runs} if rounds > 1 else {}),
                          **({"link": link_text, "emulated_rate": spec_rate(label, dil),
                              "emulated_delay": spec_delay(label, dil)} if dil else {})}
        m = status.get("measured") or {}
        title = (f"{label} user link, workload {workload}: emulated "
                 f"{link_text.partition('emulated as ')[2]}" if dil else label)
        title += (f" (measured node0->node1: {m['rate_bps'] / 1e6:.1f} Mbit/s TCP goodput, "
                  f"RTT {1000 * m['rtt_s']:.2f} ms)" if m else "")
        verdicts = [probe_text, ref_text, *progressive_verdicts(cells)]
        verdicts += peer_share_verdict(
            [c for c in cells if "samples_per_s" in c
             and (c["key"] == "auto" or c.get("peer"))] if rounds > 1 else [])
        if rounds == 1 and any(c.get("peer") for c in cells):
            verdicts.append("one round: no spread measured, so no row is called ahead of "
                            "another (--rounds 2 or more)")
        markdown.append(progressive_table(title, cells) + "\n\n" + "\n".join(
            f"- {line}" for line in verdicts))
        print(markdown[-1], flush=True)
    text = "\n".join(markdown) + f"\n\nbench wall time: {(time.time() - t_start) / 60:.1f} min\n"
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                   **({"workload": dil.as_dict(),
                       "calibration_ceiling": first_ceiling.summary} if dil else {}),
                   "results": {k: v if dil or rounds > 1 else v["cells"]
                               for k, v in results.items()}},
                  fh, indent=1, default=str)
    efficiency_chart({k: v["cells"] for k, v in results.items()},
                     os.path.join(out, "chart.png"))
    print(f"\nresults: {out}/results.md, results.json, chart.png", file=sys.stderr)
    return 0


def spec_rate(label: str, dil) -> str:
    return dilate(label.partition("+")[0], label.partition("+")[2], dil.rate_div,
                  dil.delay_mul)[0]


def spec_delay(label: str, dil) -> str:
    return dilate(label.partition("+")[0], label.partition("+")[2], dil.rate_div,
                  dil.delay_mul)[1]


def _run(cluster, row: Row, common: list[str], pdir: str, args, time_limit: float) -> None:
    """One row on the cluster; a torchft row gets a lighthouse of its own on node 0."""
    lighthouse = None
    if torchft_row(row.key) is not None:
        url = f"http://{cluster.nodes[0].address}:{LIGHTHOUSE_PORT}"
        row.args = peer_row(row.key, url)[1]
        try:
            lighthouse = start_lighthouse(cluster, args.nodes, pdir)
        except FileNotFoundError as exc:
            row.status, row.extra["wall_s"] = f"not available: {exc}", 0.0
            return
    try:
        # the no-sync ceilings are the reference: never cut short
        run_row(cluster, row, common, pdir, args.row_timeout,
                0.0 if row.key.startswith("ceiling") else time_limit)
    finally:
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
