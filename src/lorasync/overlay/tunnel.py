"""The overlay network: nodes in different networks (behind NAT, other sites)
get addresses every node can reach, so gloo/NCCL's full mesh works across them.

This module owns one node's tunnel on this host: ``up`` (checks first,
:mod:`lorasync.overlay.preflight`, then the supervisor in the background),
``status`` and ``down`` (also what a killed supervisor left), and what
training over it needs (:func:`worker_env`).  ``python -m
lorasync.overlay.tunnel supervise CONFIG`` runs the WireGuard supervisor
(:mod:`lorasync.overlay.wgsupervisor`); a node on the SSH path runs its own
(:mod:`lorasync.overlay.sshtun`).  A node's ``tunnel.json`` is
:mod:`lorasync.overlay.config`'s; :mod:`lorasync.overlay.enroll` owns the
plan and how keys are made and exchanged (``tunnel init`` / ``join`` /
``assemble``); :mod:`lorasync.overlay.wireguard` the calls to the WireGuard
tools; ``lorasync tunnel`` is the command line.

The public names of those modules that callers have always taken from here
(:func:`load_config`, :class:`TunnelConfig`, :class:`Supervisor`,
:func:`states` ...) are importable from here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lorasync.errors import ConfigError, EnvironmentProblem, LorasyncError
from lorasync.hostops import TUNNELS_DIR, pid_alive, stop_process
from lorasync.overlay import linktest, sshtun
from lorasync.overlay import wireguard as wg
from lorasync.overlay.config import (CONFIG_VERSION, DEFAULT_PORT, DEFAULT_SUBNET, TunnelConfig,
                                     check_key_matches, join_endpoint, load_config, split_endpoint)
from lorasync.overlay.preflight import check_root, preflight
from lorasync.overlay.supervisor import argv_of, end_process, ready_line, remove_state, spawn, states
from lorasync.overlay.wgsupervisor import Supervisor, supervise_main, supervise_step

__all__ = [
    "CONFIG_VERSION",
    "DEFAULT_PORT",
    "DEFAULT_SUBNET",
    "Supervisor",
    "TunnelConfig",
    "check_key_matches",
    "check_root",
    "down",
    "down_one",
    "join_endpoint",
    "leftovers",
    "load_config",
    "preflight",
    "split_endpoint",
    "states",
    "status",
    "supervise_step",
    "up",
    "wait_handshake",
    "worker_env",
]


def up(config: str | Path, *, hub_timeout: float = 20.0, cluster: str | None = None,
       python: str = sys.executable) -> dict:
    """Bring this node's tunnel up in the background; return its state.

    Checks first (:func:`preflight`), then starts the supervisor and, on a
    node other than the hub, waits up to ``hub_timeout`` s for the hub's
    handshake; on any failure nothing is left behind.
    """
    cfg = preflight(config)
    TUNNELS_DIR.mkdir(parents=True, exist_ok=True)
    if cfg.transport == "ssh" or not cfg.wireguard:
        return _up_ssh(cfg, hub_timeout=hub_timeout, cluster=cluster, python=python)
    argv = [python, "-m", "lorasync.overlay.tunnel", "supervise", str(cfg.path)]
    if cluster:
        argv += ["--cluster", cluster]
    proc = spawn(argv, TUNNELS_DIR / f"{cfg.ifname}.log")
    try:
        line = ready_line(proc, 30.0)
        if line != "ready":
            if line.startswith("error: "):
                raise EnvironmentProblem(f"tunnel {cfg.ifname}: {line[7:]}")
            raise EnvironmentProblem(f"tunnel {cfg.ifname}: the supervisor did not start (see "
                                     f"{TUNNELS_DIR / (cfg.ifname + '.log')})")
        if not cfg.is_hub and cfg.hub_peer is not None:
            wait_handshake(cfg, cfg.hub_peer, hub_timeout)
    except BaseException:  # a failure or Ctrl-C before the tunnel is up: nothing stays
        stop_process(proc)
        down(cfg.ifname)
        raise
    if cfg.ssh_server:   # the hub also serves nodes on the SSH path
        _up_ssh(cfg, hub_timeout=hub_timeout, cluster=cluster, python=python)
    return next(s for s in states() if s.get("ifname") == cfg.ifname)


def _up_ssh(cfg: TunnelConfig, *, hub_timeout: float, cluster: str | None, python: str) -> dict:
    """A node's SSH transport, or the hub's sshd for its nodes on the SSH path;
    on failure nothing of this tunnel stays (its WireGuard side included)."""
    try:
        return sshtun.start_background(sshtun.runtime_config(cfg), cluster=cluster, python=python,
                                       ready_timeout=hub_timeout)
    except BaseException:
        down(cfg.ifname)
        raise


def wait_handshake(cfg: TunnelConfig, peer: dict, timeout: float, netns: str | None = None) -> float:
    """Seconds until ``peer``'s first handshake; EnvironmentProblem after ``timeout``."""
    t0 = time.monotonic()
    while True:
        st = wg.show(cfg.ifname, netns=netns)
        ps = st.peer(peer["public_key"])
        if ps and ps.latest_handshake:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            host, port = split_endpoint(peer["endpoint"]) if peer.get("endpoint") else ("?", 0)
            raise EnvironmentProblem(
                f"the hub {peer['name']} ({peer['endpoint']}) did not answer a WireGuard handshake "
                f"within {timeout:g} s: check that `lorasync tunnel up` runs there, that UDP port "
                f"{port} on {host} is open to this node (firewall, security group), and that both "
                f"configs come from the same `lorasync tunnel assemble`")
        time.sleep(0.1)


