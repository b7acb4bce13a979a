"""WireGuard as the overlay's engine: Debian's ``wireguard-go`` (userspace, over
TUN) configured with ``wg`` from ``wireguard-tools``.

This module owns every call to those two tools and the kernel plumbing of one
overlay interface (address, MTU, routes, the relay's forwarding rules):

- keys: :func:`generate_keypair` runs ``wg genkey`` / ``wg pubkey`` through
  pipes, :func:`write_private_key` creates the file 0600 before anything is
  written to it, :func:`check_key_file` refuses a key others can read,
  :func:`public_key_of` derives a key file's public key (``wg pubkey``, the
  file as its stdin).  A private key never appears on a command line
  (``wg set ... private-key FILE`` reads the file), in a log, an error
  message or a return value other than :func:`generate_keypair`'s;
- the device: :func:`start_daemon` runs ``wireguard-go -f IFNAME`` as a child
  of the caller (the supervisor in :mod:`lorasync.overlay.wgsupervisor`),
  :func:`configure` applies port, key and peers with ``wg set``, then the
  address, MTU and routes with ``ip``;
- state: :func:`show` parses ``wg show IFNAME dump`` into :class:`DeviceState`
  (the dump's first field, the private key, is dropped while parsing);
- the relay: on the hub, packets arriving on the overlay may leave only on the
  overlay (per-interface forwarding, plus an nft table that drops anything
  routed between the overlay and another interface).

wireguard-go's control socket lives in ``/var/run/wireguard/IFNAME.sock``,
one directory for every network namespace of the host, so interface names
must be unique host-wide (the emulated cluster derives them from its name).
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Sequence

from lorasync.errors import ConfigError, EnvironmentProblem

__all__ = [
    "INSTALL_HINT",
    "DeviceState",
    "PeerConfig",
    "PeerState",
    "check_key_file",
    "configure",
    "generate_keypair",
    "is_public_key",
    "nft_table_name",
    "parse_dump",
    "path_mtu",
    "public_key_of",
    "relay_ruleset",
    "require_tools",
    "show",
    "socket_path",
    "start_daemon",
    "stop_daemon",
    "write_private_key",
]

INSTALL_HINT = "apt-get install -y wireguard-go wireguard-tools"
SOCKET_DIR = Path("/var/run/wireguard")
#: bytes WireGuard adds to every packet: outer IPv4 (20) or IPv6 (40), UDP (8),
#: its own header and tag (32)
OVERHEAD_V4 = 60
OVERHEAD_V6 = 80
#: wireguard-go handles packets up to 64 KiB; the TUN device's MTU is capped below that
MAX_MTU = 65000 - OVERHEAD_V4
MIN_MTU = 1280
_IP_MTU_DISCOVER, _IP_PMTUDISC_DO, _IP_MTU, _IPV6_MTU = 10, 2, 14, 24


# ---------------------------------------------------------------- tools and keys

def require_tools(need_nft: bool = False) -> None:
    """EnvironmentProblem naming the install command when a tool is missing."""
    missing = [t for t in ("wireguard-go", "wg") if not shutil.which(t)]
    if missing:
        raise EnvironmentProblem(
            f"{' and '.join(missing)} not found: the overlay runs WireGuard in userspace "
            f"(wireguard-go over TUN, configured with wg); install them: {INSTALL_HINT}")
    if not shutil.which("ip"):
        raise EnvironmentProblem("'ip' not found: install iproute2 (apt-get install -y iproute2)")
    if need_nft and not shutil.which("nft"):
        raise EnvironmentProblem(
            "'nft' not found: the hub relays between peers behind NAT and keeps relayed packets "
            "on the overlay with an nft table; install it: apt-get install -y nftables")
    if not os.path.exists("/dev/net/tun"):
        raise EnvironmentProblem("/dev/net/tun is missing: wireguard-go needs TUN "
                                 "(modprobe tun, or give the container --device /dev/net/tun)")


def _wg(args: Sequence[str], stdin: str | None = None, netns: str | None = None,
        what: str = "wg") -> str:
    argv = (["ip", "netns", "exec", netns] if netns else []) + ["wg", *args]
    if not shutil.which("wg"):
        raise EnvironmentProblem(f"wg not found: the overlay's keys and configuration need "
                                 f"wireguard-tools; install them: {INSTALL_HINT}")
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        # wg's own message only: our arguments never hold a key, its output might
        err = proc.stderr.strip().splitlines()
        raise EnvironmentProblem(f"{what} failed: {err[-1] if err else f'exit {proc.returncode}'}")
    return proc.stdout


def generate_keypair() -> tuple[str, str]:
    """(private, public) keys, base64, from ``wg genkey`` and ``wg pubkey``."""
    private = _wg(["genkey"], what="wg genkey").strip()
    public = _wg(["pubkey"], stdin=private + "\n", what="wg pubkey").strip()
    return private, public


def public_key_of(path: str | Path) -> str:
    """The public key of the private key in ``path`` (``wg pubkey`` reads the
    file as its stdin: the key is neither on a command line nor in a message).
    ConfigError when the file holds no WireGuard private key."""
    if not shutil.which("wg"):
        raise EnvironmentProblem(f"wg not found: install wireguard-tools: {INSTALL_HINT}")
    with open(path, "rb") as f:
        proc = subprocess.run(["wg", "pubkey"], stdin=f, capture_output=True, text=True)
    public = proc.stdout.strip()
    if proc.returncode != 0 or not is_public_key(public):
        raise ConfigError("private_key_file", str(path), "does not hold a WireGuard private key: "
                          "make a new one on this node with `lorasync tunnel join`")
    return public


def is_public_key(text) -> bool:
    """A WireGuard key as wg writes it: 32 bytes in base64 (44 characters)."""
    if not isinstance(text, str) or len(text) != 44 or not text.endswith("="):
        return False
    try:
        return len(base64.b64decode(text, validate=True)) == 32
    except ValueError:
        return False


def write_private_key(path: str | Path, key: str) -> None:
    """Create ``path`` with mode 0600 (whatever the umask) and write ``key``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)


