"""The emulated cluster for real: namespaces, shaped links, delay forwarder, launch.

Needs root and iproute2.  Timing is asserted loosely (a shared 2-core machine
is noisy); bench/cluster_links.py prints the measured/configured ratios.
Every fixture takes its cluster down in ``finally``; names carry the pid so
parallel runs (and other people's clusters) do not collide.
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

from lorasync.emulate.cluster import Cluster, down
from lorasync.emulate.launch import emulated, launch_on_cluster
from lorasync.emulate.spec import ClusterSpec, parse_emulate

pytestmark = pytest.mark.netns

TAG = f"t{os.getpid() % 100000}"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _name(kind: str) -> str:
    return f"{TAG}{kind}"


def _namespaces(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"lsync-{name}-")]


def _py(c: Cluster, node: int, code: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(c.exec_argv(node, [sys.executable, "-c", textwrap.dedent(code)]),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def _sweep():
    """Whatever a failed test left behind, the module removes at the end."""
    try:
        yield
    finally:
        for kind in ("two", "pair", "dly", "rate", "crash", "cli", "lch", "term"):
            down(_name(kind))


@pytest.fixture(scope="module")
def two():
    spec = ClusterSpec(nodes=2, rate_bps="50mbit", name=_name("two"))
    c = Cluster.up(spec)
    try:
        yield c
    finally:
        c.down()


def test_nodes_have_namespaces_addresses_and_loopback(two):
    assert sorted(_namespaces(two.spec.name)) == sorted([n.netns for n in two.nodes] + [two.hub_netns])
    for n in two.nodes:
        out = subprocess.run(two.exec_argv(n.index, ["ip", "-o", "-4", "addr", "show"]),
                             capture_output=True, text=True, check=True).stdout
        assert f"{n.address}/24" in out and f" {n.ifname} " in out and "127.0.0.1" in out
    # nothing of ours in the root namespace: the veth pairs are created inside the namespaces
    assert "10.213." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    hub_links = subprocess.run(["ip", "-n", two.hub_netns, "-o", "link"], capture_output=True, text=True).stdout
    assert "p0@" in hub_links and "p1@" in hub_links


def test_shaping_on_both_ends(two):
    node_side = subprocess.run(["tc", "-n", two.nodes[0].netns, "class", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
    hub_side = subprocess.run(["tc", "-n", two.hub_netns, "class", "show", "dev", "p0"],
                              capture_output=True, text=True).stdout
    assert "rate 50Mbit" in node_side and "rate 50Mbit" in hub_side


def test_exec_reaches_the_other_node(two):
    server = subprocess.Popen(two.exec_argv(1, [sys.executable, "-c", textwrap.dedent(f"""
        import socket
        s = socket.create_server(("{two.nodes[1].address}", 7777)); print("up", flush=True)
        c, peer = s.accept(); c.sendall(("hello " + peer[0]).encode()); c.close()
        """)]), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        r = _py(two, 0, f"""
            import socket
            print(socket.create_connection(("{two.nodes[1].address}", 7777), timeout=5).recv(100).decode())
            """)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"hello {two.nodes[0].address}"
    finally:
        server.kill()
        server.wait()


def test_exec_passes_exit_code_through(two):
    from lorasync.cli import main

    assert main(["cluster", "exec", "--name", two.spec.name, "node1", "--",
                 sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
    assert main(["cluster", "exec", "--name", two.spec.name, "0", "--", "true"]) == 0


def test_status_reports_configuration_and_measurement(two, capsys):
    from lorasync.cli import main

    assert main(["cluster", "status", "--name", two.spec.name, "--json", "--seconds", "1"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert [n["address"] for n in st["nodes"]] == ["10.213.0.1", "10.213.0.2"]
    assert [n["ifname"] for n in st["nodes"]] == ["eth0", "eth0"]
    assert st["configured"]["rate_bps"] == 50_000_000
    m = st["measured"]
    assert m["bytes"] > 0 and m["rtt_s"] > 0 and m["connect_s"] > 0
    # loose: real shaping, neither unshaped (GB/s) nor starved
    assert 0.3 * 50e6 < m["rate_bps"] < 1.5 * 50e6, m


def test_load_from_another_process_sees_the_same_cluster(two):
    r = subprocess.run([sys.executable, "-c", f"from lorasync.emulate.cluster import Cluster; "
                        f"print(Cluster.load('{two.spec.name}').nodes[1].address)"],
                       capture_output=True, text=True)
    assert r.stdout.strip() == "10.213.0.2", r.stderr


def test_set_rate_cuts_the_link_live():
    with emulated(ClusterSpec(nodes=2, rate_bps="100mbit", name=_name("rate"))) as c:
        before = c.measure(0, 1, seconds=0.8).rate_bps
        c.set_rate("10mbit")
        after = c.measure(0, 1, seconds=0.8).rate_bps
        assert after < 0.3 * before, (before, after)
        assert Cluster.load(c.spec.name).node_rates == [10_000_000, 10_000_000]
        c.set_rate("100mbit", node=1)
        assert Cluster.load(c.spec.name).node_rates == [10_000_000, 100_000_000]


def test_pair_rate_link_is_slower():
    spec = parse_emulate(f"nodes=3,rate=100mbit,pair=0-1:10mbit,name={_name('pair')}")
    with emulated(spec) as c:
        slow = c.measure(0, 1, seconds=0.8).rate_bps
        back = c.measure(1, 0, seconds=0.8).rate_bps
        fast = c.measure(0, 2, seconds=0.8).rate_bps
        assert slow < 0.4 * fast and back < 0.4 * fast, (slow, back, fast)
        assert slow < 1.5 * 10e6 and back < 1.5 * 10e6


def test_delay_link_adds_round_trip_time_and_down_stops_forwarder():
    spec = parse_emulate(f"nodes=2,rate=100mbit,delay=20ms,name={_name('dly')}")
    c = Cluster.up(spec)
    try:
        pid = c.forwarder_pid
        assert pid and os.path.exists(f"/proc/{pid}")
        m = c.measure(0, 1, seconds=0.8)
        assert m.rtt_min_s >= 2 * 0.020, m   # every packet is held 20 ms, each way
        assert m.rtt_s < 2 * 0.020 + 0.050, m
        assert m.connect_s >= 2 * 0.020, m
        assert m.rate_bps > 0.2 * 100e6, m
    finally:
        c.down()
    assert _namespaces(spec.name) == []
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split(")")[1][:3]


def test_down_is_idempotent_and_cleans_up_after_a_crash():
    name = _name("crash")
    c = Cluster.up(parse_emulate(f"nodes=2,loss=1%,name={name}"))
    # a crashed run: a process still inside a node, and the state file gone
    sleeper = subprocess.Popen(c.exec_argv(0, [sys.executable, "-c", "print('in', flush=True); "
                                              "import time; time.sleep(300)"]), stdout=subprocess.PIPE)
    assert sleeper.stdout.readline() == b"in\n"  # it is inside the namespace now
    os.unlink(f"/run/lorasync/clusters/{name}.json")
    fwd = c.forwarder_pid
    with pytest.raises(Exception, match="down"):
        Cluster.up(parse_emulate(f"nodes=2,name={name}"))  # leftovers block a new one
    removed = down(name)
    assert sleeper.wait(timeout=5) == -15  # SIGTERM from down
    assert any("netns" in r for r in removed) and _namespaces(name) == []
    assert not os.path.exists(f"/proc/{fwd}") or "Z" in open(f"/proc/{fwd}/stat").read().split(")")[1][:3]
    assert down(name) == [] and down(name) == []


def test_cli_up_status_down(capsys):
    from lorasync.cli import main

    name = _name("cli")
    try:
        assert main(["cluster", "up", "--name", name, "--nodes", "2", "--rate", "20mbit",
                     "--pair-rate", "0-1=10mbit"]) == 0
        assert main(["cluster", "status", "--name", name, "--no-measure"]) == 0
        out = capsys.readouterr().out
        assert "lsync-" + name + "-node1" in out and "pair 0-1: 10mbit" in out
        assert main(["cluster", "up", "--name", name, "--nodes", "2"]) == 2  # already up
    finally:
        assert main(["cluster", "down", "--name", name]) == 0
    assert main(["cluster", "down", "--name", name]) == 0
    assert _namespaces(name) == []


WORKER = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
peer = dist.get_world_size()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    f.write('{"sum": %s, "world": %d, "gloo_if": "%s"}' % (t[0].item(), peer, os.environ["GLOO_SOCKET_IFNAME"]))
dist.destroy_process_group()
sys.exit(2 if rank == 1 else 0)   # a "user error" on one node must come back as 2
"""


