"""The overlay network: nodes in different networks (behind NAT, other sites)
get addresses every node can reach, so gloo/NCCL's full mesh works across them.

This module owns one node's configuration (``tunnel.json``: :func:`load_config`),
the supervisor that keeps its tunnel up, and the ``up`` / ``status`` /
``down`` operations (:mod:`lorasync.overlay.enroll` owns the plan and how
keys are made and exchanged: ``tunnel init`` / ``join`` / ``assemble``;
:mod:`lorasync.overlay.wireguard` owns the calls to the WireGuard tools;
``lorasync tunnel`` is the command line).

A node's ``tunnel.json`` (from ``tunnel assemble``) holds its address, port,
peers with their public keys, endpoints and allowed IPs, the whole overlay's
layout (for ``status``) and the path of its private key, which
``tunnel join`` made on that node and which never left it.  Before anything
starts, ``up`` checks that the key file is there, readable by its owner only,
and that its public key is the one the config was assembled with.

Supervision (:class:`Supervisor`, run in the background by ``up``): starts
``wireguard-go``, configures it, serves the link test on the overlay address
(for ``status``'s RTT and rate), restarts the daemon when it dies and, for a
peer with an endpoint whose handshake goes stale, re-resolves the endpoint and
forces a new handshake, with exponential backoff; on a node behind NAT,
tries a direct path to each node it reaches only through the hub
(:mod:`lorasync.overlay.punch`; the hub's link-test server tells the
endpoints it sees); every event goes to the log
``/run/lorasync/tunnels/IFNAME.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from lorasync.errors import ConfigError, EnvironmentProblem, LorasyncError
from lorasync.hostops import TUNNELS_DIR, as_root, pid_alive, require_root, stop_process
from lorasync.overlay import linktest, punch
from lorasync.overlay import wireguard as wg
from lorasync.units import parse_hostport

__all__ = [
    "CONFIG_VERSION",
    "DEFAULT_PORT",
    "DEFAULT_SUBNET",
    "Supervisor",
    "TunnelConfig",
    "check_key_matches",
    "check_root",
    "down",
    "down_one",
    "join_endpoint",
    "leftovers",
    "load_config",
    "split_endpoint",
    "states",
    "status",
    "supervise_step",
    "up",
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
#: seconds before restarting a dead wireguard-go, doubled after each failed try
RESTART_BACKOFF = (0.5, 30.0)
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
                                                 and _is_jump(v["proxy_jump"]))))


def _is_jump(v: str) -> bool:
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


# ---------------------------------------------------------------- checks before up

def _local_addresses() -> list[tuple[str, str]]:
    """(ifname, address/prefix) of every IPv4 address here."""
    proc = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True)
    out = []
    with contextlib.suppress(ValueError):
        for link in json.loads(proc.stdout or "[]"):
            for a in link.get("addr_info", []):
                out.append((link.get("ifname", "?"), f"{a['local']}/{a.get('prefixlen', 32)}"))
    return out


def check_address_clash(cfg: TunnelConfig, addresses: Iterable[tuple[str, str]] | None = None) -> None:
    """ConfigError when this host already has an address in the overlay subnet
    (or one whose network contains the overlay address)."""
    me = ipaddress.IPv4Interface(cfg.address).ip
    for ifname, cidr in (_local_addresses() if addresses is None else addresses):
        if ifname == cfg.ifname:
            continue
        iface = ipaddress.IPv4Interface(cidr)
        if iface.network.overlaps(cfg.network) or iface.ip == me:
            raise ConfigError("address", f"{cfg.address}/{cfg.prefixlen}",
                              f"clashes with {ifname} ({cidr}) on this host: the overlay needs a "
                              f"subnet of its own; re-run `lorasync tunnel init --subnet "
                              f"10.NN.0.0/24` with one this host does not use")


def check_port_free(port: int) -> None:
    """ConfigError when the UDP listen port is taken."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        s = socket.socket(family, socket.SOCK_DGRAM)
        try:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == 98:  # EADDRINUSE
                raise ConfigError("listen_port", port,
                                  f"UDP port {port} is already in use on this host "
                                  f"(`ss -ulpn 'sport = :{port}'` shows by what): stop it, or "
                                  f"give this node another port at `tunnel init` "
                                  f"(--node NAME=HOST:PORT)") from None
            if family == socket.AF_INET:
                raise
        finally:
            s.close()


