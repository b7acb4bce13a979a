#!/usr/bin/env python3
"""Time to quality: how long each strategy takes to reach exact all-reduce's loss on a slow link.

    sudo .venv/bin/python bench/time_to_quality.py [--links 1mbit,10mbit] [--steps 120]
        [--max-steps 160] [--budget 2.0] [--candidates ddp,fp16,...] [--json FILE]

samples/s says how fast a strategy trains; it does not say how many samples
it needs.  This bench measures what a user waits for:

1. The target.  Exact fp32 all-reduce (``--comm allreduce``) trains
   ``--steps`` steps (over loopback: its losses do not depend on the link)
   with every run's schedule (cosine over ``--max-steps``, so runs that go
   on past ``--steps`` see the same learning rates); its eval loss after
   ``--steps`` steps is the target, and the eval step where it first got
   there its samples to target.  Two more seeds give the quality rule of
   bench/strategies.py: eval loss after ``--steps`` steps at most the worst
   of the three seeds + 5%.
2. The no-network ideal: exact sync at zero communication cost = the
   no-sync ceiling's time per sample (``--comm none`` on the emulated
   nodes, the faster of a run at the start and one at the end) x the
   reference's samples to target.
3. Per link (2 emulated nodes, htb-shaped): every candidate trains,
   evaluated every ``--eval-interval`` steps, until its eval loss reaches
   the target (but at least ``--steps`` steps, for the quality rule), or
   until its training time passes ``--budget`` x the ideal, or
   ``--max-steps``.  Its time to target is the training time (the sum of its
   steps, each as long as its slowest rank; evaluations and start-up left
   out) up to the first evaluation at or under the target; the ratio to the
   ideal is the figure of merit.  Between outer syncs a local SGD / DiLoCo
   run's evaluation is of the mean of its ranks' adapters, the model the run
   would give if it stopped there (``--eval-replicas own``: each rank's own
   replica on its share of the examples, as runs before 2026-12-03 did).
4. Training alone (``--speed-run``, the default): every candidate that
   reached the target trains again, without evaluations, up to the step
   where it did.  An evaluation settles a sync in flight first (it gives
   the link no free time), so with a fragment always in flight every
   evaluation exposes one transfer; the ceiling is timed without
   evaluations, and so is this run.
   Its samples/s, exposed sync and time to the step where the first run
   reached the target are reported beside the first run's: for a strategy
   whose losses follow its schedule (all but ``auto``, which re-plans from
   timings) the steps are the same, only their times differ.

Candidates: plain DDP (fp32, 25 MB buckets, buffer broadcast), torch's
PowerSGD hook (rank 1), fp16, top-k, DiLoCo with fp16 deltas one step late
(the previous best), the new DiLoCo outer syncs (fp16, int8, int4 and 3%
top-k with int4 values, and int8 with an outer step every 4 steps instead
of 8) each with the streaming delay and fragment count the planner picks
for the probed link and the measured compute
(:func:`lorasync.plan.periodic.hide_sync`), and ``auto``.  Every lorasync
row also gets the cost model's step time next to the measured one.

Peer rows (docs/peers.md), on the same nodes, data, inner optimizer and
evaluation, only the sync differs: ``localsgd_K`` (accelerate's LocalSGD
every K steps) and ``torchft_diloco`` / ``torchft_streaming`` (torchft's
DiLoCo, the lighthouse started on node 0).  ``--rounds N`` interleaves N
rounds of the candidates; each figure is then a median with its range, and
auto is compared with the best peer's time to target (issue 33: <= 0.8x).

``--workload NAME`` (lorasync.bench.workloads, docs/benchmarks.md): the links
are a GPU user's for that workload.  The no-sync ceiling then runs first on
an unshaped cluster, and each link is emulated at the user's rate divided by
the dilation its step gives (the workload's sync bytes per second of compute
over this host's); every table states the workload, the dilation and the
user's link.

Each link prints a table and the targets of issue 17: the best strategy at
1 Mbit/s at >= 90% of the ceiling's samples/s with the quality rule met;
time to target <= 1.15x the ideal at 10 Mbit/s and <= 1.3x at 1 Mbit/s;
encode+decode of the new codecs <= 5% of a compute step; cost model within
15%.  A small JSON of the results (``--json``) is what bench/reference/
holds.  Root is needed (network namespaces); everything is taken down at
the end, also on failure and Ctrl-C.  Run it under ``flock /work/bench.lock``
on a shared machine; compare ratios of one run, not times across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from lorasync.bench.peers import (  # noqa: E402
    LIGHTHOUSE_PORT, LOCALSGD_PREFIX, TORCHFT_ROWS, is_peer_row, peer_row, torchft_row,
)
from lorasync.bench.peers import start_lighthouse as _start_lighthouse  # noqa: E402
from lorasync.bench.profiles import dilate, rate_bps  # noqa: E402
from lorasync.bench.rows import probe_link  # noqa: E402
from lorasync.bench.workloads import dilation, get_workload  # noqa: E402
from lorasync.bench.tables import fmt_spread, gap_verdict, median_range  # noqa: E402
from lorasync.plan.costmodel import (  # noqa: E402
    MODELS, MiB, Workload, head_share, lora_matrices, predict,
)
from lorasync.plan.periodic import hide_sync  # noqa: E402

#: DiLoCo outer syncs the planner tunes per link (delay, fragments)
VARIANTS = {
    "diloco_fp16_tuned": {"delta_dtype": "fp16"},
    "diloco_int8": {"delta_dtype": "int8"},
    "diloco_int4": {"delta_dtype": "int4"},
    "diloco_int4_top3": {"delta_dtype": "int4", "delta_topk": 0.03},
    # an outer step every 4 inner steps instead of 8: fewer samples to a
    # loss (docs/slow-links.md: DiLoCo's 8 needs 17% more than exact sync
    # at 10 Mbit/s) for twice the bytes
    "diloco_int8_p4": {"delta_dtype": "int8", "period": 4},
}
DEFAULT_CANDIDATES = ("ddp", "torch_powersgd", "fp16", "topk", "diloco_fp16", *VARIANTS, "auto")
#: the issue's targets: ratio to the ideal per link, share of the ceiling at 1 Mbit/s
TTQ_TARGET = {"1mbit": 1.3, "10mbit": 1.15}
SPEED_TARGET = {"1mbit": 0.90}


@dataclass
class Run:
    key: str
    label: str
    args: list[str]
    options: dict = field(default_factory=dict)
    status: str = "pending"
    steps: list[dict] = field(default_factory=list)   # per step: max step_s, samples, ...
    evals: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    speed: "Run | None" = None   # the same run again without evaluations (--speed-run)
    module: str = "lorasync"     # a peer row: lorasync.bench.peers (its args come first)
    round: int = 0


def fixed_args(key: str) -> tuple[list[str], dict]:
    """``lorasync train`` arguments of a candidate that needs no planning."""
    table = {
        "ceiling": (["--comm", "none"], {}),
        "ddp": (["--comm", "allreduce", "--bucket-mb", "25", "--broadcast-buffers"], {}),
        "torch_powersgd": (["--comm", "torch_powersgd", "--bucket-mb", "25"], {}),
        "fp16": (["--comm", "fp16"], {}),
        "topk": (["--comm", "topk"], {}),
        "diloco_fp16": (["--comm", "diloco"], {"streaming": True, "delta_dtype": "fp16"}),
        "auto": (["--comm", "auto", "--comm-opt", "batch_size=4"], {}),
    }
    args, opts = table[key]
    return args + [x for k, v in opts.items() for x in ("--comm-opt", f"{k}={_v(v)}")], opts


#: peer rows (docs/peers.md): another system's sync on lorasync's own trainer
#: (lorasync.bench.peers: the same rows as in ``lorasync bench --rows``)
PEER_PREFIX = LOCALSGD_PREFIX
TORCHFT = TORCHFT_ROWS


def peer_run(key: str, lighthouse: str = "") -> "Run":
    """The Run of a peer candidate (lorasync.bench.peers): ``localsgd_K`` or a
    torchft one (``lighthouse``: the URL of the lighthouse the bench started)."""
    label, args, opts = peer_row(key, lighthouse)
    return Run(key, label, args, opts, module="lorasync.bench.peers")


is_peer = is_peer_row


def _v(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def label_of(key: str, opts: dict) -> str:
    names = {"ceiling": "no sync (ceiling)", "ddp": "plain DDP (fp32)",
             "torch_powersgd": "torch PowerSGD (rank 1)", "fp16": "fp16", "topk": "top-k 10%",
             "diloco_fp16": "DiLoCo fp16, 1 step late", "auto": "auto"}
    if key in names:
        return names[key]
    dt = opts.get("delta_dtype", "fp32") + (f" top {opts['delta_topk']:g}"
                                            if opts.get("delta_topk", 1) < 1 else "")
    every = f", every {opts['period']} steps" if "period" in opts else ""
    return (f"DiLoCo {dt}{every}, {opts.get('delay')} step(s) late, "
            f"{opts.get('fragments', 1)} fragment(s)")


# ----------------------------------------------------------------------------- reading runs

from lorasync.monitor.metrics import FIRST_STEP, KEEP_ALL, KEEP_NONE, steady_state  # noqa: E402
from lorasync.monitor.metrics import read_jsonl_records as _jsonl  # noqa: E402


def read_progress(run_dir: str, world: int) -> tuple[list[dict], list[dict]]:
    """(steps every rank finished: step, max step_s, samples, comm_s, encode_s,
    compute_s; evaluations) of a run, finished or not."""
    # step records only (the streams also hold start/end events); a step run
    # again after a restart: its latest record
    per = [{r["step"]: r for r in _jsonl(os.path.join(run_dir, "ranks", f"rank{i}.jsonl"))
            if "event" not in r} for i in range(world)]
    steps = []
    for s in sorted(set.intersection(*(set(p) for p in per)) if per else []):
        rs = [p[s] for p in per]
        steps.append({"step": s, "step_s": max(r["step_s"] for r in rs),
                      "samples": sum(r["samples"] for r in rs),
                      "comm_s": max(r["comm_s"] for r in rs),
                      "encode_s": max(r["encode_s"] for r in rs),
                      "compute_s": min(r["compute_s"] for r in rs),
                      "strategy": rs[0].get("strategy")})
    return steps, _jsonl(os.path.join(run_dir, "evals.jsonl"))


def train_time(steps: list[dict], upto: int | None = None) -> float:
    return sum(s["step_s"] for s in steps if upto is None or s["step"] <= upto)


def first_reach(evals: list[dict], target: float) -> dict | None:
    return next((e for e in sorted(evals, key=lambda e: e["step"])
                 if e.get("eval_loss") is not None and e["eval_loss"] <= target), None)


def eval_at(evals: list[dict], step: int) -> float | None:
    """The evaluation due at ``step``: the trainer runs it one step later when
    a streamed outer sync left at ``step`` and lands after the next one
    (lorasync train, --eval-interval)."""
    return next((e["eval_loss"] for e in sorted(evals, key=lambda e: e["step"])
                 if step <= e["step"] <= step + 1), None)


# ----------------------------------------------------------------------------- running

#: children that stopping a run must leave alone (a torchft lighthouse)
_KEEP: set[int] = set()


def _children() -> list[int]:
    """Processes this one started (the torchrun agents of a run)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in _KEEP:
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def run_on_cluster(cluster, run: Run, common: list[str], out: str, timeout: float,
                   stop) -> None:
    """Train ``run`` on the cluster until ``stop(steps, evals)`` names a reason
    (then its agents are sent SIGTERM: they stop their workers) or it ends."""
    from lorasync.emulate.launch import launch_on_cluster

    name = run.key + (f"-r{run.round}" if run.round else "")
    run_dir = os.path.join(out, name)
    argv = (["train", *common, *run.args, "--output-dir", run_dir] if run.module == "lorasync"
            else [*run.args, *common, "--output-dir", run_dir])
    box: dict = {}
    th = threading.Thread(target=lambda: box.update(rc=launch_on_cluster(
        cluster, argv, timeout=timeout, module=run.module,
        log_dir=os.path.join(out, f"{name}-logs"))), daemon=True)
    t0 = time.time()
    th.start()
    why = None
    while th.is_alive():
        th.join(2.0)
        if why is None and th.is_alive():
            steps, evals = read_progress(run_dir, len(cluster.nodes))
            why = stop(steps, evals)
            if why:
                for pid in _children():
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
    th.join()
    run.steps, run.evals = read_progress(run_dir, len(cluster.nodes))
    rc = box.get("rc")
    run.extra["wall_s"] = time.time() - t0
    run.status = (f"stopped: {why}" if why else "ok" if rc == 0 else
                  f"hung: stopped after {timeout:.0f} s" if rc == 124 else f"failed (exit {rc})")


