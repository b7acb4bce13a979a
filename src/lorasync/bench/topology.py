"""The topology bench, ``lorasync bench --nodes N --nproc-per-node G``: flat against hierarchical.

Owns its rows, the time dilation of its links, running and measuring a row
on N x G workers, the cost model's step time for a row, scoring a profile
(ceiling, predictions, verdicts, table), writing results.md and
results.json, and ``rescore``: scoring a saved run again from its
results.json with this version's cost model and ceiling rule, running
nothing (``lorasync bench --rescore DIR``).

Every row trains on an emulated cluster of N network namespaces with G
workers in each (the workers of a node share its namespace, so their traffic
is local; traffic between nodes crosses the shaped links):

    no sync (ceiling)
    allreduce, fp16, int8, topk, powersgd, DiLoCo   each flat and hierarchical
    auto                                            (layout its own choice)
    torch PowerSGD hook (rank 1)                    flat: what users would pick

Time dilation.  N*G workers on a few cores compute much slower than the two
workers of the 2-node bench.  Against a link of the
nominal rate, a slow computer makes the link look fast.  So the bench first
measures the slowdown s: the no-sync step of N x G workers over that of 2 x 1
(both unshaped, in this invocation), and emulates every link at rate / s and
delay x s: the compute/communication ratio of the nominal link at 2-rank
speed.  Every table says so (``--dilation X`` fixes s, ``1`` turns it off).

Measured per row (steps after the first): samples/s, the mean exposed sync
per step (comm_s, mean over ranks), the payload each node handed to
collectives spanning nodes (metrics ``inter_bytes``, summed over the node's
ranks), what really crossed the slow links (the nodes' ``eth0`` tx byte
counters over the whole row, less those of the profile's no-sync row --
rendezvous, start-up checks -- per step, all nodes together), and the cost
model's step time next to the measured one (inter-node link: a quick probe
of all N*G ranks, whose ring is as slow as the link between nodes;
intra-node link: a quick probe of node0's G workers).

The ceiling, of each profile's efficiency and of the cost model's compute
time, is the faster of two no-sync runs of N x G workers: the unshaped one at
the start and the profile's own (its only traffic is start-up): N x G
workers on a few cores vary widely between runs minutes apart (the 2-node
bench likewise takes the faster of its first and last ceiling).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from lorasync.bench.profiles import dilate, parse_profiles
from lorasync.bench.rows import prepare_run
from lorasync.bench.tables import topology_table, topology_verdicts
from lorasync.errors import ConfigError, EnvironmentProblem

__all__ = ["row_specs", "summarize", "predict_row", "run_topology", "score_profile", "rescore"]

STRATEGY_ROWS = ("allreduce", "fp16", "int8", "topk", "powersgd", "diloco")


def row_specs(steps: int, wanted: str = "all") -> list[dict]:
    """The rows: key, label, strategy, hierarchy, extra train args."""
    period = max(2, min(4, steps - 1))
    opts = {"diloco": ["--comm-opt", f"period={period}", "--comm-opt", "delta_dtype=fp16"],
            "powersgd": [], "topk": [], "int8": [], "fp16": [], "allreduce": []}
    label = {"diloco": f"DiLoCo H={period}, fp16 delta (not streamed: its sync is exposed)"}
    rows = [dict(key="ceiling", label="no sync (ceiling)", strategy="none", hierarchy="flat",
                 args=[])]
    for s in STRATEGY_ROWS:
        for h in ("flat", "node"):
            where = "flat" if h == "flat" else \
                "hierarchical, outer sync in shards" if s == "diloco" else "hierarchical"
            rows.append(dict(key=f"{s}/{h}", label=f"{label.get(s, s)} [{where}]",
                             strategy=s, hierarchy=h, args=opts[s]))
    # the outer sync carried by one rank per node (before shards, the only way)
    rows.append(dict(key="diloco/node+leaders", label=f"{label['diloco']} [hierarchical, "
                     "outer sync by the leaders]", strategy="diloco", hierarchy="node",
                     args=opts["diloco"] + ["--cross-node", "leaders"]))
    # the outer all-reduce across leaders with the algorithm chosen per message
    rows.append(dict(key="diloco/node+algo", label=f"{label['diloco']} [hierarchical, "
                     "all-reduce algorithm per message]", strategy="diloco", hierarchy="node",
                     args=opts["diloco"] + ["--allreduce-algo", "auto"]))
    rows.append(dict(key="auto", label="auto", strategy="auto", hierarchy="auto", args=[]))
    # in one 25 MB bucket (torch DDP's default), as the 2-node bench runs it: on gloo
    # torch's hook hangs with several buckets (lorasync.comm.torch_hooks)
    rows.append(dict(key="torch_powersgd", label="torch PowerSGD hook (rank 1) [flat]",
                     strategy="torch_powersgd", hierarchy="flat", args=["--bucket-mb", "25"]))
    if wanted != "all":
        keys = {k.strip() for k in wanted.split(",") if k.strip()}
        known = {r["key"] for r in rows} | {r["strategy"] for r in rows}
        bad = keys - known
        if bad:
            raise ConfigError("--rows", ",".join(sorted(bad)),
                              "use keys from: " + ", ".join(r["key"] for r in rows))
        rows = [r for r in rows if r["key"] == "ceiling" or r["key"] in keys
                or r["strategy"] in keys]
    return rows


def _tx_bytes(cluster) -> list[int]:
    """Bytes each node's eth0 has sent (the slow link; loopback is not counted)."""
    out = []
    for n in cluster.nodes:
        p = subprocess.run(["ip", "-n", n.netns, "-s", "-j", "link", "show", n.ifname],
                           capture_output=True, text=True)
        try:
            out.append(int(json.loads(p.stdout)[0]["stats64"]["tx"]["bytes"]))
        except (ValueError, KeyError, IndexError):
            out.append(0)
    return out