def choose_mtu(cfg: TunnelConfig) -> int:
    """The configured MTU, else the smallest path MTU to any peer's endpoint
    (the interface MTU where no peer has one) less WireGuard's overhead.  The
    path MTU is probed (:mod:`lorasync.netdiag.pmtu`: DF pings, one round trip
    when full-size packets pass), so a black hole on the way lowers it too."""
    if cfg.mtu:
        return int(cfg.mtu)
    seen = []
    for p in cfg.peers:
        if not p.get("endpoint"):
            continue
        host, port = split_endpoint(p["endpoint"])
        m = wg.path_mtu(host, port)
        if m and not wg.is_ipv6(host):
            # the kernel's figure misses a black hole (nothing reported it): probe it
            from lorasync.netdiag.pmtu import find_path_mtu

            found = find_path_mtu(host, high=m, tries=2)
            if found.reachable and found.path_mtu < m:
                m = found.path_mtu
        if m:
            seen.append((m, wg.is_ipv6(host)))
    if not seen:  # the hub, when no peer has an endpoint: what carries its own endpoint
        mtus = []
        for ifname, cidr in _local_addresses():
            if ifname in ("lo", cfg.ifname):
                continue
            with contextlib.suppress(OSError, ValueError):
                mtus.append(int(Path(f"/sys/class/net/{ifname}/mtu").read_text()))
        seen = [(min(mtus), False)] if mtus else []
    return wg.overlay_mtu(seen)


# ---------------------------------------------------------------- supervision

@dataclasses.dataclass
class PeerTrack:
    """Supervision state of one peer."""

    name: str
    attempts: int = 0
    next_try: float = 0.0
    stale_logged: bool = False


@dataclasses.dataclass
class Action:
    kind: str  # "rehandshake" | "recovered" | "silent" | "back"
    peer: str
    message: str
    next_in: float | None = None


def supervise_step(peers: Sequence[dict], state: wg.DeviceState, now: float, since: float,
                   tracks: dict[str, PeerTrack], *, stale_s: float, grace_s: float = 10.0,
                   backoff: tuple[float, float] = (1.0, 60.0)) -> list[Action]:
    """What to do about each peer (pure; the supervisor acts on the result).

    A peer is stale when its last handshake is older than ``stale_s``, or it
    never had one ``grace_s`` after the device (re)started at ``since``.  A
    stale peer with an endpoint is re-resolved and re-handshaken, then again
    after 1, 2, 4 ... s (at most ``backoff[1]``) while it stays stale; one
    without an endpoint (behind NAT) can only be waited for, which is logged once.
    """
    out = []
    for p in peers:
        t = tracks.setdefault(p["name"], PeerTrack(p["name"]))
        ps = state.peer(p["public_key"])
        age = ps.handshake_age(now) if ps else None
        stale = (age is None and now - since > grace_s) or (age is not None and age > stale_s)
        what = "never completed" if age is None else f"{age:.0f} s old"
        if not stale:
            if t.attempts:
                out.append(Action("recovered", p["name"], f"peer {p['name']}: handshake {age:.0f} s "
                                  f"ago, up again after {t.attempts} attempt(s)"))
            elif t.stale_logged:
                out.append(Action("back", p["name"], f"peer {p['name']}: handshake again "
                                  f"({age:.0f} s ago)"))
            t.attempts, t.next_try, t.stale_logged = 0, 0.0, False
            continue
        if not p.get("endpoint"):
            if not t.stale_logged:
                t.stale_logged = True
                out.append(Action("silent", p["name"], f"peer {p['name']} (behind NAT, no endpoint): "
                                  f"handshake {what}; waiting for it to connect"))
            continue
        if now < t.next_try:
            continue
        t.attempts += 1
        delay = min(backoff[1], backoff[0] * 2 ** (t.attempts - 1))
        t.next_try = now + delay
        out.append(Action("rehandshake", p["name"], f"peer {p['name']}: handshake {what}; "
                          f"re-resolving {p['endpoint']} and re-handshaking (attempt {t.attempts}, "
                          f"next in {delay:g} s)", delay))
    return out