def run_reference(seed: int, a, out: str) -> Run:
    """Exact all-reduce over loopback: the target and the quality rule."""
    run = Run(f"reference_seed{seed}", f"allreduce seed {seed} (loopback)", [])
    run_dir = os.path.join(out, run.key)
    cmd = [sys.executable, "-m", "lorasync", "train", *common_args(a), "--comm", "allreduce",
           "--seed", str(seed), "--stop-after", str(a.steps), "--nproc", str(a.nodes),
           "--output-dir", run_dir]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.row_timeout * 4)
    run.steps, run.evals = read_progress(run_dir, a.nodes)
    run.extra["wall_s"] = time.time() - t0
    run.status = "ok" if p.returncode == 0 else f"failed (exit {p.returncode}): " + \
        " ".join(p.stderr.strip().splitlines()[-1:])
    return run


def start_lighthouse(cluster, nodes: int, folder: str) -> subprocess.Popen:
    """torchft's lighthouse on node 0 (lorasync.bench.peers.start_lighthouse),
    left alone when a run's agents are stopped."""
    try:
        p = _start_lighthouse(cluster, nodes, folder)
    except FileNotFoundError as exc:
        raise SystemExit(f"time_to_quality: {exc}")
    _KEEP.add(p.pid)
    return p


def target_from(a):
    """(target, limit, reference samples, [], reference losses) of an earlier
    invocation, refused unless its task was this one's."""
    with open(a.target_from) as fh:
        d = json.load(fh)
    same = ("model", "batch_size", "steps", "max_steps", "eval_interval", "eval_size",
            "nodes", "eval_replicas")
    diff = [k for k in same if d["args"].get(k) != getattr(a, k)]
    if diff:
        raise SystemExit(f"--target-from {a.target_from}: another task ("
                         + ", ".join(f"{k} {d['args'].get(k)} vs {getattr(a, k)}" for k in diff)
                         + ")")
    return (d["target"], d["quality_limit"], d["reference_samples_to_target"], [],
            [r["eval_at_steps"] for r in d["reference"]])


