"""Path MTU to a peer, black holes included: ICMP echo probes with DF set.

A path MTU *black hole* is a link on the path with a smaller MTU whose
router's ICMP "fragmentation needed" never arrives (a firewall drops all
ICMP, or a tunnel swallows it): the sender keeps its larger MTU, every
full-size packet is dropped and every small one passes.  TCP connects (the
handshake is small), then the first large write stalls until a
retransmission timeout, again and again; a WireGuard overlay whose MTU is
above the path's loses every full-size tunnel packet the same way.

:func:`find_path_mtu` sends ICMP echo requests of a few sizes with DF set
(``IP_PMTUDISC_PROBE``: the kernel's cached path MTU is ignored, so every
size really goes out) and bisects between the largest that is answered and
the smallest that is not.  Afterwards the kernel's cached path MTU towards the
peer says whether the network reported the limit (an ICMP "fragmentation
needed" lowers it) or kept quiet (a black hole).  Raw ICMP needs root
(CAP_NET_RAW); without it, unprivileged ICMP sockets where
``net.ipv4.ping_group_range`` allows them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import select
import socket
import struct
import time

__all__ = ["PathMTU", "find_path_mtu", "kernel_path_mtu", "probe"]

# <linux/in.h>: Python's socket module lacks these
_IP_MTU_DISCOVER = 10
_IP_PMTUDISC_DO = 2
_IP_PMTUDISC_PROBE = 3
_IP_MTU = 14
_IP_ICMP_HEADERS = 28  # IPv4 header 20 + ICMP echo header 8
#: the smallest MTU every IPv4 host must take (RFC 791) and IPv6's minimum
_FLOOR, _IPV6_MIN = 576, 1280


@dataclasses.dataclass
class PathMTU:
    """What the probes found towards ``peer``; sizes are whole IP packets.

    ``largest_ok``: the largest size answered (None: no size was);
    ``smallest_lost``: the smallest size not answered (None: all were);
    ``local_mtu``: the kernel's path MTU before probing (the route or
    interface MTU; what the host sends up to); ``reported_mtu``: the kernel's
    path MTU after probing (lowered when the network sent "fragmentation
    needed").
    """

    peer: str
    local_mtu: int | None
    largest_ok: int | None
    smallest_lost: int | None
    reported_mtu: int | None
    probes: list = dataclasses.field(default_factory=list)  # [(size, "ok"|"lost"|"too big here")]
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.largest_ok is not None

    @property
    def path_mtu(self) -> int | None:
        """The largest packet that crosses the path, as far as the probes tell."""
        return self.largest_ok

    @property
    def blackhole(self) -> bool:
        """Large packets vanish and nothing said why: the kernel still believes
        a size that was lost fits."""
        return (self.largest_ok is not None and self.smallest_lost is not None
                and (self.reported_mtu or 0) >= self.smallest_lost)

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), path_mtu=self.path_mtu, blackhole=self.blackhole)


def kernel_path_mtu(peer: str) -> int | None:
    """The kernel's path MTU towards ``peer`` (route or interface MTU, lowered
    by any "fragmentation needed" it has seen), or None without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
            s.connect((peer, 9))  # UDP connect sends nothing: it picks the route
            return int(s.getsockopt(socket.IPPROTO_IP, _IP_MTU))
        except OSError:
            return None


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _open() -> tuple[socket.socket, bool]:
    """An ICMP socket: raw (root), else an unprivileged ICMP datagram socket."""
    try:
        return socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP), True
    except PermissionError:
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP), False


class _Pinger:
    def __init__(self, peer: str):
        self.peer = peer
        self.sock, self.raw = _open()
        self.sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_PROBE)
        self.ident = os.getpid() & 0xFFFF
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def echo(self, size: int, timeout_s: float) -> str:
        """One echo request of ``size`` bytes (IP packet): "ok", "lost" or
        "too big here" (larger than this host's own interface allows)."""
        self.seq = (self.seq + 1) & 0xFFFF
        payload = bytes(max(0, size - _IP_ICMP_HEADERS))
        header = struct.pack("!BBHHH", 8, 0, 0, self.ident, self.seq)
        packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), self.ident, self.seq) + payload
        try:
            self.sock.sendto(packet, (self.peer, 0))
        except OSError as exc:
            if exc.errno == 90:  # EMSGSIZE: above the local MTU
                return "too big here"
            raise
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                break
            try:
                data, src = self.sock.recvfrom(65535)
            except OSError:
                continue  # a queued error (unprivileged sockets): keep waiting
            if src[0] != self.peer:
                continue
            if self.raw:
                data = data[(data[0] & 0x0F) * 4:]  # past the IP header
            if len(data) < 8:
                continue
            kind, _, _, ident, seq = struct.unpack("!BBHHH", data[:8])
            # an unprivileged socket's id is its port, rewritten by the kernel: match seq only
            if kind == 0 and seq == self.seq and (ident == self.ident or not self.raw):
                return "ok"
        return "lost"


def probe(peer: str, size: int, *, timeout_s: float = 0.3, tries: int = 3) -> str:
    """One size, ``tries`` times: "ok" as soon as one is answered."""
    p = _Pinger(peer)
    try:
        return _try(p, size, timeout_s, tries)
    finally:
        p.close()


def _try(p: _Pinger, size: int, timeout_s: float, tries: int) -> str:
    out = "lost"
    for _ in range(tries):
        out = p.echo(size, timeout_s)
        if out != "lost":
            return out
    return out


def find_path_mtu(peer: str, *, high: int | None = None, timeout_s: float = 0.3, tries: int = 3,
                  step: int = 8) -> PathMTU:
    """Probe ``peer`` (an IPv4 address or name): the largest packet that
    crosses, bisected to ``step`` bytes between the local MTU (``high``) and
    the smallest size answered; a path that answers at the local MTU costs
    one round trip.  Never raises for the network: ``error`` says what went
    wrong (no permission for ICMP, no route, a name that does not resolve)."""
    try:
        addr = str(ipaddress.IPv4Address(socket.gethostbyname(peer)))
    except (OSError, ValueError) as exc:
        return PathMTU(peer, None, None, None, None, error=f"{peer} does not resolve: {exc}")
    local = kernel_path_mtu(addr)
    top = int(min(m for m in (high, local) if m) if (high or local) else 1500)
    out = PathMTU(addr, local, None, None, None)
    try:
        pinger = _Pinger(addr)
    except OSError as exc:
        out.error = (f"no ICMP socket ({exc.strerror or exc}): run as root, or allow unprivileged "
                     "ICMP: sysctl -w net.ipv4.ping_group_range='0 2147483647'")
        return out
    try:
        def run(size: int) -> str:
            r = _try(pinger, size, timeout_s, tries)
            out.probes.append((size, r))
            return r

        if run(top) == "ok":
            out.largest_ok = top
        else:
            out.smallest_lost = top
            lo = next((s for s in (_IPV6_MIN, _FLOOR) if s < top and run(s) == "ok"), None)
            if lo is not None:
                out.largest_ok, hi = lo, top
                while hi - lo > step:
                    mid = (lo + hi) // 2
                    if run(mid) == "ok":
                        lo = out.largest_ok = mid
                    else:
                        hi = out.smallest_lost = mid
    except OSError as exc:
        out.error = f"probing {addr} failed: {exc.strerror or exc}"
    finally:
        pinger.close()
    out.reported_mtu = kernel_path_mtu(addr)
    return out
