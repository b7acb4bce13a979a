"""A row of the 2-node bench: its spec, running it on an emulated cluster, reading its results.

Owns the ``Row`` (``lorasync train`` arguments and what the run left), the
``lorasync train`` arguments every row of a bench shares, running a row
(and the TCP tuning of the nodes around tuned rows), the quick probe of the
emulated link, and reading a row's summary and metrics: its mean step time,
auto's steady state after its last switch, and the cost model's step time
next to the measured one.  Used by the progressive bench and by the scripts
in bench/ that run rows of their own.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from lorasync.bench.profiles import round_trip
from lorasync.errors import ConfigError, EnvironmentProblem

__all__ = ["Row", "prepare_run", "run_row", "partial_summary", "cluster_world", "tune_nodes", "probe_link", "describe_net",
           "after_last_switch", "row_strategy", "measured_step_s", "predict_rows"]


@dataclass
class Row:
    """One row of the 2-node bench: ``lorasync train`` arguments (``args``), with
    TCP tuning or without, and what its run left (status, summary.json, extra
    figures such as the prediction)."""

    key: str
    label: str
    args: list[str]
    tune: bool = False
    status: str = "pending"
    summary: dict | None = None
    extra: dict = field(default_factory=dict)
    #: what torchrun runs: ``lorasync`` (``lorasync train``) or a peer row's
    #: worker, ``lorasync.bench.peers`` (its ``args`` come before the train flags)
    module: str = "lorasync"
    #: the round of an interleaved run (``--rounds``): its own run folder
    round: int = 0
    #: a peer row (another system's sync): compared with auto
    peer: bool = False

    @property
    def run_name(self) -> str:
        return self.key + (f"-r{self.round + 1}" if self.round else "")


def prepare_run(args, prefix: str = "") -> tuple[str, list[str]]:
    """The results folder of a bench invocation (``--output-dir``, else
    bench/results/PREFIX<date>-<time>; created) and the ``lorasync train``
    arguments all its rows share; the embedded default model is fetched first."""
    out = os.path.abspath(args.output_dir or os.path.join(
        "bench", "results", prefix + time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    if args.model == "smollm2-135m":
        from lorasync.train.model import ensure_embedded
        ensure_embedded(log=lambda m: print(m, file=sys.stderr))
    common = ["--model", args.model, "--max-steps", str(args.steps), "--batch-size",
              str(args.batch_size), "--eval-size", str(args.eval_size), "--no-eval-before",
              "--ckpt-interval", "0", "--no-progress", "--warmup-steps", "0"]
    return out, common


def run_row(cluster, row: Row, common: list[str], out: str, timeout: float,
            time_limit: float = 0.0, cpu_cap: float | None = None) -> None:
    """Train ``row`` on the emulated cluster: its summary, status and wall time
    into ``row`` (a run past ``timeout`` is stopped and reported as hung).
    With ``time_limit`` (shorter than ``timeout``) a row still running then is
    stopped and scored on the steps it finished ("capped"), if it finished at
    least two after its first.  ``cpu_cap``: the ranks' cores (see
    :func:`lorasync.emulate.launch.launch_on_cluster`)."""
    from lorasync.emulate.launch import launch_on_cluster

    run_dir = os.path.join(out, row.run_name)
    argv = (["train", *common, *row.args, "--output-dir", run_dir] if row.module == "lorasync"
            else [*row.args, *common, "--output-dir", run_dir])
    limit = min(timeout, time_limit) if time_limit else timeout
    t0 = time.time()
    rc = launch_on_cluster(cluster, argv, timeout=limit, module=row.module,
                           log_dir=os.path.join(out, f"{row.run_name}-logs"), cpu_cap=cpu_cap)
    row.extra["wall_s"] = time.time() - t0
    partial = partial_summary(run_dir, cluster_world(cluster)) if rc == 124 and \
        limit < timeout else None
    if partial:
        row.status = (f"capped: stopped after {limit:.0f} s (--row-time-limit), "
                      f"{partial['steps']} steps")
        row.summary = partial
        row.extra["capped_steps"] = partial["steps"]
    elif rc == 124 and limit < timeout:
        n = finished_steps(run_dir, cluster_world(cluster))
        row.status = (f"capped: stopped after {limit:.0f} s (--row-time-limit) with {n} "
                      f"step(s) done, too few to score (3 needed)")
    elif rc == 124:
        row.status = f"hung: stopped after {limit:.0f} s"
    elif rc != 0:
        row.status = f"failed (exit {rc}; see {row.key}-logs)"
    else:
        row.status = "ok"
        row.summary = _read_json(os.path.join(run_dir, "summary.json"))
        row.extra.update(after_last_switch(os.path.join(run_dir, "metrics.jsonl")))


def cluster_world(cluster) -> int:
    """Ranks of an emulated cluster (one per node unless it says otherwise)."""
    return len(cluster.nodes) * (getattr(getattr(cluster, "spec", None), "nproc_per_node", 1)
                                 or 1)


def _step_records(run_dir: str, world: int) -> list[dict]:
    from lorasync.monitor.metrics import read_jsonl_records

    return [{r["step"]: r for r in read_jsonl_records(os.path.join(run_dir, "ranks",
                                                                   f"rank{i}.jsonl"))
             if "event" not in r and "step" in r} for i in range(world)]


def finished_steps(run_dir: str, world: int) -> int:
    """Steps every rank of a (stopped) run finished."""
    per = _step_records(run_dir, world)
    return len(set.intersection(*(set(p) for p in per))) if per else 0


def partial_summary(run_dir: str, world: int) -> dict | None:
    """The figures of ``summary.json`` (samples/s, sync share, wire bytes per
    step, all over the steps after the first, every step as slow as its
    slowest rank) from the per-rank step records of a run that was stopped;
    None with fewer than two steps after the first finished by every rank."""
    from lorasync.monitor.metrics import FIRST_STEP, KEEP_ALL, steady_state

    per = _step_records(run_dir, world)
    common = sorted(set.intersection(*(set(p) for p in per))) if per else []
    if len(common) < 3:
        return None
    # summary.json's first step left out; two steps or more are left (checked
    # above); a record without wire_bytes counts as nothing sent
    st = steady_state([[{"wire_bytes": 0, **p[s]} for s in common] for p in per],
                      leave_out=FIRST_STEP, when_none_left=KEEP_ALL)
    return {"world_size": world, "strategy": st.rank0[-1].get("strategy"), "steps": st.steps,
            "samples_per_s": st.samples_per_s,
            "step_s_median": st.step_s_median,
            "sync_share": st.sync_share,
            "wire_bytes_per_step": st.wire_bytes_per_step,
            "eval_after": None, "partial": True}


def tune_nodes(cluster, rate: str, delay: str, out: str, action: str) -> None:
    """``lorasync tune --apply`` (for the link's rate and round trip) or
    ``--revert`` (``action``) in every node's namespace, each node's backup in
    ``out``: the bench applies it for a run of tuned rows and reverts it after."""
    import subprocess

    for n in cluster.nodes:
        backup = os.path.join(out, f"tune-backup-{n.name}.json")
        args = [sys.executable, "-m", "lorasync", "tune", "--backup", backup]
        if action == "apply":
            args += ["--apply", "--rate", rate] + (["--rtt", round_trip(delay)] if delay else [])
        else:
            args += ["--revert"]
        p = subprocess.run(cluster.exec_argv(n.index, args), capture_output=True, text=True)
        if p.returncode not in (0, 1):
            raise EnvironmentProblem(f"lorasync tune --{action} failed in {n.name}: "
                                     f"{p.stderr.strip().splitlines()[-1:]}")


def probe_link(cluster, out: str, timeout: float):
    """A quick ``lorasync probe`` on the emulated link -> (Net or None, text)."""
    from lorasync.emulate.launch import launch_on_cluster
    from lorasync.plan.net import net_from_probe

    path = os.path.join(out, "probe.json")
    rc = launch_on_cluster(cluster, ["probe", "--quick", "--no-pairs", "--output", path],
                           timeout=timeout, log_dir=os.path.join(out, "probe-logs"))
    if rc != 0 or not os.path.isfile(path):
        return None, f"probe failed (exit {rc}; see probe-logs): no predictions"
    try:
        net, _ = net_from_probe(_read_json(path))
    except (ConfigError, ValueError) as exc:
        return None, f"probe JSON not usable ({exc}): no predictions"
    return net, describe_net(net)


def describe_net(net) -> str:
    """One line on the probed network model."""
    from lorasync.units import fmt_duration, fmt_rate

    return (f"probe: all-reduce bandwidth {fmt_rate(net.bandwidth_Bps)}, "
            f"alpha {fmt_duration(net.alpha_s)}")


def _read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


def after_last_switch(metrics_path: str) -> dict:
    """For a run that switched strategy (auto): samples/s over the steps after
    its last switch, so its steady state can be set beside the fixed rows
    (the overall figure also holds auto's measuring steps)."""
    from lorasync.monitor.metrics import KEEP_NONE, steady_state

    try:
        with open(metrics_path) as fh:
            recs = [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return {}
    switched = [r["step"] for r in recs if r.get("switch")]
    if not recs:
        return {}
    if not switched:   # auto kept its first pick (or what it measured with) throughout
        return {"final_strategy": max(recs, key=lambda r: r["step"]).get("strategy")}
    last = max(switched)
    final = max(recs, key=lambda r: r["step"]).get("strategy")
    ranks = sorted({r.get("rank", 0) for r in recs})
    # every step up to the last switch is left out: auto's measuring and
    # the strategies it left; no step after it, no figure
    st = steady_state([[r for r in recs if r.get("rank", 0) == k] for k in ranks],
                      leave_out=last, when_none_left=KEEP_NONE)
    if not st.counted:
        return {"last_switch_step": last, "final_strategy": final}
    return {"last_switch_step": last, "final_strategy": final,
            "steps_after_switch": len(st.counted),
            "samples_per_s_after_switch": st.samples_per_s}


def row_strategy(row: Row) -> tuple[str, dict, float] | None:
    """(strategy, options, bucket MiB) of a row the cost model knows, else None."""
    from lorasync.config import parse_options
    from lorasync.catalog import NONE, STRATEGIES

    a = row.args
    if "--comm" not in a:
        return None   # a peer row: the peer's own sync, no cost model of it
    name = a[a.index("--comm") + 1]
    if name not in STRATEGIES and name != NONE:
        return None  # auto (switches), torch's hooks
    opts = parse_options([a[i + 1] for i, x in enumerate(a) if x == "--comm-opt"])
    bucket = float(a[a.index("--bucket-mb") + 1]) if "--bucket-mb" in a else 1.0
    return name, opts, bucket


def measured_step_s(summary: dict, batch: int) -> float:
    """Mean seconds per optimizer step over the measured steps (periodic syncs
    included, unlike the median)."""
    return summary["world_size"] * batch / summary["samples_per_s"]


def predict_rows(rows: list[Row], net, ceiling: dict, model: str, batch: int) -> None:
    """Put the cost model's step time next to each measured row (``row.extra``)."""
    from lorasync.plan.costmodel import MODELS, MiB, Workload, head_share, lora_matrices, predict

    compute = measured_step_s(ceiling, batch)
    numel = int(ceiling["adapter_params"])
    matrices = lora_matrices(MODELS[model]) if model in MODELS else None
    head = head_share(MODELS[model]) if model in MODELS else 0.0
    if matrices and sum(r * c for r, c in matrices) != numel:
        matrices = None  # another adapter shape: PowerSGD falls back to its assumption
    for row in rows:
        spec = row_strategy(row) if row.summary else None
        if spec is None:
            continue
        name, opts, bucket = spec
        wl = Workload(adapter_params=numel, compute_s=compute, batch_size=batch,
                      head_share=head, bucket_bytes=int(bucket * MiB), matrices=matrices,
                      options={name: opts} if opts else {})
        pred = predict(name, net, wl)
        measured = measured_step_s(row.summary, batch)
        row.extra.update(predicted_step_s=pred.step_s, measured_step_s=measured,
                         plan_error=measured / pred.step_s - 1)
