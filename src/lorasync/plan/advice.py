"""Advice: the steps an expert would take on a network, in order, each with
its predicted gain (``plan``): TCP tuning, hierarchical sync (several ranks
per node), compression, overlap, periodic sync, RDMA, and on NCCL the
NCCL_ALGO advice where the model predicts a gain (``nccl_advice``).  With
several ranks per node both layouts (flat, hierarchical) are ranked and the
recommendation is the faster of the two.

Pure: a ``Net``, a ``Workload`` and a ``Link`` in, a ``Plan`` (ranking,
recommendation, steps) out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from lorasync import catalog
from lorasync.catalog import NONE, PERIODIC, STRATEGIES
from lorasync.plan.costmodel import MiB, Net, Prediction, Workload, predict
from lorasync.plan.net import RDMA_ALPHA_S, Link
from lorasync.plan.periodic import hide_sync, tune_periodic, with_options
from lorasync.plan.ranking import Measurements, Recommendation, _pct, choose
from lorasync.units import fmt_bytes, fmt_duration, fmt_rate

__all__ = ["BUCKET_MIB_CHOICES", "PERIOD_CHOICES", "TARGET_EFFICIENCY", "MIN_GAIN",
           "Step", "Plan", "plan", "nccl_advice", "layouts_of", "options_text"]

#: DDP bucket sizes the overlap advice tries, in MiB
BUCKET_MIB_CHOICES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0)
#: sync periods the periodic-sync advice tries (smallest reaching TARGET_EFFICIENCY)
PERIOD_CHOICES = (2, 4, 8, 16, 32, 64, 128)
TARGET_EFFICIENCY = 0.95
#: a step worth taking gains at least this much throughput
MIN_GAIN = 0.01


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
    base = with_options(wl, name, **{k: v for k, v in given.items()})
    default_period = catalog.parse_options(name).period
    chosen, why = None, "as given"
    if "period" in given:
        _, q = hide_sync(net, base, name, fixed)
        chosen = q
    else:
        for h in PERIOD_CHOICES:
            _, q = hide_sync(net, with_options(base, name, period=h), name, fixed | {"period"})
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
                wl = with_options(wl, p.strategy, **p.options)
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
