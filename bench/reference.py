#!/usr/bin/env python3
"""Keep the small result files of a bench run as the committed reference.

    python bench/reference.py bench/results/plan-20261201-2100 plan-accuracy
    python bench/reference.py --list

Every figure in the docs comes from a file under ``bench/reference/NAME``:
this copies from a bench's output directory what the figures, ``--replan``
and ``lorasync report`` read (JSON, JSONL, config.yaml, charts), and leaves
out what is large and says nothing about the figures (adapters, checkpoints,
TensorBoard events, worker logs).  The old ``bench/reference/NAME`` is
replaced, so a reference is always one run.  ``python bench/tables.py`` then
regenerates the tables in README.md and docs/ from these files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "bench" / "reference"
KEEP = (".json", ".jsonl", ".md", ".png", ".yaml")
SKIP_DIRS = {"adapter", "checkpoints", "tensorboard", "ranks", "wandb", "mlruns"}
MAX_FILE = 512 << 10  # a figure's data, not a model


def keep(src: Path, name: str) -> list[Path]:
    if not src.is_dir():
        sys.exit(f"reference: {src} is not a directory (give a bench's --output-dir)")
    if not name or "/" in name or name.startswith("."):
        sys.exit(f"reference: {name!r} is not a plain name, e.g. plan-accuracy")
    dest = REFERENCE / name
    tmp = REFERENCE / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    kept, skipped = [], []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if not path.is_file() or any(p in SKIP_DIRS or p.endswith("-logs")
                                     or p.startswith("checkpoint-") for p in rel.parts):
            continue
        if path.suffix not in KEEP:
            continue
        if path.stat().st_size > MAX_FILE:
            skipped.append(f"{rel} ({path.stat().st_size >> 10} KiB)")
            continue
        out = tmp / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, out)
        kept.append(rel)
    if not kept:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"reference: nothing to keep in {src}")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    for s in skipped:
        print(f"left out (over {MAX_FILE >> 10} KiB): {s}", file=sys.stderr)
    size = sum((dest / k).stat().st_size for k in kept)
    print(f"bench/reference/{name}: {len(kept)} files, {size >> 10} KiB")
    return kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", help="a bench's output directory")
    ap.add_argument("name", nargs="?", help="the reference's name under bench/reference/")
    ap.add_argument("--list", action="store_true", help="list the references and their sizes")
    a = ap.parse_args()
    if a.list:
        for d in sorted(p for p in REFERENCE.iterdir() if p.is_dir() and not p.name.startswith(".")):
            files = [f for f in d.rglob("*") if f.is_file()]
            print(f"{d.name:32} {len(files):4} files {sum(f.stat().st_size for f in files) >> 10:6} KiB")
        return 0
    if not (a.results and a.name):
        ap.error("give RESULTS_DIR and NAME (or --list)")
    keep(Path(a.results), a.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