def common_args(a, ceiling: bool = False, evals: bool = True) -> list[str]:
    """Every run's ``lorasync train`` flags: the same schedule (``--max-steps``),
    evaluations of the loss only (one generated token: exact-match is not
    the figure here, and generation would dominate the bench's time); none
    for the ceiling and for a speed run (``evals=False``)."""
    steps, interval, size = ((a.ceiling_steps, 0, 0) if ceiling else
                             (a.max_steps, a.eval_interval, a.eval_size) if evals else
                             (a.max_steps, 0, 0))
    return ["--model", a.model, "--max-steps", str(steps), "--batch-size",
            str(a.batch_size), "--eval-interval", str(interval), "--eval-size",
            str(size), "--max-new-tokens", "1", "--no-eval-before", "--ckpt-interval", "0",
            "--no-progress", *(["--eval-mean"] if a.eval_replicas == "mean" else [])]


# ----------------------------------------------------------------------------- summarising

def summarize(run: Run, target: float, limit: float | None, ideal_s: float, ceiling_sps: float,
              steps_ref: int) -> dict:
    st = run.steps
    # the first step left out (a one-step run measured all the same), over
    # read_progress's rows: one per step, already reduced over the ranks
    ss = steady_state([st], leave_out=FIRST_STEP, when_none_left=KEEP_ALL)
    steady, sps = ss.rank0, ss.samples_per_s
    reach = first_reach(run.evals, target)
    at = eval_at(run.evals, steps_ref)
    comp = sum(s["compute_s"] for s in steady) / len(steady) if steady else None
    enc = sum(s["encode_s"] for s in steady) / len(steady) if steady else None
    cell = {"key": run.key, "round": run.round, "label": run.label, "options": run.options,
            "status": run.status,
            "steps_run": len(st), "samples_per_s": sps,
            "efficiency": sps / ceiling_sps if sps and ceiling_sps else None,
            "sync_share": ss.sync_share,
            "encode_share": enc / comp if comp else None,
            "eval_at_steps": at, "quality": None if at is None or limit is None else at <= limit,
            "final_strategy": st[-1]["strategy"] if st else None, **run.extra}
    if reach:
        t = train_time(st, reach["step"])
        samples = sum(s["samples"] for s in st if s["step"] <= reach["step"])
        cell.update(reached_step=reach["step"], time_to_target_s=t, samples_to_target=samples,
                    ratio_to_ideal=t / ideal_s if ideal_s else None)
    else:
        t = train_time(st)
        cell.update(reached_step=None, time_to_target_s=None, samples_to_target=None,
                    ratio_to_ideal=None, ratio_lower_bound=t / ideal_s if ideal_s else None,
                    time_lower_bound_s=t)
    cell.update(speed_of(run.speed, cell["reached_step"], ideal_s, ceiling_sps))
    return cell


