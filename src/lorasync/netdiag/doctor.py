"""Host and network checks for distributed training, each with its fix.

A :class:`Finding` says what was found, why it matters for training and the
exact fix (a command or an environment variable), at one of four
severities: ok, info, warn, error. ``doctor`` exits 1 when any finding is
an error.

Static checks (:func:`static_checks`) look at one host through
:class:`~lorasync.netdiag.hostinfo.HostInfo`, so tests run them on fake trees.
Live checks (:func:`live_checks`) run on every rank of a process group:
ranks exchange what they see (versions, config hash, interface, MTU) and a
short pair probe names the slowest link.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import platform
from dataclasses import asdict, dataclass, field

from lorasync.errors import LorasyncError
from lorasync.hostops import TUNNELS_DIR
from lorasync.netdiag.hostinfo import HostInfo, is_loopback_address, is_public_address
from lorasync.netdiag.tune import default_link, recommend
from lorasync.plan.net import Link
from lorasync.units import fmt_rate, parse_hostport

__all__ = [
    "SEVERITIES",
    "Finding",
    "static_checks",
    "live_checks",
    "rank_facts",
    "merge_findings",
    "worst",
    "exit_code",
    "format_findings",
    "nccl_ifname_matches",
]

SEVERITIES = ("ok", "info", "warn", "error")
_SOCKET_THREADS_MIN_MBPS = 25000  # NCCL's socket defaults (1 thread x 1 socket) cap out around here


@dataclass
class Finding:
    check: str  # stable id, e.g. "hostname-loopback"
    severity: str  # ok | info | warn | error
    found: str  # what was found
    why: str = ""  # why it matters for training
    fix: str = ""  # the exact command or variable
    ranks: list[int] = field(default_factory=list)  # live: which ranks saw it

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity: {self.severity!r} is not one of {SEVERITIES}")

    def to_dict(self) -> dict:
        return asdict(self)


def worst(findings: list[Finding]) -> str:
    return max((f.severity for f in findings), key=SEVERITIES.index, default="ok")


def exit_code(findings: list[Finding]) -> int:
    """0 when nothing is worse than a warning, 1 otherwise."""
    return 1 if worst(findings) == "error" else 0


# -- interface selection ----------------------------------------------------------
def _best_candidate(host: HostInfo):
    cands = host.candidate_interfaces()
    if not cands:
        return None
    # fastest link first, then physical over virtual, then biggest MTU
    return max(cands, key=lambda i: (i.speed_mbps or 0, i.physical, i.mtu or 0))


def _ifname_fix(host: HostInfo) -> str:
    best = _best_candidate(host)
    name = best.name if best else "IFACE"
    return f"export GLOO_SOCKET_IFNAME={name} NCCL_SOCKET_IFNAME={name}"


def _check_hostname(host: HostInfo, nnodes: int | None) -> list[Finding]:
    name = host.hostname()
    addrs = host.resolve()
    gloo_if = host.env.get("GLOO_SOCKET_IFNAME")
    if not addrs:
        return [Finding("hostname-resolves", "warn" if nnodes != 1 else "info",
                        f"hostname {name!r} does not resolve",
                        "gloo binds to the address the hostname resolves to; without one, "
                        "process group start-up fails unless GLOO_SOCKET_IFNAME is set",
                        _ifname_fix(host) + f"   # or add '<this host's address> {name}' to /etc/hosts")]
    first = addrs[0]
    if not is_loopback_address(first):
        return [Finding("hostname-loopback", "ok", f"hostname {name!r} resolves to {first}")]
    if gloo_if and all((i := host.interface(n)) is not None and not i.loopback
                       for n in gloo_if.split(",") if n):
        return [Finding("hostname-loopback", "ok",
                        f"hostname {name!r} resolves to loopback {first}, but GLOO_SOCKET_IFNAME={gloo_if} "
                        f"overrides it")]
    sev = {1: "info"}.get(nnodes, "error" if nnodes and nnodes > 1 else "warn")
    span = {"info": "fine while all ranks are on this host",
            "warn": "an error as soon as the job spans nodes (pass --nnodes to say)",
            "error": f"this job spans {nnodes} nodes"}[sev]
    return [Finding(
        "hostname-loopback", sev, f"hostname {name!r} resolves to loopback {first} ({span})",
        "gloo (and NCCL's bootstrap) bind to the hostname's address, so they listen on loopback and "
        "announce it to the other ranks; remote ranks then get 'Connection refused' and start-up "
        "times out",
        _ifname_fix(host) + f"   # or map {name} to that interface's address in /etc/hosts "
        f"instead of {first}")]


def nccl_ifname_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces NCCL_SOCKET_IFNAME selects: comma list of prefixes; ``^``
    excludes, ``=`` asks for exact names (NCCL's own syntax)."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    spec = spec.lstrip("=")
    pats = [p for p in spec.split(",") if p]

    def hit(n):
        return any(n == p if exact else n.startswith(p) for p in pats)
    return [n for n in names if hit(n) != exclude]


def _check_ifname_env(host: HostInfo, nnodes: int | None) -> list[Finding]:
    out = []
    names = [i.name for i in host.interfaces()]
    gloo = host.env.get("GLOO_SOCKET_IFNAME")
    if gloo is not None:
        for n in [x for x in gloo.split(",") if x] or [""]:
            i = host.interface(n)
            if i is None:
                out.append(Finding(
                    "gloo-ifname", "error", f"GLOO_SOCKET_IFNAME names {n!r}, which does not exist here "
                    f"(interfaces: {', '.join(names) or 'none'})",
                    "gloo fails at init_process_group with 'no such device' on this rank",
                    _ifname_fix(host)))
            elif not i.running or not i.addresses:
                out.append(Finding(
                    "gloo-ifname", "error",
                    f"GLOO_SOCKET_IFNAME={n} is {'down' if not i.running else 'without an address'}",
                    "gloo cannot bind to it; the process group does not start",
                    f"ip link set dev {n} up; ip addr add ADDR/PREFIX dev {n}   # or pick another: "
                    + _ifname_fix(host)))
            elif i.loopback and nnodes != 1:
                out.append(Finding(
                    "gloo-ifname", "error" if nnodes else "warn", f"GLOO_SOCKET_IFNAME={n} is loopback",
                    "other nodes cannot reach a rank listening on loopback", _ifname_fix(host)))
            else:
                out.append(Finding("gloo-ifname", "ok", f"GLOO_SOCKET_IFNAME={n} ({', '.join(i.addresses)}, "
                                                        f"mtu {i.mtu})"))
    nccl = host.env.get("NCCL_SOCKET_IFNAME")
    if nccl is not None:
        hits = nccl_ifname_matches(nccl, names)
        if not hits:
            out.append(Finding(
                "nccl-ifname", "error", f"NCCL_SOCKET_IFNAME={nccl} matches no interface here "
                f"(interfaces: {', '.join(names) or 'none'})",
                "NCCL's bootstrap finds no interface and fails ('no socket interface found')",
                _ifname_fix(host)))
        else:
            out.append(Finding("nccl-ifname", "ok", f"NCCL_SOCKET_IFNAME={nccl} selects {', '.join(hits)}"))
    return out


def _check_candidates(host: HostInfo, nnodes: int | None) -> list[Finding]:
    cands = host.candidate_interfaces()
    if not cands:
        sev = "error" if nnodes and nnodes > 1 else ("info" if nnodes == 1 else "warn")
        return [Finding("interfaces", sev, "no interface other than loopback is up with an address",
                        "ranks on other nodes cannot reach this one",
                        "ip link set dev IFACE up && ip addr add ADDR/PREFIX dev IFACE")]
    desc = ", ".join(f"{i.name} ({i.addresses[0]}, mtu {i.mtu}"
                     + (f", {i.speed_mbps} Mb/s" if i.speed_mbps else "") + ")" for i in cands)
    if len(cands) == 1:
        return [Finding("interfaces", "ok", f"one candidate interface: {desc}")]
    pinned = "GLOO_SOCKET_IFNAME" in host.env and "NCCL_SOCKET_IFNAME" in host.env
    if pinned:
        return [Finding("interfaces", "ok", f"{len(cands)} candidate interfaces ({desc}); "
                        f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME choose")]
    return [Finding(
        "interfaces", "warn" if nnodes != 1 else "info",
        f"{len(cands)} candidate interfaces: {desc}; no GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME",
        "gloo takes the hostname's address and NCCL the first interface in its own order, so "
        "training can run over a slower or management network, or ranks can disagree",
        _ifname_fix(host) + "   # the fastest; the same name on every node")]


def _check_mtu(host: HostInfo) -> list[Finding]:
    out = []
    for i in host.candidate_interfaces():
        # physical NICs only: a veth/bridge MTU follows whatever carries it
        if i.physical and (i.mtu or 0) <= 1500 and (i.max_mtu or 0) >= 9000 and (i.speed_mbps or 0) >= 10000:
            out.append(Finding(
                "jumbo-frames", "info",
                f"{i.name}: mtu {i.mtu} on a {i.speed_mbps} Mb/s link that allows up to {i.max_mtu}",
                "jumbo frames carry 6x the payload per packet: less per-packet CPU and higher "
                "throughput for the large gradient messages (only if every switch on the path allows them)",
                f"ip link set dev {i.name} mtu 9000   # on every node; test with "
                f"ping -M do -s 8972 PEER"))
    return out


# -- path MTU ----------------------------------------------------------------------------
def path_mtu_findings(result) -> list[Finding]:
    """Findings from one :class:`~lorasync.netdiag.pmtu.PathMTU` probe."""
    from lorasync.overlay.wireguard import overlay_mtu

    peer = result.peer
    if result.error:
        return [Finding("path-mtu", "info", f"path MTU towards {peer} not checked: {result.error}")]
    if not result.reachable:
        return [Finding("path-mtu", "info", f"{peer} answers no ICMP echo: path MTU not checked",
                        "a firewall that drops echo requests hides the path MTU from this check",
                        f"check by hand from a node: ping -M do -s 1472 {peer}")]
    from lorasync.overlay.wireguard import MIN_MTU, OVERHEAD_V4

    mtu, wg = result.path_mtu, overlay_mtu([(result.path_mtu, False)])
    tunnel = f"lorasync tunnel init --mtu {wg} (auto probes the path and finds it too)"
    if mtu - OVERHEAD_V4 < MIN_MTU:
        tunnel = (f"no WireGuard overlay fits ({mtu} - {OVERHEAD_V4} bytes of overhead is below the "
                  f"{MIN_MTU} its interface needs): fix the path's MTU first")
    if result.blackhole:
        return [Finding(
            "path-mtu", "warn",
            f"path MTU black hole towards {peer}: {mtu}-byte packets pass, {result.smallest_lost}-byte "
            f"ones vanish and no 'fragmentation needed' comes back (this host sends up to "
            f"{result.local_mtu})",
            "TCP connects (the handshake is small), then every full-size segment is lost and the "
            "connection stalls on retransmission timeouts; a tunnel whose MTU is above the path's "
            "loses every full-size packet the same way",
            f"sysctl -w net.ipv4.tcp_mtu_probing=1   # TCP then finds the limit itself; on an overlay: "
            f"{tunnel}; or give the interface towards {peer} mtu {mtu} on both ends")]
    if result.local_mtu and mtu < result.local_mtu:
        return [Finding("path-mtu", "info",
                        f"path MTU towards {peer} is {mtu}, below this host's {result.local_mtu}; the "
                        "network reports it ('fragmentation needed' arrives), so TCP adapts",
                        "a WireGuard overlay over this path fits in " + str(wg) + " bytes",
                        tunnel)]
    return [Finding("path-mtu", "ok", f"path MTU towards {peer}: {mtu} (full-size packets pass)")]


def _check_path_mtu(host: HostInfo, peers) -> list[Finding]:
    if host.fake or not peers:
        return []
    from lorasync.netdiag.pmtu import find_path_mtu

    return [f for p in dict.fromkeys(peers) for f in path_mtu_findings(find_path_mtu(p))]


# -- TCP ------------------------------------------------------------------------------
def _check_tcp(host: HostInfo, link: Link) -> list[Finding]:
    recs = recommend(host, link)
    out = []
    for r in recs:
        if not r.change:
            continue
        where = ("per network namespace" if r.scope == "netns" else
                 "host-global (from a namespace: set it on the host)")
        cur = r.current if r.current is not None else "not visible here"
        fix = f"sysctl -w {r.key}={r.recommended!r}" if " " in r.recommended else \
            f"sysctl -w {r.key}={r.recommended}"
        out.append(Finding(
            f"sysctl:{r.key}", r.severity, f"{r.key} = {cur}, recommended {r.recommended} [{where}]",
            r.reason + (f"; {r.note}" if r.note and not r.applicable else ""),
            f"{fix}   # or all at once: lorasync tune --apply --rate {fmt_rate(link.rate_bps, 'tc', unit='bit')} "
            f"--rtt {link.rtt_s * 1e3:.3g}ms"))
    if not out:
        out.append(Finding("sysctl", "ok", f"TCP settings meet the targets for {link.describe()}"))
    else:
        out.append(Finding("sysctl", "info", f"TCP targets sized for {link.describe()}"))
    ns = host.netns()
    if ns.initial is False:
        out.append(Finding("netns", "info", f"running in a non-initial network namespace ({ns.how})",
                           "net.core.* buffer limits are the host's; only tcp_* settings are this "
                           "namespace's own"))
    return out


# -- RDMA ------------------------------------------------------------------------------
def _check_rdma(host: HostInfo) -> list[Finding]:
    env = host.env
    ports = host.ib_ports()
    out: list[Finding] = []
    hca = env.get("NCCL_IB_HCA")
    if not ports:
        if hca:
            out.append(Finding("rdma", "warn", f"NCCL_IB_HCA={hca} but no RDMA devices in /sys/class/infiniband",
                               "NCCL will use sockets", "unset NCCL_IB_HCA"))
        fast = [i for i in host.candidate_interfaces() if (i.speed_mbps or 0) >= _SOCKET_THREADS_MIN_MBPS]
        if fast and not (env.get("NCCL_SOCKET_NTHREADS") or env.get("NCCL_NSOCKS_PERTHREAD")):
            out.append(Finding(
                "nccl-sockets", "info",
                f"no RDMA; {fast[0].name} runs at {fast[0].speed_mbps} Mb/s over TCP",
                "NCCL's socket transport uses one thread and one socket per peer by default, which "
                "does not fill a 25 Gbit/s+ link", "export NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4"))
        if not out:
            out.append(Finding("rdma", "ok", "no RDMA devices: NCCL and gloo use TCP sockets"))
        return out
    active = [p for p in ports if p.active]
    for p in ports:
        if not p.active:
            out.append(Finding(
                "rdma-port", "warn", f"{p.device} port {p.port} is {p.state} ({p.phys_state})",
                "NCCL skips ports that are not ACTIVE",
                "check the cable and switch port (ibstat); on InfiniBand a subnet manager must run: "
                "systemctl start opensm" if not p.roce else
                f"ip link set dev {(p.netdevs or ['NETDEV'])[0]} up   # RoCE follows its Ethernet port"))
    if not active:
        out.append(Finding("rdma", "warn", "RDMA devices present but no port is ACTIVE",
                           "NCCL falls back to TCP sockets, several times slower", "see rdma-port"))
        return out
    desc = ", ".join(f"{p.device}:{p.port} {p.link_layer}{' (RoCE)' if p.roce else ''} {p.rate}"
                     for p in active)
    if env.get("NCCL_IB_DISABLE", "0").strip() not in ("", "0"):
        out.append(Finding(
            "rdma-disabled", "warn", f"RDMA active ({desc}) but NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']}",
            "NCCL ignores the HCAs and falls back to TCP sockets over the same wire: several times "
            "the latency and a fraction of the bandwidth", "unset NCCL_IB_DISABLE"))
    elif not host.has_ibverbs():
        out.append(Finding(
            "rdma-verbs", "warn", f"RDMA active ({desc}) but libibverbs is not installed",
            "NCCL dlopen()s libibverbs.so.1; without it it falls back to TCP sockets",
            "apt-get install libibverbs1 ibverbs-providers   # or: dnf install rdma-core libibverbs"))
    else:
        out.append(Finding("rdma", "ok", f"RDMA active: {desc}; NCCL will use it"))
    if hca:
        wanted = [h.split(":")[0] for h in hca.lstrip("^").lstrip("=").split(",") if h]
        have = sorted({p.device for p in ports})
        missing = [h for h in wanted if not any(d.startswith(h) for d in have)]
        if missing and not hca.startswith("^"):
            out.append(Finding("nccl-ib-hca", "error",
                               f"NCCL_IB_HCA={hca} names {', '.join(missing)}, not present (have {', '.join(have)})",
                               "NCCL finds no matching HCA and falls back to sockets or fails",
                               f"export NCCL_IB_HCA={','.join(sorted({p.device for p in active}))}"))
    elif len({p.device for p in active}) > 1:
        out.append(Finding("nccl-ib-hca", "info", f"{len({p.device for p in active})} active HCAs, "
                           "NCCL_IB_HCA unset", "NCCL uses every HCA it finds, including ones on "
                           "another network or NUMA node",
                           f"export NCCL_IB_HCA={','.join(sorted({p.device for p in active}))}   "
                           f"# the ones on the training fabric"))
    gid_env = env.get("NCCL_IB_GID_INDEX")
    for p in [p for p in active if p.roce]:
        idx = p.roce_v2_ipv4_gid_index()
        gids = {g[0]: g for g in p.gids}
        if gid_env is None:
            out.append(Finding(
                "roce-gid", "warn", f"{p.device} port {p.port} is RoCE and NCCL_IB_GID_INDEX is unset"
                + (f" (RoCE v2 IPv4 GID is index {idx})" if idx is not None else ""),
                "older NCCL uses GID 0, a RoCE v1 link-local GID that does not route across subnets; "
                "connections then fail or hang (NCCL >= 2.21 picks by NCCL_IB_ROCE_VERSION_NUM)",
                f"export NCCL_IB_GID_INDEX={idx if idx is not None else 'N'}"
                + ("" if idx is not None else "   # the 'RoCE v2' index: show_gids")))
        elif not gid_env.strip().isdigit() or int(gid_env) not in gids:
            out.append(Finding("roce-gid", "error",
                               f"NCCL_IB_GID_INDEX={gid_env} is not a populated GID on {p.device} port {p.port}",
                               "NCCL cannot create its queue pairs on that GID",
                               f"export NCCL_IB_GID_INDEX={idx if idx is not None else 'N'}"))
        elif "v2" not in gids[int(gid_env)][2].lower():
            out.append(Finding("roce-gid", "warn",
                               f"NCCL_IB_GID_INDEX={gid_env} is a {gids[int(gid_env)][2]} GID on {p.device}",
                               "RoCE v1 does not route across IP subnets",
                               f"export NCCL_IB_GID_INDEX={idx if idx is not None else 'N'}"))
        else:
            out.append(Finding("roce-gid", "ok", f"NCCL_IB_GID_INDEX={gid_env} is RoCE v2 on {p.device}"))
    return out


def _check_memory(host: HostInfo) -> list[Finding]:
    """Huge pages and locked memory: what they do (RDMA) and do not do (TCP)."""
    from lorasync.netdiag.tune import memory_advice

    return [Finding(a.check, a.severity, a.found, a.why, a.fix) for a in memory_advice(host)]


# -- rendezvous ----------------------------------------------------------------------------
def _rendezvous(env, endpoint: str | None) -> tuple[str, str, int] | None:
    """(endpoint, host, port) of the rendezvous to check: ``--rdzv-endpoint``,
    else MASTER_ADDR and MASTER_PORT; None when neither names one."""
    field = "--rdzv-endpoint"
    if endpoint is None and env.get("MASTER_ADDR"):
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
        field = "MASTER_ADDR/MASTER_PORT"
    if not endpoint:
        return None
    return (endpoint, *parse_hostport(endpoint, field, default_port=29400))


def _check_rendezvous(host: HostInfo, endpoint: str | None, nnodes: int | None) -> list[Finding]:
    rdzv = _rendezvous(host.env, endpoint)
    if rdzv is None:
        if nnodes == 1:
            return [Finding("rendezvous", "ok", "one node: lorasync train's stores listen on "
                            "loopback only")]
        return [Finding("rendezvous", "info", "no rendezvous endpoint to check",
                        "pass --rdzv-endpoint HOST:PORT (or set MASTER_ADDR/MASTER_PORT) to check "
                        "whether the c10d store is exposed")]
    endpoint, name, port = rdzv
    if _is_wildcard(name):
        return [Finding("rendezvous", "error", f"rendezvous endpoint {endpoint} is the wildcard "
                        "address", "0.0.0.0 / :: is where a server listens on every interface, "
                        "not an address a peer can connect to; a store on it is open on every "
                        "network this host has",
                        f"name this host's address on the training network (or the overlay's): "
                        f"--rdzv-endpoint ADDR:{port}")]
    addrs = host.resolve(name)
    best = _best_candidate(host)
    cands = ([best] if best else []) + [i for i in host.candidate_interfaces() if i is not best]
    subnet = next((net for i in cands for net in i.networks
                   if not is_public_address(net.split("/")[0])), "TRAINING_SUBNET")
    tunnel = (f"firewall the port from everything but the training subnet: iptables -I INPUT -p tcp "
              f"--dport {port} ! -s {subnet} -j DROP; across untrusted networks tunnel it instead: "
              f"ssh -N -L {port}:127.0.0.1:{port} USER@{name} on each other node and use "
              f"--rdzv-endpoint 127.0.0.1:{port}; for training across networks, an overlay "
              f"(lorasync tunnel) also carries gloo's connections and keeps the store on it")
    if not addrs:
        return [Finding("rendezvous", "error", f"rendezvous host {name!r} does not resolve",
                        "no rank can join", f"use an IP address: --rdzv-endpoint ADDR:{port}")]
    out = []
    public = [a for a in addrs if is_public_address(a)]
    if public:
        out.append(Finding(
            "rendezvous-exposed", "warn", f"rendezvous {endpoint} is on public address {public[0]}",
            "the c10d TCPStore has no authentication: anyone who reaches the port can join the job, "
            "read or overwrite its keys, or stall start-up", tunnel))
    elif all(is_loopback_address(a) for a in addrs):
        if nnodes and nnodes > 1:
            out.append(Finding(
                "rendezvous", "warn", f"rendezvous {endpoint} is on loopback but the job spans {nnodes} nodes",
                "other nodes reach it only through a tunnel (ssh -L); otherwise they cannot join",
                f"use an address of the training network: --rdzv-endpoint ADDR:{port}"))
        else:
            out.append(Finding("rendezvous", "ok", f"rendezvous {endpoint} is on loopback (local only)"))
    else:
        out.append(Finding("rendezvous", "ok", f"rendezvous {endpoint} is on private address {addrs[0]}"))
    local = host.local_addresses()
    my_public = sorted(a for a in local if is_public_address(a))
    if (set(addrs) & local or name in ("localhost", host.hostname())) and my_public:
        out.append(Finding(
            "rendezvous-bind", "warn",
            f"this host serves the rendezvous and has public address(es) {', '.join(my_public)}",
            "lorasync's launchers bind the stores to one address, but a plain torchrun agent "
            "listens on every interface whatever address the endpoint names, so port "
            f"{port} is reachable on {my_public[0]} too, without authentication",
            "launch with lorasync train --nnodes/--rdzv-endpoint or lorasync tunnel launch; "
            + tunnel))
    return out


# -- overlay ------------------------------------------------------------------------------
_OVERLAY_FIX = ("put the nodes on an overlay: lorasync tunnel init (plan), join (on each node), "
                "assemble, then tunnel up and tunnel launch -- train ... on every node "
                "(see docs/overlay.md)")


def overlay_interfaces(host: HostInfo) -> list:
    """Overlay interfaces here: WireGuard (kernel ``wireguard`` links, wireguard-go's
    TUN devices with their control socket in /var/run/wireguard, wg*), Tailscale
    (tailscale0) and ZeroTier (zt*); see :meth:`HostInfo.overlay_kind`."""
    return [i for i in host.interfaces() if host.overlay_kind(i)]


def _is_wildcard(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_unspecified
    except ValueError:
        return False


def _in_networks(addr: str, networks) -> bool:
    try:
        a = ipaddress.ip_address(addr)
        return any(a in ipaddress.ip_network(n, strict=False) for n in networks)
    except ValueError:
        return False


def _check_overlay(host: HostInfo, endpoint: str | None, nnodes: int | None) -> list[Finding]:
    """Does the job cross networks, and if so, does it run over an overlay?"""
    env = host.env
    rdzv = _rendezvous(env, endpoint)
    overlays = overlay_interfaces(host)
    gloo = [n for n in env.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    out = []
    names = {i.name for i in overlays}
    if overlays and gloo and not set(gloo) <= names and nnodes != 1:
        o = overlays[0]
        out.append(Finding(
            "overlay-unused", "warn", f"overlay {o.name} ({', '.join(o.addresses) or 'no address'}) is up "
            f"but GLOO_SOCKET_IFNAME={','.join(gloo)}",
            "training would bypass the overlay: nodes behind NAT stay unreachable and the traffic "
            "crosses the networks outside the tunnel",
            f"export GLOO_SOCKET_IFNAME={o.name} NCCL_SOCKET_IFNAME={o.name}   # or: lorasync tunnel launch"))
    if rdzv is None:
        return out
    endpoint, name, port = rdzv
    addrs = [a for a in host.resolve(name) if not is_loopback_address(a)]
    if not addrs:
        return out
    overlay_nets = [n for i in overlays for n in i.networks]
    local_nets = [n for i in host.candidate_interfaces() if i.name not in names for n in i.networks]
    a = addrs[0]
    o = host.overlay_to(a)
    if o is None and _in_networks(a, overlay_nets):
        o = next(i for i in overlays if _in_networks(a, i.networks))
    if o is not None:
        kind, addr = host.overlay_kind(o), (o.ipv4 or o.addresses or ["no address"])[0]
        found = (f"rendezvous {endpoint} is reached over {kind} overlay {o.name} "
                 f"({', '.join(o.networks) or addr})")
        if set(gloo) == {o.name}:
            out.append(Finding("overlay", "ok", f"{found}; GLOO_SOCKET_IFNAME={o.name}"))
        elif not gloo:
            out.append(Finding(
                "overlay", "info", f"{found}: lorasync train uses it (GLOO_SOCKET_IFNAME={o.name}, "
                f"stores on {addr})",
                "gloo and NCCL otherwise take the hostname's address or their own first interface, "
                "which may not reach the other nodes", f"with plain torchrun: export "
                f"GLOO_SOCKET_IFNAME={o.name} NCCL_SOCKET_IFNAME={o.name}"))
        return out
    spans = not _in_networks(a, local_nets)  # reached through a router: another network
    if overlays:
        o = overlays[0]
        out.append(Finding(
            "store-exposed", "error" if spans or (nnodes or 0) > 1 else "warn",
            f"overlay {o.name} is up but the rendezvous {endpoint} is outside it ({a})",
            "the c10d store has no authentication and lorasync passes per-rank metrics through it: "
            "outside the overlay anyone who reaches the port can read or overwrite its keys, or join "
            "the job",
            f"use the hub's overlay address: --rdzv-endpoint HUB_OVERLAY_ADDRESS:{port}, or "
            "lorasync tunnel launch (which also binds the stores to the overlay address)"))
    elif spans and nnodes != 1:
        out.append(Finding(
            "spans-networks", "warn",
            f"the rendezvous {a} is not on a network of this host (it is routed): the job spans "
            "networks and no overlay is in use",
            "gloo and NCCL connect every rank to every other on ephemeral ports: a node behind NAT "
            "or a firewall cannot be reached (start-up fails), and the unauthenticated store and "
            "the gradients cross the networks in the clear", _OVERLAY_FIX))
    return out


# -- exposure of what runs here -------------------------------------------------------------
def job_listeners(host: HostInfo) -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every TCP socket a lorasync or torchrun
    process of this host listens on (read from /proc: real hosts only)."""
    if host.fake:
        return []
    try:   # sockets of another network namespace are not on this host's interfaces
        here = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        here = None
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv).decode(errors="replace")
        if "lorasync" not in text and "torch.distributed.run" not in text and "torchrun" not in text:
            continue
        if pid == os.getpid():
            continue   # this doctor itself
        try:
            if here is not None and os.stat(f"/proc/{pid}/ns/net").st_ino != here:
                continue
        except OSError:
            continue
        inodes = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
        except OSError:
            continue
        if not inodes:
            continue
        for table, v6 in (("tcp", False), ("tcp6", True)):
            try:
                with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
                    rows = f.read()
            except OSError:
                continue
            for addr, port, inode in parse_proc_net_tcp(rows, v6, with_inode=True):
                if inode in inodes:
                    out.append((pid, text[:80], addr, port))
    return sorted(set(out))


