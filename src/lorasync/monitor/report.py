"""Self-contained HTML report of one or more run directories.

Reads what a run leaves behind (``metrics.jsonl``, ``evals.jsonl``,
``summary.json``; see docs/contracts.md) and writes one HTML file whose plots
are PNGs embedded as base64 data URIs, so the report can be mailed or
attached to an issue and opens offline.

A transformers Trainer's output directory is one more kind of input: its
``trainer_state.json`` (or the newest ``checkpoint-N/trainer_state.json``)
holds the log history, with the ``lorasync/*`` entries ``lorasync.hf.attach``
adds (docs/huggingface.md).  Those are means per logging window, so a Trainer
run's numbers are per window, not per step; what a Trainer run does not log
(a plain Trainer has no sync timings or bytes) shows as '-'.

Definitions used throughout (the same as the trainer's ``summary.json``):

* a step is as slow as its slowest rank: global samples/s of a step is the
  sum of ``samples`` over ranks divided by the largest ``step_s``;
* run-level numbers are steady state: the first step (DDP's bucket rebuild,
  allocator warm-up) is left out; compute, sync share and wire bytes are
  rank 0's, as in ``summary.json``;
* per-step plots of compute / exposed sync / wire bytes show the mean over
  ranks of that step.

Only matplotlib (Agg, through ``matplotlib.figure.Figure``; no pyplot global
state) is needed; it is imported when a plot is drawn.  Nothing here imports
torch.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field

from lorasync.errors import LorasyncError
from lorasync.monitor.metrics import FIRST_STEP, KEEP_ALL, effective_records, steady_state

__all__ = ["Run", "load_run", "step_series", "trainer_series", "find_switches", "summarize_run",
           "summarize_trainer", "build_report", "write_report", "default_output"]

# Fields without which a record cannot be plotted (docs/contracts.md lists all).
REQUIRED_FIELDS = ("step", "rank", "loss", "samples", "compute_s", "comm_s", "step_s",
                   "wire_bytes")

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")


@dataclass
class Run:
    """What one run directory holds, as read from disk."""

    path: str
    name: str
    records: list[dict]                 # step records, sorted by (step, rank)
    evals: list[dict]                   # evals.jsonl, sorted by step
    summary: dict | None = None         # summary.json as the trainer wrote it
    notes: list[str] = field(default_factory=list)  # things the reader should know
    kind: str = "lorasync"              # or "trainer": a transformers Trainer's output dir
    trainer: dict | None = None         # kind "trainer": what _load_trainer read


# ---------------------------------------------------------------- reading


def _read_jsonl(path: str, required: tuple[str, ...]) -> tuple[list[dict], list[str]]:
    """Records of a JSONL file; a torn *last* line (a crash mid-write) is dropped
    with a note, a damaged line before it is an error (the file is not ours
    to guess about)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise LorasyncError(f"{path}: cannot read ({exc.strerror}); check the path and its "
                            "permissions") from None
    except UnicodeDecodeError:
        raise LorasyncError(f"{path}: not a text file; pass the run directory that "
                            "`lorasync train` wrote") from None
    numbered = [(i + 1, s) for i, s in enumerate(lines) if s.strip()]
    out, notes = [], []
    for k, (lineno, text) in enumerate(numbered):
        try:
            rec = json.loads(text)
        except ValueError:
            if k == len(numbered) - 1:
                notes.append(f"{os.path.basename(path)}: dropped a torn last line "
                             f"(line {lineno}, a crash mid-write)")
                break
            raise LorasyncError(f"{path}:{lineno}: not valid JSON (and not the last line, so "
                                "not a torn write); repair or delete that line") from None
        if not isinstance(rec, dict):
            raise LorasyncError(f"{path}:{lineno}: expected a JSON object, got "
                                f"{type(rec).__name__}; repair or delete that line")
        missing = [f for f in required if f not in rec]
        if missing:
            raise LorasyncError(f"{path}:{lineno}: record lacks {', '.join(missing)}; this is "
                                "not a lorasync metrics file (see docs/contracts.md)")
        out.append(rec)
    return out, notes


