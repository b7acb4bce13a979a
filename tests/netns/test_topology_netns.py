"""A 2 x 2 emulated run trains: two network namespaces, two workers in each.

The workers of one node share its namespace, so lorasync finds two nodes of
two ranks (by the namespace inode: host name and boot id are the same in
both), syncs hierarchically, and only the leaders' traffic crosses the
shaped link.  Needs root; the cluster is always taken down.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import run_cli

pytestmark = pytest.mark.netns

NAME = f"t{os.getpid() % 100000}topo"


def _train_2x2(out, name: str, *args: str):
    """``lorasync train`` on 2 emulated nodes x 2 workers (100 Mbit/s, the
    tiny model): the finished process and its metrics records; the cluster
    is checked for leftovers and taken down whatever happened."""
    try:
        p = run_cli("train", "--emulate", f"nodes=2,nproc_per_node=2,rate=100mbit,name={name}",
                    "--model", "tiny", "--batch-size", "2", "--eval-size", "0",
                    "--no-progress", "--output-dir", out, *args, timeout=380)
    finally:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        leftover = [ln for ln in listed.splitlines() if f"lsync-{name}-" in ln]
        if leftover:
            from lorasync.emulate.cluster import down
            down(name)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not leftover, leftover
    return p, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(400)
def test_two_by_two_emulated_run_trains_hierarchically(tmp_path):
    p, recs = _train_2x2(tmp_path / "run", NAME, "--max-steps", "5", "--comm", "int8")
    assert "2 workers per node" in p.stderr
    assert {r["rank"] for r in recs} == {0, 1, 2, 3}
    assert all(r["world_size"] == 4 for r in recs)
    steady = [r for r in recs if r["step"] > 1]
    for r in steady:
        assert r["loss"] == r["loss"]                       # finite, trained
        assert r["wire_bytes"] == r["intra_bytes"] + r["inter_bytes"]
        assert r["intra_bytes"] > 0                         # every rank: its node's group
        # torchrun numbers ranks node by node: ranks 0 and 2 lead their nodes
        assert (r["inter_bytes"] > 0) == (r["rank"] in (0, 2)), r
    first, last = (sum(r["loss"] for r in recs if r["step"] == s) for s in (1, 5))
    assert last < first


@pytest.mark.timeout(400)
def test_two_by_two_emulated_diloco_crosses_in_shards(tmp_path):
    """DiLoCo's outer sync in shards across real namespaces: on the steps it
    lands both ranks of each node hand bytes across, half each; on the
    others nobody does."""
    _, recs = _train_2x2(tmp_path / "run", NAME[:-1] + "s", "--max-steps", "4",
                         "--comm", "diloco", "--comm-opt", "period=2")
    for step in (2, 4):
        inter = {r["rank"]: r["inter_bytes"] for r in recs if r["step"] == step}
        assert set(inter) == {0, 1, 2, 3} and all(v > 0 for v in inter.values()), (step, inter)
        assert abs(inter[0] - inter[1]) <= 8 and abs(inter[2] - inter[3]) <= 8, inter
    assert all(r["inter_bytes"] == 0 for r in recs if r["step"] in (1, 3))
