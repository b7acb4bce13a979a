"""One node's overlay configuration: ``tunnel.json``, validated.

A node's ``tunnel.json`` (from ``tunnel assemble``, :mod:`lorasync.overlay.enroll`)
holds its address, port, peers with their public keys, endpoints and allowed
IPs, the whole overlay's layout (for ``status``) and the path of its private
key, which ``tunnel join`` made on that node and which never left it.

This module owns reading it (:func:`load_config`: every field checked, a
ConfigError naming it, its value and the fix), :class:`TunnelConfig`, the
check that the key file is the one the config was assembled with
(:func:`check_key_matches`), and the endpoints it names (``HOST[:PORT]``:
:func:`split_endpoint`, :func:`join_endpoint`, :func:`resolve_endpoint`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import socket
from pathlib import Path
from typing import Callable

from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.overlay import wireguard as wg
from lorasync.units import parse_hostport

__all__ = [
    "CONFIG_VERSION",
    "DEFAULT_IFNAME",
    "DEFAULT_KEEPALIVE",
    "DEFAULT_PORT",
    "DEFAULT_STALE_S",
    "DEFAULT_SUBNET",
    "NODE_NAME_RE",
    "TunnelConfig",
    "check_key_matches",
    "is_jump",
    "join_endpoint",
    "load_config",
    "resolve_endpoint",
    "split_endpoint",
]

#: of tunnel.json and of the files init, join and assemble write (1: keys made by init)
CONFIG_VERSION = 2
DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_PORT = 51820
DEFAULT_IFNAME = "lsync0"
DEFAULT_KEEPALIVE = 25
#: WireGuard's REJECT_AFTER_TIME: a session older than this carries no data,
#: so a peer without a newer handshake is stale
DEFAULT_STALE_S = 180
#: a node name: 1-32 letters, digits, '.', '_' or '-'
NODE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
_IFNAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,14}$")


# ---------------------------------------------------------------- endpoints

def split_endpoint(text: str, field: str = "endpoint", default_port: int = DEFAULT_PORT
                   ) -> tuple[str, int]:
    """``"host:51820"``, ``"[2001:db8::1]:51820"``, ``"host"`` -> (host, port)."""
    return parse_hostport(text, field, default_port=default_port, example="203.0.113.5:51820")


def join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------- one node's config

@dataclasses.dataclass
class TunnelConfig:
    """One node's ``tunnel.json``, validated; ``path`` is where it was read."""

    path: Path
    node: str
    hub: str
    is_hub: bool
    ifname: str
    address: str
    subnet: str
    listen_port: int
    private_key_file: Path
    peers: list[dict]
    nodes: list[dict]
    routes: dict
    endpoint: str | None = None
    mtu: int | None = None
    keepalive_s: int = DEFAULT_KEEPALIVE
    stale_s: int = DEFAULT_STALE_S
    relay: bool = False
    ssh_ifnames: list = dataclasses.field(default_factory=list)
    """The hub's tun devices of nodes on the SSH path: relayed packets may use them too."""
    public_key: str = ""
    """This node's, from its ``tunnel join``: ``up`` checks the key file against it
    (a node on the SSH path: the base64 of its SSH key)."""
    plan_id: str = ""
    transport: str = "wireguard"
    """``"ssh"``: this node reaches the hub over SSH's tun forwarding (:mod:`~lorasync.overlay.sshtun`)."""
    ssh: dict | None = None
    """A node on the SSH path: the hub's ``host``, ``port``, ``user``, ``host_key``, its ``tun``
    device number and an optional ``proxy_jump``."""
    ssh_server: dict | None = None
    """The hub serving nodes on the SSH path: sshd's ``listen`` address and ``port``, its
    ``host_key_file``, the ``clients`` (name, address, tun, public_key) and ``dummy`` (no
    WireGuard peer: the overlay address goes on a stand-in interface)."""

    def __post_init__(self):
        if not _IFNAME_RE.fullmatch(self.ifname):   # match() lets a trailing newline through
            raise ConfigError("ifname", self.ifname, "an interface name of 1-15 letters, digits, "
                              "'_', '.', '-' (e.g. lsync0)")
        try:
            self.network = ipaddress.IPv4Network(self.subnet)
            if ipaddress.IPv4Address(self.address) not in self.network:
                raise ConfigError("address", self.address, f"not inside subnet {self.subnet}: "
                                  "re-run `lorasync tunnel init`")
        except ValueError as exc:
            raise ConfigError("address", f"{self.address} in {self.subnet}", str(exc)) from None
        if not 1 <= int(self.listen_port) <= 65535:
            raise ConfigError("listen_port", self.listen_port, "must be between 1 and 65535")
        if self.mtu is not None and not wg.MIN_MTU <= int(self.mtu) <= wg.MAX_MTU:
            raise ConfigError("mtu", self.mtu, f"must be between {wg.MIN_MTU} and {wg.MAX_MTU}")
        for p in self.peers:
            for key in ("name", "address", "public_key", "allowed_ips"):
                if key not in p:
                    raise ConfigError(f"peers.{key}", p.get("name", "?"), "this tunnel.json is "
                                      "incomplete: run `lorasync tunnel assemble` again")
            if not wg.is_public_key(p["public_key"]):
                raise ConfigError("peers.public_key", p["name"], "not a WireGuard public key: "
                                  "run `lorasync tunnel assemble` again")
        mine = next((n for n in self.nodes if n.get("name") == self.node), None)
        if mine is None:
            raise ConfigError("node", self.node, "not a node of this config's plan ("
                              f"{', '.join(str(n.get('name')) for n in self.nodes)}): give the "
                              "NODE.tunnel.json `lorasync tunnel assemble` wrote for this node")
        if self.transport not in ("wireguard", "ssh"):
            raise ConfigError("transport", self.transport, f"wireguard or ssh; {_REINIT}")
        if self.transport == "ssh" and (not isinstance(self.ssh, dict) or self.is_hub):
            raise ConfigError("ssh", self.ssh, f"a node on the SSH path needs its hub's SSH "
                              f"details (and is not the hub); {_REINIT}")
        from lorasync.overlay import sshtun

        key_ok = (sshtun.is_public_key(f"ssh-ed25519 {self.public_key}")
                  if self.transport == "ssh" else wg.is_public_key(self.public_key))
        if not key_ok or mine.get("public_key") != self.public_key:
            raise ConfigError("public_key", self.node, "missing, or not the key the plan's layout "
                              "has for this node: run `lorasync tunnel assemble` again")

    @property
    def prefixlen(self) -> int:
        return self.network.prefixlen

    @property
    def device(self) -> str:
        """The interface that carries this node's overlay address (gloo binds to it)."""
        return f"tun{int(self.ssh['tun'])}" if self.transport == "ssh" else self.ifname

    @property
    def wireguard(self) -> bool:
        """Whether this node runs WireGuard (a hub whose nodes are all on SSH does not)."""
        return self.transport == "wireguard" and not (self.ssh_server or {}).get("dummy")

    @property
    def hub_peer(self) -> dict | None:
        return next((p for p in self.peers if p["name"] == self.hub), None)

    def hub_address(self) -> str:
        return next(n["address"] for n in self.nodes if n["name"] == self.hub)

    def peer_configs(self, resolve: bool = True) -> list[wg.PeerConfig]:
        out = []
        for p in self.peers:
            ep = p.get("endpoint")
            if ep and resolve:
                ep = resolve_endpoint(ep, p["name"])
            out.append(wg.PeerConfig(p["public_key"], list(p["allowed_ips"]), ep,
                                     p.get("keepalive_s")))
        return out


