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
:mod:`lorasync.net.delaylink` process (a daemon started by ``up`` and killed
by ``down``), which holds it ``delay`` seconds, drops it with probability
``loss`` and writes it back; the hub then routes it to the destination.  Each
packet crosses it once: one-way delay = ``delay``, RTT = 2 x ``delay``.  The
forwarder is one Python process for the whole cluster (measured here: about
60 MB/s in total at MTU 65000), so links with delay default to MTU 65000.

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
from typing import Iterator, Sequence

from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.units import fmt_rate, parse_duration, parse_rate_bps

__all__ = [
    "Cluster",
    "ClusterSpec",
    "LinkMeasurement",
    "Node",
    "down",
    "emulated",
    "launch_on_cluster",
    "parse_delay",
    "parse_emulate",
    "parse_loss",
    "parse_rate",
]

PREFIX = "lsync"
STATE_DIR = Path(os.environ.get("LORASYNC_STATE_DIR", "/run/lorasync/clusters"))
NODE_IF = "eth0"
DELAY_IF = "dly"
_DELAY_TABLE = 100
_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,24}$")
_MAX_GSO = 65536  # largest skb TCP hands a veth; queues must hold a few

# ---------------------------------------------------------------- parsing

def parse_rate(text: str | int | float, field: str = "rate") -> int:
    """``"100mbit"`` -> 100_000_000 (bits/s), for tc.

    The units are :mod:`lorasync.units`' (the same for every command;
    ``mbps`` is refused as ambiguous); as in tc a bare number is bits/s.
    Only the range is this module's: tc/htb shapes 8kbit..100gbit.
    """
    value = parse_rate_bps(text, field, bare_bits=True)
    if not 8000 <= value <= 100e9:
        raise ConfigError(field, text, "must be between 8kbit and 100gbit")
    return int(value)


def parse_delay(text: str | int | float, field: str = "delay") -> float:
    """``"20ms"`` -> 0.02 (seconds), units as :func:`lorasync.units.parse_duration`;
    a bare number in a string is ms, like tc; an int/float is seconds (``ClusterSpec.delay_s``).
    """
    numeric = isinstance(text, (int, float)) and not isinstance(text, bool)
    value = parse_duration(text, field, bare="s" if numeric else "ms")
    if not 0 <= value <= 5:
        raise ConfigError(field, text, "must be between 0 and 5s")
    return value


def parse_loss(text: str | int | float, field: str = "loss") -> float:
    """``"0.1%"`` -> 0.001 (probability per packet); a percent sign is required."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)%", s)
        if m:
            value = float(m.group(1)) / 100
        elif re.fullmatch(r"0*\.?0*", s) and s:
            value = 0.0
        else:
            raise ConfigError(field, text, "write a percentage such as 0.1% or 1%")
    if not 0 <= value < 0.5:
        raise ConfigError(field, text, "must be at least 0% and below 50%")
    return value


def _parse_pair(text: str, field: str = "pair-rate") -> tuple[tuple[int, int], int]:
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*[=:]\s*(\S+)\s*", str(text))
    if not m:
        raise ConfigError(field, text, "write I-J=RATE, e.g. 0-1=10mbit")
    i, j = int(m.group(1)), int(m.group(2))
    if i == j:
        raise ConfigError(field, text, "a pair needs two different nodes")
    return (min(i, j), max(i, j)), parse_rate(m.group(3), field)


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
    nproc_per_node: int = 1
    """Workers per node (``launch_on_cluster`` default); they share the node's namespace."""

    def __post_init__(self):
        if isinstance(self.rate_bps, str):
            self.rate_bps = parse_rate(self.rate_bps)
        if isinstance(self.delay_s, str):
            self.delay_s = parse_delay(self.delay_s)
        if isinstance(self.loss, str):
            self.loss = parse_loss(self.loss)
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
            self.rate_bps = parse_rate(self.rate_bps)
        self.delay_s = parse_delay(self.delay_s)
        self.loss = parse_loss(self.loss)
        pairs = {}
        for key, rate in dict(self.pair_rates).items():
            if isinstance(key, str):
                key = tuple(int(x) for x in key.split("-"))
            i, j = sorted(int(x) for x in key)
            if i == j or j >= self.nodes:
                raise ConfigError("pair-rate", f"{key[0]}-{key[1]}",
                                  f"name two different nodes between 0 and {self.nodes - 1}")
            pairs[(i, j)] = parse_rate(rate, "pair-rate")
        self.pair_rates = pairs
        if self.mtu is not None and not 576 <= int(self.mtu) <= 65000:
            raise ConfigError("mtu", self.mtu, "must be between 576 and 65000")
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
        if self.nproc_per_node > 1:
            parts.append(f"{self.nproc_per_node} workers per node")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pair_rates"] = {f"{i}-{j}": r for (i, j), r in self.pair_rates.items()}
        return d