class Supervisor:
    """Keeps one node's tunnel up (run by ``up`` in the background, or in the
    foreground with ``--foreground``).  See the module docstring."""

    def __init__(self, cfg: TunnelConfig, log=None, interval: float = 1.0,
                 cluster: str | None = None):
        self.cfg = cfg
        self.interval = interval
        self.cluster = cluster
        self.log_path = TUNNELS_DIR / f"{cfg.ifname}.log"
        self.daemon_log_path = TUNNELS_DIR / f"{cfg.ifname}.wireguard-go.log"
        self._log = log
        self.proc: subprocess.Popen | None = None
        self.mtu: int | None = None
        self.since = 0.0
        self.restarts = 0
        self.tracks: dict[str, PeerTrack] = {}
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self._last_error: str | None = None
        self.cands = punch.candidates(cfg)
        self.paths = punch.tracks(self.cands)
        self._punch_error: str | None = None

    # -- events

    def event(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {self.cfg.ifname} {msg}"
        with open(self.log_path, "a") as f:
            f.write(line + "\n")
        if self._log is not None:
            print(line, file=self._log, flush=True)

    # -- lifecycle

    def start(self) -> None:
        """Start and configure the device, serve the link test; raises on failure
        after cleaning up what it made."""
        TUNNELS_DIR.mkdir(parents=True, exist_ok=True)
        self.mtu = choose_mtu(self.cfg)
        try:
            self._start_device()
            self._serve_linktest()
        except BaseException:
            self.stop()
            raise
        self._save_state()
        peers = ", ".join(f"{p['name']} ({p.get('endpoint') or 'behind NAT'})" for p in self.cfg.peers)
        self.event(f"up: {self.cfg.node} {self.cfg.address}/{self.cfg.prefixlen}, mtu {self.mtu}, "
                   f"UDP {self.cfg.listen_port}; peers {peers or 'none'}"
                   + (" ; relaying between peers" if self.cfg.relay else ""))

    def _start_device(self) -> None:
        cfg = self.cfg
        log = open(self.daemon_log_path, "ab")
        try:
            # an emulated cluster's daemons share this host's cores: one Go thread
            # each, unless the caller's environment sets GOMAXPROCS itself
            one = self.cluster and "GOMAXPROCS" not in os.environ
            self.proc = wg.start_daemon(cfg.ifname, log, go_threads=1 if one else None)
        finally:
            log.close()
        routes = [ip for p in cfg.peers for ip in p["allowed_ips"]
                  if not ipaddress.IPv4Network(ip, strict=False).subnet_of(cfg.network)]
        wg.configure(cfg.ifname, key_file=cfg.private_key_file, listen_port=cfg.listen_port,
                     peers=cfg.peer_configs(), address=cfg.address, prefixlen=cfg.prefixlen,
                     mtu=self.mtu, routes=routes, relay=cfg.relay, relay_also=cfg.ssh_ifnames)
        self.since = time.time()

    def _serve_linktest(self) -> None:
        self._server = linktest.serve_in_background(
            self.cfg.address, self.cfg.listen_port, self._stop, freebind=True,
            endpoints=self._endpoints if self.cfg.is_hub else None)

    def _endpoints(self) -> dict[str, str]:
        """The hub's answer to a node's ``e``: each node's outside IPv4
        endpoint with a live handshake, as WireGuard sees it."""
        try:
            dev = wg.show(self.cfg.ifname)
        except (LorasyncError, ValueError):
            return {}
        names = {n["public_key"]: n["name"] for n in self.cfg.nodes}
        now = time.time()
        return {names[p.public_key]: p.endpoint for p in dev.peers
                if p.public_key in names and p.endpoint and not p.endpoint.startswith("[")
                and p.handshake_age(now) is not None and p.handshake_age(now) < self.cfg.stale_s}

    def _save_state(self) -> None:
        netns = linktest.current_netns()
        state = {"ifname": self.cfg.ifname, "node": self.cfg.node, "config": str(self.cfg.path),
                 "pid": os.getpid(), "wg_pid": self.proc.pid if self.proc else None,
                 "netns": netns, "cluster": self.cluster, "started": self.since,
                 "address": self.cfg.address, "prefixlen": self.cfg.prefixlen, "mtu": self.mtu,
                 "listen_port": self.cfg.listen_port, "hub": self.cfg.hub, "is_hub": self.cfg.is_hub,
                 "restarts": self.restarts, "log": str(self.log_path),
                 "paths": {name: t.public() for name, t in self.paths.items()}}
        tmp = TUNNELS_DIR / f".{self.cfg.ifname}.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(TUNNELS_DIR / f"{self.cfg.ifname}.json")

    def run(self) -> None:
        """Supervise until :meth:`request_stop` (SIGTERM, in ``supervise_main``)."""
        backoff, restart_at = RESTART_BACKOFF[0], None
        while not self._stop.wait(self.interval):
            if self.proc is None or self.proc.poll() is not None:
                now = time.monotonic()
                if restart_at is None:
                    code = self.proc.returncode if self.proc is not None else None
                    self.event(f"wireguard-go exited (code {code}); restarting in {backoff:g} s")
                    restart_at = now + backoff
                if now >= restart_at:
                    restart_at, backoff = self._restart(now, backoff)
                continue
            try:
                state = wg.show(self.cfg.ifname)
            except (LorasyncError, ValueError) as exc:
                if str(exc) != self._last_error:  # once, not every second
                    self.event(f"wg show failed: {exc}")
                self._last_error = str(exc)
                continue
            self._last_error = None
            for a in supervise_step(self.cfg.peers, state, time.time(), self.since, self.tracks,
                                    stale_s=self.cfg.stale_s):
                self.event(a.message)
                if a.kind == "rehandshake":
                    self._rehandshake(a.peer)
            self._punch(state)

    def _punch(self, state: wg.DeviceState) -> None:
        """Direct paths to the nodes reached through the hub (:mod:`punch`)."""
        if not self.cands:
            return
        now = time.time()
        endpoints = None
        if punch.due(self.paths, now):
            hub = self.cfg.hub_peer
            hs = state.peer(hub["public_key"]) if hub else None
            if hs is None or not hs.latest_handshake:
                return  # nothing to ask before the hub answers
            try:
                endpoints = punch.fetch_endpoints(self.cfg.hub_address(), self.cfg.listen_port)
                self._punch_error = None
            except (OSError, ValueError) as exc:
                msg = f"asking the hub {self.cfg.hub} for endpoints failed: {exc}; relayed for now"
                if msg != self._punch_error:
                    self.event(msg)
                self._punch_error = msg
                for t in self.paths.values():
                    if t.path == "relayed":
                        t.next_try = now + punch.RETRY_S[0]
                return
        keys = {n["name"]: n["public_key"] for n in self.cands}
        acts = punch.punch_step(self.cands, self.paths, {p.public_key: p for p in state.peers},
                                endpoints, now)
        for a in acts:
            try:
                if a.kind == "try":
                    wg.add_probe_peer(self.cfg.ifname, keys[a.peer], a.endpoint, punch.KEEPALIVE_S)
                elif a.kind == "direct":
                    addr = next(n["address"] for n in self.cands if n["name"] == a.peer)
                    wg.set_allowed_ips(self.cfg.ifname, keys[a.peer], [f"{addr}/32"])
                else:  # give_up (nothing was moved), lost: the hub's peer takes the address back
                    if a.kind == "lost":
                        hub = self.cfg.hub_peer
                        wg.set_allowed_ips(self.cfg.ifname, hub["public_key"], hub["allowed_ips"])
                    wg.remove_peer(self.cfg.ifname, keys[a.peer])
            except LorasyncError as exc:
                self.event(f"peer {a.peer}: {a.kind} failed: {exc}")
                continue
            self.event(a.message)
        if acts or endpoints is not None:
            self._save_state()

    def _restart(self, now: float, backoff: float) -> tuple[float | None, float]:
        """Start the daemon again; (next restart time or None, next backoff)."""
        try:
            wg.stop_daemon(None, self.cfg.ifname)  # what the dead one left
            self._start_device()
        except LorasyncError as exc:
            self.proc = None
            backoff = min(RESTART_BACKOFF[1], backoff * 2)
            self.event(f"restart failed: {exc}; next try in {backoff:g} s")
            return now + backoff, backoff
        self.restarts += 1
        self.tracks.clear()
        self.paths = punch.tracks(self.cands)  # the device came back with the config's peers only
        self._save_state()
        self.event(f"wireguard-go restarted (pid {self.proc.pid}, restart {self.restarts}); "
                   f"interface configured again")
        return None, RESTART_BACKOFF[0]

    def _rehandshake(self, name: str) -> None:
        p = next(p for p in self.cfg.peers if p["name"] == name)
        try:
            ep = resolve_endpoint(p["endpoint"], name)
            wg.set_peer(self.cfg.ifname, wg.PeerConfig(p["public_key"], list(p["allowed_ips"]), ep,
                                                       p.get("keepalive_s")))
        except LorasyncError as exc:
            self.event(f"peer {name}: {exc}")
            return
        # a packet for the peer makes WireGuard start a handshake when it has no session
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"", (p["address"], 9))

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Take everything down: device, daemon, relay table, server, state file."""
        self._stop.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.close()
            self._server = None
        wg.stop_daemon(self.proc, self.cfg.ifname)
        if self.cfg.relay:
            wg.remove_relay(self.cfg.ifname)
        with contextlib.suppress(FileNotFoundError):
            (TUNNELS_DIR / f"{self.cfg.ifname}.json").unlink()


def supervise_main(argv: list[str] | None = None) -> int:
    """``python -m lorasync.overlay.tunnel supervise CONFIG``: the background half of ``up``.

    Prints ``ready`` once the tunnel is configured (or ``error: MESSAGE``) and
    keeps it up until SIGTERM, then removes everything it made.
    """
    p = argparse.ArgumentParser(prog="python -m lorasync.overlay.tunnel")
    p.add_argument("command", choices=["supervise"])
    p.add_argument("config")
    p.add_argument("--cluster", default=None, help="emulated cluster this tunnel belongs to")
    p.add_argument("--foreground", action="store_true", help="events to stderr too")
    p.add_argument("--ssh-server", action="store_true",
                   help="a hub that also serves the SSH path: once WireGuard is up, start the hub's "
                        "sshd under its own supervisor, and stop it with this one")
    p.add_argument("--ready-timeout", type=float, default=20.0)
    args = p.parse_args(argv)
    stop = {"sig": None}
    sup: list[Supervisor] = []

    def _term(signum, frame):
        stop["sig"] = signum
        for s in sup:
            s.request_stop()

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    companion, started = None, False
    try:
        cfg = load_config(args.config)
        s = Supervisor(cfg, log=sys.stderr if args.foreground else None, cluster=args.cluster)
        sup.append(s)
        s.start()   # cleans up after itself if it fails
        started = True
        if args.ssh_server and cfg.ssh_server and stop["sig"] is None:
            companion = _start_ssh_server(cfg, args)
    except LorasyncError as exc:
        if started:   # the hub's sshd did not come up: WireGuard goes too
            s.stop()
        print(f"error: {exc}", flush=True)
        return 2
    except Exception as exc:  # a bug: say so on the pipe, keep the traceback in the log
        print(f"error: {type(exc).__name__}: {exc} (a bug; traceback in the tunnel's log)", flush=True)
        raise
    print("ready", flush=True)
    if companion is not None:
        s.event(f"SSH path: sshd on {companion.get('server')} (supervisor pid {companion.get('pid')}, "
                f"log {companion.get('log')})")
    if not args.foreground:  # the parent stops reading after "ready"
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    try:
        if stop["sig"] is None:
            s.run()
    finally:
        s.event(f"down (signal {stop['sig']})" if stop["sig"] else "down")
        if companion is not None:
            _stop_ssh_server(cfg)
        s.stop()
    return 0


def _start_ssh_server(cfg: TunnelConfig, args) -> dict:
    """The hub's sshd for its nodes on the SSH path, under its own supervisor
    (:mod:`lorasync.overlay.sshtun`): its state; on failure nothing of it stays."""
    from lorasync.overlay import sshtun

    try:
        return sshtun.start_background(sshtun.runtime_config(cfg), cluster=args.cluster,
                                       ready_timeout=args.ready_timeout)
    except BaseException:
        _stop_ssh_server(cfg)
        raise


def _stop_ssh_server(cfg: TunnelConfig) -> None:
    for st in states():
        if st.get("tunnel") == cfg.ifname and st.get("ifname") != cfg.ifname:
            down_one(st)


# ---------------------------------------------------------------- up / down / status

def check_root() -> None:
    """A tunnel needs root: raise the error that says so, unless we are root."""
    require_root("a tunnel needs root (TUN device, addresses, routes)",
                 f"run as root, e.g. {as_root('tunnel up ...')}")


def states() -> list[dict]:
    """The state file of every tunnel this host runs (also a crashed one's);
    one that is not a state file (cut short, edited) is skipped."""
    out = []
    for f in sorted(TUNNELS_DIR.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, RecursionError):
            st = json.loads(f.read_text())
            # an interface name is all `down` needs; `launch` and `status` also read
            # the config path
            if isinstance(st, dict) and isinstance(st.get("ifname"), str) \
                    and isinstance(st.get("config", ""), str):
                out.append(st)
    return out


def preflight(config: str | Path) -> TunnelConfig:
    """Everything ``up`` checks before it starts anything: root, the tools, the
    key file, the interface name, the overlay address, the UDP port, the
    endpoints (each failure names the fix)."""
    cfg = load_config(config)   # a bad file is the first thing to fix, root or not
    check_root()
    from lorasync.overlay import sshtun

    if cfg.transport == "ssh":
        sshtun.require_tools(server=False)
        wg.check_key_file(cfg.private_key_file)
        check_key_matches(cfg, public_key_of=lambda p: sshtun.public_key_of(p).split()[1])
    elif cfg.wireguard:
        wg.require_tools(need_nft=cfg.relay)
        wg.check_key_file(cfg.private_key_file)
        check_key_matches(cfg)
    if cfg.ssh_server:
        sshtun.require_tools(server=True)
        wg.check_key_file(cfg.ssh_server["host_key_file"])
    for st in states():
        if cfg.ifname in (st.get("ifname"), st.get("tunnel")) and pid_alive(st.get("pid")):
            raise ConfigError("ifname", cfg.ifname, f"this tunnel is already up (supervisor pid "
                              f"{st['pid']}): `lorasync tunnel down --ifname {cfg.ifname}` first")
    devices = [cfg.device] + ([f"tun{c['tun']}" for c in cfg.ssh_server["clients"]]
                              if cfg.ssh_server else [])
    for dev in devices:
        if Path(f"/sys/class/net/{dev}").exists():
            raise ConfigError("ifname", dev, "an interface of this name exists already (not a "
                              f"running lorasync tunnel): remove it (ip link del {dev}) or give "
                              "another --ifname at `tunnel init`")
    check_address_clash(cfg)
    if cfg.wireguard:
        check_port_free(cfg.listen_port)
    if cfg.ssh_server:
        sshtun.check_listen(cfg.ssh_server["listen"], cfg.ssh_server["port"])
    if cfg.transport == "ssh":
        return cfg
    for p in cfg.peers:
        if p.get("endpoint"):
            resolve_endpoint(p["endpoint"], "the hub" if p["name"] == cfg.hub else p["name"])
    return cfg


def up(config: str | Path, *, hub_timeout: float = 20.0, cluster: str | None = None,
       python: str = sys.executable) -> dict:
    """Bring this node's tunnel up in the background; return its state.

    Checks first (:func:`preflight`), then starts the supervisor and, on a
    node other than the hub, waits up to ``hub_timeout`` s for the hub's
    handshake; on any failure nothing is left behind.
    """
    cfg = preflight(config)
    TUNNELS_DIR.mkdir(parents=True, exist_ok=True)
    if cfg.transport == "ssh" or not cfg.wireguard:
        return _up_ssh(cfg, hub_timeout=hub_timeout, cluster=cluster, python=python)
    argv = [python, "-m", "lorasync.overlay.tunnel", "supervise", str(cfg.path)]
    if cluster:
        argv += ["--cluster", cluster]
    err = open(TUNNELS_DIR / f"{cfg.ifname}.log", "ab")
    # its own session: once up, a Ctrl-C in the shell that ran `up` must not take it down
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                            start_new_session=True, close_fds=True)
    err.close()
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        proc.stdout.close()
        if line != "ready":
            if line.startswith("error: "):
                raise EnvironmentProblem(f"tunnel {cfg.ifname}: {line[7:]}")
            raise EnvironmentProblem(f"tunnel {cfg.ifname}: the supervisor did not start (see "
                                     f"{TUNNELS_DIR / (cfg.ifname + '.log')})")
        if not cfg.is_hub and cfg.hub_peer is not None:
            wait_handshake(cfg, cfg.hub_peer, hub_timeout)
    except BaseException:  # a failure or Ctrl-C before the tunnel is up: nothing stays
        stop_process(proc)
        down(cfg.ifname)
        raise
    if cfg.ssh_server:   # the hub also serves nodes on the SSH path
        _up_ssh(cfg, hub_timeout=hub_timeout, cluster=cluster, python=python)
    return next(s for s in states() if s.get("ifname") == cfg.ifname)


def _up_ssh(cfg: TunnelConfig, *, hub_timeout: float, cluster: str | None, python: str) -> dict:
    """A node's SSH transport, or the hub's sshd for its nodes on the SSH path;
    on failure nothing of this tunnel stays (its WireGuard side included)."""
    from lorasync.overlay import sshtun

    try:
        return sshtun.start_background(sshtun.runtime_config(cfg), cluster=cluster, python=python,
                                       ready_timeout=hub_timeout)
    except BaseException:
        down(cfg.ifname)
        raise


def wait_handshake(cfg: TunnelConfig, peer: dict, timeout: float, netns: str | None = None) -> float:
    """Seconds until ``peer``'s first handshake; EnvironmentProblem after ``timeout``."""
    t0 = time.monotonic()
    while True:
        st = wg.show(cfg.ifname, netns=netns)
        ps = st.peer(peer["public_key"])
        if ps and ps.latest_handshake:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            host, port = split_endpoint(peer["endpoint"]) if peer.get("endpoint") else ("?", 0)
            raise EnvironmentProblem(
                f"the hub {peer['name']} ({peer['endpoint']}) did not answer a WireGuard handshake "
                f"within {timeout:g} s: check that `lorasync tunnel up` runs there, that UDP port "
                f"{port} on {host} is open to this node (firewall, security group), and that both "
                f"configs come from the same `lorasync tunnel assemble`")
        time.sleep(0.1)


def down(ifname: str | None = None, *, cluster: str | None = None) -> list[str]:
    """Stop tunnels and remove everything they made; idempotent.

    ``ifname`` names one tunnel; ``cluster`` every tunnel of an emulated
    cluster; neither: every lorasync tunnel on this host.  Removes the
    supervisor and wireguard-go processes, the interface, the control socket,
    the relay's nft table and the state file.  Returns what was removed.
    """
    removed = []
    for st in states():
        # a real hub's sshd goes with its tunnel (state `tunnel` names it)
        if ifname is not None and ifname not in (st.get("ifname"), st.get("tunnel")):
            continue
        if cluster is not None and st.get("cluster") != cluster:
            continue
        removed += down_one(st)
    if ifname is not None and not any(r.startswith("state") for r in removed):
        removed += leftovers(ifname, None)
    return removed


def down_one(st: dict) -> list[str]:
    """Stop the tunnel ``st`` describes (its supervisor, its wireguard-go) and
    remove what it left; what was removed, one line each."""
    if st.get("transport") == "ssh":
        from lorasync.overlay import sshtun

        return sshtun.down_one(st)
    ifname, netns = st["ifname"], st.get("netns")
    removed = []
    # a stale state file (a crashed supervisor) may name PIDs the system has since
    # given to other processes: signal only what its command line shows is ours
    pid = st.get("pid")
    if pid_alive(pid) and _is_supervisor(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 8
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_alive(pid) and _is_supervisor(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        removed.append(f"supervisor {pid}")
    wpid = st.get("wg_pid")
    if pid_alive(wpid) and _is_wireguard(wpid, ifname):
        with contextlib.suppress(ProcessLookupError):
            os.kill(wpid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while pid_alive(wpid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_alive(wpid) and _is_wireguard(wpid, ifname):
            with contextlib.suppress(ProcessLookupError):
                os.kill(wpid, signal.SIGKILL)
        removed.append(f"wireguard-go {wpid}")
    removed += leftovers(ifname, netns)
    path = TUNNELS_DIR / f"{ifname}.json"
    if path.exists():
        path.unlink()
        removed.append(f"state {path}")
    return removed


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _argv(pid: int) -> list[str]:
    return [a.decode(errors="replace") for a in _cmdline(pid).split(b"\0") if a]


def _is_supervisor(pid: int) -> bool:
    """Whether ``pid`` runs a lorasync tunnel supervisor: ``python -m
    lorasync.overlay.tunnel supervise CONFIG`` (``up``) or ``lorasync tunnel up
    --foreground CONFIG``."""
    args = _argv(pid)
    if "lorasync.overlay.tunnel" in args and "supervise" in args:
        return True
    return (any(os.path.basename(a) == "lorasync" for a in args)
            and {"tunnel", "up", "--foreground"} <= set(args))


def _is_wireguard(pid: int, ifname: str) -> bool:
    """Whether ``pid`` runs ``wireguard-go`` for ``ifname`` (as ``wireguard-go -f IFNAME``)."""
    args = _argv(pid)
    return bool(args) and os.path.basename(args[0]) == "wireguard-go" and ifname in args[1:]


def _ns(netns: str | None, argv: list[str]) -> list[str]:
    return (["ip", "netns", "exec", netns] if netns else []) + argv


def leftovers(ifname: str, netns: str | None) -> list[str]:
    """What a killed supervisor may have left: interface, socket, nft table."""
    removed = []
    if netns and not Path(f"/run/netns/{netns}").exists():
        netns_gone = True
    else:
        netns_gone = False
    if not netns_gone:
        link = subprocess.run(_ns(netns, ["ip", "link", "show", ifname]), capture_output=True)
        if link.returncode == 0:
            subprocess.run(_ns(netns, ["ip", "link", "del", ifname]), capture_output=True)
            removed.append(f"interface {ifname}")
        if subprocess.run(["sh", "-c", "command -v nft"], capture_output=True).returncode == 0:
            t = wg.nft_table_name(ifname)
            if subprocess.run(_ns(netns, ["nft", "delete", "table", "inet", t]),
                              capture_output=True).returncode == 0:
                removed.append(f"nft table inet {t}")
    sock = wg.socket_path(ifname)
    if sock.exists() and not wg._socket_alive(sock):
        sock.unlink()
        removed.append(f"socket {sock}")
    return removed


def status(ifname: str | None = None, *, measure: bool = True, seconds: float = 1.0,
           cluster: str | None = None) -> list[dict]:
    """Every tunnel here (or ``ifname``): per peer the handshake age, bytes in
    and out, RTT and rate measured through the overlay, direct or relayed."""
    out = []
    for st in states():
        if ifname is not None and st.get("ifname") != ifname:
            continue
        if cluster is not None and st.get("cluster") != cluster:
            continue
        out.append(_status_one(st, measure, seconds))
    if ifname is not None and not out:
        raise ConfigError("--ifname", ifname, "no lorasync tunnel of this name is up here "
                          "(`lorasync tunnel status` lists them)")
    return out


def _status_one(st: dict, measure: bool, seconds: float) -> dict:
    if st.get("transport") == "ssh":
        from lorasync.overlay import sshtun

        return sshtun.status_one(st, measure, seconds)
    cfg = load_config(st["config"])
    netns = st.get("netns")
    alive = pid_alive(st.get("pid"))
    dev = None
    error = None
    try:
        dev = wg.show(cfg.ifname, netns=netns)
    except (LorasyncError, ValueError) as exc:
        error = str(exc)
    now = time.time()
    by_key = {p.public_key: p for p in dev.peers} if dev else {}
    peers = []
    for n in cfg.nodes:
        if n["name"] == cfg.node:
            continue
        route = cfg.routes.get(n["name"], "direct")
        via = cfg.hub_peer if route != "direct" else next(
            (p for p in cfg.peers if p["name"] == n["name"]), None)
        path = (st.get("paths") or {}).get(n["name"])
        if path and path.get("path") == "direct":  # hole punched (punch.py)
            route, via = "direct (hole punched)", {"public_key": n["public_key"]}
        ps = by_key.get(via["public_key"]) if via else None
        row = {"name": n["name"], "address": n["address"], "route": route,
               "transport": n.get("transport", "wireguard"), "reason": n.get("reason", ""),
               "relayed": not route.startswith("direct"), "path": path,
               "endpoint": ps.endpoint if ps else None,
               "handshake_age_s": ps.handshake_age(now) if ps else None,
               "rx_bytes": ps.rx_bytes if ps else None, "tx_bytes": ps.tx_bytes if ps else None,
               "is_hub": n["name"] == cfg.hub}
        if measure and dev is not None:
            row.update(linktest.measure_peer(n["address"], cfg.listen_port, seconds, netns))
        peers.append(row)
    mine = next((n for n in cfg.nodes if n.get("name") == cfg.node), {})
    return {"ifname": cfg.ifname, "transport": "wireguard",
            "reason": mine.get("reason") or ("relays for the nodes that cannot reach each other"
                                             if cfg.relay else ""),
            "node": cfg.node, "address": cfg.address, "prefixlen": cfg.prefixlen,
            "mtu": st.get("mtu"), "listen_port": cfg.listen_port, "hub": cfg.hub, "is_hub": cfg.is_hub,
            "netns": netns, "cluster": st.get("cluster"), "supervisor_pid": st.get("pid"),
            "supervisor_alive": alive, "wg_pid": st.get("wg_pid"), "restarts": st.get("restarts", 0),
            "started": st.get("started"), "log": st.get("log"), "error": error, "peers": peers}


# ---------------------------------------------------------------- training over it

def worker_env(cfg_or_state: TunnelConfig) -> dict[str, str]:
    """What gloo/NCCL need to run over the overlay."""
    name = getattr(cfg_or_state, "device", None) or cfg_or_state.ifname
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


if __name__ == "__main__":
    sys.exit(supervise_main())
