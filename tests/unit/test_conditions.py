"""Emulated network conditions, path MTU findings and the huge-page advice, without root.

The namespaces themselves are tested in tests/netns/test_conditions_netns.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from _bad_input import assert_refused, run
from lorasync.emulate import nat
from lorasync.emulate.cluster import Cluster
from lorasync.emulate.netns import ns_names
from lorasync.emulate.spec import ClusterSpec, parse_emulate
from lorasync.errors import ConfigError
from lorasync.netdiag import doctor, pmtu, tune
from lorasync.netdiag.hostinfo import HostInfo

HOSTS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hosts")


# ---------------------------------------------------------------- --emulate keys

@pytest.mark.parametrize("text,key,nodes", [
    ("nodes=3,symmetric_nat=node2", "symmetric_nat", [2]),
    ("nodes=3,symmetric-nat=node1,node2", "symmetric_nat", [1, 2]),
    ("nodes=3,block_udp=0+2", "block_udp", [0, 2]),
    ("nodes=3,block_udp=node2,block_udp=node0,rate=10mbit", "block_udp", [0, 2]),
    ("nodes=3,mtu_blackhole=node1,2,delay=5ms", "mtu_blackhole", [1, 2]),
])
def test_condition_keys_take_node_lists_like_nat(text, key, nodes):
    spec = parse_emulate(text)
    assert getattr(spec, key) == nodes
    assert ClusterSpec(**spec.to_dict()) == spec   # the state file's round trip


def test_symmetric_nat_nodes_are_behind_nat_and_described():
    spec = parse_emulate("nodes=4,nat=node1,symmetric_nat=node2,block_udp=node3,mtu_blackhole=node0")
    assert spec.nat == [1, 2] and spec.symmetric_nat == [2]
    text = spec.describe()
    assert "node1 behind NAT" in text and "node2 behind symmetric NAT" in text
    assert "node3 without UDP" in text and "node0 behind a path MTU black hole (1400)" in text
    c = Cluster(spec)
    assert c.nodes[2].nat and c.nodes[2].nat_netns.endswith("nat2")


@pytest.mark.parametrize("text,field,hint", [
    ("nodes=2,symmetric_nat=node2", "symmetric_nat", "node0..node1"),
    ("nodes=2,block_udp=router", "block_udp", "node0, node1"),
    ("nodes=2,mtu_blackhole=node1,mtu=1400", "mtu_blackhole", "larger mtu"),
    ("nodes=2,mtu_blackhole=node1,mtu=1280", "mtu_blackhole", "path MTU is 1400"),
    ("nodes=2,block_udp=node1,overlay=wireguard", "block_udp", "WireGuard runs over UDP"),
    ("nodes=2,symmetric_nat=node0,symmetric_nat=node1,overlay=wireguard", "nat", "outside NAT"),
    ("nodes=2,udp_block=node1", "emulate", "block_udp"),
])
def test_bad_condition_values_name_key_value_and_fix(text, field, hint):
    with pytest.raises(ConfigError) as e:
        parse_emulate(text)
    assert e.value.field == field and hint in e.value.fix, (e.value.field, e.value.fix)


def test_bad_condition_is_one_line_exit_2_before_any_namespace(capsys, monkeypatch):
    made = []
    monkeypatch.setattr(Cluster, "up", classmethod(lambda cls, spec: made.append(spec)))
    before = ns_names("default") if shutil.which("ip") else []
    rc, _, err = run(capsys, ["cluster", "up", "--nodes", "2", "--block-udp", "node7"])
    assert_refused(rc, err, "block_udp", "node7", "node0..node1")
    rc, _, err = run(capsys, ["cluster", "up", "--nodes", "2", "--mtu", "1300", "--mtu-blackhole", "node1"])
    assert_refused(rc, err, "mtu_blackhole", "larger mtu")
    assert made == [] and (ns_names("default") if shutil.which("ip") else []) == before


def test_emulate_flag_of_train_refuses_a_bad_condition(capsys):
    rc, _, err = run(capsys, ["train", "--model", "tiny", "--emulate", "nodes=2,symmetric_nat=node5"])
    assert_refused(rc, err, "symmetric_nat", "node5")


def test_cluster_up_passes_the_condition_flags(capsys, monkeypatch):
    made = []

    def up(cls, spec):
        made.append(spec)
        raise ConfigError("name", spec.name, "stop here")

    monkeypatch.setattr(Cluster, "up", classmethod(up))
    run(capsys, ["cluster", "up", "--nodes", "3", "--symmetric-nat", "node1,node2", "--block-udp", "node0",
                 "--mtu-blackhole", "node2"])
    assert (made[0].symmetric_nat, made[0].nat, made[0].block_udp, made[0].mtu_blackhole) == \
        ([1, 2], [1, 2], [0], [2])


# ---------------------------------------------------------------- nft rulesets

def test_symmetric_nat_masquerades_with_a_random_port_per_mapping():
    assert "masquerade fully-random" in nat.ruleset("lan", "wan", symmetric=True)
    plain = nat.ruleset("lan", "wan")
    assert "masquerade\n" in plain and "random" not in plain


def test_hub_conditions_ruleset():
    assert nat.conditions_ruleset([], False) is None
    only_udp = nat.conditions_ruleset(["p0", "p2"], False)
    assert 'iifname { "p0", "p2" } meta l4proto udp drop' in only_udp
    assert "frag-needed" not in only_udp and "chain output" not in only_udp
    both = nat.conditions_ruleset(["p1"], True)
    # the hub's own "fragmentation needed" leaves through output
    out_chain = both.split("chain output", 1)[1]
    assert "icmp type destination-unreachable icmp code frag-needed drop" in out_chain


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"), reason="nft -c needs root and nftables")
@pytest.mark.parametrize("rules", [nat.ruleset("lan", "wan", symmetric=True),
                                   nat.conditions_ruleset(["p0", "p1"], True)])
def test_rulesets_are_valid_nft(rules):
    proc = subprocess.run(["nft", "-c", "-f", "-"], input=rules, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- path MTU

class FakePath:
    """A path that answers sizes up to ``mtu`` and loses the rest."""

    def __init__(self, mtu, local=1500):
        self.mtu, self.local, self.sent = mtu, local, []

    def install(self, monkeypatch, reported):
        path = self

        class Pinger:
            def __init__(self, peer):
                pass

            def echo(self, size, timeout_s):
                path.sent.append(size)
                return "ok" if size <= path.mtu else "lost"

            def close(self):
                pass

        calls = iter([self.local, reported])
        monkeypatch.setattr(pmtu, "_Pinger", Pinger)
        monkeypatch.setattr(pmtu, "kernel_path_mtu", lambda peer: next(calls))


def test_bisection_finds_a_black_hole(monkeypatch):
    path = FakePath(1400)
    path.install(monkeypatch, reported=1500)   # nobody said "fragmentation needed"
    r = pmtu.find_path_mtu("10.0.0.2", tries=1, step=8)
    assert 1400 - 8 < r.path_mtu <= 1400 < r.smallest_lost <= 1408 and r.blackhole
    assert r.probes[0] == (1500, "lost") and r.probes[1] == (1280, "ok")


def test_a_reported_limit_is_no_black_hole_and_a_clean_path_costs_one_probe(monkeypatch):
    path = FakePath(1400)
    path.install(monkeypatch, reported=1400)
    assert not pmtu.find_path_mtu("10.0.0.2", tries=1).blackhole
    clean = FakePath(9000, local=1500)
    clean.install(monkeypatch, reported=1500)
    r = pmtu.find_path_mtu("10.0.0.2", tries=3)
    assert (r.path_mtu, r.blackhole, clean.sent) == (1500, False, [1500])


def _result(**kw):
    base = dict(peer="10.0.0.2", local_mtu=1500, largest_ok=1400, smallest_lost=1408, reported_mtu=1500)
    return pmtu.PathMTU(**{**base, **kw})


@pytest.mark.parametrize("kw,severity,needles", [
    ({}, "warn", ["black hole", "1400-byte packets pass, 1408-byte ones vanish", "tunnel init --mtu 1340", "tcp_mtu_probing=1"]),
    ({"reported_mtu": 1400}, "info", ["is 1400, below this host's 1500", "--mtu 1340"]),
    ({"largest_ok": 1500, "smallest_lost": None}, "ok", ["1500"]),
    ({"largest_ok": None, "smallest_lost": 1500}, "info", ["answers no ICMP echo"]),
    ({"error": "no ICMP socket"}, "info", ["not checked", "no ICMP socket"]),
    ({"largest_ok": 1300, "smallest_lost": 1308}, "warn", ["no WireGuard overlay fits"]),
])
def test_path_mtu_findings(kw, severity, needles):
    [f] = doctor.path_mtu_findings(_result(**kw))
    text = f"{f.found} {f.why} {f.fix}"
    assert f.check == "path-mtu" and f.severity == severity
    assert all(n in text for n in needles), text


def test_doctor_probes_only_real_hosts():
    assert doctor._check_path_mtu(HostInfo(os.path.join(HOSTS, "good")), ["10.0.0.2"]) == []


# ---------------------------------------------------------------- huge pages

def _host(tmp_path, base="good", meminfo=None, thp=None, memlock=None):
    root = tmp_path / "host"
    shutil.copytree(os.path.join(HOSTS, base), root)
    if meminfo is not None:
        (root / "proc/meminfo").write_text(meminfo)
    if thp is not None:
        (root / "sys/kernel/mm/transparent_hugepage").mkdir(parents=True)
        (root / "sys/kernel/mm/transparent_hugepage/enabled").write_text(thp)
    if memlock is not None:
        (root / "proc/self").mkdir(parents=True, exist_ok=True)
        (root / "proc/self/limits").write_text(
            "Limit                     Soft Limit           Hard Limit           Units\n"
            f"Max locked memory         {memlock}              {memlock}              bytes\n")
    return HostInfo(str(root))


MEMINFO = "MemTotal: 1000 kB\nHugePages_Total:     512\nHugePages_Free:      512\nHugepagesize:    2048 kB\n"


def test_without_rdma_huge_pages_do_nothing_for_tcp(tmp_path):
    [a] = tune.memory_advice(_host(tmp_path))
    assert a.check == "hugepages" and a.severity == "ok" and "nothing" in a.found
    assert "socket buffers" in a.why and "RDMA" in a.why
    [b] = tune.memory_advice(_host(tmp_path / "r", meminfo=MEMINFO))
    assert b.severity == "info" and "512 x 2 MiB reserved (1 GiB, 512 free)" in b.found
    assert "only if no other program" in b.fix


def test_with_rdma_memlock_and_transparent_huge_pages(tmp_path):
    h = _host(tmp_path, "ib", meminfo=MEMINFO, thp="always madvise [never]\n", memlock=65536)
    advice = {a.check: a for a in tune.memory_advice(h)}
    assert advice["memlock"].severity == "warn" and "ulimit -l unlimited" in advice["memlock"].fix
    assert advice["hugepages"].severity == "info" and "echo madvise" in advice["hugepages"].fix
    assert "translation" in advice["hugepages"].why and "TCP traffic gains nothing" in advice["hugepages"].why
    ok = {a.check: a for a in tune.memory_advice(_host(tmp_path / "o", "ib", thp="always [madvise] never",
                                                       memlock="unlimited"))}
    assert ok["memlock"].severity == "ok" and ok["hugepages"].severity == "ok"
    assert "madvise" in ok["hugepages"].found
    # the same advice reaches doctor, and nothing in tune's settings touches huge pages
    found = {f.check for f in doctor.static_checks(h)}
    assert {"memlock", "hugepages"} <= found
    assert not any("hugepages" in k or "memlock" in k for k in tune.SYSCTL_SCOPE)


# ---------------------------------------------------------------- existing overlays

def _with_ifaces(tmp_path, extra):
    import json

    root = tmp_path / "host"
    shutil.copytree(os.path.join(HOSTS, "good"), root)
    data = json.loads((root / "ip/addr.json").read_text())
    for name, addr, prefix in extra:
        data.append({"ifname": name, "flags": ["POINTOPOINT", "UP", "LOWER_UP"], "mtu": 1280,
                     "operstate": "UNKNOWN", "link_type": "none",
                     "addr_info": [{"family": "inet", "local": addr, "prefixlen": prefix, "scope": "global"}]})
    (root / "ip/addr.json").write_text(json.dumps(data))
    return str(root)


@pytest.mark.parametrize("name,kind", [("tailscale0", "tailscale"), ("zt3jnfsw2k", "zerotier"),
                                       ("wg0", "wireguard"), ("wg-office", "wireguard"),
                                       ("eth0", None), ("tun0", None), ("lsync0", None)])
def test_overlays_are_recognized_by_name(tmp_path, name, kind):
    host = HostInfo(_with_ifaces(tmp_path, [(name, "100.64.0.5", 10)] if name != "eth0" else []))
    assert host.overlay_kind(host.interface(name)) == kind


def test_doctor_says_the_job_runs_over_the_overlay_that_reaches_the_rendezvous(tmp_path):
    root = _with_ifaces(tmp_path, [("tailscale0", "100.64.0.5", 10)])
    host = HostInfo(root, env={})
    assert host.overlay_to("100.64.0.9").name == "tailscale0" and host.overlay_to("10.0.0.12") is None
    [f] = [f for f in doctor.static_checks(host, nnodes=2, rdzv_endpoint="100.64.0.9:29400")
           if f.check == "overlay"]
    assert f.severity == "info" and "tailscale overlay tailscale0" in f.found
    assert "GLOO_SOCKET_IFNAME=tailscale0" in f.found and "stores on 100.64.0.5" in f.found
    assert "export GLOO_SOCKET_IFNAME=tailscale0 NCCL_SOCKET_IFNAME=tailscale0" in f.fix
    pinned = HostInfo(root, env={"GLOO_SOCKET_IFNAME": "tailscale0"})
    [g] = [f for f in doctor.static_checks(pinned, nnodes=2, rdzv_endpoint="100.64.0.9:29400")
           if f.check == "overlay"]
    assert g.severity == "ok"


def test_the_launch_leaves_a_named_interface_alone():
    from lorasync.launch.torchrun import use_overlay

    env = {"GLOO_SOCKET_IFNAME": "eth0"}
    assert use_overlay("100.64.0.9", env) is None and env == {"GLOO_SOCKET_IFNAME": "eth0"}
