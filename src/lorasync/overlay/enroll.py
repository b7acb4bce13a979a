"""Setting up an overlay so that every private key stays on its node: plan,
join, assemble (``lorasync tunnel init`` / ``join`` / ``assemble``).

WireGuard's practice: a node makes its own key pair and only the public key
travels.  Three steps, and every file that travels is one file, holding
nothing secret:

1. plan (:func:`init_overlay`, on any machine): addresses, endpoints, the
   hub, who peers whom.  Writes ``OUT/plan.json`` (stays there) and, per
   node, ``OUT/NODE.plan.json`` (carried to that node);
2. join (:func:`join_overlay`, on each node): makes the node's key pair
   there (``DIR/private.key``, 0600 in a 0700 directory; never printed) and
   writes ``NODE.pub.json`` beside the plan file (carried back): the public
   key, bound to the node's name and the plan's id;
3. assemble (:func:`assemble_overlay`, where the plan was made): checks every
   public-key file against the plan (same plan, a node of it, one key per
   node, no key twice) and writes ``OUT/NODE.tunnel.json`` (carried to that
   node) for ``lorasync tunnel up --config``; its ``private_key_file`` is the
   path ``join`` reported, on that node.

A plan's id is a hash of its content and a random nonce: a file from another
``init`` (or an edited one) is refused, so configs from two plans cannot mix.
The emulated cluster, one machine playing every node, runs the same three
steps (:func:`enroll_locally`), each node's key in its own directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import secrets
from pathlib import Path
from typing import Callable, Iterable, Sequence

from lorasync.errors import ConfigError
from lorasync.overlay import probe, sshtun, wireguard as wg
from lorasync.overlay.config import (DEFAULT_IFNAME, DEFAULT_KEEPALIVE, DEFAULT_PORT, DEFAULT_STALE_S,
                                     DEFAULT_SUBNET, CONFIG_VERSION, NODE_NAME_RE, is_jump,
                                     join_endpoint, split_endpoint)

__all__ = [
    "NodeSpec",
    "assemble_overlay",
    "enroll_locally",
    "init_overlay",
    "join_overlay",
    "node_config",
    "parse_node_spec",
    "plan_overlay",
    "read_plan",
    "routes",
]

PLAN_KIND = "lorasync-overlay-plan"
PUBLIC_KIND = "lorasync-overlay-public-key"
#: the files init, join and assemble write, by the name of the node they are for
_OURS = ("plan.json", "*.plan.json", "*.pub.json", "*.tunnel.json")
TRANSPORTS = ("wireguard", "ssh")


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One node as ``init`` is told about it."""

    name: str
    endpoint: str | None = None
    """HOST:PORT every node can reach it on; None: behind NAT (connects out only)."""
    listen_port: int = DEFAULT_PORT
    transport: str = "wireguard"
    """``"wireguard"`` (UDP), or ``"ssh"``: the node reaches the hub over SSH's
    tun forwarding (:mod:`lorasync.overlay.sshtun`) and every other node through it."""
    reason: str = ""
    """Why this transport (``overlay=auto`` records what it tried); shown by ``tunnel status``."""

    def __post_init__(self):
        if not NODE_NAME_RE.fullmatch(self.name):
            raise ConfigError("node", self.name, "use 1-32 letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit")
        if self.transport not in TRANSPORTS:
            raise ConfigError("transport", self.transport, f"use one of: {', '.join(TRANSPORTS)}")


def parse_node_spec(text: str, default_port: int = DEFAULT_PORT) -> NodeSpec:
    """``"node1"`` (behind NAT) or ``"node0=203.0.113.5[:51820]"`` -> :class:`NodeSpec`."""
    name, sep, ep = str(text).partition("=")
    name = name.strip()
    if not sep:
        return NodeSpec(name, None, default_port)
    host, port = split_endpoint(ep, f"node {name}", default_port)
    return NodeSpec(name, join_endpoint(host, port), port)


