"""The WireGuard overlay of an emulated cluster (``overlay=wireguard``).

Every node runs the same tunnel a real host runs: ``lorasync tunnel up`` in
its namespace, from a config made the way a real overlay's is
(:func:`lorasync.overlay.enroll.enroll_locally`: the plan, then each node's
own ``join``, its key made in its own directory ``NODE/private.key``, 0600,
then ``assemble``), under ``/run/lorasync/clusters/NAME.overlay/``.  Nodes
outside NAT get their cluster address as endpoint, nodes behind NAT none; the
hub is the first node outside NAT.  WireGuard's UDP packets cross the
cluster's shaped links (and its delay forwarder and NAT routers), so the
overlay runs on top of the emulated network, not beside it.

Interface names are unique on the host (wireguard-go's control sockets share
one directory across namespaces): ``lsw`` + 5 hex digits of the cluster name
+ ``n`` + the node index.

``overlay=ssh``: every node but the hub reaches it over SSH's tun forwarding
(:mod:`lorasync.overlay.sshtun`): the hub's namespace runs lorasync's own
sshd (on its cluster address, port :data:`SSH_PORT`), each node an ``ssh -w``
into device ``tun(100+I)``; no WireGuard.  ``overlay=auto`` tries, from each
node, the paths to the hub (:func:`probe`, with :mod:`lorasync.overlay.probe`:
UDP to its WireGuard port, TCP to its SSH port) and picks per node: WireGuard
where UDP reaches the hub (direct, or relayed through the hub between two nodes
behind NAT until they punch a direct path, :mod:`lorasync.overlay.punch`, as
with ``overlay=wireguard``), SSH where only TCP does; each choice and its reason
go into the overlay's configs (``tunnel status`` and ``cluster status``
show them).  sshd runs only when some node uses the SSH path, and goes with
the cluster (its namespace, ``down``, a failed build).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import select
import shutil
import subprocess
import sys
from pathlib import Path

from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.hostops import CLUSTERS_DIR, TUNNELS_DIR
from lorasync.overlay import probe as probe_mod

__all__ = ["OVERLAY_PORT", "SSH_PORT", "build", "choose", "config_dir", "hub_index", "ifname",
           "layout", "probe", "remove"]

OVERLAY_PORT = 51820
#: the hub's sshd, on its cluster address: the port networks that let only TCP out still pass
SSH_PORT = 22
KINDS = ("wireguard", "ssh", "auto")
#: how long a node's `tunnel up` waits for the hub's WireGuard handshake
HUB_TIMEOUT_S = 20.0


def ifname(cluster: str, index: int) -> str:
    return f"lsw{hashlib.sha1(cluster.encode()).hexdigest()[:5]}n{index}"


def hub_index(nodes: int, nat: list[int]) -> int:
    """The overlay's hub: the first node every node can reach."""
    free = [i for i in range(nodes) if i not in nat]
    if not free:
        raise ConfigError("nat", ",".join(f"node{i}" for i in nat),
                          "every node is behind NAT, so no node can be the overlay's hub (nodes "
                          "behind NAT only connect out): leave at least one node outside NAT")
    return free[0]


def layout(nodes: int, nat: list[int], subnet: str, cluster: str,
           transports: dict | None = None) -> list[tuple[str, str]]:
    """(overlay address, interface) of each node: the hub gets the first address,
    the others the next ones in node order (as :func:`~lorasync.overlay.enroll.plan_overlay`).
    A node on the SSH path (``transports``: {index: "ssh"}) uses its tun device."""
    from lorasync.overlay.sshtun import tun_number

    hosts = list(ipaddress.IPv4Network(subnet).hosts())
    h = hub_index(nodes, nat)
    order = [h] + [i for i in range(nodes) if i != h]
    pos = {i: k for k, i in enumerate(order)}
    # the hub serves the SSH nodes; its own interface is its tunnel's (or the stand-in's)
    ssh = {int(k) for k, v in (transports or {}).items() if v == "ssh"} - {h}
    return [(str(hosts[pos[i]]), f"tun{tun_number(i)}" if i in ssh else ifname(cluster, i))
            for i in range(nodes)]


