"""lorasync.launch.agent: torchrun's agent that keeps the worker's exit code (2 = user error).

One single-process torchrun per case (a few seconds each); here rather than in
tests/dist, which pytest's default norecursedirs leaves out of `pytest tests`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lorasync.launch.agent import exit_code


@pytest.mark.parametrize("codes,want", [([2], 2), ([1, 2], 2), ([3], 3), ([None, 5], 5),
                                        ([-9], 1), ([], 1)])
def test_exit_code(codes, want):
    assert exit_code(codes) == want


@pytest.mark.parametrize("code", [2, 3])
def test_agent_passes_the_worker_code_through(tmp_path, code):
    script = tmp_path / "w.py"
    script.write_text(f"import sys; sys.exit({code})\n")
    r = subprocess.run([sys.executable, "-m", "lorasync.launch.agent", "--standalone",
                        "--nproc-per-node", "1", "--max-restarts", "0", str(script)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stderr[-2000:]
