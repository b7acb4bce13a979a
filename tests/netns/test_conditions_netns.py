"""Emulated network conditions for real: symmetric NAT, UDP blocked, a path MTU
black hole, and an existing WireGuard interface that doctor and the launch pick.

Needs root, iproute2 and nftables (wireguard-go and wg for the last test).
Every cluster is taken down in ``finally``; names carry the pid.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from lorasync.emulate.cluster import Cluster, down
from lorasync.emulate.launch import emulated
from lorasync.emulate.spec import parse_emulate

pytestmark = pytest.mark.netns("nft")
#: the tests over a WireGuard overlay (wg_pair's too)
needs_wg = pytest.mark.netns("wireguard-go", "wg", tun=True)

TAG = f"c{os.getpid() % 100000}"


def _name(kind: str) -> str:
    return f"{TAG}{kind}"


def _namespaces(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"lsync-{name}-")]


def _py(c: Cluster, node: int, code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(c.exec_argv(node, [sys.executable, "-c", textwrap.dedent(code)]),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def _sweep():
    try:
        yield
    finally:
        for kind in ("sym", "udp", "bh", "bhw", "wg", "fail"):
            down(_name(kind))


_UDP_SERVER = """
    import socket, sys
    socks = []
    for port in (7001, 7002):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("{addr}", port)); s.settimeout(5); socks.append(s)
    print("ready", flush=True)
    for s in socks:
        for _ in range({expect}):
            data, src = s.recvfrom(100)
            print(data.decode(), s.getsockname()[1], src[1], flush=True)
