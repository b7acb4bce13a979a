"""Every fit of a link from timings: alpha (latency) and bandwidth (pure).

What the measurements in :mod:`lorasync.comm.probe` time, this turns into
numbers the cost model takes:

* :func:`fit_alpha_beta`: ``time = alpha + beta * bytes`` from any timings
  (a sweep, a pair's stream);
* :func:`allreduce_model`: the same fit on all-reduce timings, on *bus*
  bytes, so that beta is the link's per-byte cost, not the algorithm's;
  ``lorasync probe``'s sweep, ``auto``'s two-size live probe and a probe JSON
  without a fitted model (:func:`fit_sweep`) all go through it;
* :func:`passive_bandwidth`: the link as the syncs a strategy makes anyway
  saw it, without probe traffic;
* on a long, thin link (tens of ms one way, a few Mbit/s) a message must be
  several bandwidth-delay products long before its time says anything about
  bandwidth: :func:`sweep_estimate` and :func:`latency_bound` size the
  probes by the latency they measured first, and :func:`credited_bandwidth`
  never credits a fit with more than ``1 / MIN_TRANSFER_SHARE`` times the
  plain rate of the largest message timed (so a probe whose messages were
  all latency reads the link as slow, not as fast).

The sizes the live probe times (``SMALL_PROBE_BYTES``, ``MIN_PROBE_BYTES``,
``MAX_PROBE_BYTES``) are defined here once: the fit needs both, and the
measurements take them from here.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

from lorasync import catalog
from lorasync.errors import ConfigError
from lorasync.plan.costmodel import Net, path_terms

__all__ = [
    "SMALL_PROBE_BYTES", "MIN_PROBE_BYTES", "MAX_PROBE_BYTES",
    "AlphaBeta", "AllReduceModel", "fit_alpha_beta", "allreduce_model", "busbw_factor",
    "fit_sweep", "passive_bandwidth", "MIN_TRANSFER_SHARE", "TRANSFER_OVER_LATENCY",
    "latency_bound", "sweep_estimate", "credited_bandwidth", "SweepStep", "sweep_step",
]

#: the latency probe's all-reduce: small enough that bandwidth does not count
SMALL_PROBE_BYTES = 1024
#: the bandwidth probe's smallest all-reduce: a token-bucket shaper (tbf/htb,
#: 32 KiB bursts here) lets the first KiBs through at line rate, so smaller
#: transfers would read a cut link as a fast one
MIN_PROBE_BYTES = 256 << 10
#: the bandwidth probe's largest all-reduce (a fast link needs no more to time well)
MAX_PROBE_BYTES = 4 << 20
#: a probe's largest message times bandwidth when its transfer (its time less
#: the latency the smallest message showed) is at least this many times the
#: latency: then the latency's jitter and a shaper's burst move the figure by
#: a few per cent, not by the factor of 10-25 a latency-bound message gave
TRANSFER_OVER_LATENCY = 3.0
#: a bandwidth figure is credited with at most 1/this times the largest
#: message's plain rate (bytes over its whole time, latency included: a lower
#: bound on the link): half of that message's time may be latency, no more
MIN_TRANSFER_SHARE = 0.5


class AlphaBeta(NamedTuple):
    """time(bytes) = alpha_s + beta_s_per_byte * bytes."""

    alpha_s: float
    beta_s_per_byte: float
    r2: float

    @property
    def bandwidth_Bps(self) -> float | None:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None

    def predict(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of ``time = alpha + beta * bytes``, in two stages.

    beta: ordinary least squares over all points. Sizes grow geometrically,
    so the large transfers, where bandwidth decides the time, carry the
    slope; small points cannot bend it (a shaper's token bucket lets the
    first few KB through at line rate, which a relative-error fit would read
    as a fast link).

    alpha: given beta, the least-squares intercept under *relative* error
    (weights 1/time^2), so the small messages, where latency decides the
    time, carry it; the plain intercept would be noise from the largest
    transfer (milliseconds of jitter against microseconds of latency).

    alpha is clamped to >= 0; a slope <= 0 (times not growing with size)
    gives beta = 0 and no bandwidth.
    """
    if len(sizes) != len(times):
        raise ValueError(f"sizes and times differ in length ({len(sizes)} vs {len(times)})")
    if len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError(f"sizes: need at least 2 distinct sizes to fit alpha and beta, got {list(sizes)}")
    if any(t <= 0 or not math.isfinite(t) for t in times):
        raise ValueError(f"times: every time must be positive and finite, got {list(times)}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes: must be >= 0, got {list(sizes)}")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    beta = max(0.0, sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx)
    w = [1.0 / (t * t) for t in times]
    alpha = max(0.0, sum(wi * (y - beta * x) for wi, x, y in zip(w, sizes, times)) / sum(w))
    ss_tot = sum((y - my) ** 2 for y in times)
    ss_res = sum((y - alpha - beta * x) ** 2 for x, y in zip(sizes, times))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return AlphaBeta(alpha, beta, r2)


