"""tune, doctor and probe in network namespaces this module builds itself.

Needs root, iproute2 and tbf; skipped otherwise. Every namespace is named
``lsync-test-nd<pid>-...`` and deleted in ``finally`` (with the processes
started in it); veth pairs are created inside the namespaces, so nothing is
added to the root namespace. Timings are asserted loosely: which pair is
slowest, with a 10x shaping ratio, never how fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from lorasync.netdiag.tune import SYSCTL_SCOPE


pytestmark = pytest.mark.netns   # root: namespaces and sysctl writes

PREFIX = f"lsync-test-nd{os.getpid()}"
SUBNET = "10.231.7"


def sh(*argv, check=True):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=check)


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "LOCAL_RANK", "RANK", "WORLD_SIZE",
              "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Topo:
    """Namespaces on a bridge: node i has eth0 = SUBNET.(i+1)/24, its peer
    p<i> sits on br0 in the bridge namespace. Processes started through
    :meth:`spawn` are killed before the namespaces are deleted."""

    def __init__(self, tag: str):
        self.tag = tag
        self.names: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.bridge = None

    def ns(self, suffix: str) -> str:
        name = f"{PREFIX}-{self.tag}-{suffix}"
        sh("ip", "netns", "add", name)
        self.names.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def nodes(self, n: int, mtus=None) -> list[str]:
        self.bridge = self.ns("br")
        sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        out = []
        for i in range(n):
            node = self.ns(f"n{i}")
            # created in the bridge namespace, one end moved straight into the node's
            sh("ip", "-n", self.bridge, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
               "netns", node)
            sh("ip", "-n", self.bridge, "link", "set", f"p{i}", "master", "br0", "up")
            if mtus:
                sh("ip", "-n", node, "link", "set", "eth0", "mtu", mtus[i])
                sh("ip", "-n", self.bridge, "link", "set", f"p{i}", "mtu", max(mtus))
            sh("ip", "-n", node, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            sh("ip", "-n", node, "link", "set", "eth0", "up")
            out.append(node)
        return out

    def shape(self, i: int, rate: str, burst: str):
        """tbf on both ends of node i's veth: what it sends and what it receives."""
        for ns, dev in ((self.names[i + 1], "eth0"), (self.bridge, f"p{i}")):
            sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
               "burst", burst, "latency", "100ms")

    def spawn(self, ns: str, argv: list[str], env: dict) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.procs.append(p)
        return p

    def wait_all(self, procs, timeout: float):
        out = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"a process in a namespace did not finish within {timeout} s")
            out.append((p.returncode, o, e))
        return out

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)

    def close(self):
        self.kill()
        for name in reversed(self.names):
            sh("ip", "netns", "del", name, check=False)


@pytest.fixture
def topo(request):
    t = Topo(request.node.name.split("[")[0][-6:].replace("_", ""))
    try:
        yield t
    finally:
        t.close()
        left = [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(PREFIX)]
        assert not left, f"namespaces left behind: {left}"


def _sysctls(ns: str | None) -> dict:
    out = {}
    for key in SYSCTL_SCOPE:
        path = "/proc/sys/" + key.replace(".", "/")
        argv = ["cat", path] if ns is None else ["ip", "netns", "exec", ns, "cat", path]
        r = subprocess.run(argv, capture_output=True, text=True)
        out[key] = " ".join(r.stdout.split()) if r.returncode == 0 else None
    return out


def _lorasync(*args) -> list[str]:
    return [sys.executable, "-m", "lorasync", *map(str, args)]


@pytest.mark.timeout(120)
def test_tune_apply_revert_inside_namespace(topo, tmp_path):
    ns = topo.ns("tune")
    host_before = _sysctls(None)
    ns_before = _sysctls(ns)
    backup = tmp_path / "backup.json"
    r = sh("ip", "netns", "exec", ns, *_lorasync("tune", "--apply", "--rate", "10gbit", "--rtt", "40ms",
                                                 "--backup", backup), check=False)
    assert r.returncode == 0, r.stderr
    assert "changed net.ipv4.tcp_rmem" in r.stdout
    assert "not changed net.core.rmem_max" in r.stdout and "on the host" in r.stdout
    applied = _sysctls(ns)
    assert applied["net.ipv4.tcp_rmem"].split()[-1] == str(128 << 20)
    assert applied["net.ipv4.tcp_slow_start_after_idle"] == "0"
    assert _sysctls(None) == host_before, "tune in a namespace changed the host"
    saved = json.loads(backup.read_text())
    assert saved["netns_initial"] is False
    assert set(saved["values"]) <= {k for k, (scope, _) in SYSCTL_SCOPE.items() if scope == "netns"}

    r = sh("ip", "netns", "exec", ns, *_lorasync("tune", "--revert", "--backup", backup), check=False)
    assert r.returncode == 0, r.stderr
    assert _sysctls(ns) == ns_before
    assert _sysctls(None) == host_before
    assert not backup.exists()