def down(ifname: str | None = None, *, cluster: str | None = None) -> list[str]:
    """Stop tunnels and remove everything they made; idempotent.

    ``ifname`` names one tunnel; ``cluster`` every tunnel of an emulated
    cluster; neither: every lorasync tunnel on this host.  Removes the
    supervisor and wireguard-go processes, the interface, the control socket,
    the relay's nft table and the state file.  Returns what was removed.
    """
    removed = []
    for st in states():
        # a real hub's sshd goes with its tunnel (state `tunnel` names it)
        if ifname is not None and ifname not in (st.get("ifname"), st.get("tunnel")):
            continue
        if cluster is not None and st.get("cluster") != cluster:
            continue
        removed += down_one(st)
    if ifname is not None and not any(r.startswith("state") for r in removed):
        removed += leftovers(ifname, None)
    return removed


def down_one(st: dict) -> list[str]:
    """Stop the tunnel ``st`` describes (its supervisor, its wireguard-go) and
    remove what it left; what was removed, one line each."""
    if st.get("transport") == "ssh":
        return sshtun.down_one(st)
    ifname, netns = st["ifname"], st.get("netns")
    removed = []
    # a stale state file (a crashed supervisor) may name PIDs the system has since
    # given to other processes: signal only what its command line shows is ours
    pid = st.get("pid")
    if end_process(pid, _is_supervisor, 8):
        removed.append(f"supervisor {pid}")
    wpid = st.get("wg_pid")
    if end_process(wpid, lambda p: _is_wireguard(p, ifname), 5):
        removed.append(f"wireguard-go {wpid}")
    removed += leftovers(ifname, netns)
    removed += remove_state(ifname)
    return removed


def _is_supervisor(pid: int) -> bool:
    """Whether ``pid`` runs a lorasync tunnel supervisor: ``python -m
    lorasync.overlay.tunnel supervise CONFIG`` (``up``) or ``lorasync tunnel up
    --foreground CONFIG``."""
    args = argv_of(pid)
    if "lorasync.overlay.tunnel" in args and "supervise" in args:
        return True
    return (any(os.path.basename(a) == "lorasync" for a in args)
            and {"tunnel", "up", "--foreground"} <= set(args))


def _is_wireguard(pid: int, ifname: str) -> bool:
    """Whether ``pid`` runs ``wireguard-go`` for ``ifname`` (as ``wireguard-go -f IFNAME``)."""
    args = argv_of(pid)
    return bool(args) and os.path.basename(args[0]) == "wireguard-go" and ifname in args[1:]


def _ns(netns: str | None, argv: list[str]) -> list[str]:
    return (["ip", "netns", "exec", netns] if netns else []) + argv


