"""What auto measures: the links, each step's compute, each candidate's encode cost.

Every figure a decision uses is the same on every rank: what each rank
measured is all-reduced (:func:`allreduce_max`) before anything is decided
from it, so the ranks cannot take different branches.

* The links (:class:`Links`): at attach a quick probe of the group
  (``probe=quick``: :func:`lorasync.comm.probe.probe_group`; ``live``: the
  short timed all-reduces of :func:`lorasync.comm.probe.link_model`;
  ``none``), then the live probe whenever the policy calls for one.  With
  several ranks on each of several nodes both links are timed: the whole
  group (its ring is as slow as the link between nodes) and each node's own
  group (the fast link).
* Each step (:class:`StepMeter`): compute is the time from the end of the
  previous ``after_step`` to the moment the last bucket became ready, less
  what a two-phase hook blocked and the encode time spent in the hooks;
  everything else the step took is sync.  At a window's boundary the slowest
  rank's median compute, the mean time beyond compute of the rank that
  waited least, and the fastest bandwidth the window's syncs saw
  (:func:`lorasync.plan.linkfit.passive_bandwidth`) are reduced over ranks.
* Encode costs (:func:`encode_costs`): each candidate's hooks timed alone on
  the live device (:mod:`lorasync.comm.loopback`), in place of the
  catalog's CPU figures.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from lorasync.comm.base import Sync
from lorasync.comm.loopback import time_encode
from lorasync.comm.probe import link_model, probe_group
from lorasync.comm.wire import Wire
from lorasync.plan.costmodel import Net, lanes_of
from lorasync.plan.linkfit import MIN_PROBE_BYTES, passive_bandwidth
from lorasync.plan.policy import Window

__all__ = ["module_head_share", "allreduce_max", "encode_costs", "Links", "StepMeter"]


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


def allreduce_max(wire, values: list[float], device: torch.device) -> list[float]:
    """Element-wise max of ``values`` over the wire's ranks (counted)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    wire.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def encode_costs(sync: Sync, runs: Sequence[tuple[str, Mapping[str, Any]]]) -> list[float]:
    """Each ``(strategy, options)``'s encode+decode on this device, ns per
    element per sync (its hooks alone, a few calls on copies of the
    adapter's shapes); the slowest rank's figure, so every rank plans with
    the same numbers."""
    cap = getattr(sync.ddp, "bucket_bytes_cap", 25 << 20)
    ns = [time_encode(name, sync.params, sync.world_size, rank=sync.rank, options=opts,
                      bucket_cap_bytes=cap) for name, opts in runs]
    if sync.world_size > 1:
        ns = allreduce_max(sync.wire, ns, sync.collective_device())
    return list(ns)


class Links:
    """The links auto times and the :class:`~lorasync.plan.costmodel.Net`
    the cost model sees of them.

    ``wire``: auto's own (its bytes are auto's); ``count_intra`` counts the
    bytes of the intra-node probe; ``add_comm`` charges the probes' time to
    auto's ``comm_s`` (the step waited on the network for them).
    """

    def __init__(self, wire, topology, device: torch.device,
                 count_intra: Callable[[int], None], add_comm: Callable[[float], None]):
        self.wire = wire
        self.topo = topology
        self.device = device
        self._count_intra = count_intra
        self._add_comm = add_comm
        #: the start probe's figure (None: not probed)
        self.start: Net | None = None
        #: each node's own link, alpha and bandwidth (None: not timed)
        self.intra: tuple[float, float] | None = None
        #: live probes since attach
        self.probes = 0

    @property
    def multi(self) -> bool:
        """Several nodes of several ranks each: two links to measure."""
        return self.topo is not None and self.topo.multi_rank_nodes and self.topo.uniform

    def start_probe(self, mode: str, layout: str) -> Net | None:
        """The figure auto starts from (``probe`` option: quick, live or none);
        the quick probe falls back to the live one when it fits no model.
        Nothing is known of the link yet, so both size their messages by the
        latency they measure (a long, thin link needs messages of several
        bandwidth-delay products: :func:`lorasync.plan.linkfit.latency_bound`)."""
        if self.wire.size < 2 or mode == "none":
            return None
        if mode == "live":
            return self.live(MIN_PROBE_BYTES, layout, grow=True)[0]
        res = probe_group(self.wire.group, quick=True)
        if res.model is None:
            return self.live(MIN_PROBE_BYTES, layout, grow=True)[0]
        self.probe_intra()
        return self.with_topology(res.net(self.wire.size)[0], layout)

    def live(self, nbytes: int, layout: str, grow: bool = False) -> tuple[Net, float]:
        """The live probe: three small all-reduces and one of ``nbytes`` on the
        whole group (:func:`lorasync.comm.probe.link_model`, the fastest rank's
        times: the rank that entered last waited for nobody; ``grow``: larger
        while latency dominates it), then each node's own group.  Returns the
        Net and the seconds the probe of the whole group took (the slowest
        rank's)."""
        t_start = time.perf_counter()
        alpha, bandwidth, spent = link_model(self.wire, nbytes, self.device, grow=grow)
        self._add_comm(time.perf_counter() - t_start)
        self.probes += 1
        t1 = time.perf_counter()
        self.probe_intra()
        self._add_comm(time.perf_counter() - t1)
        net = Net(alpha_s=alpha, bandwidth_Bps=bandwidth, world_size=self.wire.size)
        return self.with_topology(net, layout), spent

    def probe_intra(self) -> None:
        """Time each node's own group (all nodes at once); the slowest node's
        figures, on every rank (the whole group's probe is the link between
        nodes: its ring is as slow as its slowest edge)."""
        if not self.multi:
            return
        wire = Wire(self.topo.build_groups().local_group, self._count_intra)
        alpha, bw, _ = link_model(wire, MIN_PROBE_BYTES, self.device)
        worst = allreduce_max(self.wire, [alpha, -bw], self.device)
        self.intra = (worst[0], -worst[1])

    def with_topology(self, net: Net, layout: str) -> Net:
        """``net`` (the whole group's alpha and bandwidth) with the nodes'
        shape, the intra-node link and ``layout``; the collectives its
        backend runs at once."""
        net = dataclasses.replace(net, lanes=lanes_of(dist.get_backend(self.wire.group)))
        if not self.multi:
            return net
        intra = self.intra or (0.0, 1e12)
        return dataclasses.replace(net, ranks_per_node=self.topo.local_size,
                                   intra_alpha_s=intra[0], intra_bandwidth_Bps=intra[1],
                                   layout=layout)

    def in_layout(self, net: Net, layout: str) -> Net:
        """``net`` as seen by a strategy in ``layout``."""
        if not self.multi or net.ranks_per_node == 1 or net.layout == layout:
            return net
        return dataclasses.replace(net, layout=layout)


