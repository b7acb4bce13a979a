"""The agent's mesh check and store binding helpers, and doctor's overlay checks: no root needed."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from lorasync.launch import agent
from lorasync.netdiag.doctor import live_checks, parse_proc_net_tcp, static_checks
from lorasync.netdiag.hostinfo import HostInfo


def test_split_argv_takes_only_leading_options():
    opts, rest = agent.split_argv(["--lorasync-label", "node1", "--lorasync-store-addr=10.0.0.1",
                                   "--lorasync-reach-timeout", "2.5", "--nnodes", "2", "-m", "x",
                                   "--lorasync-label", "not-ours"])
    assert (opts.label, opts.store_addr, opts.reach_timeout, opts.rdzv_wait) == ("node1", "10.0.0.1", 2.5, 0.0)
    assert rest == ["--nnodes", "2", "-m", "x", "--lorasync-label", "not-ours"]
    assert agent.split_argv(["--nnodes", "1"])[0].reach_timeout == agent.DEFAULT_REACH_TIMEOUT
    argv = agent.agent_argv("py", label="n0", store_addr="10.0.0.1", reach_timeout=0)
    assert argv == ["py", "-m", "lorasync.launch.agent", "--lorasync-label", "n0",
                    "--lorasync-store-addr", "10.0.0.1", "--lorasync-reach-timeout", "0"]


class FakeStore:
    """The three store calls check_mesh uses, shared by threads; ``tamper`` edits values as set."""

    def __init__(self, tamper=None):
        self.d, self.cv, self.tamper = {}, threading.Condition(), tamper

    def set(self, k, v):
        with self.cv:
            self.d[k] = self.tamper(k, v) if self.tamper else v
            self.cv.notify_all()

    def get(self, k):
        return self.d[k].encode()

    def wait(self, keys, timeout):
        with self.cv:
            assert self.cv.wait_for(lambda: all(k in self.d for k in keys), timeout.total_seconds())


def _run_mesh(store, world=2):
    errors = [None] * world

    def one(r):
        try:
            agent.check_mesh(store, r, world, f"node{r}", "127.0.0.1", 2.0)
        except agent.UnreachableNodes as exc:
            errors[r] = exc
    ts = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return errors


def test_mesh_check_passes_when_every_node_listens():
    assert _run_mesh(FakeStore(), world=3) == [None, None, None]


def test_mesh_check_names_the_unreachable_node_on_every_agent():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()

    def tamper(k, v):  # node1 announces a port nothing listens on: as if behind NAT
        if k == "lorasync/reach/addr/1":
            d = json.loads(v)
            d["port"] = closed
            return json.dumps(d)
        return v
    errors = _run_mesh(FakeStore(tamper))
    assert all(isinstance(e, agent.UnreachableNodes) for e in errors)
    msg = str(errors[0])
    assert f"node1 (127.0.0.1; a test connection to its port {closed}) cannot be reached from node0" in msg
    assert "overlay" in msg and "lorasync tunnel" in msg
    assert errors[0].brief is None and "node1 cannot be reached" in errors[1].brief


def test_wait_rendezvous_gives_up_with_the_fix():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(agent.UnreachableNodes) as e:
        agent.wait_rendezvous(f"127.0.0.1:{port}", 0.5, "node1")
    assert f"node1 cannot open a connection to the rendezvous at 127.0.0.1:{port}" in str(e.value)
    assert "overlay" in str(e.value)


# ---------------------------------------------------------------- doctor

PROC_TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100D70A:72D8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 00000000:85A5 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 100 0 0 10 0
   2: 0100D70A:85A5 0200D70A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000000000000000 20 4 30 10 -1
"""


def test_parse_proc_net_tcp_listeners():
    assert parse_proc_net_tcp(PROC_TCP) == [("10.215.0.1", 29400), ("0.0.0.0", 34213)]
    v6 = "  sl local\n   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A x\n"
    assert parse_proc_net_tcp(v6, ipv6=True) == [("::", 8080)]


def _facts(**over):
    base = {"hostname": "vm", "node": "n0", "lorasync": "0.1.0", "torch": "2.13.0", "python": "3.11.7",
            "config_hash": None, "ifname": "eth0", "addr": "10.213.0.1", "mtu": 1500, "gloo_ifnames": 1,
            "nccl_ifname": None, "network": "10.213.0.0/24", "overlay": False, "store_listen": []}
    base.update(over)
    return base


def _by(findings, check):
    return [f for f in findings if f.check == check]


