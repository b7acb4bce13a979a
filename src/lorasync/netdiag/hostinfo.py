"""What a host looks like to the network side of training, read from files.

Everything ``doctor`` and ``tune`` know about a host comes through
:class:`HostInfo`: sysctls (``/proc/sys``), interfaces (``/sys/class/net``
plus ``ip -j -d addr``), RDMA ports (``/sys/class/infiniband``), the
hostname and what it resolves to, and which network namespace we are in.
All paths hang off a configurable ``root`` so tests can point at a fake tree
(``tests/fixtures/hosts/*``); on a fake tree, what normally comes from a
command or the resolver comes from a file instead:

    ip/addr.json        output of ``ip -j -d addr show``
    etc/hostname        the hostname
    etc/hosts           resolution of the hostname (only /etc/hosts is read)
    proc/self/ns/net    a file holding e.g. ``net:[4026531833]``
    usr/lib/**/libibverbs.so*   presence of the verbs library

Nothing here writes; :mod:`lorasync.netdiag.tune` owns writes.
"""

from __future__ import annotations

import glob
import ipaddress
import json
import os
import re
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Mapping

__all__ = [
    "HostInfo",
    "Interface",
    "IBPort",
    "NetnsInfo",
    "is_public_address",
    "is_loopback_address",
    "endpoint_facts",
    "INIT_NET_NS_INODE",
]

# Kernels >= 6.? give the initial network namespace a fixed proc inode
# (PROC_NET_INIT_INO = 0xEFFFFFF9), like the other initial namespaces. Used
# only when /proc/1/ns/net cannot be read (sandboxes deny it even to root).
INIT_NET_NS_INODE = 0xEFFFFFF9
#: overlays recognized by their interface names (WireGuard also by its kind or control socket)
OVERLAY_NAMES = (("tailscale", r"tailscale\d+"), ("zerotier", r"zt[0-9a-z]+"), ("wireguard", r"wg[\w.-]*"))

_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


