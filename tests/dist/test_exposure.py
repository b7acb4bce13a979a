"""No store or lorasync listener binds a wildcard address: the listening sockets
of a real job's whole process tree (launcher, torchrun agent, workers), on one
node, with and without restarts (with restarts every round gets a fresh store,
which rank 0's worker creates), and for the probe's workers."""

import subprocess
import sys

import pytest

from conftest import cli_env
from listeners import watch, wildcard

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

TINY = ["--model", "tiny", "--batch-size", "2", "--eval-size", "0", "--no-progress",
        "--no-eval-before", "--max-steps", "60", "--ckpt-interval", "0"]


def _run_and_watch(args, seconds=150):
    p = subprocess.Popen([sys.executable, "-m", "lorasync", *map(str, args)], env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = watch(p, seconds)
        out = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, seen, out


@pytest.mark.parametrize("restarts", [0, 2])
def test_one_node_train_listens_on_loopback_only(tmp_path, restarts):
    rc, seen, out = _run_and_watch(["train", *TINY, "--max-restarts", restarts,
                                    "--output-dir", tmp_path / "r"])
    assert rc == 0, out[-2000:]
    # the rendezvous store, the workers' store and gloo's listeners: at least two
    assert len({(a, p) for _, a, p in seen}) >= 2, seen
    assert not [s for s in seen if wildcard(s[1])], f"wildcard listeners: {sorted(seen)}"
    assert {a for _, a, _ in seen} == {"127.0.0.1"}, sorted(seen)


def test_probe_workers_listen_on_loopback_only():
    rc, seen, out = _run_and_watch(["probe", "--nproc", "2", "--quick", "--no-pairs",
                                    "--max-bytes", "64KiB"], seconds=120)
    assert rc == 0, out[-2000:]
    assert seen and {a for _, a, _ in seen} == {"127.0.0.1"}, sorted(seen)
