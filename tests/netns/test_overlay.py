"""Nodes behind NAT and the WireGuard overlay on the emulated cluster, for real.

Needs root, iproute2, nftables, wireguard-go and wg (installed by .ci/run
where root is available); skipped with the reason otherwise.  Every cluster
and namespace is removed in ``finally``, and the last test checks that
nothing of ours is left: namespaces, tunnels, processes, sockets, state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import run_cli
from lorasync.overlay import enroll, tunnel
from lorasync.emulate.cluster import Cluster, down
from lorasync.emulate.launch import launch_on_cluster
from lorasync.emulate.spec import parse_emulate


pytestmark = pytest.mark.netns("nft", "wireguard-go", "wg", tun=True)

TAG = f"o{os.getpid() % 100000}"
NAMES = [f"{TAG}{k}" for k in ("rly", "nat", "trn")]
BARE = f"lsync-test-{TAG}"


def _connect(c: Cluster, where: list[str], addr: str, port: int) -> str:
    """'ok' or the error of a TCP connect from a namespace (``ip netns exec`` argv prefix)."""
    code = f"""
        import socket
        try:
            socket.create_connection(("{addr}", {port}), timeout=3).close(); print("ok")
        except OSError as e:
            print(type(e).__name__)
        """
    return subprocess.run([*where, sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=30).stdout.strip()


@pytest.fixture(scope="module", autouse=True)
def _sweep():
    try:
        yield
    finally:
        for name in NAMES:
            down(name)
        subprocess.run(["ip", "netns", "del", BARE], capture_output=True)


@pytest.fixture(scope="module")
def relay():
    """Three nodes, node1 and node2 behind symmetric NAT: no hole punching between them
    (tests/netns/test_punch_netns.py), their pair relayed through the hub node0."""
    c = Cluster.up(parse_emulate(f"nodes=3,rate=50mbit,symmetric_nat=node1,node2,overlay=wireguard,"
                                 f"name={NAMES[0]}"))
    try:
        yield c
    finally:
        c.down()


def test_nat_routers_and_overlay_layout(relay):
    n0, n1, n2 = relay.nodes
    # behind NAT: nothing connects in, the node connects out (it leaves as its router's address)
    assert _connect(relay, relay.exec_argv(0, []), n1.address, 9) == "OSError"  # no route to a LAN
    assert _connect(relay, relay.exec_argv(0, []), n1.outside, 9) == "TimeoutError"  # dropped
    rules = subprocess.run(["ip", "netns", "exec", n1.nat_netns, "nft", "list", "ruleset"],
                           capture_output=True, text=True).stdout
    assert "masquerade" in rules
    sts = {t["node"]: t for t in tunnel.status(cluster=relay.spec.name, measure=False)}
    assert set(sts) == {"node0", "node1", "node2"} and all(t["supervisor_alive"] for t in sts.values())
    peers = {p["name"]: p for p in sts["node1"]["peers"]}
    assert peers["node0"]["route"] == "direct" and peers["node0"]["handshake_age_s"] is not None
    assert peers["node2"]["route"] == "via node0" and peers["node2"]["relayed"]
    assert sts["node0"]["is_hub"] and sts["node1"]["mtu"] == 1440   # path MTU 1500 - 60
    # the hub relays, and only within the overlay
    hub_rules = subprocess.run(relay.exec_argv(0, ["nft", "list", "ruleset"]), capture_output=True,
                               text=True).stdout
    assert f'oifname != "{n0.overlay_ifname}" drop' in hub_rules
    # each node's key was made by its own join, in its own directory, and is in no other file
    from lorasync.emulate.overlay import config_dir
    d = config_dir(relay.spec.name)
    files = [f for f in d.rglob("*") if f.is_file()]
    for n in relay.nodes:
        key = d / n.name / "private.key"
        assert oct(os.stat(key).st_mode & 0o777) == "0o600"
        assert [f for f in files if key.read_text().strip() in f.read_text()] == [key]
        assert tunnel.load_config(d / f"{n.name}.tunnel.json").private_key_file == key.resolve()


def test_relayed_pair_runs_through_the_overlay_on_the_shaped_links(relay):
    m = relay.measure(1, 2, seconds=0.8, overlay=True)   # node1 -> node0 -> node2
    assert m.bytes > 0 and m.rtt_s > 0
    # the cluster's 50 Mbit/s htb shaping still applies under the tunnel (loose: a shared machine)
    assert m.rate_bps < 1.3 * 50e6, m
    # the CLI shows it per peer, with RTT and rate through the overlay
    out = subprocess.run([sys.executable, "-m", "lorasync", "tunnel", "status", "--seconds", "0.5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "via node0" in out.stdout and "Mbit/s" in out.stdout and "(hub's)" in out.stdout


STORE_WORKER = """
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f'{os.environ["MASTER_ADDR"]} {os.environ["MASTER_PORT"]} {os.environ["LORASYNC_RDZV_ENDPOINT"]}')
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""