def _check_exposure(host: HostInfo) -> list[Finding]:
    """Wildcard listeners of a job running here, and private keys others can read."""
    out = []
    listeners = job_listeners(host)
    wild = [x for x in listeners if _is_wildcard(x[2])]
    if wild:
        pid, cmd, _, _ = wild[0]
        where = ", ".join(f"{a}:{p} (pid {q})" for q, _, a, p in wild[:12])
        out.append(Finding(
            "exposure", "error",
            f"a running job listens on every address: {where}"
            + (f" and {len(wild) - 12} more" if len(wild) > 12 else "") + f"; pid {pid}: {cmd}",
            "a c10d store has no authentication: whoever reaches the port on any address of this "
            "host can list and write its keys, and torch unpickles what it reads from it",
            "launch with lorasync train or lorasync tunnel launch (they bind every store to one "
            "address); with plain torchrun, firewall the port to the training network"))
    elif listeners:
        out.append(Finding("exposure", "ok", "the running job listens on "
                           + ", ".join(sorted({f"{a}:{p}" for _, _, a, p in listeners})[:6])
                           + " only (no wildcard address)"))
    for path in _tunnel_key_files(host):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_mode & 0o077:
            out.append(Finding(
                "exposure", "error", f"private key {path} is readable by others "
                f"(mode {st.st_mode & 0o777:03o})",
                "whoever reads a node's WireGuard or SSH key can pose as that node on the "
                "overlay (the hub's SSH host key: as the hub)",
                f"chmod 600 {path}; then make a new key for the node (lorasync tunnel join) "
                "if others may have read it"))
    return out


