"""Rank the sync strategies for one network and workload, pick one, and advise.

Pure: measurements in (a ``Net``, a ``Workload``, what is known about the
link), ranked predictions, a recommendation and ordered advice out.

* ``rank(net, workload)``: every strategy's ``Prediction``, fastest first.
* ``choose(Measurements) -> Recommendation``: the seam for ``auto``
  (:mod:`lorasync.plan.policy` decides with it, :mod:`lorasync.comm.auto`
  runs the decisions), every K steps with fresh link and compute
  measurements.  The rule: the best predicted throughput, but a
  lossless strategy when one is within ``lossless_margin`` (5%) of the best,
  and fp32 all-reduce when it is within ``exact_margin`` (1%) of that; with
  ``current`` set, keep the strategy in use unless the pick beats it by more
  than ``switch_margin`` (no flapping on noisy measurements).
* ``plan(net, workload, link)``: the above plus the steps an expert would
  take on this network, in order, each with its predicted gain: TCP tuning,
  hierarchical sync (several ranks per node), compression, overlap, periodic
  sync, RDMA, and on NCCL the NCCL_ALGO advice where the model predicts a
  gain.  With several ranks per node both layouts (flat, hierarchical) are
  ranked and the recommendation is the faster of the two.
* ``what_if_net`` / ``net_from_probe``: a ``Net`` from a link description or
  from ``lorasync probe --json``.
* ``hide_sync`` / ``tune_periodic``: the streaming delay and fragment count
  that hide a periodic strategy's outer sync behind compute, from its
  predicted sync time (the fewest steps late first, then the fewest
  fragments), and the best of several outer-sync variants (codecs) so tuned.
  ``auto`` and the plan's periodic-sync step both use them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from lorasync.errors import ConfigError
from lorasync import catalog
from lorasync.catalog import NONE, PERIODIC, STRATEGIES
from lorasync.plan.costmodel import (
    MiB, Net, Prediction, Workload, adapter_shapes, lanes_of, predict,
)
from lorasync.plan.linkfit import fit_sweep
from lorasync.units import fmt_bytes, fmt_duration, fmt_rate

__all__ = [
    "DEFAULT_TCP_WINDOW", "ALPHA_PER_RTT", "ALPHA_OVERHEAD_S", "LINK_EFFICIENCY", "RDMA_ALPHA_S",
    "Link", "Measurements", "Recommendation", "Step", "Plan",
    "what_if_net", "net_from_probe", "rank", "choose", "plan", "options_text", "layouts_of",
    "nccl_advice", "hide_sync", "tune_periodic", "margin_net", "FRAGMENT_CHOICES",
    "check_link", "probe_number", "probe_field", "BANDWIDTH_LIMITS_Bps", "MAX_LATENCY_S",
    "MAX_WORLD_SIZE",
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
#: DDP bucket sizes the overlap advice tries, in MiB
BUCKET_MIB_CHOICES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0)
#: sync periods the periodic-sync advice tries (smallest reaching TARGET_EFFICIENCY)
PERIOD_CHOICES = (2, 4, 8, 16, 32, 64, 128)
TARGET_EFFICIENCY = 0.95
#: a step worth taking gains at least this much throughput
MIN_GAIN = 0.01
#: fragment counts hide_sync tries (at most the period and the adapter's tensors)
FRAGMENT_CHOICES = (1, 2, 4, 8, 16, 32)
#: a periodic sync counts as hidden when it exposes at most this share of compute
HIDDEN_SHARE = 0.005
#: ... and still would on a link this many times slower than the one modelled:
#: a streamed transfer shares the link's queue and the CPUs with training and
#: runs slower than the idle probe measured (docs/slow-links.md, "Choosing
#: delay and fragments")
HIDE_MARGIN = 1.5
#: variants of a periodic strategy within this share of the fastest count as
#: equally fast; the one listed first (the least lossy) is taken
VARIANT_TIE = 0.01


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


@dataclass(frozen=True)
class Measurements:
    """Input of ``choose``: the network and workload as measured now."""

    net: Net
    workload: Workload
    #: strategy in use now (the online controller's), for hysteresis
    current: str | None = None
    candidates: tuple[str, ...] = STRATEGIES


@dataclass(frozen=True)
class Recommendation:
    strategy: str
    options: dict
    prediction: Prediction
    reason: str
    #: every candidate, fastest first
    ranking: tuple[Prediction, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "options": self.options, "reason": self.reason,
                "prediction": self.prediction.to_dict()}


@dataclass(frozen=True)
class Step:
    """One thing to do, with its predicted effect on top of the steps before it."""

    action: str  # tcp_tuning | compression | overlap | periodic_sync | rdma
    title: str
    detail: str
    worthwhile: bool
    strategy: str
    options: dict
    bucket_mb: float | None
    samples_per_s_before: float
    #: None when the gain cannot be predicted from what is known
    samples_per_s_after: float | None
    gain: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    net: Net
    link: Link
    workload: Workload
    ceiling: Prediction
    ranking: tuple[Prediction, ...]
    recommendation: Recommendation
    steps: tuple[Step, ...]
    notes: tuple[str, ...] = ()
    #: what the ranking and the recommendation assume of the steps (the worthwhile
    #: ones that change the network or the options), so they end where the steps end
    ranked_with: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        wl = asdict(self.workload)
        wl["encode_ns"], wl["options"] = dict(self.workload.encode_ns), {
            k: dict(v) for k, v in self.workload.options.items()}
        # the shapes are long (2 per target per layer) and follow from the model
        wl["matrices"] = None if self.workload.matrices is None else len(self.workload.matrices)
        return {
            "net": asdict(self.net), "link": asdict(self.link), "workload": wl,
            "ceiling": self.ceiling.to_dict(),
            "ranking": [p.to_dict() for p in self.ranking],
            "recommendation": self.recommendation.to_dict(),
            "steps": [s.to_dict() for s in self.steps],
            "notes": list(self.notes),
            "ranked_with": list(self.ranked_with),
        }


# --------------------------------------------------------------------------- networks

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


# --------------------------------------------------------------------------- ranking

def rank(net: Net, workload: Workload, candidates: Sequence[str] = STRATEGIES
         ) -> list[Prediction]:
    """Predictions for ``candidates``, fastest first (lossless first on ties)."""
    preds = [predict(name, net, workload) for name in candidates]
    order = {name: i for i, name in enumerate(STRATEGIES)}
    return sorted(preds, key=lambda p: (-round(p.samples_per_s, 9), not p.lossless,
                                        order.get(p.strategy, 99)))


def choose(m: Measurements, *, lossless_margin: float = 0.05, exact_margin: float = 0.01,
           switch_margin: float = 0.0) -> Recommendation:
    """The strategy to use now, with the reason (see the module docstring)."""
    if not m.candidates:
        raise ConfigError("strategies", "", "name at least one strategy")
    ranking = tuple(rank(m.net, m.workload, m.candidates))
    best = ranking[0]
    pick, reason = best, "best predicted throughput"
    lossless = [p for p in ranking if p.lossless]
    if lossless and not best.lossless \
            and lossless[0].samples_per_s >= (1 - lossless_margin) * best.samples_per_s:
        pick = lossless[0]
        reason = (f"lossless and within {lossless_margin:.0%} of the fastest "
                  f"({best.strategy}, {_pct(best.samples_per_s / pick.samples_per_s - 1)} "
                  "faster)")
    if pick.lossless and pick.strategy != "allreduce":
        exact = next((p for p in ranking if p.strategy == "allreduce"), None)
        if exact and exact.samples_per_s >= (1 - exact_margin) * pick.samples_per_s:
            pick = exact
            reason = f"exact fp32 all-reduce is within {exact_margin:.0%} of the fastest"
    if not pick.lossless:
        if pick.periodic:
            reason += "; syncs only every period steps, so check eval quality"
        else:
            reason += "; lossy (error feedback), so check eval quality"
        if lossless:
            reason += (f"; the best lossless ({lossless[0].strategy}) would be "
                       f"{_pct(1 - lossless[0].samples_per_s / pick.samples_per_s)} slower")
    if m.current and m.current != pick.strategy:
        cur = next((p for p in ranking if p.strategy == m.current), None)
        if cur is not None and (cur.lossless or not pick.lossless) \
                and pick.samples_per_s <= (1 + switch_margin) * cur.samples_per_s:
            pick = cur
            reason = (f"keep {cur.strategy}: the best alternative gains less than "
                      f"{switch_margin:.0%}")
    return Recommendation(strategy=pick.strategy, options=pick.options, prediction=pick,
                          reason=reason, ranking=ranking)


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


# --------------------------------------------------------------------------- advice

def _with(workload: Workload, strategy: str, **opts) -> Workload:
    merged = {k: dict(v) for k, v in workload.options.items()}
    merged.setdefault(strategy, {}).update(opts)
    if not merged[strategy].get("streaming", True):
        merged[strategy].pop("delay", None)   # a delay without streaming is refused
    return dataclasses.replace(workload, options=merged)


def _step(action, title, detail, before: Prediction | float, after: Prediction | None,
          strategy, options, bucket_mb) -> Step:
    b = before if isinstance(before, (int, float)) else before.samples_per_s
    a = after.samples_per_s if after is not None else None
    gain = (a / b - 1) if a is not None else None
    return Step(action=action, title=title, detail=detail,
                worthwhile=gain is None or gain >= MIN_GAIN, strategy=strategy,
                options=dict(options), bucket_mb=bucket_mb, samples_per_s_before=b,
                samples_per_s_after=a, gain=gain)


def _tcp_step(net: Net, link: Link, wl: Workload, cur: Prediction) -> tuple[Step | None, Net]:
    window = link.tcp_window_bytes
    if link.rtt_s is None or link.rtt_s <= 0:
        return None, net
    rtt = link.rtt_s
    title = "Raise TCP buffers so one window covers the bandwidth-delay product"
    sysctl = ("`lorasync tune` checks and applies it (net.core.rmem_max/wmem_max and the max of "
              "net.ipv4.tcp_rmem/tcp_wmem to about 2x BDP)")
    if link.rate_Bps:
        target = link.rate_Bps * link.efficiency
        bdp = link.rate_Bps * rtt
        if target * rtt > window and target > net.bandwidth_Bps:
            tuned = dataclasses.replace(net, bandwidth_Bps=target)
            after = predict(cur.strategy, tuned, wl)
            detail = (f"BDP {fmt_bytes(bdp)} ({fmt_rate(link.rate_Bps)} x "
                      f"{fmt_duration(rtt)}) exceeds the default window "
                      f"~{fmt_bytes(window)}: one connection is capped at "
                      f"{fmt_rate(net.bandwidth_Bps)}; {sysctl}")
            if after.samples_per_s < (1 + MIN_GAIN) * cur.samples_per_s:
                detail += "; but this sync is bound by latency or compute, not bandwidth"
            return _step("tcp_tuning", title, detail, cur, after, cur.strategy, cur.options,
                         None), tuned
        detail = (f"BDP {fmt_bytes(bdp)} fits the default window ~{fmt_bytes(window)}: "
                  "TCP tuning would not raise throughput")
        return _step("tcp_tuning", title, detail, cur, cur, cur.strategy, cur.options,
                     None), net
    # measured bandwidth only: a window-limited link runs at ~window / RTT
    bdp = net.bandwidth_Bps * rtt
    if bdp >= 0.8 * window:
        detail = (f"measured {fmt_rate(net.bandwidth_Bps)} x RTT {fmt_duration(rtt)} = "
                  f"{fmt_bytes(bdp)}, close to the default window ~{fmt_bytes(window)}: the "
                  f"link is probably window-limited; {sysctl}, then re-probe (gain unknown "
                  "without the line rate: give --rate)")
        return _step("tcp_tuning", title, detail, cur, None, cur.strategy, cur.options,
                     None), net
    detail = (f"BDP {fmt_bytes(bdp)} is well under the default window ~{fmt_bytes(window)}: "
              "TCP tuning would not raise throughput")
    return _step("tcp_tuning", title, detail, cur, cur, cur.strategy, cur.options, None), net


def _describe(p: Prediction) -> str:
    if p.layout == "hierarchical":
        # what matters is what crosses nodes: the leader's bytes against fp32
        ratio = p.fp32_bytes / p.inter_bytes if p.inter_bytes else float("inf")
        return (f"{fmt_bytes(p.inter_bytes)} per node per step across nodes instead of "
                f"{fmt_bytes(p.fp32_bytes)} ({ratio:.3g}x less)")
    ratio = p.fp32_bytes / p.wire_bytes if p.wire_bytes else float("inf")
    return (f"{fmt_bytes(p.wire_bytes)} per step instead of {fmt_bytes(p.fp32_bytes)} "
            f"({ratio:.3g}x less)")


def options_text(options: Mapping[str, Any], sep: str = ", ") -> str:
    """Options as k=v, leaving out the streaming knobs while streaming is off."""
    hide = {"streaming", "delay"} if not options.get("streaming") else set()
    return sep.join(f"{k}={v}" for k, v in options.items() if k not in hide)


def _opts_text(p: Prediction) -> str:
    return options_text(p.options)


def hide_sync(net: Net, workload: Workload, strategy: str = "diloco",
              fixed: frozenset[str] | set[str] = frozenset()) -> tuple[dict, Prediction]:
    """Streaming options that hide ``strategy``'s periodic sync, and their prediction.

    Starts from ``workload.options[strategy]``; ``delay`` (steps the outer
    update may arrive late, 1 .. period-1) and, for DiLoCo, ``fragments``
    (:data:`FRAGMENT_CHOICES`, at most the period and the adapter's tensor
    count) are chosen unless named in ``fixed``: the fewest steps late that
    hide the sync (exposed at most :data:`HIDDEN_SHARE` of compute), then the
    fewest fragments; hidden on a link :data:`HIDE_MARGIN` times slower than
    ``net``, since a streamed transfer runs slower beside training than the
    probe measured.  Where nothing hides it there, the first choice hidden on
    ``net`` itself; where nothing hides it even there (the link cannot carry
    a sync per period), the choice that exposes least.  The prediction
    returned is on ``net``.  ``streaming=false`` given in
    ``fixed`` is kept as it is, and so is a period too short to stream.
    """
    base = dict(workload.options.get(strategy, {}))
    opts = catalog.parse_options(strategy, base)
    if (("streaming" in fixed and not opts.streaming) or opts.period < 2
            or strategy not in PERIODIC):
        return opts.as_dict(), predict(strategy, net, workload)
    period = opts.period
    delays = [opts.delay] if "delay" in fixed else list(range(1, period))
    if "fragments" in fixed or not hasattr(opts, "fragments"):
        frags = [getattr(opts, "fragments", None)]
    else:
        tensors = len(adapter_shapes(workload))
        frags = [f for f in FRAGMENT_CHOICES if f <= min(period, tensors)]
    slower = margin_net(net)
    best: tuple[float, dict, Prediction] | None = None
    hidden: tuple[dict, Prediction] | None = None   # hidden on net, not with the margin
    for d in delays:
        if d >= period:
            continue
        for f in frags:
            o = {**base, "streaming": True, "delay": d}
            if f is not None:
                o["fragments"] = f
            wl = _with(workload, strategy, **o)
            p = predict(strategy, net, wl)
            m = predict(strategy, slower, wl)
            if m.exposed_comm_s <= HIDDEN_SHARE * m.compute_s:
                return catalog.parse_options(strategy, o).as_dict(), p
            if hidden is None and p.exposed_comm_s <= HIDDEN_SHARE * p.compute_s:
                hidden = (o, p)
            if best is None or p.step_s < best[0] - 1e-12:
                best = (p.step_s, o, p)
    # nothing hides with the margin (the slower link could not carry one sync
    # a period): hidden on the link as modelled, else what exposes least there
    if hidden is not None:
        return catalog.parse_options(strategy, hidden[0]).as_dict(), hidden[1]
    if best is None:   # a fixed delay that streaming cannot use
        return opts.as_dict(), predict(strategy, net, workload)
    return catalog.parse_options(strategy, best[1]).as_dict(), best[2]


def margin_net(net: Net, margin: float | None = None) -> Net:
    """``net`` with its (inter-node) link ``margin`` (default
    :data:`HIDE_MARGIN`) times slower: bandwidth divided, latency multiplied;
    what :func:`hide_sync` must still hide on."""
    margin = HIDE_MARGIN if margin is None else margin
    return dataclasses.replace(net, bandwidth_Bps=net.bandwidth_Bps / margin,
                               alpha_s=net.alpha_s * margin)


def tune_periodic(net: Net, workload: Workload, strategy: str,
                  variants: Sequence[Mapping[str, Any]],
                  fixed: frozenset[str] | set[str] = frozenset(),
                  encode_ns: Sequence[float | None] | None = None
                  ) -> tuple[dict, Prediction, int]:
    """The best of ``variants`` (complete option sets of ``strategy``, the
    least lossy first), each with :func:`hide_sync`'s streaming options:
    ``(options, prediction, index of the variant)``.  Variants are compared
    on the link :data:`HIDE_MARGIN` times slower (:func:`margin_net`), where
    hide_sync requires a sync to hide: one that hides only on the link as
    measured, with no room to spare, is not as fast as one that hides with
    the margin (docs/slow-links.md has the case that showed it).  A variant within
    :data:`VARIANT_TIE` of the fastest there loses only to one listed
    before it.  The prediction returned is on ``net``.  ``encode_ns``: per
    variant, its encode+decode (ns per element per sync) where measured,
    else the catalog's."""
    if not variants:
        raise ConfigError("variants", variants, f"give at least one {strategy} option set")
    tried = []
    slower = margin_net(net)
    for i, v in enumerate(variants):
        # the variant as given, not merged into the options in the workload
        # (a top-k ratio there must not leak into a dense variant)
        wl = dataclasses.replace(workload, options={**workload.options, strategy: dict(v)})
        ns = encode_ns[i] if encode_ns is not None else None
        if ns is not None:
            wl = dataclasses.replace(wl, encode_ns={**wl.encode_ns, strategy: float(ns)})
        elif strategy in wl.encode_ns:   # measured for another variant: not this one's
            wl = dataclasses.replace(wl, encode_ns={k: x for k, x in wl.encode_ns.items()
                                                    if k != strategy})
        opts, p = hide_sync(net, wl, strategy, fixed)
        m = predict(strategy, slower, _with(wl, strategy, **opts))
        tried.append((opts, p, i, m.samples_per_s))
    fastest = max(t[3] for t in tried)
    return next(t[:3] for t in tried if t[3] >= (1 - VARIANT_TIE) * fastest)


