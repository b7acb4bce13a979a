"""Which ranks share a node, and the process groups that follow from it.

A node is what its ranks' traffic stays inside: the same kernel (host name
and ``/proc/sys/kernel/random/boot_id``) *and* the same network namespace
(the inode of ``/proc/self/ns/net``).  The namespace is what separates the
nodes of an emulated cluster, which share host name and boot id; two
containers with their own network stacks on one host are two nodes for the
same reason (their traffic crosses a virtual link).  Every rank sends its key
once (``all_gather_object``, at attach) and every rank groups the keys the
same way, so all ranks agree on the nodes without asking anyone else.

torchrun's view (``GROUP_RANK``: the agent, ``LOCAL_RANK``) is checked
against the keys: ranks of one agent always share a key; ranks of different
agents that share one (two agents on one host, as tests do) are one node all
the same (their traffic is local), and the topology says so in ``notes``.
``ranks_per_node=G`` overrides detection: consecutive blocks of G ranks are
taken as nodes (several "nodes" on one host, for tests and experiments).

From the nodes, :meth:`Topology.build_groups` makes the process groups a
hierarchical sync needs: one group per node (its ranks; the first is the
node's leader) and one group of the leaders, across nodes.  Every rank calls
``new_group`` for every group, in the same order, as torch requires.  A
variant with G cross-node groups (local rank j of every node), each owning
1/G of every message, is built on request (``shards=True``): it spreads a
node's traffic over G connections (and G NICs where a node has them);
``bench/topology_groups.py`` measures it against the leaders' group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.distributed as dist

from lorasync.comm.wire import Wire
from lorasync.errors import ConfigError

__all__ = ["Topology", "node_key", "group_nodes", "detect"]

Key = tuple[str, str, int]


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def node_key() -> Key:
    """(host name, boot id, network-namespace inode) of this process."""
    try:
        ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        ns = 0
    return socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), ns


def group_nodes(keys: Sequence[Any], ranks_per_node: int | None = None
                ) -> tuple[tuple[int, ...], ...]:
    """The nodes, as tuples of ranks, from every rank's key (pure).

    Nodes are ordered by their lowest rank and hold their ranks in order, so
    the first rank of a node (its leader) is its lowest.  ``ranks_per_node``
    takes consecutive blocks of that many ranks instead of the keys.
    """
    n = len(keys)
    if ranks_per_node:
        g = int(ranks_per_node)
        if g < 1 or n % g:
            raise ConfigError("ranks_per_node", ranks_per_node,
                              f"must divide the world size {n} (e.g. {_divisors(n)})")
        return tuple(tuple(range(i, i + g)) for i in range(0, n, g))
    order: dict[Any, list[int]] = {}
    for r, k in enumerate(keys):
        order.setdefault(k, []).append(r)
    return tuple(tuple(v) for v in order.values())


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass
class Topology:
    """The nodes of a job and this rank's place in them."""

    #: global ranks of every node (ordered by lowest rank; the first is the leader)
    nodes: tuple[tuple[int, ...], ...]
    #: this process's global rank
    rank: int
    #: where the nodes came from: "detected" or "ranks_per_node=G"
    source: str = "detected"
    #: disagreements between the keys and torchrun's agents (informational)
    notes: tuple[str, ...] = ()
    #: process groups (``build_groups``): this node's ranks; the leaders (None
    #: on other ranks); the G shard groups (local rank j of every node)
    local_group: Any = field(default=None, repr=False, compare=False)
    leader_group: Any = field(default=None, repr=False, compare=False)
    shard_group: Any = field(default=None, repr=False, compare=False)
    _built: bool = field(default=False, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def node_index(self) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if self.rank in ranks)

    @property
    def node_ranks(self) -> tuple[int, ...]:
        return self.nodes[self.node_index]

    @property
    def local_rank(self) -> int:
        return self.node_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.node_ranks)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(ranks[0] for ranks in self.nodes)

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def uniform(self) -> bool:
        """Whether every node has the same number of ranks."""
        return len({len(r) for r in self.nodes}) == 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node (the largest node's count when they differ)."""
        return max(len(r) for r in self.nodes)

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.nodes)

    @property
    def multi_rank_nodes(self) -> bool:
        """Several nodes with several ranks each: where a hierarchy pays."""
        return self.num_nodes > 1 and self.ranks_per_node > 1

    def describe(self) -> str:
        sizes = sorted({len(r) for r in self.nodes})
        per = str(sizes[0]) if len(sizes) == 1 else "/".join(map(str, sizes))
        return f"{self.num_nodes} node(s) x {per} rank(s) ({self.source})"

    def build_groups(self, shards: bool = False) -> "Topology":
        """Create the node groups and the leaders' group (once; every rank
        must call this, at the same point).  ``shards``: also the G groups of
        local rank j of every node (uniform nodes only)."""
        if self._built and (self.shard_group is not None or not shards):
            return self
        if not self._built:
            for ranks in self.nodes:  # every rank creates every group, in order
                g = dist.new_group(list(ranks))
                if self.rank in ranks:
                    self.local_group = g
            g = dist.new_group(list(self.leaders))
            self.leader_group = g if self.is_leader else None
            self._built = True
        if shards:
            if not self.uniform:
                raise ConfigError("topology", self.describe(),
                                  "shard groups need the same number of ranks on every node")
            for j in range(self.ranks_per_node):
                g = dist.new_group([ranks[j] for ranks in self.nodes])
                if self.local_rank == j:
                    self.shard_group = g
        return self

    def to_dict(self) -> dict:
        return {"nodes": [list(r) for r in self.nodes], "source": self.source,
                "notes": list(self.notes)}


_CACHE: dict[tuple, tuple[Any, Topology]] = {}


def detect(group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None
           ) -> Topology:
    """This job's topology (collective: every rank of ``group`` calls it).

    Cached per (group, ranks_per_node): strategies that ``auto`` builds and
    rebuilds share one topology and one set of process groups.
    """
    pg = group if group is not None else dist.group.WORLD
    key = (id(pg), ranks_per_node or 0)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is pg:  # (a re-initialised world gets a fresh one)
        return hit[1]
    wire = Wire(group, lambda n: None)
    env = os.environ
    mine = {"key": node_key(), "agent": env.get("GROUP_RANK"), "local": env.get("LOCAL_RANK")}
    everyone = wire.all_gather_object(mine)
    nodes = group_nodes([e["key"] for e in everyone], ranks_per_node)
    notes = []
    if not ranks_per_node:
        agents = {}
        for ranks in nodes:
            a = sorted({str(everyone[r]["agent"]) for r in ranks})
            if len(a) > 1 and a != ["None"]:
                notes.append(f"ranks {list(ranks)} share a host and network namespace but "
                             f"belong to torchrun agents {', '.join(a)}: one node")
            for x in a:
                agents.setdefault(x, set()).add(ranks)
        for a, held in agents.items():
            if a != "None" and len(held) > 1:
                notes.append(f"torchrun agent {a} holds ranks in {len(held)} network "
                             "namespaces: taken as that many nodes")
    topo = Topology(nodes=nodes, rank=wire.rank, notes=tuple(notes),
                    source=f"ranks_per_node={ranks_per_node}" if ranks_per_node else "detected")
    _CACHE[key] = (pg, topo)
    return topo