def speed_of(sp: Run | None, reached: int | None, ideal_s: float, ceiling_sps: float) -> dict:
    """The speed run's figures: samples/s and exposed sync of training alone,
    and its time to the step where the run with evaluations reached the
    target (the same steps: without evaluations nothing but the timing
    changes, and a schedule-driven strategy's losses do not depend on it)."""
    if sp is None:
        return {}
    ss = _speed_steady(sp)
    sps = ss.samples_per_s
    covered = reached is not None and any(s["step"] == reached for s in sp.steps)
    t = train_time(sp.steps, reached) if covered else None
    return {"speed_status": sp.status, "speed_steps_run": len(sp.steps),
            "speed_samples_per_s": sps,
            "speed_efficiency": sps / ceiling_sps if sps and ceiling_sps else None,
            "speed_sync_share": ss.sync_share,
            "speed_time_to_target_s": t,
            "speed_ratio_to_ideal": t / ideal_s if t is not None and ideal_s else None,
            "speed_wall_s": sp.extra.get("wall_s")}


def _f(v, fmt="{:.2f}", none="-"):
    return none if v is None else fmt.format(v)


def table(link: str, cells: list[dict], probe_text: str) -> str:
    alone = any("speed_status" in c for c in cells)
    lines = [f"\n### {link} ({probe_text})\n",
             "| candidate | samples/s (% of ceiling) | exposed sync | encode % of compute | "
             "s/step measured / planned | eval loss @ref steps | steps to target | "
             "time to target | x ideal |" + (
                 " training alone: samples/s (% of ceiling) | exposed | time to target "
                 "(x ideal) |" if alone else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if alone else "")]
    multi = any(c.get("round") for c in cells)
    for c in cells:
        if c["key"] == "ceiling":
            continue
        plan = "-" if c.get("predicted_step_s") is None else (
            f"{c['measured_step_s']:.2f} / {c['predicted_step_s']:.2f} "
            f"({100 * c['plan_error']:+.0f}%)")
        q = "" if c["quality"] is None else (" pass" if c["quality"] else " FAIL")
        ratio = (_f(c["ratio_to_ideal"], "{:.2f}x") if c["ratio_to_ideal"] is not None else
                 f"not reached (> {c['ratio_lower_bound']:.2f}x)"
                 if c.get("ratio_lower_bound") is not None else "-")
        lines.append(
            f"| {c['label']}{' #' + str(c['round'] + 1) if multi else ''}"
            f"{'' if c['status'] == 'ok' or c['status'].startswith('stopped') else ' (' + c['status'] + ')'} | "
            f"{_f(c['samples_per_s'])} ({_f(c['efficiency'], '{:.0%}')}) | "
            f"{_f(c['sync_share'], '{:.0%}')} | {_f(c['encode_share'], '{:.1%}')} | {plan} | "
            f"{_f(c['eval_at_steps'], '{:.4f}')}{q} | {c['reached_step'] or '-'} | "
            f"{_f(c['time_to_target_s'], '{:.0f} s')} | {ratio} |" + (
                "" if not alone else " - | - | - |" if "speed_status" not in c else
                f" {_f(c['speed_samples_per_s'])} ({_f(c['speed_efficiency'], '{:.0%}')})"
                f"{'' if c['speed_status'] == 'ok' else ' (' + c['speed_status'] + ')'} | "
                f"{_f(c['speed_sync_share'], '{:.0%}')} | "
                f"{_f(c['speed_time_to_target_s'], '{:.0f} s')}"
                f"{_f(c['speed_ratio_to_ideal'], ' ({:.2f}x)', '')} |"))
    return "\n".join(lines)


ROUND_FIGURES = ("time_to_target_s", "ratio_to_ideal", "efficiency", "sync_share",
                 "eval_at_steps", "reached_step", "time_lower_bound_s")


def aggregate(cells: list[dict]) -> list[dict]:
    """One row per candidate over its rounds: per figure the median, the
    lowest and the highest of the rounds that have it (``n`` of them), and
    how many rounds reached the target."""
    rows: dict[str, dict] = {}
    for c in cells:
        row = rows.setdefault(c["key"], {"key": c["key"], "label": c["label"],
                                         "options": c["options"], "rounds": 0, "reached": 0,
                                         "statuses": []})
        row["rounds"] += 1
        row["reached"] += c.get("reached_step") is not None
        row["statuses"].append(c["status"])
    for key, row in rows.items():
        mine = [c for c in cells if c["key"] == key]
        for fig in ROUND_FIGURES:
            row[fig] = median_range(c.get(fig) for c in mine)
    return list(rows.values())


_spread = fmt_spread