def load_run(path: str) -> Run:
    """Read one run directory; ``LorasyncError`` names the path and the fix."""
    if not os.path.exists(path):
        raise LorasyncError(f"{path}: no such run directory; pass the --output-dir of a "
                            "`lorasync train` run")
    if not os.path.isdir(path):
        raise LorasyncError(f"{path}: not a directory; pass a run directory (the --output-dir "
                            "of `lorasync train`), not a file in it")
    notes: list[str] = []
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics):
        records, n = _read_jsonl(metrics, REQUIRED_FIELDS)
        notes += n
        empty_fix = (f"{metrics}: no step records (empty file); the run stopped before its "
                     f"first step: train again with --output-dir {path}")
    else:
        # A run still going, stopped with --stop-after, or crashed has no merged
        # file yet, but every rank streamed its own records as it went.
        folder = os.path.join(path, "ranks")
        streams = sorted(f for f in (os.listdir(folder) if os.path.isdir(folder) else [])
                         if f.startswith("rank") and f.endswith(".jsonl"))
        if not streams:
            trainer = _load_trainer(path)
            if trainer is not None:
                return trainer
            raise LorasyncError(f"{metrics}: not found (nor per-rank streams in {folder}, nor "
                                f"a Trainer's trainer_state.json); {path} is not a lorasync "
                                "run directory: pass the --output-dir of `lorasync train` or "
                                "the output_dir of a transformers Trainer")
        per_rank = []
        for f in streams:
            recs, n = _read_jsonl(os.path.join(folder, f), ())
            per_rank.append(recs)
            notes += [f"ranks/{s}" for s in n]
        # the streams also hold start/fault events and steps run again after a restart
        records = [r for recs in effective_records(per_rank) for r in recs]
        for r in records:
            missing = [k for k in REQUIRED_FIELDS if k not in r]
            if missing:
                raise LorasyncError(f"{folder}: a record lacks {', '.join(missing)}; this is "
                                    "not a lorasync metrics stream (see docs/contracts.md)")
        notes.insert(0, "run not finished (no metrics.jsonl): built from the per-rank "
                        "streams in ranks/, no summary.json")
        empty_fix = (f"{folder}: no step records yet; the run has not finished a step: wait, "
                     f"or train again with --output-dir {path}")
    if not records:
        raise LorasyncError(empty_fix)
    records.sort(key=lambda r: (r["step"], r["rank"]))

    evals: list[dict] = []
    evals_path = os.path.join(path, "evals.jsonl")
    if os.path.isfile(evals_path):
        evals, n = _read_jsonl(evals_path, ("step",))
        notes += n
        evals.sort(key=lambda r: r["step"])

    summary = None
    summary_path = os.path.join(path, "summary.json")
    if os.path.isfile(summary_path) and os.path.isfile(metrics):
        try:
            with open(summary_path, encoding="utf-8") as fh:
                summary = json.load(fh)
            if not isinstance(summary, dict):
                raise ValueError
        except (OSError, ValueError):
            summary = None
            notes.append("summary.json unreadable: run numbers computed from metrics.jsonl")
    faults = (summary or {}).get("faults") or {}
    if faults.get("faults") or faults.get("joins"):
        notes.append(f"the run recovered from {faults.get('faults', 0)} fault(s)"
                     + (f" and took in {faults['joins']} joining node(s)" if faults.get("joins")
                        else "")
                     + f": {faults.get('steps_redone', 0)} step(s) redone, "
                     f"{faults.get('time_lost_s') or 0:.0f} s lost (docs/faults.md)")
    name = os.path.basename(os.path.normpath(os.path.abspath(path))) or path
    return Run(path=path, name=name, records=records, evals=evals, summary=summary, notes=notes)


# ---------------------------------------------------------------- Trainer output dirs

#: what a log entry of the Trainer's training logs holds (evaluations hold eval_*)
_TRAIN_LOG = "loss"
_SWITCH = re.compile(r"step (\d+): (\S+) -> (\S+): (.*?)(?=; step \d+: |$)")


