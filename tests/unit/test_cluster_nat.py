"""Cluster specs with nodes behind NAT and a WireGuard overlay: parsing and layout, no root needed."""

from __future__ import annotations

import pytest

from lorasync.errors import ConfigError
from lorasync.emulate.cluster import Cluster
from lorasync.emulate.spec import ClusterSpec, parse_emulate
from lorasync.emulate.overlay import ifname


@pytest.mark.parametrize("text,nat", [
    ("nodes=3,nat=node2", [2]), ("nodes=3,nat=node1,node2", [1, 2]), ("nodes=3,nat=1+2", [1, 2]),
    ("nodes=3,nat=node2,nat=node1", [1, 2]), ("nodes=4,nat=node1,2,rate=10mbit", [1, 2]),
])
def test_parse_nat(text, nat):
    assert parse_emulate(text).nat == nat


def test_parse_overlay_and_describe():
    spec = parse_emulate("nodes=3,nat=node2,overlay=wireguard,rate=100mbit")
    assert spec.overlay == "wireguard" and spec.overlay_subnet == "10.215.0.0/24"
    assert "node2 behind NAT" in spec.describe() and "wireguard overlay" in spec.describe()
    assert ClusterSpec(**spec.to_dict()) == spec   # the state file's round trip
    assert parse_emulate("nodes=2,overlay=none").overlay is None


@pytest.mark.parametrize("text,field,hint", [
    ("nodes=3,nat=node3", "nat", "node0..node2"), ("nodes=3,nat=hub", "nat", "node0"),
    ("nodes=2,nat=node0,node1,overlay=wireguard", "nat", "outside NAT"),
    ("nodes=2,overlay=ipsec", "overlay", "wireguard"),
    ("nodes=2,node1", "emulate", "KEY=VALUE"),
])
def test_bad_nat_and_overlay(text, field, hint):
    with pytest.raises(ConfigError) as e:
        parse_emulate(text)
    assert e.value.field == field and hint in e.value.fix


def test_subnets_must_not_overlap():
    with pytest.raises(ConfigError) as e:
        ClusterSpec(nodes=2, overlay="wireguard", overlay_subnet="10.213.0.0/16")
    assert e.value.field == "overlay_subnet" and "overlaps subnet" in e.value.fix


def test_layout_behind_nat_and_on_the_overlay():
    c = Cluster(parse_emulate("nodes=3,nat=node0,node2,overlay=wireguard,name=lay"))
    n0, n1, n2 = c.nodes
    assert (n0.nat, n1.nat, n2.nat) == (True, False, True)
    # behind NAT: a LAN address of its own; its packets leave with the router's cluster address
    assert (n0.address, n0.outside, n0.nat_netns) == ("10.214.0.2", "10.213.0.1", "lsync-lay-nat0")
    assert (n1.address, n1.outside, n1.nat_netns) == ("10.213.0.2", "10.213.0.2", None)
    # the overlay's hub is the first node outside NAT and gets the first overlay address
    assert c.overlay_hub is n1
    assert [n.overlay_address for n in c.nodes] == ["10.215.0.2", "10.215.0.1", "10.215.0.3"]
    assert [n.overlay_ifname for n in c.nodes] == [ifname("lay", i) for i in range(3)]
    assert len(ifname("a" * 24, 99)) <= 15 and ifname("lay", 0) != ifname("lax", 0)
    # launching over the overlay: the hub hosts the rendezvous
    assert c.measured_pair() == (0, 1, True)
    plain = Cluster(parse_emulate("nodes=2,nat=node1,name=p"))
    assert plain.overlay_hub is None and plain.measured_pair() == (1, 0, False)
    assert Cluster(parse_emulate("nodes=3,nat=node0,node1,name=p")).measured_pair() == (0, 2, False)
    assert Cluster(parse_emulate("nodes=2,nat=node0,node1,name=p")).measured_pair() is None
    with pytest.raises(ConfigError, match="behind NAT"):
        plain.measure(0, 1)