def test_launch_on_cluster_runs_gloo_all_reduce_across_nodes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with emulated(ClusterSpec(nodes=2, rate_bps="100mbit", name=_name("lch"))) as c:
        t = time.monotonic()
        rc = launch_on_cluster(c, [str(script), str(tmp_path)], module=None, timeout=120,
                               log_dir=tmp_path / "logs", fail_grace=1.0)
        took = time.monotonic() - t
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # 1 + 2: both ranks' data crossed the link
    assert all(r["world"] == 2 and r["gloo_if"] == "eth0" for r in results)
    assert rc == 2, (rc, (tmp_path / "logs" / "node1.log").read_text()[-2000:])
    assert took < 100


SLEEPER = """
import os, sys, time
open(os.path.join(sys.argv[1], "pid%d" % os.getpid()), "w").close()
time.sleep(300)
"""


def test_launch_on_cluster_timeout_kills_everything(tmp_path):
    from lorasync.emulate.netns import pids_in_netns

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    with emulated(ClusterSpec(nodes=2, name=_name("lch"))) as c:
        rc = launch_on_cluster(c, [str(script), str(tmp_path)], module=None, timeout=12,
                               log_dir=tmp_path / "logs")
        assert rc == 124
        left = [p for n in c.nodes for p in pids_in_netns(n.netns)]
        assert left == [], left
    for f in tmp_path.glob("pid*"):  # workers that had started are gone too
        assert not os.path.exists(f"/proc/{f.name[3:]}")