LISTENER = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", 0)); print(s.getsockname()[1], flush=True); time.sleep(120)
"""


def test_store_listens_on_the_overlay_address_only(relay, tmp_path):
    """From a namespace outside the overlay the stores' ports cannot be reached on the
    node's other addresses; through the overlay they can."""
    script, ready, go = tmp_path / "w.py", tmp_path / "ready", tmp_path / "go"
    script.write_text(STORE_WORKER)
    import threading
    rc = []
    t = threading.Thread(target=lambda: rc.append(launch_on_cluster(
        relay, [str(script), str(ready), str(go)], module=None, timeout=150,
        log_dir=tmp_path / "logs")))
    t.start()
    listeners = []
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.2)
        assert ready.exists(), [p.read_text()[-1500:] for p in (tmp_path / "logs").glob("*.log")]
        master, mport, rdzv = ready.read_text().split()
        stores = [(rdzv.split(":")[0], int(rdzv.split(":")[1])), (master, int(mport))]
        for oaddr, port in stores:
            n = next(n for n in relay.nodes if n.overlay_address == oaddr)
            # outside the overlay: the cluster's router for a node outside NAT, the node's own
            # NAT router (on its LAN) for one behind NAT
            outside = ["ip", "netns", "exec", n.nat_netns or relay.hub_netns]
            # a control: a wildcard listener on that node is reachable from there
            lst = subprocess.Popen(relay.exec_argv(n.index, [sys.executable, "-c", LISTENER]),
                                   stdout=subprocess.PIPE, text=True)
            listeners.append(lst)
            control = int(lst.stdout.readline())
            assert _connect(relay, outside, n.address, control) == "ok"
            assert _connect(relay, outside, n.address, port) == "ConnectionRefusedError", (n.name, port)
            other = relay.nodes[(n.index + 1) % 3]
            assert _connect(relay, relay.exec_argv(other.index, []), oaddr, port) == "ok"
    finally:
        go.write_text("")
        for lst in listeners:
            lst.kill()
            lst.wait()
        t.join(160)
    assert rc == [0], [p.read_text()[-1500:] for p in (tmp_path / "logs").glob("*.log")]


LOOP = """
import os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=90))
rank, world = dist.get_rank(), dist.get_world_size()
if rank == 0:
    open(sys.argv[1], "w").write("started")
bad = 0
for i in range(int(sys.argv[2])):  # a fixed count: every rank runs the same collectives
    t = torch.full((1 << 15,), float(rank + 1))
    dist.all_reduce(t)
    bad += int(t[0].item() != world * (world + 1) / 2)
    time.sleep(0.02)
with open(f"{sys.argv[1]}.{rank}", "w") as f:
    f.write(f"{i + 1} {bad}")
dist.destroy_process_group()
"""


