"""Per-step metrics records and the JSONL streams that hold them.

Every rank appends its own records, live, to ``RUN/ranks/rank{R}.jsonl``
(its own file, so ranks on other machines need no shared file system and
a crashed run still leaves its history).  At the end rank 0 gathers all
records and writes the run's ``metrics.jsonl`` sorted by (step, rank); the
field list is in docs/contracts.md.
"""

from __future__ import annotations

import json
import os

__all__ = ["RankStream", "read_jsonl_records", "write_merged", "STEP_FIELDS"]

STEP_FIELDS = ("step", "rank", "world_size", "strategy", "loss", "lr", "samples", "tokens",
               "grad_accum", "compute_s", "comm_s", "step_s", "wire_bytes", "fp32_bytes",
               "encode_s", "time")


def read_jsonl_records(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                break  # a torn last line from a crash
    return out


class RankStream:
    """Append-only JSONL stream of one rank's step records."""

    def __init__(self, run_dir: str, rank: int, keep_until_step: int = 0):
        folder = os.path.join(run_dir, "ranks")
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank{rank}.jsonl")
        # On resume, steps after the checkpoint will be run again: drop them.
        kept = [r for r in read_jsonl_records(self.path) if r.get("step", 0) <= keep_until_step]
        with open(self.path, "w") as fh:
            for r in kept:
                fh.write(json.dumps(r) + "\n")
        self.records = kept
        self._fh = open(self.path, "a")

    def write(self, record: dict) -> None:
        self.records.append(record)
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def write_merged(path: str, per_rank: list[list[dict]]) -> None:
    rows = sorted((r for recs in per_rank for r in recs), key=lambda r: (r["step"], r["rank"]))
    tmp = path + ".part"
    with open(tmp, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
