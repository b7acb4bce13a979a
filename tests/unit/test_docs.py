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
    for path in tables.DOCS:
        for m in tables.MARK.finditer(path.read_text()):
            assert tables.renderer(m.group("name")) is not None, (path.name, m.group("name"))


def test_docs_name_no_missing_local_files():
    """Every script, page or example a document names exists in the repository
    (result files under bench/reference/ are the tables' business, above)."""
    import re

    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for ref in re.findall(r"`((?:bench|docs|examples)/[\w./-]+\.(?:py|md|json))`",
                              path.read_text()):
            if not ref.startswith("bench/reference/"):
                assert (ROOT / ref).exists(), (path.name, ref)
