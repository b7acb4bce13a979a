"""``--comm auto``: measure the network, pick a sync strategy, re-plan while training.

:class:`Auto` is the strategy (:mod:`.sync`); it measures (:mod:`.measure`),
decides (:mod:`.decide`, with the pure policy of
:mod:`lorasync.plan.policy`), switches (:mod:`.switch`) and checkpoints
(:mod:`.state`).  Its options are the catalog's ``AutoOptions``.
"""

from lorasync.comm.auto.measure import module_head_share
from lorasync.comm.auto.sync import Auto

__all__ = ["Auto", "module_head_share"]