def _tunnel_key_files(host: HostInfo) -> list[str]:
    """The private key of every tunnel this host runs (from their state files):
    a WireGuard node's key, an SSH-path node's key, the hub sshd's host key."""
    from lorasync.overlay import sshtun

    keys = []
    folder = host.path(str(TUNNELS_DIR).lstrip("/")) if host.fake else str(TUNNELS_DIR)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                config = json.load(f).get("config")
            with open(config, encoding="utf-8") as f:
                raw = json.load(f)
            key = raw.get("private_key_file")
            if raw.get("kind") == sshtun.KIND:
                files = sshtun.load_config(config).files()
                key = str(files["key" if raw.get("role") == "node" else "host_key"])
        except (OSError, ValueError, TypeError, AttributeError, LorasyncError):
            continue
        if isinstance(key, str) and key:
            keys.append(key if os.path.isabs(key) else os.path.join(os.path.dirname(config), key))
    return keys


def static_checks(host: HostInfo, *, nnodes: int | None = None, link: Link | None = None,
                  rdzv_endpoint: str | None = None, exposure: bool = True,
                  peers: tuple | list = ()) -> list[Finding]:
    """Every check that needs only this host. ``nnodes``: how many nodes the
    job spans (None: unknown), which decides how bad a loopback address is.
    ``exposure``: also look at the jobs running here (off inside a live
    check, which looks at its own job's stores).  ``peers``: addresses whose
    path MTU is probed (ICMP, a few seconds each when large packets are lost)."""
    link = link or default_link(host)
    return (_check_hostname(host, nnodes) + _check_ifname_env(host, nnodes) + _check_candidates(host, nnodes)
            + _check_mtu(host) + _check_tcp(host, link) + _check_rdma(host) + _check_memory(host)
            + _check_rendezvous(host, rdzv_endpoint, nnodes) + _check_overlay(host, rdzv_endpoint, nnodes)
            + (_check_exposure(host) if exposure else []) + _check_path_mtu(host, peers))