def test_training_traffic_survives_a_tunnel_restart(relay, tmp_path):
    """Kill node2's wireguard-go mid-run: its supervisor brings it back within
    seconds, the collectives carry on, no result is wrong."""
    script, mark = tmp_path / "loop.py", tmp_path / "go"
    script.write_text(LOOP)
    import threading
    rc = []
    t = threading.Thread(target=lambda: rc.append(launch_on_cluster(
        relay, [str(script), str(mark), "200"], module=None, timeout=200, log_dir=tmp_path / "logs")))
    t.start()
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.2)
    st = json.loads((tunnel.TUNNELS_DIR / f"{relay.nodes[2].overlay_ifname}.json").read_text())
    time.sleep(1)
    os.kill(st["wg_pid"], signal.SIGKILL)
    assert not any((tmp_path / f"go.{r}").exists() for r in range(3))  # killed mid-run
    t.join(220)
    assert rc == [0], [p.read_text()[-1500:] for p in (tmp_path / "logs").glob("*.log")]
    for r in range(3):
        assert (tmp_path / f"go.{r}").read_text().split() == ["200", "0"]  # all done, none wrong
    log = (tunnel.TUNNELS_DIR / f"{relay.nodes[2].overlay_ifname}.log").read_text()
    assert "wireguard-go exited (code -9)" in log and "wireguard-go restarted" in log
    after = json.loads((tunnel.TUNNELS_DIR / f"{relay.nodes[2].overlay_ifname}.json").read_text())
    assert after["restarts"] == 1 and after["wg_pid"] != st["wg_pid"]


