"""No hang in any phase, on real gloo runs of the tiny model: one rank is made
alive but stuck (its main thread blocks for good, its watchdog thread still
beats) with the test hook ``LORASYNC_TEST_STALL=PHASE[.POINT]:RANK``
(train/watchdog.py ``stall_here``), and the other names it, with the phase,
within the bound: never the process group's 10 minutes.  The bound here is
``--fault-timeout 5`` (5 s; the start of the group gets max(20 s, 2 x 5 s));
the time to the verdict is measured from the stalled rank's own line to the
verdict's, both as this process reads them, and checked only against generous
multiples (a loaded 2-core host); ``-s`` prints them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from lorasync.monitor.metrics import read_jsonl_records

from conftest import cli_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--model", "tiny", "--batch-size", "2", "--no-progress", "--no-eval-before",
        "--fault-timeout", "5"]


def _run(run, stall, *args, timeout=240):
    """``lorasync train`` with one rank stalled; (returncode, [(seconds since start,
    stderr line)]): each line stamped when this process read it."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "lorasync", "train", *TINY, "--nproc", "2",
                          "--output-dir", run, *map(str, args)],
                         env=cli_env(LORASYNC_TEST_STALL=stall), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic() - t0, line.rstrip("\n")) for line in p.stderr), daemon=True)
    reader.start()
    try:
        p.wait(timeout)
    finally:
        if p.poll() is None:
            p.kill()
        reader.join(10)
    return p.returncode, lines


def _at(lines, text):
    """(time, line) of the first stderr line holding ``text``."""
    found = [(t, line) for t, line in lines if text in line]
    assert found, f"no line with {text!r}:\n" + "\n".join(line for _, line in lines[-40:])
    return found[0]


def _verdict_after_stall(lines, verdict_text):
    t_stall, _ = _at(lines, "lorasync: test hook LORASYNC_TEST_STALL: rank 1 stalls")
    t_verdict, verdict = _at(lines, verdict_text)
    return t_verdict - t_stall, verdict


@pytest.mark.parametrize("stall, args, phase, waits", [
    # stuck between two evaluation batches; rank 0 waits in the evaluation's all-reduce
    ("eval.batch:1", ["--eval-size", "8", "--eval-interval", "2", "--max-steps", "40",
                      "--ckpt-interval", "0"], "eval", "the evaluation's all-reduce"),
    # stuck writing its checkpoint file (a hung NFS); rank 0 waits at the next barrier
    ("checkpoint.write:1", ["--eval-size", "0", "--max-steps", "40", "--ckpt-interval", "3"],
     "checkpoint", "the barrier after writing"),
    # stuck at the start of finish(); rank 0 waits in the final average of local SGD
    ("finish:1", ["--eval-size", "0", "--max-steps", "6", "--ckpt-interval", "0",
                  "--comm", "local", "--comm-opt", "period=4"], "finish", "the final sync"),
], ids=["eval", "checkpoint", "finish"])
def test_a_stuck_rank_is_named_within_the_bound(tmp_path, stall, args, phase, waits):
    run = str(tmp_path / "r")
    code, lines = _run(run, stall, "--max-restarts", "0", *args)
    took, verdict = _verdict_after_stall(lines, "is alive but stuck")
    print(f"\n{phase}: verdict {took:.1f} s after the stall (bound 5 s)")
    assert code == 75, "\n".join(line for _, line in lines[-40:])
    assert verdict.startswith("lorasync: rank 0 (node 0)") and "rank 1 (node 0, " in verdict
    assert f"in {phase} at step" in verdict and f"while this rank waits at {waits}" in verdict
    assert "giving up" in verdict
    [fault] = [r for r in read_jsonl_records(os.path.join(run, "ranks", "rank0.jsonl"))
               if r.get("event") == "fault"]
    assert (fault["kind"], fault["peer"], fault["peer_node"], fault["peer_phase"]) == \
        ("stuck", 1, 0, phase)
    assert fault["bound_s"] >= 5 and fault["silent_s"] > fault["bound_s"]
    assert took < 60, verdict   # named within the bound, not the group's 10-minute timeout


def test_a_stuck_checkpoint_write_restarts_and_the_run_completes(tmp_path):
    """With restarts left the verdict restarts the group (the hook stalls the
    first attempt only) and the run ends as if nothing happened."""
    run = str(tmp_path / "r")
    code, lines = _run(run, "checkpoint.write:1", "--eval-size", "0", "--max-steps", "8",
                       "--ckpt-interval", "3", "--max-restarts", "1")
    took, verdict = _verdict_after_stall(lines, "is alive but stuck")
    print(f"\ncheckpoint, restarted: verdict {took:.1f} s after the stall")
    assert code == 0, "\n".join(line for _, line in lines[-40:])
    assert "restarting the group" in verdict and took < 60
    _at(lines, "lorasync: recovering (restart 1 of 1)")
    recs = read_jsonl_records(os.path.join(run, "metrics.jsonl"))
    assert sorted({r["step"] for r in recs}) == list(range(1, 9))


def test_a_rank_that_never_reaches_the_group_is_named(tmp_path):
    """Stuck before init_process_group: rank 0 names it from the store within
    the start's bound, max(20 s, 2 x 5 s)."""
    code, lines = _run(str(tmp_path / "r"), "init:1", "--eval-size", "0", "--max-steps", "4",
                       "--max-restarts", "0")
    took, verdict = _verdict_after_stall(lines, "lorasync: rank 0 (node 0), start of the group")
    print(f"\ninit: verdict {took:.1f} s after the stall (bound 20 s)")
    assert code == 75, "\n".join(line for _, line in lines[-40:])
    assert "rank 1 (its worker never connected to the group's store" in verdict
    assert "did not arrive" in verdict and "within 20 s" in verdict
    assert took < 90, verdict


def test_a_teardown_that_does_not_return_is_left_behind(tmp_path):
    """destroy_process_group blocks on rank 1: the worker ends anyway after
    --fault-timeout, and the finished run exits 0."""
    code, lines = _run(str(tmp_path / "r"), "destroy:1", "--eval-size", "0", "--max-steps", "4",
                       "--ckpt-interval", "0", "--max-restarts", "0")
    took, line = _verdict_after_stall(lines, "destroy_process_group did not return")
    print(f"\ndestroy: the worker ended {took:.1f} s after the stall (bound 5 s)")
    assert code == 0, "\n".join(line for _, line in lines[-40:])
    assert line.startswith("lorasync: rank 1: ") and took < 60
