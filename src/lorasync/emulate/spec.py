"""What an emulated cluster is made of: :class:`ClusterSpec` (nodes, link
rates, delay, loss, NAT and the other per-node conditions, the overlay),
validated on construction, and :func:`parse_emulate`, the ``--emulate
nodes=2,rate=10mbit,...`` text that ``lorasync train``, ``lorasync cluster
launch`` and the benches take.

Pure: nothing here touches the host; :mod:`lorasync.emulate.cluster` builds
what a spec describes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re

from lorasync.emulate.nat import BLACKHOLE_MTU as _BLACKHOLE_MTU
from lorasync.errors import ConfigError
from lorasync.units import fmt_rate, parse_duration, parse_fraction, parse_rate_bps

__all__ = [
    "CONDITION_KEYS",
    "ClusterSpec",
    "MAX_DELAY_S",
    "MAX_LOSS",
    "TC_RATES_bps",
    "parse_emulate",
    "parse_pair_rate",
    "tc_rate",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,24}$")

#: --emulate keys that take a list of nodes, besides nat (:mod:`lorasync.emulate.nat`)
CONDITION_KEYS = ("symmetric_nat", "block_udp", "mtu_blackhole")
_NODE_LISTS = ("nat", *CONDITION_KEYS)

#: what tc/htb shapes, bits/s
TC_RATES_bps = (8000, 100e9)
#: the delay forwarder holds packets up to this long, one way
MAX_DELAY_S = 5.0
#: loss this high or more is no link
MAX_LOSS = 0.5


def tc_rate(text: str | int | float, field: str = "rate") -> int:
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
    return (min(i, j), max(i, j)), tc_rate(m.group(3), field)


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
            self.rate_bps = tc_rate(self.rate_bps)
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
            self.rate_bps = tc_rate(self.rate_bps)
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
            pairs[(i, j)] = tc_rate(rate, "pair-rate")
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
            kw["rate_bps"] = tc_rate(value)
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