def check_key_file(path: str | Path) -> None:
    """ConfigError unless ``path`` is a regular file that only its owner can read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError("private_key_file", str(path), "no such file: a node's key is made on "
                          "that node by `lorasync tunnel join NODE.plan.json` and never leaves "
                          "it; run that here, carry back its NODE.pub.json and assemble again") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError("private_key_file", str(path), "not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError("private_key_file", str(path),
                          f"readable by others (mode {stat.S_IMODE(st.st_mode):04o}); a WireGuard "
                          f"private key must be private: chmod 600 {path}")
    if st.st_uid != os.geteuid():
        raise ConfigError("private_key_file", str(path),
                          f"owned by uid {st.st_uid}, not by this user: chown {os.geteuid()} {path}")


# ---------------------------------------------------------------- wg show

@dataclasses.dataclass
class PeerState:
    """One peer as ``wg show dump`` reports it."""

    public_key: str
    endpoint: str | None
    allowed_ips: list[str]
    latest_handshake: int
    """Unix time of the last completed handshake; 0 = never."""
    rx_bytes: int
    tx_bytes: int
    keepalive_s: int | None

    def handshake_age(self, now: float | None = None) -> float | None:
        """Seconds since the last handshake; None if there never was one."""
        if not self.latest_handshake:
            return None
        return max(0.0, (time.time() if now is None else now) - self.latest_handshake)


@dataclasses.dataclass
class DeviceState:
    """One interface: its public key, UDP port and peers (no private key)."""

    public_key: str
    listen_port: int
    peers: list[PeerState]

    def peer(self, public_key: str) -> PeerState | None:
        return next((p for p in self.peers if p.public_key == public_key), None)


def _none(field: str) -> str | None:
    return None if field in ("(none)", "") else field


def parse_dump(text: str) -> DeviceState:
    """``wg show IFNAME dump`` -> :class:`DeviceState`.

    Line 1: private-key, public-key, listen-port, fwmark (the private key is
    dropped here); one line per peer: public-key, preshared-key, endpoint,
    allowed-ips, latest-handshake, rx, tx, persistent-keepalive, tab-separated.
    A malformed line raises ValueError naming its line number, not its text.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("wg show dump: empty output")
    head = lines[0].split("\t")
    if len(head) != 4 or not head[2].isdigit():
        raise ValueError("wg show dump: line 1 is not an interface line")
    peers = []
    for no, line in enumerate(lines[1:], start=2):
        f = line.split("\t")
        if len(f) != 8 or not (f[4].isdigit() and f[5].isdigit() and f[6].isdigit()):
            raise ValueError(f"wg show dump: line {no} is not a peer line")
        ips = [] if f[3] == "(none)" else [a for a in f[3].split(",") if a]
        keep = None if f[7] in ("off", "0") else int(f[7])
        peers.append(PeerState(public_key=f[0], endpoint=_none(f[2]), allowed_ips=ips,
                               latest_handshake=int(f[4]), rx_bytes=int(f[5]),
                               tx_bytes=int(f[6]), keepalive_s=keep))
    return DeviceState(public_key=head[1], listen_port=int(head[2]), peers=peers)