def _records(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summarize(recs: list[dict], ranks_per_node: int) -> dict:
    """Per-step figures of a run's metrics (steps after the first)."""
    first = min(r["step"] for r in recs)
    by: dict[int, list[dict]] = {}
    for r in recs:
        if r["step"] != first:
            by.setdefault(r["step"], []).append(r)
    steps = sorted(by)
    wall = sum(max(x["step_s"] for x in by[s]) for s in steps)
    samples = sum(sum(x["samples"] for x in by[s]) for s in steps)
    n = len(by[steps[0]])
    nodes = n // ranks_per_node
    return {
        "steps": len(steps), "world_size": n,
        "samples_per_s": samples / wall if wall else None,
        "step_s": wall / len(steps),
        "sync_s": statistics.fmean(x["comm_s"] for s in steps for x in by[s]),
        "compute_s": statistics.fmean(x["compute_s"] for s in steps for x in by[s]),
        # payload handed to collectives spanning nodes, per node and step
        "inter_bytes_per_node": sum(x.get("inter_bytes", x["wire_bytes"])
                                    for s in steps for x in by[s]) / len(steps) / nodes,
        "intra_bytes_per_rank": sum(x.get("intra_bytes", 0) for s in steps for x in by[s])
        / len(steps) / n,
        "strategy_end": max(recs, key=lambda r: r["step"])["strategy"],
    }


def _train(cluster, row: dict, common: list[str], out: str, timeout: float) -> dict:
    from lorasync.emulate.launch import launch_on_cluster

    run_dir = os.path.join(out, row["key"].replace("/", "-"))
    argv = ["train", *common, "--comm", row["strategy"], "--hierarchy", row["hierarchy"],
            *row["args"], "--output-dir", run_dir]
    tx0 = _tx_bytes(cluster)
    t0 = time.time()
    rc = launch_on_cluster(cluster, argv, timeout=timeout,
                           log_dir=os.path.join(out, "logs", row["key"].replace("/", "-")))
    res = {"key": row["key"], "label": row["label"], "wall_s": time.time() - t0}
    tx = [b - a for a, b in zip(tx0, _tx_bytes(cluster))]
    if rc != 0:
        res["status"] = "hung" if rc == 124 else f"failed (exit {rc})"
        return res
    recs = _records(os.path.join(run_dir, "metrics.jsonl"))
    res.update(status="ok", **summarize(recs, cluster.spec.nproc_per_node))
    res["total_steps"] = max(r["step"] for r in recs)
    res["eth0_bytes_per_step"] = sum(tx) / res["total_steps"]
    res["eth0_bytes_per_node"] = tx
    switches = [r["switch"] for r in recs if r.get("switch") and r["rank"] == 0]
    if switches:
        res["switches"] = switches
    return res


def _probe(cluster, out: str, name: str, timeout: float, node_only: bool = False):
    """(alpha_s, bandwidth_Bps) of a quick probe: every rank, or node0's."""
    from lorasync.emulate.launch import launch_on_cluster
    from lorasync.plan.net import net_from_probe

    path = os.path.join(out, f"probe-{name}.json")
    args = ["probe", "--quick", "--no-pairs", "--output", path]
    if node_only:  # node0's workers alone, on their loopback
        g = cluster.spec.nproc_per_node
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(cluster.exec_argv(0, [sys.executable, "-m", "lorasync", *args,
                                                 "--nproc", str(g)]),
                           capture_output=True, text=True, timeout=timeout, env=env)
        rc = p.returncode
    else:
        rc = launch_on_cluster(cluster, args, timeout=timeout,
                               log_dir=os.path.join(out, "logs", f"probe-{name}"))
    if rc != 0 or not os.path.isfile(path):
        return None
    with open(path) as fh:
        net, _ = net_from_probe(json.load(fh))
    return net.alpha_s, net.bandwidth_Bps


def predict_row(row: dict, spec: dict, inter, intra, compute_s: float, model: str, batch: int,
                nodes: int, g: int):
    """The cost model's step time for a measured row (None: not modelled)."""
    from lorasync.config import parse_options
    from lorasync.plan.costmodel import (GLOO_LANES, MODELS, MiB, Net, Workload, head_share,
                                         lora_matrices, predict)
    from lorasync.catalog import STRATEGIES

    if row["strategy"] not in STRATEGIES or inter is None or intra is None:
        return None
    a = row["args"]
    opts = parse_options([a[i + 1] for i, x in enumerate(a) if x == "--comm-opt"])
    matrices = lora_matrices(MODELS[model]) if model in MODELS else None
    numel = spec["adapter_params"]
    if matrices and sum(x * y for x, y in matrices) != numel:
        matrices = None
    layout = "hierarchical" if row["hierarchy"] == "node" else "flat"
    algo = a[a.index("--allreduce-algo") + 1] if "--allreduce-algo" in a else "ring"
    # a row's own --bucket-mb, else run_topology's common one
    bucket_mb = float(a[a.index("--bucket-mb") + 1]) if "--bucket-mb" in a else 1.0
    net = Net(alpha_s=inter[0], bandwidth_Bps=inter[1], world_size=nodes * g, ranks_per_node=g,
              intra_alpha_s=intra[0], intra_bandwidth_Bps=intra[1], layout=layout,
              allreduce_algo=algo, lanes=GLOO_LANES)
    wl = Workload(adapter_params=numel, compute_s=compute_s, batch_size=batch,
                  head_share=head_share(MODELS[model]) if model in MODELS else 0.0,
                  bucket_bytes=int(bucket_mb * MiB), matrices=matrices,
                  options={row["strategy"]: opts} if opts else {})
    p = predict(row["strategy"], net, wl)
    return {"predicted_step_s": p.step_s, "predicted_inter_bytes_per_node": p.inter_bytes,
            "predicted_link_bytes": p.link_bytes}


def run_topology(args) -> int:
    """The bench at nodes x nproc_per_node (see the module docstring)."""
    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import parse_emulate

    if os.geteuid() != 0:
        raise EnvironmentProblem("lorasync bench: emulated clusters need root")
    n, g = args.nodes, args.nproc_per_node
    if n < 2:
        raise ConfigError("--nodes", n, "use at least 2 nodes with --nproc-per-node")
    if args.steps < 3:
        raise ConfigError("--steps", args.steps, "use at least 3 (the first step is warm-up)")
    profiles = parse_profiles(args.profiles)
    rows = row_specs(args.steps, args.rows)
    tag = f"bt{os.getpid() % 100000}"
    out, common = prepare_run(args, "topology-")
    common += ["--bucket-mb", "1"]
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.time()
    timeout = args.row_timeout
    result: dict = {"nodes": n, "nproc_per_node": g, "model": args.model, "steps": args.steps,
                    "batch_size": args.batch_size, "started": time.strftime("%Y-%m-%d %H:%M"),
                    "profiles": {}}

    # 1. the compute slowdown of N x G workers against 2 x 1, unshaped, and the ceiling
    ceiling_row = rows[0]
    with emulated(parse_emulate(f"nodes={n},nproc_per_node={g},name={tag}")) as c:
        log(f"== calibration: no sync at {n} x {g}, unshaped")
        ceil = _train(c, ceiling_row, common, os.path.join(out, f"ceiling-{n}x{g}"), timeout)
        intra = _probe(c, out, "intra", timeout, node_only=True)
    result["ceiling"], result["intra_link"] = ceil, intra
    if ceil.get("status") != "ok":
        raise EnvironmentProblem(f"the no-sync run at {n} x {g} {ceil.get('status')}; see "
                                 f"{out}/logs")
    if args.dilation:
        s = float(args.dilation)
        how = f"--dilation {s:g}"
    else:
        with emulated(parse_emulate(f"nodes=2,nproc_per_node=1,name={tag}")) as c:
            log("== calibration: no sync at 2 x 1, unshaped")
            two = _train(c, ceiling_row, common, os.path.join(out, "ceiling-2x1"), timeout)
        result["ceiling_2x1"] = two
        if two.get("status") != "ok":
            raise EnvironmentProblem(f"the no-sync run at 2 x 1 {two.get('status')}")
        s = ceil["step_s"] / two["step_s"]
        how = (f"measured: no-sync step {ceil['step_s']:.2f} s at {n} x {g} against "
               f"{two['step_s']:.2f} s at 2 x 1")
    s = max(1.0, s)
    dil_text = (f"time dilation x{s:.2f} ({how}): every link runs at rate / {s:.2f} and "
                f"delay x {s:.2f}, so that compute/communication matches the 2-rank runs")
    result.update(dilation=s, dilation_how=how, dilation_text=dil_text,
                  adapter_params=_adapter_params(os.path.join(out, f"ceiling-{n}x{g}")))
    log(f"   {dil_text}")

    # 2. each profile: probe, then every row
    for label, tail in profiles:
        rate, _, delay = label.partition("+")
        drate, ddelay = dilate(rate, delay, s)
        espec = f"nodes={n},nproc_per_node={g},rate={drate}" + (
            f",delay={ddelay}" if ddelay else "") + f",name={tag}"
        pdir = os.path.join(out, label.replace("+", "_"))
        os.makedirs(pdir, exist_ok=True)
        log(f"\n== {label} (emulated as {drate}" + (f" + {ddelay}" if ddelay else "") + ")")
        cells = []
        with emulated(parse_emulate(espec)) as c:
            inter = _probe(c, pdir, "inter", timeout)
            log("   probe between nodes: "
                + (f"{inter[1] / 1e6:.3f} MB/s, alpha {inter[0] * 1e3:.2f} ms" if inter else
                   "failed"))
            base = _train(c, ceiling_row, common, os.path.join(pdir, "baseline"), timeout)
            base_tx = sum(base.get("eth0_bytes_per_node") or [0])
            log(f"   no-sync baseline: {base.get('status')}, eth0 {base_tx / 1e6:.3f} MB in all "
                "(rendezvous and start-up: subtracted from every row)")
            for row in rows[1:]:
                log(f"   {row['label']} ...")
                cell = _train(c, row, common, pdir, timeout)
                if cell.get("status") == "ok":
                    cell["eth0_bytes_per_step"] = max(
                        0.0, sum(cell["eth0_bytes_per_node"]) - base_tx) / cell["total_steps"]
                log(f"   -> {cell.get('status')}"
                    + (f", {cell['samples_per_s']:.2f} samples/s, sync {cell['sync_s']:.3f} s, "
                       f"inter {cell['inter_bytes_per_node'] / 1e6:.3f} MB/node/step, eth0 "
                       f"{cell['eth0_bytes_per_step'] / 1e6:.3f} MB/step"
                       if cell.get("status") == "ok" else "") + f" ({cell['wall_s']:.0f} s)")
                cells.append(cell)
        prof = {"emulated_rate": drate, "emulated_delay": ddelay, "inter_link": inter,
                "baseline": base, "rows": cells}
        result["profiles"][label] = prof
        print(score_profile(result, label), flush=True)
    result["wall_min"] = (time.time() - t_start) / 60
    _write(out, result)
    log(f"\nresults: {out}/results.md, results.json")
    return 0


def _ceiling(result: dict, prof: dict) -> dict:
    """The profile's no-sync ceiling: the faster of the invocation's unshaped no-sync run and
    the profile's own (its only traffic is start-up).  N x G workers on a few cores vary by
    20% and more between runs minutes apart; one slow no-sync run would put rows over 100%
    and make every prediction slow, so the faster counts, as in the 2-node bench."""
    runs = [(result["ceiling"], "unshaped"), (prof.get("baseline") or {}, "on this profile")]
    ok = [(r, how) for r, how in runs if r.get("status") == "ok"]
    best, how = max(ok, key=lambda x: x[0]["samples_per_s"])
    return {"samples_per_s": best["samples_per_s"], "step_s": best["step_s"], "from": how}


def score_profile(result: dict, label: str) -> str:
    """Predictions, verdicts and the markdown table of one measured profile, from the
    measurements in ``result`` alone (also what ``rescore`` redoes for a saved run)."""
    n, g, s = result["nodes"], result["nproc_per_node"], result["dilation"]
    prof = result["profiles"][label]
    ceil = prof["ceiling"] = _ceiling(result, prof)
    specs = {r["key"]: r for r in row_specs(result["steps"])}
    spec = {"adapter_params": result["adapter_params"]}
    for cell in prof["rows"]:
        for k in ("predicted_step_s", "predicted_inter_bytes_per_node", "predicted_link_bytes",
                  "plan_error"):
            cell.pop(k, None)
        if cell.get("status") != "ok" or cell["key"] not in specs:
            continue
        pred = predict_row(specs[cell["key"]], spec, prof["inter_link"], result["intra_link"],
                           ceil["step_s"], result["model"], result["batch_size"], n, g)
        if pred:
            cell.update(pred, plan_error=cell["step_s"] / pred["predicted_step_s"] - 1)
    v = prof["verdicts"] = topology_verdicts({c["key"]: c for c in prof["rows"]},
                                             ceil["samples_per_s"], label)
    drate, ddelay = prof["emulated_rate"], prof["emulated_delay"]
    title = (f"{label}: emulated as {drate}" + (f" + {ddelay} one-way" if ddelay else "")
             + f" (dilation x{s:.2f})")
    ceil_text = (f"no-sync ceiling: {ceil['samples_per_s']:.2f} samples/s, step "
                 f"{ceil['step_s']:.2f} s (the faster no-sync run: {ceil['from']}; the "
                 "efficiency and the cost model's compute time)")
    prof["markdown"] = (topology_table(title, prof["rows"], ceil["samples_per_s"]) + "\n\n"
                        + "\n".join(f"- {x}" for x in [result["dilation_text"], ceil_text, *v]))
    return prof["markdown"]


def _write(out: str, result: dict) -> None:
    n, g = result["nodes"], result["nproc_per_node"]
    intra = result["intra_link"]
    head = [f"lorasync bench: {n} emulated nodes x {g} workers, model {result['model']}, "
            f"{result['steps']} steps x batch {result['batch_size']} per rank, "
            f"{result['started']}", "", f"- {result['dilation_text']}",
            f"- unshaped no-sync run: {result['ceiling']['samples_per_s']:.2f} samples/s "
            f"({n} x {g})",
            f"- intra-node link (node0's {g} workers, loopback): "
            + (f"{intra[1] / 1e6:.0f} MB/s, alpha {intra[0] * 1e6:.0f} us" if intra else
               "probe failed")]
    if result.get("rescored"):
        head.append(f"- scored again from the saved measurements: {result['rescored']}")
    result["verdicts"] = [x for p in result["profiles"].values() for x in p["verdicts"]]
    text = "\n".join(head + [p["markdown"] for p in result["profiles"].values()])
    text += f"\n\nbench wall time: {result.get('wall_min', 0):.1f} min\n"
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=str)