# -- live ------------------------------------------------------------------------------------
def _node_id(host: HostInfo) -> str:
    """Ranks on one network stack share it: boot id plus network namespace."""
    boot = ""
    try:
        with open(host.path("proc/sys/kernel/random/boot_id"), encoding="utf-8") as f:
            boot = f.read().strip()
    except OSError:
        boot = host.hostname()
    return f"{boot}/{host.netns().inode}"


def rank_facts(host: HostInfo, config_path: str | None = None) -> dict:
    """What one rank tells the others in a live check."""
    import lorasync
    try:
        import torch
        torch_v = torch.__version__
    except ImportError:
        torch_v = None
    cfg = None
    if config_path:
        try:
            with open(config_path, "rb") as f:
                cfg = hashlib.sha256(f.read()).hexdigest()[:16]
        except OSError as exc:
            cfg = f"unreadable: {exc.strerror}"
    ifname, addr = host.endpoint()
    iface = host.interface(ifname) if ifname else None
    gloo = host.env.get("GLOO_SOCKET_IFNAME")
    network = next((n for n in (iface.networks if iface else []) if addr and _in_networks(addr, [n])), None)
    return {
        "network": network, "overlay": bool(iface and iface in overlay_interfaces(host)),
        "store_listen": store_listeners(host),
        "hostname": host.hostname(), "node": _node_id(host), "lorasync": lorasync.__version__,
        "torch": torch_v, "python": platform.python_version(), "config_hash": cfg,
        "ifname": ifname, "addr": addr, "mtu": iface.mtu if iface else None,
        "gloo_ifnames": len([n for n in gloo.split(",") if n]) if gloo else 0,
        "nccl_ifname": host.env.get("NCCL_SOCKET_IFNAME"),
    }


