"""Hierarchical sync: exact inside a node, any strategy across nodes.

With G ranks on each of N nodes, a flat strategy runs on N*G ranks over the
slow link: top-k all-gathers G*N payloads where N would do, the two-phase
all-to-all of int8/onebit sends G times what a node-level exchange needs,
and a ring all-reduce of a small message waits on 2(NG-1) round trips of the
slow link instead of 2(N-1).  :class:`Hierarchical` wraps a strategy so that

1. every bucket is first all-reduced exactly inside the node (fast link;
   the node's mean gradient), in the bucket's own hook;
2. the node's leader (its lowest rank) runs the strategy's own hook on that
   mean, over a group of the N leaders: the strategy sees a world of N ranks,
   each holding its node's exact mean, and keeps its state (error feedback,
   warm-start Q, the outer optimizer) per cross-node shard, on the leader;
3. the result is broadcast inside the node.  Broadcasts are issued in bucket
   order on every rank of the node, in the last bucket's hook (never from a
   future callback): the leader waits there for each bucket's cross-node
   result in turn and broadcasts it while the next one may still travel.

Periodic strategies (local SGD, DiLoCo) all-reduce gradients inside the node
every step (the node's ranks stay identical: DDP within the node), so what
their outer sync sends is the same on every rank of a node.  It crosses the
nodes one of two ways (``cross_node``):

* ``shards`` (the default for them): every rank runs the strategy, over a
  :class:`~lorasync.comm.wire.ShardedWire`: local rank j of every node
  carries chunk j of each outer collective over its own cross-node group
  (G connections per node at once), and the node's ranks all-gather the
  chunks inside the node.  Every rank then takes the same outer step and
  keeps the same outer state (anchor, momentum, residual: G copies per
  node), so nothing is broadcast afterwards.  Why: the node's ranks already
  hold the same adapter, so the message exists on every rank, and G
  connections at once (G NICs where a node has them) use a long-delay link
  better than one (measured in docs/topology.md).
* ``leaders``: the leader alone runs the strategy, over the leaders' group,
  and on the steps where the outer sync lands it broadcasts the synced
  adapter inside the node.  Which steps those are follows from the options
  alone (period, streaming, delay), so the other ranks know without being
  told.

Per-step strategies cross by their leaders: the node-mean gradient exists
only after the reduce inside the node, and their state (PowerSGD's
matrices, a codec's blocks) follows the bucket's layout, not a 1/G cut.

Accounting: ``intra_bytes`` is what this rank handed to collectives of its
node's group (reduce, broadcast; with shards the gather), ``inter_bytes``
what it handed to the cross-node group (the strategy's own collectives;
with leaders zero on other ranks, with shards each rank's chunks);
``wire_bytes`` is their sum.  The intra-node reduce of a bucket before the
last one counts as ``comm_s`` (the hook waited on it and on the node's
slowest rank before backward went on).

Resume: a checkpoint holds the strategy's state on the leaders (with
``shards``: on every rank, the same; every rank writes its own file), so it
resumes on the same nodes x ranks layout, with the same ranks as leaders
(torchrun numbers ranks node by node); ``load_state_dict`` refuses another
layout, and a flat state.  It resumes with either ``cross_node``: the
strategy's state is the same in both (a world of N nodes), so a leaders'
checkpoint resumed in shards hands the leader's state to its node's ranks
(one gather inside the node), and one saved in shards resumes by the
leaders from the leader's own file.

Changing layout (:func:`move_periodic`, what ``auto`` does when it measured
with a flat DiLoCo and chose the hierarchical one): a periodic strategy
moves between the layouts without averaging across the slow link.  Flat to
hierarchical, every node averages its ranks' adapters (and DiLoCo's
residuals) over its own fast group; DiLoCo's anchor and outer momentum are
the same on every rank and go to the leader as they are.  The replicas of
the nodes still differ: the next outer sync averages their deltas, as it
would have without the move.  Hierarchical to flat, the leader broadcasts
the adapter, anchor, momentum and residual inside its node.  Either way the
mean over all ranks of the adapter, and of what DiLoCo still owes, is kept
(the leader's residual is its node's mean, see :meth:`residual_carry`).

Not hierarchical: ``none`` (nothing to sync), ``auto`` (it builds
hierarchical candidates itself), torch's own hooks (baselines, flat by
definition), and 1-bit Adam (onebit with ``momentum=true``, which needs the
optimizer step on every rank; ``momentum=false`` sends signed gradients and
is hierarchical like the others).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from lorasync import catalog
from lorasync.catalog import CROSS_NODE
from lorasync.comm.base import HookSync, completed, get_strategy
from lorasync.comm.topology import Topology
from lorasync.comm.wire import ShardedWire, Wire
from lorasync.errors import ConfigError

__all__ = ["Hierarchical", "NOT_HIERARCHICAL", "move_periodic"]

#: strategies that are never wrapped, whatever their options (catalog.flat_only)
NOT_HIERARCHICAL = frozenset(n for n in catalog.names() if catalog.flat_only(n) is not None
                             and n != "onebit")


class Hierarchical(HookSync):
    """``strategy`` across the nodes of ``topology``, exact inside each node.

    ``allreduce_algo`` (a Wire algorithm or a function of the payload bytes)
    applies to the strategy's all-reduces across nodes.  ``cross_node``: one
    of :data:`lorasync.catalog.CROSS_NODE` (``shards`` only for local and diloco).  Build it
    on every rank; only leaders build the strategy itself, or with shards
    every rank.
    """

    two_phase = False
    layout = "hierarchical"

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, strategy: str,
                 topology: Topology, *, allreduce_algo: str | Callable[[int], str] | None = None,
                 cross_node: str = "auto", _register_hook: bool = True, **options: Any):
        if strategy in NOT_HIERARCHICAL:
            raise ValueError(f"hierarchy: {strategy} runs flat only "
                             f"({catalog.flat_only(strategy)})")
        self.name = strategy
        self.spec = catalog.spec(strategy)
        self._cls = get_strategy(strategy)
        self.communicates = self._cls.communicates
        self._shards = _use_shards(cross_node, strategy, self.spec.per_step, topology)
        self.topo = topology.build_groups(shards=self._shards)
        self._algo = allreduce_algo
        self._raw_options = dict(options)
        super().__init__(ddp, None, _register_hook=_register_hook,
                         _wire=Wire(self.topo.local_group, self._count), **options)

    # -- set-up ---------------------------------------------------------------
    def setup(self) -> None:
        t = self.topo
        if not t.uniform:
            raise ValueError(f"hierarchy: nodes have different rank counts ({t.describe()}); "
                             "use the flat layout")
        why = catalog.flat_only(self.name, self.options)
        if why is not None:
            raise ValueError(f"{self.name}: runs flat only: {why}; pass onebit option "
                             "momentum=false (signed gradients) or the flat layout")
        self.world_size, self.rank = t.world_size, t.rank
        self._G, self._N = t.local_size, t.num_nodes
        self.leader = t.is_leader
        self._differ = False  # periodic: local steps since finish() (every rank agrees)
        self._outs: list[tuple[torch.Tensor, torch.futures.Future | None,
                               torch.futures.Future]] = []
        self.inner = None
        if self._shards:
            # the chunks' bytes are the strategy's own (inter), the gather the node's
            cross = Wire(t.shard_group, self._count_inner)
            self.inner = self._cls(self.ddp, process_group=t.shard_group, _register_hook=False,
                                   _wire=ShardedWire(cross, self.wire), **self._raw_options)
            probe = cross
        elif self.leader:
            self.inner = self._cls(self.ddp, process_group=t.leader_group, _register_hook=False,
                                   **self._raw_options)
            probe = self.inner.wire
        algo = self._algo
        if self.inner is not None and algo is not None:
            if algo == "auto":  # measured on the cross-node link, where it applies
                from lorasync.comm.probe import algo_chooser
                algo = algo_chooser(probe, self.inner.collective_device())
            self.inner.wire.set_algo(algo)

    def _count_inner(self, nbytes: int) -> None:
        if self.inner is not None:  # (the strategy counts nothing while it is built)
            self.inner._count(nbytes)

    # -- per step: the bucket hook -------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self._ready()
        lay = self.bucket_layout(bucket)
        self._would_send_fp32(lay.numel)
        last = bucket.is_last()
        if bucket.index() == 0 and self._outs:
            self._abandon("backward pass was abandoned")
        if last and self.communicates:
            with self._lock:
                self._syncs += 1
        buf = bucket.buffer()
        if self._G > 1:
            t0 = time.perf_counter()
            buf.mul_(1.0 / self._G)
            self.wire.all_reduce(buf)          # the node's exact mean, on the fast link
            if not last:
                self._add_comm(time.perf_counter() - t0)
        if not self.per_step:
            return completed(buf)              # periodic: local (node-mean) gradients
        fut = self.inner.on_bucket(bucket) if self.leader else None
        if self._G == 1:
            return fut
        out: torch.futures.Future = torch.futures.Future()
        self._outs.append((buf, fut, out))
        if last:
            self._deliver()
        return out

    def _deliver(self) -> None:
        """Broadcast every bucket's result inside the node, in bucket order
        (the leader waits for each bucket's cross-node result first)."""
        pending, self._outs = self._outs, []
        for k, (buf, fut, out) in enumerate(pending):
            try:
                if self.leader:
                    v = fut.wait()
                    if isinstance(v, (list, tuple)):
                        v = v[0]
                    if v is not buf:
                        buf.copy_(v)
                work = self.wire.broadcast(buf, 0, async_op=True)
            except Exception as e:  # never leave DDP waiting on a future nobody completes
                for _, _, o in pending[k:]:
                    o.set_exception(e)
                raise
            work.get_future().then(functools.partial(_resolve, out, buf))

    def _abandon(self, why: str) -> None:
        for _, _, out in self._outs:
            out.set_exception(RuntimeError(why))
        self._outs = []

    # -- periodic: the outer sync on the leaders ---------------------------------
    def _applies(self, step: int) -> bool:
        """Whether an outer sync (of any fragment) lands in ``after_step`` of ``step``."""
        o = self.options
        launched = step - o.delay if o.streaming else step
        return launched >= 1 and bool(
            catalog.fragments_due(launched, o.period, getattr(o, "fragments", 1)))

    @property
    def replicas_may_differ(self) -> bool:
        """Between outer syncs the nodes' replicas differ (the ranks of one node
        do not); an outer sync of the whole adapter not streamed, or
        ``finish``, makes them identical again (as ``_Periodic`` says)."""
        return self._differ

    @property
    def in_flight(self) -> bool:
        """A streamed outer sync launched and not yet applied (every rank agrees)."""
        return not self.per_step and catalog.streamed_in_flight(self._steps, self.options)

    @property
    def in_flight_next_step(self) -> bool:
        return not self.per_step and catalog.streamed_in_flight(self._steps + 1, self.options)

    def after_step(self) -> None:
        super().after_step()
        before = None
        if self.inner is not None:
            before = self.inner.stats()["syncs"]
            self.inner.after_step()
        if self.per_step:
            return
        self._differ = True
        lands = self._applies(self._steps)
        if self.inner is not None and (self.inner.stats()["syncs"] > before) != lands:
            raise RuntimeError(f"hierarchy: {self.name}'s outer sync did not follow its "
                               f"schedule at step {self._steps}")
        if lands:
            with self._lock:
                self._syncs += 1
            if not self._shards:   # with shards every rank took the same outer step
                self._share_adapter()
            if not self.options.streaming and getattr(self.options, "fragments", 1) == 1:
                self._differ = False  # the whole adapter synced, no local step since

    def settle(self) -> None:
        if self.inner is not None:
            self.inner.settle()

    def _share_adapter(self) -> None:
        """The leader's adapter to every rank of its node."""
        if self._G == 1:
            return
        flat = self._flat_params()
        t0 = time.perf_counter()
        self.wire.broadcast(flat, 0)
        self._add_comm(time.perf_counter() - t0)
        if not self.leader:
            self._set_flat_params(flat)

    def finish(self) -> None:
        self._abandon("sync finished")
        super().finish()
        if self.inner is not None:
            self.inner.finish()
        if not self.per_step and not self._shards:
            self._share_adapter()
        self._differ = False

    # -- what auto needs ----------------------------------------------------------
    def residual_carry(self, residual: Callable[[Any], torch.Tensor | None]
                       ) -> torch.Tensor | None:
        """What this rank adds to its gradient so that the next sync delivers
        what this strategy still owes (``residual``: auto's reading of a flat
        strategy).  The leader's residual is in node-mean units: G times it
        on the leader and nothing on the others gives the node mean it owes.
        The same kind of answer (a tensor or None) on every rank."""
        if not self.spec.error_feedback:
            return None
        if not self.leader:
            return torch.zeros(self.numel, device="cpu")
        r = residual(self.inner)
        return torch.zeros(self.numel, device="cpu") if r is None else r * self._G

    # -- accounting and state ----------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            own = {"wire_bytes": self._wire_bytes, "fp32_bytes": self._fp32_bytes,
                   "comm_s": self._comm_s, "encode_s": self._encode_s, "syncs": self._syncs}
        inner = self.inner.stats() if self.inner is not None else {}
        inter = inner.get("wire_bytes", 0)
        return {
            "strategy": self.name,
            "wire_bytes": own["wire_bytes"] + inter,
            "intra_bytes": own["wire_bytes"], "inter_bytes": inter,
            "fp32_bytes": own["fp32_bytes"],
            "comm_s": own["comm_s"] + inner.get("comm_s", 0.0),
            "encode_s": own["encode_s"] + inner.get("encode_s", 0.0),
            "steps": self._steps, "syncs": own["syncs"],
            "layout": "hierarchical", "nodes": self._N, "ranks_per_node": self._G,
            "cross_node": self.cross_node,
        }

    @property
    def cross_node(self) -> str:
        """How this strategy crosses nodes: ``shards`` or ``leaders``."""
        return "shards" if self._shards else "leaders"

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "hierarchy": {"nodes": self._N, "ranks_per_node": self._G,
                              "leader": self.leader, "cross_node": self.cross_node},
                "inner": self.inner.state_dict() if self.inner is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        h = state.get("hierarchy")
        if h is None:
            raise ValueError(f"state_dict: saved by flat {self.name}; resume with the flat "
                             "layout (--hierarchy flat)")
        if (h["nodes"], h["ranks_per_node"]) != (self._N, self._G):
            raise ValueError(f"state_dict: saved on {h['nodes']} nodes x {h['ranks_per_node']} "
                             f"ranks, this run has {self._N} x {self._G}; the strategy's "
                             "state lives on the node leaders: resume on the same layout")
        if bool(h["leader"]) != self.leader:
            raise ValueError("state_dict: saved by a rank that was "
                             f"{'' if h['leader'] else 'not '}a node leader; ranks must keep "
                             "their nodes (torchrun numbers ranks node by node)")
        inner = state["inner"]
        if h.get("cross_node", "leaders") == "leaders" and self._shards:
            # saved by the leaders (or before shards existed): the leader's
            # state is every rank's now; the node's ranks call this together
            inner = self.wire.all_gather_object(inner if self.leader else None)[0]
        if self.inner is not None:   # saved in shards into leaders: the leader's own
            self.inner.load_state_dict(inner)


