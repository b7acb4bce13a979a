"""doctor's checks on fake hosts (tests/fixtures/hosts/*) and synthetic rank facts."""

import json
import os
import shutil

import pytest

from lorasync import cli
from lorasync.netdiag.doctor import (Finding, exit_code, format_findings, live_checks, merge_findings,
                                 nccl_ifname_matches, static_checks, worst)
from lorasync.netdiag.hostinfo import HostInfo
from lorasync.plan.net import Link

HOSTS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hosts")
LAN_10G = Link(rate_Bps=10e9 / 8, rtt_s=1e-3, source="given")


def host(name, **env):
    return HostInfo(os.path.join(HOSTS, name), env=env)


def by_check(findings):
    out = {}
    for f in findings:
        out.setdefault(f.check, []).append(f)
    return out


def one(findings, check):
    got = by_check(findings).get(check, [])
    assert len(got) == 1, f"{check}: {got}"
    return got[0]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("NCCL_", "GLOO_", "MASTER_")):
            monkeypatch.delenv(k)


def test_hostinfo_reads_fake_tree():
    h = host("ib")
    assert h.hostname() == "node-c" and h.resolve() == ["10.0.0.13"]
    assert [i.name for i in h.candidate_interfaces()] == ["eth0", "ib0"]
    ib0 = h.interface("ib0")
    assert ib0.mtu == 2044 and ib0.speed_mbps == 100000 and ib0.kind == "ipoib" and ib0.physical
    assert ib0.networks == ["10.1.0.0/24"]
    ports = {(p.device, p.port): p for p in h.ib_ports()}
    assert ports[("mlx5_0", 1)].active and ports[("mlx5_0", 1)].rate_gbps == 100
    assert not ports[("mlx5_1", 1)].active and ports[("mlx5_1", 1)].phys_state == "Disabled"
    assert ports[("mlx5_0", 1)].netdevs == ["ib0"]
    assert h.has_ibverbs() and not host("roce").has_ibverbs()
    ns = h.netns()
    assert ns.inode == 4026531833 and ns.initial is True
    assert h.sysctl("net.ipv4.tcp_rmem") == "4096 131072 67108864"  # tabs normalised
    assert h.endpoint() == ("eth0", "10.0.0.13")


def test_good_host_has_nothing_to_fix():
    fs = static_checks(host("good"), nnodes=4, link=LAN_10G, rdzv_endpoint="10.0.0.11:29400")
    assert worst(fs) in ("ok", "info"), format_findings(fs)
    assert exit_code(fs) == 0
    assert one(fs, "hostname-loopback").severity == "ok"
    assert one(fs, "rendezvous").severity == "ok"
    assert one(fs, "sysctl").severity == "ok"


@pytest.mark.parametrize("nnodes,severity", [(2, "error"), (None, "warn"), (1, "info")])
def test_loopback_hostname(nnodes, severity):
    fs = static_checks(host("loopback-hostname"), nnodes=nnodes, link=LAN_10G)
    f = one(fs, "hostname-loopback")
    assert f.severity == severity
    assert "127.0.1.1" in f.found and "Connection refused" in f.why
    assert "GLOO_SOCKET_IFNAME=ens5" in f.fix  # the 25G NIC, not the 1G one
    assert exit_code(fs) == (1 if severity == "error" else 0)


def test_loopback_hostname_overridden_by_gloo_ifname():
    fs = static_checks(host("loopback-hostname", GLOO_SOCKET_IFNAME="ens5"), nnodes=2, link=LAN_10G)
    assert one(fs, "hostname-loopback").severity == "ok"
    assert one(fs, "gloo-ifname").severity == "ok"


def test_several_candidates_and_down_bridge_ignored():
    fs = static_checks(host("loopback-hostname"), nnodes=2, link=LAN_10G)
    f = one(fs, "interfaces")
    assert f.severity == "warn" and "2 candidate" in f.found
    assert "docker0" not in f.found  # operstate down
    pinned = static_checks(host("loopback-hostname", GLOO_SOCKET_IFNAME="ens5", NCCL_SOCKET_IFNAME="ens5"),
                           nnodes=2, link=LAN_10G)
    assert one(pinned, "interfaces").severity == "ok"


