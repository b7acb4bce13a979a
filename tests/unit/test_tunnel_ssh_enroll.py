"""The SSH path on real hosts: what `tunnel init --ssh` offers, how `tunnel join`
chooses a transport (and why), what travels, what assemble writes, and the
refusals (one line, exit 2).

WireGuard keys come from tunnel_fakes; SSH keys are real (ssh-keygen), and the
probes talk to a real probe server on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.overlay import enroll, probe, sshtun, tunnel
from tunnel_fakes import fake_wg

needs_ssh = pytest.mark.skipif(not shutil.which("ssh-keygen"), reason="needs ssh-keygen "
                               "(apt-get install -y openssh-client)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the choice

def test_decide_prefers_udp_and_says_why():
    t, why = probe.decide(True, True, host="198.51.100.1", udp_port=51820, ssh_port=443)
    assert t == "wireguard" and why.endswith("WireGuard over UDP, direct")
    t, why = probe.decide(True, False, host="h", udp_port=51820, ssh_port=443, relayed=True)
    assert t == "wireguard" and "relayed through the hub" in why
    t, why = probe.decide(False, True, host="198.51.100.1", udp_port=51820, ssh_port=443)
    assert t == "ssh"
    assert why == ("UDP to the hub 198.51.100.1:51820 got no answer (3 tries), TCP to port 443 "
                   "connects: SSH over TCP")
    with pytest.raises(EnvironmentProblem, match="neither over UDP .port 51820. nor over TCP "
                       r"\(port 443\).*probe-server"):
        probe.decide(False, False, host="h", udp_port=51820, ssh_port=443)
    # the SSH path not offered: a TCP answer is no way in
    with pytest.raises(EnvironmentProblem, match=r"neither over UDP \(port 51820\):"):
        probe.decide(False, True, host="h", udp_port=51820, ssh_port=None)


def test_probe_server_answers_udp_and_greets_tcp_with_the_plans_token():
    up, tp = _free_port(), _free_port()
    ready = threading.Event()
    t = threading.Thread(target=probe.serve, args=("127.0.0.1", up, tp, "plan-1", 5.0),
                         kwargs={"ready": ready.set}, daemon=True)
    t.start()
    assert ready.wait(5)
    assert probe.check("127.0.0.1", up, tp, token="plan-1", wait_s=0.3) == (True, True)
    # another plan's (or another service's) answer is no answer
    assert probe.check("127.0.0.1", up, tp, token="plan-2", tries=1, wait_s=0.2) == (False, False)
    # nothing listens there
    assert probe.check("127.0.0.1", _free_port(), _free_port(), tries=1, wait_s=0.2) == (False, False)
    with pytest.raises(ConfigError, match=f"TCP port {tp} on 127.0.0.1 is already in use"):
        probe.serve("127.0.0.1", _free_port(), tp, "plan-1", 0.1)


# ---------------------------------------------------------------- the plan's offer

def _plan(ssh=True, hub="h=198.51.100.1", nodes=("a", "b"), **ssh_kw):
    specs = [enroll.parse_node_spec(s) for s in (hub, *nodes)]
    return enroll.plan_overlay(specs, "h", ssh=dict({"port": 443}, **ssh_kw) if ssh else None)


def test_init_offers_sshd_on_the_hubs_one_address():
    plan = _plan()
    assert plan["ssh"] == {"host": "198.51.100.1", "listen": "198.51.100.1", "port": 443,
                           "user": "root"}
    # a hub behind 1:1 NAT: the nodes connect to its public address, sshd listens on its own
    plan = _plan(listen="10.0.0.5", port=2222)
    assert plan["ssh"] == {"host": "198.51.100.1", "listen": "10.0.0.5", "port": 2222, "user": "root"}
    assert "ssh" not in _plan(ssh=False)


@pytest.mark.parametrize("hub, kw, field, hint", [
    ("h=hub.example.org", {}, "--ssh-listen", "is a name"),
    ("h=198.51.100.1", {"listen": "0.0.0.0"}, "--ssh-listen", "never listens on a wildcard"),
    ("h=198.51.100.1", {"listen": "::"}, "--ssh-listen", "never listens on a wildcard"),
    ("h=198.51.100.1", {"listen": "hub.example.org"}, "--ssh-listen", "one IP address"),
    ("h=198.51.100.1", {"port": 70000}, "--ssh-port", "between 1 and 65535"),
])
def test_init_refuses_an_sshd_without_one_address(hub, kw, field, hint):
    with pytest.raises(ConfigError) as e:
        _plan(hub=hub, **kw)
    assert e.value.field == field and hint in str(e.value)


def test_the_offer_is_part_of_the_plans_id(tmp_path):
    out = tmp_path / "ov"
    enroll.init_overlay(out, [enroll.parse_node_spec(s) for s in ("h=198.51.100.1", "a")], "h",
                        ssh={"port": 443})
    raw = json.loads((out / "a.plan.json").read_text())
    raw["ssh"]["host"] = "203.0.113.66"   # a node sent elsewhere
    (out / "a.plan.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="does not match its plan id"):
        enroll.read_plan(out / "a.plan.json")


# ---------------------------------------------------------------- join's choice

def _never(*a, **k):
    raise AssertionError("probed")


def test_join_choice_per_flag_and_probe():
    plan = _plan()
    seen = []

    def prober(host, udp_port, tcp_port, token):
        seen.append((host, udp_port, tcp_port, token))
        return False, True
    t, why = enroll.choose_transport(plan, "a", "auto", prober=prober)
    assert t == "ssh" and "got no answer" in why
    assert seen == [("198.51.100.1", 51820, 443, plan["plan_id"])]
    t, why = enroll.choose_transport(plan, "a", "auto", prober=lambda *a, **k: (True, True))
    assert t == "wireguard" and "relayed through the hub" in why   # a and b both behind NAT
    assert enroll.choose_transport(plan, "a", "udp", prober=_never)[0] == "wireguard"
    assert enroll.choose_transport(plan, "a", "ssh", prober=_never) == (
        "ssh", "--transport ssh: SSH over TCP to the hub 198.51.100.1:443")
    t, why = enroll.choose_transport(plan, "a", "auto", "ops@bastion:2200", prober=_never)
    assert t == "ssh" and "jump host" in why and "not probed" in why
    t, why = enroll.choose_transport(plan, "h", "auto", prober=_never)
    assert t == "wireguard" and "offers the SSH path on 198.51.100.1:443" in why
    # a plan without the SSH path: WireGuard, nothing probed
    t, why = enroll.choose_transport(_plan(ssh=False), "a", "auto", prober=_never)
    assert t == "wireguard" and "offers WireGuard only" in why


@pytest.mark.parametrize("plan_ssh, node, transport, jump, field", [
    (False, "a", "ssh", None, "--transport"),
    (False, "a", "auto", "bastion", "--ssh-jump"),
    (True, "a", "udp", "bastion", "--ssh-jump"),
    (True, "a", "auto", "-oProxyCommand=sh", "--ssh-jump"),
    (True, "a", "auto", "bastion host", "--ssh-jump"),
    (True, "h", "ssh", None, "--transport"),
    (True, "a", "tcp", None, "--transport"),
])
def test_join_refusals_name_the_flag(plan_ssh, node, transport, jump, field):
    with pytest.raises(ConfigError) as e:
        enroll.choose_transport(_plan(ssh=plan_ssh), node, transport, jump, prober=_never)
    assert e.value.field == field


# ---------------------------------------------------------------- what travels, what assemble writes

def _enroll(tmp_path, found: dict, ssh=True, specs=("h=198.51.100.1", "a", "b"), hub_transport="auto"):
    """init (with the SSH path), join on each 'machine' (the probes' answers
    per node in ``found``), assemble: {node: tunnel.json dict}, out dir."""
    out = tmp_path / "ov"
    keygen, public_key_of = fake_wg()
    enroll.init_overlay(out, [enroll.parse_node_spec(s) for s in specs], "h",
                        ssh={"port": 443} if ssh else None)
    for s in specs:
        n = s.split("=")[0]
        m = tmp_path / f"machine-{n}"
        m.mkdir()
        plan = Path(shutil.copy(out / f"{n}.plan.json", m))
        enroll.join_overlay(plan, keygen=keygen, public_key_of=public_key_of,
                            transport=hub_transport if n == "h" else "auto",
                            prober=lambda *a, _n=n, **k: found.get(_n, (True, True)))
        shutil.copy(m / f"{n}.pub.json", out)
    paths = enroll.assemble_overlay(out)
    return {p.name.split(".")[0]: json.loads(p.read_text()) for p in paths}, out


@needs_ssh
def test_a_node_without_udp_joins_over_ssh_and_the_hub_serves_it(tmp_path):
    c, out = _enroll(tmp_path, {"a": (False, True)})
    hub_pub = json.loads((out / "h.pub.json").read_text())
    a_pub = json.loads((out / "a.pub.json").read_text())
    # the node made an SSH key on its machine; only its public half travels
    assert a_pub["transport"] == "ssh" and "got no answer" in a_pub["reason"]
    assert a_pub["private_key_file"] == str(tmp_path / "machine-a" / "a" / "ssh.key")
    assert a_pub["ssh_public_key"] == sshtun.public_key_of(a_pub["private_key_file"])
    assert hub_pub["ssh_host_key"] == sshtun.public_key_of(hub_pub["ssh_host_key_file"])
    for key in (a_pub["private_key_file"], hub_pub["ssh_host_key_file"]):
        secret = Path(key).read_text()
        assert os.stat(key).st_mode & 0o077 == 0
        assert [f for f in tmp_path.rglob("*") if f.is_file() and secret in f.read_text(
            errors="replace")] == [Path(key)]
    # the node: its hub's host key pinned, its own tun device, no WireGuard peer
    a = c["a"]
    assert a["transport"] == "ssh" and a["peers"] == [] and not a["relay"]
    assert a["ssh"] == {"host": "198.51.100.1", "port": 443, "user": "root",
                        "host_key": hub_pub["ssh_host_key"], "tun": 101, "proxy_jump": None}
    assert a["routes"] == {"h": "via h", "b": "via h"}
    # the hub: sshd on its one address, a's key for a's tun device only; WireGuard for b,
    # relaying between the two
    h = c["h"]
    assert h["ssh_server"] == {"listen": "198.51.100.1", "port": 443, "dummy": False,
                               "host_key_file": hub_pub["ssh_host_key_file"],
                               "clients": [{"name": "a", "address": "10.77.0.2", "tun": 101,
                                            "public_key": a_pub["ssh_public_key"]}]}
    assert h["relay"] and h["ssh_ifnames"] == ["tun101"] and [p["name"] for p in h["peers"]] == ["b"]
    assert "serves a over SSH (sshd on 198.51.100.1:443)" in \
        next(n for n in h["nodes"] if n["name"] == "h")["reason"]
    b_hub = next(p for p in c["b"]["peers"] if p["name"] == "h")
    assert "10.77.0.2/32" in b_hub["allowed_ips"]   # b reaches a through the hub
    # every config loads; a's gloo device is its tun device; a's key matches a's config
    cfgs = {n: tunnel.load_config(out / f"{n}.tunnel.json") for n in c}
    assert cfgs["a"].device == "tun101" and cfgs["b"].device == cfgs["b"].ifname
    assert tunnel.worker_env(cfgs["a"])["GLOO_SOCKET_IFNAME"] == "tun101"
    assert cfgs["h"].wireguard and not cfgs["a"].wireguard
    tunnel.check_key_matches(cfgs["a"], public_key_of=lambda p: sshtun.public_key_of(p).split()[1])
    cfgs["a"].private_key_file = Path(hub_pub["ssh_host_key_file"])
    with pytest.raises(ConfigError, match="not the one a's config"):
        tunnel.check_key_matches(cfgs["a"], public_key_of=lambda p: sshtun.public_key_of(p).split()[1])


@needs_ssh
def test_a_hub_whose_nodes_are_all_on_ssh_runs_no_wireguard(tmp_path):
    c, out = _enroll(tmp_path, {"a": (False, True)}, specs=("h=198.51.100.1", "a"))
    assert c["h"]["ssh_server"]["dummy"] and c["h"]["peers"] == []
    assert not tunnel.load_config(out / "h.tunnel.json").wireguard


@needs_ssh
def test_runtime_files_of_a_node_and_the_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(sshtun, "TUNNELS_DIR", tmp_path / "run")
    c, out = _enroll(tmp_path, {"a": (False, True)})
    node = sshtun.runtime_config(tunnel.load_config(out / "a.tunnel.json"))
    assert node.role == "node" and node.name == "lsync0" and node.ifname == "tun101"
    assert node.files()["key"] == tmp_path / "machine-a" / "a" / "ssh.key"
    kh = node.files()["known_hosts"].read_text()
    assert kh.startswith("[198.51.100.1]:443 ssh-ed25519 ")
    assert node.linktest_port == 51820 and node.runtime
    assert oct(os.stat(node.state_dir).st_mode & 0o777) == "0o700"
    hub = sshtun.runtime_config(tunnel.load_config(out / "h.tunnel.json"))
    assert hub.role == "hub" and hub.name == "lsync0-sshd" and hub.tunnel == "lsync0"
    ak = hub.files()["authorized_keys"].read_text()
    assert ak.startswith('restrict,tunnel="101",command="/bin/false" ssh-ed25519 ')
    assert sshtun.load_config(hub.path).server == "198.51.100.1"
    # what down removes: the runtime directory and config, never a key
    sshtun._remove_runtime(hub.state_dir, hub.path)
    assert not hub.state_dir.exists() and not hub.path.exists()
    assert Path(c["h"]["ssh_server"]["host_key_file"]).exists()


@needs_ssh
def test_assemble_refuses_an_ssh_node_without_the_hubs_host_key(tmp_path):
    with pytest.raises(ConfigError, match="the hub h's file has no SSH host key"):
        _enroll(tmp_path, {"a": (False, True)}, hub_transport=None)


def test_without_the_ssh_offer_nodes_join_over_udp_as_before(tmp_path):
    c, _ = _enroll(tmp_path, {"a": (False, True)}, ssh=False)
    assert all("ssh" not in cfg and "ssh_server" not in cfg for cfg in c.values())
    assert "offers WireGuard only" in next(n for n in c["h"]["nodes"] if n["name"] == "a")["reason"]


# ---------------------------------------------------------------- the command line

def test_cli_refusals_are_one_line_exit_2(tmp_path, capsys):
    from lorasync import cli

    assert cli.main(["tunnel", "init", "--out", str(tmp_path / "x"), "--hub", "h=hub.example.org",
                     "--node", "a", "--ssh"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ssh-listen" in err and "never a wildcard" in err
    assert not (tmp_path / "x").exists()
    out = tmp_path / "ov"
    assert cli.main(["tunnel", "init", "--out", str(out), "--hub", "h=198.51.100.1",
                     "--node", "a"]) == 0
    capsys.readouterr()
    assert cli.main(["tunnel", "join", str(out / "a.plan.json"), "--transport", "ssh"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "offers no SSH path" in err and "--ssh" in err
    assert cli.main(["tunnel", "probe-server", "--out", str(out)]) == 2
    assert "offers no SSH path" in capsys.readouterr().err


@needs_ssh
@pytest.mark.skipif(os.geteuid() != 0, reason="`tunnel up` checks for root first")
def test_up_without_sshd_names_the_package(tmp_path, capsys, monkeypatch):
    from lorasync import cli

    _, out = _enroll(tmp_path, {"a": (False, True)}, specs=("h=198.51.100.1", "a"))
    monkeypatch.setattr(sshtun, "SSHD", str(tmp_path / "no-sshd"))
    assert cli.main(["tunnel", "up", "--config", str(out / "h.tunnel.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install -y openssh-server" in err


def test_launch_takes_a_hubs_wireguard_tunnel_and_its_sshd_as_one():
    from lorasync.overlay.cli import launch_candidates

    wg = {"ifname": "lsync0", "pid": 1, "config": "/o/h.tunnel.json"}
    sshd = {"ifname": "lsync0-sshd", "pid": 2, "config": "/run/x.sshconf", "tunnel": "lsync0",
            "tunnel_config": "/o/h.tunnel.json", "transport": "ssh"}
    emulated = {"ifname": "lswabcden1", "pid": 3, "config": "/c/n1.tunnel.json", "cluster": "c"}
    alive = lambda pid: pid != 9   # noqa: E731
    assert [s["ifname"] for s in launch_candidates([wg, sshd, emulated], None, alive)] == ["lsync0-sshd"]
    assert len(launch_candidates([wg, sshd], "lsync0", alive)) == 1
    assert launch_candidates([dict(wg, pid=9), dict(sshd, pid=9)], None, alive) == []
    # a node on the SSH path: its state names the tunnel.json launch reads
    node = {"ifname": "lsync0", "pid": 4, "config": "/run/lsync0.sshconf",
            "tunnel_config": "/o/n1.tunnel.json", "transport": "ssh"}
    assert launch_candidates([node], None, alive) == [node]


@needs_ssh
@pytest.mark.parametrize("node, path, value", [
    ("a", ("ssh", "proxy_jump"), "bastion;rm -rf /"),     # ssh runs it through a shell
    ("a", ("ssh", "proxy_jump"), "-oProxyCommand=sh"),
    ("a", ("ssh", "host"), "hub\n[evil]:22 ssh-ed25519 AAAA"),   # a second known_hosts line
    ("a", ("ssh", "host_key"), "ssh-rsa AAAA"),
    ("h", ("ssh_server", "listen"), "0.0.0.0"),
    ("h", ("ssh_server", "clients", 0, "public_key"), 'ssh-ed25519 AAAA",command="sh'),
])
def test_load_config_refuses_an_edited_ssh_section(tmp_path, node, path, value):
    _, out = _enroll(tmp_path, {"a": (False, True)})
    f = out / f"{node}.tunnel.json"
    raw = json.loads(f.read_text())
    d = raw
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    f.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"^{path[0]}: "):
        tunnel.load_config(f)