def _use_shards(cross_node: str, strategy: str, per_step: bool, topology: Topology) -> bool:
    """Whether ``strategy`` crosses nodes in shards (``cross_node``, module docstring)."""
    if cross_node not in CROSS_NODE:
        raise ConfigError("cross_node", cross_node, "use one of " + ", ".join(CROSS_NODE))
    if cross_node == "shards" and per_step:
        raise ConfigError("cross_node", "shards", f"{strategy} syncs gradients every step and "
                          "crosses nodes by their leaders; shards apply to local and diloco "
                          "(use --cross-node auto or leaders)")
    if cross_node == "auto":
        return not per_step and topology.ranks_per_node > 1 and topology.uniform
    return cross_node == "shards" and topology.uniform


def _resolve(out: torch.futures.Future, buf: torch.Tensor, f: torch.futures.Future) -> None:
    try:
        f.value()
        out.set_result(buf)
    except Exception as e:  # noqa: BLE001 - forwarded to DDP
        out.set_exception(e)


def move_periodic(old: HookSync, new: HookSync) -> None:
    """Hand periodic strategy ``old`` (local or diloco, just built ``new``
    of the same strategy in the other layout) over without averaging across
    the nodes (module docstring).  Every rank, at the same step; syncs still
    in flight are applied first.  Only the node's fast group carries bytes
    (counted as the hierarchical side's ``intra_bytes``)."""
    flat_to_node = isinstance(new, Hierarchical)
    if flat_to_node == isinstance(old, Hierarchical) or old.name != new.name \
            or old.per_step or old.name not in ("local", "diloco"):
        raise ValueError(f"move_periodic: {old.name} ({old.layout}) -> {new.name} "
                         f"({new.layout}): only local or diloco, into the other layout")
    h = new if flat_to_node else old
    dil = old.name == "diloco"
    if flat_to_node:
        old._drain()
        G = h._G
        flat = old._flat_params().div_(G)
        res = old._residual if dil else None
        if res is not None:
            flat = torch.cat([flat, res / G])
        t0 = time.perf_counter()
        h.wire.all_reduce(flat)
        h._add_comm(time.perf_counter() - t0)
        h._set_flat_params(flat[:h.numel])
        if h.inner is not None:   # the leader, or with shards every rank
            inner = h.inner
            if dil:
                inner._anchor = old._anchor.clone()
                inner._momentum = old._momentum.clone()
                if res is not None:
                    inner._residual = flat[h.numel:].clone()
            inner._dirty = True
        return
    if h.inner is not None:
        h.inner._drain()
    h._share_adapter()   # the node's ranks take the same steps: one adapter per node
    if dil:
        n = h.numel
        state = torch.zeros(3 * n + 1, device=new._anchor.device)
        if h.leader:
            inner = h.inner
            state[:n], state[n:2 * n] = inner._anchor, inner._momentum
            if inner._residual is not None:
                state[2 * n:3 * n], state[3 * n] = inner._residual, 1.0
        t0 = time.perf_counter()
        h.wire.broadcast(state, 0)
        h._add_comm(time.perf_counter() - t0)
        new._anchor, new._momentum = state[:n].clone(), state[n:2 * n].clone()
        if bool(state[3 * n] > 0):
            new._residual = state[2 * n:3 * n].clone()
    new._dirty = True
