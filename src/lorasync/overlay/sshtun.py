"""The overlay's TCP path: layer 3 over SSH's tun forwarding (``ssh -w``).

Where UDP cannot reach the hub (networks that let only TCP out), a node joins
the overlay through an SSH connection to the hub instead of WireGuard:
OpenSSH's tun forwarding (``ssh -w N:M``, sshd ``PermitTunnel
point-to-point``) carries IP packets between a TUN device on the node and one
on the hub, so gloo's full mesh runs over it unchanged (an ``ssh -L`` port
forward carries one port, not the mesh).  The hub routes between its SSH
nodes and its WireGuard peers, as it relays between peers behind NAT.

This module owns:

* the files: an ed25519 client key made per overlay, the hub's own host key
  (``StrictHostKeyChecking yes`` against a known_hosts file the overlay wrote:
  no trust-on-first-use prompt), ``authorized_keys`` (the key may open one
  tun device, nothing else: ``restrict``, ``tunnel="N"``, a forced command)
  and the sshd config (:func:`sshd_config`: it listens on the hub's one
  address, never a wildcard);
* the supervisor (:class:`Supervisor`), one per node, run in the background
  as ``python -m lorasync.overlay.sshtun supervise CONFIG``: on the hub it
  runs ``sshd -D`` with the TUN devices of its SSH nodes; on a node it runs
  ``ssh -N -w`` (keepalives: ``ServerAliveInterval``/``CountMax``) and
  starts it again when it exits, after a backoff as autossh does (a
  connection that lived past the gate time is restarted at once, one that
  died young waits 0.5, 1, 2 ... s, at most :data:`BACKOFF` [1]); what it
  shares with WireGuard's supervisor is :mod:`lorasync.overlay.supervisor`'s.

The TUN devices are persistent (``ip tuntap add``) and made by the
supervisor, not by ssh: ssh and sshd attach to them by name (``tunN``).
When the SSH connection drops, the device, its address and its routes stay;
packets sent meanwhile are lost and TCP (gloo's connections) retransmits
them once the supervisor's new ssh has attached again.  A drop costs a slower
step, not a broken connection.

State: ``/run/lorasync/tunnels/NAME.json`` (as the WireGuard tunnels': ``tunnel
status`` and ``tunnel down`` read it), events in ``NAME.log``, ssh's and
sshd's own output in ``NAME.ssh.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lorasync.errors import ConfigError, EnvironmentProblem, LorasyncError
from lorasync.hostops import TUNNELS_DIR, pid_alive, stop_process
from lorasync.overlay import linktest
from lorasync.overlay.supervisor import (BaseSupervisor, argv_of, end_process, ready_line,
                                         remove_state, serve, spawn)

__all__ = [
    "BACKOFF",
    "GATE_S",
    "KIND",
    "SSHD",
    "Supervisor",
    "authorized_keys_line",
    "down_one",
    "known_hosts_line",
    "make_keypair",
    "next_delay",
    "require_tools",
    "ssh_argv",
    "sshd_config",
    "status_one",
    "tun_number",
]

KIND = "lorasync-ssh-transport"
#: Debian's openssh-server installs it here (and it must be started by its absolute path)
SSHD = "/usr/sbin/sshd"
#: seconds before starting ssh again after it died young, doubled per failure up to [1]
BACKOFF = (0.5, 8.0)
#: a connection that lived this long is restarted at once when it drops (autossh's gate time)
GATE_S = 10.0
#: keepalives: an unanswered connection is given up after interval x count seconds (30 s):
#: an outage shorter than that is ridden out by TCP under the tunnel, as on a direct link
#: (shorter keepalives make ssh reconnect after a brief outage, and a reconnect takes longer
#: than TCP's own retransmission); a killed ssh is seen at once (its process exits, the hub
#: gets a FIN)
ALIVE_INTERVAL_S = 10
ALIVE_COUNT = 3
#: what ssh says when the hub still holds this node's tun device for an older connection
#: (until sshd's ClientAlive check drops it): retried at the shortest delay, not backed off
BUSY = "Tunnel forwarding failed"
#: TUN device numbers: node I of the overlay plan uses tun(TUN_BASE + I) on both ends
TUN_BASE = 100
#: the SSH path's MTU: ssh and sshd read a tun packet into a 16 KiB buffer (CHAN_RBUF in
#: OpenSSH's channels.c) and pay per packet, not per byte: large packets, few of them
DEFAULT_MTU = 16000


def tun_number(index: int) -> int:
    return TUN_BASE + int(index)


def require_tools(server: bool) -> None:
    """EnvironmentProblem naming the Debian package when ssh (or sshd) is missing."""
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        raise EnvironmentProblem("'ssh' not found: the overlay's TCP path runs over SSH; install "
                                 "it: apt-get install -y openssh-client")
    if server and not os.access(SSHD, os.X_OK):
        raise EnvironmentProblem(f"{SSHD} not found: the hub serves the overlay's TCP path with "
                                 "sshd; install it: apt-get install -y openssh-server (lorasync "
                                 "starts its own sshd; the system's ssh service is not needed)")


def _is_wildcard(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_unspecified
    except ValueError:
        return True   # a name, or nothing: sshd would resolve or widen it


# ---------------------------------------------------------------- files (pure)

def sshd_config(*, listen: str, port: int, host_key: str | Path, authorized_keys: str | Path,
                pid_file: str | Path, alive_interval_s: int = ALIVE_INTERVAL_S,
                alive_count: int = ALIVE_COUNT) -> str:
    """The hub's sshd configuration: public-key login as root (needed to
    attach TUN devices) only with the overlay's key, tun forwarding only,
    listening on ``listen`` alone."""
    if _is_wildcard(listen):
        raise ConfigError("ssh listen address", listen, "give the hub's own IP address: lorasync "
                          "never listens on a wildcard address")
    if not 1 <= int(port) <= 65535:
        raise ConfigError("ssh port", port, "give a TCP port between 1 and 65535")
    host = f"[{listen}]" if ":" in listen else listen
    return "\n".join([
        f"ListenAddress {host}:{int(port)}",
        f"HostKey {host_key}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        "AllowUsers root",
        # root: attaching a TUN device needs CAP_NET_ADMIN; the key's forced command
        # (authorized_keys) is all a login can run
        "PermitRootLogin forced-commands-only",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "HostbasedAuthentication no",
        "UsePAM no",
        "PermitTunnel point-to-point",
        "AllowTcpForwarding no",
        "AllowStreamLocalForwarding no",
        "AllowAgentForwarding no",
        "X11Forwarding no",
        "PermitTTY no",
        "PermitUserEnvironment no",
        "PrintMotd no",
        "StrictModes yes",
        # a dead client is dropped, so its tun device is free for its next connection
        f"ClientAliveInterval {int(alive_interval_s)}",
        f"ClientAliveCountMax {int(alive_count)}",
        "TCPKeepAlive yes",
        "LogLevel VERBOSE",
        "",
    ])


def authorized_keys_line(public_key: str, tun: int) -> str:
    """The overlay key may open tun device ``tun`` on the hub and nothing else."""
    key = " ".join(public_key.split()[:2])
    return f'restrict,tunnel="{int(tun)}",command="/bin/false" {key} lorasync-overlay-tun{int(tun)}\n'


def known_hosts_line(host: str, port: int, host_public_key: str) -> str:
    name = host if int(port) == 22 else f"[{host}]:{int(port)}"
    return f"{name} {' '.join(host_public_key.split()[:2])}\n"


def ssh_argv(*, server: str, port: int, key_file: str | Path, known_hosts: str | Path,
             local_tun: int, remote_tun: int, alive_interval_s: int = ALIVE_INTERVAL_S,
             alive_count: int = ALIVE_COUNT, connect_timeout_s: int = 5,
             proxy_jump: str | None = None) -> list[str]:
    """``ssh -N -w LOCAL:REMOTE`` with the overlay's key and known_hosts, no
    user configuration, no prompt, keepalives on, and an exit (for the
    supervisor to reconnect) whenever the tunnel cannot be opened."""
    argv = ["ssh", "-F", "/dev/null", "-N", "-T", "-w", f"{int(local_tun)}:{int(remote_tun)}",
            "-o", "Tunnel=point-to-point", "-i", str(key_file), "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "UpdateHostKeys=no", "-o", "BatchMode=yes",
            "-o", "ExitOnForwardFailure=yes", "-o", f"ServerAliveInterval={int(alive_interval_s)}",
            "-o", f"ServerAliveCountMax={int(alive_count)}", "-o", "TCPKeepAlive=yes",
            "-o", f"ConnectTimeout={int(connect_timeout_s)}", "-o", "ControlMaster=no",
            "-o", "ControlPath=none", "-o", "LogLevel=ERROR"]
    if proxy_jump:
        argv += ["-o", f"ProxyCommand={jump_command(proxy_jump)}"]
    return argv + ["-p", str(int(port)), f"root@{server}"]


def jump_command(proxy_jump: str) -> str:
    """ssh's ProxyCommand through ``[USER@]HOST[:PORT][,...]`` (the hops of
    ``-J``).  Not ``-J`` itself: that hands the jump ssh this connection's
    ``-F /dev/null``, so the jump leg would ignore the user's own ssh config
    (aliases, keys, known_hosts of the jump host).  The jump leg is the user's
    ordinary ssh to the jump host, without prompts (BatchMode); the leg to the
    hub inside it stays pinned to the hub's host key."""
    hops = proxy_jump.split(",")
    last = hops[-1]
    via = f" -J '{','.join(hops[:-1])}'" if len(hops) > 1 else ""
    return f"ssh -o BatchMode=yes{via} -W '[%h]:%p' 'ssh://{last}'"


