"""Direct WireGuard paths between two overlay nodes that are both behind NAT.

Without this, two nodes behind NAT reach each other only through the hub: it
decrypts and encrypts every packet between them and carries them over its
own link twice (``routes`` says ``via HUB``).  Most home and cloud NATs keep
one outside port per local socket whatever the destination
("endpoint-independent mapping"), so the endpoint the hub sees for a node is
also where another node can reach it, once the node has sent a packet there
itself (its NAT then lets the answers in).  That is hole punching, as
Tailscale and other WireGuard meshes do it.

How a node behind NAT tries it (run by the tunnel's supervisor, once a
second, with :func:`punch_step` deciding and the supervisor acting):

1. It asks the hub for the endpoints the hub sees (:func:`fetch_endpoints`:
   one TCP connection to the hub's link-test server on the overlay, mode
   ``e``; the hub answers from ``wg show`` for peers with a live handshake).
   Only nodes of the overlay reach that server (it listens on the hub's
   overlay address), and it tells nothing but outside addresses and ports.
2. It adds the other node as a WireGuard peer at that endpoint with no
   allowed IPs and a short keepalive.  The keepalive makes WireGuard start
   handshakes towards it, which open this node's NAT for the answers; the
   other node does the same.  No traffic is routed to the new peer yet, so
   nothing stalls while the two try.
3. When a handshake completes, the other node's address moves to the new
   peer (WireGuard takes a /32 from the hub's peer when another peer claims
   it): the pair is direct.  Without one within :data:`TRY_S`, the peer is
   removed and the pair stays relayed by the hub; it is tried again after
   :data:`RETRY_S` (doubled each time).  Symmetric NAT (a new outside port per
   destination) ends here: the port the hub saw is not the one the other
   node would need.
4. A direct pair that hears nothing for :data:`LOST_S` (both sides send
   keepalives every :data:`KEEPALIVE_S`) goes back to the hub: the address
   moves back to the hub's peer, then the direct peer is removed.

Each pair's path, its endpoint and why it is what it is go into the tunnel's
state file; ``tunnel status`` shows them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket
from typing import Mapping, Sequence

__all__ = ["KEEPALIVE_S", "LOST_S", "RETRY_S", "TRY_S", "Action", "Track", "candidates",
           "due", "fetch_endpoints", "parse_endpoints", "punch_step", "tracks"]

#: keepalive of a direct peer: keeps both NATs' mappings open (Linux keeps an
#: unanswered UDP mapping 30 s) and shows a lost path quickly (32 bytes each)
KEEPALIVE_S = 5
#: how long a try waits for a handshake: WireGuard retries its handshake every
#: 5 s, and the other node may start its own try up to a second later
TRY_S = 20.0
#: no packet from a direct peer for this long: its path is gone (a busy path
#: delivers data all the time, an idle one a keepalive every KEEPALIVE_S)
LOST_S = 3 * KEEPALIVE_S + 2
#: seconds before trying a relayed pair again, doubled after each failed try
RETRY_S = (30.0, 600.0)
#: the most a hub's answer may hold (it lists one endpoint per node)
_MAX_ANSWER = 1 << 16


@dataclasses.dataclass
class Track:
    """One pair's path as this node sees it."""

    name: str
    path: str = "relayed"
    """``relayed`` (through the hub), ``trying`` or ``direct``."""
    endpoint: str | None = None
    since: float = 0.0
    next_try: float = 0.0
    tries: int = 0
    reason: str = "not tried yet"
    last_rx: int = 0
    rx_at: float = 0.0

    def public(self) -> dict:
        return {"path": self.path, "endpoint": self.endpoint, "reason": self.reason,
                "since": self.since, "tries": self.tries}


@dataclasses.dataclass
class Action:
    kind: str
    """``try`` (add the peer at ``endpoint``, no allowed IPs), ``direct`` (move
    its address to it), ``give_up`` (remove it) or ``lost`` (address back to
    the hub, then remove it)."""
    peer: str
    endpoint: str | None
    message: str


def candidates(cfg) -> list[dict]:
    """The nodes this node reaches only through the hub over WireGuard while
    both sit on WireGuard: those a direct path could replace (none for the
    hub or for a node on the SSH path)."""
    if cfg.is_hub or cfg.transport != "wireguard":
        return []
    return [n for n in cfg.nodes
            if n["name"] not in (cfg.node, cfg.hub)
            and n.get("transport", "wireguard") == "wireguard"
            and cfg.routes.get(n["name"], "direct") != "direct"]