def _trainer_state_path(path: str) -> tuple[str, int | None] | None:
    """(trainer_state.json, checkpoint step or None): the top one, which
    ``trainer.save_state()`` writes after training (with the final log), else
    the newest checkpoint's."""
    top = os.path.join(path, "trainer_state.json")
    if os.path.isfile(top):
        return top, None
    ckpts = []
    for f in os.listdir(path):
        m = re.fullmatch(r"checkpoint-(\d+)", f)
        if m and os.path.isfile(os.path.join(path, f, "trainer_state.json")):
            ckpts.append((int(m.group(1)), f))
    if not ckpts:
        return None
    step, f = max(ckpts)
    return os.path.join(path, f, "trainer_state.json"), step


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise LorasyncError(f"{path}: cannot read ({exc.strerror}); check the path and its "
                            "permissions") from None
    except (ValueError, UnicodeDecodeError):
        raise LorasyncError(f"{path}: not valid JSON; {what}") from None
    if not isinstance(data, dict):
        raise LorasyncError(f"{path}: expected a JSON object, got {type(data).__name__}; {what}")
    return data


def _load_trainer(path: str) -> Run | None:
    """A transformers Trainer's output directory as a Run (None: not one)."""
    found = _trainer_state_path(path)
    if found is None:
        return None
    state_path, ckpt = found
    fix = "pass the output_dir of a transformers Trainer (trainer_state.json as it wrote it)"
    state = _read_json(state_path, fix)
    history = state.get("log_history")
    if not isinstance(history, list) or not all(isinstance(e, dict) for e in history):
        raise LorasyncError(f"{state_path}: no log_history list; {fix}")
    logs = sorted((e for e in history if _TRAIN_LOG in e and isinstance(e.get("step"), int)
                   and not any(k.startswith("eval_") for k in e)), key=lambda e: e["step"])
    if not logs:
        raise LorasyncError(f"{state_path}: no training logs in log_history (the Trainer logs "
                            "every logging_steps steps); train with logging_steps smaller than "
                            "max_steps, or pass another run")
    final = next((e for e in reversed(history) if "train_runtime" in e), {})
    results = {}
    if "train_samples_per_second" not in final:
        # transformers' example scripts write the final metrics with save_metrics()
        for f in ("train_results.json", "all_results.json"):
            if os.path.isfile(os.path.join(path, f)):
                results = _read_json(os.path.join(path, f), fix)
                break
    evals = sorted(({"step": e["step"], "eval_loss": e["eval_loss"]} for e in history
                    if isinstance(e.get("eval_loss"), (int, float))
                    and isinstance(e.get("step"), int)), key=lambda e: e["step"])
    rel = os.path.relpath(state_path, path)
    notes = [f"a transformers Trainer's output directory: read {rel} (log_history every "
             f"{state.get('logging_steps', '?')} steps)"]
    if ckpt is not None:
        notes.append(f"no trainer_state.json at the top (the script did not call "
                     f"trainer.save_state()): read the newest checkpoint's, which ends at step "
                     f"{ckpt}, before the Trainer's final log")
    if not any("lorasync/step_s" in e for e in logs):
        notes.append("no lorasync/* timings in the logs (a Trainer without "
                     "lorasync.hf.attach): sync time and bytes are '-', samples/s is the "
                     "Trainer's own figure for the whole run")
    name = os.path.basename(os.path.normpath(os.path.abspath(path))) or path
    return Run(path=path, name=name, records=[], evals=evals, notes=notes, kind="trainer",
               trainer={"state": state, "logs": logs, "final": final, "results": results,
                        "source": rel, "checkpoint": ckpt})


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


# ---------------------------------------------------------------- numbers


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


def _em_parts(e: dict | None) -> tuple[float, float, int, int] | None:
    """(p, standard error, correct, n) of an eval record's exact-match."""
    if not e or not e.get("n"):
        return None
    n = int(e["n"])
    if e.get("correct") is not None:
        correct = int(e["correct"])
    elif e.get("exact_match") is not None:
        correct = round(e["exact_match"] * n)
    else:
        return None
    p = correct / n
    return p, math.sqrt(p * (1 - p) / n), correct, n


# ---------------------------------------------------------------- formatting


def _fmt(v, spec: str = ".3f", unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:{spec}}{unit}"


def _fmt_em(e: dict | None) -> str:
    parts = _em_parts(e)
    if parts is None:
        return "n/a"
    p, se, c, n = parts
    return f"{100 * p:.1f}% ± {100 * se:.1f} ({c}/{n})"