def next_delay(lived_s: float, failures: int) -> float:
    """autossh's rule: a connection that lived past :data:`GATE_S` is started
    again at once (after :data:`BACKOFF` [0]); one that died young waits
    longer each time it happens in a row."""
    if lived_s >= GATE_S:
        return BACKOFF[0]
    return min(BACKOFF[1], BACKOFF[0] * 2 ** max(0, failures - 1))


def make_keypair(path: str | Path, comment: str) -> str:
    """ed25519 key pair at ``path`` (0600) and ``path.pub``; returns the public key line."""
    p = Path(path)
    if not p.exists():
        proc = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                               "-f", str(p)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise EnvironmentProblem(f"ssh-keygen failed: {proc.stderr.strip() or proc.returncode}")
    os.chmod(p, 0o600)
    return Path(f"{p}.pub").read_text().strip()


# ---------------------------------------------------------------- devices

def _ip(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise EnvironmentProblem(f"`ip {' '.join(args)}` failed: {err[-1] if err else proc.returncode}")
    return proc


def _make_tun(name: str, mtu: int) -> None:
    # persistent: it outlives the ssh that attaches to it (module docstring)
    _ip(["tuntap", "add", "dev", name, "mode", "tun"])
    _ip(["link", "set", name, "mtu", str(mtu), "up"])
    # forward between this device and the overlay's others (on the hub); per device only
    Path(f"/proc/sys/net/ipv4/conf/{name}/forwarding").write_text("1\n")


def _del_link(name: str) -> bool:
    return _ip(["link", "del", name], check=False).returncode == 0


# ---------------------------------------------------------------- config

@dataclasses.dataclass
class SSHConfig:
    """One node's SSH transport (``NODE.ssh.json``, written with the overlay)."""

    path: Path
    role: str                 # "hub" | "node"
    name: str                 # unique on the host: the state file's name
    node: str
    hub: str
    address: str
    subnet: str
    server: str               # the hub's address the nodes connect to (and sshd listens on)
    port: int
    state_dir: Path
    mtu: int = DEFAULT_MTU
    tun: int | None = None    # node: its device number (the same on the hub)
    clients: list = dataclasses.field(default_factory=list)  # hub: [{name, address, tun}]
    dummy: str | None = None  # hub without WireGuard: an interface (veth) for its overlay address
    linktest_port: int = 51820
    reason: str = ""
    proxy_jump: str | None = None
    key_file: str | None = None       # node: its key where `tunnel join` made it (else state_dir's)
    host_key_file: str | None = None  # hub: its host key where `tunnel join` made it
    runtime: bool = False             # state_dir is this transport's own: removed with it
    tunnel: str | None = None         # the overlay's interface name (`tunnel down --ifname`)
    tunnel_config: str | None = None  # the NODE.tunnel.json it was made from (`tunnel launch`)

    def __post_init__(self):
        if self.role not in ("hub", "node"):
            raise ConfigError("role", self.role, "hub or node")
        if self.role == "node" and self.tun is None:
            raise ConfigError("tun", None, "a node needs its tun device number")
        self.network = ipaddress.IPv4Network(self.subnet)

    @property
    def ifname(self) -> str:
        """The device gloo uses on this node."""
        return f"tun{self.tun}" if self.role == "node" else (self.dummy or self.name)

    def files(self) -> dict[str, Path]:
        d = self.state_dir
        return {"key": Path(self.key_file) if self.key_file else d / f"{self.node}.key",
                "host_key": Path(self.host_key_file) if self.host_key_file else d / "host_key",
                "known_hosts": d / "known_hosts", "authorized_keys": d / "authorized_keys",
                "sshd_config": d / "sshd_config", "pid": d / "sshd.pid"}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(kind=KIND, path=None, state_dir=str(self.state_dir))
        return d


def load_config(path: str | Path) -> SSHConfig:
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("--config", str(path), f"not a readable SSH transport config ({exc})") from None
    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise ConfigError("--config", str(path), "not an SSH transport config of the overlay")
    raw = {k: v for k, v in raw.items() if k not in ("kind", "path")}
    return SSHConfig(path=p.resolve(), **dict(raw, state_dir=Path(raw["state_dir"])))


def write_config(cfg: SSHConfig, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    tmp.replace(path)


def prepare(state_dir: Path, *, server: str, port: int, clients: list[dict]) -> None:
    """The overlay's SSH files in ``state_dir`` (0700): a key per SSH node
    (``NODE.key``: sshd tells the nodes apart by key, and each key may open
    only its node's tun device), the hub's host key, known_hosts and
    authorized_keys (one line per SSH node)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    host_pub = make_keypair(state_dir / "host_key", "lorasync-overlay-hub")
    (state_dir / "known_hosts").write_text(known_hosts_line(server, port, host_pub))
    lines = [authorized_keys_line(make_keypair(state_dir / f"{c['name']}.key",
                                               f"lorasync-overlay-{c['name']}"), c["tun"])
             for c in clients]
    ak = state_dir / "authorized_keys"
    ak.write_text("".join(lines))
    os.chmod(ak, 0o600)


# ---------------------------------------------------------------- supervision

class Supervisor(BaseSupervisor):
    """Keeps one node's SSH transport up (see the module docstring); once
    started, :meth:`bring_up` waits up to ``ready_timeout`` s for traffic to
    pass (the hub: for sshd to accept connections)."""

    def __init__(self, cfg: SSHConfig, cluster: str | None = None, log=None, interval: float = 0.2,
                 *, ready_timeout: float = 20.0):
        super().__init__(cfg.name, cluster=cluster, log=log, interval=interval)
        self.cfg = cfg
        self.ready_timeout = ready_timeout
        self.proc_log_path = TUNNELS_DIR / f"{cfg.name}.ssh.log"
        self.devices: list[str] = []
        self.failures = 0
        self.started_at = 0.0
        self.since = time.time()
        self._log_offset = 0

    # -- lifecycle

    def _start(self) -> None:
        self._devices()
        # `tunnel status` measures RTT and rate against it (on a hub with WireGuard,
        # its tunnel serves it)
        if self.cfg.role == "node" or self.cfg.dummy:
            self._serve_linktest()
        self._spawn()

    def up_message(self) -> str:
        what = (f"sshd on {self.cfg.server}:{self.cfg.port} for "
                + (", ".join(f"{c['name']} (tun{c['tun']})" for c in self.cfg.clients) or "no node")
                if self.cfg.role == "hub" else
                f"ssh -w {self.cfg.tun}:{self.cfg.tun} to {self.cfg.server}:{self.cfg.port}")
        return (f"up: {self.cfg.node} {self.cfg.address} over SSH ({what}), mtu {self.cfg.mtu}"
                + (f"; {self.cfg.reason}" if self.cfg.reason else ""))

    def bring_up(self, stopping) -> None:
        self.start()   # cleans up after itself if it fails
        try:
            took = self.wait_ready(self.ready_timeout)
        except LorasyncError:
            self.stop()
            raise
        self.event(f"traffic passes to the hub {self.cfg.hub} after {took:.2f} s"
                   if self.cfg.role == "node" else
                   f"sshd accepts connections on {self.cfg.server}:{self.cfg.port} after {took:.2f} s")

    def _devices(self) -> None:
        cfg = self.cfg
        if cfg.role == "node":
            dev = f"tun{cfg.tun}"
            _make_tun(dev, cfg.mtu)
            self.devices.append(dev)
            # the whole overlay is behind the hub
            _ip(["addr", "add", f"{cfg.address}/{cfg.network.prefixlen}", "dev", dev])
            return
        if cfg.dummy:
            # no WireGuard interface holds the hub's address (gloo binds to it): a veth
            # pair with both ends here does (this kernel has no dummy links)
            _ip(["link", "add", cfg.dummy, "type", "veth", "peer", "name", f"{cfg.dummy}p"])
            self.devices.append(cfg.dummy)
            _ip(["addr", "add", f"{cfg.address}/32", "dev", cfg.dummy])
            for dev in (cfg.dummy, f"{cfg.dummy}p"):
                _ip(["link", "set", dev, "up"])
        for c in cfg.clients:
            dev = f"tun{c['tun']}"
            _make_tun(dev, cfg.mtu)
            self.devices.append(dev)
            _ip(["addr", "add", f"{cfg.address}/32", "peer", f"{c['address']}/32", "dev", dev])

    def _argv(self) -> list[str]:
        f = self.cfg.files()
        if self.cfg.role == "hub":
            return [SSHD, "-D", "-e", "-f", str(f["sshd_config"])]
        return ssh_argv(server=self.cfg.server, port=self.cfg.port, key_file=f["key"],
                        known_hosts=f["known_hosts"], local_tun=self.cfg.tun,
                        remote_tun=self.cfg.tun, proxy_jump=self.cfg.proxy_jump)

    def _spawn(self) -> None:
        if self.cfg.role == "hub":
            f = self.cfg.files()
            f["sshd_config"].write_text(sshd_config(
                listen=self.cfg.server, port=self.cfg.port, host_key=f["host_key"],
                authorized_keys=f["authorized_keys"], pid_file=f["pid"]))
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)   # sshd's privilege separation
        log = open(self.proc_log_path, "ab")
        self._log_offset = log.tell()
        try:
            self.proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, close_fds=True)
        finally:
            log.close()
        self.started_at = time.monotonic()

    def wait_ready(self, timeout: float) -> float:
        """Seconds until a TCP connection through the tunnel reaches the hub's
        link-test port (ssh connected, both devices attached)."""
        t0 = time.monotonic()
        if self.cfg.role == "hub":
            return self._wait_sshd(timeout, t0)
        while True:
            if self.proc is not None and self.proc.poll() is not None and self.cfg.role == "node":
                tail = _tail(self.proc_log_path, self._log_offset)
                raise EnvironmentProblem(f"ssh to the hub {self.cfg.server}:{self.cfg.port} exited "
                                         f"(code {self.proc.returncode}): {tail or 'no message'}")
            try:
                with socket.create_connection((self._hub_address(), self.cfg.linktest_port),
                                              timeout=1):
                    return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                raise EnvironmentProblem(
                    f"no connection through the SSH tunnel to the hub {self.cfg.hub} within "
                    f"{timeout:g} s: check that TCP port {self.cfg.port} on {self.cfg.server} is "
                    f"open to this node and that the hub's sshd runs (log {self.proc_log_path})")
            time.sleep(0.2)

    def _wait_sshd(self, timeout: float, t0: float) -> float:
        """Seconds until the hub's sshd accepts a TCP connection on its address."""
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                tail = _tail(self.proc_log_path, self._log_offset)
                raise EnvironmentProblem(f"sshd exited (code {self.proc.returncode}): "
                                         f"{tail or 'no message'}")
            with contextlib.suppress(OSError):
                with socket.create_connection((self.cfg.server, self.cfg.port), timeout=1):
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise EnvironmentProblem(f"sshd does not accept connections on {self.cfg.server}:"
                                         f"{self.cfg.port} within {timeout:g} s (log "
                                         f"{self.proc_log_path})")
            time.sleep(0.1)

    def _hub_address(self) -> str:
        return str(next(self.cfg.network.hosts()))

    def _serve_linktest(self) -> None:
        self._server = linktest.serve_in_background(self.cfg.address, self.cfg.linktest_port,
                                                    self._stop)

    def state(self) -> dict:
        cfg = self.cfg
        return {"transport": "ssh", "role": cfg.role, "ifname": cfg.name, "device": cfg.ifname,
                "devices": self.devices, "node": cfg.node, "config": str(cfg.path),
                "pid": os.getpid(), "ssh_pid": self.proc.pid if self.proc else None,
                "netns": linktest.current_netns(), "cluster": self.cluster, "started": self.since,
                "address": cfg.address, "prefixlen": cfg.network.prefixlen, "mtu": cfg.mtu,
                "hub": cfg.hub, "is_hub": cfg.role == "hub", "server": f"{cfg.server}:{cfg.port}",
                "reason": cfg.reason, "restarts": self.restarts, "log": str(self.log_path),
                "tunnel": cfg.tunnel, "tunnel_config": cfg.tunnel_config,
                "runtime_dir": str(cfg.state_dir) if cfg.runtime else None}

    # -- supervision: start ssh (sshd) again when it exits

    @property
    def _what(self) -> str:
        return "sshd" if self.cfg.role == "hub" else "ssh"

    def _exited(self, now: float) -> float:
        lived = now - self.started_at
        said = _tail(self.proc_log_path, self._log_offset)
        busy = BUSY in said and self.cfg.role == "node"
        self.failures = 0 if lived >= GATE_S or busy else self.failures + 1
        delay = next_delay(lived, self.failures)
        code = self.proc.returncode if self.proc is not None else None
        self.event(f"{self._what} exited (code {code}) after {lived:.1f} s: {said or 'no message'}"
                   + ("; the hub still holds the tun device for the previous connection"
                      if busy else "") + f"; starting it again in {delay:g} s")
        return delay

    def _restart(self, now: float) -> None:
        # a failed start is logged and counted as the next exit (backed off in _exited)
        try:
            self._spawn()
        except (OSError, LorasyncError) as exc:
            self.event(f"could not start {self._what}: {exc}")
            return None
        self.restarts += 1
        self._save_state()
        self.event(f"{self._what} started again (pid {self.proc.pid}, restart {self.restarts})")
        return None

    def stop(self) -> None:
        """Take everything down: server, ssh (sshd), devices, state file, and a
        real host's runtime files."""
        super().stop()
        if self.cfg.runtime:
            _remove_runtime(self.cfg.state_dir, self.cfg.path)

    def _release(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=5)
        for dev in self.devices:
            _del_link(dev)


def _tail(path: Path, offset: int = 0) -> str:
    """The last line written to ``path`` after ``offset`` (what this run of ssh said)."""
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return lines[-1].strip() if lines else ""
    return ""


# ---------------------------------------------------------------- real hosts (`lorasync tunnel`)

#: a real host's SSH transport config, written at ``up`` beside its state (removed at ``down``)
RUNTIME_SUFFIX = ".sshconf"
#: the hub's sshd port when `tunnel init --ssh` names none: 443 is the port networks that let
#: only TCP out still pass most often (HTTPS); 22 is usually the system's own sshd already
DEFAULT_PORT = 443
#: sshd logs the node in as root: attaching a TUN device needs CAP_NET_ADMIN; the key's
#: forced command (/bin/false) and ``restrict`` are all that login may do
USER = "root"
_PUB_RE = re.compile(r"ssh-ed25519 [A-Za-z0-9+/]{68}")


def is_public_key(text) -> bool:
    """An ed25519 public key as ``ssh-keygen`` writes it (type and base64, no comment)."""
    return isinstance(text, str) and bool(_PUB_RE.fullmatch(text))


def public_key_of(path: str | Path) -> str:
    """``ssh-ed25519 BASE64`` of the private key in ``path`` (``ssh-keygen -y``)."""
    if not shutil.which("ssh-keygen"):
        raise EnvironmentProblem("'ssh-keygen' not found: install it: apt-get install -y "
                                 "openssh-client")
    proc = subprocess.run(["ssh-keygen", "-y", "-f", str(path)], capture_output=True, text=True)
    pub = " ".join(proc.stdout.split()[:2])
    if proc.returncode != 0 or not is_public_key(pub):
        raise ConfigError("private_key_file", str(path), "does not hold this node's SSH key: make "
                          "a new one on this node with `lorasync tunnel join --transport ssh`")
    return pub


def check_listen(listen: str, port: int) -> None:
    """ConfigError unless sshd can listen on ``listen:port`` here: the address
    is this host's (not a wildcard) and nothing holds the port."""
    if _is_wildcard(listen):
        raise ConfigError("ssh listen address", listen, "give the hub's own IP address at `tunnel "
                          "init --ssh-listen`: lorasync never listens on a wildcard address")
    s = socket.socket(socket.AF_INET6 if ":" in listen else socket.AF_INET, socket.SOCK_STREAM)
    # as sshd binds: connections of a server stopped a moment ago (TIME_WAIT) do not count,
    # a listening socket does
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((listen, int(port)))
        s.listen(1)
    except OSError as exc:
        if exc.errno == 98:   # EADDRINUSE
            raise ConfigError("ssh port", port, f"TCP port {port} on {listen} is already in use "
                              f"(`ss -tlpn 'sport = :{port}'` shows by what; a `tunnel "
                              "probe-server` still running?): stop it, or plan again with "
                              "`tunnel init --ssh-port N`") from None
        raise ConfigError("ssh listen address", listen, f"sshd cannot listen there "
                          f"({exc.strerror}): not an address of this host? plan again with "
                          "`tunnel init --ssh-listen ADDR`, the hub's own address") from None
    finally:
        s.close()


def runtime_config(tcfg) -> SSHConfig:
    """The SSH transport of a real host's ``NODE.tunnel.json`` (a node on the
    SSH path, or the hub serving such nodes), written with its runtime files
    (known_hosts or authorized_keys, in a 0700 directory of its own under the
    tunnels' state directory; the private keys stay where `tunnel join` made
    them)."""
    hub_ep = next(n["endpoint"] for n in tcfg.nodes if n["name"] == tcfg.hub)
    linktest_port = int(hub_ep.rsplit(":", 1)[1]) if hub_ep else tcfg.listen_port
    if tcfg.is_hub:
        srv = tcfg.ssh_server
        dummy = tcfg.ifname if srv.get("dummy") else None
        name = tcfg.ifname if dummy else f"{tcfg.ifname}-sshd"
    else:
        srv = tcfg.ssh
        name = tcfg.ifname
    d = TUNNELS_DIR / f"{name}.ssh"
    TUNNELS_DIR.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    common = dict(path=TUNNELS_DIR / f"{name}{RUNTIME_SUFFIX}", name=name, node=tcfg.node,
                  hub=tcfg.hub, address=tcfg.address, subnet=tcfg.subnet, port=int(srv["port"]),
                  state_dir=d, linktest_port=linktest_port, runtime=True, tunnel=tcfg.ifname,
                  tunnel_config=str(tcfg.path))
    if tcfg.is_hub:
        clients = [{"name": c["name"], "address": c["address"], "tun": int(c["tun"])}
                   for c in srv["clients"]]
        ak = d / "authorized_keys"
        ak.write_text("".join(authorized_keys_line(c["public_key"], c["tun"]) for c in srv["clients"]))
        os.chmod(ak, 0o600)
        mine = next(n for n in tcfg.nodes if n["name"] == tcfg.node)
        cfg = SSHConfig(role="hub", server=srv["listen"], clients=clients, dummy=dummy,
                        host_key_file=str(srv["host_key_file"]), reason=mine.get("reason", ""),
                        **common)
    else:
        (d / "known_hosts").write_text(known_hosts_line(srv["host"], srv["port"], srv["host_key"]))
        mine = next(n for n in tcfg.nodes if n["name"] == tcfg.node)
        cfg = SSHConfig(role="node", server=srv["host"], tun=int(srv["tun"]),
                        key_file=str(tcfg.private_key_file), proxy_jump=srv.get("proxy_jump"),
                        reason=mine.get("reason", ""), **common)
    write_config(cfg, cfg.path)
    return cfg


def start_background(cfg: SSHConfig, *, cluster: str | None = None, python: str = sys.executable,
                     ready_timeout: float = 20.0) -> dict:
    """Run ``cfg``'s supervisor in a session of its own; wait for its ``ready``
    (a node: traffic passes to the hub); return its state.  On failure nothing
    it made stays (its devices, processes, runtime files)."""
    argv = [python, "-m", "lorasync.overlay.sshtun", "supervise", str(cfg.path),
            "--ready-timeout", str(ready_timeout)]
    if cluster:
        argv += ["--cluster", cluster]
    proc = spawn(argv, TUNNELS_DIR / f"{cfg.name}.supervisor.log")
    try:
        line = ready_line(proc, ready_timeout + 30)
        if line != "ready":
            what = "sshd" if cfg.role == "hub" else "ssh"
            raise EnvironmentProblem(f"the SSH transport ({what}) did not come up: "
                                     + (line[7:] if line.startswith("error: ") else
                                        f"see {TUNNELS_DIR / (cfg.name + '.log')}"))
    except BaseException:
        stop_process(proc)
        devices = ([f"tun{c['tun']}" for c in cfg.clients] + ([cfg.dummy] if cfg.dummy else [])
                   if cfg.role == "hub" else [f"tun{cfg.tun}"])
        st = {"ifname": cfg.name, "transport": "ssh", "devices": devices, "config": str(cfg.path),
              "runtime_dir": str(cfg.state_dir), "netns": linktest.current_netns()}
        down_one(st)
        raise
    state = json.loads((TUNNELS_DIR / f"{cfg.name}.json").read_text())
    return state


# ---------------------------------------------------------------- status / down

def _is_ours(pid: int | None, what: str, config: str) -> bool:
    args = argv_of(pid) if pid_alive(pid) else []
    if what == "supervisor":
        return "lorasync.overlay.sshtun" in args and "supervise" in args
    if not args or os.path.basename(args[0]) not in ("ssh", "sshd"):
        return False
    return any(a.endswith("/sshd_config") or a.endswith(".key") for a in args)


def down_one(st: dict) -> list[str]:
    """Stop the SSH transport ``st`` describes and remove its devices and state."""
    removed = []
    pid = st.get("pid")
    if end_process(pid, lambda p: _is_ours(p, "supervisor", st.get("config", "")), 8):
        removed.append(f"supervisor {pid}")
    spid = st.get("ssh_pid")
    if _is_ours(spid, "ssh", st.get("config", "")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(spid, signal.SIGTERM)
        removed.append(f"ssh {spid}")
    netns = st.get("netns")
    if netns and Path(f"/run/netns/{netns}").exists():
        for dev in st.get("devices") or []:
            if subprocess.run(["ip", "-n", netns, "link", "del", dev], capture_output=True).returncode == 0:
                removed.append(f"interface {dev} in {netns}")
    elif not netns and st.get("runtime_dir"):   # a real host's: its devices are here
        for dev in st.get("devices") or []:
            if _del_link(dev):
                removed.append(f"interface {dev}")
    removed += remove_state(st["ifname"])
    rt = st.get("runtime_dir")
    if rt and Path(rt).is_dir() and Path(rt).parent == TUNNELS_DIR:
        _remove_runtime(Path(rt), Path(st.get("config") or ""))
        removed.append(f"ssh files {rt}")
    return removed


def _remove_runtime(state_dir: Path, config: Path) -> None:
    """The files a real host's SSH transport wrote at ``up`` (known_hosts,
    authorized_keys, sshd_config, pid file, its own config); never a key."""
    if state_dir.parent != TUNNELS_DIR:
        return
    shutil.rmtree(state_dir, ignore_errors=True)
    if config.parent == TUNNELS_DIR and config.name.endswith(RUNTIME_SUFFIX):
        with contextlib.suppress(OSError):
            config.unlink()


def status_one(st: dict, measure: bool, seconds: float) -> dict:
    """``tunnel status`` of an SSH transport: what it carries, its ssh's health, and why."""
    alive = pid_alive(st.get("pid"))
    ssh_alive = pid_alive(st.get("ssh_pid"))
    error = None if ssh_alive else ("sshd" if st.get("is_hub") else "ssh") + " not running (restarting)"
    peers = []
    try:
        cfg = load_config(st["config"])
        targets = cfg.clients if cfg.role == "hub" else [{"name": cfg.hub, "address": str(next(cfg.network.hosts()))}]
    except LorasyncError as exc:
        cfg, targets, error = None, [], str(exc)
    how = {}   # a real host's: how each node joins, from its tunnel.json
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        if st.get("tunnel_config"):
            how = {n["name"]: {"transport": n.get("transport", "wireguard"),
                               "reason": n.get("reason", "")}
                   for n in json.loads(Path(st["tunnel_config"]).read_text())["nodes"]}
    for t in targets:
        row = {"name": t["name"], "address": t["address"], "route": "ssh", "relayed": False,
               **(how.get(t["name"], {}) if st.get("is_hub") else {}),
               "endpoint": st.get("server"), "handshake_age_s": None, "rx_bytes": None,
               "tx_bytes": None, "is_hub": cfg is not None and t["name"] == cfg.hub}
        if measure and cfg is not None:
            row.update(linktest.measure_peer(t["address"], cfg.linktest_port, seconds, st.get("netns")))
        peers.append(row)
    return {"ifname": st.get("device") or st["ifname"], "state": st["ifname"], "transport": "ssh",
            "reason": st.get("reason", ""), "node": st.get("node"), "address": st.get("address"),
            "prefixlen": st.get("prefixlen"), "mtu": st.get("mtu"), "listen_port": None,
            "server": st.get("server"), "hub": st.get("hub"), "is_hub": st.get("is_hub"),
            "netns": st.get("netns"), "cluster": st.get("cluster"), "supervisor_pid": st.get("pid"),
            "supervisor_alive": alive, "ssh_pid": st.get("ssh_pid"), "wg_pid": None,
            "restarts": st.get("restarts", 0), "started": st.get("started"), "log": st.get("log"),
            "error": error, "peers": peers}


# ---------------------------------------------------------------- the background process

def supervise_main(argv: list[str] | None = None) -> int:
    """``python -m lorasync.overlay.sshtun supervise CONFIG [--cluster NAME]``:
    prints ``ready`` once traffic passes (or ``error: MESSAGE``), then keeps
    the transport up until SIGTERM and removes what it made."""
    p = argparse.ArgumentParser(prog="python -m lorasync.overlay.sshtun")
    p.add_argument("command", choices=["supervise"])
    p.add_argument("config")
    p.add_argument("--cluster", default=None)
    p.add_argument("--ready-timeout", type=float, default=20.0)
    args = p.parse_args(argv)
    return serve(lambda: Supervisor(load_config(args.config), cluster=args.cluster,
                                    ready_timeout=args.ready_timeout))


if __name__ == "__main__":
    sys.exit(supervise_main())
