"""The generated tables in README.md and docs/ agree with their data (bench/reference/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_tables_match_their_data():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "tables.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_table_marker_has_a_renderer():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import tables
    finally:
        sys.path.pop(0)
    names = [(path.name, m.group("name")) for path in tables.DOCS
             for m in tables.MARK.finditer(path.read_text())]
    assert names, f"no table marker matched {tables.MARK.pattern!r} in {len(tables.DOCS)} documents"
    for doc, name in names:
        assert tables.renderer(name) is not None, (doc, name)


def test_docs_name_no_missing_local_files():
    """Every script, page or example a document names exists in the repository
    (result files under bench/reference/ are the tables' business, above)."""
    import re

    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    refs = [(path.name, ref) for path in docs
            for ref in re.findall(r"`((?:bench|docs|examples)/[\w./-]+\.(?:py|md|json))`",
                                  path.read_text())
            if not ref.startswith("bench/reference/")]
    # a pattern that no longer matches the documents' way of naming files checks nothing
    assert refs, f"no file named in backticks in {len(docs)} documents"
    for doc, ref in refs:
        assert (ROOT / ref).exists(), (doc, ref)
