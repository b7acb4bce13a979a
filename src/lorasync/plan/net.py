"""Networks: a ``Net`` and ``Link`` from a described link or from a probe.

* ``what_if_net``: a ``Net`` for a link described by its rate and RTT
  (goodput capped by the TCP window per RTT).
* ``Link``: what is known about the link beyond the alpha-beta fit (RTT,
  line rate, TCP window, RDMA): what the advice and ``tune`` are sized for.
* ``ProbeResult``: one probe of a group, typed: built by the measurement
  (:mod:`lorasync.comm.probe`) or read from ``lorasync probe --json`` with
  ``ProbeResult.from_json``, every field it reads checked (``probe_field``,
  ``probe_number``) and held to what a link can be (``check_link``);
  ``ProbeResult.net`` is the ``Net`` and ``Link`` it describes,
  ``ProbeResult.to_json`` the probe JSON.  ``net_from_probe`` is both steps
  for a file.
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from lorasync.errors import ConfigError
from lorasync.plan.costmodel import MiB, Net, lanes_of
from lorasync.plan.linkfit import fit_sweep
from lorasync.units import fmt_bytes, fmt_rate

__all__ = [
    "DEFAULT_TCP_WINDOW", "ALPHA_PER_RTT", "ALPHA_OVERHEAD_S", "LINK_EFFICIENCY", "RDMA_ALPHA_S",
    "BANDWIDTH_LIMITS_Bps", "MAX_LATENCY_S", "MAX_WORLD_SIZE",
    "MODEL_FORMULA", "Link", "ProbeModel", "ProbeResult", "what_if_net", "net_from_probe",
    "check_link", "probe_number", "probe_field",
]

#: Linux's default tcp_rmem max is 6 MiB and about half of a receive buffer is
#: offered as window, so one connection keeps ~3 MiB in flight untuned.
DEFAULT_TCP_WINDOW = 3 * MiB
#: gloo over TCP pays about one round trip per step of a collective algorithm:
#: the first bench measurements on a link with delay fit alpha = 1.0 x RTT, not
#: the one-way 0.5 x RTT (docs/cost-model.md).
ALPHA_PER_RTT = 1.0
#: per-message software cost (gloo on CPU: enqueue, copy, wake-ups)
ALPHA_OVERHEAD_S = 50e-6
#: share of the line rate a collective achieves over TCP (gloo on a shaped
#: link, docs/cost-model.md)
LINK_EFFICIENCY = 0.93
#: per-message latency with RDMA verbs (NCCL over InfiniBand/RoCE)
RDMA_ALPHA_S = 5e-6


@dataclass(frozen=True)
class Link:
    """What is known about the link beyond the alpha-beta fit: what the
    planner's advice and ``tune``'s TCP settings are sized for."""

    #: round-trip time; None when unknown
    rtt_s: float | None = None
    #: nominal line rate in bytes/s; None when unknown (a probe measures goodput only)
    rate_Bps: float | None = None
    efficiency: float = LINK_EFFICIENCY
    tcp_window_bytes: float = DEFAULT_TCP_WINDOW
    rdma: bool = False
    #: where the figures come from: "what-if" (described by the user), "probe"
    #: (measured), or tune's words ("given", "probe FILE", "assumed: ...")
    source: str = "what-if"

    @property
    def rate_bps(self) -> float | None:
        """The line rate in bits/s, as links are named."""
        return None if self.rate_Bps is None else self.rate_Bps * 8

    @property
    def bdp_bytes(self) -> float | None:
        """Bandwidth-delay product: what TCP must have in flight to fill the link."""
        if self.rate_Bps is None or self.rtt_s is None:
            return None
        return self.rate_Bps * self.rtt_s

    def describe(self) -> str:
        """``1 Gbit/s, RTT 40 ms, BDP 4.77 MiB (given)``."""
        parts = [fmt_rate(self.rate_Bps) if self.rate_Bps is not None else "rate unknown",
                 f"RTT {self.rtt_s * 1e3:.3g} ms" if self.rtt_s is not None else "RTT unknown"]
        if self.bdp_bytes is not None:
            parts.append(f"BDP {fmt_bytes(self.bdp_bytes, binary=True)}")
        return ", ".join(parts) + f" ({self.source})"



def what_if_net(world_size: int, rate_Bps: float, rtt_s: float, *,
                efficiency: float = LINK_EFFICIENCY,
                tcp_window_bytes: float | None = DEFAULT_TCP_WINDOW,
                allreduce_algo: str = "ring", alltoall: bool = True, link_load: int = 1,
                lanes: int = 1) -> Net:
    """A ``Net`` for a described link: goodput capped by the TCP window per RTT.

    ``lanes``: collectives the backend runs at once (:func:`lanes_of`).

    ``link_load``: ring legs the busiest node link carries (2 and more when
    pairs behind NAT relay through an overlay's hub:
    :func:`lorasync.plan.costmodel.ring_link_load`); the ring runs at that
    link's share."""
    if not 0 < efficiency <= 1:
        raise ConfigError("link efficiency", efficiency, "use a fraction in (0, 1], e.g. 0.93")
    if not isinstance(link_load, int) or link_load < 1:
        raise ConfigError("link load", link_load, "use an integer >= 1")
    bw = rate_Bps * efficiency / link_load
    if tcp_window_bytes and rtt_s > 0:
        bw = min(bw, tcp_window_bytes / rtt_s)
    return Net(alpha_s=rtt_s * ALPHA_PER_RTT + ALPHA_OVERHEAD_S, bandwidth_Bps=bw,
               world_size=world_size, allreduce_algo=allreduce_algo, alltoall=alltoall,
               lanes=lanes)


