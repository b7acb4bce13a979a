"""Emulated multi-node cluster on one machine: network namespaces + shaped links.

Topology (nothing is created in the host's root namespace)::

    lsync-NAME-node0 [eth0 10.213.0.1/24] --veth-- [p0] \\
    lsync-NAME-node1 [eth0 10.213.0.2/24] --veth-- [p1]  > lsync-NAME-hub (router)
    ...                                                 /      [dly] TUN, only with delay/loss

The hub namespace *routes* between the nodes (IP forwarding + proxy ARP, so
the nodes still see one flat /24) instead of bridging them: a router lets the
delay variant insert a userspace link with one policy rule, and both variants
keep the same addresses, interfaces and shaping.

Shaping is real kernel shaping, htb on both ends of each veth:

- node side ``eth0`` egress: what node I sends (its upload), class 1:10 at the
  node's rate; a per-pair rate adds a class for that destination address
  (u32 filter on the destination IP), under the same parent, so the pair is
  limited to min(pair rate, node rate);
- hub side ``pI`` egress: what node I receives (its download) at the node's
  rate, so fan-in from several senders is limited too.

Delay and loss (``netem`` is absent here): with delay or loss, the hub sends
every packet that arrives from a node into a TUN device owned by a
:mod:`lorasync.emulate.delaylink` process (a daemon started by ``up`` and killed
by ``down``), which holds it ``delay`` seconds, drops it with probability
``loss`` and writes it back; the hub then routes it to the destination.  Each
packet crosses it once: one-way delay = ``delay``, RTT = 2 x ``delay``.  The
forwarder is one Python process for the whole cluster, and its cost is per
packet, so links with delay default to MTU 65000 (docs/cost-model.md).

Nodes behind NAT (``nat=node2``): such a node sits in a LAN of its own
(``10.214.I.2/24``) behind a router namespace ``lsync-NAME-natI`` whose
cluster side takes the node's place (address ``10.213.0.I+1``, the veth to the
hub, the hub's shaping); an nft masquerade there lets the node connect out
and nothing connect in (:mod:`lorasync.emulate.nat`).  The node's own link is
still shaped at its ``eth0``.

Overlay (``overlay=wireguard``): every node runs a WireGuard tunnel over
those links (:mod:`lorasync.emulate.overlay`), with an address in
``10.215.0.0/24``; ``launch_on_cluster`` then runs gloo and the rendezvous
over it, the rendezvous on the overlay's hub (the first node outside NAT).

State lives in ``/run/lorasync/clusters/NAME.json`` so ``exec``, ``status``,
``set_rate`` and ``down`` work from other processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence

from lorasync.emulate import cpucap
from lorasync.emulate.nat import BLACKHOLE_MTU as _BLACKHOLE_MTU
from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.hostops import CLUSTERS_DIR, as_root, pid_alive, require_root
from lorasync.launch.agent import agent_argv
from lorasync.units import fmt_rate, parse_duration, parse_fraction, parse_rate_bps

__all__ = [
    "Cluster",
    "ClusterSpec",
    "LinkMeasurement",
    "Node",
    "down",
    "emulated",
    "launch_on_cluster",
    "parse_emulate",
    "parse_pair_rate",
]

PREFIX = "lsync"
NODE_IF = "eth0"
DELAY_IF = "dly"
_DELAY_TABLE = 100
_BLACKHOLE_TABLE = 200  # + node index: the routes out of a black-holed node
_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,24}$")
_MAX_GSO = 65536  # largest skb TCP hands a veth; queues must hold a few

# ---------------------------------------------------------------- parsing

#: --emulate keys that take a list of nodes, besides nat (:mod:`lorasync.emulate.nat`)
CONDITION_KEYS = ("symmetric_nat", "block_udp", "mtu_blackhole")
_NODE_LISTS = ("nat", *CONDITION_KEYS)

#: what tc/htb shapes, bits/s
TC_RATES_bps = (8000, 100e9)
#: the delay forwarder holds packets up to this long, one way
MAX_DELAY_S = 5.0
#: loss this high or more is no link
MAX_LOSS = 0.5


def _rate(text: str | int | float, field: str = "rate") -> int:
    """bits/s for tc: a bare number is bits/s, as in tc."""
    return int(parse_rate_bps(text, field, bare_bits=True, within_bps=TC_RATES_bps))


def _delay(text: str | int | float, field: str = "delay") -> float:
    """seconds, one way: a bare number in a string is ms, like tc; an
    int/float is seconds (``ClusterSpec.delay_s``)."""
    numeric = isinstance(text, (int, float)) and not isinstance(text, bool)
    return parse_duration(text, field, bare="s" if numeric else "ms", maximum_s=MAX_DELAY_S)


def _loss(text: str | int | float, field: str = "loss") -> float:
    return parse_fraction(text, field, below=MAX_LOSS)


def parse_pair_rate(text: str, field: str = "pair-rate") -> tuple[tuple[int, int], int]:
    """``"0-1=10mbit"`` -> ((0, 1), 10_000_000): the rate between two nodes."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*[=:]\s*(\S+)\s*", str(text))
    if not m:
        raise ConfigError(field, text, "write I-J=RATE, e.g. 0-1=10mbit")
    i, j = int(m.group(1)), int(m.group(2))
    if i == j:
        raise ConfigError(field, text, "a pair needs two different nodes")
    return (min(i, j), max(i, j)), _rate(m.group(3), field)


