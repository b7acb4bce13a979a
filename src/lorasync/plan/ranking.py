"""Rank the sync strategies for one network and workload, and pick one.

* ``rank(net, workload)``: every strategy's ``Prediction``, fastest first.
* ``choose(Measurements) -> Recommendation``: the seam for ``auto``
  (:mod:`lorasync.plan.policy` decides with it, :mod:`lorasync.comm.auto`
  runs the decisions), every K steps with fresh link and compute
  measurements.  The rule: the best predicted throughput, but a
  lossless strategy when one is within ``lossless_margin`` (5%) of the best,
  and fp32 all-reduce when it is within ``exact_margin`` (1%) of that; with
  ``current`` set, keep the strategy in use unless the pick beats it by more
  than ``switch_margin`` (no flapping on noisy measurements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from lorasync.catalog import STRATEGIES
from lorasync.errors import ConfigError
from lorasync.plan.costmodel import Net, Prediction, Workload, predict

__all__ = ["Measurements", "Recommendation", "rank", "choose"]


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