@dataclass
class Interface:
    """One network interface as training cares about it."""

    name: str
    mtu: int | None = None
    max_mtu: int | None = None  # what the driver allows (ip -d: max_mtu); 0/None = unknown
    operstate: str = "unknown"
    up: bool = False
    loopback: bool = False
    physical: bool = False  # has a backing device (not veth/bridge/tun/lo)
    speed_mbps: int | None = None  # None when the driver does not say (virtual links)
    kind: str | None = None  # ip -d linkinfo.info_kind: veth, bridge, tun, ipoib, ...
    link_type: str | None = None  # ether, loopback, infiniband, none
    ipv4: list[str] = field(default_factory=list)
    ipv6: list[str] = field(default_factory=list)  # scope global only
    networks: list[str] = field(default_factory=list)  # IPv4 subnets, e.g. 10.0.0.0/24

    @property
    def addresses(self) -> list[str]:
        return self.ipv4 + self.ipv6

    @property
    def running(self) -> bool:
        """Administratively up and not reported down (lo and tun say 'unknown')."""
        return self.up and self.operstate not in ("down", "lowerlayerdown", "notpresent")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class IBPort:
    """One port of an RDMA device (/sys/class/infiniband/DEV/ports/N)."""

    device: str
    port: int
    state: str  # "ACTIVE", "DOWN", "INIT", ... (the text after "N: ")
    phys_state: str
    rate: str  # e.g. "100 Gb/sec (4X EDR)"
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    netdevs: list[str] = field(default_factory=list)
    # (index, gid, type, netdev) for every non-empty GID; type "RoCE v2", "IB/RoCE v1"
    gids: list[tuple[int, str, str, str | None]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"

    @property
    def roce(self) -> bool:
        return self.link_layer.lower() == "ethernet"

    @property
    def rate_gbps(self) -> float | None:
        m = re.match(r"\s*([\d.]+)\s*Gb", self.rate)
        return float(m.group(1)) if m else None

    def roce_v2_ipv4_gid_index(self) -> int | None:
        """The GID index NCCL should use on RoCE: v2, IPv4-mapped (::ffff:a.b.c.d)."""
        for idx, gid, typ, _nd in self.gids:
            if "v2" in typ.lower() and gid.lower().startswith("0000:0000:0000:0000:0000:ffff:"):
                return idx
        for idx, gid, typ, _nd in self.gids:
            if "v2" in typ.lower():
                return idx
        return None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gids"] = [list(g) for g in self.gids]
        return d


@dataclass
class NetnsInfo:
    """Which network namespace this process is in, and how we know."""

    inode: int | None
    initial: bool | None  # None: could not tell
    how: str


def is_loopback_address(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def is_public_address(addr: str) -> bool:
    """True for an address reachable from the internet (not private, loopback,
    link-local, CGNAT or documentation space)."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return False
    if ip.version == 4 and ip.is_unspecified:
        return False
    return ip.is_global


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:  # missing, EINVAL (speed of a virtual link), EACCES
        return None


def _int(text: str | None, base: int = 10) -> int | None:
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


class HostInfo:
    """Read-only view of a host (or of a fake tree under ``root``).

    ``env`` is the environment the checks look at (default ``os.environ``);
    ``hostname`` overrides the hostname. Results are cached per instance.
    """

    def __init__(self, root: str = "/", env: Mapping[str, str] | None = None,
                 hostname: str | None = None):
        self.root = os.path.abspath(root)
        self.fake = self.root != "/"
        self.env: dict[str, str] = dict(os.environ if env is None else env)
        self._hostname = hostname
        self._ip_addr: list[dict] | None = None
        self._ifaces: list[Interface] | None = None

    # -- paths and sysctls ----------------------------------------------
    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *[p.lstrip("/") for p in parts])

    @staticmethod
    def sysctl_relpath(key: str) -> str:
        """``net.ipv4.tcp_rmem`` -> ``proc/sys/net/ipv4/tcp_rmem``."""
        return "proc/sys/" + key.replace(".", "/")

    def sysctl_path(self, key: str) -> str:
        return self.path(self.sysctl_relpath(key))

    def sysctl(self, key: str) -> str | None:
        """Value of a sysctl with whitespace normalised to single spaces, or
        None when it does not exist here (e.g. a global one seen from a netns)."""
        text = _read(self.sysctl_path(key))
        return None if text is None else " ".join(text.split())

    def sysctl_writable(self, key: str) -> bool:
        """Whether this process may write the sysctl here. In a non-initial
        netns the kernel shows global ones read-only (or not at all)."""
        p = self.sysctl_path(key)
        try:
            st = os.stat(p)
        except OSError:
            return False
        if not st.st_mode & 0o222:
            return False
        return os.access(p, os.W_OK)

    # -- network namespace ----------------------------------------------
    def netns(self) -> NetnsInfo:
        """Are we in the initial network namespace?

        Compares /proc/self/ns/net with /proc/1/ns/net (the way ``ip netns
        identify`` does). Where /proc/1 is unreadable, falls back to the
        fixed inode of init_net, then to a sysctl that only init_net has.
        """
        mine = self._ns_inode("proc/self/ns/net")
        pid1 = self._ns_inode("proc/1/ns/net")
        if mine is not None and pid1 is not None:
            return NetnsInfo(mine, mine == pid1, "compared /proc/self/ns/net with /proc/1/ns/net")
        if mine == INIT_NET_NS_INODE:
            return NetnsInfo(mine, True, "inode is the fixed init_net inode")
        # net.core.netdev_max_backlog is registered for init_net only
        if os.path.exists(self.sysctl_path("net.core.netdev_max_backlog")):
            return NetnsInfo(mine, True, "net.core.netdev_max_backlog exists (init_net only)")
        if os.path.isdir(self.path("proc/sys/net/core")):
            return NetnsInfo(mine, False, "net.core.netdev_max_backlog absent (not init_net)")
        return NetnsInfo(mine, None, "could not tell")

    def _ns_inode(self, rel: str) -> int | None:
        p = self.path(rel)
        try:
            if os.path.islink(p) or not os.path.isfile(p):
                text = os.readlink(p)
            else:
                text = _read(p) or ""
        except OSError:
            return None
        m = re.search(r"\[(\d+)\]", text)
        return int(m.group(1)) if m else None

    # -- interfaces ------------------------------------------------------
    def _ip_addr_json(self) -> list[dict]:
        if self._ip_addr is None:
            data: list[dict] = []
            if self.fake:
                text = _read(self.path("ip/addr.json"))
                data = json.loads(text) if text else []
            else:
                try:
                    out = subprocess.run(["ip", "-j", "-d", "addr", "show"], capture_output=True,
                                         text=True, timeout=10, check=True).stdout
                    data = json.loads(out or "[]")
                except (OSError, subprocess.SubprocessError, ValueError):
                    data = self._addr_without_ip()
            self._ip_addr = data
        return self._ip_addr

    def _addr_without_ip(self) -> list[dict]:
        """The ``ip -j addr`` subset we use, for hosts without iproute2
        (minimal containers): IPv4 by ioctl, IPv6 from /proc/net/if_inet6."""
        import fcntl
        import struct

        net = self.path("sys/class/net")
        names = sorted(os.listdir(net)) if os.path.isdir(net) else []
        v6: dict[str, list[dict]] = {}
        for line in (_read(self.path("proc/net/if_inet6")) or "").splitlines():
            f = line.split()
            if len(f) >= 6:
                addr = str(ipaddress.IPv6Address(bytes.fromhex(f[0])))
                v6.setdefault(f[5], []).append({"family": "inet6", "local": addr, "prefixlen": int(f[2], 16),
                                                "scope": "global" if f[3] == "00" else "other"})
        out = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for name in names:
                info = []
                req = struct.pack("256s", name.encode()[:15])
                try:
                    addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
                    mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, req)[20:24])  # SIOCGIFNETMASK
                    info.append({"family": "inet", "local": addr,
                                 "prefixlen": ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen})
                except OSError:
                    pass
                out.append({"ifname": name, "addr_info": info + v6.get(name, [])})
        return out

    def interfaces(self) -> list[Interface]:
        """All interfaces of this (network namespace of the) host, sorted by name."""
        if self._ifaces is not None:
            return self._ifaces
        by_name = {d.get("ifname"): d for d in self._ip_addr_json()}
        names = set()
        net = self.path("sys/class/net")
        if os.path.isdir(net):
            names |= {n for n in os.listdir(net) if os.path.isdir(os.path.join(net, n))}
        names |= {n for n in by_name if n}
        out = []
        for name in sorted(names):
            base = os.path.join(net, name)
            ipd = by_name.get(name, {})
            flags = _int(_read(os.path.join(base, "flags")), 16)
            mtu = _int(_read(os.path.join(base, "mtu")))
            if mtu is None:
                mtu = ipd.get("mtu")
            operstate = (_read(os.path.join(base, "operstate")) or ipd.get("operstate") or "unknown").lower()
            ipflags = ipd.get("flags") or []
            up = bool(flags & _IFF_UP) if flags is not None else "UP" in ipflags
            loop = (bool(flags & _IFF_LOOPBACK) if flags is not None else "LOOPBACK" in ipflags) \
                or name == "lo"
            speed = _int(_read(os.path.join(base, "speed")))
            if speed is not None and speed <= 0:
                speed = None
            ipv4, ipv6, nets = [], [], []
            for a in ipd.get("addr_info", []):
                if a.get("family") == "inet":
                    ipv4.append(a["local"])
                    try:
                        nets.append(str(ipaddress.ip_network(f"{a['local']}/{a.get('prefixlen', 32)}",
                                                             strict=False)))
                    except ValueError:
                        pass
                elif a.get("family") == "inet6" and a.get("scope") == "global":
                    ipv6.append(a["local"])
            out.append(Interface(
                name=name, mtu=mtu, max_mtu=ipd.get("max_mtu") or None, operstate=operstate,
                up=up, loopback=loop, physical=os.path.exists(os.path.join(base, "device")),
                speed_mbps=speed, kind=(ipd.get("linkinfo") or {}).get("info_kind"),
                link_type=ipd.get("link_type"), ipv4=ipv4, ipv6=ipv6, networks=nets))
        self._ifaces = out
        return out

    def interface(self, name: str) -> Interface | None:
        return next((i for i in self.interfaces() if i.name == name), None)

    def interface_for_address(self, addr: str) -> Interface | None:
        return next((i for i in self.interfaces() if addr in i.ipv4 or addr in i.ipv6), None)

    def overlay_kind(self, iface: Interface) -> str | None:
        """``"tailscale"``, ``"zerotier"`` or ``"wireguard"`` when ``iface`` is an
        overlay's interface (by its kind, wireguard-go's control socket, or the
        names those tools give: tailscale0, zt*, wg*), else None."""
        if iface.kind == "wireguard" or any(
                os.path.exists(self.path(d, f"{iface.name}.sock")) for d in ("var/run/wireguard", "run/wireguard")):
            return "wireguard"
        return next((k for k, pat in OVERLAY_NAMES if re.fullmatch(pat, iface.name)), None)

    def overlay_interfaces(self) -> list[Interface]:
        """The overlay interfaces here that are up with an address."""
        return [i for i in self.interfaces() if i.running and i.addresses and self.overlay_kind(i)]

    def route_source(self, peer: str) -> str | None:
        """The local address the kernel sends from towards ``peer`` (None: no
        route, or a fake tree).  A UDP connect picks the route and sends nothing."""
        if self.fake:
            return None
        from lorasync.hostops import route_address

        return route_address(peer)

    def overlay_to(self, peer: str) -> Interface | None:
        """The overlay interface that reaches ``peer``: the route to it leaves
        through one, or (on a fake tree) the peer's address is in its network."""
        overlays = self.overlay_interfaces()
        if not overlays:
            return None
        src = self.route_source(peer)
        if src is not None:
            return next((i for i in overlays if src in i.addresses), None)
        try:
            a = ipaddress.ip_address(peer)
        except ValueError:
            return None
        return next((i for i in overlays if any(a in ipaddress.ip_network(n) for n in i.networks)), None)

    def candidate_interfaces(self) -> list[Interface]:
        """Interfaces other ranks could reach us on: up, not loopback, with an address."""
        return [i for i in self.interfaces() if i.running and not i.loopback and i.addresses]

    def local_addresses(self) -> set[str]:
        return {a for i in self.interfaces() for a in i.addresses}

    # -- hostname ----------------------------------------------------------
    def hostname(self) -> str:
        if self._hostname is None:
            self._hostname = (_read(self.path("etc/hostname")) or "localhost") if self.fake \
                else socket.gethostname()
        return self._hostname

    def resolve(self, name: str | None = None) -> list[str]:
        """Addresses ``name`` (default: the hostname) resolves to, in resolver
        order; [] when it does not resolve. gloo binds to the first one."""
        name = name or self.hostname()
        try:  # a literal address resolves to itself
            return [str(ipaddress.ip_address(name))]
        except ValueError:
            pass
        if self.fake:
            return self._resolve_hosts_file(name)
        try:
            infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError):
            return []
        seen: list[str] = []
        for info in infos:
            a = info[4][0]
            if a not in seen:
                seen.append(a)
        return seen

    def _resolve_hosts_file(self, name: str) -> list[str]:
        text = _read(self.path("etc/hosts")) or ""
        out = []
        for line in text.splitlines():
            parts = line.split("#", 1)[0].split()
            if len(parts) >= 2 and name in parts[1:] and parts[0] not in out:
                out.append(parts[0])
        return out

    def endpoint(self, peer: str | None = None) -> tuple[str | None, str | None]:
        """(interface, address) the ranks on this host talk to other ranks from.

        gloo takes the first GLOO_SOCKET_IFNAME interface when set, else the
        address the hostname resolves to; where that is unknown, the kernel's
        source address toward ``peer`` (MASTER_ADDR) is what TCP would use.
        """
        names = [n for n in self.env.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        if names:
            i = self.interface(names[0])
            return names[0], (i.addresses[0] if i and i.addresses else None)
        addrs = self.resolve()
        if addrs:
            i = self.interface_for_address(addrs[0])
            if i is not None or self.fake:
                return (i.name if i else None), addrs[0]
        peer = peer or self.env.get("MASTER_ADDR")
        if peer and not self.fake:
            try:
                fam = socket.AF_INET6 if ":" in peer else socket.AF_INET
                with socket.socket(fam, socket.SOCK_DGRAM) as s:
                    s.connect((peer, 9))  # UDP connect sends nothing; it only picks a route
                    src = s.getsockname()[0]
                i = self.interface_for_address(src)
                return (i.name if i else None), src
            except OSError:
                pass
        return None, (addrs[0] if addrs else None)

    # -- RDMA ----------------------------------------------------------------
    def ib_ports(self) -> list[IBPort]:
        base = self.path("sys/class/infiniband")
        if not os.path.isdir(base):
            return []
        ports = []
        for dev in sorted(os.listdir(base)):
            ddir = os.path.join(base, dev)
            netdevs = sorted(os.listdir(os.path.join(ddir, "device", "net"))) \
                if os.path.isdir(os.path.join(ddir, "device", "net")) else []
            pdir = os.path.join(ddir, "ports")
            if not os.path.isdir(pdir):
                continue
            for p in sorted(os.listdir(pdir), key=lambda s: _int(s) or 0):
                pp = os.path.join(pdir, p)

                def rd(name, pp=pp):
                    return _read(os.path.join(pp, name)) or ""

                gids = []
                gdir = os.path.join(pp, "gids")
                if os.path.isdir(gdir):
                    for g in sorted(os.listdir(gdir), key=lambda s: _int(s) or 0):
                        gid = _read(os.path.join(gdir, g)) or ""
                        if not gid or set(gid.replace(":", "")) <= {"0"}:
                            continue  # empty slot
                        typ = _read(os.path.join(pp, "gid_attrs", "types", g)) or ""
                        nd = _read(os.path.join(pp, "gid_attrs", "ndevs", g))
                        gids.append((int(g), gid, typ, nd))
                ports.append(IBPort(
                    device=dev, port=int(p), state=rd("state").split(":")[-1].strip(),
                    phys_state=rd("phys_state").split(":")[-1].strip(), rate=rd("rate"),
                    link_layer=rd("link_layer") or "InfiniBand", netdevs=netdevs, gids=gids))
        return ports

    def has_ibverbs(self) -> bool:
        """Whether the user-space verbs library (rdma-core) is installed;
        NCCL dlopen()s libibverbs.so.1 and falls back to sockets without it."""
        pats = ["usr/lib/*/libibverbs.so*", "usr/lib/libibverbs.so*", "usr/lib64/libibverbs.so*",
                "lib/*/libibverbs.so*", "lib64/libibverbs.so*"]
        if any(glob.glob(self.path(p)) for p in pats):
            return True
        if not self.fake:
            import ctypes.util
            return ctypes.util.find_library("ibverbs") is not None
        return False

    # -- memory for RDMA -------------------------------------------------------
    def hugepages(self) -> dict:
        """Huge pages as /proc/meminfo and sysfs tell: ``total``/``free``
        reserved pages, ``size_kib`` each, ``thp`` (transparent huge pages:
        always, madvise or never; None when unknown)."""
        info = {}
        for line in (_read(self.path("proc/meminfo")) or "").splitlines():
            key, _, rest = line.partition(":")
            info[key.strip()] = rest.split()[0] if rest.split() else ""
        thp = _read(self.path("sys/kernel/mm/transparent_hugepage/enabled")) or ""
        m = re.search(r"\[(\w+)\]", thp)
        return {"total": _int(info.get("HugePages_Total")), "free": _int(info.get("HugePages_Free")),
                "size_kib": _int(info.get("Hugepagesize")), "thp": m.group(1) if m else None}

    def memlock_limit(self) -> int | None:
        """This process's RLIMIT_MEMLOCK soft limit in bytes (-1: unlimited),
        from /proc/self/limits; None when unknown."""
        for line in (_read(self.path("proc/self/limits")) or "").splitlines():
            if line.startswith("Max locked memory"):
                soft = line[len("Max locked memory"):].split()[0]
                return -1 if soft == "unlimited" else _int(soft)
        return None

    # -- summary ---------------------------------------------------------------
    def summary(self) -> dict:
        ns = self.netns()
        return {
            "hostname": self.hostname(),
            "hostname_addresses": self.resolve(),
            "netns": {"inode": ns.inode, "initial": ns.initial},
            "interfaces": [i.to_dict() for i in self.interfaces()],
            "ib_ports": [p.to_dict() for p in self.ib_ports()],
        }


def endpoint_facts() -> dict:
    """This host's endpoint as a probe labels a rank: the interface the
    collectives use, its address and MTU (None where unknown)."""
    host = HostInfo()
    ifname, addr = host.endpoint()
    iface = host.interface(ifname) if ifname else None
    return {"ifname": ifname, "addr": addr, "mtu": iface.mtu if iface else None}
