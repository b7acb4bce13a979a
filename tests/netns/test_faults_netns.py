"""Faults across emulated nodes: a link taken down and brought back, a node lost for good.

Needs root.  The tiny model, one worker per network namespace, torchrun's c10d
rendezvous across them (``launch_on_cluster``), faults injected from here; the
clusters are taken down in ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from lorasync.monitor.metrics import read_jsonl_records
from lorasync.emulate.cluster import Cluster, down
from lorasync.emulate.launch import launch_on_cluster
from lorasync.emulate.spec import ClusterSpec

pytestmark = [pytest.mark.netns, pytest.mark.timeout(420)]

TAG = f"f{os.getpid() % 100000}"
# plain all-reduce named (the default is auto): a recovered rank takes a peer's state,
# replicated after every step under a per-step sync
TINY = ["train", "--model", "tiny", "--batch-size", "2", "--eval-size", "0", "--no-progress",
        "--no-eval-before", "--comm", "allreduce"]


@pytest.fixture(scope="module", autouse=True)
def _sweep():
    try:
        yield
    finally:
        for kind in ("link", "lost"):
            down(f"{TAG}{kind}")


def _records(run, rank):
    return read_jsonl_records(os.path.join(run, "ranks", f"rank{rank}.jsonl"))


def _rank_on(run, node, world):
    """(rank, pid) of the worker running on ``node``, once it has done a step."""
    for r in range(world):
        recs = _records(run, r)
        starts = [x for x in recs if x.get("event") == "start"]
        if starts and starts[-1]["node"] == node and any("event" not in x for x in recs):
            return r, starts[-1]["pid"]
    return None


def _launch(cluster, argv, tmp_path, **kw):
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("rc", launch_on_cluster(
        cluster, argv, timeout=360, log_dir=str(tmp_path / "logs"), **kw)))
    t.start()
    return t, box


def _wait(cond, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _logs(tmp_path):
    folder = tmp_path / "logs"
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(folder.glob("*.log")))


def test_link_down_and_back_the_run_recovers(tmp_path):
    run = str(tmp_path / "r")
    c = Cluster.up(ClusterSpec(nodes=2, rate_bps="100mbit", name=f"{TAG}link"))
    try:
        t, box = _launch(c, [*TINY, "--max-steps", "160", "--ckpt-interval", "5",
                             "--fault-timeout", "8", "--max-restarts", "2",
                             "--output-dir", run], tmp_path, max_restarts=2)
        rank, _ = _wait(lambda: _rank_on(run, 1, 2), 200, "node 1's first step")
        _wait(lambda: sum("event" not in x for x in _records(run, rank)) >= 8, 200, "step 8")
        n1 = c.nodes[1]
        subprocess.run(["ip", "-n", n1.netns, "link", "set", n1.ifname, "down"], check=True)
        try:
            # some rank gives its verdict while the link is down
            _wait(lambda: any(x.get("event") == "fault" for r in (0, 1)
                              for x in _records(run, r)), 60, "a fault verdict")
        finally:
            subprocess.run(["ip", "-n", n1.netns, "link", "set", n1.ifname, "up"], check=True)
        t.join(360)
        assert box.get("rc") == 0, _logs(tmp_path)
    finally:
        c.down()
    faults = [x for r in (0, 1) for x in _records(run, r) if x.get("event") == "fault"]
    assert {f["kind"] for f in faults} <= {"silent", "store", "connection", "self"}
    assert any(f.get("peer") in (0, 1) and "restart" in f["next"] for f in faults), faults
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        recs = [json.loads(x) for x in fh]
    assert [(r["step"], r["rank"]) for r in recs] == [(s, k) for s in range(1, 161)
                                                      for k in (0, 1)]
    assert any("restart" in r for r in recs)
    with open(os.path.join(run, "summary.json")) as fh:
        assert json.load(fh)["faults"]["faults"] >= 1


def test_node_lost_for_good_the_others_continue(tmp_path):
    """--nnodes 2:3: every process of one node is killed; the two others go on alone,
    with the replicated state of the agreed checkpoint."""
    run = str(tmp_path / "r")
    c = Cluster.up(ClusterSpec(nodes=3, rate_bps="100mbit", name=f"{TAG}lost"))
    try:
        t, box = _launch(c, [*TINY, "--max-steps", "120", "--ckpt-interval", "5",
                             "--fault-timeout", "8", "--max-restarts", "2", "--nnodes", "2:3",
                             "--output-dir", run], tmp_path, max_restarts=2, min_nodes=2,
                       last_call_s=5)   # the survivors go on 5 s after reaching 2 nodes
        rank, _ = _wait(lambda: _rank_on(run, 2, 3), 240, "node 2's first step")
        _wait(lambda: sum("event" not in x for x in _records(run, rank)) >= 8, 200, "step 8")
        from lorasync.emulate.netns import pids_in_netns
        for pid in pids_in_netns(c.nodes[2].netns):  # agent and worker: the node is gone
            os.kill(pid, signal.SIGKILL)
        t.join(400)
        assert box.get("rc") == 0, _logs(tmp_path)
    finally:
        c.down()
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        recs = [json.loads(x) for x in fh]
    last = [r for r in recs if r["step"] == 120]
    assert sorted(r["rank"] for r in last) == [0, 1] and {r["world_size"] for r in last} == {2}
    assert sorted({r["step"] for r in recs}) == list(range(1, 121))
    starts = [x for r in (0, 1) for x in _records(run, r) if x.get("event") == "start"]
    resumed = [s for s in starts if s["cause"] == "recover"]
    assert resumed and all(s["world_size"] == 2 and s["state"] == "peer" for s in resumed)