@pytest.mark.timeout(150)
def test_doctor_finds_loopback_hostname_and_mtu_mismatch(topo):
    n0, n1 = topo.nodes(2, mtus=[1500, 1400])
    # static: the hostname resolves to loopback in every namespace here
    r = sh("ip", "netns", "exec", n0, *_lorasync("doctor", "--nnodes", "2", "--json"), check=False)
    data = json.loads(r.stdout)
    f = {x["check"]: x for x in data["findings"]}["hostname-loopback"]
    assert r.returncode == 1 and f["severity"] == "error"
    assert "GLOO_SOCKET_IFNAME=eth0" in f["fix"]

    # live, without GLOO_SOCKET_IFNAME: the failure the finding predicts
    port = 29517
    base = dict(MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT=port, WORLD_SIZE=2, LOCAL_WORLD_SIZE=1, LOCAL_RANK=0)
    procs = [topo.spawn(ns, _lorasync("doctor", "--timeout", "5", "--no-probe"), _env(RANK=i, **base))
             for i, ns in enumerate((n0, n1))]
    results = topo.wait_all(procs, 90)
    assert all(code == 1 for code, _, _ in results), results
    text = "".join(o for _, o, _ in results)
    assert "could not join" in text and "hostname-loopback" in text

    # live, with it: reachable, and the MTU difference is named (the live probe's
    # findings: tests/dist/test_probe.py::test_cli_doctor_live_two_ranks)
    procs = [topo.spawn(ns, _lorasync("doctor", "--timeout", "60", "--json", "--no-probe"),
                        _env(RANK=i, GLOO_SOCKET_IFNAME="eth0", **dict(base, MASTER_PORT=port + 1)))
             for i, ns in enumerate((n0, n1))]
    results = topo.wait_all(procs, 120)
    code, out, err = results[0]
    data = json.loads(out)
    checks = {x["check"]: x for x in data["findings"]}
    assert checks["reachable"]["severity"] == "ok"
    assert checks["hostname-loopback"]["severity"] == "ok"  # GLOO_SOCKET_IFNAME overrides it
    assert checks["mtu-mismatch"]["severity"] == "warn" and "mtu 1400" in checks["mtu-mismatch"]["fix"]
    assert data["nnodes"] == 2
    assert code == 0, err[-2000:]


@pytest.mark.timeout(180)
def test_probe_pair_matrix_names_the_shaped_node(topo):
    nodes = topo.nodes(3)
    topo.shape(0, "200mbit", "64kb")
    topo.shape(1, "200mbit", "64kb")
    topo.shape(2, "20mbit", "32kb")  # the slow one, 10x
    base = dict(MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT=29519, WORLD_SIZE=3, LOCAL_WORLD_SIZE=1,
                LOCAL_RANK=0, GLOO_SOCKET_IFNAME="eth0")
    args = ("probe", "--json", "--quick", "--max-bytes", "256KiB", "--pair-max-bytes", "256KiB",
            "--time-budget", "120", "--timeout", "60")  # a budget the 6 pairs never spend
    procs = [topo.spawn(ns, _lorasync(*args), _env(RANK=i, **base)) for i, ns in enumerate(nodes)]
    results = topo.wait_all(procs, 150)
    assert all(code == 0 for code, _, _ in results), [e[-2000:] for _, _, e in results]
    res = json.loads(results[0][1])
    addr = {r["rank"]: r["addr"] for r in res["ranks"]}
    assert addr == {i: f"{SUBNET}.{i + 1}" for i in range(3)}
    slow_rank = 2
    bw = {(p["src"], p["dst"]): p["bandwidth_Bps"] for p in res["pairs"]}
    assert len(bw) == 6
    sp = res["slowest_pair"]
    assert slow_rank in (sp["src"], sp["dst"]), res["pairs"]
    fast = [b for (s, d), b in bw.items() if slow_rank not in (s, d)]
    slow = [b for (s, d), b in bw.items() if slow_rank in (s, d)]
    assert max(slow) < min(fast) / 3, bw
