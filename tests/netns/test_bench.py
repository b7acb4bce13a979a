"""`lorasync bench` end to end on the tiny model: one profile, a few rows, real namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from conftest import run_cli

_why = ("needs root" if os.geteuid() != 0 else
        "needs iproute2 (ip, tc)" if not (shutil.which("ip") and shutil.which("tc")) else None)
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why is not None, reason=_why or "")]


def _bench_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("lsync-bench")]


def test_bench_rows_predictions_and_cleanup(tmp_path):
    before = _bench_namespaces()
    out = tmp_path / "res"
    p = run_cli("bench", "--model", "tiny", "--profiles", "100mbit", "--rows", "ddp,fp16",
                "--steps", "3", "--eval-size", "0", "--output-dir", out, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    md = (out / "results.md").read_text()
    for row in ("no sync (ceiling)", "plain DDP (fp32, defaults)", "+ fp16 compression",
                "no sync (ceiling, again)", "RDMA"):
        assert f"| {row}" in md
    assert "plan vs measured step time: " in md and "probe: all-reduce bandwidth" in md
    res = json.loads((out / "results.json").read_text())["results"]["100mbit"]
    ddp = next(c for c in res if c.get("key") == "ddp")
    assert ddp["status"] == "ok" and ddp["wire_mb"] > 0 and ddp["predicted_step_s"] > 0
    assert (out / "chart.png").stat().st_size > 1000
    # the tuned row's TCP settings were reverted and every namespace removed
    assert _bench_namespaces() == before