class StepMeter:
    """Each step's compute and wall time under the strategy in use, until a
    window's boundary reduces them over ranks (module docstring)."""

    #: samples and transfers kept (a window's worth; interval=0 never reduces them)
    KEEP = 256

    def __init__(self):
        #: which strategy the samples are of: a switch or a resume starts anew
        self.generation = 0
        self.samples: list[dict] = []
        #: the end of the previous after_step, and the child's counters then
        self.mark: dict | None = None
        #: when the last bucket of this step became ready
        self.t_ready: float | None = None
        #: (kind, payload bytes, seconds) of the collectives that had the wire to themselves
        self.transfers: list[tuple[str, float, float]] = []
        #: elements per DDP bucket in ready order, as the strategy in use saw them
        self.bucket_sizes: list[int] = []

    def new_generation(self) -> None:
        """What is measured from now on is of another strategy (or a resume)."""
        self.generation += 1

    def restart(self) -> None:
        """Forget the samples and the last step's mark (a resume)."""
        self.samples, self.mark = [], None

    def collect(self, wire, keep: bool) -> None:
        """The transfers the child's wire timed this step (``keep=False``:
        they do not time the link the probes measure)."""
        timed = wire.take_transfers()
        if keep:
            self.transfers.extend((t.kind, t.payload_bytes, t.seconds) for t in timed)
        del self.transfers[:-self.KEEP]

    def record(self, at_entry: Mapping[str, float], t_end: float) -> None:
        """The step that ended at ``t_end`` (``at_entry``: the child's
        counters when ``after_step`` began).  The first step after attach,
        resume or a switch is a warm-up (DDP's first iteration, new index
        caches): not measured."""
        m = self.mark
        if m is not None and not m["first"] and self.t_ready is not None \
                and self.t_ready > m["t"]:
            blocked = at_entry["comm_s"] - m["comm_s"]          # two-phase waits in backward
            raw = max(0.0, self.t_ready - m["t"] - blocked)
            enc = at_entry["encode_s"] - m["encode_s"]           # encode inside the hooks
            compute = max(0.5 * raw, raw - enc)
            self.samples.append({"gen": self.generation, "compute": compute,
                                 "wall": t_end - m["t"]})
            del self.samples[:-self.KEEP]
        self.t_ready = None

    def add_wall(self, seconds: float) -> None:
        """Time the step took after the boundary (a periodic child's launch,
        its encode) on the step just recorded."""
        if self.samples and self.samples[-1]["gen"] == self.generation:
            self.samples[-1]["wall"] += seconds

    def start_step(self, t: float, first: bool, counters: Mapping[str, float]) -> None:
        """The next step starts at ``t`` (``first``: under a strategy just
        switched to)."""
        self.mark = {"t": t, "first": first, **counters}

    def window(self, wire, device: torch.device, alpha_s: float,
               add_comm: Callable[[float], None]) -> Window | None:
        """This window's samples, reduced over ranks (identical on every
        rank), or None when no rank measured a step."""
        mine = [s for s in self.samples if s["gen"] == self.generation]
        # the link as the syncs of this window saw it (the fastest transfer,
        # then the fastest rank: the one that arrived last waited for nobody)
        link = passive_bandwidth(self.transfers, wire.size, alpha_s)
        self.transfers = []
        if mine:
            comp = statistics.median(s["compute"] for s in mine)
            overs = [s["wall"] - s["compute"] for s in mine]
            recent = overs[-max(2, len(overs) // 3):]
            vals = [1.0, comp, -statistics.fmean(overs), -statistics.fmean(recent),
                    float(len(mine)), link]
        else:
            vals = [0.0, 0.0, -1e30, -1e30, 0.0, link]
        t0 = time.perf_counter()
        ok, comp, neg_over, neg_recent, steps, link = allreduce_max(wire, vals, device)
        # waited on the network (and on the slowest rank): sync, not compute, in
        # the trainer's metrics (comm_s), as the probe's time already is
        add_comm(time.perf_counter() - t0)
        self.samples = []
        if not ok or comp <= 0:
            return None
        return Window(compute_s=comp, overhead_s=max(0.0, -neg_over), steps=int(steps),
                      recent_overhead_s=max(0.0, -neg_recent), link_Bps=link)