def ssh_state_name(cluster: str) -> str:
    """The hub's SSH server, in the tunnels' state directory."""
    return f"lsw{hashlib.sha1(cluster.encode()).hexdigest()[:5]}s"


def config_dir(cluster: str) -> Path:

    return CLUSTERS_DIR / f"{cluster}.overlay"


def build(cluster) -> dict[int, dict]:
    """Write every node's tunnel config and bring the tunnels up (hub first);
    returns {node index: {"transport", "reason"}}.

    Raises EnvironmentProblem (with the install command) when the tools a
    chosen transport needs are missing; the caller removes what was made on
    failure.
    """
    from lorasync.overlay import enroll, sshtun, wireguard as wg

    spec = cluster.spec
    nat = list(spec.nat)
    h = hub_index(spec.nodes, nat)
    choice = choose(cluster, h)
    ssh_nodes = [i for i, c in choice.items() if c["transport"] == "ssh" and i != h]
    wg_nodes = [i for i, c in choice.items() if c["transport"] == "wireguard" and i != h]
    d = config_dir(spec.name)
    if wg_nodes:
        relay = sum(1 for i in range(spec.nodes) if i in nat) >= 2 or bool(ssh_nodes)
        wg.require_tools(need_nft=relay)
    if ssh_nodes:
        sshtun.require_tools(server=True)
    nodes = [enroll.NodeSpec(n.name, None if n.nat else f"{n.outside}:{OVERLAY_PORT}", OVERLAY_PORT,
                             transport=choice[n.index]["transport"], reason=choice[n.index]["reason"])
             for n in cluster.nodes]
    if wg_nodes:
        enroll.enroll_locally(d, nodes, cluster.nodes[h].name, subnet=spec.overlay_subnet,
                              ifname=lambda i: ifname(spec.name, i), force=True)
    d.mkdir(parents=True, exist_ok=True)
    if ssh_nodes:
        _write_ssh(cluster, h, ssh_nodes, dummy=not wg_nodes, choice=choice)
    order = [i for i in range(spec.nodes) if i != h]
    if wg_nodes:
        _up(cluster, [h], d)  # the others wait for the hub's handshake
    if ssh_nodes:
        _ssh_up(cluster, [(h, d / "hub.ssh.json")])
    procs = []
    for i in order:
        if i in wg_nodes:
            procs.append((cluster.nodes[i], _start_tunnel(cluster, i, d)))
        else:
            procs.append((cluster.nodes[i], _start_ssh(cluster, i, d / f"{cluster.nodes[i].name}.ssh.json")))
    _wait(procs)
    return choice


def choose(cluster, h: int) -> dict[int, dict]:
    """Each node's transport and why: the kind the cluster asked for, or with
    ``auto`` what :func:`probe` found from each node."""
    spec = cluster.spec
    hub = cluster.nodes[h]
    out = {h: {"transport": "wireguard" if spec.overlay != "ssh" else "ssh-hub",
               "reason": "the hub: the first node outside NAT, every node connects to it"}}
    others = [i for i in range(spec.nodes) if i != h]
    if spec.overlay == "wireguard":
        out.update({i: {"transport": "wireguard", "reason": "overlay=wireguard"} for i in others})
    elif spec.overlay == "ssh":
        out.update({i: {"transport": "ssh", "reason": "overlay=ssh"} for i in others})
    else:
        found = probe(cluster, h, others)
        for i in others:
            udp, tcp = found[i]
            relayed = bool(cluster.nodes[i].nat) and sum(1 for j in spec.nat if j != h) >= 2
            try:
                transport, reason = probe_mod.decide(udp, tcp, host=hub.outside,
                                                     udp_port=OVERLAY_PORT, ssh_port=SSH_PORT,
                                                     relayed=relayed, fix="")
            except EnvironmentProblem as exc:
                raise EnvironmentProblem(f"overlay=auto: {cluster.nodes[i].name}: {exc}") from None
            out[i] = {"transport": transport, "reason": reason}
        if all(out[i]["transport"] == "ssh" for i in others):
            out[h]["transport"] = "ssh-hub"
    for c in out.values():
        if c["transport"] == "ssh-hub":
            c["transport"] = "ssh"
            c["reason"] = (c["reason"] + "; serves its nodes' SSH connections (sshd on "
                           f"{hub.outside}:{SSH_PORT})")
    if spec.overlay == "auto" and any(out[i]["transport"] == "ssh" for i in others) \
            and out[h]["transport"] == "wireguard":
        out[h]["reason"] += f"; sshd on {hub.outside}:{SSH_PORT} for the nodes on the SSH path"
    return out