def _fmt_duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s"


def _eval_loss(e: dict | None) -> float | None:
    return e.get("eval_loss") if e else None


def _strategy_label(s: dict) -> str:
    """"fp16", "allreduce → fp16", or "auto (allreduce → fp16)" when the
    configured strategy (summary.json) is not one that ran."""
    if s.get("trainer"):
        used = s.get("strategies_used") or []
        return (" → ".join(str(x) for x in used) + " (Trainer)" if used
                else "Trainer, no lorasync")
    strategies = s.get("strategies_used") or [s.get("strategy")]
    strat = " → ".join(str(x) for x in strategies)
    if s.get("strategy") and s["strategy"] not in strategies:
        strat = f"{s['strategy']} ({strat})"
    return strat


def _ranks(s: dict) -> str:
    """The rank count, '?' for a lorasync run that does not say, '-' for a
    Trainer run whose logs do not (a Trainer without lorasync)."""
    return str(s.get("world_size") or ("-" if s.get("trainer") else "?"))


def _summary_rows(s: dict) -> list[tuple[str, str]]:
    eb, ea = s.get("eval_before"), s.get("eval_after")
    strat = _strategy_label(s)
    wire, fp32 = s.get("wire_bytes_per_step"), s.get("fp32_bytes_per_step")
    ratio = f", {fp32 / wire:.1f}x less" if wire and fp32 and wire < fp32 else ""
    rows = [
        ("ranks × strategy", f"{_ranks(s)} × {strat}"),
        ("steps", f"{s.get('steps')} (last step {s.get('last_step')}, "
                  f"{_fmt_duration(s.get('elapsed_s'))})"),
        ("samples/s (all ranks)", _fmt(s.get("samples_per_s"), ".2f")),
        ("step time median", _fmt(s.get("step_s_median"), ".3f", " s")),
        ("compute vs exposed sync per step",
         f"{_fmt(s.get('compute_s_mean'), '.3f', ' s')} vs "
         f"{_fmt(s.get('comm_s_mean'), '.3f', ' s')}"
         f" ({_fmt(100 * s['sync_share'] if s.get('sync_share') is not None else None, '.1f', '%')}"
         " waiting on sync)"),
        ("sent per step per rank",
         f"{_fmt(wire / 1e6 if wire is not None else None, '.3f', ' MB')} (fp32 all-reduce: "
         f"{_fmt(fp32 / 1e6 if fp32 is not None else None, '.3f', ' MB')}{ratio})"),
        ("train loss (last step)", _fmt(s.get("final_loss"), ".4f")),
        ("eval loss before → after", f"{_fmt(_eval_loss(eb), '.4f')} → "
                                     f"{_fmt(_eval_loss(ea), '.4f')}"),
        ("eval exact-match before", _fmt_em(eb)),
        ("eval exact-match after", _fmt_em(ea)),
    ]
    if s.get("adapter_params"):
        rows.insert(1, ("adapter parameters", f"{s['adapter_params']:,}"))
    if s.get("model"):
        rows.insert(1, ("model", str(s["model"])))
    if s.get("trainer"):
        # per-window means: a median of steps cannot be had from them
        rows[3] = ("step time mean", _fmt(s.get("step_s_mean"), ".3f", " s"))
        rows.insert(3, ("Trainer's samples/s (whole run)",
                        _fmt(s.get("trainer_samples_per_s"), ".2f")))
        rows.append(("numbers from", str(s.get("source"))))
        # what the Trainer's logs do not have is '-', a row with nothing at all one '-'
        return [(k, v.replace("n/a", "-") if re.search(r"\d", re.sub(r"n/a|fp32", "", v))
                 else "-") if "n/a" in v else (k, v) for k, v in rows]
    rows.append(("numbers from", f"{s.get('source')}; steady state (first step left out), "
                                 "compute/sync/bytes are rank 0's"))
    return rows