def test_tunnel_launch_runs_torchrun_over_the_overlay(relay, tmp_path):
    """What a user runs on each real host, here in each node's namespace."""
    out = tmp_path / "probe.json"
    procs = [subprocess.Popen(relay.exec_argv(n.index, [
        sys.executable, "-m", "lorasync", "tunnel", "launch", "--ifname", n.overlay_ifname,
        "--port", "29411", "--run-id", f"t{TAG}", "--", "probe", "--quick", "--no-pairs",
        "--output", str(out)]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1")) for n in relay.nodes]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[-1500:] for o in outs]
    probe = json.loads(out.read_text())
    assert probe["world_size"] == 3
    assert sorted(r["ifname"] for r in probe["ranks"]) == sorted(n.overlay_ifname for n in relay.nodes)
    assert f"rendezvous {relay.nodes[0].overlay_address}:29411 (here)" in outs[0]


TINY = ["--model", "tiny", "--batch-size", "2", "--eval-size", "0", "--max-steps", "3",
        "--no-progress", "--ckpt-interval", "0"]


def test_nat_without_overlay_fails_fast_with_the_fix(tmp_path):
    t0 = time.monotonic()
    p = run_cli("train", *TINY, "--emulate", f"nodes=3,nat=node2,name={NAMES[1]}",
                "--output-dir", tmp_path / "r", timeout=300)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr[-3000:]
    assert "node2 (10.214.2.2; a test connection to its port" in p.stderr
    assert "cannot be reached from node0, node1" in p.stderr and "overlay=wireguard" in p.stderr
    assert took < 150  # bounded by the mesh check, far below gloo's 30 min process-group timeout
    assert not [n for n in _namespaces() if NAMES[1] in n]


def test_overlay_trains_three_ranks_with_node2_behind_nat(tmp_path):
    out = tmp_path / "r"
    p = run_cli("train", *TINY, "--emulate", f"nodes=3,rate=100mbit,nat=node2,overlay=wireguard,"
                f"name={NAMES[2]}", "--output-dir", out, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 3
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["rank"] for r in recs}) == [0, 1, 2] and max(r["step"] for r in recs) == 3
    assert not [n for n in _namespaces() if NAMES[2] in n]


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# ---------------------------------------------------------------- `tunnel up` refusing bad input

@pytest.fixture
def bare(tmp_path):
    """A bare namespace with one address and an overlay config for node a (hub h elsewhere)."""
    subprocess.run(["ip", "netns", "add", BARE], check=True)
    try:
        subprocess.run(["ip", "-n", BARE, "link", "set", "lo", "up"], check=True)
        # a veth pair with both ends here (this kernel has no dummy links): a network the hub
        # would be on, where nothing answers
        subprocess.run(["ip", "-n", BARE, "link", "add", "d0", "type", "veth", "peer", "name", "d1"],
                       check=True)
        subprocess.run(["ip", "-n", BARE, "addr", "add", "192.168.77.2/24", "dev", "d0"], check=True)
        for dev in ("d0", "d1"):
            subprocess.run(["ip", "-n", BARE, "link", "set", dev, "up"], check=True)
        # plan, each node's join (its key in its own directory), assemble: the real flow
        paths = enroll.enroll_locally(tmp_path / "ov", [enroll.parse_node_spec("h=192.168.77.1"),
                                                        enroll.parse_node_spec("a")], "h",
                                      ifname=f"lsx{TAG}")
        yield paths[1]
    finally:
        subprocess.run(["ip", "netns", "exec", BARE, sys.executable, "-m", "lorasync", "tunnel", "down",
                        "--ifname", f"lsx{TAG}"], capture_output=True)
        subprocess.run(["ip", "netns", "del", BARE], capture_output=True)
        for log in tunnel.TUNNELS_DIR.glob(f"lsx{TAG}*.log"):  # down keeps event logs; a test does not
            log.unlink()


def _up(cfg, *extra):
    return subprocess.run(["ip", "netns", "exec", BARE, sys.executable, "-m", "lorasync", "tunnel", "up",
                           "--config", str(cfg), *extra], capture_output=True, text=True, timeout=120)


def _left(ifname: str) -> list[str]:
    left = []
    if subprocess.run(["ip", "-n", BARE, "link", "show", ifname], capture_output=True).returncode == 0:
        left.append("interface")
    if (tunnel.TUNNELS_DIR / f"{ifname}.json").exists():
        left.append("state")
    if os.path.exists(f"/var/run/wireguard/{ifname}.sock"):
        left.append("socket")
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if ifname.encode() in cmd and (b"wireguard-go" in cmd or b"supervise" in cmd):
                left.append(f"process {pid}")
    return left


def test_hub_that_cannot_be_reached(bare):
    p = _up(bare, "--hub-timeout", "2")
    assert p.returncode == 2
    assert "the hub h (192.168.77.1:51820) did not answer a WireGuard handshake within 2 s" in p.stderr
    assert "UDP port 51820" in p.stderr
    assert _left(f"lsx{TAG}") == []


def test_port_in_use_address_clash_and_open_key_file(bare):
    holder = subprocess.Popen(["ip", "netns", "exec", BARE, sys.executable, "-c",
                               "import socket,time; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                               "s.bind(('0.0.0.0', 51820)); print('up', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        p = _up(bare)
        assert p.returncode == 2 and "UDP port 51820 is already in use" in p.stderr, p.stderr
    finally:
        holder.kill()
        holder.wait()
    subprocess.run(["ip", "-n", BARE, "addr", "add", "10.77.0.9/24", "dev", "d0"], check=True)
    p = _up(bare)
    assert p.returncode == 2 and "clashes with d0 (10.77.0.9/24)" in p.stderr, p.stderr
    subprocess.run(["ip", "-n", BARE, "addr", "del", "10.77.0.9/24", "dev", "d0"], check=True)
    key = tunnel.load_config(bare).private_key_file
    os.chmod(key, 0o644)
    p = _up(bare)
    assert p.returncode == 2 and f"chmod 600 {key}" in p.stderr
    assert key.read_text().strip() not in p.stderr + p.stdout
    assert _left(f"lsx{TAG}") == []


def test_a_config_with_another_nodes_key_is_refused(bare):
    """`up` checks the key's public key against the config before it starts anything."""
    raw = json.loads(bare.read_text())
    hub_key = bare.parent / "h" / "private.key"
    raw["private_key_file"] = str(hub_key)
    wrong = bare.parent / "wrong.tunnel.json"
    wrong.write_text(json.dumps(raw))
    p = _up(wrong)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"private_key_file: invalid value '{hub_key}'" in p.stderr
    assert "not the one a's config" in p.stderr
    assert hub_key.read_text().strip() not in p.stderr + p.stdout
    assert _left(f"lsx{TAG}") == []


def test_nothing_of_ours_is_left():
    """Runs last in this module: every cluster above is down."""
    for name in NAMES:
        down(name)
    assert not [n for n in _namespaces() if any(name in n for name in NAMES)]
    ours = [s for s in tunnel.states() if s.get("cluster") in NAMES]
    assert ours == []
    from lorasync.emulate.overlay import ifname
    for name in NAMES:
        for i in range(3):
            assert not os.path.exists(f"/var/run/wireguard/{ifname(name, i)}.sock")
            assert not (tunnel.TUNNELS_DIR / f"{ifname(name, i)}.log").exists()
            assert _left(ifname(name, i)) == []