def _store_ports(env) -> set[int]:
    ports = set()
    for value in (env.get("MASTER_PORT"), env.get("LORASYNC_RDZV_ENDPOINT", "").rpartition(":")[2]):
        if value and str(value).isdigit():
            ports.add(int(value))
    return ports


def parse_proc_net_tcp(text: str, ipv6: bool = False, with_inode: bool = False) -> list[tuple]:
    """(address, port) of every listening socket in /proc/net/tcp or tcp6
    (``with_inode``: (address, port, socket inode))."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 4 or f[3] != "0A":  # TCP_LISTEN
            continue
        hexaddr, _, hexport = f[1].partition(":")
        try:
            raw = bytes.fromhex(hexaddr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = str(ipaddress.IPv6Address(raw) if ipv6 else ipaddress.IPv4Address(raw))
            if with_inode:
                out.append((addr, int(hexport, 16), int(f[9]) if len(f) > 9 else -1))
            else:
                out.append((addr, int(hexport, 16)))
        except ValueError:
            continue
    return out


def store_listeners(host: HostInfo) -> list[str]:
    """Where this host's c10d stores listen (MASTER_PORT, the rendezvous port): "ADDR:PORT"."""
    ports = _store_ports(host.env)
    if not ports:
        return []
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(host.path("proc/net", name), encoding="ascii") as f:
                text = f.read()
        except OSError:
            continue
        out += [f"{a}:{p}" for a, p in parse_proc_net_tcp(text, v6) if p in ports]
    return sorted(set(out))


