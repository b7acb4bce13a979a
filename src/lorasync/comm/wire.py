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

The wire also times what it carries, so that the link can be measured from
the syncs a strategy makes anyway instead of by extra probe traffic
(``auto`` on slow links, where a probe costs seconds): every collective
issued while no other collective of this wire was in flight is kept as a
:class:`Transfer` (kind, payload bytes, seconds from issue to completion,
taken in a completion callback for asynchronous ones) until
:meth:`Wire.take_transfers` collects them.  The time includes waiting for
the other ranks to arrive; the rank that arrived last measured the
transfer itself, which is why ``auto`` takes the fastest rank's figure.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Wire", "LoopbackWire", "Transfer", "count_group"]


#: torch 2.13 renamed all_gather_into_tensor (the old name warns); older releases lack the new one
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Transfer(NamedTuple):
    """One collective that had the wire to itself: what it carried and how long it took."""

    kind: str          # all_reduce | all_gather | all_to_all | broadcast
    payload_bytes: int
    seconds: float
    #: perf_counter at completion
    end: float


#: transfers kept until collected (a window of steps has a few)
_KEEP = 64


class Wire:
    """Collectives of one process group, counted by ``count(nbytes)``.

    Each method takes ``count=False`` for the few calls that are not sync
    traffic (attach-time checks of what the backend can do); ``async_op``
    returns torch's ``Work``.  ``broadcast``'s ``src`` is a rank of the group.
    Counted collectives that found the wire idle are timed (module docstring).
    """

    __slots__ = ("group", "size", "rank", "backend", "_count", "_busy", "_lock", "_transfers")

    def __init__(self, group: dist.ProcessGroup | None, count: Callable[[int], None]):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self._count = count
        self._busy = 0
        self._lock = threading.Lock()
        self._transfers: collections.deque[Transfer] = collections.deque(maxlen=_KEEP)

    def take_transfers(self) -> list[Transfer]:
        """The timed transfers since the last call (oldest first)."""
        with self._lock:
            out = list(self._transfers)
            self._transfers.clear()
        return out

    def _run(self, kind: str, t: torch.Tensor, count: bool, async_op: bool, call):
        if not count:
            return call()
        nbytes = _nbytes(t)
        self._count(nbytes)
        with self._lock:
            idle = self._busy == 0
            self._busy += 1
        t0 = time.perf_counter()
        try:
            work = call()
        except BaseException:
            with self._lock:
                self._busy -= 1
            raise
        if not async_op:
            self._done(kind, nbytes, t0, idle)
            return work
        work.get_future().then(lambda _f: self._done(kind, nbytes, t0, idle))
        return work

    def _done(self, kind: str, nbytes: int, t0: float, idle: bool) -> None:
        t1 = time.perf_counter()
        with self._lock:
            self._busy -= 1
            if idle:
                self._transfers.append(Transfer(kind, nbytes, t1 - t0, t1))

    def all_reduce(self, t: torch.Tensor, *, op=dist.ReduceOp.SUM, async_op: bool = False,
                   count: bool = True):
        return self._run("all_reduce", t, count, async_op, lambda: dist.all_reduce(
            t, op=op, group=self.group, async_op=async_op))

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, *, async_op: bool = False,
                   count: bool = True):
        """``out`` holds every rank's ``t``, in rank order (``size`` x ``t``)."""
        return self._run("all_gather", t, count, async_op, lambda: _all_gather(
            out, t, group=self.group, async_op=async_op))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, *, async_op: bool = False,
                   count: bool = True):
        """Chunk j of ``t`` goes to rank j; chunk j of ``out`` comes from rank j."""
        return self._run("all_to_all", t, count, async_op, lambda: dist.all_to_all_single(
            out, t, group=self.group, async_op=async_op))

    def broadcast(self, t: torch.Tensor, src: int = 0, *, async_op: bool = False,
                  count: bool = True):
        root = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._run("broadcast", t, count, async_op, lambda: dist.broadcast(
            t, src=root, group=self.group, async_op=async_op))


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

    def take_transfers(self) -> list[Transfer]:
        return []   # nothing travels: nothing to time

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