def _direct(a: dict, b: dict) -> bool:
    """A pair is direct when one of the two can be reached by the other over
    WireGuard (a node on the SSH path reaches every other node through the hub)."""
    if a.get("transport", "wireguard") != "wireguard" or b.get("transport", "wireguard") != "wireguard":
        return False
    return bool(a["endpoint"] or b["endpoint"])


# ---------------------------------------------------------------- 1. the plan

def plan_overlay(nodes: Sequence[NodeSpec], hub: str, *, subnet: str = DEFAULT_SUBNET,
                 ifname: str | Callable[[int], str] = DEFAULT_IFNAME,
                 keepalive_s: int = DEFAULT_KEEPALIVE, mtu: int | None = None,
                 stale_s: int = DEFAULT_STALE_S, nonce: str | None = None,
                 ssh: dict | None = None) -> dict:
    """The overlay's plan (no keys): every node's address, endpoint, UDP port
    and interface, the hub, and the settings every node shares; with its id.

    Validates the whole overlay: unique names, a hub with an endpoint, a
    subnet with room for every node and containing no endpoint.

    ``ssh`` ({"port", "listen"}): the hub also offers the SSH path (its own
    sshd on ``listen:port``, :mod:`~lorasync.overlay.sshtun`) to the nodes
    whose ``tunnel join`` finds UDP blocked; the plan then carries the host the
    nodes connect to (the hub's endpoint), the port and the login user.
    """
    nodes = list(nodes)
    if not nodes:
        raise ConfigError("node", "", "give at least two nodes, e.g. --hub node0=HOST --node node1")
    names = [n.name for n in nodes]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ConfigError("node", dup, "every node needs a name of its own")
    if hub not in names:
        raise ConfigError("hub", hub, f"name one of the nodes: {', '.join(names)}")
    h = names.index(hub)
    if not nodes[h].endpoint:
        raise ConfigError("hub", hub, "the hub relays for nodes behind NAT, so every node must "
                          "reach it: give its endpoint, e.g. --hub node0=203.0.113.5:51820")
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError:
        raise ConfigError("subnet", subnet, "give an IPv4 network such as 10.77.0.0/24") from None
    if not net.is_private:
        raise ConfigError("subnet", subnet, "use a private range such as 10.77.0.0/24")
    hosts = list(net.hosts())
    if len(nodes) > len(hosts):
        raise ConfigError("subnet", subnet, f"has room for {len(hosts)} nodes, not {len(nodes)}: "
                          "use a bigger one, e.g. /24")
    for n in nodes:
        if n.endpoint:
            host, _ = split_endpoint(n.endpoint)
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:  # a name: resolved at `up`
                ip = None
            if ip is not None and ip in net:
                raise ConfigError("subnet", subnet, f"contains {n.name}'s endpoint {host}: "
                                  "the tunnel would route its own packets into itself; "
                                  "choose a subnet no node's real address is in")
    if mtu is not None and not wg.MIN_MTU <= int(mtu) <= wg.MAX_MTU:
        raise ConfigError("mtu", mtu, f"must be between {wg.MIN_MTU} and {wg.MAX_MTU} (or auto)")
    if not 1 <= int(keepalive_s) <= 3600:
        raise ConfigError("keepalive", keepalive_s, "give seconds between 1 and 3600 (25 is usual)")
    order = [h] + [i for i in range(len(nodes)) if i != h]  # the hub gets the first address
    addr = {nodes[i].name: str(hosts[k]) for k, i in enumerate(order)}
    plan = {
        "kind": PLAN_KIND, "version": CONFIG_VERSION, "hub": hub, "subnet": str(net),
        "mtu": None if mtu is None else int(mtu), "keepalive_s": int(keepalive_s),
        "stale_s": int(stale_s),
        # two inits with the same arguments are still two plans: their files must not mix
        "nonce": nonce or secrets.token_hex(8),
        "nodes": [dict({"name": n.name, "address": addr[n.name], "endpoint": n.endpoint,
                        "listen_port": n.listen_port,
                        "ifname": ifname(i) if callable(ifname) else ifname},
                       # only when set: plans of WireGuard alone keep their layout
                       **({"transport": n.transport, "reason": n.reason}
                          if n.transport != "wireguard" or n.reason else {}))
                  for i, n in enumerate(nodes)],
    }
    if nodes[h].transport != "wireguard":
        raise ConfigError("hub", hub, "the hub serves every transport: it cannot itself be on the "
                          "SSH path")
    if ssh is not None:
        plan["ssh"] = ssh_offer(nodes[h], ssh.get("port", sshtun.DEFAULT_PORT), ssh.get("listen"))
    plan["plan_id"] = plan_id(plan)
    return plan