def tracks(cands: Sequence[dict]) -> dict[str, Track]:
    """A fresh start: every candidate pair relayed, due for a try."""
    return {n["name"]: Track(n["name"]) for n in cands}


def due(tracks: Mapping[str, Track], now: float) -> bool:
    """Whether some pair wants the hub's endpoints now."""
    return any(t.path == "relayed" and now >= t.next_try for t in tracks.values())


def parse_endpoints(raw: bytes) -> dict[str, str]:
    """The hub's answer: ``{"node": "A.B.C.D:PORT", ...}``; ValueError if it is not."""
    data = json.loads(raw.decode())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    out = {}
    for name, ep in data.items():
        if not isinstance(name, str) or not isinstance(ep, str):
            raise ValueError(f"entry {name!r}: not a name and an endpoint")
        host, _, port = ep.rpartition(":")
        ipaddress.IPv4Address(host)
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"entry {name!r}: {ep!r} is not ADDRESS:PORT")
        out[name] = ep
    return out


def fetch_endpoints(address: str, port: int, timeout: float = 3.0) -> dict[str, str]:
    """Ask the hub's link-test server (mode ``e``) for the endpoints it sees.
    Raises OSError or ValueError."""
    with socket.create_connection((address, port), timeout=timeout) as s:
        s.sendall(b"e")
        buf = b""
        while len(buf) <= _MAX_ANSWER:
            got = s.recv(4096)
            if not got:
                break
            buf += got
    if len(buf) > _MAX_ANSWER:
        raise ValueError("the hub's answer is too long")
    return parse_endpoints(buf)


def punch_step(cands: Sequence[dict], tracks: dict[str, Track], peers: Mapping[str, object],
               endpoints: Mapping[str, str] | None, now: float, *, try_s: float = TRY_S, lost_s: float = LOST_S,
               retry: tuple[float, float] = RETRY_S) -> list[Action]:
    """What to do about each candidate pair (pure; the supervisor acts).

    ``peers``: this device's WireGuard peers by public key (objects with
    ``latest_handshake`` and ``rx_bytes``, as :func:`wireguard.show` gives);
    ``endpoints``: the hub's answer when it was asked this round, else None."""
    out = []
    for n in cands:
        name = n["name"]
        t = tracks.setdefault(name, Track(name, next_try=now))
        ps = peers.get(n["public_key"])
        if t.path == "relayed":
            if now < t.next_try or endpoints is None:
                continue
            ep = endpoints.get(name)
            if not ep:
                t.reason = "the hub has no live endpoint for it (not up yet?)"
                t.next_try = now + retry[0]
                continue
            t.path, t.endpoint, t.since = "trying", ep, now
            t.tries += 1
            t.reason = f"trying {ep} (the endpoint the hub sees), try {t.tries}"
            out.append(Action("try", name, ep, f"peer {name}: trying a direct path to {ep} "
                              f"(try {t.tries})"))
        elif t.path == "trying":
            if ps is not None and getattr(ps, "latest_handshake", 0):
                took = now - t.since
                t.path, t.since = "direct", now
                t.last_rx, t.rx_at = getattr(ps, "rx_bytes", 0), now
                t.reason = f"hole punched: a handshake with {t.endpoint} completed"
                out.append(Action("direct", name, t.endpoint, f"peer {name}: direct at "
                                  f"{t.endpoint} after {took:.0f} s; no longer "
                                  "relayed by the hub"))
            elif now - t.since >= try_s:
                delay = min(retry[1], retry[0] * 2 ** (t.tries - 1))
                t.path, t.next_try = "relayed", now + delay
                t.reason = (f"no handshake at {t.endpoint} within {try_s:g} s (its NAT or ours "
                            f"maps each destination to a new port, or it is not trying); "
                            f"relayed by the hub, next try in {delay:g} s")
                out.append(Action("give_up", name, t.endpoint, f"peer {name}: {t.reason}"))
        elif t.path == "direct":
            rx = getattr(ps, "rx_bytes", 0) if ps is not None else 0
            if ps is not None and rx != t.last_rx:
                t.last_rx, t.rx_at = rx, now
            elif now - t.rx_at >= lost_s:
                t.path, t.next_try, t.tries = "relayed", now + retry[0], 0
                t.reason = (f"the direct path to {t.endpoint} went silent for {lost_s:g} s; "
                            f"relayed by the hub again, next try in {retry[0]:g} s")
                out.append(Action("lost", name, t.endpoint, f"peer {name}: {t.reason}"))
    return out
