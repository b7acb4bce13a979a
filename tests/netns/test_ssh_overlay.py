"""The overlay's TCP path (SSH tun forwarding) and ``overlay=auto`` on the emulated cluster.

Needs root, iproute2, nftables, wireguard-go and wg, and Debian's openssh-server
(installed by .ci/run where root is available); skipped with the reason
otherwise.  Every cluster is removed in ``finally``, and the last test checks
that nothing of ours is left: namespaces, tunnels, ssh and sshd processes, state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lorasync.emulate import overlay as cluster_overlay
from lorasync.emulate.cluster import Cluster, down
from lorasync.emulate.spec import parse_emulate
from lorasync.errors import EnvironmentProblem
from lorasync.overlay import tunnel


pytestmark = pytest.mark.netns("nft", "wireguard-go", "wg", "ssh", "ssh-keygen", "sshd", tun=True)

TAG = f"s{os.getpid() % 100000}"
NAMES = [f"{TAG}{k}" for k in ("trn", "neg")]


@pytest.fixture(scope="module", autouse=True)
def _sweep():
    try:
        yield
    finally:
        for name in NAMES:
            down(name)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _steps(path) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    return max([json.loads(ln).get("step", 0) for ln in lines if ln.strip()] or [0])


def test_auto_picks_ssh_for_the_node_without_udp_and_trains_through_a_killed_ssh(tmp_path):
    """3 nodes, node1 without UDP, overlay=auto: node1 joins over SSH, the
    others over WireGuard; the tiny model trains; ssh killed mid-run is started
    again by its supervisor and training finishes with no restart."""
    name, out = NAMES[0], tmp_path / "r"
    argv = [sys.executable, "-m", "lorasync", "train", "--model", "tiny", "--batch-size", "2",
            "--eval-size", "0", "--max-steps", "120", "--no-progress", "--ckpt-interval", "0",
            "--comm", "allreduce", "--warmup-steps", "0",
            "--emulate", f"nodes=3,rate=100mbit,block_udp=node1,overlay=auto,name={name}",
            "--output-dir", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 240
        while _steps(out / "ranks" / "rank1.jsonl") < 10 and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        # the choice, recorded with the cluster and in the tunnels' status, with the reason
        st = Cluster.load(name).status(measure=False)["overlay"]
        how = {n["node"]: (n["transport"], n["reason"]) for n in st["nodes"]}
        assert how["node1"][0] == "ssh" and "UDP to the hub" in how["node1"][1] \
            and "no answer" in how["node1"][1]
        assert how["node0"][0] == how["node2"][0] == "wireguard"
        assert "answers" in how["node2"][1]
        sts = {t["node"]: t for t in tunnel.status(cluster=name, measure=False)}
        assert sts["node1"]["transport"] == "ssh" and sts["node1"]["ifname"] == "tun101"
        states = [s for s in tunnel.states() if s.get("cluster") == name
                  and s.get("transport") == "ssh" and not s.get("is_hub")]
        assert len(states) == 1
        before = states[0]
        os.kill(before["ssh_pid"], signal.SIGKILL)
        killed_at = _steps(out / "ranks" / "rank1.jsonl")
        path = tunnel.TUNNELS_DIR / f"{before['ifname']}.json"
        after = before
        while after.get("restarts", 0) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            after = json.loads(path.read_text())
        log = (tunnel.TUNNELS_DIR / f"{before['ifname']}.log").read_text()
        text = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, text[-3000:]
    assert killed_at < 120   # mid-run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 3
    assert summary["faults"]["restarts"] == 0 and summary["faults"]["faults"] == 0
    for r in range(3):
        assert _steps(out / "ranks" / f"rank{r}.jsonl") == 120
    # the supervisor started ssh again, at once (it had lived past the gate time)
    assert after["restarts"] == 1 and after["ssh_pid"] != before["ssh_pid"]
    assert "ssh exited (code -9)" in log and "ssh started again" in log
    assert not [n for n in _namespaces() if name in n]


def test_negative_control_wireguard_cannot_join_the_node_without_udp(monkeypatch):
    """The same condition with WireGuard forced: node1's tunnel never hears the
    hub (UDP really is blocked), so the build fails and says so."""
    spec = parse_emulate(f"nodes=2,block_udp=node1,name={NAMES[1]}")
    c = Cluster.up(spec)
    try:
        c.spec.overlay = "wireguard"   # what `overlay=wireguard,block_udp=...` refuses up front
        c.nodes = Cluster(c.spec).nodes
        # the probe auto relies on: no UDP comes back, TCP connects
        assert cluster_overlay.probe(c, 0, [1]) == {1: (False, True)}
        monkeypatch.setattr(cluster_overlay, "HUB_TIMEOUT_S", 4.0)
        with pytest.raises(EnvironmentProblem, match="node1: .*did not answer a WireGuard handshake"):
            cluster_overlay.build(c)
    finally:
        c.down()


def test_nothing_of_ours_is_left():
    assert not [n for n in _namespaces() if any(name in n for name in NAMES)]
    left = [s for s in tunnel.states() if s.get("cluster") in NAMES]
    assert not left
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            assert not any(f"{name}.overlay".encode() in cmd for name in NAMES), cmd