def ssh_offer(hub: NodeSpec, port, listen: str | None) -> dict:
    """The plan's ``ssh``: where the hub's sshd listens (one address of the hub,
    never a wildcard; by default its endpoint's, when that is an IP address),
    the host and port the nodes connect to, and the user they log in as."""
    host, _ = split_endpoint(hub.endpoint)
    if not str(port).isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError("--ssh-port", port, "give a TCP port between 1 and 65535 (443 passes "
                          "most networks that let only TCP out)")
    if listen is None:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError("--ssh-listen", "", f"the hub's endpoint {host} is a name, and sshd "
                              "listens on one address of the hub, never a wildcard: give it, "
                              "e.g. --ssh-listen 203.0.113.5") from None
        listen = host
    try:
        ip = ipaddress.ip_address(listen)
    except ValueError:
        raise ConfigError("--ssh-listen", listen, "give one IP address of the hub (sshd listens "
                          "there only)") from None
    if ip.is_unspecified:
        raise ConfigError("--ssh-listen", listen, "give one IP address of the hub: lorasync "
                          "never listens on a wildcard address")
    return {"host": host, "listen": str(ip), "port": int(port), "user": sshtun.USER}


def plan_id(plan: dict) -> str:
    """16 hex digits of SHA-256 over the plan's content (its id and the node a
    copy is for left out): the same in every copy, changed by any edit."""
    body = {k: v for k, v in plan.items() if k not in ("plan_id", "node")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def init_overlay(out_dir: str | Path, nodes: Sequence[NodeSpec], hub: str, *,
                 force: bool = False, **kw) -> list[Path]:
    """Write ``OUT/plan.json`` and, per node, ``OUT/NODE.plan.json`` (the one
    file to carry to that node); return those, in ``nodes`` order.  No key is
    made here.  Nothing is written when validation fails; an existing overlay
    is kept unless ``force`` (which replaces the files init, join and assemble
    wrote in ``OUT``, never a key directory)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        raise ConfigError("--out", str(out), "already holds files (an earlier overlay?): choose "
                          "another directory, or pass --force to replace its plan")
    plan = plan_overlay(nodes, hub, **kw)
    out.mkdir(parents=True, exist_ok=True)
    for pattern in _OURS:  # an earlier plan's files would be refused by assemble anyway
        for old in out.glob(pattern):
            old.unlink()
    _write_json(out / "plan.json", plan)
    paths = []
    for n in plan["nodes"]:
        paths.append(out / f"{n['name']}.plan.json")
        _write_json(paths[-1], dict(plan, node=n["name"]))
    return paths


def read_plan(path: str | Path, field: str = "plan") -> dict:
    """A plan file (``plan.json`` or ``NODE.plan.json``), checked against its id."""
    raw = _read_json(path, field, PLAN_KIND, "the plan `lorasync tunnel init` wrote")
    try:
        names = [n["name"] for n in raw["nodes"]]
        lacks = [k for k in ("hub", "subnet", "mtu", "keepalive_s", "stale_s") if k not in raw]
    except (KeyError, TypeError):
        lacks = ["nodes"]
    if lacks:
        raise ConfigError(field, str(path), f"incomplete plan (no {', '.join(lacks)}): copy it "
                          "again from where `lorasync tunnel init` ran")
    if raw.get("plan_id") != plan_id(raw):
        raise ConfigError(field, str(path), "its content does not match its plan id (edited or "
                          "damaged): copy it again from where `lorasync tunnel init` ran")
    ssh = raw.get("ssh")
    if ssh is not None and not (isinstance(ssh, dict) and isinstance(ssh.get("host"), str)
                                and isinstance(ssh.get("listen"), str)
                                and isinstance(ssh.get("port"), int) and ssh.get("user") == sshtun.USER):
        raise ConfigError(field, str(path), "its ssh section is not the one `tunnel init --ssh` "
                          "writes: copy the plan again from where `lorasync tunnel init` ran")
    if "node" in raw and raw["node"] not in names:
        raise ConfigError(field, str(path), f"is for node {raw['node']!r}, which is not in its "
                          f"plan ({', '.join(names)}): carry the NODE.plan.json `tunnel init` wrote")
    return raw


# ---------------------------------------------------------------- 2. join, on each node

TRANSPORT_CHOICES = ("udp", "ssh", "auto")


def choose_transport(plan: dict, node: str, requested: str | None = "auto",
                     ssh_jump: str | None = None, prober: Callable = probe.check
                     ) -> tuple[str, str]:
    """(transport, reason) of ``node`` at ``tunnel join``: the one asked for,
    or with ``auto`` what the probes to the hub find (UDP to its WireGuard
    port, TCP to the SSH port the plan offers: :mod:`~lorasync.overlay.probe`)."""
    if requested not in TRANSPORT_CHOICES:
        raise ConfigError("--transport", requested, f"use one of: {', '.join(TRANSPORT_CHOICES)}")
    ssh = plan.get("ssh")
    hubn = next(n for n in plan["nodes"] if n["name"] == plan["hub"])
    host, udp_port = split_endpoint(hubn["endpoint"])
    if ssh_jump is not None:
        if not is_jump(ssh_jump):
            raise ConfigError("--ssh-jump", ssh_jump, "give ssh's jump host: [USER@]HOST[:PORT]")
    if node == plan["hub"]:
        if ssh_jump or requested == "ssh":
            raise ConfigError("--transport" if requested == "ssh" else "--ssh-jump",
                              requested if requested == "ssh" else ssh_jump,
                              "the hub serves the SSH path; it does not take it")
        return "wireguard", "the hub: every node connects to it" + (
            f"; offers the SSH path on {ssh['listen']}:{ssh['port']}" if ssh else "")
    if ssh is None and (requested == "ssh" or ssh_jump):
        raise ConfigError("--ssh-jump" if ssh_jump else "--transport", ssh_jump or requested,
                          "this plan offers no SSH path: plan again on the hub with `lorasync "
                          "tunnel init --ssh` (or join over UDP)")
    if requested == "udp":
        if ssh_jump:
            raise ConfigError("--ssh-jump", ssh_jump, "goes with --transport ssh or auto")
        return "wireguard", f"--transport udp: WireGuard over UDP to the hub {host}:{udp_port}"
    jump = f" through the jump host {ssh_jump}" if ssh_jump else ""
    if requested == "ssh":
        return "ssh", f"--transport ssh: SSH over TCP to the hub {host}:{ssh['port']}{jump}"
    if ssh is None:
        return "wireguard", (f"the plan offers WireGuard only (no `tunnel init --ssh`): UDP to "
                             f"the hub {host}:{udp_port}")
    if ssh_jump:
        return "ssh", (f"--ssh-jump {ssh_jump}: the hub is reached through a jump host, so over "
                       f"SSH (TCP port {ssh['port']}; not probed)")
    udp, tcp = prober(host, udp_port, ssh["port"], token=plan["plan_id"])
    mine = next(n for n in plan["nodes"] if n["name"] == node)
    behind = [n for n in plan["nodes"] if not n["endpoint"] and n["name"] != plan["hub"]]
    return probe.decide(udp, tcp, host=host, udp_port=udp_port, ssh_port=ssh["port"],
                        relayed=not mine["endpoint"] and len(behind) >= 2)


def join_overlay(plan_file: str | Path, key_dir: str | Path | None = None, *,
                 keygen: Callable[[], tuple[str, str]] = wg.generate_keypair,
                 public_key_of: Callable[[Path], str] = wg.public_key_of,
                 transport: str | None = None, ssh_jump: str | None = None,
                 prober: Callable = probe.check) -> Path:
    """On the node a ``NODE.plan.json`` is for: make its key pair here and
    write ``NODE.pub.json`` (beside the plan file) to carry back; return its path.

    The private key goes to ``key_dir/private.key`` (default: the plan file's
    directory / NODE; made 0700 if new), created 0600; it is neither printed
    nor written anywhere else.  A key already there is kept (the node keeps its
    identity when it joins again, or joins a new plan).

    ``transport`` (``udp``, ``ssh``, ``auto``: :func:`choose_transport`)
    records the node's transport and why in ``NODE.pub.json``; a node on the
    SSH path makes an SSH key instead (``DIR/ssh.key``), and the hub of a plan
    offering the SSH path its sshd's host key too (``DIR/ssh_host.key``).
    None (the emulated cluster): the plan's own choice, nothing probed.
    """
    plan_file = Path(plan_file)
    plan = read_plan(plan_file)
    node = plan.get("node")
    if node is None:
        raise ConfigError("plan", str(plan_file), "is the whole plan, for no node in particular: "
                          "carry to each node the file made for it (NODE.plan.json, beside it)")
    d = Path(key_dir) if key_dir is not None else plan_file.parent / node
    if not d.exists():  # a directory the user gave keeps its mode: the key itself is 0600
        d.mkdir(parents=True, mode=0o700)
        os.chmod(d, 0o700)  # whatever the umask
    chosen = None if transport is None else choose_transport(plan, node, transport, ssh_jump,
                                                                 prober)
    extra: dict = {}
    if chosen is not None and chosen[0] == "ssh":
        sshtun.require_tools(server=False)
        key = d / "ssh.key"
        if key.exists():
            wg.check_key_file(key)
        full = " ".join(sshtun.make_keypair(key, f"lorasync-overlay-{node}").split()[:2])
        public = full.split()[1]
        extra = {"ssh_public_key": full, "ssh_jump": ssh_jump}
    else:
        key = d / "private.key"
        if key.exists():
            wg.check_key_file(key)
            public = public_key_of(key)
        else:
            private, public = keygen()
            wg.write_private_key(key, private)
    if chosen is not None and node == plan["hub"] and plan.get("ssh"):
        sshtun.require_tools(server=False)
        hk = d / "ssh_host.key"
        extra = {"ssh_host_key": " ".join(sshtun.make_keypair(hk, "lorasync-overlay-hub").split()[:2]),
                 "ssh_host_key_file": str(hk.resolve())}
    if chosen is not None:
        extra.update(transport=chosen[0], reason=chosen[1])
    pub = plan_file.parent / f"{node}.pub.json"
    _write_json(pub, {"kind": PUBLIC_KIND, "version": CONFIG_VERSION, "plan_id": plan["plan_id"],
                      "node": node, "public_key": public,
                      "private_key_file": str(key.resolve()), **extra})
    return pub


# ---------------------------------------------------------------- 3. assemble

def read_public(path: str | Path, plan: dict) -> dict:
    """A ``NODE.pub.json``, checked against ``plan``: same plan, a node of it, a key."""
    field = "public-key file"
    raw = _read_json(path, field, PUBLIC_KIND, "the NODE.pub.json `lorasync tunnel join` wrote")
    names = [n["name"] for n in plan["nodes"]]
    if raw.get("plan_id") != plan["plan_id"]:
        raise ConfigError(field, str(path), f"made for plan {raw.get('plan_id')}, not this one "
                          f"({plan['plan_id']}): run `lorasync tunnel join NODE.plan.json` on that "
                          "node with this plan's file and carry back the NODE.pub.json it writes")
    if raw.get("node") not in names:
        raise ConfigError(field, str(path), f"is node {raw.get('node')!r}'s, which is not in the "
                          f"plan ({', '.join(names)}): carry back only files of this plan's nodes")
    t = raw.get("transport", "wireguard")
    if t not in TRANSPORTS or (t == "ssh" and not plan.get("ssh")):
        raise ConfigError(field, str(path), f"its transport {t!r} is not one this plan offers: "
                          "run `lorasync tunnel join` on that node again")
    if t == "ssh":
        full = raw.get("ssh_public_key")
        if not sshtun.is_public_key(full) or full.split()[1] != raw.get("public_key"):
            raise ConfigError(field, str(path), "its ssh_public_key is not an ed25519 SSH key "
                              "matching its public_key: run `lorasync tunnel join` on that node again")
        jump = raw.get("ssh_jump")
        if jump is not None and not (isinstance(jump, str) and is_jump(jump)):
            raise ConfigError(field, str(path), "its ssh_jump is not a jump host ([USER@]HOST"
                              "[:PORT]): run `lorasync tunnel join` on that node again")
    elif not wg.is_public_key(raw.get("public_key")):
        raise ConfigError(field, str(path), "its public_key is not a WireGuard key (44 characters "
                          "of base64): run `lorasync tunnel join` on that node again")
    if "ssh_host_key" in raw and not (sshtun.is_public_key(raw["ssh_host_key"]) and isinstance(
            raw.get("ssh_host_key_file"), str) and os.path.isabs(raw["ssh_host_key_file"])):
        raise ConfigError(field, str(path), "its ssh_host_key is not an ed25519 SSH key with the "
                          "absolute path of its file: run `lorasync tunnel join` on the hub again")
    kf = raw.get("private_key_file")
    if not isinstance(kf, str) or not os.path.isabs(kf):
        raise ConfigError(field, str(path), "its private_key_file is not the absolute path "
                          "`lorasync tunnel join` writes: run it on that node again")
    return raw


def assemble_overlay(out_dir: str | Path, public_files: Iterable[str | Path] | None = None
                     ) -> list[Path]:
    """From ``OUT/plan.json`` and every node's ``NODE.pub.json`` (given, or
    ``OUT/*.pub.json``), write ``OUT/NODE.tunnel.json`` for every node (public
    keys only); return them in plan order.  Refuses a file of another plan or
    of a node not in it, two keys for one node, one key for two nodes, and
    a node without a public key."""
    out = Path(out_dir)
    if not (out / "plan.json").exists():
        raise ConfigError("--out", str(out), "holds no plan.json: run assemble in the directory "
                          "`lorasync tunnel init --out` wrote")
    plan = read_plan(out / "plan.json")
    files = sorted(out.glob("*.pub.json")) if public_files is None else [Path(f) for f in public_files]
    pubs: dict[str, dict] = {}
    for f in files:
        raw = read_public(f, plan)
        prev = pubs.get(raw["node"])
        if prev is not None and prev["public_key"] != raw["public_key"]:
            raise ConfigError("public-key file", str(f), f"a second, different key for "
                              f"{raw['node']} (the other in {prev['_file']}): keep only the file "
                              "that node's latest `tunnel join` wrote")
        pubs[raw["node"]] = dict(raw, _file=str(f))
    owners: dict[str, str] = {}
    for name, raw in pubs.items():
        if raw["public_key"] in owners:
            raise ConfigError("public-key file", raw["_file"], f"{name} has the same key as "
                              f"{owners[raw['public_key']]}: a key was copied between nodes; "
                              "delete private.key on one of them and run `lorasync tunnel join` "
                              "there again")
        owners[raw["public_key"]] = name
    missing = [n["name"] for n in plan["nodes"] if n["name"] not in pubs]
    if missing:
        raise ConfigError("public keys", ", ".join(missing), f"no NODE.pub.json for these nodes in "
                          f"{out}: run `lorasync tunnel join NODE.plan.json` on each of them and "
                          f"carry the NODE.pub.json it writes into {out}/")
    plan = effective_plan(plan, pubs)
    paths = []
    for n in plan["nodes"]:
        cfg = node_config(plan, n["name"], {k: v["public_key"] for k, v in pubs.items()},
                          pubs[n["name"]]["private_key_file"], pubs=pubs)
        paths.append(out / f"{n['name']}.tunnel.json")
        _write_json(paths[-1], cfg)
    return paths


def effective_plan(plan: dict, pubs: dict[str, dict]) -> dict:
    """The plan with each node's transport and reason as its ``tunnel join``
    chose them (a node joined without a choice keeps the plan's); ConfigError
    when a node chose SSH and the hub's file has no SSH host key."""
    nodes = []
    for n in plan["nodes"]:
        raw = pubs.get(n["name"], {})
        if "transport" in raw:
            n = dict(n, transport=raw["transport"], reason=raw.get("reason", ""))
        nodes.append(n)
    if any(n.get("transport") == "ssh" for n in nodes) and plan.get("ssh") \
            and "ssh_host_key" not in pubs.get(plan["hub"], {}):
        hub = plan["hub"]
        raise ConfigError("public-key file", pubs.get(hub, {}).get("_file", f"{hub}.pub.json"),
                          f"the hub {hub}'s file has no SSH host key, and "
                          f"{', '.join(n['name'] for n in nodes if n.get('transport') == 'ssh')} "
                          "joined over SSH: run `lorasync tunnel join` on the hub again with this "
                          "plan and carry back its NODE.pub.json")
    ssh_nodes = [n["name"] for n in nodes if n.get("transport") == "ssh"]
    if ssh_nodes and plan.get("ssh"):
        nodes = [dict(n, reason=n.get("reason", "") + f"; serves {', '.join(ssh_nodes)} over SSH "
                      f"(sshd on {plan['ssh']['listen']}:{plan['ssh']['port']})")
                 if n["name"] == plan["hub"] else n for n in nodes]
    return dict(plan, nodes=nodes)


def node_config(plan: dict, name: str, public_keys: dict[str, str], key_file: str,
                pubs: dict[str, dict] | None = None) -> dict:
    """One node's ``tunnel.json``: its address, port, interface and key file
    (a path on that node), its peers with their public keys, endpoints and
    allowed IPs, and the whole overlay's layout (for ``status``)."""
    nodes = plan["nodes"]
    hub = plan["hub"]
    a = next(n for n in nodes if n["name"] == name)
    hubn = next(n for n in nodes if n["name"] == hub)
    keepalive = int(plan["keepalive_s"])
    peers = []
    relayed = [c["name"] for c in nodes if c is not a and not _direct(a, c)]
    for b in nodes:
        if b is a or not _direct(a, b):
            continue
        ips = [f"{b['address']}/32"]
        via = []
        if b is hubn:  # the hub also carries a's traffic to the nodes a cannot reach
            via = relayed
            ips += [f"{c['address']}/32" for c in nodes if c["name"] in relayed]
        peers.append({"name": b["name"], "address": b["address"], "public_key": public_keys[b["name"]],
                      "endpoint": b["endpoint"], "allowed_ips": ips, "relays": via,
                      "keepalive_s": keepalive if b["endpoint"] else None})
    return {
        "version": CONFIG_VERSION, "plan_id": plan["plan_id"], "node": name, "hub": hub,
        "is_hub": a is hubn, "ifname": a["ifname"], "address": a["address"],
        "subnet": plan["subnet"], "listen_port": a["listen_port"], "endpoint": a["endpoint"],
        "mtu": plan["mtu"], "keepalive_s": keepalive, "stale_s": int(plan["stale_s"]),
        "public_key": public_keys[name], "private_key_file": key_file,
        # the hub relays when two of its peers cannot reach each other
        "relay": a is hubn and any(not _direct(x, y) for x in nodes for y in nodes if x is not y),
        "peers": peers, "routes": routes(plan, name),
        # the hub forwards between WireGuard and its SSH nodes' tun devices
        "ssh_ifnames": [f"tun{sshtun.tun_number(i)}" for i, n in enumerate(nodes)
                        if n.get("transport") == "ssh"] if a is hubn else [],
        "nodes": [{"name": n["name"], "address": n["address"], "endpoint": n["endpoint"],
                   "public_key": public_keys[n["name"]],
                   "transport": n.get("transport", "wireguard"), "reason": n.get("reason", "")}
                  for n in nodes],
    } | _ssh_sections(plan, a, pubs)


def _ssh_sections(plan: dict, a: dict, pubs: dict[str, dict] | None) -> dict:
    """A real host's SSH path (nodes that joined over SSH, ``pubs`` from their
    ``tunnel join``): the node's ``ssh`` (the hub's host, port, user, host key,
    its tun device) or the hub's ``ssh_server`` (sshd's address, port, host
    key file and every SSH node's key, each for its own tun device)."""
    ssh = plan.get("ssh")
    if not ssh or not pubs:
        return {}
    nodes = plan["nodes"]
    hub = plan["hub"]
    ssh_idx = [i for i, n in enumerate(nodes)
               if n.get("transport") == "ssh" and "ssh_public_key" in pubs.get(n["name"], {})]
    if a["name"] == hub:
        if not ssh_idx:
            return {}
        wg_nodes = [n for n in nodes if n["name"] != hub and n.get("transport", "wireguard") == "wireguard"]
        return {"ssh_server": {
            "listen": ssh["listen"], "port": ssh["port"],
            "host_key_file": pubs[hub]["ssh_host_key_file"], "dummy": not wg_nodes,
            "clients": [{"name": nodes[i]["name"], "address": nodes[i]["address"],
                         "tun": sshtun.tun_number(i),
                         "public_key": pubs[nodes[i]["name"]]["ssh_public_key"]} for i in ssh_idx]}}
    i = nodes.index(a)
    if i not in ssh_idx:
        return {}
    return {"transport": "ssh", "ssh": {
        "host": ssh["host"], "port": ssh["port"], "user": ssh["user"],
        "host_key": pubs[hub]["ssh_host_key"], "tun": sshtun.tun_number(i),
        "proxy_jump": pubs[a["name"]].get("ssh_jump")}}


def routes(plan: dict, name: str) -> dict[str, str]:
    """How ``name`` reaches every other node: ``"direct"`` or ``"via HUB"``."""
    a = next(n for n in plan["nodes"] if n["name"] == name)

    def how(c: dict) -> str:
        if _direct(a, c):
            return "direct"
        if a["name"] == plan["hub"] and c.get("transport") == "ssh":
            return "ssh"
        return f"via {plan['hub']}"
    return {c["name"]: how(c) for c in plan["nodes"] if c is not a}


def enroll_locally(out_dir: str | Path, nodes: Sequence[NodeSpec], hub: str, *,
                   keygen: Callable[[], tuple[str, str]] = wg.generate_keypair,
                   public_key_of: Callable[[Path], str] = wg.public_key_of, **kw) -> list[Path]:
    """init, join and assemble on one machine that plays every node (the
    emulated cluster, tests): each node's key is made by :func:`join_overlay`
    in that node's own directory ``OUT/NODE/``, as on a real node.  Returns
    the ``NODE.tunnel.json`` paths in ``nodes`` order."""
    for p in init_overlay(out_dir, nodes, hub, **kw):
        join_overlay(p, keygen=keygen, public_key_of=public_key_of)
    return assemble_overlay(out_dir)


# ---------------------------------------------------------------- files

def _write_json(path: Path, obj: dict) -> None:
    """Atomically, 0644: nothing these files hold is secret."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.chmod(tmp, 0o644)
    tmp.replace(path)


def _read_json(path: str | Path, field: str, kind: str, what: str) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(field, str(path), f"no such file: give {what}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(field, str(path), f"not readable JSON ({type(exc).__name__}): give "
                          f"{what}") from None
    if not isinstance(raw, dict) or raw.get("kind") != kind:
        raise ConfigError(field, str(path), f"not {what}")
    if raw.get("version") != CONFIG_VERSION:
        raise ConfigError(field, str(path), f"made by another lorasync version "
                          f"({raw.get('version')}, this one reads {CONFIG_VERSION}): run "
                          "`lorasync tunnel init` again")
    return raw
