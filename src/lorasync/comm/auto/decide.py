"""auto's decisions at a window's boundary, and what it decides with.

After ``measure_steps`` steps under the start strategy, and then every
``interval`` steps (K), at a boundary inside ``after_step`` (never in a
future callback), :class:`Controller`:

1. takes the window's measurements (reduced over ranks, so every rank holds
   the same numbers) and a figure of the link: the one the window's syncs
   gave, the last one, or a live probe when the policy calls for one
   (:func:`lorasync.plan.policy.probe_plan`: due by its budget, or the time
   beyond compute drifted from the prediction);
2. fits the cost model's corrections on the strategy in use
   (:class:`Calibration`: what it cost beyond its prediction; what running
   collectives inside backward cost, measured against the compute of a
   strategy idle in backward);
3. at the first choice with two layouts, keeps the layout whose best
   candidate is predicted faster; tunes DiLoCo's outer sync to the link;
4. picks with :func:`lorasync.plan.policy.decide` (the planner's rule, with
   hysteresis: a routine switch must win two windows in a row), and
   broadcasts rank 0's pick and layout (8 bytes), so the ranks cannot disagree;
5. switches through the :class:`~lorasync.comm.auto.switch.Switcher` and
   leaves the basis of :meth:`Auto.suggested_accum
   <lorasync.comm.auto.Auto.suggested_accum>`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from lorasync import catalog
from lorasync.catalog import PERIODIC
from lorasync.comm.auto.measure import Links, StepMeter
from lorasync.comm.auto.switch import Switcher, variant_text
from lorasync.plan import policy
from lorasync.plan.costmodel import Net, Prediction, Workload, predict
from lorasync.plan.periodic import tune_periodic
from lorasync.plan.policy import EXPOSED_PRIOR, Decision, Window

__all__ = ["Settings", "Calibration", "Controller"]


@dataclass(frozen=True)
class Settings:
    """What auto chooses among and with, fixed at attach."""

    #: the candidates some layout can run, and per layout the ones it can
    candidates: tuple[str, ...]
    layouts: tuple[str, ...]
    layout_candidates: Mapping[str, tuple[str, ...]]
    #: steps between decisions (0: decide once)
    interval: int
    lossless_margin: float
    switch_margin: float
    #: DiLoCo's outer-sync variants (full options) and the options the user fixed
    variant_options: list
    diloco_fixed: frozenset
    #: the workload: adapter elements, world size, DDP's bucket cap, the
    #: adapter's matrices, samples per step, the output embedding's share
    numel: int
    world_size: int
    bucket_cap_bytes: int
    matrices: Any
    batch_size: int
    head_share: float
    #: log samples/s (the user gave batch_size)
    show_samples: bool
    topology: Any


class Calibration:
    """The cost model as auto corrects it with what it measured.

    What the strategy in use cost beyond its prediction is split into a base
    every strategy pays and the share of the collective time the model hides
    behind backward that was in fact exposed
    (:func:`lorasync.plan.policy.split_extra`); every candidate is then
    predicted with the same two numbers (:meth:`workload`), so none looks
    better merely because it has not run yet.  Compute measured under a
    strategy idle in backward is kept as the quiet reference: backward slower
    than that under a per-step strategy is what its collectives took from it,
    charged to every per-step strategy.
    """

    def __init__(self, settings: Settings, switcher: Switcher, meter: StepMeter,
                 encode_ns: dict[str, float]):
        self.s, self.sw, self.meter = settings, switcher, meter
        #: encode+decode ns per element per sync timed on this device, per
        #: candidate (empty: the catalog's figures)
        self.encode_ns = encode_ns
        self.fit_for: str | None = None       # strategy the corrections were fitted on
        self.last_extra = 0.0
        self.base_s = 0.0
        self.exposed = EXPOSED_PRIOR
        self.fixed_s = 0.0
        self.quiet_s: float | None = None  # compute under a strategy idle in backward
        self.inflation_s = 0.0  # what collectives inside backward add to it
        self.window_syncs = 0   # syncs of the strategy in use before this window

    def split_window(self, w: Window, initial: bool) -> tuple[float, float]:
        """``(compute_s, overhead_s)`` per step of window ``w`` as the cost
        model takes them."""
        if initial and not getattr(self.sw.child, "communicates", True):
            # the start strategy sent nothing (start=local): what the step took
            # beyond compute (end of backward, optimizer step) is the same under
            # every strategy, so it is compute to the cost model, not sync
            self.fixed_s = w.overhead_s
        return w.compute_s + self.fixed_s, max(0.0, w.overhead_s - self.fixed_s)

    def fit(self, comp: float, over: float, step_s: float, net: Net, probed: bool) -> float:
        """Fit the corrections on the strategy in use (``net``: the link in
        its layout); returns the compute the cost model is given (less what
        collectives inside backward cost)."""
        child = self.sw.child
        if not getattr(child, "communicates", True):
            self.quiet_s = comp   # nothing ran inside backward: every strategy's compute
        elif self.quiet_s is not None:
            # backward slower than with nothing in it: what running
            # collectives inside backward costs here (CPU taken from it), a
            # cost of every per-step strategy, not of local/diloco
            self.inflation_s = policy.inflation(comp, self.quiet_s)
            comp -= self.inflation_s
        # what the strategy in use cost beyond the model -- unless it is a
        # periodic one that has not synced in this window (then it cost
        # nothing yet, which says nothing about its sync)
        syncs = child.stats()["syncs"]
        if not (child.spec.periodic and syncs == self.window_syncs):
            p = predict(child.name, net, self.workload(comp))
            x = over - (p.step_s - p.compute_s)
            if self.fit_for == child.name and not probed:
                x = 0.5 * (self.last_extra + x)
            self.last_extra, self.fit_for = x, child.name
            self.base_s, self.exposed = policy.split_extra(x, policy.hidden_of(p), step_s,
                                                           self.base_s, self.exposed)
        self.window_syncs = syncs
        return comp

    def workload(self, compute_s: float, net: Net | None = None) -> Workload:
        """The workload with per-strategy corrections (``net`` given) or without."""
        names = sorted(set(self.s.candidates) | {self.sw.child.name})
        kw = dict(bucket_sizes=self.meter.bucket_sizes, bucket_cap_bytes=self.s.bucket_cap_bytes,
                  matrices=self.s.matrices,
                  options={c: self.sw.candidate_options.get(c, {}) for c in names},
                  batch_size=self.s.batch_size, head_share=self.s.head_share,
                  encode_base=self.encode_ns)
        plain = policy.workload_for(self.s.numel, compute_s, **kw)
        if net is None:
            return plain
        hidden = {n: policy.hidden_of(predict(n, net, plain)) for n in names}
        extra = policy.corrections(names, hidden, self.base_s, self.exposed)
        for n in names:
            if n not in PERIODIC:
                extra[n] += self.inflation_s
        return policy.workload_for(self.s.numel, compute_s, **kw, extra_s=extra)


class Controller:
    """auto's decisions (module docstring) and the state they are made with:
    the link figure in use, the cost model's corrections (:class:`Calibration`),
    the probe and decision schedule and the basis of the grad-accumulation
    advice.  Its attributes are what ``Auto.state_dict`` saves.

    ``wire``, ``device``, ``add_comm``: auto's own collectives (the window's
    reduction, the broadcast of the pick) and their time; ``switch(to,
    options, reason)`` switches auto; ``log`` prints on rank 0.
    """

    def __init__(self, settings: Settings, switcher: Switcher, links: Links, meter: StepMeter,
                 *, encode_ns: dict[str, float], variant_ns: list, wire, device: torch.device,
                 switch: Callable[[str, Mapping[str, Any], str], None],
                 add_comm: Callable[[float], None], log: Callable[[str], None]):
        self.s = settings
        self.sw, self.links, self.meter = switcher, links, meter
        #: encode+decode ns per element per sync of each DiLoCo variant timed
        #: on this device (None: the catalog's figure)
        self.variant_ns = variant_ns
        self._wire, self._device = wire, device
        self._switch, self._add_comm, self._log = switch, add_comm, log
        # the schedule
        self.measuring = False       # under the start strategy, before the first choice
        self.next_eval = 0           # step of the next decision (0: none)
        self.next_probe = 0          # step of the next untriggered probe
        self.deferred = 0            # decisions moved a step behind a streamed sync
        self.pending_pick: str | None = None  # a routine switch waits for a second window
        #: the link figure in use
        self.net: Net | None = None
        #: the cost model's corrections
        self.cal = Calibration(settings, switcher, meter, encode_ns)
        #: (step, compute_s, overhead_s) of the last decision
        self.accum_basis: tuple[int, float, float] | None = None

    def after_switch(self, syncs: int) -> None:
        """The strategy in use changed (it has counted ``syncs`` so far)."""
        self.cal.window_syncs = syncs
        self.measuring = False
        self.pending_pick = None

    # -- the boundary -------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """At the end of ``after_step``: decide when a window is due."""
        if not self.next_eval or step < self.next_eval:
            return
        child = self.sw.child
        if policy.defer_decision(child.in_flight, self.deferred,
                                 int(getattr(child.options, "period", 1))):
            # decide one step later (identical on every rank: the launch and
            # apply steps are)
            self.deferred += 1
            self.next_eval = step + 1
            return
        self.deferred = 0
        initial = self.measuring
        interval = self.s.interval
        self.next_eval = step + interval if interval else 0
        net = self.net or self.links.start
        w = self.meter.window(self._wire, self._device, net.alpha_s if net is not None else 0.0,
                              self._add_comm)
        if w is None:   # nothing measured yet (e.g. measure_steps=1): next step
            self.next_eval = step + 1 if initial or not interval else self.next_eval
            return
        self.evaluate(w, initial, step)

    def evaluate(self, w: Window, initial: bool, step: int) -> None:
        """Decide on window ``w`` (``initial``: the first choice) and act."""
        cur = self.sw.child.name
        comp, over = self.cal.split_window(w, initial)
        step_s = comp + over
        prev = self.net
        net, probed, passive = self._link(w, initial, step, comp, over, step_s)
        net, changed = self._confirm_change(prev, net, probed, passive, step_s)
        self.net = net
        comp = self.cal.fit(comp, over, step_s, self.links.in_layout(net, self.sw.child.layout),
                            probed)
        fresh = initial or changed
        layout = self.sw.layout
        if initial and len(self.s.layouts) > 1:
            layout = self._best_layout(comp, net)
        net = self.net = self.links.in_layout(net, layout)
        self._tune_diloco(comp, net, fresh)
        wl = self.cal.workload(comp, net)
        d = policy.decide(net, wl, None if initial or layout != self.sw.child.layout else cur,
                          self.s.layout_candidates[layout],
                          lossless_margin=self.s.lossless_margin,
                          switch_margin=self.s.switch_margin, fresh=fresh)
        pick = self._hold(d, cur, fresh, initial, step)
        pick, layout, net = self._agree(pick, layout, net)
        self.sw.layout = layout
        reason = policy.describe(d, net, comp, previous=prev if (probed or passive) else None,
                                 initial=initial, samples=self.s.show_samples)
        if passive:
            reason = "link measured from the syncs: " + reason
        self._act(d, pick, layout, net, wl, comp, over, reason, initial, step)

    # -- the link -------------------------------------------------------------------
    def _link(self, w: Window, initial: bool, step: int, comp: float, over: float,
              step_s: float) -> tuple[Net, bool, bool]:
        """The link this decision uses: ``(net, probed, passive)`` -- the
        window's syncs measured it (passive), a probe did, or the last figure
        (:func:`lorasync.plan.policy.probe_plan` decides which)."""
        if self.s.world_size < 2:
            return Net(alpha_s=0.0, bandwidth_Bps=1e12, world_size=1), False, False
        child = self.sw.child
        pp = policy.probe_plan(
            step, self.net or self.links.start, link_Bps=w.link_Bps,
            next_probe=self.next_probe, interval=self.s.interval, step_s=step_s,
            initial=initial, start_probed=self.links.start is not None,
            in_flight=child.in_flight,
            overheads=(over, max(0.0, w.recent_overhead_s - self.cal.fixed_s)),
            calibrated=self.cal.fit_for == child.name,
            in_use=lambda net: self._predict_in_use(net, comp))
        if not pp.probe_bytes:
            self.next_probe = pp.next_probe
            return pp.net, False, pp.passive
        net, spent = self.links.live(pp.probe_bytes, self.sw.layout)
        self.next_probe = pp.next_after(spent)
        return net, True, pp.passive

    def _predict_in_use(self, net: Net, comp: float) -> Prediction:
        """The strategy in use's prediction on ``net`` (in its layout), with
        the corrections fitted so far."""
        child = self.sw.child
        cnet = self.links.in_layout(net, child.layout)
        return predict(child.name, cnet, self.cal.workload(comp, cnet))

    def _confirm_change(self, prev: Net | None, net: Net, probed: bool, passive: bool,
                        step_s: float) -> tuple[Net, bool]:
        """``(net, changed)``: whether the new figure describes another link.
        One rank descheduled during the probe reads as a slow link: a change
        must show in a second probe too (the faster one counts); a passive
        figure is already the fastest of the window's syncs."""
        if not (probed or passive) or prev is None:
            return net, False
        changed = policy.link_changed(prev, net, self.s.numel, step_s)
        if changed and probed:
            again, _ = self.links.live(policy.probe_size(net.bandwidth_Bps, net.alpha_s,
                                                         net.world_size), self.sw.layout)
            if again.bandwidth_Bps > net.bandwidth_Bps:
                net = again
            changed = policy.link_changed(prev, net, self.s.numel, step_s)
        return net, changed

    # -- the choice -------------------------------------------------------------------
    def _best_layout(self, comp: float, net: Net) -> str:
        """Flat or hierarchical: the layout whose best candidate is faster."""
        best = None
        for lay in self.s.layouts:
            lnet = self.links.in_layout(net, lay)
            dd = policy.decide(lnet, self.cal.workload(comp, lnet), None,
                               self.s.layout_candidates[lay],
                               lossless_margin=self.s.lossless_margin,
                               switch_margin=self.s.switch_margin, fresh=True)
            if best is None or dd.prediction.samples_per_s > best[1].prediction.samples_per_s:
                best = (lay, dd)
        return best[0]

    def _tune_diloco(self, comp: float, net: Net, fresh: bool) -> None:
        """DiLoCo's outer sync for this link: the variant, delay and fragment
        count the planner predicts fastest (hiding the sync where the link
        allows).  While DiLoCo runs, its options change only when the new ones
        are predicted ``switch_margin`` faster, or the link changed."""
        if "diloco" not in self.s.candidates or self.s.world_size < 2:
            return
        wl = self.cal.workload(comp, net)
        cur = dict(self.sw.candidate_options.get("diloco", {}))
        # the corrections fitted for the variant in use apply to every variant
        raw = self.cal.encode_ns.get("diloco")
        adj = wl.encode_ns.get("diloco", 0.0) - raw if raw is not None else 0.0
        ns = [None if x is None else max(0.0, x + adj) for x in self.variant_ns]
        opts, pred, i = tune_periodic(net, wl, "diloco", self.s.variant_options,
                                      fixed=self.s.diloco_fixed,
                                      encode_ns=ns if any(x is not None for x in ns) else None)
        if opts == catalog.parse_options("diloco", cur).as_dict():
            return
        if self.sw.child.name == "diloco" and not fresh:
            now = predict("diloco", net, wl)
            if pred.samples_per_s <= (1 + self.s.switch_margin) * now.samples_per_s:
                return   # the options in use are about as good: no change for noise
        self.sw.candidate_options["diloco"] = opts
        if self.variant_ns[i] is not None:
            self.cal.encode_ns["diloco"] = self.variant_ns[i]

    def _hold(self, d: Decision, cur: str, fresh: bool, initial: bool, step: int) -> str:
        """The pick, or the strategy in use while a routine switch waits for
        the next window to agree."""
        pick = d.strategy if (d.switch or initial) else cur
        if policy.wait_for_confirmation(d.switch, fresh, self.pending_pick, pick):
            self.pending_pick, pick = pick, cur
            now = (policy.prediction_text(d.current) if d.current is not None
                   else f"{cur}, not predicted")
            self._log(f"auto: step {step}: {d.strategy} looks better than {cur} "
                      f"({policy.prediction_text(d.prediction)} vs {now}); "
                      f"switching if the next window agrees")
        else:
            self.pending_pick = None
        return pick

    def _agree(self, pick: str, layout: str, net: Net) -> tuple[str, str, Net]:
        """Rank 0's pick and layout are everybody's (the inputs are identical;
        this makes sure)."""
        layouts = self.s.layouts
        cands = self.s.layout_candidates[layout]
        t = torch.tensor([cands.index(pick) if pick in cands else -1, layouts.index(layout)],
                         dtype=torch.int32, device=self._device)
        t0 = time.perf_counter()
        self._wire.broadcast(t, 0)
        self._add_comm(time.perf_counter() - t0)
        if layouts[int(t[1])] != layout:
            layout = layouts[int(t[1])]
            cands = self.s.layout_candidates[layout]
            net = self.net = self.links.in_layout(net, layout)
        idx = int(t[0])
        if idx >= 0 and cands[idx] != pick:
            pick = cands[idx]
        return pick, layout, net

    def _act(self, d: Decision, pick: str, layout: str, net: Net, wl: Workload, comp: float,
             over: float, reason: str, initial: bool, step: int) -> None:
        """Switch to ``pick`` (or keep the strategy in use) and leave the
        basis of the grad-accumulation advice."""
        child = self.sw.child
        if pick == "diloco":
            reason += f"; outer sync {variant_text(self.sw.candidate_options.get('diloco', {}))}"
        if len(self.s.layouts) > 1 and initial:
            reason += f"; layout {layout} ({self.s.topology.describe()})"
        overhead = over
        opts = self.sw.candidate_options.get(pick, {})
        if pick != child.name or opts != self.sw.options or layout != child.layout:
            self._switch(pick, opts, reason)
            np_ = d.prediction if d.strategy == pick else predict(pick, net, wl)
            overhead = np_.step_s - np_.compute_s
        elif initial:
            self.measuring = False
            self._log(f"auto: step {step}: keep {child.name}: {reason}")
        self.accum_basis = (step, comp, overhead)
