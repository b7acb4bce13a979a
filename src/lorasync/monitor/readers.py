"""Reading what a run leaves behind, for the report.

A lorasync run directory: ``metrics.jsonl``, ``evals.jsonl`` and
``summary.json`` (docs/contracts.md), or, for a run not finished, the
per-rank streams in ``ranks/``.  A transformers Trainer's output directory
is one more kind of run: its ``trainer_state.json`` (or the newest
``checkpoint-N/trainer_state.json``) holds the log history, with the
``lorasync/*`` entries ``lorasync.hf.attach`` adds (docs/huggingface.md).
What cannot be read is a ``LorasyncError`` that names the path and the fix.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from lorasync.errors import LorasyncError
from lorasync.monitor.metrics import effective_records

__all__ = ["Run", "load_run", "REQUIRED_FIELDS"]

# Fields without which a record cannot be plotted (docs/contracts.md lists all).
REQUIRED_FIELDS = ("step", "rank", "loss", "samples", "compute_s", "comm_s", "step_s",
                   "wire_bytes")


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

