"""The supervisor that keeps one node's WireGuard tunnel up (run in the
background by ``up`` as ``python -m lorasync.overlay.tunnel supervise
CONFIG``, or in the foreground with ``tunnel up --foreground``).

It starts ``wireguard-go``, configures it, serves the link test on the
overlay address (for ``status``'s RTT and rate), restarts the daemon when it
dies and, for a peer with an endpoint whose handshake goes stale, re-resolves
the endpoint and forces a new handshake, with exponential backoff
(:func:`supervise_step` decides, pure); on a node behind NAT, it tries a
direct path to each node it reaches only through the hub
(:mod:`lorasync.overlay.punch`; the hub's link-test server tells the
endpoints it sees).  A hub that also serves the SSH path starts its sshd
under its own supervisor (:mod:`lorasync.overlay.sshtun`) once WireGuard is
up, and stops it with this one.  Every event goes to the log
``/run/lorasync/tunnels/IFNAME.log`` (:mod:`lorasync.overlay.supervisor`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import os
import socket
import sys
import time
from typing import Sequence

from lorasync.errors import LorasyncError
from lorasync.hostops import TUNNELS_DIR
from lorasync.overlay import linktest, punch, sshtun
from lorasync.overlay import wireguard as wg
from lorasync.overlay.config import TunnelConfig, load_config, resolve_endpoint
from lorasync.overlay.preflight import choose_mtu
from lorasync.overlay.supervisor import BaseSupervisor, serve, states

__all__ = ["RESTART_BACKOFF", "Action", "PeerTrack", "Supervisor", "supervise_main",
           "supervise_step"]

#: seconds before restarting a dead wireguard-go, doubled after each failed try
RESTART_BACKOFF = (0.5, 30.0)


@dataclasses.dataclass
class PeerTrack:
    """Supervision state of one peer."""

    name: str
    attempts: int = 0
    next_try: float = 0.0
    stale_logged: bool = False


@dataclasses.dataclass
class Action:
    kind: str  # "rehandshake" | "recovered" | "silent" | "back"
    peer: str
    message: str
    next_in: float | None = None


def supervise_step(peers: Sequence[dict], state: wg.DeviceState, now: float, since: float,
                   tracks: dict[str, PeerTrack], *, stale_s: float, grace_s: float = 10.0,
                   backoff: tuple[float, float] = (1.0, 60.0)) -> list[Action]:
    """What to do about each peer (pure; the supervisor acts on the result).

    A peer is stale when its last handshake is older than ``stale_s``, or it
    never had one ``grace_s`` after the device (re)started at ``since``.  A
    stale peer with an endpoint is re-resolved and re-handshaken, then again
    after 1, 2, 4 ... s (at most ``backoff[1]``) while it stays stale; one
    without an endpoint (behind NAT) can only be waited for, which is logged once.
    """
    out = []
    for p in peers:
        t = tracks.setdefault(p["name"], PeerTrack(p["name"]))
        ps = state.peer(p["public_key"])
        age = ps.handshake_age(now) if ps else None
        stale = (age is None and now - since > grace_s) or (age is not None and age > stale_s)
        what = "never completed" if age is None else f"{age:.0f} s old"
        if not stale:
            if t.attempts:
                out.append(Action("recovered", p["name"], f"peer {p['name']}: handshake {age:.0f} s "
                                  f"ago, up again after {t.attempts} attempt(s)"))
            elif t.stale_logged:
                out.append(Action("back", p["name"], f"peer {p['name']}: handshake again "
                                  f"({age:.0f} s ago)"))
            t.attempts, t.next_try, t.stale_logged = 0, 0.0, False
            continue
        if not p.get("endpoint"):
            if not t.stale_logged:
                t.stale_logged = True
                out.append(Action("silent", p["name"], f"peer {p['name']} (behind NAT, no endpoint): "
                                  f"handshake {what}; waiting for it to connect"))
            continue
        if now < t.next_try:
            continue
        t.attempts += 1
        delay = min(backoff[1], backoff[0] * 2 ** (t.attempts - 1))
        t.next_try = now + delay
        out.append(Action("rehandshake", p["name"], f"peer {p['name']}: handshake {what}; "
                          f"re-resolving {p['endpoint']} and re-handshaking (attempt {t.attempts}, "
                          f"next in {delay:g} s)", delay))
    return out


class Supervisor(BaseSupervisor):
    """Keeps one node's WireGuard tunnel up (see the module docstring).
    ``ssh_server``: a hub that also serves the SSH path starts its sshd once
    up (waiting ``ready_timeout`` s for it)."""

    def __init__(self, cfg: TunnelConfig, log=None, interval: float = 1.0,
                 cluster: str | None = None, *, ssh_server: bool = False,
                 ready_timeout: float = 20.0):
        super().__init__(cfg.ifname, cluster=cluster, log=log, interval=interval)
        self.cfg = cfg
        self.daemon_log_path = TUNNELS_DIR / f"{cfg.ifname}.wireguard-go.log"
        self.mtu: int | None = None
        self.since = 0.0
        self.tracks: dict[str, PeerTrack] = {}
        self._backoff = RESTART_BACKOFF[0]
        self._last_error: str | None = None
        self.cands = punch.candidates(cfg)
        self.paths = punch.tracks(self.cands)
        self._punch_error: str | None = None
        self.ssh_server = ssh_server
        self.ready_timeout = ready_timeout
        self.companion: dict | None = None

    # -- lifecycle

    def start(self) -> None:
        """Start and configure the device, serve the link test; raises on failure
        after cleaning up what it made."""
        TUNNELS_DIR.mkdir(parents=True, exist_ok=True)
        self.mtu = choose_mtu(self.cfg)
        super().start()

    def _start(self) -> None:
        self._start_device()
        self._serve_linktest()

    def up_message(self) -> str:
        peers = ", ".join(f"{p['name']} ({p.get('endpoint') or 'behind NAT'})" for p in self.cfg.peers)
        return (f"up: {self.cfg.node} {self.cfg.address}/{self.cfg.prefixlen}, mtu {self.mtu}, "
                f"UDP {self.cfg.listen_port}; peers {peers or 'none'}"
                + (" ; relaying between peers" if self.cfg.relay else ""))

    def bring_up(self, stopping) -> None:
        self.start()   # cleans up after itself if it fails
        if not (self.ssh_server and self.cfg.ssh_server) or stopping():
            return
        try:
            self.companion = _start_ssh_server(self.cfg, self.cluster, self.ready_timeout)
        except LorasyncError:   # the hub's sshd did not come up: WireGuard goes too
            self.stop()
            raise
        self.event(f"SSH path: sshd on {self.companion.get('server')} (supervisor pid "
                   f"{self.companion.get('pid')}, log {self.companion.get('log')})")

    def _start_device(self) -> None:
        cfg = self.cfg
        log = open(self.daemon_log_path, "ab")
        try:
            # an emulated cluster's daemons share this host's cores: one Go thread
            # each, unless the caller's environment sets GOMAXPROCS itself
            one = self.cluster and "GOMAXPROCS" not in os.environ
            self.proc = wg.start_daemon(cfg.ifname, log, go_threads=1 if one else None)
        finally:
            log.close()
        routes = [ip for p in cfg.peers for ip in p["allowed_ips"]
                  if not ipaddress.IPv4Network(ip, strict=False).subnet_of(cfg.network)]
        wg.configure(cfg.ifname, key_file=cfg.private_key_file, listen_port=cfg.listen_port,
                     peers=cfg.peer_configs(), address=cfg.address, prefixlen=cfg.prefixlen,
                     mtu=self.mtu, routes=routes, relay=cfg.relay, relay_also=cfg.ssh_ifnames)
        self.since = time.time()

    def _serve_linktest(self) -> None:
        self._server = linktest.serve_in_background(
            self.cfg.address, self.cfg.listen_port, self._stop, freebind=True,
            endpoints=self._endpoints if self.cfg.is_hub else None)

    def _endpoints(self) -> dict[str, str]:
        """The hub's answer to a node's ``e``: each node's outside IPv4
        endpoint with a live handshake, as WireGuard sees it."""
        try:
            dev = wg.show(self.cfg.ifname)
        except (LorasyncError, ValueError):
            return {}
        names = {n["public_key"]: n["name"] for n in self.cfg.nodes}
        now = time.time()
        return {names[p.public_key]: p.endpoint for p in dev.peers
                if p.public_key in names and p.endpoint and not p.endpoint.startswith("[")
                and p.handshake_age(now) is not None and p.handshake_age(now) < self.cfg.stale_s}

    def state(self) -> dict:
        return {"ifname": self.cfg.ifname, "node": self.cfg.node, "config": str(self.cfg.path),
                "pid": os.getpid(), "wg_pid": self.proc.pid if self.proc else None,
                "netns": linktest.current_netns(), "cluster": self.cluster, "started": self.since,
                "address": self.cfg.address, "prefixlen": self.cfg.prefixlen, "mtu": self.mtu,
                "listen_port": self.cfg.listen_port, "hub": self.cfg.hub, "is_hub": self.cfg.is_hub,
                "restarts": self.restarts, "log": str(self.log_path),
                "paths": {name: t.public() for name, t in self.paths.items()}}

    # -- supervision

    def _exited(self, now: float) -> float:
        code = self.proc.returncode if self.proc is not None else None
        self.event(f"wireguard-go exited (code {code}); restarting in {self._backoff:g} s")
        return self._backoff

    def _check(self) -> None:
        try:
            state = wg.show(self.cfg.ifname)
        except (LorasyncError, ValueError) as exc:
            if str(exc) != self._last_error:  # once, not every second
                self.event(f"wg show failed: {exc}")
            self._last_error = str(exc)
            return
        self._last_error = None
        for a in supervise_step(self.cfg.peers, state, time.time(), self.since, self.tracks,
                                stale_s=self.cfg.stale_s):
            self.event(a.message)
            if a.kind == "rehandshake":
                self._rehandshake(a.peer)
        self._punch(state)

    def _punch(self, state: wg.DeviceState) -> None:
        """Direct paths to the nodes reached through the hub (:mod:`punch`)."""
        if not self.cands:
            return
        now = time.time()
        endpoints = None
        if punch.due(self.paths, now):
            hub = self.cfg.hub_peer
            hs = state.peer(hub["public_key"]) if hub else None
            if hs is None or not hs.latest_handshake:
                return  # nothing to ask before the hub answers
            try:
                endpoints = punch.fetch_endpoints(self.cfg.hub_address(), self.cfg.listen_port)
                self._punch_error = None
            except (OSError, ValueError) as exc:
                msg = f"asking the hub {self.cfg.hub} for endpoints failed: {exc}; relayed for now"
                if msg != self._punch_error:
                    self.event(msg)
                self._punch_error = msg
                for t in self.paths.values():
                    if t.path == "relayed":
                        t.next_try = now + punch.RETRY_S[0]
                return
        keys = {n["name"]: n["public_key"] for n in self.cands}
        acts = punch.punch_step(self.cands, self.paths, {p.public_key: p for p in state.peers},
                                endpoints, now)
        for a in acts:
            try:
                if a.kind == "try":
                    wg.add_probe_peer(self.cfg.ifname, keys[a.peer], a.endpoint, punch.KEEPALIVE_S)
                elif a.kind == "direct":
                    addr = next(n["address"] for n in self.cands if n["name"] == a.peer)
                    wg.set_allowed_ips(self.cfg.ifname, keys[a.peer], [f"{addr}/32"])
                else:  # give_up (nothing was moved), lost: the hub's peer takes the address back
                    if a.kind == "lost":
                        hub = self.cfg.hub_peer
                        wg.set_allowed_ips(self.cfg.ifname, hub["public_key"], hub["allowed_ips"])
                    wg.remove_peer(self.cfg.ifname, keys[a.peer])
            except LorasyncError as exc:
                self.event(f"peer {a.peer}: {a.kind} failed: {exc}")
                continue
            self.event(a.message)
        if acts or endpoints is not None:
            self._save_state()

    def _restart(self, now: float) -> float | None:
        try:
            wg.stop_daemon(None, self.cfg.ifname)  # what the dead one left
            self._start_device()
        except LorasyncError as exc:
            self.proc = None
            self._backoff = min(RESTART_BACKOFF[1], self._backoff * 2)
            self.event(f"restart failed: {exc}; next try in {self._backoff:g} s")
            return now + self._backoff
        self.restarts += 1
        self.tracks.clear()
        self.paths = punch.tracks(self.cands)  # the device came back with the config's peers only
        self._save_state()
        self.event(f"wireguard-go restarted (pid {self.proc.pid}, restart {self.restarts}); "
                   f"interface configured again")
        self._backoff = RESTART_BACKOFF[0]
        return None

    def _rehandshake(self, name: str) -> None:
        p = next(p for p in self.cfg.peers if p["name"] == name)
        try:
            ep = resolve_endpoint(p["endpoint"], name)
            wg.set_peer(self.cfg.ifname, wg.PeerConfig(p["public_key"], list(p["allowed_ips"]), ep,
                                                       p.get("keepalive_s")))
        except LorasyncError as exc:
            self.event(f"peer {name}: {exc}")
            return
        # a packet for the peer makes WireGuard start a handshake when it has no session
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"", (p["address"], 9))

    def stop(self) -> None:
        """Take everything down: the hub's sshd (when this one started it),
        server, device, daemon, relay table, state file."""
        if self.companion is not None:
            _stop_ssh_server(self.cfg)
        super().stop()

    def _release(self) -> None:
        wg.stop_daemon(self.proc, self.cfg.ifname)
        if self.cfg.relay:
            wg.remove_relay(self.cfg.ifname)


def supervise_main(argv: list[str] | None = None) -> int:
    """``python -m lorasync.overlay.tunnel supervise CONFIG``: the background half of ``up``.

    Prints ``ready`` once the tunnel is configured (or ``error: MESSAGE``) and
    keeps it up until SIGTERM, then removes everything it made.
    """
    p = argparse.ArgumentParser(prog="python -m lorasync.overlay.tunnel")
    p.add_argument("command", choices=["supervise"])
    p.add_argument("config")
    p.add_argument("--cluster", default=None, help="emulated cluster this tunnel belongs to")
    p.add_argument("--foreground", action="store_true", help="events to stderr too")
    p.add_argument("--ssh-server", action="store_true",
                   help="a hub that also serves the SSH path: once WireGuard is up, start the hub's "
                        "sshd under its own supervisor, and stop it with this one")
    p.add_argument("--ready-timeout", type=float, default=20.0)
    args = p.parse_args(argv)
    return serve(lambda: Supervisor(load_config(args.config),
                                    log=sys.stderr if args.foreground else None,
                                    cluster=args.cluster, ssh_server=args.ssh_server,
                                    ready_timeout=args.ready_timeout),
                 foreground=args.foreground, report_bugs=True)


def _start_ssh_server(cfg: TunnelConfig, cluster: str | None, ready_timeout: float) -> dict:
    """The hub's sshd for its nodes on the SSH path, under its own supervisor
    (:mod:`lorasync.overlay.sshtun`): its state; on failure nothing of it stays."""
    try:
        return sshtun.start_background(sshtun.runtime_config(cfg), cluster=cluster,
                                       ready_timeout=ready_timeout)
    except BaseException:
        _stop_ssh_server(cfg)
        raise


def _stop_ssh_server(cfg: TunnelConfig) -> None:
    # the hub's sshd: the SSH transport's state naming this tunnel
    for st in states():
        if st.get("tunnel") == cfg.ifname and st.get("ifname") != cfg.ifname:
            sshtun.down_one(st)
