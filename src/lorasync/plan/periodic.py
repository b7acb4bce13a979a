"""Periodic tuning: the streaming delay and fragment count that hide a
periodic strategy's outer sync behind compute, from its predicted sync time
(the fewest steps late first, then the fewest fragments; ``hide_sync``), and
the best of several outer-sync variants (codecs) so tuned
(``tune_periodic``).  ``auto`` and the plan's periodic-sync step both use them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from lorasync import catalog
from lorasync.catalog import PERIODIC
from lorasync.errors import ConfigError
from lorasync.plan.costmodel import Net, Prediction, Workload, adapter_shapes, predict

__all__ = ["FRAGMENT_CHOICES", "HIDDEN_SHARE", "HIDE_MARGIN", "VARIANT_TIE", "with_options",
           "hide_sync", "margin_net", "tune_periodic"]

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


def with_options(workload: Workload, strategy: str, **opts) -> Workload:
    """``workload`` with ``opts`` over ``strategy``'s options."""
    merged = {k: dict(v) for k, v in workload.options.items()}
    merged.setdefault(strategy, {}).update(opts)
    if not merged[strategy].get("streaming", True):
        merged[strategy].pop("delay", None)   # a delay without streaming is refused
    return dataclasses.replace(workload, options=merged)


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
            wl = with_options(workload, strategy, **o)
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
        m = predict(strategy, slower, with_options(wl, strategy, **opts))
        tried.append((opts, p, i, m.samples_per_s))
    fastest = max(t[3] for t in tried)
    return next(t[:3] for t in tried if t[3] >= (1 - VARIANT_TIE) * fastest)

