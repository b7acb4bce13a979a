""":class:`Auto`: the strategy ``--comm auto`` attaches.

It is one :class:`~lorasync.comm.base.Sync` to the trainer: it registers the
one DDP comm hook a model takes and hands every bucket to the strategy in use
(adding a carried residual first), and at the end of every ``after_step`` it
measures the step and, at a boundary, lets the controller decide.  The parts
it is made of:

* :mod:`.measure`: the links, each step's compute, each candidate's encode cost;
* :mod:`.decide`: the decisions and what they are made with (the policy itself
  is :mod:`lorasync.plan.policy`);
* :mod:`.switch`: the strategies it builds and the moves between them;
* :mod:`.state`: its checkpoint.

Several ranks per node (``hierarchy`` auto or node, and a topology with
several nodes of several ranks): auto measures both links, predicts every
candidate flat and hierarchical at its first choice, keeps the layout whose
best candidate is faster (``node``: hierarchical always) and chooses
strategies within it from then on.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from lorasync import catalog
from lorasync.catalog import STRATEGIES
from lorasync.comm.auto.decide import Controller, Settings
from lorasync.comm.auto.measure import Links, StepMeter, encode_costs, module_head_share
from lorasync.comm.auto.state import load_state, save_state
from lorasync.comm.auto.switch import COUNTERS, Carry, Switcher, variant_text
from lorasync.comm.base import Sync, comm_hook, register
from lorasync.errors import LorasyncError
from lorasync.plan import policy
from lorasync.units import fmt_duration, fmt_rate

__all__ = ["Auto"]


def _counters(child: Sync) -> dict[str, float]:
    st = child.stats()
    return {k: st[k] for k in COUNTERS}


@register
class Auto(Sync):
    """Picks and switches sync strategies from live measurements (module docstring).

    Options (``--comm-opt KEY=VALUE``) are the catalog's ``AutoOptions``, and
    any candidate's own as ``NAME.OPTION`` (e.g. ``topk.ratio=0.001``).
    """

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
        #: layouts auto may use (which one is decided at the first choice)
        self._layouts = (("hierarchical",) if hierarchy == "node" else
                         ("flat", "hierarchical") if hierarchy == "auto" and multi else ("flat",))
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
        self._candidates = policy.parse_candidates(o.candidates)
        self._force = policy.parse_force(o.force_switch_at)
        self._variants = policy.parse_variants(o.diloco_variants)
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
        self._auto_bytes = 0
        self._auto_intra = 0
        self._accum_advice: tuple[int, int] | None = None
        self._meter = StepMeter()
        self._switcher = Switcher(
            self, topology=self._topo, allreduce_algo=self._algo, cross_node=self._cross_node,
            layout=self._layouts[0] if len(self._layouts) == 1 else "flat",
            candidate_options=policy.child_options(self._nested),
            carry=Carry(self._pindex, self._numels, self._offsets),
            add_comm=self._add_comm, log=self._log)
        layout_candidates = self._usable_candidates()
        variants = (policy.variant_options(self._variants, self._nested)
                    or [dict(self._switcher.candidate_options.get("diloco", {}))])
        encode_ns, variant_ns = self._encode_costs(variants)
        self.ddp.register_comm_hook(self, comm_hook)
        self._links = Links(self.wire, self._topo, self.collective_device(),
                            self._count_intra, self._add_comm)
        t0 = time.perf_counter()
        self._links.start = self._links.start_probe(self.options.probe, self._switcher.layout)
        probe_s = time.perf_counter() - t0
        start = self._start(layout_candidates)
        self._ctl = Controller(
            self._settings(layout_candidates, variants), self._switcher, self._links,
            self._meter, encode_ns=encode_ns, variant_ns=variant_ns, wire=self.wire,
            device=self.collective_device(), switch=self._switch, add_comm=self._add_comm,
            log=self._log)
        measuring = self.options.measure_steps > 0
        self._ctl.measuring = measuring
        self._ctl.next_eval = self.options.measure_steps if measuring else self.options.interval
        self._log_start(start, probe_s)

    def _usable_candidates(self) -> dict[str, tuple[str, ...]]:
        """Every candidate built once in every layout auto may use, without a
        hook: option values and backend support are checked now, not at a
        switch in the middle of a run (1-bit Adam, say, runs flat only).
        Narrows the layouts and the candidates to what can run."""
        usable_in: dict[str, tuple[str, ...]] = {}
        for layout in self._layouts:
            usable = []
            for name in self._candidates:
                try:
                    self._switcher.build(name, layout=layout)
                except ValueError as e:
                    if name in self._nested and len(self._layouts) == 1:
                        raise ValueError(f"auto: {e}") from None
                    self._log(f"auto: leaving out {name}"
                              + (f" ({layout})" if len(self._layouts) > 1 else "") + f": {e}")
                    continue
                usable.append(name)
            usable_in[layout] = tuple(usable)
        self._layouts = tuple(lay for lay in self._layouts if usable_in[lay])
        if not self._layouts:
            raise ValueError("auto: none of the candidates can run here")
        if self._switcher.layout not in self._layouts:
            self._switcher.layout = self._layouts[0]
        self._candidates = tuple(c for c in self._candidates
                                 if any(c in usable_in[lay] for lay in self._layouts))
        return usable_in

    def _encode_costs(self, variants: list[dict]) -> tuple[dict[str, float], list]:
        """Each candidate's and each DiLoCo variant's encode+decode timed on
        this device (``encode_probe``), else none: the catalog's CPU figures."""
        variant_ns: list = [None] * len(variants)
        if not self.options.encode_probe:
            return {}, variant_ns
        opts = self._switcher.candidate_options
        t0 = time.perf_counter()
        ns = encode_costs(self, [(c, opts.get(c, {})) for c in self._candidates])
        encode_ns = dict(zip(self._candidates, ns))
        self._log(f"auto: encode+decode on {self.device.type} ({time.perf_counter() - t0:.1f} s): "
                  + ", ".join(f"{c} {v:.3g}" for c, v in encode_ns.items()) + " ns per element")
        if "diloco" in self._candidates and len(variants) > 1:
            variant_ns = encode_costs(self, [("diloco", v) for v in variants])
            self._log("auto: diloco outer syncs: " + ", ".join(
                f"{variant_text(v)} {x:.3g}" for v, x in zip(variants, variant_ns))
                + " ns per element")
        return encode_ns, variant_ns

    def _start(self, usable_in: dict[str, tuple[str, ...]]) -> str:
        """Build and run the start strategy (:func:`lorasync.plan.policy.start_strategy`)."""
        sw = self._switcher
        start = policy.start_strategy(
            self._candidates, usable_in[sw.layout], self.options.start,
            hierarchical=sw.layout == "hierarchical", options=sw.candidate_options)
        opts = sw.candidate_options.get(start, {})
        sw.start(sw.build(start, opts), opts)
        return start

    def _settings(self, usable_in: dict[str, tuple[str, ...]], variants: list[dict]) -> Settings:
        o = self.options
        return Settings(
            candidates=self._candidates, layouts=self._layouts, layout_candidates=usable_in,
            interval=o.interval, lossless_margin=o.lossless_margin,
            switch_margin=o.switch_margin, variant_options=variants,
            diloco_fixed=frozenset(self._nested.get("diloco", {})), numel=self.numel,
            world_size=self.world_size,
            bucket_cap_bytes=getattr(self.ddp, "bucket_bytes_cap", 25 << 20),
            matrices=tuple((p.shape[0], p.numel() // p.shape[0])
                           for p in self.params if p.dim() >= 2) or None,
            batch_size=o.batch_size, head_share=module_head_share(self.ddp),
            show_samples="batch_size" in self._given, topology=self._topo)

    def _log_start(self, start: str, probe_s: float) -> None:
        net, intra, ctl = self._links.start, self._links.intra, self._ctl
        what = (f"probe {fmt_rate(net.bandwidth_Bps, 'both')}, alpha "
                f"{fmt_duration(net.alpha_s)} ({probe_s:.1f} s)"
                if net else f"no start probe (probe={self.options.probe})")
        if intra is not None:
            what += (f"; inside nodes ({self._topo.describe()}) "
                     f"{fmt_rate(intra[1], 'both')}, alpha {fmt_duration(intra[0])}"
                     f"; layouts {'/'.join(self._layouts)}")
        interval = self.options.interval
        plan = (f"measuring compute with {start} for {self.options.measure_steps} steps, then "
                f"choosing among {', '.join(self._candidates)}" if ctl.measuring else
                f"starting with {start}" + (f", re-planning every {interval} steps"
                                            if interval else ""))
        self._log(f"auto: {what}; {plan}")

    def _log(self, msg: str) -> None:
        if self.rank == 0 and self.options.log:
            print(msg, file=sys.stderr, flush=True)

    # -- accounting --------------------------------------------------------------
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

    @property
    def _child(self) -> Sync:
        """The strategy in use."""
        return self._switcher.child

    # -- the one DDP hook -------------------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self._ready()
        self._meter.t_ready = self.last_ready_time
        self._switcher.carry.add_to(bucket)
        return self._child.on_bucket(bucket)

    # -- the step ---------------------------------------------------------------
    def after_step(self) -> None:
        super().after_step()
        meter, child = self._meter, self._child
        gen = meter.generation
        at_entry = _counters(child)
        # a periodic child in two halves: its due syncs are applied, auto
        # measures and decides on the idle link, then the due ones launch
        halves = hasattr(child, "after_step_launch")
        if halves:
            child.after_step_apply()
        else:
            child.after_step()
        # several ranks per node: a flat child's collectives cross nodes and
        # stay inside them, a hierarchical one's wire is the node's: neither
        # times the link between nodes alone, which the probes measure
        meter.collect(child.wire, keep=not self._links.multi)
        t_mid = time.perf_counter()
        sizes = getattr(child, "bucket_sizes", None)
        if sizes:
            meter.bucket_sizes = sizes
        meter.record(at_entry, t_mid)
        self._switcher.carry.settle()
        self._boundary()
        if halves and self._child is child:
            t0 = time.perf_counter()
            child.after_step_launch()
            if meter.generation == gen:
                meter.add_wall(time.perf_counter() - t0)   # its encode
        meter.start_step(time.perf_counter(), meter.generation != gen, _counters(self._child))

    def _boundary(self) -> None:
        s = self._steps
        forced = self._force.get(s)
        if forced is not None:
            self._switch(forced, self._switcher.candidate_options.get(forced, {}),
                         f"forced by option force_switch_at at step {s}")
            return
        self._ctl.boundary(s)

    def _switch(self, to: str, options, reason: str) -> None:
        """``to`` with ``options`` from now on (``Switcher.switch``): what is
        measured from now on is of the new strategy."""
        syncs = self._switcher.switch(to, options, reason, self._steps)
        self._meter.new_generation()
        self._ctl.after_switch(syncs)

    # -- public API -----------------------------------------------------------------
    @property
    def strategy(self) -> str:
        """Name of the strategy in use."""
        return self._child.name

    @property
    def grads_hold_momentum(self) -> bool:
        return self._child.grads_hold_momentum

    @property
    def bucket_sizes(self) -> list[int]:
        return list(self._meter.bucket_sizes)

    def suggested_accum(self, current: int, max_accum: int, min_accum: int = 1) -> int:
        """Micro-batches (grad_accum) for the next optimizer step.

        Call after every ``after_step()`` with the grad_accum of the step that
        just ended; use the result from the next step on.  The value changes
        only right after a K-step boundary, identically on every rank (it is
        computed from all-reduced measurements and the arguments), and stays
        in [min_accum, max_accum]: more micro-batches per sync while the
        step waits more than ~15% on sync, fewer when it waits under ~5%
        (see :func:`lorasync.plan.policy.suggest_accum`).  Until the first
        decision it returns ``current``.  The measurements assume grad_accum
        changed only when this advised it (at most once per window).
        """
        basis = self._ctl.accum_basis
        if basis is None:
            return min(max(current, min_accum), max_accum)
        step, compute, overhead = basis
        if self._accum_advice is None or self._accum_advice[0] != step:
            self._accum_advice = (step, policy.suggest_accum(
                current, compute, overhead, max_accum=max_accum, min_accum=min_accum))
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
        self._switcher.set_optimizer(optimizer)

    @property
    def replicas_may_differ(self) -> bool:
        return self._switcher.may_differ or self._child.replicas_may_differ

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
        sw = self._switcher
        sw.child.finish()
        sw.carry.clear()
        if sw.may_differ and sw.child.per_step:
            # a periodic strategy was left without its optimizer moments
            # averaged: the replicas drifted apart since; one fp32 average
            avg = self._flat_params().to(self.collective_device()).div_(self.world_size)
            t0 = time.perf_counter()
            self.wire.all_reduce(avg)
            self._add_comm(time.perf_counter() - t0)
            self._set_flat_params(avg)
        sw.may_differ = False

    def stats(self) -> dict[str, Any]:
        sw = self._switcher
        c = sw.child.stats()
        with self._lock:
            own = {"wire_bytes": self._wire_bytes, "fp32_bytes": self._fp32_bytes,
                   "comm_s": self._comm_s, "encode_s": self._encode_s, "syncs": self._syncs}
            auto_bytes = self._auto_bytes
            auto_intra = self._auto_intra
        out: dict[str, Any] = {"strategy": c["strategy"]}
        for k in COUNTERS:
            out[k] = sw.retired[k] + own[k] + c[k]
        mine = "inter_bytes" if self.spans_nodes else "intra_bytes"
        out["inter_bytes"] = sw.retired["inter_bytes"] + c.get("inter_bytes", 0)
        out["intra_bytes"] = sw.retired["intra_bytes"] + c.get("intra_bytes", 0)
        out[mine] += own["wire_bytes"] - auto_intra
        out["intra_bytes"] += auto_intra
        out["layout"] = sw.child.layout
        out.update(steps=self._steps, switches=sw.switches,
                   last_switch=dict(sw.last) if sw.last else None,
                   auto_bytes=auto_bytes, probes=self._links.probes)
        return out

    def state_dict(self) -> dict[str, Any]:
        return save_state(super().state_dict(), self._switcher, self._ctl, self._links)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        super().load_state_dict(saved)
        load_state(saved, self._switcher, self._ctl, self._links, self.world_size)
        self._meter.new_generation()
        self._meter.restart()
        self._accum_advice = None