def test_live_job_spanning_networks_without_overlay_and_exposed_store():
    facts = [_facts(store_listen=["0.0.0.0:29400"]),
             _facts(node="n2", addr="10.214.2.2", network="10.214.2.0/24")]
    fs = live_checks(facts)
    (span,) = _by(fs, "spans-networks")
    assert span.severity == "warn" and "10.213.0.0/24, 10.214.2.0/24" in span.found
    assert "lorasync tunnel" in span.fix
    (store,) = _by(fs, "store-exposed")
    assert store.severity == "error" and "0.0.0.0:29400" in store.found and "spans networks" in store.found


def test_live_overlay_with_store_on_the_overlay_only():
    facts = [_facts(ifname="lsync0", addr="10.77.0.1", network="10.77.0.0/24", overlay=True,
                    store_listen=["10.77.0.1:29400", "10.77.0.1:34213"]),
             _facts(node="n2", ifname="lsync0", addr="10.77.0.2", network="10.77.0.0/24", overlay=True)]
    fs = live_checks(facts)
    assert _by(fs, "overlay")[0].severity == "ok" and not _by(fs, "spans-networks")
    (store,) = _by(fs, "store-exposed")
    assert store.severity == "ok" and "10.77.0.1:29400" in store.found
    facts[0]["store_listen"] = ["0.0.0.0:29400"]
    (store,) = _by(live_checks(facts), "store-exposed")
    assert store.severity == "error" and "over the overlay" in store.found


def test_live_one_network_spans_nothing_but_a_wildcard_store_is_still_exposed():
    fs = live_checks([_facts(store_listen=["0.0.0.0:29400"]), _facts(node="n1", addr="10.213.0.2")])
    assert not _by(fs, "spans-networks")
    (store,) = _by(fs, "store-exposed")   # every address of the node: its other networks too
    assert store.severity == "warn" and "0.0.0.0:29400" in store.found
    fs = live_checks([_facts(store_listen=["10.213.0.1:29400"]), _facts(node="n1", addr="10.213.0.2")])
    assert [f.severity for f in _by(fs, "store-exposed")] == ["ok"]


def _fake_host(tmp_path, overlay=True, gloo="lsync0"):
    """A host with eth0 10.0.0.13/24 and, with ``overlay``, a wireguard-go tunnel lsync0 10.77.0.2/24."""
    links = [{"ifname": "lo", "flags": ["LOOPBACK", "UP"], "mtu": 65536, "operstate": "UNKNOWN",
              "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
             {"ifname": "eth0", "flags": ["UP"], "mtu": 1500, "operstate": "UP",
              "addr_info": [{"family": "inet", "local": "10.0.0.13", "prefixlen": 24}]}]
    if overlay:
        links.append({"ifname": "lsync0", "flags": ["UP"], "mtu": 1420, "operstate": "UNKNOWN",
                      "linkinfo": {"info_kind": "tun"},
                      "addr_info": [{"family": "inet", "local": "10.77.0.2", "prefixlen": 24}]})
        (tmp_path / "var/run/wireguard").mkdir(parents=True)
        (tmp_path / "var/run/wireguard/lsync0.sock").write_text("")
    (tmp_path / "ip").mkdir(parents=True)
    (tmp_path / "ip/addr.json").write_text(json.dumps(links))
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hostname").write_text("node-b\n")
    (tmp_path / "etc/hosts").write_text("10.0.0.13 node-b\n")
    return HostInfo(str(tmp_path), env={"GLOO_SOCKET_IFNAME": gloo} if gloo else {})


def test_static_overlay_findings(tmp_path):
    h = _fake_host(tmp_path / "a")
    fs = static_checks(h, nnodes=3, rdzv_endpoint="10.77.0.1:29400")
    assert _by(fs, "overlay")[0].severity == "ok" and "lsync0" in _by(fs, "overlay")[0].found
    (exposed,) = _by(static_checks(h, nnodes=3, rdzv_endpoint="203.0.113.5:29400"), "store-exposed")
    assert exposed.severity == "error" and "HUB_OVERLAY_ADDRESS" in exposed.fix
    (unused,) = _by(static_checks(_fake_host(tmp_path / "b", gloo="eth0"), nnodes=3), "overlay-unused")
    assert unused.severity == "warn" and "GLOO_SOCKET_IFNAME=lsync0" in unused.fix
    (span,) = _by(static_checks(_fake_host(tmp_path / "c", overlay=False, gloo=None), nnodes=2,
                                rdzv_endpoint="198.51.100.7:29400"), "spans-networks")
    assert span.severity == "warn" and "lorasync tunnel" in span.fix
    on_lan = static_checks(_fake_host(tmp_path / "d", overlay=False, gloo=None), nnodes=2,
                           rdzv_endpoint="10.0.0.1:29400")
    assert not _by(on_lan, "spans-networks") and not _by(on_lan, "store-exposed")