#: the bandwidths a link can have: a probe value outside is a corrupt or
#: hand-edited file, not a measurement (1 kB/s barely moves a packet a second;
#: 10 TB/s is above any NIC, NVLink or memory bus)
BANDWIDTH_LIMITS_Bps = (1e3, 1e13)
#: a message that takes longer than a minute went over a dead link, not a slow one
MAX_LATENCY_S = 60.0
#: ranks a plan can model (a what-if beyond any cluster is a typo)
MAX_WORLD_SIZE = 1 << 20


def check_link(field: str, value: float, kind: str, given=None,
               fix: str = "this is no measurement: re-run `lorasync probe`") -> float:
    """``value``, a ``"bandwidth"`` (B/s) or ``"latency"`` (s) that a link can
    have, or a ConfigError naming ``field``, ``given`` (what the user wrote;
    default ``value``), the physical bounds and ``fix``."""
    if kind == "bandwidth":
        lo, hi = BANDWIDTH_LIMITS_Bps
        bounds = (f"a link moves between {lo:g} B/s ({fmt_rate(lo)}) and {hi:g} B/s "
                  f"({fmt_rate(hi)})")
    else:
        lo, hi = 0.0, MAX_LATENCY_S
        bounds = f"a latency lies between 0 and {hi:g} s"
    if not lo <= value <= hi:
        raise ConfigError(field, value if given is None else given, f"{bounds}; {fix}")
    return value


def probe_number(d: Mapping, key: str, where: str, required: bool = True, *,
                 kind: str | None = None, strict: bool = False) -> float | None:
    """``d[key]`` of a probe JSON: a finite number >= 0 (None when absent and
    not ``required``), held to :func:`check_link` when ``strict``; else a
    ConfigError naming ``where.key``."""
    v = d.get(key)
    if v is None and not required:
        return None
    if not _is_num(v) or v < 0:
        raise ConfigError(f"{where}.{key}", v, "the probe JSON needs a number >= 0 here; "
                          "re-run `lorasync probe --json`")
    if strict and kind:
        check_link(f"{where}.{key}", v, kind)
    return float(v)


