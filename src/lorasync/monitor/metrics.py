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
"""

from __future__ import annotations

import json
import os
import threading
import warnings

__all__ = ["RankStream", "read_jsonl", "read_jsonl_records", "write_merged", "effective_records",
           "attempts", "STEP_FIELDS"]

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