# ---------------------------------------------------------------- plots


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _new_figure(nrows: int = 1, height: float = 3.6, sharey: bool = False):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise LorasyncError("the report needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(10, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, 1, squeeze=False, sharex=True, sharey=sharey)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _mark_switches(ax, switches: list[dict], color: str, label_prefix: str = "") -> None:
    """A vertical line at the boundary before the step that ran the new strategy,
    labelled "from → to" along the line."""
    for sw in switches:
        x = sw["step"] - 0.5
        ax.axvline(x, color=color, linestyle="--", linewidth=1.2, alpha=0.8)
        text = f"{label_prefix}{sw['from']} → {sw['to']}"
        ax.text(x, 0.97, " " + text, transform=ax.get_xaxis_transform(), rotation=90,
                va="top", ha="right", fontsize=8, color=color,
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1})


def _width(i: int, n: int, base: float = 1.5) -> float:
    """Overlaid runs often coincide (same seed, same bytes): earlier runs drawn
    wider stay visible under later ones."""
    return base + 1.5 * (n - 1 - i)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for v in values:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def _plot_throughput(runs, series, switches, colors) -> str:
    fig, (ax,) = _new_figure()
    for i, (run, rows, sw, c) in enumerate(zip(runs, series, switches, colors)):
        x = [r["step"] for r in rows]
        y = [r["samples_per_s"] for r in rows]
        window = max(1, len(rows) // 20)
        if window > 1:
            ax.plot(x, y, color=c, alpha=0.3, linewidth=0.8)
            ax.plot(x, _smooth(y, window), color=c, linewidth=_width(i, len(runs), 2.0),
                    label=f"{run.name} (mean of {window} steps)")
        else:
            ax.plot(x, y, color=c, linewidth=_width(i, len(runs), 1.8), marker="o",
                    markersize=3, label=run.name)
        _mark_switches(ax, sw, c)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title("Throughput: samples of all ranks / slowest rank's step time")
    ax.legend(loc="lower right", fontsize=9)
    return _png(fig)


def _plot_time_split(runs, series, switches, colors) -> str:
    fig, axes = _new_figure(len(runs), height=3.0 if len(runs) > 1 else 3.6, sharey=True)
    for ax, run, rows, sw, c in zip(axes, runs, series, switches, colors):
        x = [r["step"] for r in rows]
        comp = [r["compute_s"] for r in rows]
        comm = [r["comm_s"] for r in rows]
        other = [r["other_s"] for r in rows]
        if len(rows) <= 200:
            ax.bar(x, comp, width=0.85, color="#4c72b0", label="compute")
            ax.bar(x, comm, width=0.85, bottom=comp, color="#dd8452", label="exposed sync")
            ax.bar(x, other, width=0.85, bottom=[a + b for a, b in zip(comp, comm)],
                   color="#bbbbbb", label="data / other")
        else:  # thousands of bars render as noise; areas read better
            ax.stackplot(x, comp, comm, other, colors=("#4c72b0", "#dd8452", "#bbbbbb"),
                         labels=("compute", "exposed sync", "data / other"), linewidth=0)
        _mark_switches(ax, sw, "black")
        ax.set_ylabel("seconds per step")
        what = "(mean over ranks)"
        if run.kind == "trainer":
            what = ("(rank 0, mean over each logging window)"
                    if any(math.isfinite(v) for v in comm)
                    else "no lorasync/* timings in the Trainer's logs")
        ax.set_title(f"{run.name}: compute vs exposed sync per step {what}",
                     fontsize=10, color=c if len(runs) > 1 else "black")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("step")
    return _png(fig)


def _plot_wire(runs, series, switches, colors) -> str:
    fig, (ax,) = _new_figure()
    top = 0.0
    for i, (run, rows, sw, c) in enumerate(zip(runs, series, switches, colors)):
        x = [r["step"] for r in rows]
        y = [r["wire_bytes"] / 1e6 for r in rows]
        top = max([top, *y])
        ax.step(x, y, where="mid", color=c, linewidth=_width(i, len(runs)), label=run.name)
        _mark_switches(ax, sw, c)
    fp32 = [r["fp32_bytes"] for r in series[0] if r["fp32_bytes"] is not None]
    if fp32:
        ax.axhline(statistics.median(fp32) / 1e6, color="gray", linestyle=":", linewidth=1.5,
                   label="fp32 all-reduce")
        top = max(top, statistics.median(fp32) / 1e6)
    # headroom above the highest line for the switch labels
    ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("MB per rank")
    ax.set_title("Wire bytes per step (handed to collectives, mean over ranks)")
    ax.legend(loc="best", fontsize=9)
    return _png(fig)


def _plot_loss(runs, series, switches, colors) -> str:
    fig, (ax,) = _new_figure()
    any_eval = False
    for i, (run, rows, sw, c) in enumerate(zip(runs, series, switches, colors)):
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=c,
                linewidth=_width(i, len(runs)), alpha=0.9, label=f"{run.name} train")
        pts = [(e["step"], e["eval_loss"]) for e in run.evals
               if e.get("eval_loss") is not None]
        if pts:
            any_eval = True
            ax.plot(*zip(*pts), color=c, marker="D", markersize=6, linestyle=":",
                    markeredgecolor="black", label=f"{run.name} eval")
        _mark_switches(ax, sw, c)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss: train (mean over ranks)" + (", eval (diamonds)" if any_eval else ""))
    ax.legend(loc="upper right", fontsize=9)
    return _png(fig)