#: DiLoCo outer syncs the plan may recommend: auto's default variants (each
#: passed the quality rule at the default period; catalog.AutoOptions)
PLAN_VARIANTS = catalog.AutoOptions().diloco_variants


def _variant_list(text: str) -> list[dict[str, Any]]:
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        dtype, at, ratio = item.partition("@")
        out.append({"delta_dtype": dtype, **({"delta_topk": float(ratio)} if at else {})})
    return out


def _periodic_choice(p: Prediction, net: Net, wl: Workload, given: Mapping[str, Any],
                     cur: Prediction) -> tuple[Prediction, str]:
    """The periodic step's strategy options: the fewest local steps (period)
    that reach TARGET_EFFICIENCY with the sync streamed behind compute
    (:func:`hide_sync` picks the delay and fragments); for DiLoCo, where
    that needs a period longer than the default and the user fixed no codec,
    a DiLoCo outer-sync variant at the default period that reaches it."""
    name = p.strategy
    fixed = set(given)
    base = _with(wl, name, **{k: v for k, v in given.items()})
    default_period = catalog.parse_options(name).period
    chosen, why = None, "as given"
    if "period" in given:
        _, q = hide_sync(net, base, name, fixed)
        chosen = q
    else:
        for h in PERIOD_CHOICES:
            _, q = hide_sync(net, _with(base, name, period=h), name, fixed | {"period"})
            if q.efficiency >= TARGET_EFFICIENCY and q.samples_per_s > cur.samples_per_s:
                chosen, why = q, (f"the fewest local steps that reach {TARGET_EFFICIENCY:.0%} "
                                  f"of the ceiling and beat {cur.strategy}")
                break
    if name == "diloco" and not fixed & {"delta_dtype", "delta_topk", "delta_block"} \
            and (chosen is None or chosen.options["period"] > default_period):
        h = given.get("period", default_period)
        variants = [{**{k: v for k, v in given.items()}, "period": h, **v}
                    for v in _variant_list(PLAN_VARIANTS)]
        _, q, _ = tune_periodic(net, base, name, variants, fixed | {"period"})
        if q.efficiency >= TARGET_EFFICIENCY or chosen is None \
                or q.samples_per_s > (1 + MIN_GAIN) * chosen.samples_per_s:
            chosen, why = q, (f"period {h}, with the outer sync compressed "
                              f"({q.options['delta_dtype']}"
                              + (f", top {q.options['delta_topk']:g}"
                                 if q.options["delta_topk"] < 1 else "")
                              + ") rather than more local steps")
    if chosen is None or chosen.samples_per_s <= p.samples_per_s:
        return p, "the default period" if "period" not in given else "as given"
    if chosen.options.get("streaming"):
        why += (f"; streamed {chosen.options['delay']} step(s) late"
                + (f" in {chosen.options['fragments']} fragments"
                   if chosen.options.get("fragments", 1) > 1 else "")
                + f", exposing {fmt_duration(chosen.exposed_comm_s)} per step")
    return chosen, why