def _is_num(v) -> bool:
    """A finite number: not NaN or inf, nor an int beyond float range (10**400)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and abs(v) <= sys.float_info.max)


def probe_field(probe: Mapping, key: str, kind: type, what: str, where: str = "probe"):
    """``probe[key]``: None or a ``kind``, else a ConfigError naming ``where.key``."""
    v = probe.get(key)
    if v is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
        raise ConfigError(f"{where}.{key}", v, f"give {what}, as `lorasync probe --json` writes; "
                          "or re-run it")
    return v


def _world(v, field: str, fix: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_WORLD_SIZE:
        raise ConfigError(field, v, f"{fix} (at most {MAX_WORLD_SIZE})")
    return v


#: the all-reduce model a probe fits, as its JSON states it
MODEL_FORMULA = "all_reduce(B) = 2(n-1)*alpha_s + 2(n-1)/n*B*beta_s_per_byte"


@dataclass(frozen=True)
class ProbeModel:
    """The group's alpha-beta model of all-reduce: the probe JSON's ``model``
    (:func:`lorasync.plan.linkfit.allreduce_model`)."""

    #: seconds per message (one step of the ring); the JSON's latency_s too
    alpha_s: float
    #: seconds per byte, 1 / bandwidth_Bps as the probe computed it
    beta_s_per_byte: float
    bandwidth_Bps: float
    #: the fit's intercept: seconds of latency per all-reduce, 2(n-1) x alpha_s
    allreduce_alpha_s: float | None = None
    r2: float | None = None
    #: where the bandwidth comes from: the fit, or what bounded it
    bandwidth_from: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                "bandwidth_Bps": self.bandwidth_Bps, "latency_s": self.alpha_s,
                "allreduce_alpha_s": self.allreduce_alpha_s, "r2": self.r2,
                "formula": MODEL_FORMULA, "bandwidth_from": self.bandwidth_from}


@dataclass(frozen=True)
class ProbeResult:
    """One probe of a process group (the probe JSON of docs/contracts.md).

    Built by the measurement itself (:func:`lorasync.comm.probe.probe_group`:
    what ``lorasync probe`` writes, what ``auto``'s start probe plans from)
    or read from a file with :meth:`from_json`, which checks every field the
    plan reads.  :meth:`net` is the link it describes, :meth:`to_json` the
    JSON ``lorasync probe`` writes.  The sweep's, the pairs' and the ranks'
    records are kept as measured (JSON objects): the plan reads the pairs'
    ``latency_s`` and the ranks' ``rdma``.
    """

    #: ranks probed
    world_size: int
    #: the process group's backend (gloo, nccl); None when not known
    backend: str | None = None
    #: None when fewer than two all-reduce sizes were timed
    model: ProbeModel | None = None
    sweep: tuple[Mapping, ...] = ()
    pairs: tuple[Mapping, ...] = ()
    #: the pair of the least bandwidth {src, dst, bandwidth_Bps, latency_s}
    slowest_pair: Mapping | None = None
    ranks: tuple = ()
    #: RDMA between the nodes (given in a file; a probe over sockets cannot tell)
    rdma: bool = False
    quick: bool = False
    #: unix time of the probe, from rank 0's clock
    time: float | None = None
    #: whether every pair was measured (quick pairs stop when their budget is spent)
    pairs_complete: bool | None = None
    warnings: tuple[str, ...] = ()
    elapsed_s: float | None = None

    @classmethod
    def from_json(cls, probe: Any, *, world_size: int | None = None,
                  strict: bool = True) -> ProbeResult:
        """A probe read from a file (``lorasync probe --json``), every field
        the plan reads checked: a wrong type or a negative number is a
        ConfigError naming the field (``probe.model.alpha_s``), the value and
        the fix.  ``strict`` also refuses bandwidths and latencies no link
        has (:func:`check_link`).  Without a ``model`` the all-reduce sweep
        is fitted the way the probe fits it.  ``world_size``: the ranks the
        caller plans for (``--nodes``), checked here too; a probe that does
        not say how many ranks it measured reads as that many.  What the
        plan does not read (timings, warnings) is not kept."""
        if not isinstance(probe, Mapping):
            raise ConfigError("probe", type(probe).__name__, "expected a JSON object from "
                              "`lorasync probe --json`")
        given = probe.get("world_size")
        if given is not None:
            _world(given, "probe.world_size", "the probe JSON needs an integer >= 1")
        n = world_size if world_size is not None else given
        n = _world(n, "--nodes" if world_size is not None else "probe.world_size",
                   "the probe JSON needs an integer >= 1, or give --nodes")
        backend = probe_field(probe, "backend", str, "a backend name such as gloo or nccl")
        model = _check_model(probe, given or n, strict)
        pairs, slowest = _check_pairs(probe, strict)
        ranks = probe_field(probe, "ranks", list, "a list of rank records") or []
        rdma = bool(probe_field(probe, "rdma", bool, "true or false"))
        return cls(world_size=given if given is not None else n, backend=backend, model=model,
                   pairs=tuple(pairs), slowest_pair=slowest, ranks=tuple(ranks), rdma=rdma)

    def to_json(self) -> dict[str, Any]:
        """The probe JSON (docs/contracts.md), as ``lorasync probe`` writes it."""
        out = {"world_size": self.world_size, "backend": self.backend, "quick": self.quick,
               "time": self.time, "ranks": copy.deepcopy(list(self.ranks)),
               "sweep": copy.deepcopy(list(self.sweep)),
               "pairs": copy.deepcopy(list(self.pairs)), "pairs_complete": self.pairs_complete,
               "model": self.model.to_json() if self.model is not None else None,
               "slowest_pair": copy.deepcopy(self.slowest_pair),
               "warnings": list(self.warnings)}
        if self.rdma:
            out["rdma"] = True
        out["elapsed_s"] = self.elapsed_s
        return out

    def latencies(self) -> list[float]:
        """Every pair's one-way ``latency_s``, sorted (the slowest pair's when
        no pair has one)."""
        out = sorted(float(p["latency_s"]) for p in self.pairs
                     if p.get("latency_s") is not None)
        if not out and self.slowest_pair and self.slowest_pair.get("latency_s") is not None:
            out = [float(self.slowest_pair["latency_s"])]
        return out

    def net(self, world_size: int | None = None, *, allreduce_algo: str = "ring",
            alltoall: bool = True) -> tuple[Net, Link]:
        """The ``Net`` and ``Link`` this probe describes.

        The group model's alpha (per message) and bandwidth; the RTT (for
        the bandwidth-delay product) is twice the pairs' median one-way
        latency; the backend sets how many collectives run at once
        (``lanes``, 2 on gloo: :func:`lorasync.plan.costmodel.lanes_of`);
        ``rdma`` at the top level or on a rank enables the RDMA advice.
        ``world_size`` replaces the probe's for a what-if on more nodes.
        """
        if self.model is None:
            raise ValueError("probe: no model of the link to plan from (fewer than two "
                             "all-reduce sizes were timed)")
        alpha = self.model.alpha_s
        # RTT for the bandwidth-delay product: pairs' latency_s is half a ping-pong;
        # the model's latency_s is the per-message alpha, which is ~1 RTT on TCP
        rtt = None
        lats = self.latencies()
        if lats:
            rtt = 2 * lats[len(lats) // 2]
        elif alpha > ALPHA_OVERHEAD_S:
            rtt = (alpha - ALPHA_OVERHEAD_S) / ALPHA_PER_RTT
        rdma = self.rdma or any(isinstance(r, Mapping) and r.get("rdma") for r in self.ranks)
        net = Net(alpha_s=alpha, bandwidth_Bps=1.0 / self.model.beta_s_per_byte,
                  world_size=world_size if world_size is not None else self.world_size,
                  allreduce_algo=allreduce_algo, alltoall=alltoall,
                  lanes=lanes_of(self.backend))
        return net, Link(rtt_s=rtt, rdma=rdma, source="probe")


def _check_pairs(probe: Mapping, strict: bool) -> tuple[list, Mapping | None]:
    """``(pairs, slowest_pair)`` of a probe JSON: every pair a record with a
    ``latency_s`` (when given) that is a latency, and the slowest pair's
    checked where it is the only latency there is."""
    pairs = probe_field(probe, "pairs", list, "a list of pair records") or []
    found = False
    for i, p in enumerate(pairs):
        if not isinstance(p, Mapping):
            raise ConfigError(f"probe.pairs[{i}]", p, "give a record {src, dst, latency_s, "
                              "bandwidth_Bps}, as `lorasync probe --json` writes")
        found |= probe_number(p, "latency_s", f"probe.pairs[{i}]", False, kind="latency",
                              strict=strict) is not None
    slowest = probe_field(probe, "slowest_pair", Mapping, "a pair record {src, dst, latency_s}")
    if not found and slowest:
        probe_number(slowest, "latency_s", "probe.slowest_pair", False, kind="latency",
                     strict=strict)
    return pairs, slowest


def _check_model(probe: Mapping, world_size: int, strict: bool) -> ProbeModel:
    """The probe JSON's ``model``, else the all-reduce model fitted on its
    sweep as ``world_size`` ranks (:func:`lorasync.plan.linkfit.fit_sweep`)."""
    model = probe_field(probe, "model", Mapping, "an object {alpha_s, bandwidth_Bps}") or {}
    if model:
        alpha = probe_number(model, "alpha_s", "probe.model", kind="latency", strict=strict)
        bw = probe_number(model, "bandwidth_Bps", "probe.model", required=False,
                          kind="bandwidth", strict=strict)
        if bw:
            return ProbeModel(alpha_s=alpha, beta_s_per_byte=1.0 / bw, bandwidth_Bps=bw)
        beta = probe_number(model, "beta_s_per_byte", "probe.model")
        if beta and (strict or not math.isfinite(1.0 / beta)):
            check_link("probe.model.beta_s_per_byte", 1.0 / beta, "bandwidth")
        if beta:
            return ProbeModel(alpha_s=alpha, beta_s_per_byte=beta, bandwidth_Bps=1.0 / beta)
    else:
        fit = fit_sweep(probe_field(probe, "sweep", list, "a list of sweep records") or [],
                        world_size)
        if fit:
            alpha, beta = fit.alpha_s, 1.0 / fit.bandwidth_Bps
            if strict or not math.isfinite(fit.bandwidth_Bps):
                check_link("probe.sweep (fitted alpha_s)", alpha, "latency")
                check_link("probe.sweep (fitted bandwidth)", fit.bandwidth_Bps, "bandwidth")
            if beta:
                return ProbeModel(alpha_s=alpha, beta_s_per_byte=beta,
                                  bandwidth_Bps=fit.bandwidth_Bps,
                                  allreduce_alpha_s=fit.allreduce_alpha_s, r2=fit.r2,
                                  bandwidth_from=fit.bandwidth_from)
    raise ConfigError("probe.model", model or None,
                      "the probe JSON has neither a fitted model (alpha_s, bandwidth_Bps) "
                      "nor two all_reduce sweep points; re-run `lorasync probe --json`")


def net_from_probe(probe: Mapping, *, world_size: int | None = None,
                   allreduce_algo: str = "ring", alltoall: bool = True,
                   strict: bool = False) -> tuple[Net, Link]:
    """``Net`` and ``Link`` from a probe JSON read from a file
    (:meth:`ProbeResult.from_json`, then :meth:`ProbeResult.net`):
    ``world_size`` overrides the probe's for a what-if on more nodes;
    ``strict`` refuses bandwidths and latencies no link has."""
    return ProbeResult.from_json(probe, world_size=world_size, strict=strict).net(
        world_size, allreduce_algo=allreduce_algo, alltoall=alltoall)