def rounds_table(link: str, rows: list[dict], rounds: int) -> str:
    lines = [f"\n### {link}: median (range) over {rounds} interleaved rounds\n",
             "| candidate | reached | time to target | x ideal | % of ceiling | exposed sync |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['reached']}/{r['rounds']} | "
                     f"{_spread(r['time_to_target_s'], '{:.0f} s')} | "
                     f"{_spread(r['ratio_to_ideal'], '{:.2f}x')} | "
                     f"{_spread(r['efficiency'], '{:.0%}')} | "
                     f"{_spread(r['sync_share'], '{:.0%}')} |")
    return "\n".join(lines)


#: issue 33's target: auto's time to target <= 0.8x the best peer's
PEER_TTQ_TARGET = 0.8


def peer_verdicts(link: str, rows: list[dict]) -> list[str]:
    """auto against the best peer row: the ratio of their median times to
    target, and "ahead" only where auto's slowest round beats the peer's
    fastest (the gap exceeds the spread)."""
    peers = [r for r in rows if is_peer(r["key"]) and r["time_to_target_s"]
             and r["reached"] == r["rounds"]]
    auto = next((r for r in rows if r["key"] == "auto"), None)
    if not peers and auto is not None:
        return _unreached_peer_verdict(rows, auto)
    if not peers or auto is None:
        return []
    best = min(peers, key=lambda r: r["time_to_target_s"]["median"])
    b = best["time_to_target_s"]
    if not auto["time_to_target_s"] or auto["reached"] < auto["rounds"]:
        return [f"auto did not reach the target in every round ({auto['reached']}/"
                f"{auto['rounds']}); best peer: {best['label']}, {b['median']:.0f} s"]
    t = auto["time_to_target_s"]
    ratio = t["median"] / b["median"]
    ahead = gap_verdict(t, b, higher_is_better=False)
    return [f"auto vs the best peer ({best['label']}): time to target {t['median']:.0f} s vs "
            f"{b['median']:.0f} s = {ratio:.2f}x ({ahead}; target <= {PEER_TTQ_TARGET}x: "
            f"{'met' if ratio <= PEER_TTQ_TARGET else 'NOT met'})"]


def _unreached_peer_verdict(rows: list[dict], auto: dict) -> list[str]:
    """No peer reached the target in any round: each was stopped after at least
    its ``time_lower_bound_s`` of training (its budget).  auto's slowest round
    against the shortest of those is an upper bound on the ratio."""
    out = [r for r in rows if is_peer(r["key"]) and r["reached"] == 0
           and (r.get("time_lower_bound_s") or {}).get("n")]
    if not out:
        return []
    lb = min(r["time_lower_bound_s"]["min"] for r in out)
    names = ", ".join(r["label"] for r in out)
    if not auto["time_to_target_s"] or auto["reached"] < auto["rounds"]:
        return [f"neither auto ({auto['reached']}/{auto['rounds']} rounds) nor the peers "
                f"({names}) reached the target in every round"]
    t = auto["time_to_target_s"]
    ratio = t["max"] / lb
    return [f"auto vs the peers: time to target {t['median']:.0f} s (slowest round "
            f"{t['max']:.0f} s); no peer reached the target ({names}: stopped unreached after "
            f"at least {lb:.0f} s of training), so auto <= {ratio:.2f}x of the best peer's "
            f"(an upper bound; target <= {PEER_TTQ_TARGET}x: "
            f"{'met' if ratio <= PEER_TTQ_TARGET else 'not shown'})"]


def verdicts(link: str, cells: list[dict]) -> list[str]:
    out = []
    ok = [c for c in cells if c["key"] != "ceiling" and c["samples_per_s"]]
    passing = [c for c in ok if c["quality"]]
    # each figure as the run with evaluations gave it and, where there is a
    # speed run, as training alone gave it (the ceiling is timed alone too)
    for what, sps, eff in (("", "samples_per_s", "efficiency"),
                           (", training alone", "speed_samples_per_s", "speed_efficiency")):
        cands = [c for c in passing if c.get(sps)]
        if cands:
            best = max(cands, key=lambda c: c[sps])
            line = (f"best strategy meeting the quality rule{what}: {best['label']} at "
                    f"{best[eff]:.1%} of the no-sync ceiling's samples/s")
            if link in SPEED_TARGET:
                line += (f" (target >= {SPEED_TARGET[link]:.0%}: "
                         f"{'met' if best[eff] >= SPEED_TARGET[link] else 'NOT met'})")
            out.append(line)
    for what, key in (("", "ratio_to_ideal"), (", training alone", "speed_ratio_to_ideal")):
        reached = [c for c in ok if c.get(key) is not None]
        if reached:
            best = min(reached, key=lambda c: c[key])
            line = f"best time to target{what}: {best['label']}, {best[key]:.2f}x the ideal"
            if link in TTQ_TARGET:
                line += (f" (target <= {TTQ_TARGET[link]}x: "
                         f"{'met' if best[key] <= TTQ_TARGET[link] else 'NOT met'})")
            out.append(line)
        elif not what:
            out.append("no candidate reached the target within the budget")
    new = [c for c in ok if c["key"] in VARIANTS and c["encode_share"] is not None]
    if new:
        worst = max(new, key=lambda c: c["encode_share"])
        out.append(f"encode+decode of the new outer syncs: at most {worst['encode_share']:.1%} "
                   f"of a compute step ({worst['label']}; target <= 5%: "
                   f"{'met' if worst['encode_share'] <= 0.05 else 'NOT met'})")
    planned = [c for c in ok if c.get("plan_error") is not None]
    if planned:
        worst = max(planned, key=lambda c: abs(c["plan_error"]))
        within = sum(abs(c["plan_error"]) <= 0.15 for c in planned)
        out.append(f"cost model vs measured step time: {within}/{len(planned)} within 15%, "
                   f"worst {100 * worst['plan_error']:+.1f}% ({worst['label']})")
    return out