def probe(cluster, h: int, nodes: list[int], udp_port: int = OVERLAY_PORT,
          tcp_port: int = SSH_PORT) -> dict[int, tuple[bool, bool]]:
    """From each of ``nodes``, in its namespace: does UDP to the hub's WireGuard
    port come back, does TCP to its SSH port connect?  A stand-in server in
    the hub's namespace answers both (nothing of the overlay runs yet; on a
    cluster whose overlay runs, give other ports)."""
    hub = cluster.nodes[h]
    mod = [sys.executable, "-m", "lorasync.overlay.probe"]
    srv = subprocess.Popen(cluster.exec_argv(h, [*mod, "serve", hub.outside, str(udp_port),
                                                 str(tcp_port)]),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([srv.stdout], [], [], 15.0)
        if not ready or srv.stdout.readline().strip() != "ready":
            raise EnvironmentProblem(f"overlay=auto: the probe server in {hub.netns} did not start")
        clients = {i: subprocess.Popen(cluster.exec_argv(i, [
            *mod, "check", hub.outside, str(udp_port), str(tcp_port)]), stdout=subprocess.PIPE,
            text=True) for i in nodes}
        out = {}
        for i, p in clients.items():
            text = p.communicate(timeout=30)[0]
            udp, tcp = json.loads(text) if p.returncode == 0 else (False, False)
            out[i] = (bool(udp), bool(tcp))
        return out
    finally:
        srv.kill()
        srv.communicate()


def _write_ssh(cluster, h: int, ssh_nodes: list[int], *, dummy: bool, choice: dict) -> None:
    """The SSH files (client key, host key, known_hosts, authorized_keys) and
    the hub's and each SSH node's transport config."""
    from lorasync.overlay import sshtun

    spec = cluster.spec
    d = config_dir(spec.name)
    sd = d / "ssh"
    hub = cluster.nodes[h]
    clients = [{"name": cluster.nodes[i].name, "address": cluster.nodes[i].overlay_address,
                "tun": sshtun.tun_number(i)} for i in ssh_nodes]
    sshtun.prepare(sd, server=hub.outside, port=SSH_PORT, clients=clients)
    common = dict(hub=hub.name, subnet=spec.overlay_subnet, server=hub.outside, port=SSH_PORT,
                  state_dir=sd, linktest_port=OVERLAY_PORT)
    sshtun.write_config(sshtun.SSHConfig(
        path=d / "hub.ssh.json", role="hub", name=ssh_state_name(spec.name), node=hub.name,
        address=hub.overlay_address, clients=clients, dummy=ifname(spec.name, h) if dummy else None,
        reason=choice[h]["reason"], **common), d / "hub.ssh.json")
    for i in ssh_nodes:
        n = cluster.nodes[i]
        sshtun.write_config(sshtun.SSHConfig(
            path=d / f"{n.name}.ssh.json", role="node", name=ifname(spec.name, i), node=n.name,
            address=n.overlay_address, tun=sshtun.tun_number(i), reason=choice[i]["reason"],
            **common), d / f"{n.name}.ssh.json")


def _start_tunnel(cluster, i: int, d: Path) -> subprocess.Popen:
    n = cluster.nodes[i]
    argv = cluster.exec_argv(i, [sys.executable, "-m", "lorasync", "tunnel", "up", "--config",
                                 str(d / f"{n.name}.tunnel.json"), "--cluster", cluster.spec.name,
                                 "--hub-timeout", str(HUB_TIMEOUT_S), "--quiet"])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start_ssh(cluster, i: int, cfg: Path) -> subprocess.Popen:
    """The SSH transport's supervisor in node ``i``'s namespace, in a session of
    its own (it outlives this call); it prints ``ready`` or ``error: ...``."""
    from lorasync.hostops import TUNNELS_DIR

    TUNNELS_DIR.mkdir(parents=True, exist_ok=True)
    argv = cluster.exec_argv(i, [sys.executable, "-m", "lorasync.overlay.sshtun", "supervise",
                                 str(cfg), "--cluster", cluster.spec.name])
    name = json.loads(cfg.read_text())["name"]
    err = open(TUNNELS_DIR / f"{name}.supervisor.log", "ab")
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                             text=True, start_new_session=True, close_fds=True)
    finally:
        err.close()
    p._lorasync_ssh = True  # type: ignore[attr-defined]
    return p


