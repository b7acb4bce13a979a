"""Per-step metrics records and the JSONL streams that hold them.

Every rank appends its own records, live, to ``RUN/ranks/rank{R}.jsonl``
(its own file, so ranks on other machines need no shared file system and
a crashed run still leaves its history).  A stream is never truncated: each
start of the worker (a new run, a ``--resume``, a restart after a failure)
appends an ``{"event": "start", ...}`` record, a detected failure a
``{"event": "fault", ...}`` record, and steps run again after a restart
appear twice.  A corrupt line is skipped (and counted), never a reason to
drop the records after it.  ``effective_records`` keeps the step records that count (one
per rank per step, the latest attempt's); at the end rank 0 gathers them and
writes the run's ``metrics.jsonl`` sorted by (step, rank); the field list is
in docs/contracts.md.

``steady_state`` is the one reduction of step records to run-level figures
(samples/s over the steady steps, rank 0's compute, sync and bytes): the
trainer's ``summary.json``, the report and the benches all use it.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import warnings
from dataclasses import dataclass

__all__ = ["RankStream", "read_jsonl", "read_jsonl_records", "write_merged", "effective_records",
           "attempts", "STEP_FIELDS", "Steady", "steady_state", "FIRST_STEP", "KEEP_ALL",
           "KEEP_NONE"]

STEP_FIELDS = ("step", "rank", "world_size", "strategy", "loss", "lr", "samples", "tokens",
               "grad_accum", "compute_s", "comm_s", "step_s", "wire_bytes", "fp32_bytes",
               "encode_s", "time")


def read_jsonl(path: str) -> tuple[list[dict], list[int]]:
    """The records of a JSONL stream and the line numbers of corrupt lines skipped.

    A corrupt line (not a JSON object) is skipped, never a reason to drop what
    follows it: the attempts appended after a damaged spot still count.  A
    torn last line (no newline: a crash mid-write) is left out, not counted."""
    if not os.path.isfile(path):
        return [], []
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    out, bad = [], []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            out.append(rec)
        elif i < len(lines) - 1:  # a complete line (newline-terminated) that is not a record
            bad.append(i + 1)
    return out, bad


_warned: set[tuple[str, tuple[int, ...]]] = set()


def read_jsonl_records(path: str) -> list[dict]:
    """``read_jsonl``'s records; corrupt lines skipped are told once per file
    and process, as a ``RuntimeWarning`` (how many, and where)."""
    out, bad = read_jsonl(path)
    if bad and (path, tuple(bad)) not in _warned:
        _warned.add((path, tuple(bad)))
        where = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        warnings.warn(f"{path}: skipped {len(bad)} corrupt line(s) (line {where}); the "
                      f"{len(out)} records around them are kept", RuntimeWarning, stacklevel=2)
    return out


class RankStream:
    """Append-only JSONL stream of one rank's step and event records."""

    def __init__(self, run_dir: str, rank: int):
        folder = os.path.join(run_dir, "ranks")
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank{rank}.jsonl")
        _cut_torn_tail(self.path)
        self.records = read_jsonl_records(self.path)  # the history, every attempt
        self._lock = threading.Lock()  # the failure watchdog writes from its thread
        self._fh = open(self.path, "a")

    def write(self, record: dict) -> None:
        with self._lock:
            self.records.append(record)
            if self._fh.closed:  # after the loop: the last word of a failing attempt
                with open(self.path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                return
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def _cut_torn_tail(path: str) -> None:
    """Drop a last line without its newline (a crash mid-write), so that the
    records appended after it stay readable; complete lines are never touched."""
    try:
        with open(path, "rb+") as fh:
            data = fh.read()
            if data and not data.endswith(b"\n"):
                fh.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


def attempts(records: list[dict]) -> list[tuple[dict | None, list[dict]]]:
    """A stream split at its start events: [(start event or None, records after it)]."""
    out: list[tuple[dict | None, list[dict]]] = [(None, [])]
    for r in records:
        if r.get("event") == "start":
            out.append((r, []))
        else:
            out[-1][1].append(r)
    return [a for a in out if a[0] is not None or a[1]]


def effective_records(per_rank: list[list[dict]]) -> list[list[dict]]:
    """The step records that count, from every rank's whole stream.

    A step record is superseded when a later attempt (of any rank: attempts are
    numbered for the whole group) resumed from an earlier step: that step ran
    again.  Event records are left out.
    """
    resumed: dict[int, int] = {}  # attempt -> step it resumed from
    for recs in per_rank:
        for r in recs:
            if r.get("event") == "start":
                resumed[int(r.get("attempt", 0))] = int(r.get("resumed_from", 0))
    out = []
    for recs in per_rank:
        keep, attempt = [], 0
        for r in recs:
            if r.get("event") == "start":
                attempt = int(r.get("attempt", 0))
                continue
            if "event" in r:
                continue
            if any(a > attempt and s < r["step"] for a, s in resumed.items()):
                continue
            keep.append(r)
        out.append(keep)
    return out


def write_merged(path: str, per_rank: list[list[dict]]) -> None:
    rows = sorted((r for recs in per_rank for r in recs), key=lambda r: (r["step"], r["rank"]))
    tmp = path + ".part"
    with open(tmp, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- steady state

#: ``leave_out`` of :func:`steady_state`: rank 0's first step, which holds
#: DDP's bucket rebuild and the allocator's warm-up
FIRST_STEP = "first_step"
#: ``when_none_left`` of :func:`steady_state`: a run too short to leave
#: anything out is measured over all its steps ...
KEEP_ALL = "all"
#: ... or has no steady figures (None)
KEEP_NONE = "none"


@dataclass(frozen=True)
class Steady:
    """Run-level figures of step records over the steady steps.

    A step is as slow as its slowest rank and its samples are summed over
    ranks; the per-step means, the median and the sync share are rank 0's
    (the first list given).  A figure is None where it cannot be had: no
    steady step, no time, or a steady record of rank 0 without its field."""

    steps: int                       # rank 0's step records, the left-out ones included
    counted: tuple[int, ...]         # the steady steps (of any rank), ascending
    rank0: tuple[dict, ...]          # rank 0's records of the steady steps
    wall_s: float                    # sum over the steady steps of the slowest rank's step_s
    samples: float                   # samples of every rank over the steady steps
    samples_per_s: float | None
    step_s_median: float | None
    compute_s_mean: float | None
    comm_s_mean: float | None
    sync_share: float | None         # rank 0's exposed sync time / its step time
    wire_bytes_per_step: float | None
    fp32_bytes_per_step: float | None
    final_loss: float | None         # rank 0's last step, left-out steps included

    def figures(self) -> dict:
        """The figures ``summary.json`` holds, in its order."""
        return {k: getattr(self, k) for k in _FIGURES}


_FIGURES = ("samples_per_s", "step_s_median", "compute_s_mean", "comm_s_mean", "sync_share",
            "wire_bytes_per_step", "fp32_bytes_per_step", "final_loss")


def steady_state(per_rank, *, leave_out: str | int, when_none_left: str) -> Steady:
    """The steady-state figures of every rank's step records (``per_rank[0]``
    is rank 0's; each list any order, one record per step).

    ``leave_out``: :data:`FIRST_STEP`, or a step number: every step up to and
    including it is left out (auto's steps up to its last switch).
    ``when_none_left``: :data:`KEEP_ALL` (then every step counts) or
    :data:`KEEP_NONE`, for when that leaves no step."""
    if when_none_left not in (KEEP_ALL, KEEP_NONE):
        raise ValueError(f"when_none_left={when_none_left!r}: use KEEP_ALL or KEEP_NONE")
    r0 = sorted(per_rank[0], key=lambda r: r["step"]) if per_rank else []
    if leave_out == FIRST_STEP:
        first = r0[0]["step"] if r0 else None

        def counts(step):
            return step != first
    elif isinstance(leave_out, int) and not isinstance(leave_out, bool):
        def counts(step):
            return step > leave_out
    else:
        raise ValueError(f"leave_out={leave_out!r}: use FIRST_STEP or a step number")
    by_step: dict[int, list[dict]] = {}
    for recs in per_rank:
        for r in recs:
            by_step.setdefault(r["step"], []).append(r)
    fallback = when_none_left == KEEP_ALL
    counted = [s for s in sorted(by_step) if counts(s)] or (sorted(by_step) if fallback else [])
    steady = [r for r in r0 if counts(r["step"])] or (r0 if fallback else [])
    wall = sum(max(r["step_s"] for r in by_step[s]) for s in counted)
    samples = sum(sum(r["samples"] for r in by_step[s]) for s in counted)

    def has(key):
        return bool(steady) and all(key in r for r in steady)

    def mean(key):
        return statistics.fmean(r[key] for r in steady) if has(key) else None

    step_total = sum(r["step_s"] for r in steady)
    return Steady(
        steps=len(r0), counted=tuple(counted), rank0=tuple(steady), wall_s=wall,
        samples=samples, samples_per_s=samples / wall if wall else None,
        step_s_median=statistics.median(r["step_s"] for r in steady) if steady else None,
        compute_s_mean=mean("compute_s"), comm_s_mean=mean("comm_s"),
        sync_share=(sum(r["comm_s"] for r in steady) / step_total
                    if has("comm_s") and step_total else None),
        wire_bytes_per_step=mean("wire_bytes"), fp32_bytes_per_step=mean("fp32_bytes"),
        final_loss=r0[-1].get("loss") if r0 else None)
