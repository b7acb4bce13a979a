"""The overlay's SSH path without processes: sshd/ssh settings, backoff, the
plan's routes for nodes on the SSH path, the relay's rules, emulation specs."""

from __future__ import annotations

import pytest

from lorasync.emulate.spec import parse_emulate
from lorasync.emulate.overlay import layout
from lorasync.errors import ConfigError
from lorasync.overlay import enroll, sshtun, wireguard as wg
from tunnel_fakes import fake_wg


def test_sshd_listens_on_one_address_with_tun_forwarding_and_keys_only(tmp_path):
    text = sshtun.sshd_config(listen="10.213.0.1", port=22, host_key=tmp_path / "hk",
                              authorized_keys=tmp_path / "ak", pid_file=tmp_path / "p")
    lines = set(text.splitlines())
    assert "ListenAddress 10.213.0.1:22" in lines
    assert {"PermitTunnel point-to-point", "PasswordAuthentication no", "UsePAM no",
            "PermitRootLogin forced-commands-only", "AllowTcpForwarding no"} <= lines
    assert f"AuthorizedKeysFile {tmp_path / 'ak'}" in lines and "ClientAliveInterval 10" in text


@pytest.mark.parametrize("listen", ["0.0.0.0", "::", "", "hub.example"])
def test_sshd_never_listens_on_a_wildcard(listen, tmp_path):
    with pytest.raises(ConfigError, match="wildcard"):
        sshtun.sshd_config(listen=listen, port=22, host_key="h", authorized_keys="a", pid_file="p")


def test_a_key_opens_its_own_tun_device_only():
    line = sshtun.authorized_keys_line("ssh-ed25519 AAAAkey comment", 102)
    assert line.startswith('restrict,tunnel="102",command="/bin/false" ssh-ed25519 AAAAkey ')
    assert sshtun.known_hosts_line("10.0.0.1", 22, "ssh-ed25519 K c") == "10.0.0.1 ssh-ed25519 K\n"
    assert sshtun.known_hosts_line("10.0.0.1", 2222, "ssh-ed25519 K") == "[10.0.0.1]:2222 ssh-ed25519 K\n"


def test_ssh_checks_the_host_key_keeps_alive_and_exits_when_the_tunnel_fails():
    argv = sshtun.ssh_argv(server="10.213.0.1", port=22, key_file="/s/n1.key",
                           known_hosts="/s/known_hosts", local_tun=101, remote_tun=101)
    opts = {argv[i + 1] for i, a in enumerate(argv) if a == "-o"}
    assert {"StrictHostKeyChecking=yes", "BatchMode=yes", "ExitOnForwardFailure=yes",
            "ServerAliveInterval=10", "ServerAliveCountMax=3", "IdentitiesOnly=yes",
            "UserKnownHostsFile=/s/known_hosts", "Tunnel=point-to-point"} <= opts
    assert argv[:3] == ["ssh", "-F", "/dev/null"] and "-w" in argv and argv[-1] == "root@10.213.0.1"
    assert "101:101" in argv and "-J" not in argv
    jump = sshtun.ssh_argv(server="h", port=22, key_file="k", known_hosts="kh", local_tun=1,
                           remote_tun=1, proxy_jump="user@bastion")
    # the jump leg is the user's own ssh (their config, keys, known_hosts), with no prompt
    assert "-J" not in jump
    assert jump[jump.index("-o", jump.index("ExitOnForwardFailure=yes")) + 1:].count(
        "ProxyCommand=ssh -o BatchMode=yes -W '[%h]:%p' 'ssh://user@bastion'") == 1
    two = sshtun.jump_command("a@j1:2200,j2")
    assert two == "ssh -o BatchMode=yes -J 'a@j1:2200' -W '[%h]:%p' 'ssh://j2'"


def test_backoff_as_autossh():
    # a connection that lived past the gate time comes back at once
    assert sshtun.next_delay(sshtun.GATE_S + 1, 0) == sshtun.BACKOFF[0]
    # one that died young waits longer each time in a row, up to the cap
    delays = [sshtun.next_delay(1.0, k) for k in range(1, 8)]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0] and max(delays) == sshtun.BACKOFF[1]


def test_plan_routes_ssh_nodes_through_the_hub(tmp_path):
    nodes = [enroll.NodeSpec("h", "10.0.0.1:51820"), enroll.NodeSpec("a", "10.0.0.2:51820"),
             enroll.NodeSpec("s", "10.0.0.3:51820", transport="ssh", reason="no UDP")]
    keygen, public_key_of = fake_wg()
    paths = enroll.enroll_locally(tmp_path, nodes, "h", keygen=keygen, public_key_of=public_key_of)
    import json

    h, a, s = (json.loads(p.read_text()) for p in paths)
    assert h["routes"] == {"a": "direct", "s": "ssh"} and h["ssh_ifnames"] == ["tun102"]
    assert [p["name"] for p in h["peers"]] == ["a"] and h["relay"] is True
    hub_peer = next(p for p in a["peers"] if p["name"] == "h")
    assert "10.77.0.3/32" in hub_peer["allowed_ips"] and a["routes"]["s"] == "via h"
    assert {n["name"]: n["transport"] for n in a["nodes"]} == {"h": "wireguard", "a": "wireguard",
                                                               "s": "ssh"}
    assert next(n for n in a["nodes"] if n["name"] == "s")["reason"] == "no UDP"
    # plans of WireGuard alone are unchanged: no transport keys in them
    plan = enroll.plan_overlay(nodes[:2], "h", nonce="n")
    assert all("transport" not in n for n in plan["nodes"])
    with pytest.raises(ConfigError, match="hub"):
        enroll.plan_overlay([enroll.NodeSpec("h", "10.0.0.1", transport="ssh"), nodes[1]], "h")
    with pytest.raises(ConfigError, match="transport"):
        enroll.NodeSpec("x", transport="tcp")


def test_relay_lets_packets_pass_to_the_ssh_nodes_devices():
    rules = wg.relay_ruleset("lsw0", ["tun101", "tun102"])
    assert 'iifname "lsw0" oifname != { "lsw0", "tun101", "tun102" } drop' in rules
    assert 'oifname "lsw0" iifname != { "lsw0", "tun101", "tun102" } drop' in rules


def test_emulation_specs():
    assert parse_emulate("nodes=3,block_udp=node1,overlay=auto").overlay == "auto"
    assert parse_emulate("nodes=2,overlay=ssh").overlay == "ssh"
    with pytest.raises(ConfigError, match="overlay=auto"):
        parse_emulate("nodes=3,block_udp=node1,overlay=wireguard")
    with pytest.raises(ConfigError, match="overlay"):
        parse_emulate("nodes=2,overlay=tcp")
    # a node on the SSH path uses its tun device; addresses do not move
    plain = layout(3, [], "10.215.0.0/24", "c")
    mixed = layout(3, [], "10.215.0.0/24", "c", {1: "ssh", 0: "wireguard"})
    assert [a for a, _ in plain] == [a for a, _ in mixed]
    assert mixed[1][1] == "tun101" and mixed[0][1] == plain[0][1] and mixed[2][1] == plain[2][1]
    # overlay=ssh: the hub keeps its own interface (a stand-in holding its address)
    assert layout(2, [], "10.215.0.0/24", "c", {0: "ssh", 1: "ssh"})[0][1] == plain[0][1]