def parse_emulate(text: str) -> ClusterSpec:
    """``"nodes=2,rate=10mbit,delay=40ms,loss=0.1%"`` -> validated :class:`ClusterSpec`.

    Keys: nodes, rate, delay, loss, pair (``pair=0-1:10mbit``, repeatable),
    name, subnet, mtu, nproc_per_node (workers per node, sharing its
    namespace).  Errors raise ``ConfigError`` naming the key.
    """
    kw: dict = {"pair_rates": {}}
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        value = value.strip()
        if not sep or not value:
            raise ConfigError("emulate", item, "write KEY=VALUE items separated by commas, "
                              "e.g. nodes=2,rate=10mbit,delay=20ms")
        if key == "nodes":
            if not value.isdigit():
                raise ConfigError("nodes", value, "give a whole number of nodes, at least 1")
            kw["nodes"] = int(value)
        elif key == "rate":
            kw["rate_bps"] = parse_rate(value)
        elif key == "delay":
            kw["delay_s"] = parse_delay(value)
        elif key == "loss":
            kw["loss"] = parse_loss(value)
        elif key in ("pair", "pair_rate"):
            pair, rate = _parse_pair(value, "pair")
            kw["pair_rates"][pair] = rate
        elif key in ("name", "subnet"):
            kw[key] = value
        elif key == "mtu":
            if not value.isdigit():
                raise ConfigError("mtu", value, "give a whole number of bytes, e.g. 1500")
            kw["mtu"] = int(value)
        elif key == "nproc_per_node":
            if not value.isdigit():
                raise ConfigError("nproc_per_node", value, "give a whole number of workers per node")
            kw["nproc_per_node"] = int(value)
        else:
            raise ConfigError("emulate", key, "known keys: nodes, rate, delay, loss, pair, name, subnet, "
                              "mtu, nproc_per_node")
    return ClusterSpec(**kw)


# ---------------------------------------------------------------- host commands

def _require_host(need_tun: bool = False) -> None:
    if os.geteuid() != 0:
        raise EnvironmentProblem("an emulated cluster needs root (network namespaces, tc): "
                                 "run as root, e.g. sudo lorasync cluster up ...")
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
    pat = re.compile(rf"^{PREFIX}-{re.escape(name) if name else '[A-Za-z0-9_]+'}-(hub|node\d+)$")
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
        if b"lorasync.net.delaylink" not in argv or b"--cluster" not in argv:
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
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone; it is its parent's to reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


#: forwarders started by this process, by pid (another process's `down` just kills them)
_FORWARDERS: dict[int, subprocess.Popen] = {}


def down(name: str | None = "default") -> list[str]:
    """Remove cluster ``name`` and any leftovers of a crashed run; idempotent.

    Kills every process inside its namespaces and its delay forwarder, deletes
    the namespaces (their links go with them) and the state file.  ``name=None``
    removes every lorasync cluster on this host.  Returns what was removed.
    """
    _require_host()
    removed = []
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
    states = ([STATE_DIR / f"{name}.json", STATE_DIR / f"{name}.delaylink.log"] if name
              else [*STATE_DIR.glob("*.json"), *STATE_DIR.glob("*.delaylink.log")])
    for path in states:
        if path.exists():
            path.unlink()
            removed.append(f"state {path}")
    return removed