def _same(facts: list[dict], key: str) -> dict:
    groups: dict = {}
    for r, f in enumerate(facts):
        groups.setdefault(f.get(key), []).append(r)
    return groups


def _ranks_text(groups: dict) -> str:
    return "; ".join(f"{v!r} on rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}"
                     for v, rs in groups.items())


def live_checks(facts: list[dict], probe: dict | None = None) -> list[Finding]:
    """Cross-rank checks from every rank's :func:`rank_facts` (index = rank)
    and, when given, a probe result (slowest pair)."""
    n = len(facts)
    out = [Finding("reachable", "ok", f"all {n} ranks joined the process group and exchanged data")]
    for key, what, sev, why in (
            ("lorasync", "lorasync version", "error", "ranks running different code can disagree on "
             "the wire format of compressed gradients and hang"),
            ("torch", "torch version", "error", "collectives of different torch builds may not match"),
            ("config_hash", "config file", "error", "ranks would train with different settings"),
            ("python", "Python version", "info", "usually harmless, but pickled objects may differ")):
        g = _same(facts, key)
        if len(g) > 1:
            out.append(Finding(f"same-{key}", sev, f"{what} differs across ranks: {_ranks_text(g)}", why,
                               "install the same version on every node (pip install -e . from one commit)"
                               if key != "config_hash" else "copy one config file to every node"))
        elif key != "python" and next(iter(g)) is not None:
            out.append(Finding(f"same-{key}", "ok", f"same {what} on all ranks: {next(iter(g))}"))
    g = _same(facts, "gloo_ifnames")
    if len(g) > 1:
        out.append(Finding("gloo-ifname-count", "error",
                           f"GLOO_SOCKET_IFNAME lists different numbers of interfaces: {_ranks_text(g)}",
                           "gloo pairs the i-th device of every rank; ranks with different counts "
                           "fail to connect", "give every node the same number of names in GLOO_SOCKET_IFNAME"))
    g = _same(facts, "mtu")
    if len(g) > 1:
        per = ", ".join(f"rank {r}: {facts[r].get('ifname')} mtu {facts[r].get('mtu')}" for r in range(n))
        out.append(Finding(
            "mtu-mismatch", "warn", f"MTU differs across ranks ({per})",
            "frames larger than the smallest MTU are dropped on the way; TCP stalls until path-MTU "
            "discovery (often blocked) or tcp_mtu_probing recovers, RDMA fails outright",
            f"ip link set dev IFACE mtu {min(m for m in g if m)}   # the same on every node; and "
            f"sysctl -w net.ipv4.tcp_mtu_probing=1"))
    elif n > 1:
        out.append(Finding("mtu", "ok", f"same MTU on all ranks: {next(iter(g))}"))
    out += _overlay_live(facts)
    if probe and probe.get("pairs"):
        pairs = probe["pairs"]
        # against the fastest pair, not the median: one slow node out of three
        # is in 4 of the 6 directed pairs, which would make "slow" the median
        fastest = max(p["bandwidth_Bps"] for p in pairs)
        sp = min(pairs, key=lambda p: p["bandwidth_Bps"])

        def who(r):
            f = facts[r] if r < n else {}
            return f"rank {r} ({f.get('hostname')} {f.get('addr')})"
        text = (f"slowest link {who(sp['src'])} -> {who(sp['dst'])}: "
                f"{fmt_rate(sp['bandwidth_Bps'], 'bytes')}, fastest pair {fmt_rate(fastest, 'bytes')}")
        # a rank in every slow pair is the slow node, not the link
        slow = [p for p in pairs if p["bandwidth_Bps"] < 0.5 * fastest]
        if slow:
            common = set.intersection(*({p["src"], p["dst"]} for p in slow))
            where = ""
            if len(common) == 1 and len(slow) > 1:
                where = f"; rank {sorted(common)[0]} is in every slow pair: its NIC, cable or shaping"
            elif len(common) == 2 and n > 2:
                a, b = sorted(common)
                where = (f"; only the path between rank {a} and rank {b} is slow (both ranks are fast "
                         f"with the others): a switch port, route or shaper on that path")
            out.append(Finding(
                "slow-link", "warn", text + where,
                "synchronous all-reduce runs at the speed of its slowest link: every rank waits for it",
                "check that link (ethtool IFACE for speed/duplex, tc qdisc show, cabling); or exclude "
                "that node; lorasync plan can pick a strategy sending fewer bytes"))
        else:
            out.append(Finding("slow-link", "ok", text))
    return out


