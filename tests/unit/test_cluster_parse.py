"""Cluster spec parsing and validation: pure logic, no root needed."""

from __future__ import annotations

import pytest

from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.emulate import netns
from lorasync.emulate.cluster import Cluster
from lorasync.emulate.spec import ClusterSpec, parse_emulate
from lorasync.units import fmt_rate


def parse_rate(text):
    return ClusterSpec(nodes=2, rate_bps=text).rate_bps


def parse_delay(text):
    return ClusterSpec(nodes=2, delay_s=text).delay_s


def parse_loss(text):
    return ClusterSpec(nodes=2, loss=text).loss


# The spellings (mbit, MB/s, refused mbps, ...) are tested once, for every
# command, in test_units.py; here only what is cluster's own: tc's range,
# bare numbers (bits, ms), int/float input, the field names, as a ClusterSpec
# reads them.

@pytest.mark.parametrize("text,bps", [
    ("8000", 8000), ("8000bit", 8000), (10**6, 10**6), (1.5e6, 1_500_000), ("100gbit", 100 * 10**9),
    ("12.5MB/s", 100_000_000),
])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps and isinstance(parse_rate(text), int)


@pytest.mark.parametrize("text,hint", [
    ("100mbps", "ambiguous"), ("fast", "10mbit"), ("100 furlongs", "unit"), ("", "10mbit"),
    ("1kbit", "between"), ("1tbit", "between"), ("-5mbit", "10mbit"), ("7999", "between"),
    (7999, "between"), (0, "> 0"),
])
def test_parse_rate_rejects_with_fix(text, hint):
    with pytest.raises(ConfigError) as e:
        parse_rate(text)
    assert e.value.field == "rate" and e.value.value == text and hint in str(e.value)


@pytest.mark.parametrize("text,s", [("20ms", 0.02), ("0", 0.0), ("40", 0.04), ("5s", 5.0),
                                    (0.01, 0.01), (0, 0.0)])
def test_parse_delay(text, s):
    assert parse_delay(text) == pytest.approx(s)


@pytest.mark.parametrize("text", ["20 parsecs", "-1ms", "10s", "ms", "5001", 6.0, -0.1])
def test_parse_delay_rejects(text):
    with pytest.raises(ConfigError, match="delay"):
        parse_delay(text)


@pytest.mark.parametrize("text,p", [("0.1%", 0.001), ("1%", 0.01), ("0", 0.0), ("0%", 0.0), (0.02, 0.02)])
def test_parse_loss(text, p):
    assert parse_loss(text) == pytest.approx(p)


@pytest.mark.parametrize("text", ["0.1", "60%", "lots", "-1%"])
def test_parse_loss_rejects(text):
    with pytest.raises(ConfigError) as e:
        parse_loss(text)
    assert e.value.field == "loss" and "%" in e.value.fix


def test_format_rate_roundtrips():
    for text in ["10mbit", "100mbit", "1gbit", "1.5gbit", "500kbit"]:
        assert fmt_rate(parse_rate(text), 'tc', unit='bit') == text
    assert fmt_rate(None, 'tc', unit='bit') == "unshaped"


def test_parse_emulate_full():
    spec = parse_emulate("nodes=3,rate=10mbit,delay=40ms,loss=0.1%,pair=0-2:1mbit,name=x1")
    assert (spec.nodes, spec.rate_bps, spec.delay_s, spec.loss) == (3, 10**7, 0.04, 0.001)
    assert spec.pair_rates == {(0, 2): 10**6}
    assert spec.name == "x1" and spec.needs_forwarder and spec.link_mtu == 65000


def test_parse_emulate_defaults():
    spec = parse_emulate("nodes=2")
    assert spec.rate_bps is None and spec.delay_s == 0 and not spec.needs_forwarder
    assert spec.link_mtu == 1500 and spec.name == "default" and spec.subnet == "10.213.0.0/24"
    assert parse_emulate("nodes=2,rate=1gbit,mtu=9000").link_mtu == 9000