@pytest.mark.parametrize("env,check,severity,text", [
    ({"GLOO_SOCKET_IFNAME": "eth9"}, "gloo-ifname", "error", "does not exist"),
    ({"GLOO_SOCKET_IFNAME": "docker0"}, "gloo-ifname", "error", "down"),
    ({"GLOO_SOCKET_IFNAME": "lo"}, "gloo-ifname", "error", "loopback"),
    ({"NCCL_SOCKET_IFNAME": "ib"}, "nccl-ifname", "error", "matches no interface"),
    ({"NCCL_SOCKET_IFNAME": "^lo,docker"}, "nccl-ifname", "ok", "eno1, ens5"),
    ({"NCCL_SOCKET_IFNAME": "=ens5"}, "nccl-ifname", "ok", "selects ens5"),
])
def test_ifname_env(env, check, severity, text):
    f = one(static_checks(host("loopback-hostname", **env), nnodes=2, link=LAN_10G), check)
    assert f.severity == severity and text in f.found, f


def test_nccl_ifname_syntax():
    names = ["lo", "eth0", "eth1", "docker0", "ib0"]
    assert nccl_ifname_matches("eth", names) == ["eth0", "eth1"]
    assert nccl_ifname_matches("=eth", names) == []
    assert nccl_ifname_matches("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert nccl_ifname_matches("^=eth0", names) == ["lo", "eth1", "docker0", "ib0"]


def test_jumbo_frames_available_but_unused():
    fs = static_checks(host("loopback-hostname"), nnodes=2, link=LAN_10G)
    f = one(fs, "jumbo-frames")
    assert f.severity == "info" and f.found.startswith("ens5") and "mtu 9000" in f.fix
    assert "jumbo-frames" not in by_check(static_checks(host("good"), nnodes=2, link=LAN_10G))


def test_tcp_settings_sized_for_bdp():
    wan = Link(rate_Bps=1e9 / 8, rtt_s=40e-3, source="given")  # BDP 5 MB -> buffers up to 16 MiB
    fs = by_check(static_checks(host("loopback-hostname"), nnodes=2, link=wan))
    rmem = fs["sysctl:net.ipv4.tcp_rmem"][0]
    assert rmem.severity == "warn" and "recommended 4096 131072 16777216" in rmem.found
    assert "per network namespace" in rmem.found and "tcp_rmem='4096 131072 16777216'" in rmem.fix
    assert "host-global" in fs["sysctl:net.core.rmem_max"][0].found
    assert fs["sysctl:net.ipv4.tcp_slow_start_after_idle"][0].severity == "warn"
    assert "tune --apply --rate 1gbit --rtt 40ms" in rmem.fix
    # the well-tuned host meets the targets of the same link
    good = by_check(static_checks(host("good"), nnodes=2, link=wan))
    assert not any(k.startswith("sysctl:") for k in good)


def test_ib_host():
    fs = static_checks(host("ib"), nnodes=2, link=LAN_10G)
    assert one(fs, "rdma").severity == "ok" and "mlx5_0:1 InfiniBand" in one(fs, "rdma").found
    port = one(fs, "rdma-port")
    assert port.severity == "warn" and "mlx5_1 port 1 is DOWN" in port.found and "opensm" in port.fix
    # the 100G IPoIB link is not what the hostname resolves to: pin it
    assert "GLOO_SOCKET_IFNAME=ib0" in one(fs, "interfaces").fix


def test_ib_disabled_in_nccl():
    fs = static_checks(host("ib", NCCL_IB_DISABLE="1"), nnodes=2, link=LAN_10G)
    f = one(fs, "rdma-disabled")
    assert f.severity == "warn" and "sockets" in f.why and f.fix == "unset NCCL_IB_DISABLE"


def test_ib_hca_names_missing_device():
    fs = static_checks(host("ib", NCCL_IB_HCA="mlx5_9:1"), nnodes=2, link=LAN_10G)
    f = one(fs, "nccl-ib-hca")
    assert f.severity == "error" and "mlx5_9" in f.found and f.fix == "export NCCL_IB_HCA=mlx5_0"
    assert exit_code(fs) == 1


def test_roce_host_without_verbs_and_gid_index():
    fs = static_checks(host("roce"), nnodes=2, link=LAN_10G)
    verbs = one(fs, "rdma-verbs")
    assert verbs.severity == "warn" and "libibverbs" in verbs.fix
    gid = one(fs, "roce-gid")
    assert gid.severity == "warn" and gid.fix == "export NCCL_IB_GID_INDEX=3"


@pytest.mark.parametrize("index,severity", [("3", "ok"), ("2", "warn"), ("7", "error"), ("x", "error")])
def test_roce_gid_index(index, severity):
    fs = static_checks(host("roce", NCCL_IB_GID_INDEX=index), nnodes=2, link=LAN_10G)
    assert one(fs, "roce-gid").severity == severity


def test_no_rdma_fast_nic_suggests_socket_threads():
    f = one(static_checks(host("loopback-hostname"), nnodes=2, link=LAN_10G), "nccl-sockets")
    assert "NCCL_SOCKET_NTHREADS=4" in f.fix


@pytest.mark.parametrize("endpoint,check,severity", [
    ("52.14.7.200:29400", "rendezvous-exposed", "warn"),
    ("10.0.0.11:29400", "rendezvous", "ok"),
    ("127.0.0.1:29400", "rendezvous", "warn"),  # loopback while the job spans nodes
    ("nowhere.invalid:29400", "rendezvous", "error"),
])
def test_rendezvous_endpoint(endpoint, check, severity):
    f = one(static_checks(host("good"), nnodes=2, link=LAN_10G, rdzv_endpoint=endpoint), check)
    assert f.severity == severity, f
    if check == "rendezvous-exposed":
        assert "no authentication" in f.why and "ssh -N -L 29400:127.0.0.1:29400" in f.fix
        assert "! -s 10.0.0.0/24" in f.fix


def test_rendezvous_from_master_env_and_public_address_on_this_host():
    h = host("loopback-hostname", MASTER_ADDR="node-b", MASTER_PORT="29500")
    f = one(static_checks(h, nnodes=1, link=LAN_10G), "rendezvous-bind")
    assert f.severity == "warn" and "52.14.7.12" in f.found and "29500" in f.why


def _facts(**over):
    base = {"hostname": "a", "node": "n0", "lorasync": "0.1.0", "torch": "2.13.0", "python": "3.11.7",
            "config_hash": None, "ifname": "eth0", "addr": "10.0.0.1", "mtu": 1500, "gloo_ifnames": 1,
            "nccl_ifname": None}
    base.update(over)
    return base


def test_live_checks_consistent_ranks():
    fs = live_checks([_facts(), _facts(hostname="b", addr="10.0.0.2", node="n1")])
    assert worst(fs) == "ok"
    assert one(fs, "reachable").found.startswith("all 2 ranks")


def test_live_checks_find_mismatches():
    facts = [_facts(), _facts(hostname="b", torch="2.12.0", mtu=9000, gloo_ifnames=2, config_hash="x")]
    fs = live_checks(facts)
    assert one(fs, "same-torch").severity == "error" and "'2.12.0' on rank 1" in one(fs, "same-torch").found
    assert one(fs, "same-config_hash").severity == "error"
    assert one(fs, "gloo-ifname-count").severity == "error"
    mtu = one(fs, "mtu-mismatch")
    assert mtu.severity == "warn" and "mtu 1500" in mtu.fix and "tcp_mtu_probing=1" in mtu.fix
    assert exit_code(fs) == 1


def test_live_checks_name_slow_node():
    facts = [_facts(hostname=h, addr=f"10.0.0.{i + 1}") for i, h in enumerate("abc")]
    bw = {(0, 1): 25e6, (1, 0): 25e6, (0, 2): 2.5e6, (2, 0): 2.4e6, (1, 2): 2.5e6, (2, 1): 2.6e6}
    probe = {"pairs": [{"src": s, "dst": d, "bandwidth_Bps": b, "latency_s": 1e-4} for (s, d), b in bw.items()]}
    f = one(live_checks(facts, probe), "slow-link")
    assert f.severity == "warn"
    assert "rank 2 (c 10.0.0.3) -> rank 0 (a 10.0.0.1)" in f.found
    assert "rank 2 is in every slow pair" in f.found
    one_link = {"pairs": [dict(p, bandwidth_Bps=2.5e6 if {p["src"], p["dst"]} == {1, 2} else 25e6)
                          for p in probe["pairs"]]}
    f = one(live_checks(facts, one_link), "slow-link")
    assert f.severity == "warn" and "only the path between rank 1 and rank 2" in f.found
    even = {"pairs": [dict(p, bandwidth_Bps=25e6) for p in probe["pairs"]]}
    assert one(live_checks(facts, even), "slow-link").severity == "ok"


def test_merge_and_format():
    a = Finding("x", "warn", "same", "why", "fix")
    merged = merge_findings([[a], [Finding("x", "warn", "same", "why", "fix")], []])
    assert len(merged) == 1 and merged[0].ranks == [0, 1]
    text = format_findings(merged + [Finding("y", "error", "bad", "because", "do this")], world=3)
    first = text.splitlines()[1]
    assert first.startswith("ERROR") and "fix: do this" in text and "[ranks 0,1]" in text
    with pytest.raises(ValueError, match="severity"):
        Finding("z", "fatal", "x")


def test_cli_static_exit_codes(capsys):
    root = os.path.join(HOSTS, "good")
    assert cli.main(["doctor", "--root", root, "--nnodes", "2", "--rate", "10gbit", "--rtt", "1ms"]) == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out
    assert cli.main(["doctor", "--root", os.path.join(HOSTS, "loopback-hostname"), "--nnodes", "1"]) == 0
    assert cli.main(["doctor", "--root", os.path.join(HOSTS, "loopback-hostname"), "--nnodes", "2"]) == 1


def test_cli_json(capsys):
    root = os.path.join(HOSTS, "loopback-hostname")
    assert cli.main(["doctor", "--root", root, "--nnodes", "2", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 1 and data["worst"] == "error"
    assert any(f["check"] == "hostname-loopback" and f["severity"] == "error" for f in data["findings"])
    assert data["host"]["hostname"] == "node-b"


@pytest.mark.parametrize("argv,word", [
    (["--root", "/nonexistent-root"], "--root"),
    (["--rate", "fast"], "--rate"),
    (["--rtt", "40"], "--rtt"),
    (["--from-probe", "/nonexistent.json"], "--from-probe"),
])
def test_cli_bad_input_is_exit_2(argv, word, capsys):
    assert cli.main(["doctor", *argv]) == 2
    assert word in capsys.readouterr().err


@pytest.mark.skipif(not shutil.which("ip"), reason="compares with iproute2's view; `ip` is not installed")
def test_addresses_without_iproute2_match_ip():
    """Minimal containers have no `ip`: the ioctl fallback must see the same IPv4 addresses."""
    h = HostInfo("/")
    via_ip = {d["ifname"]: sorted(a["local"] for a in d.get("addr_info", []) if a["family"] == "inet")
              for d in h._ip_addr_json()}
    fallback = {d["ifname"]: sorted(a["local"] for a in d["addr_info"] if a["family"] == "inet")
                for d in h._addr_without_ip()}
    assert fallback == via_ip


def test_wildcard_rendezvous_endpoint_is_an_error():
    f = one(static_checks(host("good"), nnodes=2, link=LAN_10G, rdzv_endpoint="0.0.0.0:29400"),
            "rendezvous")
    assert f.severity == "error" and "wildcard" in f.found and "--rdzv-endpoint ADDR:29400" in f.fix


def test_one_node_without_endpoint_is_fine():
    assert one(static_checks(host("good"), nnodes=1, link=LAN_10G), "rendezvous").severity == "ok"


def test_exposure_names_a_wildcard_listener_of_a_running_job():
    import socket
    import subprocess
    import sys

    from lorasync.netdiag.doctor import HostInfo as RealHost

    code = ("import socket,sys,time;s=socket.socket();s.bind(('0.0.0.0',0));s.listen();"
            "print(s.getsockname()[1],flush=True);time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, "lorasync-test-store"], stdout=subprocess.PIPE,
                         text=True)
    try:
        port = int(p.stdout.readline())
        fs = [f for f in static_checks(RealHost(), nnodes=1, link=LAN_10G) if f.check == "exposure"]
        bad = [f for f in fs if f.severity == "error" and f"0.0.0.0:{port}" in f.found]
        assert bad, fs
        assert "lorasync train" in bad[0].fix
    finally:
        p.kill()
        p.wait()
    with socket.socket() as s:   # bound to one address: not reported as exposed
        s.bind(("127.0.0.1", 0))
        s.listen()
        fs = static_checks(RealHost(), nnodes=1, link=LAN_10G)
        assert not [f for f in fs if f.check == "exposure" and f.severity == "error"
                    and f"127.0.0.1:{s.getsockname()[1]}" in f.found]


def test_exposure_names_a_readable_tunnel_key(tmp_path, monkeypatch):
    import json
    import os

    from lorasync.netdiag import doctor

    key = tmp_path / "private.key"
    key.write_text("k\n")
    os.chmod(key, 0o644)
    cfg = tmp_path / "tunnel.json"
    cfg.write_text(json.dumps({"private_key_file": str(key)}))
    states = tmp_path / "tunnels"
    states.mkdir()
    (states / "lsync0.json").write_text(json.dumps({"config": str(cfg)}))
    monkeypatch.setattr(doctor, "TUNNELS_DIR", states)
    found = [f for f in doctor._check_exposure(doctor.HostInfo()) if str(key) in f.found]
    assert found and found[0].severity == "error" and "chmod 600" in found[0].fix
    os.chmod(key, 0o600)
    assert not [f for f in doctor._check_exposure(doctor.HostInfo()) if str(key) in f.found]


def test_exposure_names_a_readable_ssh_path_key(tmp_path, monkeypatch):
    """A node on the overlay's SSH path keeps its key where its SSH transport
    config says (its state folder unless `tunnel join` put it elsewhere); the hub
    keeps its sshd host key: both are checked like a WireGuard key."""
    import json
    import os

    from lorasync.netdiag import doctor
    from lorasync.overlay import sshtun

    states = tmp_path / "tunnels"
    states.mkdir()
    monkeypatch.setattr(doctor, "TUNNELS_DIR", states)
    for role, name, key in (("node", "n1", tmp_path / "node1.key"),
                            ("hub", "h0", tmp_path / "ssh" / "host_key")):
        key.parent.mkdir(exist_ok=True)
        key.write_text("k\n")
        os.chmod(key, 0o640)
        cfg = sshtun.SSHConfig(path=tmp_path / f"{name}.ssh.json", name=name, node=name,
                               role=role, address="10.77.0.2", subnet="10.77.0.0/24",
                               hub="10.77.0.1", server="192.0.2.1", port=443,
                               state_dir=tmp_path / "ssh", tun=100 if role == "node" else None,
                               key_file=str(key) if role == "node" else None)
        sshtun.write_config(cfg, cfg.path)
        (states / f"{name}.json").write_text(json.dumps({"config": str(cfg.path)}))
        found = [f for f in doctor._check_exposure(doctor.HostInfo()) if str(key) in f.found]
        assert found and found[0].severity == "error" and f"chmod 600 {key}" in found[0].fix
        os.chmod(key, 0o600)
        assert not [f for f in doctor._check_exposure(doctor.HostInfo()) if str(key) in f.found]
