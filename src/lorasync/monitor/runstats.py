"""A run's numbers, as the report shows them: per-step series, strategy
switches and the run-level summary.

Definitions (the same as the trainer's ``summary.json``):

* a step is as slow as its slowest rank: global samples/s of a step is the
  sum of ``samples`` over ranks divided by the largest ``step_s``;
* run-level numbers are steady state (:func:`lorasync.monitor.metrics.steady_state`):
  the first step (DDP's bucket rebuild, allocator warm-up) is left out;
  compute, sync share and wire bytes are rank 0's, as in ``summary.json``;
* per-step series of compute / exposed sync / wire bytes are the mean over
  ranks of that step.

A Trainer run's numbers come from its logging windows (means per window of
the ``lorasync/*`` entries), so they are per window, not per step; what a
Trainer run does not log (a plain Trainer has no sync timings or bytes) is
None or nan.
"""

from __future__ import annotations

import os
import re

from lorasync.monitor.metrics import FIRST_STEP, KEEP_ALL, steady_state
from lorasync.monitor.readers import Run

__all__ = ["step_series", "trainer_series", "find_switches", "summarize_run",
           "summarize_trainer"]

# ---------------------------------------------------------------- Trainer runs

#: one switch of a log's ``lorasync/switch``: "step N: from -> to: reason",
#: several joined by "; "
_SWITCH = re.compile(r"step (\d+): (\S+) -> (\S+): (.*?)(?=; step \d+: |$)")


def _windows(logs: list[dict]) -> list[tuple[dict, int]]:
    """(log, optimizer steps since the previous log) for each training log."""
    out, prev = [], 0
    for e in logs:
        out.append((e, max(1, e["step"] - prev)))
        prev = e["step"]
    return out


def _num(e: dict, key: str) -> float | None:
    v = e.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def trainer_series(run: Run) -> list[dict]:
    """One row per logging window of a Trainer run, with step_series' keys;
    nan where the logs have nothing (a plain Trainer: no timings, no bytes)."""
    nan = float("nan")
    rows = []
    for e, _ in _windows(run.trainer["logs"]):
        step_s, comm = _num(e, "lorasync/step_s"), _num(e, "lorasync/comm_s")
        wire, ratio = _num(e, "lorasync/wire_bytes"), _num(e, "lorasync/compression")
        sps = _num(e, "lorasync/samples_per_s")
        rows.append({
            "step": e["step"], "ranks": e.get("lorasync/world_size"), "samples": None,
            "wall_s": step_s if step_s is not None else nan,
            "samples_per_s": sps if sps is not None else nan,
            # the Trainer's step time holds data loading too: all of it is "compute"
            "compute_s": step_s - comm if step_s is not None and comm is not None else nan,
            "comm_s": comm if comm is not None else nan,
            "other_s": 0.0,
            "wire_bytes": wire if wire is not None else nan,
            "fp32_bytes": wire * ratio if wire is not None and ratio is not None else None,
            "loss": float(e["loss"]), "strategy": e.get("lorasync/strategy"), "time": None,
        })
    return rows


def _trainer_switches(logs: list[dict]) -> list[dict]:
    out = []
    for e in logs:
        for m in _SWITCH.finditer(str(e.get("lorasync/switch") or "")):
            out.append({"step": int(m.group(1)), "from": m.group(2), "to": m.group(3),
                        "reason": m.group(4)})
    return out


def summarize_trainer(run: Run) -> dict:
    """summarize_run's keys for a Trainer run, from its logging windows: steady
    state leaves out the first window (it holds step 1), means are weighted by
    the steps of each window; None where the logs do not say."""
    t = run.trainer
    logs, final, results = t["logs"], t["final"], t["results"]
    timed = [(e, w) for e, w in _windows(logs) if _num(e, "lorasync/step_s") is not None
             and _num(e, "lorasync/comm_s") is not None]
    steady = timed[1:] if len(timed) > 1 else timed

    def wmean(key_fn, rows):
        pts = [(key_fn(e), w) for e, w in rows]
        pts = [(v, w) for v, w in pts if v is not None]
        return sum(v * w for v, w in pts) / sum(w for _, w in pts) if pts else None

    step_time = sum(_num(e, "lorasync/step_s") * w for e, w in steady)
    sps_rows = [(e, w) for e, w in steady if _num(e, "lorasync/samples_per_s") is not None]
    # all ranks' samples / time, over the steady windows
    samples = sum(_num(e, "lorasync/samples_per_s") * _num(e, "lorasync/step_s") * w
                  for e, w in sps_rows)
    sps_time = sum(_num(e, "lorasync/step_s") * w for e, w in sps_rows)
    whole = _num(final, "train_samples_per_second")
    if whole is None:
        whole = _num(results, "train_samples_per_second")
    used = []
    for e in logs:
        s = e.get("lorasync/strategy")
        if s is not None and s not in used:
            used.append(s)
    world = next((e["lorasync/world_size"] for e in reversed(logs)
                  if isinstance(e.get("lorasync/world_size"), int)), None)
    runtime = _num(final, "train_runtime")
    if runtime is None:
        runtime = _num(results, "train_runtime")
    before = next((e for e in run.evals if e["step"] == 0), None)
    later = [e for e in run.evals if e["step"] > 0]
    out = {
        "world_size": world,
        "strategy": used[0] if used else None,
        "strategies_used": used,
        "steps": t["state"].get("global_step", logs[-1]["step"]),
        "last_step": t["state"].get("global_step", logs[-1]["step"]),
        "samples_per_s": samples / sps_time if sps_time else None,
        "trainer_samples_per_s": whole,
        "step_s_median": None,
        "step_s_mean": wmean(lambda e: _num(e, "lorasync/step_s"), steady),
        "comm_s_mean": wmean(lambda e: _num(e, "lorasync/comm_s"), steady),
        "sync_share": (sum(_num(e, "lorasync/comm_s") * w for e, w in steady) / step_time
                       if step_time else None),
        "wire_bytes_per_step": wmean(lambda e: _num(e, "lorasync/wire_bytes"), steady),
        "fp32_bytes_per_step": wmean(
            lambda e: (_num(e, "lorasync/wire_bytes") * _num(e, "lorasync/compression")
                       if _num(e, "lorasync/wire_bytes") is not None
                       and _num(e, "lorasync/compression") is not None else None), steady),
        "final_loss": float(logs[-1]["loss"]),
        "eval_before": before, "eval_after": later[-1] if later else None,
        "switches": _trainer_switches(logs),
        "elapsed_s": runtime,
        "trainer": True,
        "source": (f"{t['source']}: log_history, means per logging window weighted by its "
                   "steps, first window left out; compute/sync/bytes are rank 0's"
                   if timed else f"{t['source']}: log_history (no lorasync/* timings)"),
    }
    out["compute_s_mean"] = (out["step_s_mean"] - out["comm_s_mean"]
                             if out["step_s_mean"] is not None and out["comm_s_mean"] is not None
                             else None)
    return out