@dataclasses.dataclass
class ClusterSpec:
    """What to build; validated on construction."""

    nodes: int = 2
    """Number of nodes (network namespaces)."""
    rate_bps: int | None = None
    """Per-node link rate in bits/s, both directions; None = unshaped veth."""
    delay_s: float = 0.0
    """One-way delay between any two nodes (RTT = 2 x delay); needs the TUN forwarder."""
    loss: float = 0.0
    """Drop probability per packet and direction (0.001 = 0.1%)."""
    pair_rates: dict = dataclasses.field(default_factory=dict)
    """{(i, j): bits/s} with i < j: a slower link between two nodes, both directions."""
    name: str = "default"
    """Cluster name; namespaces are lsync-NAME-nodeI and lsync-NAME-hub."""
    subnet: str = "10.213.0.0/24"
    """Private subnet, used only inside the cluster's namespaces."""
    mtu: int | None = None
    """Link MTU; None = 1500, or 65000 when delay/loss needs the userspace forwarder."""
    nat: list = dataclasses.field(default_factory=list)
    """Nodes behind NAT (indices): they can connect out, nothing can connect in."""
    overlay: str | None = None
    """``"wireguard"``: every node on a WireGuard overlay; ``"ssh"``: every node
    reaches the hub over SSH (TCP); ``"auto"``: per node, what works; None: none."""
    overlay_subnet: str = "10.215.0.0/24"
    """The overlay's addresses (with ``overlay``)."""
    nat_subnet: str = "10.214.0.0/16"
    """LANs of the nodes behind NAT: node I is 10.214.I.2/24 behind router 10.214.I.1."""
    nproc_per_node: int = 1
    """Workers per node (``launch_on_cluster`` default); they share the node's namespace."""
    symmetric_nat: list = dataclasses.field(default_factory=list)
    """Nodes behind a symmetric NAT (a new outside port per destination); they are in ``nat`` too."""
    block_udp: list = dataclasses.field(default_factory=list)
    """Nodes that can send only TCP (and ICMP): UDP from them is dropped at the hub."""
    mtu_blackhole: list = dataclasses.field(default_factory=list)
    """Nodes behind a path MTU black hole: the path to and from them has MTU
    1400 and no ICMP "fragmentation needed" comes back."""

    def __post_init__(self):
        if isinstance(self.rate_bps, str):
            self.rate_bps = _rate(self.rate_bps)
        if isinstance(self.delay_s, str):
            self.delay_s = _delay(self.delay_s)
        if isinstance(self.loss, str):
            self.loss = _loss(self.loss)
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes < 1:
            raise ConfigError("nodes", self.nodes, "give a whole number of nodes, at least 1")
        if not _NAME_RE.match(str(self.name)):
            raise ConfigError("name", self.name, "use 1-24 letters, digits or '_' (no '-')")
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError:
            raise ConfigError("subnet", self.subnet, "give an IPv4 network such as 10.213.0.0/24") from None
        if not net.is_private:
            raise ConfigError("subnet", self.subnet, "use a private range such as 10.213.0.0/24")
        if self.nodes > net.num_addresses - 3:
            raise ConfigError("nodes", self.nodes, f"at most {net.num_addresses - 3} fit in {self.subnet}")
        if self.rate_bps is not None:
            self.rate_bps = _rate(self.rate_bps)
        self.delay_s = _delay(self.delay_s)
        self.loss = _loss(self.loss)
        pairs = {}
        for key, rate in dict(self.pair_rates).items():
            if isinstance(key, str):
                key = tuple(int(x) for x in key.split("-"))
            i, j = sorted(int(x) for x in key)
            if i == j or j >= self.nodes:
                raise ConfigError("pair-rate", f"{key[0]}-{key[1]}",
                                  f"name two different nodes between 0 and {self.nodes - 1}")
            pairs[(i, j)] = _rate(rate, "pair-rate")
        self.pair_rates = pairs
        if self.mtu is not None and not 576 <= int(self.mtu) <= 65000:
            raise ConfigError("mtu", self.mtu, "must be between 576 and 65000")
        for key in CONDITION_KEYS:
            setattr(self, key, sorted({_node_index(x, self.nodes, key) for x in (getattr(self, key) or [])}))
        self.nat = sorted({_node_index(x, self.nodes, "nat") for x in (self.nat or [])} | set(self.symmetric_nat))
        if self.mtu_blackhole and self.link_mtu <= _BLACKHOLE_MTU:
            raise ConfigError("mtu_blackhole", _nodes_text(self.mtu_blackhole),
                              f"the black hole's path MTU is {_BLACKHOLE_MTU}: give the links a larger "
                              f"mtu (e.g. mtu=1500), or drop mtu_blackhole")
        if self.overlay in ("", "none"):
            self.overlay = None
        if self.overlay is not None:
            from lorasync.emulate.overlay import KINDS, hub_index

            if self.overlay not in KINDS:
                raise ConfigError("overlay", self.overlay, f"use one of: {', '.join(KINDS)} (or none)")
            hub_index(self.nodes, self.nat)  # a hub outside NAT exists
            if self.block_udp and self.overlay == "wireguard":
                raise ConfigError("block_udp", _nodes_text(self.block_udp),
                                  "WireGuard runs over UDP, so those nodes cannot join a wireguard "
                                  "overlay: use overlay=auto (SSH over TCP for them), or drop "
                                  "block_udp")
        nets = {"subnet": net}
        for key in ("overlay_subnet", "nat_subnet"):
            try:
                other = ipaddress.IPv4Network(getattr(self, key))
            except ValueError:
                raise ConfigError(key, getattr(self, key), "give an IPv4 network such as 10.214.0.0/16") from None
            if not other.is_private:
                raise ConfigError(key, getattr(self, key), "use a private range")
            clash = next((k for k, n in nets.items() if n.overlaps(other)), None)
            if clash:
                raise ConfigError(key, getattr(self, key), f"overlaps {clash} {nets[clash]}: use another range")
            nets[key] = other
        if self.nat and (ipaddress.IPv4Network(self.nat_subnet).prefixlen > 16
                         or max(self.nat) > 254):
            raise ConfigError("nat_subnet", self.nat_subnet, "needs a /16 (one /24 per node behind NAT, "
                              "at most 255 nodes)")
        if not isinstance(self.nproc_per_node, int) or isinstance(self.nproc_per_node, bool) \
                or not 1 <= self.nproc_per_node <= 64:
            raise ConfigError("nproc_per_node", self.nproc_per_node,
                              "give a whole number of workers per node, 1 to 64")

    @property
    def needs_forwarder(self) -> bool:
        return self.delay_s > 0 or self.loss > 0

    @property
    def link_mtu(self) -> int:
        return int(self.mtu or (65000 if self.needs_forwarder else 1500))

    def describe(self) -> str:
        parts = [f"{self.nodes} nodes", f"rate {fmt_rate(self.rate_bps, 'tc', unit='bit')}"]
        if self.delay_s:
            parts.append(f"delay {self.delay_s * 1e3:g}ms one-way (RTT {2 * self.delay_s * 1e3:g}ms)")
        if self.loss:
            parts.append(f"loss {self.loss * 100:g}%")
        parts += [f"pair {i}-{j} {fmt_rate(r, 'tc', unit='bit')}" for (i, j), r in sorted(self.pair_rates.items())]
        plain = [i for i in self.nat if i not in self.symmetric_nat]
        if plain:
            parts.append(_nodes_text(plain, ", ") + " behind NAT")
        if self.symmetric_nat:
            parts.append(_nodes_text(self.symmetric_nat, ", ") + " behind symmetric NAT")
        if self.block_udp:
            parts.append(_nodes_text(self.block_udp, ", ") + " without UDP")
        if self.mtu_blackhole:
            parts.append(_nodes_text(self.mtu_blackhole, ", ") + f" behind a path MTU black hole "
                         f"({_BLACKHOLE_MTU})")
        if self.overlay:
            parts.append(f"{self.overlay} overlay {self.overlay_subnet}")
        if self.nproc_per_node > 1:
            parts.append(f"{self.nproc_per_node} workers per node")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pair_rates"] = {f"{i}-{j}": r for (i, j), r in self.pair_rates.items()}
        return d


def _nodes_text(indices, sep: str = "+") -> str:
    return sep.join(f"node{i}" for i in indices)