def predict_cell(cell: dict, run: Run, net, compute_s: float, a) -> None:
    """The cost model's step time for a lorasync row (not auto, not torch's hook)."""
    if "--comm" not in run.args:   # a peer row: no cost model of its sync
        return
    name = run.args[run.args.index("--comm") + 1]
    if name in ("auto", "none", "torch_powersgd") or net is None or not run.steps:
        return
    wl = workload(a, compute_s, run)
    wl = Workload(**{**wl.__dict__, "options": {name: run.options}})
    p = predict(name, net, wl)
    # as summarize's samples/s: the first step left out unless it is the only one
    ss = steady_state([run.steps], leave_out=FIRST_STEP, when_none_left=KEEP_ALL)
    measured = ss.wall_s / len(ss.counted)
    cell.update(predicted_step_s=p.step_s, measured_step_s=measured,
                plan_error=measured / p.step_s - 1)


def workload(a, compute_s: float, run: Run | None = None) -> Workload:
    shape = MODELS.get(a.model)
    bucket = 1.0
    if run is not None and "--bucket-mb" in run.args:
        bucket = float(run.args[run.args.index("--bucket-mb") + 1])
    return Workload(adapter_params=a.adapter_params, compute_s=compute_s,
                    batch_size=a.batch_size, head_share=head_share(shape) if shape else 0.0,
                    bucket_bytes=int(bucket * MiB),
                    matrices=lora_matrices(shape) if shape else None)


# ----------------------------------------------------------------------------- main