def rescore(out: str) -> dict:
    """Score a saved run (its ``results.json``) again with this version's cost model and
    ceiling rule, without running anything; rewrites its results.md and results.json."""
    path = os.path.join(out, "results.json")
    try:
        with open(path) as fh:
            result = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError("--rescore", out, f"give a directory the topology bench wrote "
                          f"(results.json: {exc})") from None
    if "adapter_params" not in result:   # runs saved before it was kept
        result["adapter_params"] = _adapter_params(
            os.path.join(out, f"ceiling-{result['nodes']}x{result['nproc_per_node']}"))
    s = result["dilation"]
    result.setdefault("dilation_text", f"time dilation x{s:.2f} ({result['dilation_how']}): "
                      f"every link runs at rate / {s:.2f} and delay x {s:.2f}, so that "
                      "compute/communication matches the 2-rank runs")
    if "started" not in result:   # runs saved before it was kept: from their results.md
        try:
            with open(os.path.join(out, "results.md")) as fh:
                md = fh.read()
        except OSError:
            md = ""
        m = re.search(r", (\d{4}-\d\d-\d\d \d\d:\d\d)\n", md)
        result["started"] = m.group(1) if m else "(date not kept)"
        m = re.search(r"bench wall time: ([\d.]+) min", md)
        if m:
            result["wall_min"] = float(m.group(1))
    for label in result["profiles"]:
        score_profile(result, label)
    result["rescored"] = time.strftime("%Y-%m-%d %H:%M")
    _write(out, result)
    return result


def _adapter_params(run_dir: str) -> int:
    with open(os.path.join(run_dir, "ceiling", "summary.json")) as fh:
        return int(json.load(fh)["adapter_params"])
