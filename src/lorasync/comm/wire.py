"""The one way a strategy hands tensors to ``torch.distributed``.

Every collective of a strategy goes through its :class:`Wire`, which counts
the payload bytes of what it hands over (docs/contracts.md "Wire bytes": the
tensor sent, at its dtype, not the ring traffic) before it calls
``torch.distributed``.  A new strategy therefore cannot forget to count, and
``tests/unit/test_strategy_devices.py`` checks that no module of
``lorasync.comm`` but this one calls a collective directly.

:class:`LoopbackWire` is the same interface without a network: it completes
every collective at once, as if every rank had sent what this one sent.  It
lets a strategy's hooks run alone, to time their encode+decode on the live
device (:mod:`lorasync.comm.loopback`).

torch's own hooks (the bench's baselines) call ``torch.distributed`` from
inside torch; :func:`count_group` measures what they hand over by counting
the ``all_reduce`` calls that name a given process group.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Wire", "LoopbackWire", "count_group"]


#: torch 2.13 renamed all_gather_into_tensor (the old name warns); older releases lack the new one
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Wire:
    """Collectives of one process group, counted by ``count(nbytes)``.

    Each method takes ``count=False`` for the few calls that are not sync
    traffic (attach-time checks of what the backend can do); ``async_op``
    returns torch's ``Work``.  ``broadcast``'s ``src`` is a rank of the group.
    """

    __slots__ = ("group", "size", "rank", "backend", "_count")

    def __init__(self, group: dist.ProcessGroup | None, count: Callable[[int], None]):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self._count = count

    def all_reduce(self, t: torch.Tensor, *, op=dist.ReduceOp.SUM, async_op: bool = False,
                   count: bool = True):
        if count:
            self._count(_nbytes(t))
        return dist.all_reduce(t, op=op, group=self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, *, async_op: bool = False,
                   count: bool = True):
        """``out`` holds every rank's ``t``, in rank order (``size`` x ``t``)."""
        if count:
            self._count(_nbytes(t))
        return _all_gather(out, t, group=self.group, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, *, async_op: bool = False,
                   count: bool = True):
        """Chunk j of ``t`` goes to rank j; chunk j of ``out`` comes from rank j."""
        if count:
            self._count(_nbytes(t))
        return dist.all_to_all_single(out, t, group=self.group, async_op=async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0, *, async_op: bool = False,
                  count: bool = True):
        if count:
            self._count(_nbytes(t))
        root = dist.get_global_rank(self.group, src) if self.group is not None else src
        return dist.broadcast(t, src=root, group=self.group, async_op=async_op)


class _Done:
    """A finished collective: what ``Work`` offers the strategies."""

    __slots__ = ("_t",)

    def __init__(self, t: torch.Tensor):
        self._t = t

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([self._t])
        return fut


class LoopbackWire:
    """A :class:`Wire` of ``size`` ranks that sends nothing: every rank is
    taken to have sent what this rank sent (a sum over ranks is left as it is,
    an all-gather repeats the tensor).  Counts like :class:`Wire`."""

    __slots__ = ("group", "size", "rank", "backend", "_count")

    def __init__(self, size: int, rank: int = 0, count: Callable[[int], None] = lambda n: None):
        self.group = None
        self.backend = "loopback"
        self.size, self.rank, self._count = int(size), int(rank), count

    def _done(self, t: torch.Tensor, async_op: bool, count: bool):
        if count:
            self._count(_nbytes(t))
        return _Done(t) if async_op else None

    def all_reduce(self, t, *, op=dist.ReduceOp.SUM, async_op=False, count=True):
        return self._done(t, async_op, count)

    def all_gather(self, out, t, *, async_op=False, count=True):
        out.view(self.size, -1).copy_(t.reshape(1, -1))
        return self._done(t, async_op, count)

    def all_to_all(self, out, t, *, async_op=False, count=True):
        out.copy_(t)
        return self._done(t, async_op, count)

    def broadcast(self, t, src=0, *, async_op=False, count=True):
        return self._done(t, async_op, count)


# -- counting torch's own hooks ----------------------------------------------------
_counters: dict[int, Callable[[int], None]] = {}
_lock = threading.Lock()
_original_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    count = _counters.get(id(group)) if group is not None else None
    if count is not None:
        count(_nbytes(tensor))
    return _original_all_reduce(tensor, op=op, group=group, async_op=async_op)


def count_group(group: dist.ProcessGroup, count: Callable[[int], None] | None) -> None:
    """Count the bytes of every ``torch.distributed.all_reduce`` that names
    ``group`` (``count=None``: stop).  For torch's DDP comm hooks, which issue
    their collectives themselves (PowerSGD's second one from a future
    callback); give them a group of their own so that nothing else is counted.
    ``torch.distributed.all_reduce`` is wrapped only while some group is counted."""
    with _lock:
        if count is None:
            _counters.pop(id(group), None)
        else:
            _counters[id(group)] = count
        dist.all_reduce = (functools.wraps(_original_all_reduce)(_counting_all_reduce)
                           if _counters else _original_all_reduce)