def _node_index(x, nodes: int, field: str) -> int:
    """``2``, ``"2"`` or ``"node2"`` -> 2, checked against the node count."""
    key = str(x).strip().removeprefix("node")
    if not key.isdigit():
        raise ConfigError(field, x, "name nodes as node0, node1, ... (or their indices)")
    if not 0 <= int(key) < nodes:
        raise ConfigError(field, x, f"this cluster has nodes node0..node{nodes - 1}")
    return int(key)


def parse_emulate(text: str) -> ClusterSpec:
    """``"nodes=2,rate=10mbit,delay=40ms,loss=0.1%"`` -> validated :class:`ClusterSpec`.

    Keys: nodes, rate, delay, loss, pair (``pair=0-1:10mbit``, repeatable),
    name, subnet, mtu, nat (``nat=node2``; several: ``nat=node1,node2`` or
    ``nat=node1+node2``), overlay (``overlay=wireguard``), nproc_per_node
    (workers per node, sharing its namespace), and the conditions that take
    a list of nodes like ``nat``: symmetric_nat, block_udp, mtu_blackhole.
    Errors raise ``ConfigError`` naming the key.
    """
    kw: dict = {"pair_rates": {}, "nat": [], **{k: [] for k in CONDITION_KEYS}}
    last = None
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        value = value.strip()
        if not sep and last in _NODE_LISTS and re.fullmatch(r"(node)?\d+", key):
            kw[last].append(key)  # nat=node1,node2: the list goes on
            continue
        last = key
        if not sep or not value:
            raise ConfigError("emulate", item, "write KEY=VALUE items separated by commas, "
                              "e.g. nodes=2,rate=10mbit,delay=20ms")
        if key == "nodes":
            if not value.isdigit():
                raise ConfigError("nodes", value, "give a whole number of nodes, at least 1")
            kw["nodes"] = int(value)
        elif key == "rate":
            kw["rate_bps"] = _rate(value)
        elif key == "delay":
            kw["delay_s"] = _delay(value)
        elif key == "loss":
            kw["loss"] = _loss(value)
        elif key in ("pair", "pair_rate"):
            pair, rate = parse_pair_rate(value, "pair")
            kw["pair_rates"][pair] = rate
        elif key in ("name", "subnet"):
            kw[key] = value
        elif key == "mtu":
            if not value.isdigit():
                raise ConfigError("mtu", value, "give a whole number of bytes, e.g. 1500")
            kw["mtu"] = int(value)
        elif key in _NODE_LISTS:
            kw[key] += [v for v in value.split("+") if v.strip()]
        elif key == "overlay":
            kw["overlay"] = value.lower()
        elif key == "nproc_per_node":
            if not value.isdigit():
                raise ConfigError("nproc_per_node", value, "give a whole number of workers per node")
            kw["nproc_per_node"] = int(value)
        else:
            raise ConfigError("emulate", key, "known keys: nodes, rate, delay, loss, pair, name, subnet, "
                              "mtu, nat, overlay, nproc_per_node, " + ", ".join(CONDITION_KEYS))
    return ClusterSpec(**kw)


# ---------------------------------------------------------------- host commands

def _require_host(need_tun: bool = False) -> None:
    require_root("an emulated cluster needs root (network namespaces, tc)",
                 f"run as root, e.g. {as_root('cluster up ...')}")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise EnvironmentProblem(f"'{tool}' not found: install iproute2 (apt-get install iproute2)")
    if need_tun and not os.path.exists("/dev/net/tun"):
        raise EnvironmentProblem("delay/loss needs /dev/net/tun (the kernel has no netem here "
                                 "and the delay link is a TUN forwarder): load the tun module")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise EnvironmentProblem(f"`{' '.join(argv)}` failed: {msg[-1] if msg else proc.returncode}")
    return proc


def _ns_names(name: str | None) -> list[str]:
    """Namespaces of cluster ``name`` (all lorasync clusters when None)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    pat = re.compile(rf"^{PREFIX}-{re.escape(name) if name else '[A-Za-z0-9_]+'}-(hub|node\d+|nat\d+)$")
    return [line.split()[0] for line in out.splitlines() if line.strip() and pat.match(line.split()[0])]


def _pids_in_netns(ns: str) -> list[int]:
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            s = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            pids.append(int(entry))
    return pids


def _forwarder_pids(name: str | None) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lorasync.emulate.delaylink" not in argv or b"--cluster" not in argv:
            continue
        owner = argv[argv.index(b"--cluster") + 1:][:1]
        if name is None or owner == [name.encode()]:
            pids.append(int(entry))
    return pids


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _kill(pids: Sequence[int], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace`` seconds."""
    pids = [p for p in set(pids) if p not in _ancestors()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids if pid_alive(p)]
            if not pids:
                return
            time.sleep(0.02)


#: forwarders started by this process, by pid (another process's `down` just kills them)
_FORWARDERS: dict[int, subprocess.Popen] = {}


def down(name: str | None = "default") -> list[str]:
    """Remove cluster ``name`` and any leftovers of a crashed run; idempotent.

    Kills every process inside its namespaces and its delay forwarder, deletes
    the namespaces (their links go with them) and the state file.  ``name=None``
    removes every lorasync cluster on this host.  Returns what was removed.
    """
    _require_host()
    from lorasync.emulate import overlay as cluster_overlay

    # tunnels first: their supervisors remove interfaces, sockets and nft tables themselves
    removed = cluster_overlay.remove(name)
    namespaces = _ns_names(name)
    pids = set(_forwarder_pids(name))
    for ns in namespaces:
        pids.update(_pids_in_netns(ns))
    if pids:
        _kill(sorted(pids))
        for pid in pids:  # forwarders this process started: reap them
            proc = _FORWARDERS.pop(pid, None)
            if proc is not None:
                proc.wait()
        removed += [f"process {p}" for p in sorted(pids)]
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(f"netns {ns}")
    removed += [f"cgroup {p}" for p in cpucap.leftovers(name)]  # a capped launch that was killed
    states = ([CLUSTERS_DIR / f"{name}.json", CLUSTERS_DIR / f"{name}.delaylink.log"] if name
              else [*CLUSTERS_DIR.glob("*.json"), *CLUSTERS_DIR.glob("*.delaylink.log")])
    for path in states:
        if path.exists():
            path.unlink()
            removed.append(f"state {path}")
    return removed


# ---------------------------------------------------------------- cluster