def layouts_of(net: Net) -> tuple[str, ...]:
    """The layouts worth comparing on ``net``: both where several nodes hold
    several ranks each (and the intra-node link is known), else its own."""
    if net.ranks_per_node > 1 and net.nodes > 1 and net.intra_bandwidth_Bps:
        return ("flat", "hierarchical")
    return (net.layout,)


def nccl_advice(net: Net, workload: Workload, strategy: str) -> Step | None:
    """NCCL_ALGO for ``strategy``'s all-reduces: Tree where the model predicts
    it beats the ring by at least MIN_GAIN of the throughput (latency-bound
    messages across many ranks), with the numbers; None when the strategy
    makes no all-reduce.  NCCL_PROTO is not advised: the alpha-beta model has
    no protocol term (NCCL's tuner picks LL/LL128 for small messages itself)."""
    opts = workload.options.get(strategy)
    if not any(c.kind == "all_reduce" for c in catalog.collectives(
            strategy, workload.matrices or workload.adapter_params, max(2, net.world_size),
            opts)):
        return None
    ring = predict(strategy, dataclasses.replace(net, allreduce_algo="ring"), workload)
    tree = predict(strategy, dataclasses.replace(net, allreduce_algo="tree"), workload)
    worth = tree.samples_per_s >= (1 + MIN_GAIN) * ring.samples_per_s
    detail = (f"{strategy}'s all-reduces: ring {fmt_duration(ring.exposed_comm_s)} exposed per "
              f"step ({ring.messages:.3g} messages), tree {fmt_duration(tree.exposed_comm_s)} "
              f"({tree.messages:.3g})")
    if worth:
        detail += ("; export NCCL_ALGO=Tree on every node (NCCL_PROTO: leave NCCL's choice; "
                   "check with NCCL_DEBUG=INFO)")
    else:
        detail += "; leave NCCL_ALGO unset (NCCL's default)"
    return _step("nccl_algo", "Set NCCL_ALGO=Tree" if worth else "NCCL_ALGO", detail, ring,
                 tree, strategy, ring.options, None)


