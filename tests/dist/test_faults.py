"""Faults on real gloo runs of the tiny model: a killed worker, a frozen one, node-local
disks (a damaged checkpoint: test_train.py).  The faults are injected from here (kill -9, SIGSTOP) while
``lorasync train`` runs in a subprocess; every verdict is checked by what the run says
and records, not by how long it took (the test timeout is the hang detector: the
process group's own timeout would be 10 minutes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from lorasync.monitor.metrics import read_jsonl_records

from conftest import cli_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--model", "tiny", "--batch-size", "2", "--eval-size", "0", "--no-progress",
        "--no-eval-before"]


def _records(run, rank):
    return read_jsonl_records(os.path.join(run, "ranks", f"rank{rank}.jsonl"))


def _metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _start(*args, **env):
    return subprocess.Popen([sys.executable, "-m", "lorasync", "train", *map(str, args)],
                            env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_step(proc, run, rank, step, timeout=200):
    """The pid of ``rank``'s worker once its stream shows ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        recs = _records(run, rank)
        steps = [r["step"] for r in recs if "event" not in r]
        if steps and steps[-1] >= step:
            return [r for r in recs if r.get("event") == "start"][-1]["pid"]
        time.sleep(0.05)
    out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
    raise AssertionError(f"rank {rank} never reached step {step}: {err[-3000:]}")


def test_killed_worker_restarts_and_the_run_completes(tmp_path):
    run = str(tmp_path / "r")
    p = _start(*TINY, "--nproc", "2", "--max-steps", "24", "--ckpt-interval", "4",
               "--output-dir", run)
    try:
        os.kill(_wait_for_step(p, run, 1, 9), signal.SIGKILL)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-4000:]
    assert "lorasync: recovering (restart 1 of 3)" in err
    recs = _metrics(run)
    # one record per rank per step: the steps run twice count once, the latest run
    assert [(r["step"], r["rank"]) for r in recs] == [(s, k) for s in range(1, 25) for k in (0, 1)]
    first = [r for r in recs if "restart" in r]
    assert {r["rank"] for r in first} == {0, 1}
    rs = first[0]["restart"]
    assert rs["attempt"] == 2 and rs["from_step"] % 4 == 0 and rs["from_step"] >= 8
    assert 0 <= rs["steps_redone"] <= 4 and rs["lost_s"] > 0
    # the stream keeps everything: two starts, the steps of both attempts
    stream = _records(run, 0)
    starts = [r for r in stream if r.get("event") == "start"]
    assert [(s["attempt"], s["cause"]) for s in starts] == [(1, "new"), (2, "recover")]
    assert len([r for r in stream if "event" not in r]) == 24 + rs["steps_redone"]
    with open(os.path.join(run, "summary.json")) as fh:
        faults = json.load(fh)["faults"]
    assert (faults["faults"], faults["restarts"]) == (1, 1)
    assert faults["steps_redone"] == rs["steps_redone"] and faults["time_lost_s"] > 0
    assert "faults survived" in out


@pytest.mark.parametrize("strategy, opts, site", [
    ("allreduce", [], "train/trainer.py"),                  # waiting inside backward's hooks
    ("local", ["--comm-opt", "period=3"], "comm/periodic.py"),   # in a periodic sync
    ("diloco", ["--comm-opt", "period=3", "--comm-opt", "streaming=true"],
     "comm/periodic.py"),                                         # in a streamed DiLoCo sync
])
def test_frozen_worker_is_named_by_the_survivor(tmp_path, strategy, opts, site):
    run = str(tmp_path / "r")
    # no restart: the verdict and "giving up" are what this test is about
    p = _start(*TINY, "--nproc", "2", "--max-steps", "400", "--ckpt-interval", "0",
               "--comm", strategy, *opts, "--fault-timeout", "8", "--max-restarts", "0",
               "--output-dir", run)
    pid = None
    try:
        pid = _wait_for_step(p, run, 1, 4)
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and p.poll() is None and not any(
                r.get("event") == "fault" for r in _records(run, 0)):
            time.sleep(0.1)
        # let it go: torchrun's SIGTERM reaches a stopped process only then (else it
        # waits 30 s before SIGKILL)
        os.kill(pid, signal.SIGCONT)
        out, err = p.communicate(timeout=200)
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    verdict = [line for line in err.splitlines() if "stopped answering" in line]
    assert verdict, err[-4000:]
    assert verdict[0].startswith("lorasync: rank 0 ") and "rank 1 (node 0" in verdict[0]
    assert "giving up" in verdict[0] and "--resume --output-dir" in verdict[0]
    assert "--max-restarts" in err.strip().splitlines()[-1]  # the launcher's last word
    [fault] = [r for r in _records(run, 0) if r.get("event") == "fault"]
    assert fault["peer"] == 1 and fault["kind"] == "silent" and site in fault["where"], fault


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(dirs, *args):
    """Two `lorasync train` launchers joined by one c10d rendezvous, like two machines,
    each with its own output directory (its own disk)."""
    port = _free_port()
    secret = os.path.join(os.path.dirname(dirs[0]), "job.secret")
    if not os.path.exists(secret):   # the job's shared secret, as every node would hold it
        assert subprocess.run([sys.executable, "-m", "lorasync", "secret", secret],
                              capture_output=True).returncode == 0
    procs = [_start(*TINY, "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint",
                    f"127.0.0.1:{port}", "--output-dir", d, *args,
                    LORASYNC_SECRET_FILE=secret) for d in dirs]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    return outs


def test_node_local_disks_resume_on_every_node(tmp_path):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    _two_nodes(dirs, "--max-steps", "8", "--ckpt-interval", "2", "--stop-after", "6")
    for d in dirs:  # each node wrote its config and its own ranks' checkpoint files
        assert os.path.isfile(os.path.join(d, "config.yaml"))
        assert sorted(n for n in os.listdir(d) if n.startswith("checkpoint-")) == [
            "checkpoint-4", "checkpoint-6"]
    # the newest checkpoint is half-written on one node: it must not be chosen
    os.remove(os.path.join(dirs[1], "checkpoint-6", "lorasync", "meta.json"))
    outs = _two_nodes(dirs, "--resume")
    assert any("resumed from" in err and "checkpoint-4 at step 4" in err for _, err in outs)
    done = [d for d in dirs if os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    assert len(done) == 1  # rank 0's node writes the run's shared files
    recs = _metrics(done[0])
    assert sorted({r["step"] for r in recs}) == list(range(1, 9))
    assert len(recs) == 8 * 2


# a damaged checkpoint file (bytes flipped, same size) is never loaded:
# tests/dist/test_train.py::test_resume_equals_uninterrupted_and_skips_a_damaged_checkpoint
