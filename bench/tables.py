#!/usr/bin/env python3
"""The tables in README.md and docs/, generated from the code and bench/reference/.

    python bench/tables.py            # rewrite every generated table in place
    python bench/tables.py --check    # exit 1 if a table differs from its data (a test runs this)

A generated table sits between two markers in a Markdown file:

    <!-- BEGIN table:NAME -->
    ...
    <!-- END table:NAME -->

and ``NAME`` is one of the renderers below, each reading the catalog (the
strategies table) or the committed result files of one bench (``bench/
reference/NAME``, kept with ``bench/reference.py``).  A table and its data
therefore cannot drift apart: change the data, run this, commit both.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "bench" / "reference"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"(<!-- BEGIN table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- END table:(?P=name) -->)",
                  re.S)

sys.path.insert(0, str(ROOT / "src"))


def _load(*parts: str):
    path = REF.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"bench/reference/{'/'.join(parts)} is missing: run the bench "
                                "and keep its results with bench/reference.py")
    return json.loads(path.read_text())


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


# --------------------------------------------------------------------------- renderers

def strategies() -> str:
    """Every strategy of the catalog: what it sends, its bytes for the embedded
    default, its options with their defaults."""
    from lorasync import catalog
    from lorasync.plan.costmodel import MODELS, lora_matrices

    smol = lora_matrices(MODELS["smollm2-135m"], 8)
    fp32 = catalog.wire_bytes("allreduce", smol, 2)
    lines = ["| strategy | what a rank sends | MB per step, steady state (SmolLM2-135M r=8, "
             "2 ranks) | options (default) |", "|---|---|---|---|"]
    for name in catalog.SPECS:
        spec = catalog.spec(name)
        if spec.wire is not None:
            b = catalog.wire_bytes(name, smol, 2)
            size = f"{_mb(b)} ({fp32 / b:.1f}x less)" if b and b < fp32 else _mb(b)
        else:
            size = "measured"
        opts = ", ".join(f"`{k}={str(v).lower() if isinstance(v, bool) else v}`"
                         for k, v, _ in catalog.option_help(name)
                         if name != "auto" or k in ("candidates", "interval"))
        lines.append(f"| `{name}` | {spec.summary} | {size} | {opts or '-'} |")
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[], str]] = {
    "strategies": strategies,
}


# --------------------------------------------------------------------------- files

def render(text: str, path: Path) -> str:
    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"{path.relative_to(ROOT)}: no renderer for table {name!r} "
                             f"(known: {', '.join(sorted(RENDERERS))})")
        return m.group(1) + RENDERERS[name]().rstrip("\n") + "\n" + m.group(4)
    return MARK.sub(sub, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a generated table differs from its data")
    a = ap.parse_args()
    stale = []
    for path in DOCS:
        old = path.read_text()
        new = render(old, path)
        if new != old:
            stale.append(path.relative_to(ROOT))
            if not a.check:
                path.write_text(new)
    if a.check and stale:
        print("stale generated tables in: " + ", ".join(map(str, stale))
              + " (run python bench/tables.py)", file=sys.stderr)
        return 1
    print(("up to date: " if a.check else "rewritten: " if stale else "unchanged: ")
          + (", ".join(map(str, stale)) if stale and not a.check else f"{len(DOCS)} files"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
