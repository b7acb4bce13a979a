"""What auto's checkpoint holds (``Auto.state_dict()``) and how it loads.

Per rank: the strategy in use (name, options, layout, its own state_dict),
every candidate's options (DiLoCo's are tuned while training), the schedule,
the link figure and the fitted corrections, the switch history and the
residual carried over a switch that was not yet sent.  A resume therefore
continues with the same strategy and the same decisions; the measurements of
the window under way are not kept (the first step after a resume is not
measured anyway).  Every key but ``child`` and ``child_state`` is read with
a default, so a checkpoint written before a key existed still loads.
"""

from __future__ import annotations

from typing import Any

from lorasync.catalog import STRATEGIES
from lorasync.comm.auto.decide import Controller
from lorasync.comm.auto.measure import Links
from lorasync.comm.auto.switch import Switcher
from lorasync.plan.costmodel import Net
from lorasync.plan.policy import EXPOSED_PRIOR

__all__ = ["save_state", "load_state"]


def save_state(base: dict[str, Any], sw: Switcher, ctl: Controller, links: Links) -> dict[str, Any]:
    """``base`` (what every strategy saves) with auto's own keys."""
    net = ctl.net
    return {
        **base,
        "child": sw.child.name, "child_options": dict(sw.options),
        "candidate_options": {k: dict(v) for k, v in sw.candidate_options.items()},
        "window_syncs": ctl.cal.window_syncs,
        "layout": sw.child.layout,
        "intra": list(links.intra) if links.intra else None,
        "child_state": sw.child.state_dict(), "measuring": ctl.measuring,
        "next_eval": ctl.next_eval, "next_probe": ctl.next_probe,
        "net": None if net is None else [net.alpha_s, net.bandwidth_Bps],
        "fit_for": ctl.cal.fit_for, "last_extra": ctl.cal.last_extra,
        "pending_pick": ctl.pending_pick, "fixed_s": ctl.cal.fixed_s, "base_s": ctl.cal.base_s,
        "quiet_s": ctl.cal.quiet_s, "inflation_s": ctl.cal.inflation_s,
        "exposed": ctl.cal.exposed, "switches": sw.switches,
        "last_switch": dict(sw.last) if sw.last else None,
        "carry": sw.carry.saved(),
        "carry_left": sorted(sw.carry.left), "may_differ": sw.may_differ,
        "accum_basis": ctl.accum_basis,
    }


def load_state(state: dict[str, Any], sw: Switcher, ctl: Controller, links: Links,
         world_size: int) -> None:
    """Auto's keys of ``state`` into the strategy in use, the controller and
    the links (the base keys are the caller's); ValueError for a strategy or
    a layout this run cannot take."""
    name, opts = state["child"], dict(state.get("child_options") or {})
    if name not in STRATEGIES:
        raise ValueError(f"state_dict: auto saved strategy {name!r}, which it cannot run")
    layout = state.get("layout", "flat")
    layouts = ctl.s.layouts
    if layout not in layouts:
        raise ValueError(f"state_dict: auto ran {name} {layout}, which this run's topology "
                         f"and hierarchy option do not allow ({'/'.join(layouts)})")
    sw.layout = layout
    if state.get("intra"):
        links.intra = tuple(float(x) for x in state["intra"])
    if name != sw.child.name or opts != sw.options or layout != sw.child.layout:
        sw.child = sw.build(name, opts)
        sw.options = opts
    sw.child.load_state_dict(state["child_state"])
    for k, v in (state.get("candidate_options") or {}).items():
        if k in sw.candidate_options or k in STRATEGIES:
            sw.candidate_options[k] = dict(v)
    _load_controller(state, ctl, links, world_size, layout)
    sw.switches = int(state.get("switches", 0))
    sw.last = state.get("last_switch")
    sw.carry.load(state.get("carry"), state.get("carry_left"))
    sw.may_differ = bool(state.get("may_differ", False))


def _load_controller(state: dict[str, Any], ctl: Controller, links: Links, world_size: int,
                     layout: str) -> None:
    cal = ctl.cal
    cal.window_syncs = int(state.get("window_syncs", 0))
    ctl.measuring = bool(state.get("measuring", False))
    ctl.next_eval = int(state.get("next_eval", 0))
    ctl.next_probe = int(state.get("next_probe", 0))
    net = state.get("net")
    if net is not None:
        ctl.net = links.with_topology(Net(alpha_s=float(net[0]), bandwidth_Bps=float(net[1]),
                                          world_size=world_size), layout)
    cal.fit_for = state.get("fit_for")
    cal.last_extra = float(state.get("last_extra", 0.0))
    ctl.pending_pick = state.get("pending_pick")
    cal.fixed_s = float(state.get("fixed_s", 0.0))
    quiet = state.get("quiet_s")
    cal.quiet_s = None if quiet is None else float(quiet)
    cal.inflation_s = float(state.get("inflation_s", 0.0))
    cal.base_s = float(state.get("base_s", 0.0))
    cal.exposed = float(state.get("exposed", EXPOSED_PRIOR))
    basis = state.get("accum_basis")
    ctl.accum_basis = tuple(basis) if basis else None