def _overlay_live(facts: list[dict]) -> list[Finding]:
    """Across ranks: networks spanned, overlay in use, where the stores listen."""
    out = []
    by_node = {f.get("node"): f for f in facts}
    nets = {f.get("network") for f in by_node.values() if f.get("network")}
    overlay = bool(facts) and all(f.get("overlay") for f in facts)
    spans = len(nets) > 1
    if overlay:
        out.append(Finding("overlay", "ok", f"every rank runs over the overlay ({', '.join(sorted(nets))})"))
    elif spans:
        out.append(Finding(
            "spans-networks", "warn", f"the ranks' addresses are in {len(nets)} networks "
            f"({', '.join(sorted(nets))}) and no overlay is in use",
            "traffic between the networks is routed: a node behind NAT or a firewall cannot be "
            "reached by the others, and the unauthenticated store and the gradients cross the "
            "networks in the clear", _OVERLAY_FIX))
    wild = sorted({(r, a) for r, f in enumerate(facts) for a in f.get("store_listen") or []
                   if _is_wildcard(a.rsplit(":", 1)[0])})
    if wild:
        r, a = wild[0]
        out.append(Finding(
            "store-exposed", "error" if spans or overlay else "warn",
            f"the c10d store on rank {r}'s node listens on every address ({a})"
            + (" although the job runs over the overlay" if overlay else
               " and the job spans networks" if spans else ""),
            "the store has no authentication and lorasync passes per-rank metrics through it: anyone "
            "who reaches that port on any of the node's addresses can read or overwrite its keys, or "
            "join the job",
            "launch with lorasync train or lorasync tunnel launch (they bind every store to one "
            "address), or firewall the port to the training network"))
    elif any(f.get("store_listen") for f in facts):
        where = sorted({a for f in facts for a in f.get("store_listen") or []})
        out.append(Finding("store-exposed", "ok", f"the c10d stores listen on {', '.join(where)} only"))
    return out


