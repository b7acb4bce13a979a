"""Gradient-sync strategies and the public ``attach`` API.

    sync = lorasync.attach(ddp_model, "int8", **options)
    ...
    loss.backward(); optimizer.step(); sync.after_step()
    ...
    sync.finish()

``comm`` knows nothing about models or data: it gets a DDP module (whose
trainable parameters are the adapter) and optionally a process group.

Strategies (module): allreduce, none (reference); fp16, bf16 (lowprec);
int8, onebit (twophase); topk; powersgd; local, diloco (periodic); auto
(auto: measures and switches, with the policy of ``lorasync.plan.policy``);
torch_fp16, torch_powersgd (torch_hooks: torch's own hooks, bench baselines).
Their options, kinds and byte formulas are in :mod:`lorasync.catalog`
(``catalog.wire_bytes`` gives the bytes per step without running anything).

Layout (``hierarchy``): with several ranks on each of several nodes
(:mod:`lorasync.comm.topology` finds them), ``auto`` and ``node`` wrap the
strategy in :class:`~lorasync.comm.hierarchy.Hierarchical` (exact inside the
node, the strategy across node leaders); ``flat`` runs it over all ranks.
``cross_node``: how a hierarchical periodic strategy (local, diloco)
crosses nodes: ``auto``/``shards`` (local rank j of every node carries 1/G
of each outer sync) or ``leaders`` (the node's lowest rank carries all of
it); per-step strategies always cross by their leaders.
``allreduce_algo``: ``ring`` (the backend's own), ``recursive_doubling``
(lorasync's, from point-to-point sends; gloo only), or ``auto`` (per message,
from the cost model and a short timed probe of the link at attach).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lorasync.comm import (auto, lowprec, periodic, powersgd, reference, topk,  # noqa: F401
                           torch_hooks, twophase)   # (importing them registers the strategies)
from lorasync import catalog
from lorasync.catalog import ALLREDUCE_ALGOS, CROSS_NODE, HIERARCHIES
from lorasync.comm.base import HookSync, Sync, get_strategy, strategy_names
from lorasync.comm.hierarchy import NOT_HIERARCHICAL, Hierarchical
from lorasync.errors import ConfigError

# HIERARCHIES, ALLREDUCE_ALGOS, CROSS_NODE: what attach() takes, from the catalog
__all__ = ["attach", "Sync", "HookSync", "strategy_names", "get_strategy", "HIERARCHIES",
           "ALLREDUCE_ALGOS", "CROSS_NODE", "use_hierarchy"]


def use_hierarchy(strategy: str, hierarchy: str, topo, options: dict) -> bool:
    """Whether ``strategy`` runs hierarchically on ``topo`` (None: unknown, flat).

    ``auto``: where several nodes have several ranks each, for every strategy
    that can (1-bit Adam, onebit's default, stays flat: its optimizer step
    runs on every rank); ``node``: always, or a ValueError naming why not.
    """
    if hierarchy == "flat" or topo is None:
        if hierarchy == "node" and topo is None:
            raise ConfigError("hierarchy", "node", "needs the default process group (no "
                              "process_group) so that every rank can build the node groups")
        return False
    if hierarchy == "node":
        if strategy in NOT_HIERARCHICAL:
            raise ConfigError("hierarchy", "node", f"{strategy} runs flat only; use "
                              "--hierarchy flat (or auto)")
        return True
    if strategy in NOT_HIERARCHICAL or not topo.multi_rank_nodes or not topo.uniform:
        return False
    return catalog.flat_only(strategy, options) is None


def attach(ddp: torch.nn.parallel.DistributedDataParallel, strategy: str,
           process_group=None, *, hierarchy: str = "auto", ranks_per_node: int | None = None,
           allreduce_algo: str = "ring", cross_node: str = "auto", **options: Any) -> Sync:
    """Attach a sync strategy to a DDP model; see the module docstring.

    ``hierarchy``: ``auto`` (hierarchical where several nodes hold several
    ranks each), ``flat`` or ``node``; ``ranks_per_node``: take consecutive
    blocks of that many ranks as nodes instead of detecting them (tests,
    several "nodes" on one host); ``allreduce_algo``: ``ring``,
    ``recursive_doubling`` or ``auto`` (per message); ``cross_node``: one of
    :data:`CROSS_NODE` (module docstring).

    Raises ValueError for an unknown strategy, an option the strategy does not
    take or a bad value, or a backend that lacks what the strategy needs.
    Every rank must call it (some strategies probe the backend with a tiny
    collective; the topology is one all-gather of host keys).

    At exit the sync is settled and the process groups are destroyed
    (:mod:`lorasync.comm.shutdown`); a loop should still end with
    ``sync.finish()`` (the replicas identical) and may call
    ``dist.destroy_process_group()`` itself.
    """
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"ddp: expected torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}"
        )
    if hierarchy not in HIERARCHIES:
        raise ConfigError("hierarchy", hierarchy, "use one of " + ", ".join(HIERARCHIES))
    if allreduce_algo not in ALLREDUCE_ALGOS:
        raise ConfigError("allreduce_algo", allreduce_algo,
                          "use one of " + ", ".join(ALLREDUCE_ALGOS))
    if cross_node not in CROSS_NODE:
        raise ConfigError("cross_node", cross_node, "use one of " + ", ".join(CROSS_NODE))
    cls = get_strategy(strategy)
    topo = None
    if process_group is None and dist.get_world_size() > 1 and hierarchy != "flat":
        from lorasync.comm.topology import detect
        topo = detect(None, ranks_per_node)
    elif ranks_per_node and hierarchy != "flat":
        raise ConfigError("ranks_per_node", ranks_per_node, "applies to the default process "
                          "group only")
    if strategy == "auto":
        return _track(cls(ddp, process_group=process_group, hierarchy=hierarchy, topology=topo,
                         allreduce_algo=allreduce_algo, cross_node=cross_node, **options))
    if use_hierarchy(strategy, hierarchy, topo, options):
        return _track(Hierarchical(ddp, strategy, topo, allreduce_algo=allreduce_algo,
                                  cross_node=cross_node, **options))
    sync = cls(ddp, process_group=process_group, **options)
    sync.spans_nodes = topo.num_nodes > 1 if topo is not None else True
    if allreduce_algo != "ring":
        sync.wire.set_algo(_chooser(allreduce_algo, sync.wire, sync))
    return _track(sync)


def _track(sync: Sync) -> Sync:
    """``sync``, settled at exit by lorasync's exit guard (lorasync.comm.shutdown)."""
    from lorasync.comm import shutdown
    shutdown.track(sync)
    return sync


def _chooser(algo: str, wire, sync: Sync):
    """``algo``, or for ``auto`` the cost model's choice on this wire's link."""
    if algo != "auto":
        return algo
    from lorasync.comm.probe import algo_chooser
    return algo_chooser(wire, sync.collective_device())