def test_a_bench_killed_with_sigterm_takes_its_cluster_down(tmp_path):
    """A script that holds ``emulated(...)`` and is ended with SIGTERM (kill, a CI
    timeout) still removes its namespaces: the default SIGTERM would not unwind."""
    name = _name("term")
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'src')!r})\n"
        "from lorasync.emulate.launch import emulated\n"
        f"with emulated('nodes=2,rate=100mbit,name={name}'):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        assert _namespaces(name)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
        down(name)
    assert not _namespaces(name)


CGROUP = """
import os, sys
with open(os.path.join(sys.argv[1], "cg%s" % os.environ["RANK"]), "w") as f:
    f.write(open("/proc/self/cgroup").read())
"""


def test_launch_on_cluster_holds_every_rank_to_the_cpu_cap_and_removes_it(tmp_path):
    from lorasync.emulate import cpucap

    if cpucap.hierarchy() is None:
        pytest.skip("no CPU cgroup on this host")
    script = tmp_path / "cg.py"
    script.write_text(CGROUP)
    name = _name("cap")
    with emulated(ClusterSpec(nodes=2, name=name)) as c:
        rc = launch_on_cluster(c, [str(script), str(tmp_path)], module=None, timeout=120,
                               log_dir=tmp_path / "logs", cpu_cap=1.5)
    assert rc == 0, (tmp_path / "logs" / "node0.log").read_text()[-2000:]
    for r in (0, 1):
        assert f"/lorasync-{name}" in (tmp_path / f"cg{r}").read_text()  # each node's rank, in the cap
    root, _ = cpucap.hierarchy()
    assert not (root / f"lorasync-{name}").exists()