class AllReduceModel(NamedTuple):
    """Ring all-reduce of B bytes on n ranks: ``2(n-1) alpha_s + 2(n-1)/n B / bandwidth_Bps``."""

    #: latency per message (one step of the ring)
    alpha_s: float
    #: never None: times that did not grow with size give the largest bus
    #: bandwidth measured, a lower bound on the link
    bandwidth_Bps: float
    #: the whole all-reduce's latency, 2(n-1) alpha_s
    allreduce_alpha_s: float
    r2: float
    bandwidth_from: str


def allreduce_model(sizes: Sequence[float], times: Sequence[float], world_size: int
                    ) -> AllReduceModel:
    """The alpha-beta model of a group from all-reduce timings (payload bytes,
    seconds): :func:`fit_alpha_beta` on bus bytes (the bytes each rank moves,
    2(n-1)/n of the payload), alpha per ring step."""
    n = int(world_size)
    if n < 2:
        raise ValueError(f"world_size: an all-reduce model needs at least 2 ranks, got {world_size}")
    f = busbw_factor("all_reduce", n)
    fit = fit_alpha_beta([b * f for b in sizes], times)
    steps = 2 * (n - 1)  # ring all-reduce: n-1 reduce-scatter + n-1 all-gather messages
    if fit.bandwidth_Bps is None:  # times flat in size: latency-bound up to the largest size
        bw = max(b * f / t for b, t in zip(sizes, times))
        source = "largest busbw (times did not grow with size)"
    else:
        bw, source = fit.bandwidth_Bps, "fit"
    return AllReduceModel(fit.alpha_s / steps, bw, fit.alpha_s, fit.r2, source)


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor."""
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"collective: unknown {collective!r}; use all_reduce, all_gather or broadcast")


#: what a sweep record can hold: up to 1 PB in up to an hour
_SWEEP_LIMITS = {"bytes": 1e15, "time_s": 3600.0}


def fit_sweep(sweep: Sequence[Mapping], world_size: int, where: str = "probe.sweep"
              ) -> AllReduceModel | None:
    """:func:`allreduce_model` of the all-reduce records of a probe's sweep
    (``bytes``, ``time_s``), or None when fewer than two sizes were timed.

    A sweep that is not a list of records, or an all-reduce record without a
    positive ``bytes`` and ``time_s``, is a ConfigError naming the record
    (``where[i].bytes``): a probe JSON is read from a file."""
    if not isinstance(sweep, (list, tuple)):
        raise ConfigError(where, sweep, "give a list of records {\"collective\": "
                          "\"all_reduce\", \"bytes\": B, \"time_s\": T}, as `lorasync probe "
                          "--json` writes")
    pts = []
    for i, rec in enumerate(sweep):
        if not isinstance(rec, Mapping):
            raise ConfigError(f"{where}[{i}]", rec, "give a record {\"collective\", "
                              "\"bytes\", \"time_s\"}, as `lorasync probe --json` writes")
        if rec.get("collective") != "all_reduce":
            continue
        point = []
        for key, top in _SWEEP_LIMITS.items():
            v = rec.get(key)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= top):
                raise ConfigError(f"{where}[{i}].{key}", v, f"give a number in (0, {top:g}]; "
                                  "re-run `lorasync probe --json`")
            point.append(float(v))
        pts.append(tuple(point))
    if world_size < 2 or len({b for b, _ in pts}) < 2:
        return None
    return allreduce_model([b for b, _ in pts], [t for _, t in pts], world_size)


def passive_bandwidth(transfers: Sequence[tuple[str, float, float]], world_size: int,
                      alpha_s: float) -> float:
    """Bytes per second the link gave the fastest of ``transfers`` (kind,
    payload bytes, seconds; collectives timed on an idle wire), or 0.0 when
    none is big enough to tell: at least ``MIN_PROBE_BYTES`` on the
    critical path (a shaper's burst flatters smaller ones) and longer than
    its latency terms."""
    net = Net(alpha_s=alpha_s, bandwidth_Bps=1.0, world_size=world_size)
    best = 0.0
    for kind, payload, seconds in transfers:
        msgs, nbytes = path_terms(catalog.Collective(kind, float(payload)), net)
        busy = seconds - msgs * alpha_s
        if nbytes >= MIN_PROBE_BYTES and busy > 0:
            best = max(best, nbytes / busy)
    return best


def latency_bound(t_small: float, t_big: float) -> bool:
    """Whether a message of ``t_big`` seconds is too short to time the
    bandwidth on a link whose smallest message took ``t_small`` (latency,
    both times of the same collective): its transfer, ``t_big - t_small``,
    is under ``TRANSFER_OVER_LATENCY`` times the latency.  A probe grows its
    messages while this holds (and its budget allows)."""
    return t_big - t_small < TRANSFER_OVER_LATENCY * t_small


def sweep_estimate(nbytes: float, t_small: float, last_bytes: float, last_s: float) -> float:
    """Projected seconds of one ``nbytes`` collective from the smallest
    message's time (latency, ``t_small``) and the last one timed
    (``last_bytes`` in ``last_s``): the latency plus the last transfer scaled
    to ``nbytes``.

    Scaling the last *time* instead (latency included, what the sweep did
    before) projects a latency-bound message as if its latency grew with its
    size: at 10 Mbit/s with 50 ms one way a 64 KiB all-reduce took 0.21 s, of
    which 0.20 s latency, and 1 MiB was projected at 3.3 s (it takes 1.0 s),
    beyond the quick probe's budget, so the sweep stopped at sizes a 64 KiB
    burst lets through at line rate and read the link 12x too fast.  When
    the last message was itself all latency this under-projects; sizes grow
    4x at a time, and a time is concave in size (latency + bytes/bandwidth),
    so a call takes at most 4x the last one: the budget is overrun by at
    most one call."""
    if last_bytes <= 0 or last_s <= 0:
        raise ValueError(f"last_bytes, last_s: need a timed message, got {last_bytes}, {last_s}")
    base = min(max(t_small, 0.0), last_s)
    return base + (last_s - base) * nbytes / last_bytes


class SweepStep(NamedTuple):
    """What a sweep does with its next size (:func:`sweep_step`)."""

    #: time it (else the sweep stops here)
    measure: bool
    #: projected seconds of one call (None: the first size, nothing to go by)
    est_s: float | None
    #: projected to be mostly latency: one call tells as much as several
    latency_only: bool


def sweep_step(nbytes: float, points: Sequence[tuple[float, float]], remaining_s: float, *,
               min_reps: int = 1, grow_past: float | None = None) -> SweepStep:
    """Whether a probe's sweep times ``nbytes`` next, given the ``points``
    (bytes, seconds) it timed so far, smallest first, and ``remaining_s`` of
    its budget.

    Always the first two sizes (a line needs two points); then a size whose
    ``min_reps`` calls are projected (:func:`sweep_estimate`) to fit the
    budget.  ``grow_past`` (the quick probe): sizes above it only while the
    largest so far is :func:`latency_bound`, so a long, thin link gets
    messages of several bandwidth-delay products and a short one stops where
    it always did.
    """
    if not points:
        return SweepStep(True, None, False)
    t_small = points[0][1]
    last_bytes, last_s = points[-1]
    est = sweep_estimate(nbytes, t_small, last_bytes, last_s)
    if grow_past is not None and nbytes > grow_past and not latency_bound(t_small, last_s):
        return SweepStep(False, est, False)
    if len(points) >= 2 and est * min_reps > remaining_s:
        return SweepStep(False, est, False)
    return SweepStep(True, est, latency_bound(t_small, est))


def credited_bandwidth(fit_Bps: float, big_bus_bytes: float, t_big: float, t_small: float
                       ) -> tuple[float, bool]:
    """``(bandwidth, capped)``: the fitted bandwidth, at most the largest
    message's bytes per second of its transfer, where its transfer is
    counted as at least ``MIN_TRANSFER_SHARE`` of its time.

    ``big_bus_bytes / t_big`` is a lower bound on the link (all of the time
    charged to bytes).  Where the largest message was mostly latency
    (``t_small`` close to ``t_big``) a fit reads the bytes from differences
    of a few ms between times of hundreds: a shaper's burst or jitter makes
    that any figure, and one 25x too fast made auto plan an outer sync it
    expected to hide.  Capped, such a probe reads the link at most
    ``1/MIN_TRANSFER_SHARE`` times its lower bound: never more than 2x too
    fast, possibly slower than it is, which the first sync's own timing
    (:func:`passive_bandwidth`) corrects; a probe sized by the latency
    (:func:`latency_bound`) is not capped.
    """
    if not (t_big > 0 and big_bus_bytes > 0):
        return fit_Bps, False
    transfer = max(t_big - max(t_small, 0.0), MIN_TRANSFER_SHARE * t_big)
    cap = big_bus_bytes / transfer
    return (cap, True) if fit_Bps > cap else (fit_Bps, False)