def leftovers(ifname: str, netns: str | None) -> list[str]:
    """What a killed supervisor may have left: interface, socket, nft table."""
    removed = []
    if netns and not Path(f"/run/netns/{netns}").exists():
        netns_gone = True
    else:
        netns_gone = False
    if not netns_gone:
        link = subprocess.run(_ns(netns, ["ip", "link", "show", ifname]), capture_output=True)
        if link.returncode == 0:
            subprocess.run(_ns(netns, ["ip", "link", "del", ifname]), capture_output=True)
            removed.append(f"interface {ifname}")
        if subprocess.run(["sh", "-c", "command -v nft"], capture_output=True).returncode == 0:
            t = wg.nft_table_name(ifname)
            if subprocess.run(_ns(netns, ["nft", "delete", "table", "inet", t]),
                              capture_output=True).returncode == 0:
                removed.append(f"nft table inet {t}")
    sock = wg.socket_path(ifname)
    if sock.exists() and not wg._socket_alive(sock):
        sock.unlink()
        removed.append(f"socket {sock}")
    return removed


def status(ifname: str | None = None, *, measure: bool = True, seconds: float = 1.0,
           cluster: str | None = None) -> list[dict]:
    """Every tunnel here (or ``ifname``): per peer the handshake age, bytes in
    and out, RTT and rate measured through the overlay, direct or relayed."""
    out = []
    for st in states():
        if ifname is not None and st.get("ifname") != ifname:
            continue
        if cluster is not None and st.get("cluster") != cluster:
            continue
        out.append(_status_one(st, measure, seconds))
    if ifname is not None and not out:
        raise ConfigError("--ifname", ifname, "no lorasync tunnel of this name is up here "
                          "(`lorasync tunnel status` lists them)")
    return out


def _status_one(st: dict, measure: bool, seconds: float) -> dict:
    if st.get("transport") == "ssh":
        return sshtun.status_one(st, measure, seconds)
    cfg = load_config(st["config"])
    netns = st.get("netns")
    alive = pid_alive(st.get("pid"))
    dev = None
    error = None
    try:
        dev = wg.show(cfg.ifname, netns=netns)
    except (LorasyncError, ValueError) as exc:
        error = str(exc)
    now = time.time()
    by_key = {p.public_key: p for p in dev.peers} if dev else {}
    peers = []
    for n in cfg.nodes:
        if n["name"] == cfg.node:
            continue
        route = cfg.routes.get(n["name"], "direct")
        via = cfg.hub_peer if route != "direct" else next(
            (p for p in cfg.peers if p["name"] == n["name"]), None)
        path = (st.get("paths") or {}).get(n["name"])
        if path and path.get("path") == "direct":  # hole punched (punch.py)
            route, via = "direct (hole punched)", {"public_key": n["public_key"]}
        ps = by_key.get(via["public_key"]) if via else None
        row = {"name": n["name"], "address": n["address"], "route": route,
               "transport": n.get("transport", "wireguard"), "reason": n.get("reason", ""),
               "relayed": not route.startswith("direct"), "path": path,
               "endpoint": ps.endpoint if ps else None,
               "handshake_age_s": ps.handshake_age(now) if ps else None,
               "rx_bytes": ps.rx_bytes if ps else None, "tx_bytes": ps.tx_bytes if ps else None,
               "is_hub": n["name"] == cfg.hub}
        if measure and dev is not None:
            row.update(linktest.measure_peer(n["address"], cfg.listen_port, seconds, netns))
        peers.append(row)
    mine = next((n for n in cfg.nodes if n.get("name") == cfg.node), {})
    return {"ifname": cfg.ifname, "transport": "wireguard",
            "reason": mine.get("reason") or ("relays for the nodes that cannot reach each other"
                                             if cfg.relay else ""),
            "node": cfg.node, "address": cfg.address, "prefixlen": cfg.prefixlen,
            "mtu": st.get("mtu"), "listen_port": cfg.listen_port, "hub": cfg.hub, "is_hub": cfg.is_hub,
            "netns": netns, "cluster": st.get("cluster"), "supervisor_pid": st.get("pid"),
            "supervisor_alive": alive, "wg_pid": st.get("wg_pid"), "restarts": st.get("restarts", 0),
            "started": st.get("started"), "log": st.get("log"), "error": error, "peers": peers}


# ---------------------------------------------------------------- training over it

def worker_env(cfg_or_state: TunnelConfig) -> dict[str, str]:
    """What gloo/NCCL need to run over the overlay."""
    name = getattr(cfg_or_state, "device", None) or cfg_or_state.ifname
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


if __name__ == "__main__":
    sys.exit(supervise_main())
