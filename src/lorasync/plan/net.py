"""Networks: a ``Net`` and ``Link`` from a described link or from a probe.

* ``what_if_net``: a ``Net`` for a link described by its rate and RTT
  (goodput capped by the TCP window per RTT).
* ``Link``: what is known about the link beyond the alpha-beta fit (RTT,
  line rate, TCP window, RDMA): what the advice and ``tune`` are sized for.
* ``net_from_probe``: a ``Net`` and ``Link`` from ``lorasync probe --json``,
  every field it reads checked (``probe_field``, ``probe_number``), and
  held to what a link can be (``check_link``) when read from a file.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Mapping

from lorasync.errors import ConfigError
from lorasync.plan.costmodel import MiB, Net, lanes_of
from lorasync.plan.linkfit import fit_sweep
from lorasync.units import fmt_bytes, fmt_rate

__all__ = [
    "DEFAULT_TCP_WINDOW", "ALPHA_PER_RTT", "ALPHA_OVERHEAD_S", "LINK_EFFICIENCY", "RDMA_ALPHA_S",
    "BANDWIDTH_LIMITS_Bps", "MAX_LATENCY_S", "MAX_WORLD_SIZE",
    "Link", "what_if_net", "net_from_probe", "check_link", "probe_number", "probe_field",
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


def _pair_latencies(probe: Mapping, strict: bool) -> list[float]:
    """Every pair's one-way ``latency_s`` (the slowest pair's when there are no pairs)."""
    out = []
    for i, p in enumerate(probe_field(probe, "pairs", list, "a list of pair records") or []):
        if not isinstance(p, Mapping):
            raise ConfigError(f"probe.pairs[{i}]", p, "give a record {src, dst, latency_s, "
                              "bandwidth_Bps}, as `lorasync probe --json` writes")
        lat = probe_number(p, "latency_s", f"probe.pairs[{i}]", False, kind="latency",
                           strict=strict)
        if lat is not None:
            out.append(lat)
    slowest = probe_field(probe, "slowest_pair", Mapping, "a pair record {src, dst, latency_s}")
    if not out and slowest:
        lat = probe_number(slowest, "latency_s", "probe.slowest_pair", False, kind="latency",
                           strict=strict)
        out += [] if lat is None else [lat]
    return sorted(out)


def net_from_probe(probe: Mapping, *, world_size: int | None = None,
                   allreduce_algo: str = "ring", alltoall: bool = True,
                   strict: bool = False) -> tuple[Net, Link]:
    """``Net`` and ``Link`` from ``lorasync probe --json`` (docs/contracts.md).

    Uses the group model (alpha_s per message, bandwidth_Bps) the probe fitted
    on all-reduce; without it, fits the all-reduce sweep the same way
    (:func:`lorasync.plan.linkfit.fit_sweep`).  The RTT (for the
    bandwidth-delay product) is twice the pairs' median one-way latency.
    The probe's backend sets how many collectives run at once (``lanes``, 2
    on gloo: :func:`lorasync.plan.costmodel.lanes_of`).
    ``rdma: true`` at the top level (or on a rank) enables the RDMA advice.
    ``world_size`` overrides the probe's for a what-if on more nodes.

    Every field it reads is checked: a wrong type or a negative number is a
    ConfigError naming the field (``probe.model.alpha_s``).  ``strict`` (a
    probe read from a file) also refuses bandwidths and latencies no link has
    (:func:`check_link`); a live measurement is not held to them, so that a
    noisy fit never stops a run.
    """
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
    model = probe_field(probe, "model", Mapping, "an object {alpha_s, bandwidth_Bps}") or {}
    alpha = beta = None
    if model:
        alpha = probe_number(model, "alpha_s", "probe.model", kind="latency", strict=strict)
        bw = probe_number(model, "bandwidth_Bps", "probe.model", required=False,
                          kind="bandwidth", strict=strict)
        if bw:
            beta = 1.0 / bw
        else:
            beta = probe_number(model, "beta_s_per_byte", "probe.model")
            if beta and (strict or not math.isfinite(1.0 / beta)):
                check_link("probe.model.beta_s_per_byte", 1.0 / beta, "bandwidth")
    else:
        fit = fit_sweep(probe_field(probe, "sweep", list, "a list of sweep records") or [],
                        given or n)
        if fit:
            alpha, beta = fit.alpha_s, 1.0 / fit.bandwidth_Bps
            if strict or not math.isfinite(fit.bandwidth_Bps):
                check_link("probe.sweep (fitted alpha_s)", alpha, "latency")
                check_link("probe.sweep (fitted bandwidth)", fit.bandwidth_Bps, "bandwidth")
    if alpha is None or not beta:
        raise ConfigError("probe.model", model or None,
                          "the probe JSON has neither a fitted model (alpha_s, bandwidth_Bps) "
                          "nor two all_reduce sweep points; re-run `lorasync probe --json`")
    # RTT for the bandwidth-delay product: pairs' latency_s is half a ping-pong;
    # the model's latency_s is the per-message alpha, which is ~1 RTT on TCP
    rtt = None
    lats = _pair_latencies(probe, strict)
    if lats:
        rtt = 2 * lats[len(lats) // 2]
    elif alpha > ALPHA_OVERHEAD_S:
        rtt = (alpha - ALPHA_OVERHEAD_S) / ALPHA_PER_RTT
    ranks = probe_field(probe, "ranks", list, "a list of rank records") or []
    rdma = bool(probe_field(probe, "rdma", bool, "true or false")) \
        or any(isinstance(r, Mapping) and r.get("rdma") for r in ranks)
    net = Net(alpha_s=alpha, bandwidth_Bps=1.0 / beta, world_size=n,
              allreduce_algo=allreduce_algo, alltoall=alltoall, lanes=lanes_of(backend))
    link = Link(rtt_s=rtt, rdma=rdma, source="probe")
    return net, link
