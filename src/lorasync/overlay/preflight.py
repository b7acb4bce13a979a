"""What a node's tunnel needs of this host, checked before anything starts
(:func:`preflight`: root, the tools, the key file, the interface name, the
overlay address, the UDP port, the endpoints; each failure names the fix),
and the MTU its device gets (:func:`choose_mtu`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
from pathlib import Path
from typing import Iterable

from lorasync.errors import ConfigError
from lorasync.hostops import as_root, pid_alive, require_root
from lorasync.overlay import sshtun
from lorasync.overlay import wireguard as wg
from lorasync.overlay.config import (TunnelConfig, check_key_matches, load_config, resolve_endpoint,
                                     split_endpoint)
from lorasync.overlay.supervisor import states

__all__ = ["check_address_clash", "check_port_free", "check_root", "choose_mtu",
           "local_addresses", "preflight"]


def check_root() -> None:
    """A tunnel needs root: raise the error that says so, unless we are root."""
    require_root("a tunnel needs root (TUN device, addresses, routes)",
                 f"run as root, e.g. {as_root('tunnel up ...')}")


def preflight(config: str | Path) -> TunnelConfig:
    """Everything ``up`` checks before it starts anything: root, the tools, the
    key file, the interface name, the overlay address, the UDP port, the
    endpoints (each failure names the fix)."""
    cfg = load_config(config)   # a bad file is the first thing to fix, root or not
    check_root()
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


def local_addresses() -> list[tuple[str, str]]:
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
    for ifname, cidr in (local_addresses() if addresses is None else addresses):
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
        for ifname, cidr in local_addresses():
            if ifname in ("lo", cfg.ifname):
                continue
            with contextlib.suppress(OSError, ValueError):
                mtus.append(int(Path(f"/sys/class/net/{ifname}/mtu").read_text()))
        seen = [(min(mtus), False)] if mtus else []
    return wg.overlay_mtu(seen)