# ---------------------------------------------------------------- lorasync runs


def _by_step(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in records:
        out.setdefault(r["step"], []).append(r)
    return dict(sorted(out.items()))


def step_series(records: list[dict]) -> list[dict]:
    """One row per step: global samples/s, mean-over-ranks times and bytes."""
    rows = []
    for step, recs in _by_step(records).items():
        n = len(recs)
        wall = max(r["step_s"] for r in recs)
        samples = sum(r["samples"] for r in recs)
        first = min(recs, key=lambda r: r["rank"])
        rows.append({
            "step": step, "ranks": n, "samples": samples, "wall_s": wall,
            "samples_per_s": samples / wall if wall > 0 else float("nan"),
            "compute_s": sum(r["compute_s"] for r in recs) / n,
            "comm_s": sum(r["comm_s"] for r in recs) / n,
            # data loading and whatever else the step did besides compute and sync
            "other_s": sum(max(0.0, r["step_s"] - r["compute_s"] - r["comm_s"])
                           for r in recs) / n,
            "wire_bytes": sum(r["wire_bytes"] for r in recs) / n,
            "fp32_bytes": (sum(r["fp32_bytes"] for r in recs) / n
                           if all("fp32_bytes" in r for r in recs) else None),
            "loss": sum(r["loss"] for r in recs) / n,
            "strategy": first.get("strategy"),
            "time": max((r.get("time") or 0.0) for r in recs),
        })
    return rows


def find_switches(records: list[dict]) -> list[dict]:
    """Strategy changes: a record's ``switch`` field, or ``strategy`` changing
    between steps (a switch not announced in a record still shows)."""
    out: dict[int, dict] = {}
    prev = None
    for step, recs in _by_step(records).items():
        r0 = min(recs, key=lambda r: r["rank"])
        sw = next((r["switch"] for r in recs if isinstance(r.get("switch"), dict)), None)
        cur = r0.get("strategy")
        if sw is not None:
            out[step] = {"step": step, "from": sw.get("from", prev), "to": sw.get("to", cur),
                         "reason": sw.get("reason", "")}
        elif prev is not None and cur is not None and cur != prev:
            out[step] = {"step": step, "from": prev, "to": cur, "reason": ""}
        if cur is not None:
            prev = cur
    return list(out.values())


def _eval_points(run: Run) -> tuple[dict | None, dict | None]:
    """(before, after) eval records: summary.json's when present, else evals.jsonl's
    step-0 record and its last record."""
    if run.summary is not None and ("eval_before" in run.summary or "eval_after" in run.summary):
        return run.summary.get("eval_before"), run.summary.get("eval_after")
    before = next((e for e in run.evals if e.get("step") == 0), None)
    later = [e for e in run.evals if e.get("step", 0) > 0]
    return before, (later[-1] if later else None)


def summarize_run(run: Run) -> dict:
    """Run-level numbers: summary.json's where the trainer wrote one, otherwise
    computed from the records with the trainer's definitions; plus what only
    the records tell (strategies used, switches, wall time)."""
    if run.kind == "trainer":
        return summarize_trainer(run)
    recs = run.records
    ranks = sorted({r["rank"] for r in recs})
    r0 = [r for r in recs if r["rank"] == ranks[0]]
    # summary.json's definitions, for a run that has none: first step left
    # out, a one-step run measured all the same
    st = steady_state([[r for r in recs if r["rank"] == k] for k in ranks],
                      leave_out=FIRST_STEP, when_none_left=KEEP_ALL)
    computed = {
        "world_size": max(r.get("world_size", 0) for r in recs) or len(ranks),
        "strategy": r0[0].get("strategy"),
        "steps": st.steps,
        **st.figures(),
    }
    out = dict(computed)
    if run.summary is not None:
        out.update({k: v for k, v in run.summary.items() if v is not None or k.startswith("eval")})
        out["source"] = "summary.json"
    else:
        out["source"] = "computed from " + ("metrics.jsonl" if os.path.isfile(
            os.path.join(run.path, "metrics.jsonl")) else "ranks/*.jsonl")
    out["eval_before"], out["eval_after"] = _eval_points(run)
    used = []
    for r in r0:
        s = r.get("strategy")
        if s is not None and s not in used:
            used.append(s)
    out["strategies_used"] = used
    out["switches"] = find_switches(recs)
    out["last_step"] = r0[-1]["step"]
    times = [r.get("time") for r in recs if r.get("time")]
    out["elapsed_s"] = (max(times) - min(times) + r0[0]["step_s"]) if times else None
    return out

