"""Direct paths between two overlay nodes behind NAT (overlay/punch.py), for real.

Two nodes behind plain NAT punch a hole and talk directly, not through the
hub; when that path goes silent they fall back to the hub and an open TCP
connection carries on.  Behind symmetric NAT the try fails and the pair
stays relayed.  Needs root, nftables, wireguard-go and wg; every cluster is
removed in ``finally``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lorasync.emulate.cluster import down
from lorasync.emulate.launch import emulated
from lorasync.emulate.spec import parse_emulate
from lorasync.overlay import punch, tunnel
from lorasync.overlay import wireguard as wg


pytestmark = pytest.mark.netns("nft", "wireguard-go", "wg", tun=True)

TAG = f"pu{os.getpid() % 100000}"


@pytest.fixture(scope="module", autouse=True)
def _sweep():
    try:
        yield
    finally:
        for k in ("nat", "sym"):
            down(f"{TAG}{k}")


def _path(c, a: int, b: int) -> dict:
    sts = {t["node"]: t for t in tunnel.status(cluster=c.spec.name, measure=False)}
    return next(p for p in sts[c.nodes[a].name]["peers"] if p["name"] == c.nodes[b].name)


def _wait_for(c, a: int, b: int, pred, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        p = _path(c, a, b)
        if pred(p) or time.monotonic() > deadline:
            return p
        time.sleep(0.5)


def _hub_rx_from(c, i: int) -> int:
    """Bytes the hub's WireGuard has received from node i."""
    st = tunnel.status(cluster=c.spec.name, measure=False)
    hub = next(t for t in st if t["is_hub"])
    return next(p["rx_bytes"] for p in hub["peers"] if p["name"] == c.nodes[i].name)


STREAM = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.settimeout(None)
end = time.monotonic() + float(sys.argv[3])
sent = 0
while time.monotonic() < end:
    s.sendall(b"x" * 4096); sent += 4096; time.sleep(0.01)
s.shutdown(socket.SHUT_WR)
print(sent, s.recv(64).decode(), flush=True)
"""

SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2]))); print("ready", flush=True)
c, _ = srv.accept(); n = 0
while True:
    b = c.recv(65536)
    if not b:
        break
    n += len(b)
c.sendall(str(n).encode()); c.close()
"""


def test_two_nodes_behind_nat_go_direct_and_fall_back_to_the_hub_when_it_breaks():
    with emulated(parse_emulate(f"nodes=3,rate=50mbit,nat=node1,node2,overlay=wireguard,"
                                f"name={TAG}nat")) as c:
        p = _wait_for(c, 1, 2, lambda p: p["route"].startswith("direct"), 30)
        assert p["route"] == "direct (hole punched)" and not p["relayed"], p
        assert p["path"]["reason"].startswith("hole punched")
        # the endpoint is node2's router's outside address, not the hub's
        assert p["endpoint"].split(":")[0] == c.nodes[2].outside
        back = _wait_for(c, 2, 1, lambda p: p["route"].startswith("direct"), 10)
        assert back["route"] == "direct (hole punched)", back
        # traffic node1 -> node2 no longer passes through the hub's WireGuard
        before = _hub_rx_from(c, 1)
        m = c.measure(1, 2, seconds=1.0, overlay=True)
        assert m.bytes > 1_000_000
        assert _hub_rx_from(c, 1) - before < m.bytes / 10
        # the CLI says so
        out = subprocess.run([sys.executable, "-m", "lorasync", "tunnel", "status", "--no-measure"],
                             capture_output=True, text=True, timeout=60)
        assert "direct (hole punched)" in out.stdout and "path to node2: direct" in out.stdout, \
            out.stdout + out.stderr

        # cut the direct path (UDP between the two routers); a TCP stream keeps going
        sink = subprocess.Popen(c.exec_argv(2, [sys.executable, "-c", SINK,
                                                c.nodes[2].overlay_address, "29777"]),
                                stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "ready"
        secs = punch.LOST_S + 20
        src = subprocess.Popen(c.exec_argv(1, [sys.executable, "-c", STREAM,
                                               c.nodes[2].overlay_address, "29777", str(secs)]),
                               stdout=subprocess.PIPE, text=True)
        r1, r2 = c.nodes[1].outside, c.nodes[2].outside
        rules = (f"table inet lsync_cut {{\n chain f {{\n"
                 f"  type filter hook forward priority -5; policy accept;\n"
                 f"  ip saddr {r1} ip daddr {r2} meta l4proto udp drop\n"
                 f"  ip saddr {r2} ip daddr {r1} meta l4proto udp drop\n }}\n}}\n")
        try:
            time.sleep(2)
            subprocess.run(["ip", "netns", "exec", c.hub_netns, "nft", "-f", "-"], input=rules,
                           text=True, check=True)
            p = _wait_for(c, 1, 2, lambda p: p["relayed"], punch.LOST_S + 10)
            assert p["route"] == "via node0" and "went silent" in p["path"]["reason"], p
            out, _ = src.communicate(timeout=secs + 60)
            sent, got = out.split()
            assert int(sent) == int(got) > 0     # every byte arrived, on one connection
            assert src.returncode == 0
        finally:
            subprocess.run(["ip", "netns", "exec", c.hub_netns, "nft", "delete", "table", "inet",
                           "lsync_cut"], capture_output=True)
            for proc in (src, sink):
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()
        log = (tunnel.TUNNELS_DIR / f"{c.nodes[1].overlay_ifname}.log").read_text()
        assert "direct at" in log and "went silent" in log
        # the direct peer is gone again; node2's address is the hub's peer's once more
        dev = wg.show(c.nodes[1].overlay_ifname, netns=c.nodes[1].netns)
        assert len(dev.peers) == 1 and f"{c.nodes[2].overlay_address}/32" in dev.peers[0].allowed_ips


def test_behind_symmetric_nat_the_try_fails_and_the_hub_keeps_relaying():
    with emulated(parse_emulate(f"nodes=3,rate=50mbit,symmetric_nat=node1,node2,"
                                f"overlay=wireguard,name={TAG}sym")) as c:
        p = _wait_for(c, 1, 2, lambda p: (p["path"] or {}).get("tries") and
                      p["path"]["path"] == "relayed", punch.TRY_S + 15)
        assert p["route"] == "via node0" and p["relayed"], p
        assert "no handshake" in p["path"]["reason"]
        m = c.measure(1, 2, seconds=0.5, overlay=True)   # through the hub, as before
        assert m.bytes > 0
        dev = wg.show(c.nodes[1].overlay_ifname, netns=c.nodes[1].netns)
        assert len(dev.peers) == 1    # the try's peer was removed
