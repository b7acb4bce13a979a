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


OUTSIDER = r"""
import datetime, sys
from lorasync.launch import guard, stores
host, port = sys.argv[1], int(sys.argv[2])
t = datetime.timedelta(seconds=3)
got = []
for name, cls in (("plain", stores._store_class()),
                  ("other secret", stores._make_store_class("127.0.0.1", guard.new_secret()))):
    try:
        s = cls(host, port, None, False, timeout=t, wait_for_workers=False)
        got.append(f"{name}: joined, keys readable: {s.num_keys()}")
    except Exception as exc:
        got.append(f"{name}: refused ({type(exc).__name__})")
print("|".join(got))
"""


def test_across_nodes_a_process_without_the_secret_can_neither_join_nor_read(tmp_path):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*TINY, "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    # without a shared secret a job across nodes does not start: one line, exit 2
    p = subprocess.run([sys.executable, "-m", "lorasync", "train", *args, "--output-dir",
                        tmp_path / "none"], env=cli_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "LORASYNC_SECRET_FILE" in p.stderr.strip().splitlines()[-1]
    assert "Traceback" not in p.stderr
    secret = tmp_path / "job.secret"
    assert subprocess.run([sys.executable, "-m", "lorasync", "secret", secret]).returncode == 0
    env = cli_env(LORASYNC_SECRET_FILE=str(secret))
    nodes = [subprocess.Popen([sys.executable, "-m", "lorasync", "train", *args, "--output-dir",
                               tmp_path / d], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for d in ("a", "b")]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:   # the rendezvous store is up
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        out = subprocess.run([sys.executable, "-c", OUTSIDER, "127.0.0.1", str(port)],
                             env=cli_env(), capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "plain: refused (DistNetworkError)|" \
            "other secret: refused (StoreAuthError)" or (
                "joined" not in out.stdout and out.stdout.count("refused") == 2), out.stdout
        seen = set()
        for n in nodes:
            seen |= watch(n, 5)
        logs = [n.communicate(timeout=200)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], [log[-1500:] for log in logs]
    assert not [x for x in seen if wildcard(x[1])], sorted(seen)