@pytest.mark.parametrize("text,field", [
    ("nodes=0", "nodes"), ("nodes=two", "nodes"), ("rate=1x", "rate"), ("delay=soon", "delay"),
    ("loss=3", "loss"), ("nodes=2,pair=0-5:1mbit", "pair-rate"), ("nodes=2,pair=1-1:1mbit", "pair"),
    ("nodes=2,colour=red", "emulate"), ("nodes", "emulate"), ("nodes=2,name=a-b", "name"),
    ("nodes=2,subnet=8.8.8.0/24", "subnet"), ("nodes=300", "nodes"), ("nodes=2,mtu=100", "mtu"),
    ("nodes=2,subnet=banana", "subnet"),
])
def test_parse_emulate_errors_name_the_field(text, field):
    with pytest.raises(ConfigError) as e:
        parse_emulate(text)
    assert e.value.field == field, str(e.value)
    assert e.value.fix  # every error says how to fix it


def test_spec_accepts_strings_and_orders_pairs():
    spec = ClusterSpec(nodes=3, rate_bps="100mbit", delay_s="5ms", loss="1%", pair_rates={(2, 0): "10mbit"})
    assert spec.rate_bps == 10**8 and spec.delay_s == 0.005 and spec.loss == 0.01
    assert spec.pair_rates == {(0, 2): 10**7}
    again = ClusterSpec(**spec.to_dict())  # the state file's round trip
    assert again == spec


def test_cluster_layout_without_root():
    c = Cluster(parse_emulate("nodes=3,rate=100mbit,pair=0-1:10mbit,name=lay"))
    assert [n.name for n in c.nodes] == ["node0", "node1", "node2"]
    assert [n.netns for n in c.nodes] == [f"lsync-lay-node{i}" for i in range(3)]
    assert [n.address for n in c.nodes] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    assert c.hub_netns == "lsync-lay-hub" and c.hub_address == "10.213.0.254"
    assert c.exec_argv(1, ["python", "-V"]) == ["ip", "netns", "exec", "lsync-lay-node1", "python", "-V"]
    assert c.exec_argv("node2", ["true"])[3] == "lsync-lay-node2"
    assert c.path_rate(0, 1) == 10**7 and c.path_rate(1, 0) == 10**7 and c.path_rate(0, 2) == 10**8
    with pytest.raises(ConfigError, match="0..2"):
        c.exec_argv(3, ["true"])
    with pytest.raises(ConfigError, match="node"):
        c.node("hub")


def test_needs_root(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(EnvironmentProblem, match="root"):
        Cluster.up(parse_emulate("nodes=2,name=noroot"))


def test_needs_iproute2(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None)
    with pytest.raises(EnvironmentProblem, match="iproute2"):
        Cluster.up(parse_emulate("nodes=2,name=noip"))


def test_cli_parses_actions():
    from lorasync.cli import build_parser

    p = build_parser()
    a = p.parse_args(["cluster", "up", "--nodes", "3", "--rate", "100mbit", "--delay", "20ms",
                      "--pair-rate", "0-1=10mbit", "--pair-rate", "1-2=5mbit"])
    assert (a.cluster_cmd, a.nodes, a.rate, a.delay, a.pair_rate) == \
        ("up", 3, "100mbit", "20ms", ["0-1=10mbit", "1-2=5mbit"])
    a = p.parse_args(["cluster", "exec", "node1", "--", "python", "-c", "print(1)"])
    # argparse may or may not keep the "--"; run() accepts both
    assert a.node == "node1" and [x for x in a.argv if x != "--"] == ["python", "-c", "print(1)"]
    assert a.command == "cluster"   # the subcommand, which error lines name
    assert p.parse_args(["cluster", "down", "--all"]).all
    assert p.parse_args(["cluster", "status", "--json", "--no-measure"]).no_measure


def test_cli_bad_pair_rate_is_a_config_error(capsys):
    from lorasync.cli import main

    assert main(["cluster", "up", "--nodes", "2", "--pair-rate", "0-1:fast"]) == 2
    assert "pair-rate" in capsys.readouterr().err