def load_config(path: str | Path) -> TunnelConfig:
    """Read and validate a node's ``tunnel.json``: every field, a ConfigError
    naming it (``peers[1].allowed_ips``), its value and the fix."""
    p = Path(path)
    if p.is_dir():
        p = p / "tunnel.json"
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("--config", str(path), "no such file: give the NODE.tunnel.json that "
                          "`lorasync tunnel assemble` wrote for this node") from None
    except RecursionError:
        raise ConfigError("--config", str(path), "not a tunnel.json (JSON nested too deeply): "
                          "give the NODE.tunnel.json `lorasync tunnel assemble` wrote") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("--config", str(path), f"not a readable tunnel.json ({exc})") from None
    if isinstance(raw, dict) and raw.get("version") == 1:
        raise ConfigError("--config", str(path), "made by an older `tunnel init` that generated "
                          "every node's private key on one machine: plan again (`lorasync tunnel "
                          "init`, `tunnel join` on each node, `tunnel assemble`; docs/overlay.md)")
    if not isinstance(raw, dict) or raw.get("version") != CONFIG_VERSION:
        raise ConfigError("--config", str(path), "not a tunnel.json of this lorasync version: "
                          "give the NODE.tunnel.json `lorasync tunnel assemble` wrote")
    for key in ("node", "hub", "is_hub", "ifname", "address", "subnet", "listen_port",
                "private_key_file", "peers", "nodes", "public_key", "plan_id"):
        if key not in raw:
            raise ConfigError(f"tunnel.json {key}", str(path), "missing: run `lorasync "
                              "tunnel assemble` again")
    _check_fields(raw)
    key = Path(raw["private_key_file"])
    if not key.is_absolute():
        key = p.parent / key
    return TunnelConfig(
        path=p.resolve(), node=raw["node"], hub=raw["hub"], is_hub=raw["is_hub"],
        ifname=raw["ifname"], address=raw["address"], subnet=raw["subnet"],
        listen_port=raw["listen_port"], private_key_file=key, peers=list(raw["peers"]),
        nodes=list(raw["nodes"]), routes=dict(raw.get("routes") or {}),
        endpoint=raw.get("endpoint"), mtu=raw.get("mtu"),
        keepalive_s=raw.get("keepalive_s") or DEFAULT_KEEPALIVE,
        stale_s=raw.get("stale_s") or DEFAULT_STALE_S, relay=bool(raw.get("relay")),
        ssh_ifnames=list(raw.get("ssh_ifnames") or []),
        public_key=raw["public_key"], plan_id=raw["plan_id"],
        transport=raw.get("transport") or "wireguard", ssh=raw.get("ssh"),
        ssh_server=raw.get("ssh_server"))