@dataclasses.dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, address and interface.

    ``address`` is the one on the node's own interface; behind NAT that is a
    LAN address nobody else can reach, and ``outside`` is the router's
    cluster address its packets leave with.  With an overlay, the node also
    has ``overlay_address`` on interface ``overlay_ifname``.
    """

    index: int
    name: str
    netns: str
    address: str
    ifname: str = NODE_IF
    nat: bool = False
    outside: str = ""
    nat_netns: str | None = None
    overlay_address: str | None = None
    overlay_ifname: str | None = None

    def __post_init__(self):
        if not self.outside:
            object.__setattr__(self, "outside", self.address)


@dataclasses.dataclass
class LinkMeasurement:
    """One short TCP measurement from node ``src`` to node ``dst``.

    ``rate_bps`` is the receiver's steady-state goodput (the first quarter
    of the transfer, TCP's ramp-up, is left out); ``rtt_s`` is the median of
    1-byte request/response round trips on a TCP_NODELAY connection.
    """

    src: int
    dst: int
    rate_bps: float
    rtt_s: float
    rtt_min_s: float
    connect_s: float
    bytes: int
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Cluster:
    """A running emulated cluster (see the module docstring for the topology)."""

    def __init__(self, spec: ClusterSpec, forwarder_pid: int | None = None, created: float | None = None,
                 node_rates: list | None = None, overlay_choice: dict | None = None):
        self.spec = spec
        self.node_rates: list[int | None] = list(node_rates or [spec.rate_bps] * spec.nodes)
        """Current rate of each node's link (``set_rate`` changes them), bits/s or None."""
        self.forwarder_pid = forwarder_pid
        self.created = created or time.time()
        net = ipaddress.IPv4Network(spec.subnet)
        hosts = list(net.hosts())
        self.hub_netns = f"{PREFIX}-{spec.name}-hub"
        self.hub_address = str(hosts[-1])
        self.overlay_choice: dict[int, dict] = {int(k): v for k, v in (overlay_choice or {}).items()}
        """Each node's overlay transport and why ({index: {transport, reason}}), once built."""
        overlay = None
        if spec.overlay:
            from lorasync.emulate.overlay import layout

            overlay = layout(spec.nodes, spec.nat, spec.overlay_subnet, spec.name,
                             {i: c["transport"] for i, c in self.overlay_choice.items()})
        self.nodes: list[Node] = []
        for i in range(spec.nodes):
            nat = i in spec.nat
            lan = list(ipaddress.IPv4Network(spec.nat_subnet).subnets(new_prefix=24))[i] if nat else None
            self.nodes.append(Node(
                i, f"node{i}", f"{PREFIX}-{spec.name}-node{i}",
                str(lan.network_address + 2) if nat else str(hosts[i]), nat=nat, outside=str(hosts[i]),
                nat_netns=f"{PREFIX}-{spec.name}-nat{i}" if nat else None,
                overlay_address=overlay[i][0] if overlay else None,
                overlay_ifname=overlay[i][1] if overlay else None))

    # -- lifecycle

    @classmethod
    def up(cls, spec: ClusterSpec) -> "Cluster":
        """Create the namespaces, links, shaping and (with delay/loss) the forwarder.

        Raises ``ConfigError`` if a cluster of that name exists and
        ``EnvironmentProblem`` without root/iproute2; on any failure whatever
        was created is removed again.
        """
        _require_host(need_tun=spec.needs_forwarder)
        if (CLUSTERS_DIR / f"{spec.name}.json").exists() or _ns_names(spec.name):
            raise ConfigError("name", spec.name, "a cluster of this name is up (or left over): run "
                              f"`lorasync cluster down --name {spec.name}` or choose another --name")
        cluster = cls(spec)
        try:
            cluster._build()
            cluster._save()
        except BaseException:
            with contextlib.suppress(Exception):
                down(spec.name)
            raise
        return cluster

    @classmethod
    def load(cls, name: str = "default") -> "Cluster":
        """The cluster ``name`` brought up by another process."""
        path = CLUSTERS_DIR / f"{name}.json"
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError("name", name, "no cluster of this name is up: run "
                              f"`lorasync cluster up --name {name} --nodes N ...`") from None
        spec = ClusterSpec(**state["spec"])
        cluster = cls(spec, state.get("forwarder_pid"), state.get("created"), state.get("node_rates"),
                      state.get("overlay_choice"))
        missing = [n.netns for n in cluster.nodes if not os.path.exists(f"/run/netns/{n.netns}")]
        if missing:
            raise EnvironmentProblem(f"cluster {name!r} is broken (namespace {missing[0]} is gone): "
                                     f"run `lorasync cluster down --name {name}` and bring it up again")
        return cluster

    def down(self) -> list[str]:
        """Remove this cluster; safe to call twice."""
        return down(self.spec.name)

    def _save(self) -> None:
        CLUSTERS_DIR.mkdir(parents=True, exist_ok=True)
        state = {"spec": self.spec.to_dict(), "forwarder_pid": self.forwarder_pid, "created": self.created,
                 "node_rates": self.node_rates, "hub_netns": self.hub_netns,
                 "overlay_choice": self.overlay_choice, "nodes": [dataclasses.asdict(n) for n in self.nodes]}
        tmp = CLUSTERS_DIR / f".{self.spec.name}.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(CLUSTERS_DIR / f"{self.spec.name}.json")

    def _build(self) -> None:
        spec, hub, mtu = self.spec, self.hub_netns, self.spec.link_mtu
        if spec.nat and not shutil.which("nft"):
            raise EnvironmentProblem("nodes behind NAT need nftables for their routers' masquerade: "
                                     "apt-get install -y nftables")
        if (spec.block_udp or spec.mtu_blackhole) and not shutil.which("nft"):
            raise EnvironmentProblem("block_udp and mtu_blackhole need nftables in the hub: "
                                     "apt-get install -y nftables")
        if spec.overlay in ("wireguard", "auto"):
            from lorasync.overlay import wireguard

            wireguard.require_tools()  # before anything is built: the install command, fast
        if spec.overlay == "ssh":
            from lorasync.overlay import sshtun

            sshtun.require_tools(server=True)
        _run(["ip", "netns", "add", hub])
        for n in self.nodes:
            _run(["ip", "netns", "add", n.netns])
        # hub routes between nodes; set defaults before links exist so they inherit them
        # (a new namespace copies the host's rp_filter, which would drop delayed packets)
        sysctls = {"net/ipv4/ip_forward": 1, "net/ipv4/conf/all/rp_filter": 0,
                   "net/ipv4/conf/default/rp_filter": 0, "net/ipv4/conf/default/proxy_arp": 1,
                   "net/ipv4/conf/all/send_redirects": 0, "net/ipv4/conf/default/send_redirects": 0,
                   "net/ipv6/conf/all/disable_ipv6": 1, "net/ipv6/conf/default/disable_ipv6": 1}
        script = "; ".join(f"echo {v} > /proc/sys/{k}" for k, v in sysctls.items())
        _run(["ip", "netns", "exec", hub, "sh", "-ec", script])
        _run(["ip", "-n", hub, "link", "set", "lo", "up"])
        prefix = ipaddress.IPv4Network(spec.subnet).prefixlen
        for n in self.nodes:
            # quiet nodes: no IPv6 chatter (router solicitations) on shaped links
            _run(["ip", "netns", "exec", n.netns, "sh", "-ec",
                  "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                  "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"])
            peer = f"p{n.index}"
            _run(["ip", "-n", n.netns, "link", "set", "lo", "up"])
            if n.nat:
                self._build_nat(n, prefix)
            else:
                # create the pair inside the namespaces: the root namespace never sees it
                _run(["ip", "-n", hub, "link", "add", peer, "mtu", str(mtu), "type", "veth",
                      "peer", "name", n.ifname, "netns", n.netns, "mtu", str(mtu)])
                _run(["ip", "-n", n.netns, "addr", "add", f"{n.address}/{prefix}", "dev", n.ifname])
                _run(["ip", "-n", n.netns, "link", "set", n.ifname, "up"])
            _run(["ip", "-n", hub, "addr", "add", f"{self.hub_address}/32", "dev", peer])
            _run(["ip", "-n", hub, "link", "set", peer, "up"])
            # a black-holed node: the hub's route to it carries the smaller MTU
            mtu_to = ["mtu", str(_BLACKHOLE_MTU)] if n.index in spec.mtu_blackhole else []
            _run(["ip", "-n", hub, "route", "add", f"{n.outside}/32", "dev", peer, *mtu_to])
        # proxy ARP answers after a random wait of up to 0.8 s by default
        # (per device only: a namespace has no neigh/default of its own)
        _run(["ip", "netns", "exec", hub, "sh", "-ec", "; ".join(
            f"echo 0 > /proc/sys/net/ipv4/neigh/p{n.index}/proxy_delay" for n in self.nodes)])
        if spec.needs_forwarder:
            self._start_forwarder()
        self._build_conditions()
        for n in self.nodes:
            self._shape(n.index)
        if spec.overlay:
            from lorasync.emulate import overlay as cluster_overlay

            self.overlay_choice = cluster_overlay.build(self)
            addrs = cluster_overlay.layout(spec.nodes, spec.nat, spec.overlay_subnet, spec.name,
                                           {i: c["transport"] for i, c in self.overlay_choice.items()})
            self.nodes = [dataclasses.replace(n, overlay_ifname=addrs[n.index][1]) for n in self.nodes]

    def _build_conditions(self) -> None:
        """block_udp and mtu_blackhole, in the hub (see :mod:`lorasync.emulate.nat`).

        The path from a black-holed node: its packets take a table of their own
        whose routes carry the smaller MTU (the forwarding path honours a
        route's MTU, and the node's own routes stay at the link's: it does not
        know).  The path to it: its route in the main table (``_build``)."""
        from lorasync.emulate.nat import conditions_ruleset

        spec, hub = self.spec, self.hub_netns
        for i in spec.mtu_blackhole:
            table = str(_BLACKHOLE_TABLE + i)
            if spec.needs_forwarder:  # first hop: into the delay forwarder
                _run(["ip", "-n", hub, "route", "add", "default", "dev", DELAY_IF, "mtu",
                      str(_BLACKHOLE_MTU), "table", table])
            else:
                for n in self.nodes:
                    if n.index != i:
                        _run(["ip", "-n", hub, "route", "add", f"{n.outside}/32", "dev", f"p{n.index}",
                              "mtu", str(_BLACKHOLE_MTU), "table", table])
            _run(["ip", "-n", hub, "rule", "add", "iif", f"p{i}", "lookup", table, "pref", "90"])
        rules = conditions_ruleset([f"p{i}" for i in spec.block_udp], bool(spec.mtu_blackhole))
        if rules:
            proc = subprocess.run(["ip", "netns", "exec", hub, "nft", "-f", "-"], input=rules,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise EnvironmentProblem(f"the hub's conditions could not be set up (nft: "
                                         f"{(proc.stderr.strip().splitlines() or ['failed'])[0]})")

    def _build_nat(self, n: Node, prefix: int) -> None:
        """Node ``n`` behind its own router: node eth0 -- lan [router] wan -- hub pI."""
        from lorasync.emulate.nat import ruleset

        r, mtu = n.nat_netns, self.spec.link_mtu
        gw = str(ipaddress.IPv4Address(n.address) - 1)
        _run(["ip", "netns", "add", r])
        _run(["ip", "netns", "exec", r, "sh", "-ec",
              "echo 1 > /proc/sys/net/ipv4/ip_forward; echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter; "
              "echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter; "
              "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
              "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"])
        _run(["ip", "-n", r, "link", "set", "lo", "up"])
        _run(["ip", "-n", self.hub_netns, "link", "add", f"p{n.index}", "mtu", str(mtu), "type", "veth",
              "peer", "name", "wan", "netns", r, "mtu", str(mtu)])
        _run(["ip", "-n", r, "link", "add", "lan", "mtu", str(mtu), "type", "veth",
              "peer", "name", n.ifname, "netns", n.netns, "mtu", str(mtu)])
        _run(["ip", "-n", r, "addr", "add", f"{n.outside}/{prefix}", "dev", "wan"])
        _run(["ip", "-n", r, "addr", "add", f"{gw}/24", "dev", "lan"])
        for dev in ("wan", "lan"):
            _run(["ip", "-n", r, "link", "set", dev, "up"])
        _run(["ip", "-n", n.netns, "addr", "add", f"{n.address}/24", "dev", n.ifname])
        _run(["ip", "-n", n.netns, "link", "set", n.ifname, "up"])
        _run(["ip", "-n", n.netns, "route", "add", "default", "via", gw])
        proc = subprocess.run(["ip", "netns", "exec", r, "nft", "-f", "-"], input=ruleset("lan", "wan", symmetric=n.index in self.spec.symmetric_nat),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise EnvironmentProblem(f"the NAT router of {n.name} could not be set up (nft: "
                                     f"{(proc.stderr.strip().splitlines() or ['failed'])[0]})")

    def _start_forwarder(self) -> None:
        spec, hub = self.spec, self.hub_netns
        CLUSTERS_DIR.mkdir(parents=True, exist_ok=True)
        log = open(CLUSTERS_DIR / f"{spec.name}.delaylink.log", "ab")
        argv = ["ip", "netns", "exec", hub, sys.executable, "-m", "lorasync.emulate.delaylink",
                "--dev", DELAY_IF, "--delay", repr(spec.delay_s), "--loss", repr(spec.loss),
                "--mtu", str(spec.link_mtu), "--cluster", spec.name]
        # its own session: a Ctrl-C in the shell that ran `up` must not kill the link
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                start_new_session=True, close_fds=True)
        log.close()
        self.forwarder_pid = proc.pid
        ready, _, _ = select.select([proc.stdout], [], [], 10.0)
        line = proc.stdout.readline().strip() if ready else b""
        proc.stdout.close()
        if line != b"ready":
            proc.kill()
            proc.wait()
            tail = (CLUSTERS_DIR / f"{spec.name}.delaylink.log").read_text(errors="replace").strip()
            raise EnvironmentProblem(f"the delay forwarder did not start: {tail.splitlines()[-1] if tail else 'no output'}")
        _FORWARDERS[proc.pid] = proc  # so that down() in this process can reap it
        _run(["ip", "-n", hub, "link", "set", DELAY_IF, "mtu", str(spec.link_mtu), "up"])
        _run(["ip", "-n", hub, "route", "add", "default", "dev", DELAY_IF, "table", str(_DELAY_TABLE)])
        for n in self.nodes:
            # packets arriving from a node detour through the forwarder; packets it
            # writes back arrive on DELAY_IF and take the main table to their node
            _run(["ip", "-n", hub, "rule", "add", "iif", f"p{n.index}", "lookup", str(_DELAY_TABLE),
                  "pref", "100"])

    # -- shaping

    def _shape(self, index: int) -> None:
        """(Re)build both ends' qdiscs of node ``index`` from ``self.spec``."""
        n, spec = self.nodes[index], self.spec
        pairs = {(j if i == index else i): r for (i, j), r in spec.pair_rates.items() if index in (i, j)}
        rate_bps = self.node_rates[index]
        # by the address the other node's packets carry (its router's, behind NAT)
        self._shape_dev(n.netns, n.ifname, rate_bps,
                        {self.nodes[j].outside: r for j, r in sorted(pairs.items())})
        self._shape_dev(self.hub_netns, f"p{index}", rate_bps, {})

    def _shape_dev(self, ns: str, dev: str, rate_bps: int | None, by_dst: dict[str, int]) -> None:
        _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        if rate_bps is None and not by_dst:
            return
        # unclassified traffic goes to 1:10 (shaped) or, unshaped, straight through (default 0)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
              "default", "10" if rate_bps else "0"])
        parent = "1:"
        if rate_bps:
            _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
                  "htb", *self._htb_args(rate_bps)])
            self._leaf(ns, dev, "1:1", 10, rate_bps)
            parent = "1:1"
        for k, (addr, prate) in enumerate(by_dst.items()):
            minor = 100 + k
            self._leaf(ns, dev, parent, minor, prate)
            _run(["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                  "prio", "1", "u32", "match", "ip", "dst", f"{addr}/32", "flowid", f"1:{minor}"])

    def _leaf(self, ns: str, dev: str, parent: str, minor: int, rate_bps: int) -> None:
        _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", parent, "classid", f"1:{minor}",
              "htb", *self._htb_args(rate_bps)])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle",
              f"{minor}:", "bfifo", "limit", str(self._queue_limit(rate_bps))])

    def _queue_limit(self, rate_bps: int) -> int:
        # a bounded queue (about 100 ms, at least a few full-size packets), as a switch
        # port has; htb's default pfifo of 1000 packets would hold seconds of data
        return max(2 * max(_MAX_GSO, self.spec.link_mtu), int(rate_bps / 8 * 0.1))

    def _htb_args(self, rate_bps: int) -> list[str]:
        # burst: 1 ms at the rate, at least one full-size packet, so fast links are not
        # held back by timer granularity and slow ones do not overshoot by much
        burst = max(self.spec.link_mtu + 100, _MAX_GSO // 2, int(rate_bps / 8 * 0.001))
        return ["rate", f"{rate_bps}bit", "ceil", f"{rate_bps}bit", "burst", str(burst), "cburst", str(burst),
                "quantum", str(min(200000, max(self.spec.link_mtu + 100, 1600)))]

    def set_rate(self, rate: str | int, node: int | str | None = None) -> None:
        """Change the node link rate live (both directions); ``node=None`` = every node.

        Connections stay open: on a shaped link only the htb classes change.
        The new rates go to the state file, so ``status`` and other processes
        see them.
        """
        bps = _rate(rate)
        targets = range(len(self.nodes)) if node is None else [self._index(node)]
        for i in targets:
            n, was = self.nodes[i], self.node_rates[i]
            self.node_rates[i] = bps
            if was is None:  # unshaped until now: build the qdiscs
                self._shape(i)
                continue
            for ns, dev in ((n.netns, n.ifname), (self.hub_netns, f"p{i}")):
                for parent, cls in (("1:", "1:1"), ("1:1", "1:10")):
                    _run(["tc", "-n", ns, "class", "change", "dev", dev, "parent", parent,
                          "classid", cls, "htb", *self._htb_args(bps)])
                _run(["tc", "-n", ns, "qdisc", "change", "dev", dev, "parent", "1:10",
                      "handle", "10:", "bfifo", "limit", str(self._queue_limit(bps))])
        if node is None:
            self.spec.rate_bps = bps
        self._save()

    # -- using it

    def _index(self, node: int | str) -> int:
        if isinstance(node, str):
            key = node.removeprefix("node")
            if not key.isdigit():
                raise ConfigError("node", node, f"give an index 0..{len(self.nodes) - 1} or a name like node0")
            node = int(key)
        if not 0 <= node < len(self.nodes):
            raise ConfigError("node", node, f"this cluster has nodes 0..{len(self.nodes) - 1}")
        return node

    def path_rate(self, src: int, dst: int) -> int | None:
        """Configured rate from ``src`` to ``dst`` (bits/s): the slowest of both node
        links and any pair rate between them; None when unshaped."""
        rates = [self.node_rates[src], self.node_rates[dst],
                 self.spec.pair_rates.get((min(src, dst), max(src, dst)))]
        rates = [r for r in rates if r]
        return min(rates) if rates else None

    def node(self, node: int | str) -> Node:
        """Node by index or name (``0`` or ``"node0"``)."""
        return self.nodes[self._index(node)]

    def exec_argv(self, node: int | str, argv: Sequence[str]) -> list[str]:
        """``["ip", "netns", "exec", NETNS, *argv]``: run ``argv`` inside node ``node``."""
        return ["ip", "netns", "exec", self.node(node).netns, *argv]

    def measure(self, src: int = 0, dst: int = 1, seconds: float = 1.0,
                max_bytes: int = 256 << 20, overlay: bool = False) -> LinkMeasurement:
        """Short TCP test from ``src`` to ``dst``: RTT, then bulk data for ``seconds``
        or ``max_bytes``, whichever ends first; ``overlay``: between the nodes'
        overlay addresses (through the tunnels).

        Takes about ``seconds`` plus process start-up (0.3 s): the two ends of
        :mod:`lorasync.overlay.linktest` run inside the namespaces, no extra tools.
        """
        s, d = self.node(src), self.node(dst)
        if overlay and not d.overlay_address:
            raise ConfigError("overlay", True, "this cluster has no overlay: bring it up with "
                              "overlay=wireguard (--overlay wireguard)")
        if d.nat and not overlay:
            raise ConfigError("dst", d.name, "is behind NAT: nothing can connect to it; measure "
                              f"from it ({d.name} -> another node) or through the overlay")
        addr = d.overlay_address if overlay else d.address
        py = [sys.executable, "-m", "lorasync.overlay.linktest"]
        server = subprocess.Popen(self.exec_argv(d.index, [*py, "serve", addr, str(seconds),
                                                                 str(int(max_bytes))]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([server.stdout], [], [], 10.0)
            port = server.stdout.readline().strip() if ready else ""
            if not port.isdigit():
                raise EnvironmentProblem(f"measurement server in {d.netns} did not start: "
                                         f"{server.stderr.read() if server.poll() is not None else 'timeout'}")
            client = subprocess.run(self.exec_argv(s.index, [*py, "measure", addr, port, str(seconds)]),
                                    capture_output=True, text=True, timeout=seconds + 30)
            if client.returncode != 0:
                raise EnvironmentProblem(f"measurement {s.name} -> {d.name} failed: "
                                         f"{client.stderr.strip().splitlines()[-1:]}")
            r = json.loads(client.stdout)
        finally:
            if server.poll() is None:
                server.kill()
            server.communicate()
        return LinkMeasurement(src=s.index, dst=d.index, rate_bps=r["rate_bps"], rtt_s=r["rtt_s"],
                               rtt_min_s=r["rtt_min_s"], connect_s=r["connect_s"], bytes=r["bytes"],
                               seconds=r["seconds"])

    def measured_pair(self) -> tuple[int, int, bool] | None:
        """(src, dst, through the overlay) that ``status`` measures: node0 -> node1,
        through the overlay when there is one; without it nothing connects to a
        node behind NAT, so towards the first node outside NAT (None: none is)."""
        if self.spec.overlay:
            return 0, 1, True
        if not self.nodes[1].nat:
            return 0, 1, False
        dst = next((n.index for n in self.nodes if not n.nat), None)
        if dst is None:
            return None
        return (1 if dst == 0 else 0), dst, False

    @property
    def overlay_hub(self) -> Node | None:
        """The overlay's hub node (the rendezvous host over the overlay)."""
        if not self.spec.overlay:
            return None
        from lorasync.emulate.overlay import hub_index

        return self.nodes[hub_index(len(self.nodes), self.spec.nat)]

    def status(self, measure: bool = True, seconds: float = 1.0) -> dict:
        """Configuration, and (``measure``) a measurement node0 -> node1 (see
        :meth:`measured_pair`)."""
        rates = self.node_rates
        out = {
            "name": self.spec.name, "spec": self.spec.to_dict(), "created": self.created,
            "hub_netns": self.hub_netns,
            "topology": "routed hub" + (f" + delay forwarder (TUN {DELAY_IF}, pid {self.forwarder_pid})"
                                        if self.spec.needs_forwarder else ""),
            "forwarder_pid": self.forwarder_pid,
            "forwarder_alive": bool(self.forwarder_pid) and pid_alive(self.forwarder_pid),
            "nodes": [dict(dataclasses.asdict(n), rate_bps=rates[n.index]) for n in self.nodes],
            # for the path measured below (node0 -> node1), pair rate included
            "configured": {"rate_bps": self.path_rate(0, 1) if len(self.nodes) > 1 else self.node_rates[0],
                           "delay_s": self.spec.delay_s,
                           "rtt_s": 2 * self.spec.delay_s, "loss": self.spec.loss},
        }
        if self.spec.nat:
            out["nat"] = [{"node": n.name, "router_netns": n.nat_netns, "lan_address": n.address,
                           "outside_address": n.outside} for n in self.nodes if n.nat]
        if self.spec.overlay:
            from lorasync.overlay import tunnel

            out["overlay"] = {"kind": self.spec.overlay, "subnet": self.spec.overlay_subnet,
                              "hub": self.overlay_hub.name,
                              "nodes": [{"node": n.name, "address": n.overlay_address,
                                         "ifname": n.overlay_ifname,
                                         **self.overlay_choice.get(n.index, {})} for n in self.nodes],
                              "tunnels": tunnel.status(cluster=self.spec.name, measure=False)}
        pair = self.measured_pair() if len(self.nodes) >= 2 else None
        if measure and pair:
            src, dst, over = pair
            out["measured"] = dict(self.measure(src, dst, seconds, overlay=over).to_dict(), overlay=over)
        return out


@contextlib.contextmanager
def emulated(spec: ClusterSpec | str) -> Iterator[Cluster]:
    """``with emulated(parse_emulate("nodes=2,rate=10mbit")) as c:`` -- always taken down."""
    if isinstance(spec, str):
        spec = parse_emulate(spec)
    restore = _unwind_on_sigterm()
    try:
        cluster = Cluster.up(spec)
        try:
            yield cluster
        finally:
            cluster.down()
    finally:
        restore()


def _unwind_on_sigterm() -> Callable[[], None]:
    """In a program that left SIGTERM at its default (the bench scripts), make
    it unwind while a cluster is up (``SystemExit(143)``, as the CLI does), so
    ``finally`` takes the cluster down; the default would end the process with
    namespaces, shapers and forwarders left behind.  Returns what restores
    the old handler."""
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def _later(signum, frame):
        pass

    def _term(signum, frame):
        # once: a second SIGTERM must not interrupt the teardown this one starts
        # (processes killed, namespaces not yet deleted).  Not SIG_IGN, which
        # the commands run during teardown would inherit.
        signal.signal(signal.SIGTERM, _later)
        raise SystemExit(128 + signum)

    def restore() -> None:
        # only our own handler: one the body installed meanwhile stays
        if signal.getsignal(signal.SIGTERM) in (_term, _later):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, _term)
    return restore


# ---------------------------------------------------------------- launching


def _descendants(roots: Sequence[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _agent_route(cluster: Cluster, overlay: bool | None) -> tuple[Node, dict[int, tuple[str, str]], bool]:
    """(rendezvous host, {node: (address, interface)}, over the overlay) for a launch."""
    use = bool(cluster.spec.overlay) if overlay is None else overlay
    if use and not cluster.spec.overlay:
        raise ConfigError("overlay", True, "this cluster has no overlay (bring it up with overlay=wireguard)")
    if use:
        return cluster.overlay_hub, {n.index: (n.overlay_address, n.overlay_ifname) for n in cluster.nodes}, True
    return cluster.nodes[0], {n.index: (n.address, n.ifname) for n in cluster.nodes}, False


def launch_on_cluster(cluster: Cluster, argv: Sequence[str], nproc_per_node: int | None = None,
                      timeout: float | None = None, *, module: str | None = "lorasync",
                      port: int = 29400, env: dict | None = None, log_dir: str | Path | None = None,
                      fail_grace: float = 10.0, overlay: bool | None = None,
                      reach_timeout: float = 5.0, max_restarts: int = 0,
                      min_nodes: int | None = None, last_call_s: float | None = None,
                      cpu_cap: float | None = None) -> int:
    """Run one torchrun agent per node, each in its namespace; return an exit code.

    ``nproc_per_node`` workers per agent (default: the spec's); the workers of
    one node share its namespace, so their traffic to each other is local.

    Each node runs torchrun (``torch.distributed.run``, through
    :mod:`lorasync.launch.agent`) ``--nnodes N --node-rank I --nproc-per-node P
    --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m MODULE ARGV``; with
    ``module=None`` ``argv`` is what follows the torchrun options as is (a
    script path and its arguments).  The workers get
    ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = the node's interface (gloo
    would otherwise bind to what the hostname resolves to, 127.0.0.1),
    ``OMP_NUM_THREADS=1`` (a script of its own, ``module=None``: unless the
    environment sets it) and ``PYTHONUNBUFFERED=1``; with ``module=None`` the
    job's store secret is kept from them (torch's plain store client could not
    pass a guarded store).  Output goes to our
    stdout/stderr, or to ``log_dir/nodeI.log``.

    HOST is node0, or with the cluster's overlay (``overlay=None``: whenever it
    has one) the overlay's hub: then addresses and interfaces are the overlay's
    and the c10d stores listen on the overlay address only.  After the
    rendezvous the agents check that every node can connect to every other
    (``reach_timeout`` s per connection, 0 = no check) and stop with a message
    naming the unreachable node instead of letting gloo retry until its timeout.

    Returns 0 if all succeed, else 2 if any agent returned 2, else the first
    non-zero code.  After a failure the others get ``fail_grace`` seconds,
    then everything is killed; also on ``timeout`` (returns 124) and Ctrl-C.

    ``max_restarts``: torchrun restarts the worker group that many times after
    a failure (with a fresh c10d store per round, see lorasync.launch).
    ``min_nodes`` (elastic, ``--nnodes MIN:N``): an agent that dies is not a
    failure while at least ``min_nodes`` agents still run; the run succeeds
    when those do.
    ``last_call_s``: how long a rendezvous that has ``min_nodes`` waits for
    the others (torch's ``last_call_timeout``, 30 s by default): the time
    the survivors give a lost node to come back before going on without it.
    ``cpu_cap``: hold the agents and their workers, all nodes together, to that
    many of this host's cores (:mod:`lorasync.emulate.cpucap`), leaving the
    rest to the cluster's helpers (tunnel daemons).
    """
    nn = len(cluster.nodes)
    if nproc_per_node is None:
        nproc_per_node = cluster.spec.nproc_per_node
    host, route, over = _agent_route(cluster, overlay)
    endpoint = f"{route[host.index][0]}:{port}"
    rdzv_id = f"lsync-{uuid.uuid4().hex[:8]}"
    base_env = dict(os.environ if env is None else env)
    if module == "lorasync" or not base_env.get("OMP_NUM_THREADS"):
        # every node's workers share this machine's cores; a script keeps its caller's choice
        base_env["OMP_NUM_THREADS"] = "1"
    base_env["PYTHONUNBUFFERED"] = "1"
    if module == "lorasync":
        # every node's agent guards its stores with the launch's own secret; a
        # script of its own (module=None) creates its store with torch's plain
        # client, which a guarded store would refuse: its stores stay on the
        # nodes' addresses, inside the emulated network
        from lorasync.launch.guard import ENV as SECRET_ENV, new_secret
        base_env.setdefault(SECRET_ENV, new_secret())
    else:
        # nor may a secret the caller's environment holds reach the agents: the
        # script's workers would meet a guarded agent store with a plain client
        from lorasync.launch.guard import ENV as SECRET_ENV, FILE_ENV
        from lorasync.launch.stores import GUARD_ENV
        for k in (SECRET_ENV, FILE_ENV, GUARD_ENV):
            base_env.pop(k, None)
    from lorasync.launch import restart_env
    nnodes = f"{min_nodes}:{nn}" if min_nodes else str(nn)
    base_env.update(restart_env(max_restarts, nnodes))
    procs: list[subprocess.Popen] = []
    logs = []
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    stack = contextlib.ExitStack()
    try:
        cap = stack.enter_context(cpucap.cpu_cap(cpu_cap, cluster.spec.name)) if cpu_cap else None
        for n in cluster.nodes:
            addr, ifname = route[n.index]
            cmd = agent_argv(sys.executable, label=n.name, store_addr=addr,
                             reach_timeout=reach_timeout, rdzv_wait=20.0)
            cmd += ["--nnodes", nnodes,
                    "--node-rank", str(n.index), "--nproc-per-node", str(nproc_per_node),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                    # HOST hosts the rendezvous store; torch's own guess compares
                    # hostnames, which are the same in every namespace
                    "--rdzv-conf", f"is_host={1 if n.index == host.index else 0}"
                    + (f",last_call_timeout={last_call_s:g}" if last_call_s else ""),
                    "--local-addr", addr, "--max-restarts", str(max_restarts)]
            cmd += ["-m", module, *argv] if module else list(argv)
            e = dict(base_env, GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname,
                     LORASYNC_RDZV_ENDPOINT=endpoint)
            out = None
            if log_dir is not None:
                out = open(Path(log_dir) / f"{n.name}.log", "wb")
                logs.append(out)
            procs.append(subprocess.Popen(cluster.exec_argv(n.index, cmd), env=e, stdout=out,
                                          stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True,
                                          preexec_fn=cap.enter if cap else None))
        deadline = None if timeout is None else time.monotonic() + timeout
        first_bad: int | None = None
        bad_since = None
        lost: set[int] = set()
        while [p.poll() for p in procs].count(None):  # poll every agent, no short-circuit
            if min_nodes and [p.returncode for p in procs].count(None) >= min_nodes:
                # a node lost while enough others run is survivable (elastic)
                lost |= {i for i, p in enumerate(procs) if p.returncode not in (None, 0, 2)}
            codes = [p.returncode for i, p in enumerate(procs)
                     if p.returncode not in (None, 0) and i not in lost]
            if codes and first_bad is None:
                first_bad, bad_since = codes[0], time.monotonic()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                _stop_agents(procs)
                return 124
            if bad_since is not None and now - bad_since > fail_grace:
                _stop_agents(procs)
                break
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
        if 2 in codes:
            return 2
        if first_bad is not None:
            return first_bad
        if min_nodes and codes.count(0) >= min_nodes and all(
                c == 0 for i, c in enumerate(codes) if i not in lost):
            return 0
        return next((c if c > 0 else 128 - c for c in codes if c != 0), 0)
    except BaseException:
        _stop_agents(procs)
        raise
    finally:
        for f in logs:
            f.close()
        stack.close()


def _stop_agents(procs: Sequence[subprocess.Popen]) -> None:
    """Terminate agents and everything they started (workers run in their own sessions)."""
    live = [p.pid for p in procs if p.poll() is None]
    tree = _descendants(live) | set(live)
    for pid in live:  # an agent on SIGTERM stops its workers itself
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    # an agent blocked in a store call (e.g. its exit barrier) only sees SIGTERM late
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and [p.poll() for p in procs].count(None):
        time.sleep(0.05)
    _kill([p for p in tree if pid_alive(p)], grace=1.0)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=5)
