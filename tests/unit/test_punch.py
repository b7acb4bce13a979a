"""Hole punching's decisions (overlay/punch.py), step by step, without a network;
the real thing runs in tests/netns/test_punch_netns.py."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading

import pytest

from lorasync.overlay import linktest, punch


@dataclasses.dataclass
class Peer:
    latest_handshake: int = 0
    rx_bytes: int = 0


N2 = {"name": "node2", "address": "10.77.0.3", "public_key": "K2"}


def step(tracks, peers, endpoints, now, **kw):
    return punch.punch_step([N2], tracks, peers, endpoints, now, **kw)


def test_a_pair_is_tried_at_the_hubs_endpoint_and_goes_direct_on_a_handshake():
    tracks: dict = {}
    assert step(tracks, {}, None, 100.0) == []          # nothing known yet: no try
    assert punch.due(tracks, 100.0)
    acts = step(tracks, {}, {"node2": "192.0.2.7:40001"}, 100.0)
    assert [(a.kind, a.endpoint) for a in acts] == [("try", "192.0.2.7:40001")]
    assert tracks["node2"].path == "trying" and not punch.due(tracks, 101.0)
    assert step(tracks, {"K2": Peer()}, None, 105.0) == []   # no handshake yet: keep trying
    acts = step(tracks, {"K2": Peer(latest_handshake=104, rx_bytes=92)}, None, 106.0)
    assert [a.kind for a in acts] == ["direct"]
    assert "after 6 s" in acts[0].message
    assert tracks["node2"].public()["path"] == "direct"


def test_no_handshake_within_the_try_gives_up_and_retries_later_with_backoff():
    tracks: dict = {}
    step(tracks, {}, {"node2": "192.0.2.7:40001"}, 0.0)
    assert step(tracks, {"K2": Peer()}, None, 19.0) == []
    acts = step(tracks, {"K2": Peer()}, None, 20.0)
    assert [a.kind for a in acts] == ["give_up"]
    t = tracks["node2"]
    assert t.path == "relayed" and t.next_try == 20.0 + punch.RETRY_S[0]
    assert "relayed by the hub" in t.reason
    assert step(tracks, {}, {"node2": "192.0.2.7:40001"}, 30.0) == []   # not due yet
    acts = step(tracks, {}, {"node2": "192.0.2.7:40002"}, 50.0)
    assert [(a.kind, a.endpoint) for a in acts] == [("try", "192.0.2.7:40002")]
    step(tracks, {"K2": Peer()}, None, 70.0)
    assert tracks["node2"].next_try == 70.0 + 2 * punch.RETRY_S[0]   # doubled


def test_a_node_the_hub_does_not_see_is_asked_about_again_later():
    tracks: dict = {}
    assert step(tracks, {}, {}, 0.0) == []
    assert tracks["node2"].path == "relayed" and not punch.due(tracks, 1.0)
    assert "no live endpoint" in tracks["node2"].reason


def test_a_silent_direct_path_goes_back_to_the_hub():
    tracks: dict = {}
    step(tracks, {}, {"node2": "192.0.2.7:40001"}, 0.0)
    step(tracks, {"K2": Peer(1, 100)}, None, 2.0)
    assert tracks["node2"].path == "direct"
    assert step(tracks, {"K2": Peer(1, 300)}, None, 20.0) == []   # packets still come
    assert step(tracks, {"K2": Peer(1, 300)}, None, 20.0 + punch.LOST_S - 1) == []
    acts = step(tracks, {"K2": Peer(1, 300)}, None, 20.0 + punch.LOST_S)
    assert [a.kind for a in acts] == ["lost"]
    assert tracks["node2"].path == "relayed"


@dataclasses.dataclass
class Cfg:
    node: str
    hub: str = "node0"
    is_hub: bool = False
    transport: str = "wireguard"
    routes: dict = dataclasses.field(default_factory=dict)
    nodes: list = dataclasses.field(default_factory=list)


def test_only_wireguard_pairs_through_the_hub_are_candidates():
    nodes = [{"name": "node0"}, {"name": "node1"}, {"name": "node2"},
             {"name": "node3", "transport": "ssh"}, {"name": "node4"}]
    routes = {"node0": "direct", "node2": "via node0", "node3": "via node0", "node4": "direct"}
    cfg = Cfg("node1", routes=routes, nodes=nodes)
    assert [n["name"] for n in punch.candidates(cfg)] == ["node2"]
    assert punch.candidates(dataclasses.replace(cfg, is_hub=True)) == []
    assert punch.candidates(dataclasses.replace(cfg, transport="ssh")) == []


@pytest.mark.parametrize("raw", [b"[]", b'{"n": 5}', b'{"n": "host:1"}', b'{"n": "10.0.0.1:0"}',
                                 b'{"n": "10.0.0.1"}', b"not json"])
def test_a_malformed_answer_is_refused(raw):
    with pytest.raises(ValueError):
        punch.parse_endpoints(raw)


def test_the_hubs_link_test_server_answers_endpoints_and_others_do_not():
    stop = threading.Event()
    srv = linktest.serve_in_background("127.0.0.1", 0, stop,
                                       endpoints=lambda: {"node1": "192.0.2.1:51820"})
    plain = linktest.serve_in_background("127.0.0.1", 0, stop)
    try:
        assert punch.fetch_endpoints("127.0.0.1", srv.getsockname()[1]) == {"node1": "192.0.2.1:51820"}
        with pytest.raises(json.JSONDecodeError):   # a node's server has nothing to tell
            punch.fetch_endpoints("127.0.0.1", plain.getsockname()[1])
    finally:
        stop.set()
        srv.close()
        plain.close()
    with pytest.raises(OSError):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        punch.fetch_endpoints("127.0.0.1", port, timeout=1)
