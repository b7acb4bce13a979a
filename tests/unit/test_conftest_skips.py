"""The skip that tests/conftest.py gives a test needing what the host lacks:
root, network tools (with the packages that bring them), /dev/net/tun."""

from __future__ import annotations

import os
import shutil

import pytest

import conftest


@pytest.fixture
def host(monkeypatch):
    """A host whose uid, tools and /dev/net/tun the test sets."""
    state = {"uid": 0, "tools": set(conftest.PACKAGES), "tun": True}
    monkeypatch.setattr(os, "geteuid", lambda: state["uid"])
    monkeypatch.setattr(shutil, "which", lambda t: f"/usr/bin/{t}" if t in state["tools"] else None)
    real_access, real_exists = os.access, os.path.exists
    monkeypatch.setattr(os, "access", lambda p, mode: "sshd" in state["tools"] if p == conftest.SSHD
                        else real_access(p, mode))
    monkeypatch.setattr(os.path, "exists", lambda p: state["tun"] if p == "/dev/net/tun"
                        else real_exists(p))
    return state


class _Item:
    def __init__(self, *marks):
        self.marks, self.added = [m.mark for m in marks], []

    def iter_markers(self, name):
        return (m for m in self.marks if m.name == name)

    def add_marker(self, marker):
        self.added.append(marker.mark)


def test_a_host_with_everything_skips_nothing(host):
    assert conftest.missing("ip", "tc", "nft", "sshd", tun=True) is None
    items = [_Item(pytest.mark.netns("nft", tun=True)), _Item(pytest.mark.timeout(5))]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.added for i in items] == [[], []]


def test_a_user_without_root_is_told_so(host):
    host["uid"] = 1000
    assert conftest.missing("ip", "tc") == "needs root"
    assert conftest.missing("ip", root=False) is None


def test_each_missing_tool_is_named_with_its_package(host):
    host["tools"] -= {"tc", "nft", "wg", "sshd", "ssh-keygen"}
    host["tun"] = False
    assert conftest.missing("ip", "tc", "nft", "wireguard-go", "wg", "ssh", "ssh-keygen", "sshd",
                            tun=True) == (
        "needs tc, nft, wg, ssh-keygen, sshd (apt-get install -y iproute2 nftables "
        "wireguard-tools openssh-client openssh-server); /dev/net/tun")


def test_everything_missing_is_named_at_once(host):
    host.update(uid=1000, tools=set(), tun=False)
    assert conftest.missing("ip", "tc", tun=True) == (
        "needs root; ip, tc (apt-get install -y iproute2); /dev/net/tun")


def test_the_netns_marks_of_module_and_test_add_up_over_ip_and_tc(host):
    """The module's mark asks for nft, the test's for wireguard and TUN: the
    skip names every one the host lacks, ip and tc included without asking."""
    host["tools"] -= {"ip", "nft", "wg"}
    host["tun"] = False
    both = _Item(pytest.mark.netns("wireguard-go", "wg", tun=True), pytest.mark.netns("nft"))
    module_only, plain, unmarked = (_Item(pytest.mark.netns("nft")), _Item(pytest.mark.netns),
                                    _Item(pytest.mark.timeout(5)))
    conftest.pytest_collection_modifyitems(None, [both, module_only, plain, unmarked])
    reasons = [[(m.name, m.kwargs["reason"]) for m in i.added] for i in (both, module_only, plain)]
    assert reasons == [
        [("skip", "needs ip, wg, nft (apt-get install -y iproute2 wireguard-tools nftables); "
                  "/dev/net/tun")],
        [("skip", "needs ip, nft (apt-get install -y iproute2 nftables)")],
        [("skip", "needs ip (apt-get install -y iproute2)")]]
    assert unmarked.added == []