def merge_findings(per_rank: list[list[Finding]]) -> list[Finding]:
    """One finding per (check, severity, found), with the ranks that saw it."""
    merged: dict = {}
    for rank, fs in enumerate(per_rank):
        for f in fs:
            key = (f.check, f.severity, f.found)
            if key not in merged:
                merged[key] = Finding(f.check, f.severity, f.found, f.why, f.fix, [])
            merged[key].ranks.append(rank)
    return list(merged.values())


# -- text ---------------------------------------------------------------------------------------
_MARK = {"ok": "ok", "info": "info", "warn": "WARN", "error": "ERROR"}


def format_findings(findings: list[Finding], *, verbose: bool = False, world: int | None = None) -> str:
    """A table: severity, check, what was found; why and fix under each non-ok row."""
    order = sorted(findings, key=lambda f: -SEVERITIES.index(f.severity))
    w = max([len(f.check) for f in findings] + [5])
    lines = [f"{'severity':<8} {'check':<{w}} found"]
    for f in order:
        found = f.found
        if f.ranks and world and len(f.ranks) < world:
            found += f"  [rank{'s' if len(f.ranks) > 1 else ''} {','.join(map(str, f.ranks))}]"
        lines.append(f"{_MARK[f.severity]:<8} {f.check:<{w}} {found}")
        if f.severity != "ok" or verbose:
            if f.why:
                lines.append(f"{'':<9}  why: {f.why}")
            if f.fix:
                lines.append(f"{'':<9}  fix: {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    lines.append(f"{counts['error']} error(s), {counts['warn']} warning(s), {counts['info']} note(s), "
                 f"{counts['ok']} ok")
    return "\n".join(lines)
