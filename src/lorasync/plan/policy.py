"""``auto``'s policy: measurements in, decisions out (pure: no torch, no I/O).

The strategy that runs it, :class:`lorasync.comm.auto.Auto`, measures and
switches; everything it decides with is here, unit-tested without a process
group: which candidates and options (:func:`parse_candidates`,
:func:`child_options`, :func:`variant_options`, :func:`start_strategy`),
when to probe, with what and when next (:func:`probe_plan`, from
:func:`sync_drifted`, :func:`probe_size`, :func:`next_probe_step` and
:func:`probe_every`; :func:`link_changed` after a probe), when to
decide (:func:`defer_decision`, :func:`wait_for_confirmation`), how the cost
model is corrected by what was measured (:func:`corrections`,
:func:`inflation`, :func:`split_extra`, :func:`encode_ns_for`,
:func:`workload_for`), what to pick (:func:`decide`, :func:`describe`) and
how many micro-batches per sync (:func:`suggest_accum`).

How a network change is seen (exposed sync time alone is ambiguous when sync
overlaps with backward or happens every few steps): the per-step time beyond
compute (wall time of the step minus compute, so evaluations and checkpoints
between steps cancel out) is compared with the cost model's prediction for
the current strategy, calibrated on it while it runs.  A drift of more than
``DRIFT`` of the step triggers a probe at the boundary: three 1 KiB
all-reduces (latency) and one of 256 KiB to 4 MiB (bandwidth; never smaller,
because a shaper's token bucket lets the first tens of KiB through at line
rate; on a long link at least 3x the latency of transfer, :func:`probe_size`), timed, the fastest rank's time counting (the others may have waited
for it to arrive); a probe that finds another link is repeated at once and
the faster of the two counts (a rank descheduled during one probe must not
read as a cut link).  Without a trigger the probe runs every m K-step
windows, m chosen so it costs about ``PROBE_BUDGET`` (1%) of the step time.

On slow links a probe is dear (256 KiB take 2 s at 1 Mbit/s), so the link is
measured from the syncs the strategy makes anyway whenever they can tell
(:func:`lorasync.plan.linkfit.passive_bandwidth`: every collective that found the wire idle is
timed, see :mod:`lorasync.comm.wire`; transfers of at least
``MIN_PROBE_BYTES`` on the link's critical path count, for the reason the
probe has that floor); the timed probe runs only when they give no figure.

DiLoCo comes in variants (:func:`parse_variants`: its outer-sync codec), each
admitted with the options that passed the quality rule; at every decision
the variant and its streaming delay / fragment count are chosen from the
predicted sync time (:func:`lorasync.plan.periodic.tune_periodic`).

The cost model is corrected by what it sees (:func:`corrections`,
:func:`split_extra`): what the strategy in use cost beyond its prediction is
split into a base that every strategy pays (ranks waiting for each other on
a busy host, per-step overheads) and the share of the collective time the
model hides behind backward that was in fact exposed; every candidate is
then predicted with the same two numbers, so none looks better merely
because it has not run yet, and load common to all cancels out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from lorasync import catalog
from lorasync.catalog import PERIODIC, STRATEGIES
from lorasync.errors import LorasyncError
from lorasync.plan.costmodel import (
    Net, Prediction, Workload, collective_time, encode_ns, predict,
)
from lorasync.plan.linkfit import (MAX_PROBE_BYTES, MIN_PROBE_BYTES, SMALL_PROBE_BYTES,
                                   TRANSFER_OVER_LATENCY, busbw_factor)
from lorasync.plan.ranking import Measurements, choose
from lorasync.units import fmt_duration, fmt_rate

__all__ = [
    "DEFAULT_CANDIDATES", "DEFAULT_CHILD_OPTIONS", "Window", "Decision", "probe_size",
    "probe_every", "corrections", "inflation", "hidden_of", "split_extra", "workload_for",
    "encode_ns_for", "decide", "drifted", "link_changed", "suggest_accum", "describe",
    "parse_candidates", "parse_force", "parse_variants", "probe_cost", "prediction_text",
    "child_options", "variant_options", "start_strategy", "ProbePlan", "probe_plan",
    "sync_drifted", "next_probe_step", "defer_decision", "wait_for_confirmation",
]

#: the strategies auto chooses among unless ``candidates`` says otherwise
#: (the catalog's default of that option; why onebit is not among them: there)
DEFAULT_CANDIDATES = tuple(catalog.AutoOptions().candidates.split(","))
#: candidate options auto uses unless given (``NAME.OPTION``): DiLoCo's outer
#: sync as fp16 and overlapped with the next inner step, which is what makes a
#: periodic strategy worth picking on a slow link (fp16 deltas met the quality
#: rule as fp32 ones did: bench/strategies.py)
DEFAULT_CHILD_OPTIONS = {"diloco": {"streaming": True, "delta_dtype": "fp16"}}
#: share of the training time the periodic (untriggered) probe may take
PROBE_BUDGET = 0.01
#: duration the bandwidth probe aims at on fast links
PROBE_TARGET_S = 0.02
#: time beyond compute that moved by more than this share of the step
#: (calibrated / not yet calibrated prediction) triggers a probe
DRIFT = 0.2
DRIFT_UNCALIBRATED = 0.5
#: compute this much above the last one measured under a strategy idle in
#: backward (local, diloco) counts as the cost of running collectives inside
#: backward (the CPU they take from it), charged to every per-step strategy
INFLATION_MIN = 0.02
#: a probe that moves an fp32 sync of the adapter by this share of the step
#: (and is BANDWIDTH_CHANGE off) found another link: decide afresh
LINK_MOVE = 0.05
#: a probe this many times faster or slower than the last forgets the
#: per-strategy corrections measured on the old link
BANDWIDTH_CHANGE = 1.5
#: steps per window for the probe schedule when auto decides only once
#: (``interval=0``): drift is still checked, and probes still budgeted, per window
PROBE_WINDOW = 10


# --------------------------------------------------------------------------- pure parts

def parse_candidates(value: Any, field: str = "candidates") -> tuple[str, ...]:
    """``"allreduce,topk"`` or a list -> a validated tuple of strategy names."""
    if isinstance(value, str):
        names = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        names = [str(v).strip() for v in value]
    else:
        raise ValueError(f"auto: option {field}={value!r} must be a comma-separated list of "
                         f"strategies, e.g. allreduce,fp16,topk")
    if not names:
        raise ValueError(f"auto: option {field} is empty; name at least one strategy")
    for n in names:
        if n not in STRATEGIES:
            raise ValueError(f"auto: option {field}: {n!r} cannot be chosen automatically; "
                             f"use some of {', '.join(STRATEGIES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"auto: option {field}={value!r} names a strategy twice")
    return tuple(names)


def parse_force(value: Any) -> dict[int, str]:
    """``"10:int8,20:allreduce"`` (or ``{10: "int8"}``) -> ``{10: "int8", 20: "allreduce"}``."""
    if value in (None, "", {}):
        return {}
    items: list[tuple[Any, Any]]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, str):
        items = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            step, sep, name = part.partition(":")
            if not sep:
                raise ValueError(f"auto: option force_switch_at={value!r}: write STEP:NAME, "
                                 "e.g. 10:int8 (comma-separated for several)")
            items.append((step.strip(), name.strip()))
    else:
        raise ValueError(f"auto: option force_switch_at={value!r}: write STEP:NAME, e.g. 10:int8")
    out: dict[int, str] = {}
    for step, name in items:
        try:
            s = int(step)
        except (TypeError, ValueError):
            s = 0
        if s < 1:
            raise ValueError(f"auto: option force_switch_at: step {step!r} must be an integer >= 1")
        if name not in STRATEGIES:
            raise ValueError(f"auto: option force_switch_at: {name!r} is not one of "
                             f"{', '.join(STRATEGIES)}")
        out[s] = name
    return out


def parse_variants(value: Any, field: str = "diloco_variants") -> list[dict[str, Any]]:
    """``"fp16,int8,int4@0.03"`` -> DiLoCo outer-sync options, in the order
    given (the least lossy first: it wins ties): ``DTYPE`` is ``delta_dtype``,
    ``@RATIO`` ``delta_topk``."""
    items = value.split(",") if isinstance(value, str) else list(value or [])
    out: list[dict[str, Any]] = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        dtype, at, ratio = item.partition("@")
        v: dict[str, Any] = {"delta_dtype": dtype.strip()}
        if at:
            try:
                v["delta_topk"] = float(ratio)
            except ValueError:
                raise ValueError(f"auto: option {field}: {item!r}: write DTYPE@RATIO, e.g. "
                                 "int4@0.03") from None
        try:
            catalog.parse_options("diloco", v)
        except ValueError as e:
            raise ValueError(f"auto: option {field}: {item!r}: {e}") from None
        if v in out:
            raise ValueError(f"auto: option {field}={value!r} names {item!r} twice")
        out.append(v)
    if not out:
        raise ValueError(f"auto: option {field} is empty; name at least one, e.g. fp16")
    return out


def child_options(nested: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each candidate's options: ``DEFAULT_CHILD_OPTIONS`` under the user's
    ``NAME.OPTION`` ones (``nested``), unless together they do not parse
    (e.g. ``diloco.period=1`` leaves no room to stream): then the user's stand."""
    out = {k: dict(v) for k, v in nested.items()}
    for k, v in DEFAULT_CHILD_OPTIONS.items():
        merged = {**v, **out.get(k, {})}
        try:
            catalog.parse_options(k, merged)
        except LorasyncError:
            continue
        out[k] = merged
    return out