# ---------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto;
       max-width: 1060px; color: #222; padding: 0 16px; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.meta { color: #666; font-size: 0.9em; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 5px 10px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { background: #fff8dc; border: 1px solid #e6d58a; padding: 6px 10px; margin: 8px 0; }
figure { margin: 12px 0 20px; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.88em; }
code { background: #f4f4f4; padding: 1px 4px; }
"""


def _e(x) -> str:
    return html.escape(str(x))


def _table(header: list[str] | None, rows: list[list[str]], num_cols: set[int] = frozenset(),
           cls: str = "") -> str:
    out = [f'<table class="{cls}">' if cls else "<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = []
        for i, v in enumerate(row):
            tag = "th" if header is None and i == 0 else "td"
            attr = ' class="num"' if i in num_cols else ""
            cells.append(f"<{tag}{attr}>{_e(v)}</{tag}>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _figure(b64: str, alt: str, caption: str) -> str:
    return (f'<figure><img alt="{_e(alt)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _comparison(runs: list[Run], sums: list[dict]) -> str:
    # the baseline is the first run; a Trainer without lorasync timings cannot be one
    ref = next((i for i, s in enumerate(sums) if s.get("samples_per_s")), 0)
    base = sums[ref].get("samples_per_s")
    trainers = any(s.get("trainer") for s in sums)
    # the Trainer's own figure compares Trainer runs with each other (plain or not)
    tbase = next((s["trainer_samples_per_s"] for s in sums if s.get("trainer_samples_per_s")),
                 None)
    rows = []
    for run, s in zip(runs, sums):
        sps = s.get("samples_per_s")
        speed = f"{sps / base:.2f}x" if sps and base else "-"
        strat = _strategy_label(s)
        wire = s.get("wire_bytes_per_step")
        share = s.get("sync_share")
        ea = s.get("eval_after")
        row = [run.name, f"{_ranks(s)} × {strat}", _fmt(sps, ".2f"), speed,
               _fmt(100 * share if share is not None else None, ".1f", "%"),
               _fmt(wire / 1e6 if wire is not None else None, ".3f"),
               _fmt(_eval_loss(ea), ".4f"), _fmt_em(ea)]
        if trainers:
            whole = s.get("trainer_samples_per_s")
            row.insert(4, f"{whole:.2f} ({whole / tbase:.2f}x)" if whole and tbase else "-")
        rows.append(["-" if c == "n/a" else c for c in row])
    header = ["run", "ranks × strategy", "samples/s", f"speedup vs {runs[ref].name}",
              "sync share", "wire MB/step/rank", "eval loss", "exact-match ± s.e. (n)"]
    if trainers:
        header.insert(4, "Trainer's samples/s, whole run")
    return _table(header, rows, num_cols=set(range(2, len(header))))


def _unique_names(runs: list[Run]) -> None:
    """Runs named alike (runs/a/x, runs/b/x) get enough parent folders to differ."""
    depth = 1
    while len({r.name for r in runs}) < len(runs) and depth < 6:
        depth += 1
        for r in runs:
            parts = os.path.normpath(os.path.abspath(r.path)).split(os.sep)
            r.name = "/".join(parts[-depth:])


def build_report(runs: list[Run], title: str | None = None) -> str:
    """The report as one HTML string (images embedded)."""
    if not runs:
        raise LorasyncError("report: no run directories given; pass one or more")
    _unique_names(runs)
    sums = [summarize_run(r) for r in runs]
    series = [trainer_series(r) if r.kind == "trainer" else step_series(r.records) for r in runs]
    switches = [s["switches"] for s in sums]
    colors = [_COLORS[i % len(_COLORS)] for i in range(len(runs))]
    title = title or ("lorasync report: " + (runs[0].name if len(runs) == 1
                                             else f"{len(runs)} runs"))
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1>",
             f"<p class=\"meta\">written {_e(now)} from "
             + ", ".join(f"<code>{_e(os.path.abspath(r.path))}</code>" for r in runs) + "</p>"]
    for run in runs:
        for note in run.notes:
            parts.append(f'<div class="note">{_e(run.name)}: {_e(note)}</div>')

    if len(runs) > 1:
        parts.append("<h2>Comparison</h2>")
        parts.append(_comparison(runs, sums))
        parts.append('<p class="meta">samples/s: steady state (first step left out), all '
                     "ranks; sync share: exposed sync time / step time; eval: the run's last "
                     "evaluation; s.e.: binomial standard error of exact-match. Differences "
                     "smaller than about two standard errors are noise."
                     + (" Trainer runs: from the lorasync/* entries of the Trainer's logs "
                        "(means per logging window, the first window left out); the Trainer's "
                        "own samples/s covers the whole run (start-up and first step included) "
                        "and is what a Trainer without lorasync has; '-': not in the run's "
                        "logs." if any(r.kind == "trainer" for r in runs) else "") + "</p>")
    else:
        parts.append("<h2>Summary</h2>")
        parts.append(_table(None, [list(r) for r in _summary_rows(sums[0])]))

    parts.append("<h2>Where the time goes</h2>")
    parts.append(_figure(_plot_throughput(runs, series, switches, colors), "samples per second",
                         "Global samples/s per step (sum of samples over ranks / slowest "
                         "rank's step time). Dashed lines: strategy switches."))
    parts.append(_figure(_plot_time_split(runs, series, switches, colors),
                         "compute vs exposed sync",
                         "Per step, mean over ranks: compute (forward, backward, optimizer), "
                         "exposed sync (time the step waited on gradient sync), and the rest "
                         "(data loading)."))
    parts.append(_figure(_plot_wire(runs, series, switches, colors), "wire bytes per step",
                         "Payload bytes each rank handed to collectives per step, at the dtype "
                         "sent (not ring traffic)."))
    parts.append("<h2>Quality</h2>")
    parts.append(_figure(_plot_loss(runs, series, switches, colors), "loss",
                         "Train loss per step (mean over ranks); eval loss from evals.jsonl."))

    any_sw = [(run, sw) for run, sw in zip(runs, switches) if sw]
    if any_sw:
        parts.append("<h2>Strategy switches</h2>")
        rows = [[run.name, str(sw["step"]), str(sw["from"]), str(sw["to"]), sw["reason"] or ""]
                for run, sws in any_sw for sw in sws]
        parts.append(_table(["run", "from step", "from", "to", "reason"], rows, num_cols={1}))

    if len(runs) > 1:
        for run, s in zip(runs, sums):
            parts.append(f"<h2>Run {_e(run.name)}</h2>")
            parts.append(_table(None, [list(r) for r in _summary_rows(s)]))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def default_output(run_dirs: list[str]) -> str:
    """RUN_DIR/report.html for one run, ./lorasync-report.html for several."""
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], "report.html")
    return "lorasync-report.html"


def write_report(run_dirs: list[str], output: str | None = None,
                 title: str | None = None) -> str:
    """Read the runs, write the report (atomically); returns its path."""
    runs = [load_run(d) for d in run_dirs]  # all errors before any plotting
    text = build_report(runs, title=title)
    path = output or default_output(run_dirs)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = path + ".part"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise LorasyncError(f"{path}: cannot write the report ({exc.strerror}); pass "
                            "-o PATH in a folder you can write to") from None
    return path