def _ssh_up(cluster, items: list[tuple[int, Path]]) -> None:
    _wait([(cluster.nodes[i], _start_ssh(cluster, i, cfg)) for i, cfg in items])


def _wait(procs: list) -> None:
    errors = []
    for n, p in procs:
        if getattr(p, "_lorasync_ssh", False):
            ready, _, _ = select.select([p.stdout], [], [], 60.0)
            line = p.stdout.readline().strip() if ready else ""
            p.stdout.close()
            if line != "ready":
                errors.append(f"{n.name} (SSH): {line.removeprefix('error: ') or 'did not start'}")
            continue
        out, err = p.communicate(timeout=120)
        if p.returncode != 0:
            lines = [ln for ln in (err or out).strip().splitlines() if ln.strip()]
            errors.append(f"{n.name}: {lines[-1] if lines else f'exit {p.returncode}'}")
    if errors:
        raise EnvironmentProblem("the overlay did not come up: " + "; ".join(errors))


def _up(cluster, indices: list[int], d: Path) -> None:
    _wait([(cluster.nodes[i], _start_tunnel(cluster, i, d)) for i in indices])


def remove(cluster: str | None) -> list[str]:
    """Take down the tunnels of ``cluster`` (every cluster when None) and
    remove their configs (keys) and logs."""
    from lorasync.overlay import tunnel

    removed = []
    states = [s for s in tunnel.states() if s.get("cluster") and (cluster is None or s["cluster"] == cluster)]
    names = {s["ifname"] for s in states}
    for s in states:
        removed += tunnel.down_one(s)
    dirs = [config_dir(cluster)] if cluster else sorted(CLUSTERS_DIR.glob("*.overlay"))
    for d in dirs:
        if d.is_dir():
            for cfg in [*d.glob("*.tunnel.json"), *d.glob("*/tunnel.json")]:  # and an older layout's
                names.add(_ifname_of(cfg))
            for cfg in d.glob("*.ssh.json"):
                names.add(_ifname_of(cfg, "name"))
            shutil.rmtree(d)
            removed.append(f"overlay configs {d}")
    for name in sorted(n for n in names if n):
        removed += tunnel.leftovers(name, None)
        for log in (TUNNELS_DIR / f"{name}.log", TUNNELS_DIR / f"{name}.wireguard-go.log",
                    TUNNELS_DIR / f"{name}.ssh.log", TUNNELS_DIR / f"{name}.supervisor.log"):
            if log.exists():
                log.unlink()
    return removed


def _ifname_of(cfg: Path, key: str = "ifname") -> str | None:
    try:
        return json.loads(cfg.read_text()).get(key)
    except (OSError, ValueError):
        return None
