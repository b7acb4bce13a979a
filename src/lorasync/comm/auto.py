"""``--comm auto``: measure the network, pick a sync strategy, re-plan while training.

:class:`Auto` is the strategy that measures and switches; what it decides
with (when to probe, how the cost model is corrected, what to pick) is the
pure policy in :mod:`lorasync.plan.policy`.

What ``Auto`` does, in order:

1. At attach: a quick probe of the group (``net.probe.run_probe(quick=True)``,
   a few seconds; ``probe=live`` uses the 1 KiB + 256 KiB all-reduce probe
   below instead, ``probe=none`` skips it), then ``measure_steps`` steps
   (default 4; the first is DDP's warm-up and not measured) under a start
   strategy to measure compute time: one that sends nothing during backward
   (diloco, else local, else the lossless candidate that sends the fewest
   bytes), or ``start``.  That compute is kept as the quiet reference: when
   backward runs slower than that under a per-step strategy (its collectives
   take CPU from it on a shared host), the difference is charged to every
   per-step strategy, and local/diloco are predicted with the quiet compute.  Compute is the time
   from the end of the previous ``after_step`` to the moment the last bucket
   became ready (``last_ready_time``), less what a two-phase hook blocked and
   the encode time spent in the hooks; everything else the step took is sync.
2. At the end of those steps, and then every ``interval`` steps (K, default
   10), at a boundary inside ``after_step`` (never in a future callback):
   every rank all-reduces what it measured over the window (median compute
   of the slowest rank, mean time beyond compute of the rank that waited
   least), so every rank holds the same numbers; a small timed probe runs
   when due (below); the planner's rule (:func:`lorasync.plan.planner.choose`:
   best predicted throughput, a lossless strategy within ``lossless_margin``
   of the best) picks the strategy.  The first choice, and a choice after
   the probe found another link, is taken as is; otherwise the strategy in
   use stays unless the pick is predicted ``switch_margin`` (5%) faster in
   two windows in a row (hysteresis: noisy windows on a busy host do not
   make it flap; with the second window as confirmation the margin can be
   as small as the lossless preference, so auto does not sit on a lossless
   strategy that turned out 5-10% slower than the best).  Rank 0's pick is broadcast (4 bytes) so the ranks cannot
   disagree.
3. A switch happens only there, between optimizer steps, when no two-phase
   bucket is pending (a completed backward drains them all):

   * a periodic strategy (local, diloco) is ``finish()``-ed first: its
     replicas are averaged, so every rank continues from the same adapter;
     their inner optimizer moments are rank-local too, so when a per-step
     strategy follows, the optimizer given to :meth:`Auto.set_optimizer` has
     its state averaged as well (without it replicas drift apart slowly and
     ``finish()`` averages the adapter at the end); the same periodic
     strategy in the other layout (the first choice at several ranks per
     node) is not finished but handed over
     (:func:`~lorasync.comm.hierarchy.move_periodic`): nothing crosses the
     slow link, the next outer sync averages the replicas;
   * error feedback is carried, not dropped: the old strategy's residual (on
     every rank its worker residual ``e_r``, plus ``n * s_r`` for the server
     residual of the shard it owns, int8/onebit) is added to that rank's
     gradient of the next step before the new strategy sends it, so the
     averaged update of that step contains ``mean(e) + s``, exactly what the
     old strategy still owed (or the new strategy's own residual keeps it).
     A new periodic strategy averages no gradients, so the residual is
     all-reduced once (fp32, counted in ``wire_bytes``) and the mean added on
     every rank;
   * the new strategy is built fresh (``_register_hook=False``: DDP takes one
     comm hook per model, so ``Auto`` registers one hook and hands every
     bucket to the current strategy's ``on_bucket``);
   * ``stats()`` then reports the new strategy's name in ``strategy``, and
     ``switches`` / ``last_switch`` ``{"from", "to", "reason", "step"}``,
     which the trainer copies into that step's metrics record; rank 0 logs a
     line to stderr.

Options (``--comm-opt KEY=VALUE``): ``candidates`` (comma list, default
allreduce,fp16,int8,topk,powersgd,local,diloco: the ones that kept eval
quality, see the catalog's AutoOptions), ``interval`` (K; 0 =
decide once), ``measure_steps``, ``start``, ``probe`` (quick | live | none),
``lossless_margin`` (0.05), ``switch_margin`` (0.05), ``batch_size``
(samples per rank per step, only for the samples/s in log lines),
``force_switch_at`` (``STEP:NAME[,STEP:NAME]``, for tests), ``log``; and any
candidate's own options as ``NAME.OPTION``, e.g. ``topk.ratio=0.001``
(``diloco.streaming`` defaults to true and ``diloco.delta_dtype`` to fp16 here).

Adaptive accumulation: :meth:`Auto.suggested_accum` (see there) gives the
trainer the number of micro-batches per optimizer step for the next step.

Several ranks per node (``hierarchy`` auto or node, and a topology with
several nodes of several ranks): auto measures both links -- the start
probe and every live probe time the whole group (its ring is as slow as the
link between nodes) and each node's own group (the fast link) -- and
describes the network to the cost model with both.  At its first choice it
predicts every candidate flat and hierarchical
(:class:`~lorasync.comm.hierarchy.Hierarchical`) and keeps the layout whose
best candidate is faster (``node``: hierarchical always); from then on it
chooses strategies within that layout.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from lorasync import catalog
from lorasync.catalog import PERIODIC, STRATEGIES
from lorasync.comm.base import Sync, comm_hook, get_strategy, register
from lorasync.comm.hierarchy import Hierarchical, move_periodic
from lorasync.comm.loopback import time_encode
from lorasync.errors import LorasyncError
from lorasync.plan.linkfit import allreduce_model, passive_bandwidth
from lorasync.plan.costmodel import Net, Workload, lanes_of, predict
from lorasync.plan.planner import tune_periodic
from lorasync.plan.policy import (
    DEFAULT_CHILD_OPTIONS, EXPOSED_PRIOR, MIN_PROBE_BYTES, SMALL_PROBE_BYTES, Window, decide,
    describe, drifted, hidden_of, inflation, link_changed, parse_candidates, parse_force,
    parse_variants, probe_cost, probe_every, probe_size, split_extra,
    suggest_accum,
    workload_for, corrections, prediction_text,
)
from lorasync.units import fmt_duration, fmt_rate

__all__ = ["Auto", "module_head_share"]


def module_head_share(module: torch.nn.Module) -> float:
    """:func:`lorasync.plan.costmodel.head_share` of a live model: the output
    embedding's weights against the frozen 2-D weights of every other linear
    layer (LoRA's own, trainable, left out; a tied input embedding is a
    lookup and is not counted).  0.0 for a model without an output embedding
    the ``get_output_embeddings`` way (transformers, PEFT)."""
    m = module
    while isinstance(getattr(m, "module", None), torch.nn.Module):  # DDP and the like
        m = m.module
    get = getattr(m, "get_output_embeddings", None)
    try:
        out = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        out = None
    w = getattr(out, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return 0.0
    body = sum(x.weight.numel() for x in m.modules()
               if isinstance(x, torch.nn.Linear) and x is not out and x.weight is not w
               and not x.weight.requires_grad)
    return w.numel() / (w.numel() + body) if body else 0.0


# --------------------------------------------------------------------------- the strategy

def _residual(child: Sync) -> torch.Tensor | None:
    """What an error-feedback strategy still owes, per rank, in gradient units
    over the canonical flat parameters: adding it to this rank's gradient
    before an averaging sync delivers mean(e) + s (see the module docstring)."""
    if isinstance(child, Hierarchical):  # the leader's, in node units
        return child.residual_carry(_residual)
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


_COUNTERS = ("wire_bytes", "fp32_bytes", "comm_s", "encode_s", "syncs")


def _variant_text(options: Mapping[str, Any]) -> str:
    """A DiLoCo outer sync in a few words: dtype[, top-k][, delay, fragments]."""
    o = catalog.parse_options("diloco", options)
    out = [o.delta_dtype + (f" top {o.delta_topk:g}" if o.delta_topk < 1 else "")]
    if o.streaming:
        out.append(f"{o.delay} step{'s' if o.delay > 1 else ''} late")
    if o.fragments > 1:
        out.append(f"{o.fragments} fragments")
    return ", ".join(out)


@register
class Auto(Sync):
    """Picks and switches sync strategies from live measurements (module docstring)."""

    name = "auto"

    def __init__(self, ddp, process_group=None, *, _register_hook: bool = True,
                 hierarchy: str = "flat", topology=None, allreduce_algo: str = "ring",
                 cross_node: str = "auto", **options: Any):
        if not _register_hook:
            raise ValueError("auto: cannot run inside another strategy")
        self._topo = topology
        self._algo = allreduce_algo
        self._cross_node = cross_node
        self.spans_nodes = topology.num_nodes > 1 if topology is not None else True
        multi = topology is not None and topology.multi_rank_nodes and topology.uniform
        if hierarchy == "node" and not multi and topology is None:
            raise ValueError("auto: hierarchy=node needs the default process group")
        #: layouts auto may use; the one in use (decided at the first choice)
        self._layouts = (("hierarchical",) if hierarchy == "node" else
                         ("flat", "hierarchical") if hierarchy == "auto" and multi else ("flat",))
        self._layout = self._layouts[0] if len(self._layouts) == 1 else "flat"
        plain, nested = {}, {}
        for key, value in options.items():
            name, dot, opt = key.partition(".")
            if dot:
                nested.setdefault(name, {})[opt] = value
            else:
                plain[key] = value
        self._nested = nested
        super().__init__(ddp, process_group=process_group, **plain)

    # -- set-up ---------------------------------------------------------------
    def validate(self) -> None:
        o = self.options
        self._candidates = parse_candidates(o.candidates)
        self._interval = o.interval
        self._measure = o.measure_steps
        self._lossless_margin = o.lossless_margin
        self._switch_margin = o.switch_margin
        self._force = parse_force(o.force_switch_at)
        self._variants = parse_variants(o.diloco_variants)
        if o.start and o.start not in STRATEGIES:
            raise ValueError(f"auto.start: {o.start!r} must be one of {', '.join(STRATEGIES)}")
        for name, opts in self._nested.items():
            if name not in STRATEGIES:
                raise ValueError(f"auto: option {name}.{next(iter(opts))}: {name!r} is not a "
                                 f"strategy auto can use ({', '.join(STRATEGIES)})")
            try:
                parsed = catalog.parse_options(name, opts)
            except LorasyncError as e:
                raise ValueError(f"auto: option {e}") from None
            # the checked values, plain Python types (a numpy float or an Enum given
            # here would otherwise reach state_dict() and not load with weights_only)
            self._nested[name] = {k: getattr(parsed, k) for k in opts}

    def install(self) -> None:
        self._child_opts: dict[str, dict] = {k: dict(v) for k, v in self._nested.items()}
        for k, v in DEFAULT_CHILD_OPTIONS.items():
            merged = {**v, **self._child_opts.get(k, {})}
            try:
                catalog.parse_options(k, merged)
            except LorasyncError:
                continue  # e.g. diloco.period=1: no room to stream; the user's options stand
            self._child_opts[k] = merged
        # DiLoCo's outer-sync variants: each on top of the defaults above, the
        # user's diloco.* options over both (they are never changed)
        self._diloco_fixed = frozenset(self._nested.get("diloco", {}))
        variants: list[dict] = []
        for v in self._variants:
            merged = {**DEFAULT_CHILD_OPTIONS.get("diloco", {}), **v,
                      **self._nested.get("diloco", {})}
            try:
                catalog.parse_options("diloco", merged)
            except LorasyncError:
                continue
            if merged not in variants:
                variants.append(merged)
        self._variant_opts = variants or [dict(self._child_opts.get("diloco", {}))]
        self._variant_ns: list[float | None] = [None] * len(self._variant_opts)
        self._transfers: list[tuple[str, float, float]] = []
        self._deferred = 0
        self._window_syncs = 0
        self._retired = dict.fromkeys(_COUNTERS + ("inter_bytes", "intra_bytes"), 0)
        self._auto_bytes = 0
        self._auto_intra = 0
        self._probes = 0
        self._switches = 0
        self._last_switch: dict | None = None
        self._carry: torch.Tensor | None = None
        self._optimizer = None
        #: replicas may differ: a periodic strategy ran and its rank-local
        #: optimizer moments were not averaged when it was left
        self._may_differ = False
        self._carry_left: set[int] = set()
        self._t_ready: float | None = None
        self._mark: dict | None = None
        self._samples: list[dict] = []
        self._generation = 0
        self._net: Net | None = None
        self._fit_for: str | None = None      # strategy the corrections were fitted on
        self._last_extra = 0.0
        self._pending_pick: str | None = None  # a routine switch waits for a second window
        self._base_s = 0.0
        self._exposed = EXPOSED_PRIOR
        self._fixed_s = 0.0
        self._quiet_s: float | None = None  # compute under a strategy idle in backward
        self._inflation_s = 0.0  # what collectives inside backward add to it
        self._next_probe = 0
        self._accum_basis: tuple[int, float, float] | None = None
        self._accum_advice: tuple[int, int] | None = None
        self._bucket_sizes: list[int] = []
        self._matrices = tuple((p.shape[0], p.numel() // p.shape[0])
                               for p in self.params if p.dim() >= 2) or None
        self._head_share = module_head_share(self.ddp)
        # every candidate once, without a hook: option values and backend
        # support are checked now, not at a switch in the middle of a run
        # (in every layout auto may use: 1-bit Adam, say, runs flat only)
        self._layout_candidates: dict[str, tuple[str, ...]] = {}
        for layout in self._layouts:
            usable = []
            for name in self._candidates:
                try:
                    self._build(name, layout=layout)
                except ValueError as e:
                    if name in self._nested and len(self._layouts) == 1:
                        raise ValueError(f"auto: {e}") from None
                    self._log(f"auto: leaving out {name}"
                              + (f" ({layout})" if len(self._layouts) > 1 else "") + f": {e}")
                    continue
                usable.append(name)
            self._layout_candidates[layout] = tuple(usable)
        self._layouts = tuple(lay for lay in self._layouts if self._layout_candidates[lay])
        if not self._layouts:
            raise ValueError("auto: none of the candidates can run here")
        if self._layout not in self._layouts:
            self._layout = self._layouts[0]
        self._candidates = tuple(c for c in self._candidates
                                 if any(c in self._layout_candidates[lay]
                                        for lay in self._layouts))
        self._intra: tuple[float, float] | None = None  # the node's link: alpha, bandwidth
        self._encode_ns = self._time_encodes() if self.options.encode_probe else {}
        if self.options.encode_probe and "diloco" in self._candidates \
                and len(self._variant_opts) > 1:
            self._variant_ns = self._time_variants()
        self.ddp.register_comm_hook(self, comm_hook)
        t0 = time.perf_counter()
        self._start_net = self._start_probe()
        probe_s = time.perf_counter() - t0
        # the start strategy, for measure_steps steps: one that sends nothing
        # during backward (DiLoCo, else local SGD), so the compute measured is
        # what every strategy shares; under a strategy whose collectives run
        # inside backward, they take CPU from it (two ranks on two cores:
        # compute 3-7% slower at 100 Mbit/s), which the model cannot tell
        # from compute.  Leaving it for a per-step strategy costs one fp32
        # average of the adapter and of the optimizer moments; on a slow link,
        # where that is dear, auto stays on DiLoCo anyway.  Without a periodic
        # candidate: the lossless one that sends the fewest bytes.
        start = self.options.start or next(
            (c for c in ("diloco", "local", "fp16", "bf16", "allreduce")
             if c in self._candidates),
            next((c for c in self._candidates if c not in PERIODIC), self._candidates[0]))
        measuring = self._measure > 0
        opts = self._child_opts.get(start, {})
        if start not in self._layout_candidates[self._layout] and (
                start in self._candidates or self._layout == "hierarchical"
                and catalog.flat_only(start, opts) is not None):
            # a candidate this layout cannot run (auto.start may name a
            # strategy outside the candidates: it runs as given where it can)
            start = self._layout_candidates[self._layout][0]
            opts = self._child_opts.get(start, {})
        self._child = self._build(start, opts)
        self._child_options = dict(opts)
        self._measuring = measuring
        self._may_differ = not self._child.per_step
        self._next_eval = self._measure if measuring else self._interval
        what = (f"probe {fmt_rate(self._start_net.bandwidth_Bps, 'both')}, alpha "
                f"{fmt_duration(self._start_net.alpha_s)} ({probe_s:.1f} s)"
                if self._start_net else f"no start probe (probe={self.options.probe})")
        if self._intra is not None:
            what += (f"; inside nodes ({self._topo.describe()}) "
                     f"{fmt_rate(self._intra[1], 'both')}, alpha {fmt_duration(self._intra[0])}"
                     f"; layouts {'/'.join(self._layouts)}")
        plan = (f"measuring compute with {start} for {self._measure} steps, then choosing among "
                f"{', '.join(self._candidates)}" if measuring else
                f"starting with {start}" + (f", re-planning every {self._interval} steps"
                                            if self._interval else ""))
        self._log(f"auto: {what}; {plan}")

    def _time_encodes(self) -> dict[str, float]:
        """Each candidate's encode+decode on this device, ns per element per
        sync (lorasync.comm.loopback: its hooks run alone, a few calls on
        copies of the adapter's shapes); the slowest rank's figure, so every
        rank plans with the same numbers."""
        t0 = time.perf_counter()
        cap = getattr(self.ddp, "bucket_bytes_cap", 25 << 20)
        ns = [time_encode(c, self.params, self.world_size, rank=self.rank,
                          options=self._child_opts.get(c, {}), bucket_cap_bytes=cap)
              for c in self._candidates]
        if self.world_size > 1:
            ns = self._allreduce_max(ns)
        out = dict(zip(self._candidates, ns))
        self._log(f"auto: encode+decode on {self.device.type} ({time.perf_counter() - t0:.1f} s): "
                  + ", ".join(f"{c} {v:.3g}" for c, v in out.items()) + " ns per element")
        return out

    def _time_variants(self) -> list[float | None]:
        """Each DiLoCo variant's encode+decode on this device, as _time_encodes."""
        cap = getattr(self.ddp, "bucket_bytes_cap", 25 << 20)
        ns = [time_encode("diloco", self.params, self.world_size, rank=self.rank, options=v,
                          bucket_cap_bytes=cap) for v in self._variant_opts]
        if self.world_size > 1:
            ns = self._allreduce_max(ns)
        self._log("auto: diloco outer syncs: " + ", ".join(
            f"{_variant_text(v)} {x:.3g}" for v, x in zip(self._variant_opts, ns))
            + " ns per element")
        return list(ns)

    def _start_probe(self) -> Net | None:
        if self.world_size < 2 or self.options.probe == "none":
            return None
        if self.options.probe == "live":
            return self._live_probe(MIN_PROBE_BYTES)[0]
        from lorasync.comm.probe import run_probe
        from lorasync.plan.planner import net_from_probe

        res = run_probe(self.group, quick=True)
        if not res.get("model"):
            return self._live_probe(MIN_PROBE_BYTES)[0]
        self._probe_intra()
        return self._with_topology(net_from_probe(res, world_size=self.world_size)[0])

    # -- topology -------------------------------------------------------------
    def _multi(self) -> bool:
        """Several nodes of several ranks each: two links to measure."""
        return self._topo is not None and self._topo.multi_rank_nodes and self._topo.uniform

    def _probe_intra(self) -> None:
        """Time each node's own group (all nodes at once); the slowest node's
        figures, on every rank (the whole group's probe is the link between
        nodes: its ring is as slow as its slowest edge)."""
        if not self._multi():
            return
        from lorasync.comm.probe import link_model
        from lorasync.comm.wire import Wire

        wire = Wire(self._topo.build_groups().local_group, self._count_intra)
        alpha, bw, _ = link_model(wire, MIN_PROBE_BYTES, self._comm_device())
        worst = self._allreduce_max([alpha, -bw])
        self._intra = (worst[0], -worst[1])

    def _with_topology(self, net: Net, layout: str | None = None) -> Net:
        """``net`` (the whole group's alpha and bandwidth) with the nodes'
        shape, the intra-node link and a layout; the collectives its backend
        runs at once."""
        net = dataclasses.replace(net, lanes=lanes_of(dist.get_backend(self.group)))
        if not self._multi():
            return net
        intra = self._intra or (0.0, 1e12)
        return dataclasses.replace(net, ranks_per_node=self._topo.local_size,
                                   intra_alpha_s=intra[0], intra_bandwidth_Bps=intra[1],
                                   layout=layout or self._layout)

    def _build(self, name: str, options: Mapping[str, Any] | None = None,
               layout: str | None = None) -> Sync:
        opts = self._child_opts.get(name, {}) if options is None else options
        layout = layout or self._layout
        if layout == "hierarchical":
            child = Hierarchical(self.ddp, name, self._topo, _register_hook=False,
                                 allreduce_algo=None if self._algo == "ring" else self._algo,
                                 cross_node=self._cross_node if not catalog.spec(name).per_step
                                 else "auto", **opts)
        else:
            child = get_strategy(name)(self.ddp, process_group=self.group,
                                       _register_hook=False, **opts)
            child.spans_nodes = self.spans_nodes
            if self._algo != "ring":
                child.wire.set_algo(self._chooser())
        self._give_optimizer(child)
        return child

    def _chooser(self):
        """The flat children's all-reduce algorithm (``allreduce_algo``);
        for ``auto`` measured once on the whole group."""
        if self._algo != "auto":
            return self._algo
        if getattr(self, "_algo_fn", None) is None:
            from lorasync.comm.probe import algo_chooser
            self._algo_fn = algo_chooser(self.wire, self._comm_device())
        return self._algo_fn

    def _give_optimizer(self, child: Sync) -> None:
        """onebit takes the optimizer to run as 1-bit Adam (its warm-up counts
        the optimizer's steps, so after a switch it starts compressing at
        once); with an optimizer it cannot use it sends signed gradients."""
        if self._optimizer is None or not hasattr(child, "set_optimizer"):
            return
        try:
            child.set_optimizer(self._optimizer)
        except ValueError as e:
            self._log(f"auto: {child.name} sends signed gradients: {e}")

    def _log(self, msg: str) -> None:
        if self.rank == 0 and self.options.log:
            print(msg, file=sys.stderr, flush=True)

    # -- the one DDP hook -------------------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self._ready()
        self._t_ready = self.last_ready_time
        if self._carry is not None:
            buf = bucket.buffer()
            off = 0
            for p in bucket.parameters():
                i = self._pindex[id(p)]
                m = self._numels[i]
                if i in self._carry_left:
                    a = self._offsets[i]
                    buf[off:off + m].add_(self._carry[a:a + m].to(buf.device, buf.dtype))
                    self._carry_left.discard(i)
                off += m
            if not self._carry_left:
                self._carry = None
        return self._child.on_bucket(bucket)

    # -- measurements -------------------------------------------------------------
    def _child_counters(self) -> dict[str, float]:
        st = self._child.stats()
        return {k: st[k] for k in _COUNTERS}

    def _comm_device(self) -> torch.device:
        """Where auto's own collectives run: the gradients' device (NCCL takes
        CUDA tensors only)."""
        dev = self.params[0].device
        if dev.type == "cpu" and self.wire.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return dev

    def _allreduce_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        self.wire.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def _count(self, nbytes: int) -> None:
        # auto's own collectives (its children count theirs): also auto_bytes
        with self._lock:
            self._wire_bytes += nbytes
            self._auto_bytes += nbytes

    def _count_intra(self, nbytes: int) -> None:
        # the intra-node probe: auto's own bytes, on the node's link
        with self._lock:
            self._wire_bytes += nbytes
            self._auto_bytes += nbytes
            self._auto_intra += nbytes

    def _live_probe(self, nbytes: int) -> tuple[Net, float]:
        """Three small all-reduces and one large, timed; min over ranks."""
        dev = self._comm_device()
        small = torch.zeros(SMALL_PROBE_BYTES // 4, device=dev)
        large = torch.zeros(nbytes // 4, device=dev)
        t_start = time.perf_counter()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            self.wire.all_reduce(small)
            self._sync_device(dev)
            ts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.wire.all_reduce(large)
        self._sync_device(dev)
        tl = time.perf_counter() - t0
        # min over ranks: the rank that entered last waited for nobody, its
        # time is the transfer's (a rank the host descheduled for a moment
        # makes the others' times long, not its own)
        neg_small, neg_large, spent = self._allreduce_max(
            [-min(ts), -tl, time.perf_counter() - t_start])
        t_small, t_large = -neg_small, -neg_large
        self._add_comm(time.perf_counter() - t_start)
        self._probes += 1
        m = allreduce_model([SMALL_PROBE_BYTES, nbytes], [t_small, t_large], self.world_size)
        t1 = time.perf_counter()
        self._probe_intra()
        self._add_comm(time.perf_counter() - t1)
        return self._with_topology(Net(alpha_s=m.alpha_s, bandwidth_Bps=m.bandwidth_Bps,
                                       world_size=self.world_size)), spent

    def _in_layout(self, net: Net, layout: str) -> Net:
        """``net`` as seen by a strategy in ``layout``."""
        if not self._multi() or net.ranks_per_node == 1 or net.layout == layout:
            return net
        return dataclasses.replace(net, layout=layout)

    @staticmethod
    def _sync_device(dev: torch.device) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _window(self) -> Window | None:
        """This window's samples, reduced over ranks (identical on every rank)."""
        mine = [s for s in self._samples if s["gen"] == self._generation]
        net = self._net or self._start_net
        # the link as the syncs of this window saw it (the fastest transfer,
        # then the fastest rank: the one that arrived last waited for nobody)
        link = passive_bandwidth(self._transfers, self.world_size,
                                 net.alpha_s if net is not None else 0.0)
        self._transfers = []
        if mine:
            comp = statistics.median(s["compute"] for s in mine)
            overs = [s["wall"] - s["compute"] for s in mine]
            recent = overs[-max(2, len(overs) // 3):]
            vals = [1.0, comp, -statistics.fmean(overs), -statistics.fmean(recent),
                    float(len(mine)), link]
        else:
            vals = [0.0, 0.0, -1e30, -1e30, 0.0, link]
        t0 = time.perf_counter()
        ok, comp, neg_over, neg_recent, steps, link = self._allreduce_max(vals)
        # waited on the network (and on the slowest rank): sync, not compute, in
        # the trainer's metrics (comm_s), as the probe's time already is
        self._add_comm(time.perf_counter() - t0)
        self._samples = []
        if not ok or comp <= 0:
            return None
        return Window(compute_s=comp, overhead_s=max(0.0, -neg_over), steps=int(steps),
                      recent_overhead_s=max(0.0, -neg_recent), link_Bps=link)

    # -- the step ---------------------------------------------------------------
    def after_step(self) -> None:
        super().after_step()
        child = self._child
        gen = self._generation
        at_entry = self._child_counters()
        # a periodic child in two halves: its due syncs are applied, auto
        # measures and decides on the idle link, then the due ones launch
        halves = hasattr(child, "after_step_launch")
        if halves:
            child.after_step_apply()
        else:
            child.after_step()
        timed = child.wire.take_transfers()
        if not self._multi():
            # several ranks per node: a flat child's collectives cross nodes and
            # stay inside them, a hierarchical one's wire is the node's: neither
            # times the link between nodes alone, which the probes measure
            self._transfers.extend((t.kind, t.payload_bytes, t.seconds) for t in timed)
        del self._transfers[:-256]   # a window's worth (interval=0 never collects them)
        t_mid = time.perf_counter()
        sizes = getattr(child, "bucket_sizes", None)
        if sizes:
            self._bucket_sizes = sizes
        m = self._mark
        # the first step after attach, resume or a switch is a warm-up (DDP's
        # first iteration, new index caches): not measured
        if m is not None and not m["first"] and self._t_ready is not None \
                and self._t_ready > m["t"]:
            blocked = at_entry["comm_s"] - m["comm_s"]          # two-phase waits in backward
            raw = max(0.0, self._t_ready - m["t"] - blocked)
            enc = at_entry["encode_s"] - m["encode_s"]           # encode inside the hooks
            compute = max(0.5 * raw, raw - enc)
            self._samples.append({"gen": gen, "compute": compute, "wall": t_mid - m["t"]})
            del self._samples[:-256]
        self._t_ready = None
        if not self._carry_left:
            self._carry = None
        self._boundary()
        if halves and self._child is child:
            t0 = time.perf_counter()
            child.after_step_launch()
            if self._samples and self._samples[-1]["gen"] == gen and self._generation == gen:
                self._samples[-1]["wall"] += time.perf_counter() - t0   # its encode
        self._mark = {"t": time.perf_counter(), "first": self._generation != gen,
                      **self._child_counters()}

    def _boundary(self) -> None:
        s = self._steps
        forced = self._force.get(s)
        if forced is not None:
            self._switch(forced, self._child_opts.get(forced, {}),
                         f"forced by option force_switch_at at step {s}")
            return
        if not self._next_eval or s < self._next_eval:
            return
        if self.in_flight and self._deferred < self._max_defer():
            # a streamed sync launched in an earlier step is still on the link
            # (delay > 1): the window all-reduce and any probe would queue
            # behind it, block this step for the rest of the transfer (which
            # compute would otherwise hide) and time a busy link.  Decide one
            # step later (identical on every rank: the launch and apply steps
            # are), but not forever: fragments with a long delay may always
            # have one in flight
            self._deferred += 1
            self._next_eval = s + 1
            return
        self._deferred = 0
        initial = self._measuring
        self._next_eval = s + self._interval if self._interval else 0
        w = self._window()
        if w is None:   # nothing measured yet (e.g. measure_steps=1): next step
            self._next_eval = s + 1 if initial or not self._interval else self._next_eval
            return
        self._evaluate(w, initial)

    def _max_defer(self) -> int:
        return int(getattr(self._child.options, "period", 1))

    def _workload(self, compute_s: float, net: Net | None = None) -> Workload:
        """The workload with per-strategy corrections (``net`` given) or without."""
        names = sorted(set(self._candidates) | {self._child.name})
        kw = dict(bucket_sizes=self._bucket_sizes,
                  bucket_cap_bytes=getattr(self.ddp, "bucket_bytes_cap", 25 << 20),
                  matrices=self._matrices,
                  options={c: self._child_opts.get(c, {}) for c in names},
                  batch_size=self.options.batch_size, head_share=self._head_share,
                  encode_base=self._encode_ns)
        plain = workload_for(self.numel, compute_s, **kw)
        if net is None:
            return plain
        hidden = {n: hidden_of(predict(n, net, plain)) for n in names}
        extra = corrections(names, hidden, self._base_s, self._exposed)
        for n in names:
            if n not in PERIODIC:
                extra[n] += self._inflation_s
        return workload_for(self.numel, compute_s, **kw, extra_s=extra)

    def _evaluate(self, w: Window, initial: bool) -> None:
        s = self._steps
        cur = self._child.name
        if initial and not getattr(self._child, "communicates", True):
            # the start strategy sent nothing (start=local): what the step took
            # beyond compute (end of backward, optimizer step) is the same under
            # every strategy, so it is compute to the cost model, not sync
            self._fixed_s = w.overhead_s
        comp = w.compute_s + self._fixed_s
        over = max(0.0, w.overhead_s - self._fixed_s)
        step = comp + over
        k = self._interval or 10
        prev = self._net
        net = self._net or self._start_net
        probed = passive = False
        if self.world_size > 1:
            if w.link_Bps > 0 and net is not None:
                # the syncs of this window measured the link: no probe traffic
                net = dataclasses.replace(net, bandwidth_Bps=w.link_Bps)
                passive = True
                self._next_probe = max(self._next_probe, s + k)
            due = net is None or s >= self._next_probe
            if not due and not initial and not passive:
                # the whole window, or its last third (a change just before
                # the boundary): a needless probe costs little, a missed one K steps
                cnet = self._in_layout(net, self._child.layout)
                p = predict(cur, cnet, self._workload(comp, cnet))
                recent = max(0.0, w.recent_overhead_s - self._fixed_s)
                due = any(drifted(o, p.step_s - p.compute_s, p.step_s,
                                  calibrated=self._fit_for == cur) for o in (over, recent))
            if due and not passive and not (initial and self._start_net is not None) \
                    and not self.in_flight:
                # the syncs gave no figure (too small, none in the window): probe
                size = probe_size(net.bandwidth_Bps if net else 0.0)
                net, spent = self._live_probe(size)
                probed = True
                self._next_probe = s + probe_every(spent, step, k) * k
            elif initial:
                # the start probe is the figure until the next probe's share of
                # the training time (PROBE_BUDGET) is due, or the syncs drift
                self._next_probe = s + probe_every(probe_cost(net), step, k) * k
        else:
            net = Net(alpha_s=0.0, bandwidth_Bps=1e12, world_size=1)
        changed = (probed or passive) and prev is not None \
            and link_changed(prev, net, self.numel, step)
        if changed and probed:
            # one rank descheduled during the probe reads as a slow link: a
            # change must show in a second probe too (the faster one counts);
            # a passive figure is already the fastest of the window's syncs
            again, _ = self._live_probe(probe_size(net.bandwidth_Bps))
            if again.bandwidth_Bps > net.bandwidth_Bps:
                net = again
            changed = link_changed(prev, net, self.numel, step)
        self._net = net
        if not getattr(self._child, "communicates", True):
            self._quiet_s = comp   # nothing ran inside backward: every strategy's compute
        elif self._quiet_s is not None:
            # backward slower than with nothing in it: what running
            # collectives inside backward costs here (CPU taken from it), a
            # cost of every per-step strategy, not of local/diloco
            self._inflation_s = inflation(comp, self._quiet_s)
            comp -= self._inflation_s
        # fit the corrections on the strategy in use: what it cost beyond the
        # model -- unless it is a periodic one that has not synced in this
        # window (then it cost nothing yet, which says nothing about its sync)
        syncs = self._child.stats()["syncs"]
        if not (self._child.spec.periodic and syncs == self._window_syncs):
            p = predict(cur, self._in_layout(net, self._child.layout), self._workload(comp))
            x = over - (p.step_s - p.compute_s)
            if self._fit_for == cur and not probed:
                x = 0.5 * (self._last_extra + x)
            self._last_extra, self._fit_for = x, cur
            self._base_s, self._exposed = split_extra(x, hidden_of(p), step, self._base_s,
                                                      self._exposed)
        self._window_syncs = syncs
        fresh = initial or changed
        layout = self._layout
        if initial and len(self._layouts) > 1:
            # flat or hierarchical: the layout whose best candidate is faster
            best = None
            for lay in self._layouts:
                lnet = self._in_layout(net, lay)
                dd = decide(lnet, self._workload(comp, lnet), None, self._layout_candidates[lay],
                            lossless_margin=self._lossless_margin,
                            switch_margin=self._switch_margin, fresh=True)
                if best is None or dd.prediction.samples_per_s > best[1].prediction.samples_per_s:
                    best = (lay, dd)
            layout = best[0]
        net = self._in_layout(net, layout)
        self._net = net
        cands = self._layout_candidates[layout]
        self._tune_diloco(comp, net, fresh)
        wl = self._workload(comp, net)
        d = decide(net, wl, None if initial or layout != self._child.layout else cur, cands,
                   lossless_margin=self._lossless_margin, switch_margin=self._switch_margin,
                   fresh=fresh)
        pick = d.strategy if (d.switch or initial) else cur
        if d.switch and not fresh and self._pending_pick != pick:
            # a routine switch (same link) must win two windows in a row:
            # one noisy window on a busy host is not enough
            self._pending_pick, pick = pick, cur
            now = prediction_text(d.current) if d.current is not None else f"{cur}, not predicted"
            self._log(f"auto: step {s}: {d.strategy} looks better than {cur} "
                      f"({prediction_text(d.prediction)} vs {now}); "
                      f"switching if the next window agrees")
        else:
            self._pending_pick = None
        # rank 0's pick is everybody's (the inputs are identical; this makes sure)
        t = torch.tensor([cands.index(pick) if pick in cands else -1,
                          self._layouts.index(layout)],
                         dtype=torch.int32, device=self._comm_device())
        t0 = time.perf_counter()
        self.wire.broadcast(t, 0)
        self._add_comm(time.perf_counter() - t0)
        if self._layouts[int(t[1])] != layout:
            layout = self._layouts[int(t[1])]
            cands = self._layout_candidates[layout]
            net = self._net = self._in_layout(net, layout)
        idx = int(t[0])
        if idx >= 0 and cands[idx] != pick:
            pick = cands[idx]
        self._layout = layout
        reason = describe(d, net, comp, previous=prev if (probed or passive) else None,
                          initial=initial, samples="batch_size" in self._given)
        if passive:
            reason = "link measured from the syncs: " + reason
        if pick == "diloco":
            reason += f"; outer sync {_variant_text(self._child_opts.get('diloco', {}))}"
        if len(self._layouts) > 1 and initial:
            reason += f"; layout {layout} ({self._topo.describe()})"
        overhead = over
        opts = self._child_opts.get(pick, {})
        if pick != cur or opts != self._child_options or layout != self._child.layout:
            self._switch(pick, opts, reason)
            np_ = d.prediction if d.strategy == pick else predict(pick, net, wl)
            overhead = np_.step_s - np_.compute_s
        elif initial:
            self._measuring = False
            self._log(f"auto: step {s}: keep {cur}: {reason}")
        self._accum_basis = (s, comp, overhead)

    def _tune_diloco(self, comp: float, net: Net, fresh: bool) -> None:
        """DiLoCo's outer sync for this link: the variant, delay and fragment
        count the planner predicts fastest (hiding the sync where the link
        allows).  While DiLoCo runs, its options change only when the new ones
        are predicted ``switch_margin`` faster, or the link changed."""
        if "diloco" not in self._candidates or self.world_size < 2:
            return
        wl = self._workload(comp, net)
        cur = dict(self._child_opts.get("diloco", {}))
        # the corrections fitted for the variant in use apply to every variant
        raw = self._encode_ns.get("diloco")
        adj = wl.encode_ns.get("diloco", 0.0) - raw if raw is not None else 0.0
        ns = [None if x is None else max(0.0, x + adj) for x in self._variant_ns]
        opts, pred, i = tune_periodic(net, wl, "diloco", self._variant_opts,
                                      fixed=self._diloco_fixed,
                                      encode_ns=ns if any(x is not None for x in ns) else None)
        if opts == catalog.parse_options("diloco", cur).as_dict():
            return
        if self._child.name == "diloco" and not fresh:
            now = predict("diloco", net, wl)
            if pred.samples_per_s <= (1 + self._switch_margin) * now.samples_per_s:
                return   # the options in use are about as good: no change for noise
        self._child_opts["diloco"] = opts
        if self._variant_ns[i] is not None:
            self._encode_ns["diloco"] = self._variant_ns[i]

    # -- switching ----------------------------------------------------------------
    def _switch(self, to: str, options: Mapping[str, Any], reason: str) -> None:
        old = self._child
        frm = old.name
        if to == frm and hasattr(old, "reconfigure") and old.layout == self._layout:
            # DiLoCo with another outer sync: in place, without averaging the
            # replicas (anchor, momentum and residual carry over).  Not into
            # another layout: a flat DiLoCo reconfigured stays flat (the first
            # choice at 4 x 2 took hierarchical DiLoCo and ran it flat)
            old.reconfigure(**options)
            self._child_options = dict(options)
            self._window_syncs = old.stats()["syncs"]
            self._generation += 1
            self._measuring = False
            self._switches += 1
            self._pending_pick = None
            self._last_switch = {"from": frm, "to": to, "reason": reason, "step": self._steps}
            self._log(f"auto: step {self._steps}: {frm} outer sync -> "
                      f"{_variant_text(options)}: {reason}")
            return
        if to == frm and not old.per_step and old.layout != self._layout:
            self._move_layout(old, options, reason)
            return
        old.finish()   # periodic: average the replicas; two-phase: nothing pending
        carry = _residual(old)
        for k, v in old.stats().items():
            if k in _COUNTERS or k in ("inter_bytes", "intra_bytes"):
                self._retired[k] += v
        self._child = self._build(to, options)
        self._window_syncs = 0
        if not self._child.per_step:
            self._may_differ = True
        elif not old.per_step and self._optimizer is not None:
            # the adapter is averaged (finish above); the inner optimizer's
            # moments are rank-local under local SGD / DiLoCo: average them too,
            # or identical gradients would still give different updates
            self._average_optimizer_state()
            self._may_differ = False
        self._child_options = dict(options)
        self._generation += 1
        self._measuring = False
        self._carry, self._carry_left = None, set()   # (always sent by now: one per step)
        if carry is not None:
            if not self._child.per_step:
                # gradients are not averaged every step now: average the debt once
                # (on every rank alike: a node's other ranks may owe nothing, their
                # leader does)
                carry = carry.to(self._comm_device()).div_(self.world_size)
                t0 = time.perf_counter()
                self.wire.all_reduce(carry)
                self._add_comm(time.perf_counter() - t0)
            if bool(carry.abs().max() > 0):
                self._carry = carry
                self._carry_left = set(range(len(self.params)))
        self._switches += 1
        self._pending_pick = None
        self._last_switch = {"from": frm, "to": to, "reason": reason, "step": self._steps}
        self._log(f"auto: step {self._steps}: {frm} -> {to}: {reason}")

    def _move_layout(self, old: Sync, options: Mapping[str, Any], reason: str) -> None:
        """The periodic strategy in use into the other layout, its replicas
        averaged only inside each node (:func:`move_periodic`): measuring with
        a flat DiLoCo and then averaging its adapter in fp32 across the slow
        link to start the hierarchical one took 36.5 s of a 24-step run at
        4 x 2 ranks on 10 Mbit/s (docs/topology.md)."""
        new = self._build(old.name, options)
        move_periodic(old, new)
        if self._optimizer is not None and isinstance(new, Hierarchical):
            # a node's ranks take the same (node-mean) gradients from now on:
            # their inner optimizer moments must agree as well
            self._average_optimizer_state(new.wire, new.topo.local_size)
        for k, v in old.stats().items():
            if k in _COUNTERS or k in ("inter_bytes", "intra_bytes"):
                self._retired[k] += v
        self._child = new
        self._window_syncs = 0
        self._may_differ = True
        self._child_options = dict(options)
        self._generation += 1
        self._measuring = False
        self._carry, self._carry_left = None, set()
        self._switches += 1
        self._pending_pick = None
        self._last_switch = {"from": old.name, "to": new.name, "reason": reason,
                             "step": self._steps}
        self._log(f"auto: step {self._steps}: {old.name} {old.layout} -> {new.layout}, "
                  f"replicas averaged inside each node only: {reason}")

    # -- public API -----------------------------------------------------------------
    @property
    def strategy(self) -> str:
        """Name of the strategy in use."""
        return self._child.name

    @property
    def bucket_sizes(self) -> list[int]:
        return list(self._bucket_sizes)

    def suggested_accum(self, current: int, max_accum: int, min_accum: int = 1) -> int:
        """Micro-batches (grad_accum) for the next optimizer step.

        Call after every ``after_step()`` with the grad_accum of the step that
        just ended; use the result from the next step on.  The value changes
        only right after a K-step boundary, identically on every rank (it is
        computed from all-reduced measurements and the arguments), and stays
        in [min_accum, max_accum]: more micro-batches per sync while the
        step waits more than ~15% on sync, fewer when it waits under ~5%
        (see :func:`suggest_accum`).  Until the first decision it returns
        ``current``.  The measurements assume grad_accum changed only when
        this advised it (at most once per window).
        """
        basis = self._accum_basis
        if basis is None:
            return min(max(current, min_accum), max_accum)
        step, compute, overhead = basis
        if self._accum_advice is None or self._accum_advice[0] != step:
            self._accum_advice = (step, suggest_accum(current, compute, overhead,
                                                      max_accum=max_accum, min_accum=min_accum))
        return min(max(self._accum_advice[1], min_accum), max_accum)

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Optional, recommended: the optimizer that steps the adapter.

        Local SGD and DiLoCo train every rank with its own optimizer moments.
        When auto leaves them for a per-step strategy it averages the adapter
        (their ``finish()``) and, given the optimizer, its per-parameter state
        tensors (AdamW: exp_avg, exp_avg_sq; 8 bytes/element, counted in
        ``wire_bytes``), so that replicas stay bit-identical from then on.
        Without it they drift apart slowly (identical gradients, different
        moments) and ``finish()`` averages the adapter once more at the end.
        """
        self._optimizer = optimizer
        self._give_optimizer(self._child)

    def _average_optimizer_state(self, wire=None, size: int | None = None) -> None:
        """The optimizer's per-parameter moments averaged over ``wire``'s
        group of ``size`` ranks (default: every rank)."""
        wire = wire or self.wire
        size = size or self.world_size
        tensors = []
        for p in self.params:
            st = self._optimizer.state.get(p, {})
            for key in sorted(st):
                v = st[key]
                if isinstance(v, torch.Tensor) and v.is_floating_point() \
                        and v.shape == p.shape:
                    tensors.append(v)
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors]).to(self._comm_device())
        flat.div_(size)
        t0 = time.perf_counter()
        wire.all_reduce(flat)
        self._add_comm(time.perf_counter() - t0)
        off = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

    @property
    def replicas_may_differ(self) -> bool:
        return self._may_differ or self._child.replicas_may_differ

    @property
    def in_flight(self) -> bool:
        """Whether the strategy in use has a collective launched in one
        ``after_step`` and applied in a later one (streaming local/diloco)."""
        return self._child.in_flight

    @property
    def in_flight_next_step(self) -> bool:
        return self._child.in_flight_next_step

    def settle(self) -> None:
        self._child.settle()

    def finish(self) -> None:
        self._child.finish()
        self._carry, self._carry_left = None, set()
        if self._may_differ and self._child.per_step:
            avg = self._flat_params().to(self._comm_device()).div_(self.world_size)
            t0 = time.perf_counter()
            self.wire.all_reduce(avg)
            self._add_comm(time.perf_counter() - t0)
            self._set_flat_params(avg)
        self._may_differ = False

    def stats(self) -> dict[str, Any]:
        c = self._child.stats()
        with self._lock:
            own = {"wire_bytes": self._wire_bytes, "fp32_bytes": self._fp32_bytes,
                   "comm_s": self._comm_s, "encode_s": self._encode_s, "syncs": self._syncs}
            auto_bytes = self._auto_bytes
            auto_intra = self._auto_intra
        out: dict[str, Any] = {"strategy": c["strategy"]}
        for k in _COUNTERS:
            out[k] = self._retired[k] + own[k] + c[k]
        mine = "inter_bytes" if self.spans_nodes else "intra_bytes"
        out["inter_bytes"] = self._retired["inter_bytes"] + c.get("inter_bytes", 0)
        out["intra_bytes"] = self._retired["intra_bytes"] + c.get("intra_bytes", 0)
        out[mine] += own["wire_bytes"] - auto_intra
        out["intra_bytes"] += auto_intra
        out["layout"] = self._child.layout
        out.update(steps=self._steps, switches=self._switches,
                   last_switch=dict(self._last_switch) if self._last_switch else None,
                   auto_bytes=auto_bytes, probes=self._probes)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "child": self._child.name, "child_options": dict(self._child_options),
            "candidate_options": {k: dict(v) for k, v in self._child_opts.items()},
            "window_syncs": self._window_syncs,
            "layout": self._child.layout,
            "intra": list(self._intra) if self._intra else None,
            "child_state": self._child.state_dict(), "measuring": self._measuring,
            "next_eval": self._next_eval, "next_probe": self._next_probe,
            "net": None if self._net is None else [self._net.alpha_s, self._net.bandwidth_Bps],
            "fit_for": self._fit_for, "last_extra": self._last_extra,
            "pending_pick": self._pending_pick, "fixed_s": self._fixed_s, "base_s": self._base_s,
            "quiet_s": self._quiet_s, "inflation_s": self._inflation_s,
            "exposed": self._exposed, "switches": self._switches,
            "last_switch": dict(self._last_switch) if self._last_switch else None,
            "carry": None if self._carry is None else self._carry.clone(),
            "carry_left": sorted(self._carry_left), "may_differ": self._may_differ,
            "accum_basis": self._accum_basis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        name, opts = state["child"], dict(state.get("child_options") or {})
        if name not in STRATEGIES:
            raise ValueError(f"state_dict: auto saved strategy {name!r}, which it cannot run")
        layout = state.get("layout", "flat")
        if layout not in self._layouts:
            raise ValueError(f"state_dict: auto ran {name} {layout}, which this run's topology "
                             f"and hierarchy option do not allow ({'/'.join(self._layouts)})")
        self._layout = layout
        if state.get("intra"):
            self._intra = tuple(float(x) for x in state["intra"])
        if name != self._child.name or opts != self._child_options \
                or layout != self._child.layout:
            self._child = self._build(name, opts)
            self._child_options = opts
        self._child.load_state_dict(state["child_state"])
        for k, v in (state.get("candidate_options") or {}).items():
            if k in self._child_opts or k in STRATEGIES:
                self._child_opts[k] = dict(v)
        self._window_syncs = int(state.get("window_syncs", 0))
        self._generation += 1
        self._samples, self._mark = [], None
        self._measuring = bool(state.get("measuring", False))
        self._next_eval = int(state.get("next_eval", 0))
        self._next_probe = int(state.get("next_probe", 0))
        net = state.get("net")
        if net is not None:
            self._net = self._with_topology(Net(alpha_s=float(net[0]),
                                                bandwidth_Bps=float(net[1]),
                                                world_size=self.world_size), layout)
        self._fit_for = state.get("fit_for")
        self._last_extra = float(state.get("last_extra", 0.0))
        self._pending_pick = state.get("pending_pick")
        self._fixed_s = float(state.get("fixed_s", 0.0))
        quiet = state.get("quiet_s")
        self._quiet_s = None if quiet is None else float(quiet)
        self._inflation_s = float(state.get("inflation_s", 0.0))
        self._base_s = float(state.get("base_s", 0.0))
        self._exposed = float(state.get("exposed", EXPOSED_PRIOR))
        self._switches = int(state.get("switches", 0))
        self._last_switch = state.get("last_switch")
        carry = state.get("carry")
        self._carry = None if carry is None else carry.clone()
        self._carry_left = set(state.get("carry_left") or []) if carry is not None else set()
        self._may_differ = bool(state.get("may_differ", False))
        basis = state.get("accum_basis")
        self._accum_basis = tuple(basis) if basis else None
        self._accum_advice = None
