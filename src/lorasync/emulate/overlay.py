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
"""

from __future__ import annotations

import hashlib
import ipaddress
import shutil
import subprocess
import sys
from pathlib import Path

from lorasync.errors import ConfigError, EnvironmentProblem
from lorasync.hostops import CLUSTERS_DIR, TUNNELS_DIR

__all__ = ["OVERLAY_PORT", "build", "config_dir", "hub_index", "ifname", "layout", "remove"]

OVERLAY_PORT = 51820
KINDS = ("wireguard",)


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


def layout(nodes: int, nat: list[int], subnet: str, cluster: str) -> list[tuple[str, str]]:
    """(overlay address, interface) of each node: the hub gets the first address,
    the others the next ones in node order (as :func:`~lorasync.overlay.enroll.plan_overlay`)."""
    hosts = list(ipaddress.IPv4Network(subnet).hosts())
    h = hub_index(nodes, nat)
    order = [h] + [i for i in range(nodes) if i != h]
    pos = {i: k for k, i in enumerate(order)}
    return [(str(hosts[pos[i]]), ifname(cluster, i)) for i in range(nodes)]


def config_dir(cluster: str) -> Path:

    return CLUSTERS_DIR / f"{cluster}.overlay"


def build(cluster) -> None:
    """Write every node's tunnel config and bring the tunnels up (hub first).

    Raises EnvironmentProblem (with the install command) when the WireGuard
    tools are missing; the caller removes what was made on failure.
    """
    from lorasync.overlay import enroll, wireguard as wg

    spec = cluster.spec
    nat = list(spec.nat)
    relay = sum(1 for i in range(spec.nodes) if i in nat) >= 2
    wg.require_tools(need_nft=relay)
    h = hub_index(spec.nodes, nat)
    nodes = [enroll.NodeSpec(n.name, None if n.nat else f"{n.outside}:{OVERLAY_PORT}", OVERLAY_PORT)
             for n in cluster.nodes]
    d = config_dir(spec.name)
    enroll.enroll_locally(d, nodes, cluster.nodes[h].name, subnet=spec.overlay_subnet,
                          ifname=lambda i: ifname(spec.name, i), force=True)
    order = [h] + [i for i in range(spec.nodes) if i != h]
    _up(cluster, order[:1], d)  # the others wait for the hub's handshake
    _up(cluster, order[1:], d)


def _up(cluster, indices: list[int], d: Path) -> None:
    procs = []
    for i in indices:
        n = cluster.nodes[i]
        argv = cluster.exec_argv(i, [sys.executable, "-m", "lorasync", "tunnel", "up", "--config",
                                     str(d / f"{n.name}.tunnel.json"), "--cluster", cluster.spec.name,
                                     "--quiet"])
        procs.append((n, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)))
    errors = []
    for n, p in procs:
        out, err = p.communicate(timeout=120)
        if p.returncode != 0:
            lines = [ln for ln in (err or out).strip().splitlines() if ln.strip()]
            errors.append(f"{n.name}: {lines[-1] if lines else f'exit {p.returncode}'}")
    if errors:
        raise EnvironmentProblem("the overlay did not come up: " + "; ".join(errors))


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
            shutil.rmtree(d)
            removed.append(f"overlay configs {d}")
    for name in sorted(n for n in names if n):
        removed += tunnel.leftovers(name, None)
        for log in (TUNNELS_DIR / f"{name}.log", TUNNELS_DIR / f"{name}.wireguard-go.log"):
            if log.exists():
                log.unlink()
    return removed


def _ifname_of(cfg: Path) -> str | None:
    import json

    try:
        return json.loads(cfg.read_text()).get("ifname")
    except (OSError, ValueError):
        return None