def main() -> int:
    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import parse_emulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="1mbit,10mbit", help="comma-separated link rates")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120,
                    help="the reference's steps: its eval loss there is the target")
    ap.add_argument("--max-steps", type=int, default=160,
                    help="every run's schedule length and its cap in steps")
    ap.add_argument("--budget", type=float, default=1.6,
                    help="training time a candidate may take, in units of the ideal")
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=64)
    ap.add_argument("--eval-replicas", choices=("mean", "own"), default="mean",
                    help="what a local SGD / DiLoCo run's evaluations between outer syncs "
                         "are of: the mean of the ranks' adapters (the model the run would "
                         "give if it stopped there; lorasync train --eval-mean) or each "
                         "rank's own replica on its share of the examples (before 2026-12-03)")
    ap.add_argument("--speed-run", action=argparse.BooleanOptionalAction, default=True,
                    help="run each candidate that reached the target again without "
                         "evaluations, up to that step, for the speed of training alone "
                         "(the ceiling is timed that way too); an evaluation waits for a "
                         "sync in flight, so evaluating often slows a streamed sync's run")
    ap.add_argument("--seeds", type=int, default=3, help="reference seeds (quality rule)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES))
    ap.add_argument("--ceiling-steps", type=int, default=16)
    ap.add_argument("--row-timeout", type=float, default=1800.0)
    ap.add_argument("--target-from", metavar="FILE", default="",
                    help="take the target, quality limit and reference samples from an "
                         "earlier invocation's --json (the same model, data, batch, steps and "
                         "schedule: the loopback reference is deterministic) instead of "
                         "running the reference again")
    ap.add_argument("--once", default="", metavar="KEYS",
                    help="candidates run in the first round only (with --rounds)")
    ap.add_argument("--time-limit", type=float, default=0.0, metavar="S",
                    help="start no candidate run after S seconds of the bench (0: no limit); "
                         "the closing ceiling run and the results still follow")
    ap.add_argument("--workload", default="", metavar="NAME",
                    help="the links are a GPU user's for this workload (smollm2-h200, "
                         "llama2-7b-r16-h100; lorasync.bench.workloads): the no-sync ceiling "
                         "runs first, unshaped, and each link is emulated at the rate that "
                         "keeps the workload's sync bytes per second of compute")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the candidates this many times, interleaved (round 1: every "
                         "candidate, then round 2 ...); each figure is then the median with "
                         "its range")
    ap.add_argument("--output-dir", default="")
    ap.add_argument("--json", metavar="FILE", help="write the small result JSON here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("time_to_quality: emulated links need root (network namespaces)")
    if a.steps % a.eval_interval:
        raise SystemExit(f"--steps {a.steps} must be a multiple of --eval-interval "
                         f"{a.eval_interval} (the target is an evaluation)")
    if a.max_steps < a.steps:
        raise SystemExit("--max-steps must be at least --steps")
    keys = [k.strip() for k in a.candidates.split(",") if k.strip()]
    unknown = {k for k in keys if not is_peer(k)} - set(DEFAULT_CANDIDATES)
    if unknown:
        raise SystemExit(f"--candidates: unknown {', '.join(sorted(unknown))}; use some of "
                         f"{', '.join(DEFAULT_CANDIDATES)}, or a peer: {PEER_PREFIX}K "
                         "(accelerate's LocalSGD every K steps), " + ", ".join(TORCHFT)
                         + " (optionally :outer_lr=X:outer_momentum=Y)")
    for k in keys:
        try:
            torchft_row(k)
        except ValueError as exc:
            raise SystemExit(f"--candidates: {exc}")
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: give 1 or more")
    if a.workload:
        from lorasync.errors import ConfigError
        try:
            get_workload(a.workload)
        except ConfigError as exc:
            raise SystemExit(f"time_to_quality: {exc}")
    out = os.path.abspath(a.output_dir or os.path.join(
        "bench", "results", "ttq-" + time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    if a.model == "smollm2-135m":
        from lorasync.train.model import ensure_embedded
        ensure_embedded(log=lambda m: print(m, file=sys.stderr))
    t_start = time.time()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    # 1. the target, over loopback (or an earlier invocation's, with the same task)
    refs = []
    if a.target_from:
        target, limit, ref_samples, refs, losses = target_from(a)
        log(f"target from {a.target_from}")
    else:
        for seed in range(a.seeds):
            log(f"reference: allreduce seed {seed}, {a.steps} of {a.max_steps} steps ...")
            refs.append(run_reference(seed, a, out))
            log(f"   {refs[-1].status} ({refs[-1].extra['wall_s']:.0f} s)")
        losses = [eval_at(r.evals, a.steps) for r in refs]
        if losses[0] is None:
            raise SystemExit(f"reference seed 0 has no eval at step {a.steps}: "
                             f"{refs[0].status}")
        target = losses[0]
        limit = max(x for x in losses if x is not None) * 1.05
        ref_reach = first_reach(refs[0].evals, target)
        ref_samples = sum(s["samples"] for s in refs[0].steps if s["step"] <= ref_reach["step"])
    a.adapter_params = None
    log(f"target: eval loss {target:.4f} (seed 0 at step {a.steps}; {ref_samples} samples to "
        f"reach it); quality limit {limit:.4f}")

    tag = f"ttq{os.getpid() % 100000}"
    links = [x.strip() for x in a.links.split(",") if x.strip()]
    results: dict[str, dict] = {}
    ceilings: list[Run] = []
    md = [f"time to quality: {a.nodes} emulated nodes, {a.model}, batch {a.batch_size} per "
          f"rank, schedule {a.max_steps} steps, target = allreduce's eval loss at step "
          f"{a.steps} ({target:.4f}; quality limit {limit:.4f} = worst of {len(losses)} seeds "
          f"+ 5%), {time.strftime('%Y-%m-%d %H:%M')}"]
    pending = []   # (link, runs, net, probe text)
    dil = None
    if a.workload:
        # the ceiling first, unshaped: its step sets every link's dilation
        cdir = os.path.join(out, "calibration")
        os.makedirs(cdir, exist_ok=True)
        log("\n== calibration: no sync, unshaped (the compute step of this host)")
        with emulated(parse_emulate(f"nodes={a.nodes},name={tag}")) as cluster:
            c = Run("ceiling", "no sync (ceiling)", fixed_args("ceiling")[0])
            run_on_cluster(cluster, c, common_args(a, ceiling=True), cdir, a.row_timeout,
                           lambda st, ev: None)
        if len(c.steps) < 2:
            raise SystemExit(f"time_to_quality: the calibration no-sync run {c.status}")
        ceilings.append(c)
        a.adapter_params = adapter_params(os.path.join(cdir, "ceiling"))
        dil = dilation(get_workload(a.workload),
                       train_time(c.steps[1:]) / (len(c.steps) - 1), a.adapter_params)
        log(f"   {dil.text()}")
        md.append(f"\n{dil.text()}.")
    emulated_as = {}
    for li, link in enumerate(links):
        rate = dilate(link, "", dil.rate_div, dil.delay_mul)[0] if dil else link
        emulated_as[link] = rate
        spec = parse_emulate(f"nodes={a.nodes},rate={rate},name={tag}")
        log(f"\n== {link}: {spec.describe()}" + (f" (user link {link}, workload {a.workload})"
                                                  if dil else ""))
        pdir = os.path.join(out, link)
        os.makedirs(pdir, exist_ok=True)
        with emulated(spec) as cluster:
            net, probe_text = probe_link(cluster, pdir, a.row_timeout)
            log(f"   {probe_text}")
            if dil:
                probe_text = (f"user link {link}, emulated as {rate_bps(rate) / 1e6:.3f} Mbit/s; "
                              + probe_text)
            if li == 0 and not dil:
                c = Run("ceiling", "no sync (ceiling)", fixed_args("ceiling")[0])
                run_on_cluster(cluster, c, common_args(a, ceiling=True), pdir, a.row_timeout,
                               lambda st, ev: None)
                ceilings.append(c)
                log(f"   ceiling: {c.status}")
            ceiling = max(ceilings, key=lambda r: sps_of(r) or 0)
            compute = train_time(ceiling.steps[1:]) / max(1, len(ceiling.steps) - 1)
            if a.adapter_params is None:
                a.adapter_params = adapter_params(os.path.join(pdir, "ceiling"))
            ideal = ref_samples / (sps_of(ceiling) or float("inf"))
            runs = []
            for key in keys:
                if key in VARIANTS:
                    if net is None:
                        continue
                    wl = workload(a, compute)
                    wl = Workload(**{**wl.__dict__, "options": {"diloco": VARIANTS[key]}})
                    opts, _ = hide_sync(net, wl, "diloco")
                    opts = {k: v for k, v in opts.items()
                            if k in ("streaming", "delay", "fragments", "delta_dtype",
                                     "delta_topk") or k in VARIANTS[key]}
                    if key == "diloco_fp16_tuned" and opts.get("delay") == 1 \
                            and opts.get("fragments") == 1:
                        continue   # the same as diloco_fp16
                    args = ["--comm", "diloco"] + [x for k, v in opts.items()
                                                   for x in ("--comm-opt", f"{k}={_v(v)}")]
                elif is_peer(key):
                    runs.append(peer_run(key, f"http://{cluster.nodes[0].address}:"
                                              f"{LIGHTHOUSE_PORT}"))
                    continue
                else:
                    args, opts = fixed_args(key)
                runs.append(Run(key, label_of(key, opts), args, opts))
            # rounds interleaved: every candidate once, then again
            once = {k.strip() for k in a.once.split(",") if k.strip()}
            runs = [r if not i else Run(r.key, r.label, r.args, r.options, module=r.module,
                                        round=i)
                    for i in range(a.rounds) for r in runs if not (i and r.key in once)]
            skipped = []
            for run in list(runs):
                if a.time_limit and time.time() - t_start > a.time_limit:
                    # what is left is not started: a bench lock is held for a bounded time
                    log(f"   {run.label}: not run (--time-limit {a.time_limit:g} s passed)")
                    skipped.append(f"{run.key} round {run.round + 1}")
                    runs.remove(run)
                    continue
                budget_s = a.budget * ideal

                def stop(st, ev, run=run, budget_s=budget_s):
                    reach = first_reach(ev, target)
                    done = st[-1]["step"] if st else 0
                    if reach and done >= a.steps and any(e["step"] >= a.steps for e in ev):
                        return f"reached the target at step {reach['step']}"
                    if train_time(st) > budget_s:
                        return f"budget ({a.budget:g}x the ideal, {budget_s:.0f} s) spent"
                    return None

                log(f"   {run.label}" + (f" (round {run.round + 1})" if a.rounds > 1 else "")
                    + " ...")
                # a lighthouse of its own for each torchft run (none is left from an
                # earlier run's replicas)
                lighthouse = start_lighthouse(cluster, a.nodes, pdir) \
                    if torchft_row(run.key) is not None else None
                try:
                    run_on_cluster(cluster, run, [*common_args(a), "--seed", "0"], pdir,
                                   a.row_timeout, stop)
                finally:
                    if lighthouse is not None:
                        _KEEP.discard(lighthouse.pid)
                        lighthouse.kill()
                        lighthouse.wait()
                log(f"   {run.label}: {run.status}, {len(run.steps)} steps "
                    f"({run.extra['wall_s']:.0f} s)")
                reach = first_reach(run.evals, target)
                if a.speed_run and reach:
                    upto = reach["step"]
                    run.speed = Run(run.key + "_speed", run.label, run.args, run.options)
                    log(f"   ... again without evaluations, {upto} steps")
                    run_on_cluster(cluster, run.speed,
                                   [*common_args(a, evals=False), "--seed", "0",
                                    "--stop-after", str(upto)], pdir, a.row_timeout,
                                   lambda st, ev: None)
                    log(f"   training alone: {run.speed.status}, {len(run.speed.steps)} steps "
                        f"({run.speed.extra['wall_s']:.0f} s)")
            if li == len(links) - 1 and len(links) > 0:
                c = Run("ceiling_end", "no sync (ceiling, again)", fixed_args("ceiling")[0])
                run_on_cluster(cluster, c, common_args(a, ceiling=True), pdir, a.row_timeout,
                               lambda st, ev: None)
                ceilings.append(c)
        pending.append((link, runs, net, probe_text, skipped))
    ceiling = max(ceilings, key=lambda r: sps_of(r) or 0)
    ceiling_sps = sps_of(ceiling) or 0.0
    compute = train_time(ceiling.steps[1:]) / max(1, len(ceiling.steps) - 1)
    ideal = ref_samples / ceiling_sps if ceiling_sps else 0.0
    for link, runs, net, probe_text, skipped in pending:
        cells = []
        for run in runs:
            cell = summarize(run, target, limit, ideal, ceiling_sps, a.steps)
            predict_cell(cell, run, net, compute, a)
            cells.append(cell)
        rows = aggregate(cells) if a.rounds > 1 else None
        results[link] = {"probe": probe_text, "cells": cells,
                         **({"rows": rows} if rows else {}),
                         **({"not_run": skipped} if skipped else {})}
        md.append(table(link, cells, probe_text) + "\n\n" + "\n".join(
            f"- {x}" for x in verdicts(link, cells)))
        if rows:
            md.append(rounds_table(link, rows, a.rounds) + "\n\n" + "\n".join(
                f"- {x}" for x in peer_verdicts(link, rows)))
        print(md[-1], flush=True)
    head = (f"\nceiling: {ceiling_sps:.2f} samples/s (the faster of {len(ceilings)} no-sync "
            f"runs); no-network ideal: {ref_samples} samples x {1 / ceiling_sps:.3f} s = "
            f"{ideal:.0f} s of training" if ceiling_sps else "\nno ceiling measured")
    md.insert(1, head)
    print(head)
    text = "\n".join(md) + f"\n\nbench wall time: {(time.time() - t_start) / 60:.1f} min\n"
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(text)
    small = {"args": {k: v for k, v in vars(a).items()},
             **({"workload": dil.as_dict(), "emulated_rate": emulated_as} if dil else {}),
             "target": target, "quality_limit": limit,
             "reference": ([{"seed": i, "eval_at_steps": x, "status": r.status}
                            for i, (r, x) in enumerate(zip(refs, losses))] if refs else
                           [{"seed": i, "eval_at_steps": x, "status": f"from {a.target_from}"}
                            for i, x in enumerate(losses)]),
             "reference_samples_to_target": ref_samples, "ceiling_samples_per_s": ceiling_sps,
             "compute_s_per_step": compute, "ideal_s": ideal, "links": results,
             "wall_min": (time.time() - t_start) / 60}
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(small, fh, indent=1)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(small, fh, indent=1)
    print(f"\nresults: {out}/results.md, results.json", file=sys.stderr)
    return 0


def _speed_steady(run: Run):
    # the first step left out, even of a run that stopped after it: a speed
    # run or a ceiling of one step has no samples/s
    return steady_state([run.steps], leave_out=FIRST_STEP, when_none_left=KEEP_NONE)


def sps_of(run: Run) -> float | None:
    return _speed_steady(run).samples_per_s


def adapter_params(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "summary.json")) as fh:
            return int(json.load(fh)["adapter_params"])
    except (OSError, ValueError, KeyError):
        return 921_600


if __name__ == "__main__":
    raise SystemExit(main())
