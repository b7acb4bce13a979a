"""auto's strategies: how one is built, the one in use, and the moves between them.

A switch happens only at a boundary inside ``after_step``, between optimizer
steps, when no two-phase bucket is pending (a completed backward drains them
all); every rank switches at the same step.  Nothing the old strategy owes
is lost:

* a periodic strategy (local, diloco) is ``finish()``-ed first, so every
  rank continues from the same adapter; its inner optimizer moments are
  rank-local too, so when a per-step strategy follows, the optimizer auto was
  given has its per-parameter state averaged as well (without it replicas
  drift apart slowly);
* the same periodic strategy in the other layout is handed over, not
  finished (:func:`~lorasync.comm.hierarchy.move_periodic`): nothing crosses
  the slow link, the next outer sync averages the replicas;
* DiLoCo with another outer sync is reconfigured in place (anchor, momentum
  and residual carry over);
* error feedback is carried (:class:`Carry`): what the old strategy still
  owes (:func:`residual_owed`) is added to this rank's gradient of the next
  step before the new strategy sends it, so the averaged update of that step
  holds exactly the debt; a new periodic strategy averages no gradients, so
  the debt is all-reduced once (fp32, counted in ``wire_bytes``) instead.

Strategies are built without a DDP hook (``_register_hook=False``): DDP takes
one comm hook per model, so auto registers one and hands every bucket to the
strategy in use.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from lorasync import catalog
from lorasync.comm.base import Sync, get_strategy
from lorasync.comm.hierarchy import Hierarchical, move_periodic

__all__ = ["COUNTERS", "residual_owed", "variant_text", "Carry", "Switcher"]

#: the counters auto reports as the sum over every strategy it ran
COUNTERS = ("wire_bytes", "fp32_bytes", "comm_s", "encode_s", "syncs")
#: what a strategy left behind still counts for: its counters and its bytes per link
_RETIRED = COUNTERS + ("inter_bytes", "intra_bytes")


def residual_owed(child: Sync) -> torch.Tensor | None:
    """What an error-feedback strategy still owes, per rank, in gradient units
    over the canonical flat parameters: adding it to this rank's gradient
    before an averaging sync delivers ``mean(e) + s`` -- on every rank its
    worker residual ``e``, plus ``n * s`` for the server residual of the shard
    it owns (int8, onebit) -- exactly what the strategy still owed."""
    if isinstance(child, Hierarchical):  # the leader's, in node units
        return child.residual_carry(residual_owed)
    if not child.per_step:
        # DiLoCo's residual is delta it has not sent yet, in weight units; its
        # finish() averages the weights themselves, which hold all of it
        return None
    sd = child.state_dict()
    n = child.world_size
    if "worker_residual" in sd:          # int8, onebit
        return sd["worker_residual"].float() + n * sd["server_residual"].float()
    if "residual" in sd:                 # topk
        return sd["residual"].float().clone()
    if "error" in sd:                    # powersgd: per compressed matrix
        flat = torch.zeros(child.numel, device="cpu")  # state_dict() tensors are on the CPU
        for i, e in sd["error"].items():
            i = int(i)
            flat[child._offsets[i]:child._offsets[i + 1]] = e.reshape(-1)
        return flat
    return None


def variant_text(options: Mapping[str, Any]) -> str:
    """A DiLoCo outer sync in a few words: dtype[, top-k][, delay, fragments]."""
    o = catalog.parse_options("diloco", options)
    out = [o.delta_dtype + (f" top {o.delta_topk:g}" if o.delta_topk < 1 else "")]
    if o.streaming:
        out.append(f"{o.delay} step{'s' if o.delay > 1 else ''} late")
    if o.fragments > 1:
        out.append(f"{o.fragments} fragments")
    return ", ".join(out)


class Carry:
    """The residual a switch carried over (canonical flat order), added to
    this rank's gradient one parameter at a time in the next step's hooks.

    ``pindex``, ``numels``, ``offsets``: the canonical layout of the
    parameters (a parameter's index by ``id``, its size, its offset)."""

    def __init__(self, pindex: Mapping[int, int], numels: list[int], offsets: list[int]):
        self._pindex, self._numels, self._offsets = pindex, numels, offsets
        self.tensor: torch.Tensor | None = None
        #: parameters whose share has not been added yet
        self.left: set[int] = set()

    def set(self, tensor: torch.Tensor | None) -> None:
        """Carry ``tensor`` into the next step (nothing when it is all zero)."""
        self.clear()
        if tensor is not None and bool(tensor.abs().max() > 0):
            self.tensor = tensor
            self.left = set(range(len(self._numels)))

    def clear(self) -> None:
        self.tensor, self.left = None, set()

    def add_to(self, bucket: dist.GradBucket) -> None:
        """Add the carried share of ``bucket``'s parameters to its gradients."""
        if self.tensor is None:
            return
        buf = bucket.buffer()
        off = 0
        for p in bucket.parameters():
            i = self._pindex[id(p)]
            m = self._numels[i]
            if i in self.left:
                a = self._offsets[i]
                buf[off:off + m].add_(self.tensor[a:a + m].to(buf.device, buf.dtype))
                self.left.discard(i)
            off += m
        if not self.left:
            self.tensor = None

    def settle(self) -> None:
        """After a step: every share has been sent by now (one per step)."""
        if not self.left:
            self.tensor = None

    def saved(self) -> torch.Tensor | None:
        return None if self.tensor is None else self.tensor.clone()

    def load(self, tensor: torch.Tensor | None, left) -> None:
        self.tensor = None if tensor is None else tensor.clone()
        self.left = set(left or []) if tensor is not None else set()


class Switcher:
    """The strategy auto runs (``child``), how one is built, and every move
    to another (module docstring).

    ``host``: the auto strategy, whose wire (counted as auto's own bytes),
    parameters and process group the children share; ``add_comm`` charges
    what auto's own collectives waited to its ``comm_s``; ``log`` prints on
    rank 0.
    """

    def __init__(self, host: Sync, *, topology, allreduce_algo: str, cross_node: str,
                 layout: str, candidate_options: dict[str, dict], carry: Carry,
                 add_comm: Callable[[float], None], log: Callable[[str], None]):
        self.host = host
        self.topo = topology
        self.algo = allreduce_algo
        self.cross_node = cross_node
        #: the layout new strategies are built in (decided at the first choice)
        self.layout = layout
        #: every candidate's options, as the next switch to it would use them
        self.candidate_options = candidate_options
        self.carry = carry
        self._add_comm = add_comm
        self._log = log
        self._algo_fn = None
        self.child: Sync | None = None
        #: the options ``child`` was built (or reconfigured) with
        self.options: dict[str, Any] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        #: replicas may differ: a periodic strategy ran and its rank-local
        #: optimizer moments were not averaged when it was left
        self.may_differ = False
        #: the counters of the strategies left behind
        self.retired = dict.fromkeys(_RETIRED, 0)
        self.switches = 0
        self.last: dict | None = None

    # -- building ---------------------------------------------------------------
    def build(self, name: str, options: Mapping[str, Any] | None = None,
              layout: str | None = None) -> Sync:
        """``name`` with ``options`` (default: its candidate options) in
        ``layout`` (default: the one in use), without a DDP hook."""
        host = self.host
        opts = self.candidate_options.get(name, {}) if options is None else options
        layout = layout or self.layout
        if layout == "hierarchical":
            child = Hierarchical(host.ddp, name, self.topo, _register_hook=False,
                                 allreduce_algo=None if self.algo == "ring" else self.algo,
                                 cross_node=self.cross_node if not catalog.spec(name).per_step
                                 else "auto", **opts)
        else:
            child = get_strategy(name)(host.ddp, process_group=host.group,
                                       _register_hook=False, **opts)
            child.spans_nodes = host.spans_nodes
            if self.algo != "ring":
                child.wire.set_algo(self._chooser())
        self.give_optimizer(child)
        return child

    def start(self, child: Sync, options: Mapping[str, Any]) -> None:
        """Run ``child`` (built with ``options``) from now on, as the first."""
        self.child, self.options = child, dict(options)
        # every rank starts from the same adapter: nothing differs before a step
        # (an evaluation of the replicas' mean at step 0 would move the whole
        # adapter for nothing; the child says so itself once it has trained)
        self.may_differ = False

    def _chooser(self):
        """The flat children's all-reduce algorithm (``allreduce_algo``);
        for ``auto`` measured once on the whole group."""
        if self.algo != "auto":
            return self.algo
        if self._algo_fn is None:
            from lorasync.comm.probe import algo_chooser
            self._algo_fn = algo_chooser(self.host.wire, self.host.collective_device())
        return self._algo_fn

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.give_optimizer(self.child)

    def give_optimizer(self, child: Sync) -> None:
        """onebit takes the optimizer to run as 1-bit Adam (its warm-up counts
        the optimizer's steps, so after a switch it starts compressing at
        once); with an optimizer it cannot use it sends signed gradients."""
        if self.optimizer is None or not hasattr(child, "set_optimizer"):
            return
        try:
            child.set_optimizer(self.optimizer)
        except ValueError as e:
            self._log(f"auto: {child.name} sends signed gradients: {e}")

    # -- switching ----------------------------------------------------------------
    def switch(self, to: str, options: Mapping[str, Any], reason: str, step: int) -> int:
        """``to`` with ``options`` from now on, at the end of optimizer step
        ``step``.  Returns the syncs the strategy in use has counted so far
        (0 for a new one)."""
        old = self.child
        frm = old.name
        if to == frm and hasattr(old, "reconfigure") and old.layout == self.layout:
            # DiLoCo with another outer sync: in place, without averaging the
            # replicas.  Not into another layout: a flat DiLoCo reconfigured
            # stays flat
            old.reconfigure(**options)
            self.options = dict(options)
            self._record(frm, to, reason, step,
                         f"{frm} outer sync -> {variant_text(options)}: {reason}")
            return old.stats()["syncs"]
        if to == frm and not old.per_step and old.layout != self.layout:
            self._move_layout(old, options, reason, step)
        else:
            self._replace(old, to, options, reason, step)
        return 0

    def _replace(self, old: Sync, to: str, options: Mapping[str, Any], reason: str,
                 step: int) -> None:
        old.finish()   # periodic: average the replicas; two-phase: nothing pending
        owed = residual_owed(old)
        self._retire(old)
        self.child = new = self.build(to, options)
        if not new.per_step:
            self.may_differ = True
        elif not old.per_step and self.optimizer is not None:
            # the adapter is averaged (finish above); the inner optimizer's
            # moments are rank-local under local SGD / DiLoCo: average them too,
            # or identical gradients would still give different updates
            self.average_optimizer_state()
            self.may_differ = False
        self.options = dict(options)
        self.carry.clear()   # (always sent by now: one per step)
        if owed is not None and not new.per_step:
            # gradients are not averaged every step now: average the debt once
            # (on every rank alike: a node's other ranks may owe nothing, their
            # leader does)
            host = self.host
            owed = owed.to(host.collective_device()).div_(host.world_size)
            t0 = time.perf_counter()
            host.wire.all_reduce(owed)
            self._add_comm(time.perf_counter() - t0)
        self.carry.set(owed)
        self._record(old.name, to, reason, step, f"{old.name} -> {to}: {reason}")

    def _move_layout(self, old: Sync, options: Mapping[str, Any], reason: str,
                     step: int) -> None:
        """The periodic strategy in use into the other layout, its replicas
        averaged only inside each node (:func:`move_periodic`): finishing it
        instead would average the adapter in fp32 across the slow link, the
        link the hierarchical layout was chosen to spare."""
        new = self.build(old.name, options)
        move_periodic(old, new)
        if self.optimizer is not None and isinstance(new, Hierarchical):
            # a node's ranks take the same (node-mean) gradients from now on:
            # their inner optimizer moments must agree as well
            self.average_optimizer_state(new.wire, new.topo.local_size)
        self._retire(old)
        self.child = new
        self.may_differ = True
        self.options = dict(options)
        self.carry.clear()
        self._record(old.name, new.name, reason, step,
                     f"{old.name} {old.layout} -> {new.layout}, replicas averaged inside "
                     f"each node only: {reason}")

    def _retire(self, old: Sync) -> None:
        for k, v in old.stats().items():
            if k in self.retired:
                self.retired[k] += v

    def _record(self, frm: str, to: str, reason: str, step: int, text: str) -> None:
        self.switches += 1
        self.last = {"from": frm, "to": to, "reason": reason, "step": step}
        self._log(f"auto: step {step}: {text}")

    def average_optimizer_state(self, wire=None, size: int | None = None) -> None:
        """The optimizer's per-parameter moments averaged over ``wire``'s
        group of ``size`` ranks (default: every rank)."""
        host = self.host
        wire = wire or host.wire
        size = size or host.world_size
        tensors = []
        for p in host.params:
            st = self.optimizer.state.get(p, {})
            for key in sorted(st):
                v = st[key]
                if isinstance(v, torch.Tensor) and v.is_floating_point() \
                        and v.shape == p.shape:
                    tensors.append(v)
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors]).to(host.collective_device())
        flat.div_(size)
        t0 = time.perf_counter()
        wire.all_reduce(flat)
        self._add_comm(time.perf_counter() - t0)
        off = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