def show(ifname: str, netns: str | None = None) -> DeviceState:
    return parse_dump(_wg(["show", ifname, "dump"], netns=netns, what=f"wg show {ifname}"))


# ---------------------------------------------------------------- the device

def socket_path(ifname: str) -> Path:
    """wireguard-go's control socket for ``ifname`` (shared by every namespace)."""
    return SOCKET_DIR / f"{ifname}.sock"


def start_daemon(ifname: str, log, go_threads: int | None = None) -> subprocess.Popen:
    """Start ``wireguard-go -f ifname`` in this namespace; return once its
    control socket answers.  ``log`` is a binary file for its output.

    ``go_threads``: GOMAXPROCS, the threads that run its Go code at once
    (default: one per core).  An emulated cluster gives 1: its daemons share
    this host's cores, and with one thread each they spent about half the
    CPU per MB at 100 Mbit/s, at the same throughput: Go's idle threads spin
    looking for work after every packet (``bench/overlay.py --parts cpu``,
    docs/connectivity.md)."""
    stale = socket_path(ifname)
    if stale.exists() and not _socket_alive(stale):
        stale.unlink()  # left by a daemon that was killed; wireguard-go would refuse
    env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
    if go_threads:
        env["GOMAXPROCS"] = str(go_threads)
    proc = subprocess.Popen(["wireguard-go", "-f", ifname], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, env=env, close_fds=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EnvironmentProblem(f"wireguard-go {ifname} exited with code {proc.returncode} "
                                     f"at start (see its log)")
        if _socket_alive(socket_path(ifname)):
            return proc
        time.sleep(0.02)
    stop_daemon(proc, ifname)
    raise EnvironmentProblem(f"wireguard-go {ifname} did not open its control socket within 10 s")


def _socket_alive(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def stop_daemon(proc: subprocess.Popen | None, ifname: str) -> None:
    """Stop wireguard-go (its TUN device goes with it) and remove what it leaves."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if Path(f"/sys/class/net/{ifname}").exists():
        subprocess.run(["ip", "link", "del", ifname], capture_output=True)
    path = socket_path(ifname)
    if path.exists() and not _socket_alive(path):
        path.unlink()


@dataclasses.dataclass
class PeerConfig:
    """What ``wg set`` needs about one peer."""

    public_key: str
    allowed_ips: list[str]
    endpoint: str | None = None
    """HOST:PORT (resolved by wg) or None: a peer behind NAT, learnt from its handshakes."""
    keepalive_s: int | None = None


def peer_args(p: PeerConfig) -> list[str]:
    args = ["peer", p.public_key, "allowed-ips", ",".join(p.allowed_ips) or "0.0.0.0/32"]
    if p.endpoint:
        args += ["endpoint", p.endpoint]
    if p.keepalive_s:
        args += ["persistent-keepalive", str(p.keepalive_s)]
    return args


def configure(ifname: str, *, key_file: str | Path, listen_port: int, peers: Sequence[PeerConfig],
              address: str, prefixlen: int, mtu: int, routes: Sequence[str] = (),
              relay: bool = False, relay_also: Sequence[str] = ()) -> None:
    """Key, port and peers with ``wg set``; address, MTU and routes with ``ip``;
    with ``relay``, forwarding between peers (this node is the hub)."""
    args = ["set", ifname, "listen-port", str(listen_port), "private-key", str(key_file)]
    for p in peers:
        args += peer_args(p)
    _wg(args, what=f"wg set {ifname}")
    _ip(["addr", "replace", f"{address}/{prefixlen}", "dev", ifname])
    _ip(["link", "set", ifname, "mtu", str(mtu), "up"])
    for r in routes:
        _ip(["route", "replace", r, "dev", ifname])
    if relay:
        # forwarding for packets that arrive on the overlay only (not host-wide), and
        # an nft table so that they can leave on the overlay only
        Path(f"/proc/sys/net/ipv4/conf/{ifname}/forwarding").write_text("1\n")
        _nft(relay_ruleset(ifname, relay_also))


def set_peer(ifname: str, peer: PeerConfig) -> None:
    _wg(["set", ifname, *peer_args(peer)], what=f"wg set {ifname}")


def add_probe_peer(ifname: str, public_key: str, endpoint: str, keepalive_s: int) -> None:
    """A peer at ``endpoint`` with no allowed IPs (nothing is routed to it) whose
    keepalive makes WireGuard handshake with it: a hole-punching try."""
    _wg(["set", ifname, "peer", public_key, "allowed-ips", "", "endpoint", endpoint,
         "persistent-keepalive", str(keepalive_s)], what=f"wg set {ifname}")


def set_allowed_ips(ifname: str, public_key: str, allowed_ips: Sequence[str]) -> None:
    """Replace a peer's allowed IPs (WireGuard takes each from the peer that had it)."""
    _wg(["set", ifname, "peer", public_key, "allowed-ips", ",".join(allowed_ips)],
        what=f"wg set {ifname}")


def remove_peer(ifname: str, public_key: str) -> None:
    _wg(["set", ifname, "peer", public_key, "remove"], what=f"wg set {ifname}")


def _ip(args: Sequence[str]) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise EnvironmentProblem(f"`ip {' '.join(args)}` failed: {err[-1] if err else proc.returncode}")


def nft_table_name(ifname: str) -> str:
    return "lsync_" + ifname.replace("-", "_").replace(".", "_")


def relay_ruleset(ifname: str, also: Sequence[str] = ()) -> str:
    """nft table for the hub: relayed packets stay on the overlay.

    Forwarding is enabled for ``ifname`` alone; this table drops what would be
    routed from the overlay to another interface or the other way, so the
    overlay's peers do not reach the hub's other networks through it.
    ``also``: the overlay's other interfaces here (the tun devices of nodes on
    the SSH path), between which and ``ifname`` packets may pass.
    """
    t = nft_table_name(ifname)
    ours = f'{{ {", ".join(chr(34) + n + chr(34) for n in [ifname, *also])} }}' if also else f'"{ifname}"'
    return (f"table inet {t} {{\n"
            f"  chain forward {{\n"
            f"    type filter hook forward priority filter; policy accept;\n"
            f"    iifname \"{ifname}\" oifname != {ours} drop\n"
            f"    oifname \"{ifname}\" iifname != {ours} drop\n"
            f"  }}\n"
            f"}}\n")


def _nft(ruleset: str) -> None:
    proc = subprocess.run(["nft", "-f", "-"], input=ruleset, capture_output=True, text=True)
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise EnvironmentProblem(f"nft failed: {err[0] if err else proc.returncode}")


def remove_relay(ifname: str) -> bool:
    """Delete the relay's nft table; True if there was one."""
    if not shutil.which("nft"):
        return False
    proc = subprocess.run(["nft", "delete", "table", "inet", nft_table_name(ifname)],
                          capture_output=True, text=True)
    return proc.returncode == 0


# ---------------------------------------------------------------- MTU

def path_mtu(host: str, port: int) -> int | None:
    """The kernel's path MTU towards ``host:port`` (route or interface MTU,
    lowered by any ICMP 'fragmentation needed' it has seen), or None when
    there is no route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return None
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_DGRAM)
    try:
        # <linux/in.h>, <linux/in6.h>: Python's socket module lacks some of these
        if family == socket.AF_INET:
            s.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
        s.connect(addr)
        if family == socket.AF_INET:
            return int(s.getsockopt(socket.IPPROTO_IP, _IP_MTU))
        return int(s.getsockopt(socket.IPPROTO_IPV6, _IPV6_MTU))
    except OSError:
        return None
    finally:
        s.close()


def overlay_mtu(path_mtus: Sequence[tuple[int, bool]]) -> int:
    """Overlay MTU from (path MTU, is_ipv6) of every endpoint: the smallest
    path MTU less WireGuard's overhead, within [1280, 64940]."""
    if not path_mtus:
        return 1420  # wg-quick's default for an unknown path
    mtu = min(m - (OVERHEAD_V6 if v6 else OVERHEAD_V4) for m, v6 in path_mtus)
    return max(MIN_MTU, min(MAX_MTU, mtu))


def is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False
