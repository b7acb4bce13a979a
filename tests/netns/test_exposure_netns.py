"""An outsider in a routable namespace, without the job's secret, can neither
join, read nor write the stores of a job on an emulated cluster, and no
listener of the job is on a wildcard address, in any node's namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from lorasync.emulate.cluster import down
from lorasync.emulate.launch import emulated, launch_on_cluster
from lorasync.emulate.spec import ClusterSpec

pytestmark = [pytest.mark.netns, pytest.mark.timeout(420)]

NAME = f"t{os.getpid() % 100000}out"
PORT = 29400
OUTSIDER = r"""
import datetime, socket, sys
from lorasync.launch import guard, stores
host, port = sys.argv[1], int(sys.argv[2])
t = datetime.timedelta(seconds=3)
got = []
for name, cls in (("plain", stores._store_class()),
                  ("other secret", stores._make_store_class("127.0.0.1", guard.new_secret()))):
    try:
        s = cls(host, port, None, False, timeout=t, wait_for_workers=False)
        got.append(f"{name}: joined {s.num_keys()}")
    except Exception as exc:
        got.append(f"{name}: refused")
with socket.create_connection((host, port), timeout=5) as s:   # the port is open: the guard
    hello = s.recv(64)
    s.sendall(b"\x00" * 68)
    got.append("raw: " + ("challenge only" if hello[:4] == guard.MAGIC and s.recv(64) == b""
                          else "data"))
print("|".join(got))
"""


def _listeners_in_namespaces(cluster) -> set[tuple[str, str, int]]:
    """(namespace, address, port) of every listening socket of a process in a node's netns."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from listeners import _listen_table

    out = set()
    for n in cluster.nodes:
        pids = subprocess.run(["ip", "netns", "pids", n.netns], capture_output=True,
                              text=True).stdout.split()
        for pid in map(int, pids):
            table = _listen_table(pid)
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:[") and int(target[8:-1]) in table:
                    out.add((n.netns, *table[int(target[8:-1])]))
    return out


def test_an_outsider_without_the_secret_gets_nothing(tmp_path):
    spec = ClusterSpec(nodes=2, rate_bps="200mbit", name=NAME)
    try:
        with emulated(spec) as c:
            rc = []
            argv = ["train", "--model", "tiny", "--batch-size", "2", "--eval-size", "0",
                    "--no-progress", "--no-eval-before", "--max-steps", "2000",
                    "--ckpt-interval", "0", "--output-dir", str(tmp_path / "run")]
            t = threading.Thread(target=lambda: rc.append(launch_on_cluster(
                c, argv, timeout=300, log_dir=tmp_path / "logs")))
            t.start()
            host = c.nodes[0].address
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:   # the rendezvous store is up on node0
                probe = subprocess.run(["ip", "netns", "exec", c.hub_netns, sys.executable, "-c",
                                        f"import socket; socket.create_connection(('{host}', "
                                        f"{PORT}), timeout=1)"], capture_output=True)
                if probe.returncode == 0:
                    break
                time.sleep(0.5)
            # the outsider: the hub namespace routes to every node, and holds no secret
            out = subprocess.run(["ip", "netns", "exec", c.hub_netns, sys.executable, "-c",
                                  OUTSIDER, host, str(PORT)], capture_output=True, text=True,
                                 timeout=120, env={k: v for k, v in os.environ.items()
                                                   if not k.startswith("LORASYNC_SECRET")})
            seen = set()
            while t.is_alive():
                seen |= _listeners_in_namespaces(c)
                t.join(1.0)
        assert out.stdout.strip() == ("plain: refused|other secret: refused|raw: challenge only"), \
            (out.stdout, out.stderr[-1500:])
        assert rc == [0], (tmp_path / "logs" / "node0.log").read_text()[-2000:]
        assert seen, "no listener seen while the job ran"
        wild = [s for s in seen if s[1] in ("0.0.0.0", "::")]
        assert not wild, f"wildcard listeners: {sorted(seen)}"
    finally:
        down(NAME)