def plan(net: Net, workload: Workload, link: Link = Link(),
         candidates: Sequence[str] = STRATEGIES, backend: str = "gloo",
         layouts: Sequence[str] | None = None) -> Plan:
    """Ranking, recommendation and the expert's ordered steps for this network
    (``layouts``: those to rank, default :func:`layouts_of`; ``backend``
    "nccl" adds the NCCL_ALGO advice)."""
    candidates = tuple(candidates)
    for c in candidates:
        catalog.spec(c)  # validates the name
    layouts = tuple(layouts) if layouts else layouts_of(net)
    if len(layouts) == 1 and net.layout != layouts[0]:
        net = dataclasses.replace(net, layout=layouts[0])
    given = candidates

    def runs(lay: str) -> tuple[str, ...]:
        if lay == "flat":
            return given
        return tuple(c for c in given
                     if catalog.flat_only(c, workload.options.get(c)) is None)

    def recommend(wl: Workload, base: Net | None = None) -> Recommendation:
        """Every layout's ranking merged, the fastest layout's recommendation."""
        base = base or net
        recs = [choose(Measurements(dataclasses.replace(base, layout=lay), wl,
                                    candidates=runs(lay))) for lay in layouts if runs(lay)]
        best = max(recs, key=lambda r: r.prediction.samples_per_s)
        if len(recs) > 1:
            order = {name: i for i, name in enumerate(STRATEGIES)}
            merged = sorted((p for r in recs for p in r.ranking),
                            key=lambda p: (-round(p.samples_per_s, 9), not p.lossless,
                                           order.get(p.strategy, 99), p.layout))
            best = dataclasses.replace(best, ranking=tuple(merged))
        return best

    rec = recommend(workload)
    net = dataclasses.replace(net, layout="flat") if len(layouts) > 1 else net
    ceiling = predict(NONE, net, workload)
    steps: list[Step] = []
    notes: list[str] = []
    bucket_mb = workload.bucket_bytes / MiB

    # 0. where a user starts: plain DDP (fp32 all-reduce) with the current buckets
    cur = predict("allreduce", net, workload)
    cur_net, wl = net, workload

    # 1. TCP tuning: free, lossless, fixes the transport for every strategy.  The
    # steps after it assume it; whether it is worth it is judged again for the
    # strategy they end on (below): plain DDP may be latency-bound where the
    # periodic sync it ends on is not.
    step, cur_net = _tcp_step(cur_net, link, wl, cur)
    tcp_at = None
    if step is None:
        notes.append("RTT unknown: the TCP window check was skipped (give --rtt)")
    else:
        tcp_at = len(steps)
        steps.append(step)
        if step.samples_per_s_after is not None:
            cur = predict(cur.strategy, cur_net, wl)

    # 1b. several ranks per node: exact inside the node, across nodes once per node
    if len(layouts) > 1:
        hnet = dataclasses.replace(cur_net, layout="hierarchical")
        after = predict(cur.strategy, hnet, wl)
        detail = (f"{net.nodes} nodes x {net.ranks_per_node} ranks: all-reduce inside each "
                  f"node ({fmt_rate(net.intra_bandwidth_Bps)}), {cur.strategy} across the "
                  f"{net.nodes} node leaders, broadcast inside the node: "
                  f"{fmt_bytes(after.inter_bytes)} per node per step cross nodes instead of "
                  f"{fmt_bytes(cur.inter_bytes)}, {after.messages:.0f} slow-link messages "
                  f"instead of {cur.messages:.0f} (--hierarchy node; auto picks it)")
        st = _step("hierarchy", "Sync hierarchically (node groups)", detail, cur, after,
                   cur.strategy, cur.options, None)
        steps.append(st)
        if st.worthwhile:
            cur, cur_net = after, hnet
            candidates = runs("hierarchical")

    # 2. compression: the best per-step strategy (lossless preferred within 5%)
    per_step = tuple(c for c in candidates if c not in PERIODIC)
    if per_step and net.world_size > 1:
        r = choose(Measurements(cur_net, wl, candidates=per_step))
        p = r.prediction
        if p.strategy != cur.strategy:
            title = f"Compress gradients: strategy {p.strategy}" + (
                f" ({_opts_text(p)})" if p.options else "")
            steps.append(_step("compression", title, f"{_describe(p)}; {r.reason}", cur, p,
                               p.strategy, p.options, None))
            cur = p
        else:
            steps.append(_step("compression", "Compress gradients",
                               f"{p.strategy} is already the best per-step strategy here "
                               f"({r.reason})", cur, cur, cur.strategy, cur.options, None))

    # 3. overlap: buckets small enough that all but the last sync during backward
    if not cur.periodic and cur.comm_s > 0:
        tries = []
        for mb in BUCKET_MIB_CHOICES:
            w = dataclasses.replace(wl, bucket_bytes=int(mb * MiB), first_bucket_bytes=None)
            tries.append((predict(cur.strategy, cur_net, w).samples_per_s, -mb, mb, w))
        sps, _, mb, w = max(tries)
        after = predict(cur.strategy, cur_net, w)
        if mb != bucket_mb and after.samples_per_s > cur.samples_per_s:
            detail = (f"{after.buckets} buckets instead of {cur.buckets}: exposed sync "
                      f"{fmt_duration(cur.exposed_comm_s)} -> "
                      f"{fmt_duration(after.exposed_comm_s)} per step (only the last bucket's "
                      "sync must wait for the end of backward; each bucket costs its own "
                      "round trips)")
            st = _step("overlap", f"Overlap sync with backward: bucket_mb {mb:g}",
                       detail, cur, after, cur.strategy, cur.options, mb)
            steps.append(st)
            if st.worthwhile:
                cur, wl, bucket_mb = after, w, mb
        else:
            steps.append(_step("overlap", "Overlap sync with backward",
                               f"bucket_mb {bucket_mb:g} is already the best size tried "
                               f"({', '.join(f'{b:g}' for b in BUCKET_MIB_CHOICES)} MiB)",
                               cur, cur, cur.strategy, cur.options, bucket_mb))

    # 4. periodic sync: when even the best per-step strategy leaves too much exposed
    periodic = tuple(c for c in candidates if c in PERIODIC)
    if periodic and net.world_size > 1:
        # each periodic candidate with its period and outer sync tuned for this link
        tuned = [_periodic_choice(predict(c, cur_net, wl), cur_net, wl,
                                  workload.options.get(c, {}), cur) for c in periodic]
        # of those about as fast as the fastest, the one with the fewest local steps
        fastest = max(t[0].samples_per_s for t in tuned)
        p, why = min((t for t in tuned if t[0].samples_per_s >= (1 - MIN_GAIN) * fastest),
                     key=lambda t: t[0].options["period"])
        if p.samples_per_s > cur.samples_per_s:
            title = f"Sync periodically: strategy {p.strategy} ({_opts_text(p)})"
            detail = (f"one outer sync every {p.options['period']} steps ({why}); "
                      f"{_describe(p)}; replicas drift between syncs: compare eval quality "
                      "with a per-step run")
            st = _step("periodic_sync", title, detail, cur, p, p.strategy, p.options, None)
            steps.append(st)
            if st.worthwhile:   # else listed as not worth it, and not taken
                cur = p
                wl = _with(wl, p.strategy, **p.options)
        else:
            best_p = p
            steps.append(_step("periodic_sync", "Sync periodically",
                               f"not needed: {cur.strategy} already reaches "
                               f"{_pct(cur.efficiency)} of the no-sync ceiling "
                               f"({best_p.strategy} would reach {_pct(best_p.efficiency)} "
                               "with a quality risk)", cur, cur, cur.strategy, cur.options,
                               None))

    # 1, judged again: TCP tuning for the strategy the steps end on
    tcp_bw = None
    if tcp_at is not None and cur_net.bandwidth_Bps != net.bandwidth_Bps:
        untuned = dataclasses.replace(cur_net, bandwidth_Bps=net.bandwidth_Bps)
        again, _ = _tcp_step(untuned, link, wl, predict(cur.strategy, untuned, wl))
        first = steps[tcp_at]
        if (again.gain or 0) > (first.gain or 0):
            steps[tcp_at] = dataclasses.replace(
                again, detail=again.detail + f" (for {cur.strategy}, where the steps end; "
                f"{first.strategy} at the start would gain {first.gain:+.1%})")
        if steps[tcp_at].worthwhile:
            tcp_bw = cur_net.bandwidth_Bps

    # 5. RDMA where the hardware has it: latency drops, TCP's window goes away
    if link.rdma:
        bw = max(cur_net.bandwidth_Bps, link.rate_Bps * 0.97) if link.rate_Bps \
            else cur_net.bandwidth_Bps
        rnet = dataclasses.replace(cur_net, alpha_s=min(cur_net.alpha_s, RDMA_ALPHA_S),
                                   bandwidth_Bps=bw)
        r = choose(Measurements(rnet, wl, current=cur.strategy, candidates=candidates),
                   switch_margin=MIN_GAIN)
        p = r.prediction
        detail = (f"NCCL over InfiniBand/RoCE (GPUDirect where available): alpha "
                  f"{fmt_duration(cur_net.alpha_s)} -> {fmt_duration(rnet.alpha_s)}"
                  + (f", bandwidth -> {fmt_rate(bw)}" if bw > cur_net.bandwidth_Bps else
                     " (bandwidth gain not counted: give --rate for the line rate)"))
        if p.strategy != cur.strategy:
            detail += f"; then {p.strategy} is best ({r.reason})"
        steps.append(_step("rdma", "Use RDMA transport", detail, cur, p, p.strategy,
                           p.options, bucket_mb))
        cur = p
        cur_net = rnet

    # 6. NCCL: its all-reduce algorithm, where the model predicts a gain
    if backend == "nccl":
        adv = nccl_advice(cur_net, wl, cur.strategy)
        if adv is not None:
            steps.append(adv)

    # the ranking and the recommendation with what the steps tuned: the bucket size
    # and the periodic strategy's options (the network as measured: RDMA and TCP
    # tuning stay steps), so that the recommendation is where the steps end
    applied: list[str] = []
    if tcp_bw is not None:
        applied.append(f"TCP buffers raised ({fmt_rate(tcp_bw)} between nodes)")
    if wl.bucket_bytes != workload.bucket_bytes:
        applied.append(f"bucket_mb {bucket_mb:g}")
    if wl.options != workload.options:
        applied.append(f"{cur.strategy} as tuned")
    if applied:
        tuned = dataclasses.replace(workload, bucket_bytes=wl.bucket_bytes,
                                    first_bucket_bytes=wl.first_bucket_bytes,
                                    options=wl.options)
        rec = recommend(tuned, dataclasses.replace(net, bandwidth_Bps=tcp_bw)
                        if tcp_bw is not None else None)

    if workload.matrices is None and "powersgd" in candidates:
        notes.append("PowerSGD bytes assume LoRA matrices r x 1024 (give --model for shapes)")
    return Plan(net=net, link=link, workload=workload, ceiling=ceiling, ranking=rec.ranking,
                recommendation=rec, steps=tuple(steps), notes=tuple(notes),
                ranked_with=tuple(applied))