"""


def test_symmetric_nat_gives_each_destination_its_own_port():
    """One local socket sends to two destinations: behind symmetric NAT they
    see two different source ports; behind plain NAT, one."""
    with emulated(parse_emulate(f"nodes=3,symmetric_nat=node0,nat=node1,name={_name('sym')}")) as c:
        server = c.node(2).address
        srv = subprocess.Popen(c.exec_argv(2, [sys.executable, "-c", textwrap.dedent(
            _UDP_SERVER.format(addr=server, expect=2))]), stdout=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "ready"
            for node in (0, 1):
                r = _py(c, node, f"""
                    import socket
                    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    s.bind(("{c.node(node).address}", 40000 + {node}))
                    for port in (7001, 7002):
                        s.sendto(b"node{node}", ("{server}", port))
                """)
                assert r.returncode == 0, r.stderr
            out, _ = srv.communicate(timeout=10)
        finally:
            srv.kill()
        seen: dict = {}
        for line in out.split("\n"):
            if line.strip():
                who, _dst, sport = line.split()
                seen.setdefault(who, set()).add(int(sport))
        assert len(seen["node0"]) == 2, seen   # symmetric: a new mapping per destination
        assert seen["node1"] == {40001}, seen  # plain masquerade keeps the free port
        assert "node0 behind symmetric NAT" in c.spec.describe()


def test_block_udp_lets_only_tcp_and_icmp_out():
    with emulated(parse_emulate(f"nodes=2,block_udp=node0,name={_name('udp')}")) as c:
        peer = c.node(1).address
        srv = subprocess.Popen(c.exec_argv(1, [sys.executable, "-c", textwrap.dedent(f"""
            import socket, select
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("{peer}", 7001))
            t = socket.socket(); t.bind(("{peer}", 7002)); t.listen()
            print("ready", flush=True)
            got = []
            while len(got) < 2:
                r, _, _ = select.select([u, t], [], [], 3)
                if not r:
                    break
                for s in r:
                    if s is u:
                        got.append("udp:" + u.recvfrom(100)[0].decode())
                    else:
                        got.append("tcp:" + s.accept()[0].recv(100).decode())
            print(" ".join(sorted(got)), flush=True)
        """)]), stdout=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "ready"
            send = """
                import socket
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"{who}", ("{peer}", 7001))
                with socket.create_connection(("{peer}", 7002), timeout=5) as t:
                    t.sendall(b"{who}")
            """
            assert _py(c, 0, send.format(who="n0", peer=peer)).returncode == 0
            out, _ = srv.communicate(timeout=10)
        finally:
            srv.kill()
        assert out.split() == ["tcp:n0"], out   # the UDP datagram never arrived
        # ICMP still passes (the path MTU probe is ICMP)
        r = _py(c, 0, f"from lorasync.netdiag.pmtu import probe; print(probe('{peer}', 100))")
        assert r.stdout.strip() == "ok", r.stderr


def test_mtu_blackhole_large_df_packets_vanish_and_doctor_says_so():
    with emulated(parse_emulate(f"nodes=2,mtu_blackhole=node1,name={_name('bh')}")) as c:
        peer = c.node(1).address
        code = f"""
            import json
            from lorasync.netdiag.pmtu import find_path_mtu, probe
            print(probe("{peer}", 1300, timeout_s=0.3, tries=2), probe("{peer}", 1500, timeout_s=0.3, tries=2))
            print(json.dumps(find_path_mtu("{peer}", timeout_s=0.2, tries=2, step=16).to_dict()))
        """
        r = _py(c, 0, code)
        assert r.returncode == 0, r.stderr
        small_large, found = r.stdout.splitlines()
        assert small_large.split() == ["ok", "lost"]   # a small DF packet passes, a large one stalls
        found = json.loads(found)
        assert found["blackhole"] and found["reported_mtu"] == 1500, found
        assert 1400 - 16 < found["path_mtu"] <= 1400 < found["smallest_lost"], found
        # doctor, run on node0 with the peer: the black hole and the overlay MTU that fits
        d = subprocess.run(c.exec_argv(0, [sys.executable, "-m", "lorasync", "doctor", "--peer", peer,
                                           "--json"]), capture_output=True, text=True, timeout=60)
        findings = {f["check"]: f for f in json.loads(d.stdout)["findings"]}
        f = findings["path-mtu"]
        assert f["severity"] == "warn" and "black hole" in f["found"], f
        seen = int(re.search(r"(\d+)-byte packets pass", f["found"]).group(1))
        assert 1400 - 8 < seen <= 1400, f
        assert f"--mtu {seen - 60}" in f["fix"] and "tcp_mtu_probing=1" in f["fix"], f
        # the same path with "fragmentation needed" let through: a limit, not a black hole
        subprocess.run(["ip", "netns", "exec", c.hub_netns, "nft", "delete", "table", "ip", "lsync_cond"],
                       check=True)
        r = _py(c, 0, code)
        found = json.loads(r.stdout.splitlines()[1])
        assert not found["blackhole"] and found["reported_mtu"] == 1400, found


def test_a_failed_build_leaves_no_namespace_or_table(monkeypatch):
    """The conditions are built after the namespaces: a failure there removes them all."""
    from lorasync.emulate import cluster as cl
    from lorasync.errors import EnvironmentProblem

    real = cl.Cluster._build_conditions

    def broken(self):
        real(self)  # the hub's table exists now
        raise EnvironmentProblem("injected")

    monkeypatch.setattr(cl.Cluster, "_build_conditions", broken)
    name = _name("fail")
    with pytest.raises(EnvironmentProblem, match="injected"):
        Cluster.up(parse_emulate(f"nodes=2,block_udp=node0,mtu_blackhole=node1,symmetric_nat=node1,name={name}"))
    assert _namespaces(name) == []
    assert not (cl.CLUSTERS_DIR / f"{name}.json").exists()


@needs_wg
def test_overlay_mtu_auto_fits_the_black_hole():
    """The tunnels' MTU (auto) comes from the probed path, so full-size tunnel
    packets fit through the black hole and bulk data flows over the overlay."""
    with emulated(parse_emulate(f"nodes=2,mtu_blackhole=node1,overlay=wireguard,name={_name('bhw')}")) as c:
        from lorasync.overlay import tunnel

        mtus = {t["node"]: t["mtu"] for t in tunnel.status(cluster=c.spec.name, measure=False)}
        assert len(mtus) == 2 and all(1400 - 60 - 8 < m <= 1400 - 60 for m in mtus.values()), mtus
        m = c.measure(0, 1, seconds=0.5, overlay=True)
        assert m.bytes > 1 << 20, m   # a stalled connection moves next to nothing


@pytest.fixture
def wg_pair(tmp_path):
    """Two emulated nodes joined by a plain WireGuard interface each (wireguard-go over
    TUN, named wg*): an overlay lorasync did not make, as Tailscale or ZeroTier would be."""
    with emulated(parse_emulate(f"nodes=2,name={_name('wg')}")) as c:
        names = [f"wg{TAG}{x}" for x in "ab"]
        addrs = ["10.99.0.1", "10.99.0.2"]
        keys = [subprocess.run(["wg", "genkey"], capture_output=True, text=True, check=True).stdout.strip()
                for _ in names]
        pubs = [subprocess.run(["wg", "pubkey"], input=k, capture_output=True, text=True, check=True).stdout.strip()
                for k in keys]
        daemons = []
        try:
            for i, name in enumerate(names):
                key = tmp_path / f"{name}.key"
                key.write_text(keys[i] + "\n")
                key.chmod(0o600)
                daemons.append(subprocess.Popen(c.exec_argv(i, ["wireguard-go", "-f", name]),
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for i, name in enumerate(names):
                sock = f"/var/run/wireguard/{name}.sock"
                for _ in range(100):
                    if os.path.exists(sock):
                        break
                    subprocess.run(["sleep", "0.05"])
                j = 1 - i
                for argv in (["wg", "set", name, "private-key", str(tmp_path / f"{name}.key"),
                              "listen-port", "51999", "peer", pubs[j], "endpoint",
                              f"{c.node(j).address}:51999", "allowed-ips", f"{addrs[j]}/32"],
                             ["ip", "addr", "add", f"{addrs[i]}/24", "dev", name],
                             ["ip", "link", "set", name, "up"]):
                    subprocess.run(c.exec_argv(i, argv), check=True, capture_output=True)
            yield c, names, addrs
        finally:
            for d in daemons:
                d.terminate()
            for d in daemons:
                d.wait(timeout=10)


@needs_wg
def test_an_existing_wireguard_interface_is_recognized_and_used(wg_pair):
    c, names, addrs = wg_pair
    # doctor on node0: the rendezvous (node1's overlay address) is reached over wg*
    d = subprocess.run(c.exec_argv(0, [sys.executable, "-m", "lorasync", "doctor", "--nnodes", "2",
                                       "--rdzv-endpoint", f"{addrs[1]}:29400", "--json"]),
                       capture_output=True, text=True, timeout=60)
    f = next(f for f in json.loads(d.stdout)["findings"] if f["check"] == "overlay")
    assert f"wireguard overlay {names[0]}" in f["found"] and f"GLOO_SOCKET_IFNAME={names[0]}" in f["found"], f
    assert f"stores on {addrs[0]}" in f["found"], f
    # the launch picks it: gloo/NCCL on wg*, the stores on its address (and says so)
    r = _py(c, 0, f"""
        import os
        from lorasync.launch.torchrun import use_overlay
        env = {{}}
        print(use_overlay("{addrs[1]}", env), env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"])
        from lorasync.launch import stores
        print(stores.collective_address(env))
        print(use_overlay("{c.node(1).address}", {{}}))   # not over the overlay: left alone
    """)
    assert r.returncode == 0, r.stderr
    chosen, store, direct = r.stdout.splitlines()
    assert chosen == f"('{names[0]}', '{addrs[0]}') {names[0]} {names[0]}"
    assert store == addrs[0] and direct == "None"
    assert f"reached over wireguard overlay {names[0]}" in r.stderr


@needs_wg
def test_a_job_across_nodes_runs_over_the_existing_interface(wg_pair, tmp_path):
    """lorasync's own launch (here the live doctor: two nodes, one rank each)
    on nodes joined by wg*: every rank talks over it and the stores listen on
    its addresses only."""
    c, names, addrs = wg_pair
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(0o600)
    env = dict(os.environ, LORASYNC_SECRET_FILE=str(secret), OMP_NUM_THREADS="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.pop("NCCL_SOCKET_IFNAME", None)
    procs = [subprocess.Popen(c.exec_argv(i, [sys.executable, "-m", "lorasync", "doctor", "--nproc", "1",
                                              "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint",
                                              f"{addrs[0]}:29400", "--no-probe", "--json"]),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    report = next(json.loads(o) for o, _ in outs if o.strip().startswith("{"))
    ranks = report["ranks"]
    assert [r["ifname"] for r in ranks] == names and [r["addr"] for r in ranks] == addrs, ranks
    listening = {a.rsplit(":", 1)[0] for r in ranks for a in r["store_listen"]}
    assert listening and listening <= set(addrs), ranks
    assert all(f"over wireguard overlay {names[i]}" in outs[i][1] for i in range(2))
