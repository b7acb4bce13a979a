"""Emulated multi-node cluster on one machine: network namespaces + shaped links.

:class:`Cluster` builds what a :class:`~lorasync.emulate.spec.ClusterSpec`
describes, changes its rates, measures it and, with :func:`down`, takes it
down again; :mod:`lorasync.emulate.launch` runs jobs on it.

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
``10.215.0.0/24``; :func:`~lorasync.emulate.launch.launch_on_cluster` then runs gloo and the rendezvous
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
import select
import shutil
import subprocess
import sys
import time
from typing import Sequence

from lorasync.emulate import cpucap
from lorasync.emulate.nat import BLACKHOLE_MTU as _BLACKHOLE_MTU
from lorasync.emulate.netns import (PREFIX, forwarder_pids, kill, ns_names, pids_in_netns,
                                    require_host, run)
from lorasync.emulate.spec import ClusterSpec, tc_rate
from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.hostops import CLUSTERS_DIR, pid_alive

__all__ = [
    "Cluster",
    "LinkMeasurement",
    "Node",
    "down",
]

NODE_IF = "eth0"
DELAY_IF = "dly"
_DELAY_TABLE = 100
_BLACKHOLE_TABLE = 200  # + node index: the routes out of a black-holed node
_MAX_GSO = 65536  # largest skb TCP hands a veth; queues must hold a few


#: forwarders started by this process, by pid (another process's `down` just kills them)
_FORWARDERS: dict[int, subprocess.Popen] = {}


def down(name: str | None = "default") -> list[str]:
    """Remove cluster ``name`` and any leftovers of a crashed run; idempotent.

    Kills every process inside its namespaces and its delay forwarder, deletes
    the namespaces (their links go with them) and the state file.  ``name=None``
    removes every lorasync cluster on this host.  Returns what was removed.
    """
    require_host()
    from lorasync.emulate import overlay as cluster_overlay

    # tunnels first: their supervisors remove interfaces, sockets and nft tables themselves
    removed = cluster_overlay.remove(name)
    namespaces = ns_names(name)
    pids = set(forwarder_pids(name))
    for ns in namespaces:
        pids.update(pids_in_netns(ns))
    if pids:
        kill(sorted(pids))
        for pid in pids:  # forwarders this process started: reap them
            proc = _FORWARDERS.pop(pid, None)
            if proc is not None:
                proc.wait()
        removed += [f"process {p}" for p in sorted(pids)]
    for ns in namespaces:
        run(["ip", "netns", "del", ns], check=False)
        removed.append(f"netns {ns}")
    removed += [f"cgroup {p}" for p in cpucap.leftovers(name)]  # a capped launch that was killed
    states = ([CLUSTERS_DIR / f"{name}.json", CLUSTERS_DIR / f"{name}.delaylink.log"] if name
              else [*CLUSTERS_DIR.glob("*.json"), *CLUSTERS_DIR.glob("*.delaylink.log")])
    for path in states:
        if path.exists():
            path.unlink()
            removed.append(f"state {path}")
    return removed



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
        require_host(need_tun=spec.needs_forwarder)
        if (CLUSTERS_DIR / f"{spec.name}.json").exists() or ns_names(spec.name):
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
        run(["ip", "netns", "add", hub])
        for n in self.nodes:
            run(["ip", "netns", "add", n.netns])
        # hub routes between nodes; set defaults before links exist so they inherit them
        # (a new namespace copies the host's rp_filter, which would drop delayed packets)
        sysctls = {"net/ipv4/ip_forward": 1, "net/ipv4/conf/all/rp_filter": 0,
                   "net/ipv4/conf/default/rp_filter": 0, "net/ipv4/conf/default/proxy_arp": 1,
                   "net/ipv4/conf/all/send_redirects": 0, "net/ipv4/conf/default/send_redirects": 0,
                   "net/ipv6/conf/all/disable_ipv6": 1, "net/ipv6/conf/default/disable_ipv6": 1}
        script = "; ".join(f"echo {v} > /proc/sys/{k}" for k, v in sysctls.items())
        run(["ip", "netns", "exec", hub, "sh", "-ec", script])
        run(["ip", "-n", hub, "link", "set", "lo", "up"])
        prefix = ipaddress.IPv4Network(spec.subnet).prefixlen
        for n in self.nodes:
            # quiet nodes: no IPv6 chatter (router solicitations) on shaped links
            run(["ip", "netns", "exec", n.netns, "sh", "-ec",
                  "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                  "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"])
            peer = f"p{n.index}"
            run(["ip", "-n", n.netns, "link", "set", "lo", "up"])
            if n.nat:
                self._build_nat(n, prefix)
            else:
                # create the pair inside the namespaces: the root namespace never sees it
                run(["ip", "-n", hub, "link", "add", peer, "mtu", str(mtu), "type", "veth",
                      "peer", "name", n.ifname, "netns", n.netns, "mtu", str(mtu)])
                run(["ip", "-n", n.netns, "addr", "add", f"{n.address}/{prefix}", "dev", n.ifname])
                run(["ip", "-n", n.netns, "link", "set", n.ifname, "up"])
            run(["ip", "-n", hub, "addr", "add", f"{self.hub_address}/32", "dev", peer])
            run(["ip", "-n", hub, "link", "set", peer, "up"])
            # a black-holed node: the hub's route to it carries the smaller MTU
            mtu_to = ["mtu", str(_BLACKHOLE_MTU)] if n.index in spec.mtu_blackhole else []
            run(["ip", "-n", hub, "route", "add", f"{n.outside}/32", "dev", peer, *mtu_to])
        # proxy ARP answers after a random wait of up to 0.8 s by default
        # (per device only: a namespace has no neigh/default of its own)
        run(["ip", "netns", "exec", hub, "sh", "-ec", "; ".join(
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
                run(["ip", "-n", hub, "route", "add", "default", "dev", DELAY_IF, "mtu",
                      str(_BLACKHOLE_MTU), "table", table])
            else:
                for n in self.nodes:
                    if n.index != i:
                        run(["ip", "-n", hub, "route", "add", f"{n.outside}/32", "dev", f"p{n.index}",
                              "mtu", str(_BLACKHOLE_MTU), "table", table])
            run(["ip", "-n", hub, "rule", "add", "iif", f"p{i}", "lookup", table, "pref", "90"])
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
        run(["ip", "netns", "add", r])
        run(["ip", "netns", "exec", r, "sh", "-ec",
              "echo 1 > /proc/sys/net/ipv4/ip_forward; echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter; "
              "echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter; "
              "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
              "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"])
        run(["ip", "-n", r, "link", "set", "lo", "up"])
        run(["ip", "-n", self.hub_netns, "link", "add", f"p{n.index}", "mtu", str(mtu), "type", "veth",
              "peer", "name", "wan", "netns", r, "mtu", str(mtu)])
        run(["ip", "-n", r, "link", "add", "lan", "mtu", str(mtu), "type", "veth",
              "peer", "name", n.ifname, "netns", n.netns, "mtu", str(mtu)])
        run(["ip", "-n", r, "addr", "add", f"{n.outside}/{prefix}", "dev", "wan"])
        run(["ip", "-n", r, "addr", "add", f"{gw}/24", "dev", "lan"])
        for dev in ("wan", "lan"):
            run(["ip", "-n", r, "link", "set", dev, "up"])
        run(["ip", "-n", n.netns, "addr", "add", f"{n.address}/24", "dev", n.ifname])
        run(["ip", "-n", n.netns, "link", "set", n.ifname, "up"])
        run(["ip", "-n", n.netns, "route", "add", "default", "via", gw])
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
        run(["ip", "-n", hub, "link", "set", DELAY_IF, "mtu", str(spec.link_mtu), "up"])
        run(["ip", "-n", hub, "route", "add", "default", "dev", DELAY_IF, "table", str(_DELAY_TABLE)])
        for n in self.nodes:
            # packets arriving from a node detour through the forwarder; packets it
            # writes back arrive on DELAY_IF and take the main table to their node
            run(["ip", "-n", hub, "rule", "add", "iif", f"p{n.index}", "lookup", str(_DELAY_TABLE),
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
        run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        if rate_bps is None and not by_dst:
            return
        # unclassified traffic goes to 1:10 (shaped) or, unshaped, straight through (default 0)
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
              "default", "10" if rate_bps else "0"])
        parent = "1:"
        if rate_bps:
            run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
                  "htb", *self._htb_args(rate_bps)])
            self._leaf(ns, dev, "1:1", 10, rate_bps)
            parent = "1:1"
        for k, (addr, prate) in enumerate(by_dst.items()):
            minor = 100 + k
            self._leaf(ns, dev, parent, minor, prate)
            run(["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                  "prio", "1", "u32", "match", "ip", "dst", f"{addr}/32", "flowid", f"1:{minor}"])

    def _leaf(self, ns: str, dev: str, parent: str, minor: int, rate_bps: int) -> None:
        run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", parent, "classid", f"1:{minor}",
              "htb", *self._htb_args(rate_bps)])
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle",
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
        bps = tc_rate(rate)
        targets = range(len(self.nodes)) if node is None else [self._index(node)]
        for i in targets:
            n, was = self.nodes[i], self.node_rates[i]
            self.node_rates[i] = bps
            if was is None:  # unshaped until now: build the qdiscs
                self._shape(i)
                continue
            for ns, dev in ((n.netns, n.ifname), (self.hub_netns, f"p{i}")):
                for parent, cls in (("1:", "1:1"), ("1:1", "1:10")):
                    run(["tc", "-n", ns, "class", "change", "dev", dev, "parent", parent,
                          "classid", cls, "htb", *self._htb_args(bps)])
                run(["tc", "-n", ns, "qdisc", "change", "dev", dev, "parent", "1:10",
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