# ---------------------------------------------------------------- cluster


@dataclasses.dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, address and interface."""

    index: int
    name: str
    netns: str
    address: str
    ifname: str = NODE_IF


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
                 node_rates: list | None = None):
        self.spec = spec
        self.node_rates: list[int | None] = list(node_rates or [spec.rate_bps] * spec.nodes)
        """Current rate of each node's link (``set_rate`` changes them), bits/s or None."""
        self.forwarder_pid = forwarder_pid
        self.created = created or time.time()
        net = ipaddress.IPv4Network(spec.subnet)
        hosts = list(net.hosts())
        self.hub_netns = f"{PREFIX}-{spec.name}-hub"
        self.hub_address = str(hosts[-1])
        self.nodes: list[Node] = [
            Node(i, f"node{i}", f"{PREFIX}-{spec.name}-node{i}", str(hosts[i])) for i in range(spec.nodes)
        ]

    # -- lifecycle

    @classmethod
    def up(cls, spec: ClusterSpec) -> "Cluster":
        """Create the namespaces, links, shaping and (with delay/loss) the forwarder.

        Raises ``ConfigError`` if a cluster of that name exists and
        ``EnvironmentProblem`` without root/iproute2; on any failure whatever
        was created is removed again.
        """
        _require_host(need_tun=spec.needs_forwarder)
        if (STATE_DIR / f"{spec.name}.json").exists() or _ns_names(spec.name):
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
        path = STATE_DIR / f"{name}.json"
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError("name", name, "no cluster of this name is up: run "
                              f"`lorasync cluster up --name {name} --nodes N ...`") from None
        spec = ClusterSpec(**state["spec"])
        cluster = cls(spec, state.get("forwarder_pid"), state.get("created"), state.get("node_rates"))
        missing = [n.netns for n in cluster.nodes if not os.path.exists(f"/run/netns/{n.netns}")]
        if missing:
            raise EnvironmentProblem(f"cluster {name!r} is broken (namespace {missing[0]} is gone): "
                                     f"run `lorasync cluster down --name {name}` and bring it up again")
        return cluster

    def down(self) -> list[str]:
        """Remove this cluster; safe to call twice."""
        return down(self.spec.name)

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"spec": self.spec.to_dict(), "forwarder_pid": self.forwarder_pid, "created": self.created,
                 "node_rates": self.node_rates, "hub_netns": self.hub_netns, "nodes": [dataclasses.asdict(n) for n in self.nodes]}
        tmp = STATE_DIR / f".{self.spec.name}.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(STATE_DIR / f"{self.spec.name}.json")

    def _build(self) -> None:
        spec, hub, mtu = self.spec, self.hub_netns, self.spec.link_mtu
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
            # create the pair inside the namespaces: the root namespace never sees it
            _run(["ip", "-n", hub, "link", "add", peer, "mtu", str(mtu), "type", "veth",
                  "peer", "name", n.ifname, "netns", n.netns, "mtu", str(mtu)])
            _run(["ip", "-n", n.netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", n.netns, "addr", "add", f"{n.address}/{prefix}", "dev", n.ifname])
            _run(["ip", "-n", n.netns, "link", "set", n.ifname, "up"])
            _run(["ip", "-n", hub, "addr", "add", f"{self.hub_address}/32", "dev", peer])
            _run(["ip", "-n", hub, "link", "set", peer, "up"])
            _run(["ip", "-n", hub, "route", "add", f"{n.address}/32", "dev", peer])
        # proxy ARP answers after a random wait of up to 0.8 s by default
        # (per device only: a namespace has no neigh/default of its own)
        _run(["ip", "netns", "exec", hub, "sh", "-ec", "; ".join(
            f"echo 0 > /proc/sys/net/ipv4/neigh/p{n.index}/proxy_delay" for n in self.nodes)])
        if spec.needs_forwarder:
            self._start_forwarder()
        for n in self.nodes:
            self._shape(n.index)

    def _start_forwarder(self) -> None:
        spec, hub = self.spec, self.hub_netns
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        log = open(STATE_DIR / f"{spec.name}.delaylink.log", "ab")
        argv = ["ip", "netns", "exec", hub, sys.executable, "-m", "lorasync.net.delaylink",
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
            tail = (STATE_DIR / f"{spec.name}.delaylink.log").read_text(errors="replace").strip()
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
        rate = self.node_rates[index]
        self._shape_dev(n.netns, n.ifname, rate, {self.nodes[j].address: r for j, r in sorted(pairs.items())})
        self._shape_dev(self.hub_netns, f"p{index}", rate, {})

    def _shape_dev(self, ns: str, dev: str, rate: int | None, by_dst: dict[str, int]) -> None:
        _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        if rate is None and not by_dst:
            return
        # unclassified traffic goes to 1:10 (shaped) or, unshaped, straight through (default 0)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
              "default", "10" if rate else "0"])
        parent = "1:"
        if rate:
            _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
                  "htb", *self._htb_args(rate)])
            self._leaf(ns, dev, "1:1", 10, rate)
            parent = "1:1"
        for k, (addr, prate) in enumerate(by_dst.items()):
            minor = 100 + k
            self._leaf(ns, dev, parent, minor, prate)
            _run(["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                  "prio", "1", "u32", "match", "ip", "dst", f"{addr}/32", "flowid", f"1:{minor}"])

    def _leaf(self, ns: str, dev: str, parent: str, minor: int, rate: int) -> None:
        _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", parent, "classid", f"1:{minor}",
              "htb", *self._htb_args(rate)])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle",
              f"{minor}:", "bfifo", "limit", str(self._queue_limit(rate))])

    def _queue_limit(self, rate: int) -> int:
        # a bounded queue (about 100 ms, at least a few full-size packets), as a switch
        # port has; htb's default pfifo of 1000 packets would hold seconds of data
        return max(2 * max(_MAX_GSO, self.spec.link_mtu), int(rate / 8 * 0.1))

    def _htb_args(self, rate: int) -> list[str]:
        # burst: 1 ms at rate, at least one full-size packet, so fast links are not
        # held back by timer granularity and slow ones do not overshoot by much
        burst = max(self.spec.link_mtu + 100, _MAX_GSO // 2, int(rate / 8 * 0.001))
        return ["rate", f"{rate}bit", "ceil", f"{rate}bit", "burst", str(burst), "cburst", str(burst),
                "quantum", str(min(200000, max(self.spec.link_mtu + 100, 1600)))]

    def set_rate(self, rate: str | int, node: int | str | None = None) -> None:
        """Change the node link rate live (both directions); ``node=None`` = every node.

        Connections stay open: on a shaped link only the htb classes change.
        The new rates go to the state file, so ``status`` and other processes
        see them.
        """
        bps = parse_rate(rate)
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
                max_bytes: int = 256 << 20) -> LinkMeasurement:
        """Short TCP test from ``src`` to ``dst``: RTT, then bulk data for ``seconds``
        or ``max_bytes``, whichever ends first.

        Takes about ``seconds`` plus process start-up (0.3 s); run with
        Python's socket module inside the namespaces, no extra tools.
        """
        s, d = self.node(src), self.node(dst)
        py = [sys.executable, "-S", "-c"]
        server = subprocess.Popen(self.exec_argv(d.index, [*py, _SERVER, d.address, str(seconds),
                                                                 str(int(max_bytes))]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([server.stdout], [], [], 10.0)
            port = server.stdout.readline().strip() if ready else ""
            if not port.isdigit():
                raise EnvironmentProblem(f"measurement server in {d.netns} did not start: "
                                         f"{server.stderr.read() if server.poll() is not None else 'timeout'}")
            client = subprocess.run(self.exec_argv(s.index, [*py, _CLIENT, d.address, port, str(seconds)]),
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

    def status(self, measure: bool = True, seconds: float = 1.0) -> dict:
        """Configuration, and (``measure``) a measurement node0 -> node1."""
        rates = self.node_rates
        out = {
            "name": self.spec.name, "spec": self.spec.to_dict(), "created": self.created,
            "hub_netns": self.hub_netns,
            "topology": "routed hub" + (f" + delay forwarder (TUN {DELAY_IF}, pid {self.forwarder_pid})"
                                        if self.spec.needs_forwarder else ""),
            "forwarder_pid": self.forwarder_pid,
            "forwarder_alive": bool(self.forwarder_pid) and _alive(self.forwarder_pid),
            "nodes": [dict(dataclasses.asdict(n), rate_bps=rates[n.index]) for n in self.nodes],
            # for the path measured below (node0 -> node1), pair rate included
            "configured": {"rate_bps": self.path_rate(0, 1) if len(self.nodes) > 1 else self.node_rates[0],
                           "delay_s": self.spec.delay_s,
                           "rtt_s": 2 * self.spec.delay_s, "loss": self.spec.loss},
        }
        if measure and len(self.nodes) >= 2:
            out["measured"] = self.measure(0, 1, seconds).to_dict()
        return out


_SERVER = r"""
import json, socket, sys, time
addr, window, max_bytes = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
srv = socket.socket(); srv.bind((addr, 0)); srv.listen(8); srv.settimeout(window + 20)
print(srv.getsockname()[1], flush=True)
while True:
    c, _ = srv.accept(); c.settimeout(window + 20)
    mode = c.recv(1)
    if mode == b"p":  # echo single bytes until EOF
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            b = c.recv(1)
            if not b: break
            c.sendall(b)
        c.close(); continue
    buf = bytearray(1 << 20); n = 0; marks = []; t0 = None
    while True:
        k = c.recv_into(buf)
        if not k: break
        now = time.monotonic(); n += k
        if t0 is None: t0 = now
        if not marks or now - marks[-1][0] >= 0.005: marks.append((now, n))
        if now - t0 >= window or n >= max_bytes: break
    marks.append((time.monotonic(), n))
    ws = t0 + 0.25 * (marks[-1][0] - t0)  # leave out TCP's ramp-up
    a = next(m for m in marks if m[0] >= ws)
    dt = marks[-1][0] - a[0]
    rate = (marks[-1][1] - a[1]) * 8 / dt if dt > 0 else 0.0
    c.sendall(json.dumps({"bytes": n, "seconds": marks[-1][0] - t0, "rate_bps": rate}).encode() + b"\n")
    c.settimeout(5)
    try:
        while c.recv_into(buf): pass
    except OSError: pass
    c.close(); break
"""

_CLIENT = r"""
import json, select, socket, statistics, struct, sys, time
addr, port, window = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t = time.monotonic(); c = socket.create_connection((addr, port), timeout=10); connect = time.monotonic() - t
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); c.sendall(b"p")
rtts = []
for _ in range(7):
    t = time.monotonic(); c.sendall(b"x")
    if c.recv(1) != b"x": sys.exit("echo failed")
    rtts.append(time.monotonic() - t)
c.close()
d = socket.create_connection((addr, port), timeout=10); d.sendall(b"d"); d.setblocking(False)
chunk = b"\0" * (1 << 16); deadline = time.monotonic() + window + 15; reply = b""
while not reply.endswith(b"\n"):
    if time.monotonic() > deadline: sys.exit("bulk transfer timed out")
    r, w, _ = select.select([d], [d], [], 1.0)
    if r:
        got = d.recv(4096)
        if not got: break
        reply += got
    elif w:
        try: d.send(chunk)
        except BlockingIOError: pass
# drop what is still queued instead of trickling it out at a slow rate
d.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)); d.close()
res = json.loads(reply)
res.update(rtt_s=statistics.median(rtts[1:]), rtt_min_s=min(rtts[1:]), connect_s=connect)
print(json.dumps(res))
"""


@contextlib.contextmanager
def emulated(spec: ClusterSpec | str) -> Iterator[Cluster]:
    """``with emulated(parse_emulate("nodes=2,rate=10mbit")) as c:`` -- always taken down."""
    if isinstance(spec, str):
        spec = parse_emulate(spec)
    cluster = Cluster.up(spec)
    try:
        yield cluster
    finally:
        cluster.down()


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


def launch_on_cluster(cluster: Cluster, argv: Sequence[str], nproc_per_node: int | None = None,
                      timeout: float | None = None, *, module: str | None = "lorasync",
                      port: int = 29400, env: dict | None = None, log_dir: str | Path | None = None,
                      fail_grace: float = 10.0) -> int:
    """Run one torchrun agent per node, each in its namespace; return an exit code.

    ``nproc_per_node`` workers per agent (default: the spec's); the workers of
    one node share its namespace, so their traffic to each other is local.

    Each node runs torchrun (``torch.distributed.run``) ``--nnodes N --node-rank I
    --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint NODE0:PORT
    -m MODULE ARGV``; with ``module=None`` ``argv`` is what follows the
    torchrun options as is (a script path and its arguments).  The workers
    get ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = the node's interface
    (gloo would otherwise bind to what the hostname resolves to, 127.0.0.1),
    ``OMP_NUM_THREADS=1`` and ``PYTHONUNBUFFERED=1``.  Output goes to our
    stdout/stderr, or to ``log_dir/nodeI.log``.

    Returns 0 if all succeed, else 2 if any agent returned 2, else the first
    non-zero code.  After a failure the others get ``fail_grace`` seconds,
    then everything is killed; also on ``timeout`` (returns 124) and Ctrl-C.
    """
    nn = len(cluster.nodes)
    if nproc_per_node is None:
        nproc_per_node = cluster.spec.nproc_per_node
    endpoint = f"{cluster.nodes[0].address}:{port}"
    rdzv_id = f"lsync-{uuid.uuid4().hex[:8]}"
    base_env = dict(os.environ if env is None else env)
    base_env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    logs = []
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    try:
        for n in cluster.nodes:
            cmd = [sys.executable, "-c", _AGENT, "--nnodes", str(nn),
                   "--node-rank", str(n.index), "--nproc-per-node", str(nproc_per_node),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                   # node0 hosts the rendezvous store; torch's own guess compares
                   # hostnames, which are the same in every namespace
                   "--rdzv-conf", f"is_host={1 if n.index == 0 else 0}",
                   "--local-addr", n.address, "--max-restarts", "0"]
            cmd += ["-m", module, *argv] if module else list(argv)
            e = dict(base_env, GLOO_SOCKET_IFNAME=n.ifname, NCCL_SOCKET_IFNAME=n.ifname)
            out = None
            if log_dir is not None:
                out = open(Path(log_dir) / f"{n.name}.log", "wb")
                logs.append(out)
            procs.append(subprocess.Popen(cluster.exec_argv(n.index, cmd), env=e, stdout=out,
                                          stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True))
        deadline = None if timeout is None else time.monotonic() + timeout
        first_bad: int | None = None
        bad_since = None
        while [p.poll() for p in procs].count(None):  # poll every agent, no short-circuit
            codes = [p.returncode for p in procs if p.returncode not in (None, 0)]
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
        return next((c if c > 0 else 128 - c for c in codes if c != 0), 0)
    except BaseException:
        _stop_agents(procs)
        raise
    finally:
        for f in logs:
            f.close()


# torchrun itself exits 1 whatever its workers returned; this keeps the worker's code
# (2 = a user error) the way lorasync.launch.run_torchrun does in-process
_AGENT = """
import sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run
try:
    run(get_args_parser().parse_args(sys.argv[1:]))
except ChildFailedError as exc:
    codes = [f.exitcode for f in exc.failures.values()]
    sys.exit(2 if 2 in codes else next((c for c in codes if c and c > 0), 1))
except SignalException as exc:  # stopped by launch_on_cluster; the agent has stopped its workers
    sys.exit(128 + int(exc.sigval))
"""


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
    _kill([p for p in tree if _alive(p)], grace=1.0)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=5)