def variant_options(variants: Sequence[Mapping[str, Any]],
                    nested: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """DiLoCo's outer-sync variants as full options: each on top of the
    defaults, the user's ``diloco.*`` options over both (they are never
    changed); the ones that do not parse, and repeats, left out.  Empty when
    none is left."""
    out: list[dict[str, Any]] = []
    for v in variants:
        merged = {**DEFAULT_CHILD_OPTIONS.get("diloco", {}), **v, **nested.get("diloco", {})}
        try:
            catalog.parse_options("diloco", merged)
        except LorasyncError:
            continue
        if merged not in out:
            out.append(merged)
    return out


def start_strategy(candidates: Sequence[str], usable: Sequence[str], start: str = "", *,
                   hierarchical: bool = False,
                   options: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The strategy auto measures compute under before its first choice.

    ``start`` when given, else one that sends nothing during backward
    (diloco, else local): the compute measured under it is what every
    strategy shares, while collectives run inside backward take CPU from it,
    which the cost model cannot tell from compute (and leaving it costs one
    fp32 average, on a slow link where auto stays on DiLoCo anyway).  Without
    a periodic candidate: the lossless one that sends the fewest bytes.
    ``usable``: what the layout in use can run; a start it cannot (a
    candidate, or in the ``hierarchical`` layout one that runs flat only with
    its ``options``) gives way to the first usable one.  A ``start`` outside
    the candidates runs as given where it can.
    """
    name = start or next(
        (c for c in ("diloco", "local", "fp16", "bf16", "allreduce") if c in candidates),
        next((c for c in candidates if c not in PERIODIC), candidates[0]))
    opts = (options or {}).get(name, {})
    if name not in usable and (name in candidates or hierarchical
                               and catalog.flat_only(name, opts) is not None):
        return usable[0]
    return name


def probe_size(bandwidth_Bps: float, alpha_s: float = 0.0, world_size: int = 2) -> int:
    """Bytes of the bandwidth probe, a power of two in [256 KiB, 4 MiB]: a
    transfer of about ``PROBE_TARGET_S`` (long enough for the timer, short
    enough to run every window), and on a link with latency (``alpha_s`` per
    message of a ring of ``world_size``) at least ``TRANSFER_OVER_LATENCY``
    times the all-reduce's latency, rounded up: at 10 Mbit/s with 50 ms one
    way 20 ms of transfer sit under 200 ms of latency, where the fit reads
    the bandwidth from a few ms of difference."""
    target = bandwidth_Bps * PROBE_TARGET_S
    size = MIN_PROBE_BYTES if target <= MIN_PROBE_BYTES else 2 ** math.floor(math.log2(target))
    n = max(2, int(world_size))
    if alpha_s > 0 and bandwidth_Bps > 0:
        latency = 2 * (n - 1) * alpha_s
        need = TRANSFER_OVER_LATENCY * latency * bandwidth_Bps / busbw_factor("all_reduce", n)
        if need > size:
            size = 2 ** math.ceil(math.log2(need))
    return int(min(MAX_PROBE_BYTES, max(MIN_PROBE_BYTES, size)))


def probe_cost(net: Net | None) -> float:
    """Seconds auto's timed probe takes on ``net``: three 1 KiB all-reduces
    and one of :func:`probe_size` (0.0 without a net: nothing to go by)."""
    if net is None:
        return 0.0
    small = collective_time(catalog.Collective("all_reduce", SMALL_PROBE_BYTES), net)
    size = probe_size(net.bandwidth_Bps, net.alpha_s, net.world_size)
    large = collective_time(catalog.Collective("all_reduce", size), net)
    return 3 * small + large


def probe_every(probe_s: float, step_s: float, interval: int,
                budget: float = PROBE_BUDGET) -> int:
    """Windows of ``interval`` steps between untriggered probes so that a
    probe of ``probe_s`` costs about ``budget`` of the training time."""
    window = budget * max(1, interval) * step_s
    if window <= 0:
        return 1
    return max(1, math.ceil(probe_s / window))


def encode_ns_for(name: str, options: Mapping[str, Any], extra_s: float, numel: int,
                  base_ns: float | None = None) -> float:
    """The encode time of ``name`` (ns per element per sync: ``base_ns`` as
    timed on the live device, else the catalog's CPU figure) plus ``extra_s``
    per optimizer step that it was measured to cost beyond its prediction
    (never below zero)."""
    opts = catalog.parse_options(name, options)
    per_sync = opts.period if name in PERIODIC else 1
    base = encode_ns(name, opts) if base_ns is None else base_ns
    return max(0.0, base + extra_s * 1e9 * per_sync / numel)


def corrections(names: Sequence[str], hidden_s: Mapping[str, float], base_s: float = 0.0,
                exposed: float = 0.0) -> dict[str, float]:
    """Seconds per step each strategy costs beyond the cost model:
    ``base_s + exposed * hidden_s[name]`` -- what any strategy was seen to pay
    (ranks waiting for each other on a busy host, per-step overheads) plus the
    share of the collective time the model hides behind backward
    (``hidden_of(prediction)``) that turned out exposed (CPU contention, one
    bucket ready late).  Both are fitted on the strategy in use
    (:func:`split_extra`), so every strategy is compared on the same footing:
    none looks better merely because it has not run yet, a lighter one is not
    charged a heavier one's transfer, and load that comes and goes (common to
    all) cancels out."""
    return {n: base_s + exposed * hidden_s.get(n, 0.0) for n in names}


def inflation(compute_s: float, quiet_s: float) -> float:
    """Seconds per step that running collectives inside backward costs:
    ``compute_s`` (measured under such a strategy) beyond ``quiet_s``
    (measured with nothing inside backward); nothing below
    ``INFLATION_MIN`` of the quiet compute (noise).

    It is the CPU the collectives take from backward on a shared host, about
    the same for every per-step strategy whatever it sends, so it is charged
    to every per-step strategy the same, not per byte."""
    extra = compute_s - quiet_s
    return extra if extra > INFLATION_MIN * quiet_s else 0.0


def hidden_of(p: Prediction) -> float:
    """Collective time per step the model expects to overlap with backward."""
    return max(0.0, p.comm_s - p.exposed_comm_s)


#: a strategy whose hidden collective time exceeds this share of the step
#: tells how much of it is really hidden; below, its extra cost is all base
SIGNIFICANT_HIDDEN = 0.02
#: before any fit: half of what the model hides is assumed exposed
EXPOSED_PRIOR = 0.5


def split_extra(extra_s: float, hidden_s: float, step_s: float, base_s: float,
                exposed: float) -> tuple[float, float]:
    """``(base_s, exposed)`` updated with the strategy in use's measured extra
    cost (``extra_s``; ``hidden_s``: its collective time the model hides).

    A strategy with significant hidden time updates the exposed share (0..1)
    given the base; one without updates the base.
    """
    if hidden_s > SIGNIFICANT_HIDDEN * step_s:
        share = (extra_s - base_s) / hidden_s
        if share > 1.0:
            return extra_s - hidden_s, 1.0
        if share < 0.0:
            return extra_s, 0.0
        return base_s, share
    return extra_s - exposed * hidden_s, exposed


def workload_for(numel: int, compute_s: float, *, bucket_sizes: Sequence[int] = (),
                 bucket_cap_bytes: int = 25 << 20, matrices=None,
                 options: Mapping[str, Mapping[str, Any]] | None = None,
                 extra_s: Mapping[str, float] | None = None, batch_size: int = 1,
                 head_share: float = 0.0,
                 encode_base: Mapping[str, float] | None = None) -> Workload:
    """A cost-model ``Workload`` from what a running job knows about itself.

    ``bucket_sizes``: elements per DDP bucket in ready order (a strategy's
    ``bucket_sizes``), else DDP's cap; ``extra_s``: measured per-step cost
    beyond the prediction, per strategy (see :func:`encode_ns_for`);
    ``head_share``: :func:`lorasync.comm.auto.module_head_share` of the model;
    ``encode_base``: encode+decode ns per element per sync timed on the live
    device, per strategy (else the catalog's CPU figures).
    """
    options = {k: dict(v) for k, v in (options or {}).items()}
    if bucket_sizes:
        bucket_bytes = 4 * max(bucket_sizes)
        first = 4 * bucket_sizes[0]
    else:
        bucket_bytes, first = int(bucket_cap_bytes), None
    extra, base = dict(extra_s or {}), dict(encode_base or {})
    encode = {name: encode_ns_for(name, options.get(name, {}), extra.get(name, 0.0), numel,
                                  base.get(name))
              for name in sorted(set(extra) | set(base))}
    return Workload(adapter_params=int(numel), compute_s=max(float(compute_s), 1e-6),
                    batch_size=int(batch_size), head_share=float(head_share),
                    bucket_bytes=int(bucket_bytes),
                    first_bucket_bytes=first, matrices=matrices, encode_ns=encode,
                    options=options)


@dataclass(frozen=True)
class Window:
    """What the ranks measured over the last window of steps (the same numbers
    on every rank after the all-reduce)."""

    #: median compute per optimizer step (forward, backward, optimizer, data;
    #: no sync, no encode), slowest rank
    compute_s: float
    #: mean time per step beyond compute (sync waited on, encode, periodic
    #: syncs in after_step), on the rank that waited least
    overhead_s: float
    #: steps measured
    steps: int
    #: the same mean over the window's last third (a change late in the window)
    recent_overhead_s: float = 0.0
    #: bytes/s the link gave the window's syncs (:func:`lorasync.plan.linkfit.passive_bandwidth`,
    #: fastest rank); 0.0 when they cannot tell
    link_Bps: float = 0.0


@dataclass(frozen=True)
class Decision:
    strategy: str
    options: dict
    #: whether this is a change of strategy
    switch: bool
    #: the planner's reason (lossless preference, hysteresis, ...)
    rule: str
    prediction: Prediction
    #: the strategy in use, as predicted on the same measurements (None at start)
    current: Prediction | None
    ranking: tuple[Prediction, ...]


def decide(net: Net, workload: Workload, current: str | None, candidates: Sequence[str], *,
           lossless_margin: float = 0.05, switch_margin: float = 0.05,
           fresh: bool = False) -> Decision:
    """The strategy to use from now on.

    The pick is ``ranking.choose``'s on these measurements (best predicted
    throughput; a lossless strategy within ``lossless_margin`` of the best).
    ``fresh`` (the first choice, or the link changed): that pick, whatever is
    in use.  Otherwise (a routine re-evaluation) the strategy in use stays
    unless the pick is predicted more than ``switch_margin`` faster -- in
    either direction, lossy to lossless included, so noisy measurements
    cannot make it flap -- or the fastest candidate is: then the pick is
    taken even if it gains less (a lossless strategy in use that is more than
    the margin behind the fastest does not stay because another lossless
    one is only slightly better than it).  A current strategy that is not a candidate is
    always left.
    """
    cands = tuple(candidates)
    rec = choose(Measurements(net, workload, candidates=cands),
                 lossless_margin=lossless_margin)
    cur = None
    if current is not None:
        cur = next((p for p in rec.ranking if p.strategy == current), None)
        if cur is None:
            cur = predict(current, net, workload)
    pick, rule = rec.prediction, rec.reason
    fastest = rec.ranking[0]
    if not fresh and current in cands and pick.strategy != current \
            and pick.samples_per_s <= (1 + switch_margin) * cur.samples_per_s \
            and fastest.samples_per_s <= (1 + switch_margin) * cur.samples_per_s:
        gain = pick.samples_per_s / cur.samples_per_s - 1
        rule = (f"keep {current}: {pick.strategy} would gain {gain:.1%}, not more than "
                f"{switch_margin:.0%}")
        pick = cur
    return Decision(strategy=pick.strategy, options=pick.options,
                    switch=current is None or pick.strategy != current, rule=rule,
                    prediction=pick, current=cur, ranking=rec.ranking)


def drifted(overhead_s: float, predicted_overhead_s: float, step_s: float,
            calibrated: bool = True) -> bool:
    """Whether the time per step beyond compute moved away from the prediction
    for the strategy in use by more than ``DRIFT`` of the step (the link
    changed, or something else did: either way, measure again)."""
    tol = DRIFT if calibrated else DRIFT_UNCALIBRATED
    return abs(overhead_s - predicted_overhead_s) > tol * max(step_s, 1e-9) + 2e-3


def link_changed(previous: Net, net: Net, numel: int, step_s: float) -> bool:
    """Whether a new probe describes another link for this job: bandwidth off
    by more than ``BANDWIDTH_CHANGE`` either way *and* enough to move an fp32
    sync of the adapter by more than ``LINK_MOVE`` of the step, as much as
    the margins a choice is made with (on a fast link the estimate is noisy
    and irrelevant).  Looser than ``DRIFT``: a tenfold cut from a fast link
    can move the step by less than ``DRIFT`` and still change the choice."""
    ratio = net.bandwidth_Bps / previous.bandwidth_Bps
    if 1 / BANDWIDTH_CHANGE <= ratio <= BANDWIDTH_CHANGE:
        return False
    moved = abs(4.0 * numel / net.bandwidth_Bps - 4.0 * numel / previous.bandwidth_Bps)
    return moved > LINK_MOVE * step_s


# --------------------------------------------------------------------------- when to measure

def _window_steps(interval: int) -> int:
    return interval or PROBE_WINDOW


def sync_drifted(predicted: Prediction, overheads: Sequence[float],
                 calibrated: bool) -> bool:
    """Whether any of ``overheads`` (time per step beyond compute: the whole
    window's, its last third's, so that a change just before the boundary
    counts) :func:`drifted` from ``predicted``, the strategy in use's
    prediction.  A needless probe costs little, a missed one a window."""
    return any(drifted(o, predicted.step_s - predicted.compute_s, predicted.step_s,
                       calibrated=calibrated) for o in overheads)


def next_probe_step(step: int, probe_s: float, step_s: float, interval: int) -> int:
    """The step of the next untriggered probe after one of ``probe_s``
    seconds at ``step``: whole windows later, as many as keep probes at
    ``PROBE_BUDGET`` of the training time (:func:`probe_every`)."""
    k = _window_steps(interval)
    return step + probe_every(probe_s, step_s, k) * k


@dataclass(frozen=True)
class ProbePlan:
    """What auto does about the link at a window's boundary (:func:`probe_plan`)."""

    #: the link figure to decide with unless a probe runs: the window's syncs'
    #: (``passive``), else the last one (None: none yet)
    net: Net | None
    #: the window's syncs measured the link
    passive: bool
    #: bytes of the bandwidth probe to run now; 0: none
    probe_bytes: int
    #: the step of the next untriggered probe when none runs now (after one:
    #: :meth:`next_after`)
    next_probe: int
    #: the boundary's step, step time and decision interval, which
    #: :meth:`next_after` schedules from
    step: int
    step_s: float
    interval: int

    def next_after(self, spent_s: float) -> int:
        """The step of the next untriggered probe after this plan's probe
        took ``spent_s`` (:func:`next_probe_step`)."""
        return next_probe_step(self.step, spent_s, self.step_s, self.interval)


def probe_plan(step: int, net: Net | None, *, link_Bps: float, next_probe: int, interval: int,
               step_s: float, initial: bool, start_probed: bool, in_flight: bool,
               overheads: Sequence[float], calibrated: bool,
               in_use: Callable[[Net], Prediction]) -> ProbePlan:
    """Whether to probe the link at this boundary, with how many bytes, and
    when next: auto's whole decision about measuring the link.

    What auto knows: ``net``, the link figure in use (the start probe's
    until the first decision; None without one); ``link_Bps``, the bandwidth
    the window's syncs saw (:attr:`Window.link_Bps`; 0.0: they cannot tell);
    ``next_probe``, the step the schedule set; ``initial``, the first choice;
    ``start_probed``, whether ``net`` is a start probe's; ``in_flight``, a
    streamed sync still on the link; ``overheads``, the window's time per
    step beyond compute (the whole window's and its last third's) and
    ``calibrated``, whether the corrections were fitted on the strategy in
    use; ``in_use(net)``, that strategy's prediction on a link (asked only
    when the drift decides).

    * The window's syncs measured the link (and ``net`` has the latency,
      which transfers big enough to time bandwidth do not time): ``net``
      with their bandwidth, no probe traffic, and the scheduled probe not
      before the next window.
    * Else a probe is due with no figure of the link yet or once the
      schedule's step has come; at a routine boundary (not the first
      choice: nothing is calibrated yet, the start probe is the figure) a
      drift of the time beyond compute from the prediction
      (:func:`sync_drifted`) calls one too.
    * A due probe runs, of :func:`probe_size` bytes for ``net``
      (``MIN_PROBE_BYTES`` without one), except at the first choice after a
      start probe (its figure is fresh) and while a sync is in flight (the
      probe would queue behind it, block the step for the rest of the
      transfer and time a busy link).
    * The next untriggered probe: after a probe, whole windows later, as
      many as keep probes at ``PROBE_BUDGET`` of the training time
      (:meth:`ProbePlan.next_after`); at a first choice without one, as
      many as a probe on ``net`` would need (:func:`probe_cost`).
    """
    at = dict(step=step, step_s=step_s, interval=interval)
    if link_Bps > 0 and net is not None:
        net = dataclasses.replace(net, bandwidth_Bps=link_Bps)
        if initial:
            next_probe = next_probe_step(step, probe_cost(net), step_s, interval)
        else:
            next_probe = max(next_probe, step + _window_steps(interval))
        return ProbePlan(net=net, passive=True, probe_bytes=0, next_probe=next_probe, **at)
    due = net is None or step >= next_probe
    if not (due or initial):
        due = sync_drifted(in_use(net), overheads, calibrated)
    if due and not (initial and start_probed) and not in_flight:
        size = (probe_size(net.bandwidth_Bps, net.alpha_s, net.world_size) if net is not None
                else MIN_PROBE_BYTES)
        return ProbePlan(net=net, passive=False, probe_bytes=size, next_probe=next_probe, **at)
    if initial:
        next_probe = next_probe_step(step, probe_cost(net), step_s, interval)
    return ProbePlan(net=net, passive=False, probe_bytes=0, next_probe=next_probe, **at)


def defer_decision(in_flight: bool, deferred: int, period: int) -> bool:
    """Whether to move a due decision one step later: a streamed sync
    launched in an earlier step is still on the link, and the window's
    all-reduce and any probe would queue behind it, block the step for the
    rest of the transfer (which compute would otherwise hide) and time a
    busy link.  Not more than ``period`` steps in a row: fragments with a
    long delay may always have one in flight."""
    return in_flight and deferred < period


def wait_for_confirmation(switch: bool, fresh: bool, pending: str | None, pick: str) -> bool:
    """Whether a switch to ``pick`` waits for the next window to agree: a
    routine one (same link, not the first choice) must win two windows in a
    row (``pending``: the pick the last window deferred), so that one noisy
    window on a busy host does not make auto switch."""
    return switch and not fresh and pending != pick


def suggest_accum(current: int, compute_s: float, overhead_s: float, *, max_accum: int,
                  min_accum: int = 1, target: float = 0.9, slack: float = 0.05) -> int:
    """Micro-batches per optimizer step for the next steps.

    ``compute_s`` and ``overhead_s`` (sync time waited per step) were measured
    at ``current`` micro-batches per step.  More micro-batches per sync when
    the step spends less than ``target - slack`` of its time computing, fewer
    when it spends more than ``target + slack``; the new value is the fewest
    that reach ``target`` (the sync per step stays, compute grows with the
    micro-batches), bounded by [min_accum, max_accum] -- the user's range of
    effective batch sizes.  Returns ``current`` (clamped) when no change is due.
    """
    for name, v in (("current", current), ("max_accum", max_accum), ("min_accum", min_accum)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    if min_accum > max_accum:
        raise ValueError(f"min_accum ({min_accum}) must not exceed max_accum ({max_accum})")
    if not 0 < target < 1:
        raise ValueError(f"target: must be in (0, 1), got {target!r}")
    cur = min(max(current, min_accum), max_accum)
    if not (compute_s > 0) or not math.isfinite(overhead_s):
        return cur
    overhead = max(0.0, overhead_s)
    per_micro = compute_s / current
    eff = compute_s / (compute_s + overhead)
    need = math.ceil(target / (1 - target) * overhead / per_micro - 1e-9) if overhead else 1
    need = min(max(need, min_accum), max_accum)
    if need > cur and eff < target - slack:
        return need
    if need < cur and eff > target + slack:
        return need
    return cur


def prediction_text(p: Prediction) -> str:
    """``NAME S s/step (E% of no-sync)``: one prediction in a log line."""
    return f"{p.strategy} {p.step_s:.3g} s/step ({p.efficiency:.0%} of no-sync)"


def describe(d: Decision, net: Net, compute_s: float, previous: Net | None = None,
             initial: bool = False, samples: bool = True) -> str:
    """One line: what was measured, what was picked and why."""
    if previous is not None and previous.bandwidth_Bps != net.bandwidth_Bps:
        bw = f"bandwidth {fmt_rate(previous.bandwidth_Bps, 'both')} -> {fmt_rate(net.bandwidth_Bps, 'both')}"
    else:
        bw = f"bandwidth {fmt_rate(net.bandwidth_Bps, 'both')}"
    head = (f"{'initial choice: ' if initial else ''}{bw}, alpha {fmt_duration(net.alpha_s)}, "
            f"compute {compute_s:.3g} s/step")
    p = d.prediction
    sps = f", {p.samples_per_s:.3g} samples/s" if samples else ""
    parts = [f"{p.strategy} predicted {p.step_s:.3g} s/step ({p.efficiency:.0%} of no-sync{sps})"]
    if d.current is not None and d.current.strategy != p.strategy:
        parts.append(f"vs {prediction_text(d.current)}")
    others = [q for q in d.ranking if q.strategy not in (p.strategy, getattr(d.current, "strategy",
                                                                             None))][:2]
    if others:
        parts.append("others: " + ", ".join(prediction_text(q) for q in others))
    return f"{head}: {'; '.join(parts)}; {d.rule}"