def check_key_matches(cfg: TunnelConfig, public_key_of: Callable[[Path], str] = wg.public_key_of
                      ) -> None:
    """ConfigError unless the key file's public key is the one ``cfg`` was
    assembled with (this node's key changed after ``join``, or the config is
    another node's or another plan's)."""
    if public_key_of(cfg.private_key_file) != cfg.public_key:
        raise ConfigError("private_key_file", str(cfg.private_key_file),
                          f"its public key is not the one {cfg.node}'s config (plan {cfg.plan_id}) "
                          f"was assembled with: give this node's own NODE.tunnel.json, or run "
                          f"`lorasync tunnel join` here again, carry back NODE.pub.json and "
                          f"assemble again")


_REINIT = "run `lorasync tunnel assemble` again rather than editing the file"


def _int_in(lo: int, hi: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_name(v) -> bool:
    return isinstance(v, str) and bool(NODE_NAME_RE.fullmatch(v))


def _is_key(v) -> bool:
    return isinstance(v, str) and v != "" and not any(c.isspace() or c == "\0" for c in v)


def _is_ipv4(v) -> bool:
    if not isinstance(v, str):   # IPv4Address() also takes an int
        return False
    try:
        ipaddress.IPv4Address(v)
    except ValueError:
        return False
    return True


def _is_endpoint(v) -> bool:
    """None (behind NAT) or HOST[:PORT]."""
    if v is None:
        return True
    try:
        return isinstance(v, str) and "\0" not in v and bool(split_endpoint(v))
    except ConfigError:
        return False


def _is_ssh_client(v) -> bool:
    from lorasync.overlay import sshtun

    return (isinstance(v, dict) and isinstance(v.get("host"), str) and v["host"] != ""
            and not any(c.isspace() or c == "\0" for c in v["host"])
            and _int_in(1, 65535)(v.get("port")) and v.get("user") == sshtun.USER
            and sshtun.is_public_key(v.get("host_key")) and _int_in(0, 4095)(v.get("tun"))
            and (v.get("proxy_jump") is None or (isinstance(v["proxy_jump"], str)
                                                 and is_jump(v["proxy_jump"]))))


def is_jump(v: str) -> bool:
    """ssh's -J [USER@]HOST[:PORT][,...]: no option, no space, no quote."""
    return bool(re.fullmatch(r"[A-Za-z0-9_.@:\[\],-]+", v)) and not any(
        h == "" or h.startswith("-") for h in v.split(","))


def _is_ip(v) -> bool:
    try:
        return isinstance(v, str) and not ipaddress.ip_address(v).is_unspecified
    except ValueError:
        return False


def _is_ssh_server(v) -> bool:
    from lorasync.overlay import sshtun

    return (isinstance(v, dict) and _is_ip(v.get("listen")) and _int_in(1, 65535)(v.get("port"))
            and isinstance(v.get("host_key_file"), str) and os.path.isabs(v["host_key_file"])
            and isinstance(v.get("clients"), list) and all(
                isinstance(c, dict) and _is_name(c.get("name")) and _is_ipv4(c.get("address"))
                and _int_in(0, 4095)(c.get("tun")) and sshtun.is_public_key(c.get("public_key"))
                for c in v["clients"]))


def _need(field: str, value, ok: bool, fix: str) -> None:
    if not ok:
        raise ConfigError(field, value, f"{fix}; {_REINIT}")


def _check_fields(raw: dict) -> None:
    """Types and ranges of every field of a tunnel.json (TunnelConfig checks the
    relations between address, subnet and interface name)."""
    top = {
        "node": (_is_name, "a node name of 1-32 letters, digits, '.', '_' or '-'"),
        "hub": (_is_name, "the hub's node name"),
        "is_hub": (lambda v: isinstance(v, bool), "true or false"),
        "ifname": (lambda v: isinstance(v, str), "an interface name such as lsync0"),
        "address": (_is_ipv4, "this node's overlay IPv4 address, e.g. 10.77.0.2"),
        "listen_port": (_int_in(1, 65535), "a UDP port number between 1 and 65535"),
        "private_key_file": (lambda v: isinstance(v, str) and v.strip() != "" and "\0" not in v,
                             "the key file's path, e.g. private.key"),
        "peers": (lambda v: isinstance(v, list), "a list of peer objects"),
        "nodes": (lambda v: isinstance(v, list) and len(v) >= 2, "a list of the overlay's nodes"),
        "routes": (lambda v: v is None or isinstance(v, dict), "an object NODE: direct|via HUB"),
        "endpoint": (_is_endpoint, "null (behind NAT) or HOST:PORT"),
        "mtu": (lambda v: v is None or _int_in(wg.MIN_MTU, wg.MAX_MTU)(v),
                f"null (auto) or a number of bytes between {wg.MIN_MTU} and {wg.MAX_MTU}"),
        "keepalive_s": (lambda v: v is None or _int_in(1, 3600)(v),
                        "seconds between 1 and 3600 (25 is usual)"),
        "stale_s": (lambda v: v is None or _int_in(1, 86400)(v), "seconds between 1 and 86400"),
        "relay": (lambda v: v is None or isinstance(v, bool), "true or false"),
        "ssh_ifnames": (lambda v: v is None or (isinstance(v, list) and all(
            isinstance(x, str) and _IFNAME_RE.fullmatch(x) for x in v)), "a list of interface names"),
        "public_key": (_is_key, "this node's public key, as `tunnel join` printed it"),
        "transport": (lambda v: v is None or v in ("wireguard", "ssh"), "wireguard or ssh"),
        "ssh": (lambda v: v is None or _is_ssh_client(v),
                "an object {host, port, user, host_key, tun} (the hub's SSH server)"),
        "ssh_server": (lambda v: v is None or _is_ssh_server(v),
                       "an object {listen, port, host_key_file, clients}"),
        "plan_id": (lambda v: isinstance(v, str) and v != "" and "\0" not in v,
                    "the plan's id, as `tunnel init` wrote it"),
    }
    for key, (ok, fix) in top.items():
        if key in raw:
            _need(key, raw[key], ok(raw[key]), f"give {fix}")
    try:
        net = ipaddress.IPv4Network(raw["subnet"])
    except (ValueError, TypeError):
        _need("subnet", raw["subnet"], False, "give the overlay's IPv4 network, e.g. "
              "10.77.0.0/24")
    names = []
    for i, n in enumerate(raw["nodes"]):
        where = f"nodes[{i}]"
        _need(where, n, isinstance(n, dict), "give an object {name, address, endpoint, "
              "public_key}")
        _need(f"{where}.name", n.get("name"), _is_name(n.get("name")), "give a node name")
        _need(f"{where}.address", n.get("address"),
              _is_ipv4(n.get("address")) and ipaddress.IPv4Address(n["address"]) in net,
              f"give the node's overlay address, inside {net}")
        _need(f"{where}.endpoint", n.get("endpoint"), _is_endpoint(n.get("endpoint")),
              "give null (behind NAT) or HOST:PORT")
        names.append(n["name"])
    for key in ("node", "hub"):
        _need(key, raw[key], raw[key] in names, f"name one of the nodes ({', '.join(names)})")
    _need("is_hub", raw["is_hub"], raw["is_hub"] == (raw["node"] == raw["hub"]),
          f"give {str(raw['node'] == raw['hub']).lower()}: this node is "
          + ("" if raw["node"] == raw["hub"] else "not ") + "the hub")
    for name, route in (raw.get("routes") or {}).items():
        _need(f"routes[{name!r}]", route,
              name in names and route in ("direct", f"via {raw['hub']}", "ssh"),
              f"give direct, via {raw['hub']} or ssh for a node of the overlay")
    # the underlay: the real addresses packets to the peers travel on
    underlay = {split_endpoint(ep)[0] for ep in [raw.get("endpoint")]
                + [n.get("endpoint") for n in raw["nodes"]]
                + [p.get("endpoint") for p in raw["peers"] if isinstance(p, dict)]
                if ep and _is_endpoint(ep)}
    for i, peer in enumerate(raw["peers"]):
        _check_peer(f"peers[{i}]", peer, net, names, underlay)


def _check_peer(where: str, p, net: ipaddress.IPv4Network, names: list[str],
                underlay: set[str]) -> None:
    _need(where, p, isinstance(p, dict), "give an object {name, address, public_key, "
          "endpoint, allowed_ips}")
    for key in ("name", "address", "public_key", "allowed_ips"):
        _need(f"{where}.{key}", None, key in p, "missing")
    _need(f"{where}.name", p["name"], p["name"] in names, "name a node of the overlay")
    _need(f"{where}.address", p["address"],
          _is_ipv4(p["address"]) and ipaddress.IPv4Address(p["address"]) in net,
          f"give the peer's overlay address, inside {net}")
    _need(f"{where}.public_key", p["public_key"], _is_key(p["public_key"]),
          "give the peer's WireGuard public key")
    _need(f"{where}.endpoint", p.get("endpoint"), _is_endpoint(p.get("endpoint")),
          "give null (behind NAT) or HOST:PORT")
    _need(f"{where}.keepalive_s", p.get("keepalive_s"),
          p.get("keepalive_s") is None or _int_in(1, 3600)(p["keepalive_s"]),
          "give null or seconds between 1 and 3600")
    _need(f"{where}.relays", p.get("relays"), p.get("relays") is None or (
        isinstance(p["relays"], list) and all(r in names for r in p["relays"] if _is_name(r))
        and all(_is_name(r) for r in p["relays"])), "give a list of node names")
    ips = p["allowed_ips"]
    _need(f"{where}.allowed_ips", ips, isinstance(ips, list) and ips != [],
          f"give a list of overlay addresses, e.g. [\"{p['address']}/32\"]")
    for ip in ips:
        field = f"{where}.allowed_ips"
        try:
            cidr = ipaddress.ip_network(ip if isinstance(ip, str) else "-", strict=False)
        except ValueError:
            _need(field, ip, False, "give addresses as A.B.C.D/N, e.g. 10.77.0.1/32")
        if cidr.prefixlen == 0 or cidr.num_addresses >= 1 << (cidr.max_prefixlen - 1):
            raise ConfigError(field, ip, "would route all traffic of this host into the "
                              f"tunnel; list only overlay addresses inside {net}")
        hit = next((h for h in underlay if _contains(cidr, h)), None)
        if hit:
            raise ConfigError(field, ip, f"overlaps the underlay (endpoint {hit}): the tunnel "
                              f"would route its own packets into itself; list only overlay "
                              f"addresses inside {net}")
        _need(field, ip, cidr.version == 4 and cidr.subnet_of(net),
              f"lorasync's overlay routes only its own addresses: list addresses inside {net}")


def _contains(cidr, host: str) -> bool:
    try:
        return ipaddress.ip_address(host) in cidr
    except ValueError:   # a name: resolved at `up`
        return False


def resolve_endpoint(endpoint: str, who: str = "peer") -> str:
    """HOST:PORT -> IP:PORT now (DNS may have moved the host since the last time)."""
    host, port = split_endpoint(endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise EnvironmentProblem(f"{who}'s endpoint {host} does not resolve ({exc.strerror}): "
                                 f"check the name, or give its IP address at `tunnel init`") from None
    ip = infos[0][4][0]
    return join_endpoint(ip, port)
