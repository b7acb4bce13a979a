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

The all-reduce algorithm is chosen per message (``Wire(..., algo=)``): the
backend's own collective (``ring``: gloo's ring, or whatever NCCL picks), or
lorasync's recursive doubling built from point-to-point sends
(:func:`recursive_doubling`; log2 n exchanges of the whole message, two
more when n is not a power of two, instead of the ring's 2(n-1) steps of
1/n of it, so it wins where latency binds).  gloo cannot be told to use
another algorithm; on NCCL the backend's own stays (``lorasync plan`` and
``doctor`` advise NCCL_ALGO instead).
Point-to-point algorithms of one process group run on one FIFO worker thread
per group, fed in the order the hook thread (or ``after_step``) issues them:
the same order on every rank, as for every other collective.
"""

from __future__ import annotations

import collections
import functools
import itertools
import queue
import threading
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Wire", "ShardedWire", "LoopbackWire", "Transfer", "count_group", "recursive_doubling",
           "ALGOS"]

#: all-reduce algorithms a Wire can run: the backend's own, or lorasync's own
ALGOS = ("ring", "recursive_doubling")


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

    __slots__ = ("group", "size", "rank", "backend", "_count", "_busy", "_lock", "_transfers",
                 "_choose", "algo_counts")

    def __init__(self, group: dist.ProcessGroup | None, count: Callable[[int], None],
                 algo: str | Callable[[int], str] | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self._count = count
        self._busy = 0
        self._lock = threading.Lock()
        self._transfers: collections.deque[Transfer] = collections.deque(maxlen=_KEEP)
        #: all-reduces per algorithm since construction (counted ones only)
        self.algo_counts = dict.fromkeys(ALGOS, 0)
        self.set_algo(algo)

    def take_transfers(self) -> list[Transfer]:
        """The timed transfers since the last call (oldest first)."""
        with self._lock:
            out = list(self._transfers)
            self._transfers.clear()
        return out

    def _run(self, kind: str, t: torch.Tensor, count: bool, async_op: bool, call,
             timed: bool = True):
        """Issue ``call`` counted and, when ``timed`` and the wire is idle, timed
        (``timed=False``: an algorithm the cost model's path terms do not
        describe as ``kind``, which a bandwidth read from it would misprice)."""
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
        idle = idle and timed
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

    def set_algo(self, algo: str | Callable[[int], str] | None) -> None:
        """The all-reduce algorithm: ``ring`` (None: the backend's own),
        ``recursive_doubling``, or a function of the payload bytes returning
        one of them (the cost model's choice per message).  Only gloo runs
        lorasync's own algorithms; on another backend the backend's stays."""
        if isinstance(algo, str) and algo not in ALGOS:
            raise ValueError(f"allreduce_algo: unknown {algo!r}; use one of {', '.join(ALGOS)}")
        if algo is None or self.backend != "gloo" or self.size < 2:
            algo = "ring"
        self._choose = (lambda nbytes, a=algo: a) if isinstance(algo, str) else algo

    def algo_for(self, t: torch.Tensor) -> str:
        """The algorithm an all-reduce of ``t`` runs with."""
        if t.device.type != "cpu":
            return "ring"
        return self._choose(_nbytes(t))

    def all_reduce(self, t: torch.Tensor, *, op=dist.ReduceOp.SUM, async_op: bool = False,
                   count: bool = True, algo: str | None = None):
        """``algo`` forces an algorithm for this call (probes time the ring)."""
        algo = algo or self.algo_for(t)
        if algo != "ring" and (self.backend != "gloo" or self.size < 2
                               or t.device.type != "cpu"):
            algo = "ring"
        if count:
            self.algo_counts[algo] += 1
        if algo == "ring":
            return self._run("all_reduce", t, count, async_op, lambda: dist.all_reduce(
                t, op=op, group=self.group, async_op=async_op))

        def call():
            work = _runner(self.group).submit(
                lambda: recursive_doubling(t, op=op, group=self.group))
            if async_op:
                return work
            work.wait()
            return None

        return self._run("all_reduce", t, count, async_op, call, timed=False)

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

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order: set-up only (the
        topology's keys), never sync traffic, so not counted."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


class ShardedWire:
    """Collectives across nodes of a tensor that every rank of a node holds
    alike, carried by all of the node's ranks at once.

    ``cross`` is a Wire on this rank's cross-node group (local rank j of every
    node, :meth:`~lorasync.comm.topology.Topology.build_groups` ``shards``),
    ``local`` one on its node's group.  Local rank j hands chunk j (1/G of
    the tensor, the last chunks zero-padded to equal length) to ``cross``,
    so a node's G ranks carry the message over G connections at once instead
    of its leader carrying all of it; the node's ranks then all-gather the
    chunks over ``local`` (the fast link).  What a strategy sees is a Wire of
    the N nodes (``size``, ``rank``: the cross-node group's), and the result
    is what one rank per node would have got from ``cross`` with the whole
    tensor: a sum over nodes for ``all_reduce``, every node's tensor in node
    order for ``all_gather``.

    The input must be the same on every rank of the node (a periodic
    strategy's outer sync in the hierarchical layout: the node's ranks take
    the same steps); nothing here checks it.  ``async_op`` returns a Work
    whose ``wait()`` finishes the cross-node part and then runs the gather
    inside the node: every rank of the node must wait on its Works in the
    same order, as it issues any other collective of the node's group.
    Bytes count as each wire counts them: ``cross`` its chunk (the node's
    ranks together hand over the whole tensor, as a leader would), ``local``
    the gather.
    """

    __slots__ = ("cross", "local")

    def __init__(self, cross: Wire, local: Wire):
        self.cross, self.local = cross, local

    size = property(lambda self: self.cross.size)
    rank = property(lambda self: self.cross.rank)
    backend = property(lambda self: self.cross.backend)
    algo_counts = property(lambda self: self.cross.algo_counts)

    def take_transfers(self) -> list[Transfer]:
        return self.cross.take_transfers()

    def set_algo(self, algo: str | Callable[[int], str] | None) -> None:
        """The cross-node all-reduce's algorithm, chosen on the chunk's bytes."""
        self.cross.set_algo(algo)

    def algo_for(self, t: torch.Tensor) -> str:
        flat = t.reshape(-1)
        return self.cross.algo_for(flat[:self._chunk_len(flat)])

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.cross.all_gather_object(obj)

    def _chunk_len(self, flat: torch.Tensor) -> int:
        """Elements per rank's chunk: 1/G of ``flat``, rounded up."""
        return -(-flat.numel() // self.local.size)

    def _chunk(self, flat: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's chunk of ``flat`` (a copy, zero-padded) and the chunk length."""
        j, c = self.local.rank, self._chunk_len(flat)
        part = flat[j * c:(j + 1) * c]
        if part.numel() == c:
            return part.clone(), c
        out = torch.zeros(c, dtype=flat.dtype, device=flat.device)
        out[:part.numel()] = part
        return out, c

    @staticmethod
    def _finish(work, done: Callable[[], None], async_op: bool):
        """The in-node part now (after the cross-node ``work``), or a Work for it."""
        deferred = _Deferred(work, done)
        if async_op:
            return deferred
        deferred.wait()
        return None

    def all_reduce(self, t: torch.Tensor, *, op=dist.ReduceOp.SUM, async_op: bool = False,
                   count: bool = True, algo: str | None = None):
        if not t.is_contiguous():
            raise ValueError("ShardedWire.all_reduce: needs a contiguous tensor")
        flat = t.view(-1)
        chunk, c = self._chunk(flat)
        work = self.cross.all_reduce(chunk, op=op, async_op=True, count=count, algo=algo)

        def done() -> None:
            whole = torch.empty(self.local.size * c, dtype=t.dtype, device=t.device)
            self.local.all_gather(whole, chunk, count=count)
            flat.copy_(whole[:flat.numel()])

        return self._finish(work, done, async_op)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, *, async_op: bool = False,
                   count: bool = True):
        """``out`` holds every node's ``t``, in node order (``size`` x ``t``)."""
        n, b = self.size, t.numel()
        if out.numel() != n * b or not out.is_contiguous():
            raise ValueError(f"ShardedWire.all_gather: out has {out.numel()} elements, "
                             f"needs {n} x {b}, contiguous")
        chunk, c = self._chunk(t.reshape(-1))
        part = torch.empty(n * c, dtype=t.dtype, device=t.device)
        work = self.cross.all_gather(part, chunk, async_op=True, count=count)

        def done() -> None:
            g = self.local.size
            whole = torch.empty(g * n * c, dtype=t.dtype, device=t.device)
            self.local.all_gather(whole, part, count=count)
            # whole[j, m] is chunk j of node m's tensor
            byn = whole.view(g, n, c).transpose(0, 1).reshape(n, g * c)
            out.view(n, b).copy_(byn[:, :b])

        return self._finish(work, done, async_op)

    def all_to_all(self, out, t, **kw):
        raise NotImplementedError("ShardedWire: all_to_all is not sharded (strategies "
                                  "with a two-phase exchange cross nodes by their leaders)")

    def broadcast(self, t, src: int = 0, **kw):
        raise NotImplementedError("ShardedWire: broadcast is not sharded")


class _Deferred:
    """A sharded collective's Work: ``wait()`` waits for the cross-node part
    and runs the gather inside the node, once."""

    __slots__ = ("_work", "_done")

    def __init__(self, work, done: Callable[[], None]):
        self._work, self._done = work, done

    def wait(self) -> bool:
        if self._done is not None:
            done, self._done = self._done, None
            self._work.wait()
            done()
        return True

    def is_completed(self) -> bool:
        return self._done is None


# -- lorasync's own all-reduce algorithms ----------------------------------------------
_COMBINE = {
    dist.ReduceOp.SUM: lambda a, b: a.add_(b),
    dist.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
    dist.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
}
#: tag of lorasync's point-to-point messages (the probe's pairs use 0)
_P2P_TAG = 7411


def recursive_doubling(t: torch.Tensor, *, op=dist.ReduceOp.SUM,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce ``t`` in place by recursive doubling over point-to-point
    sends, for any group size: with p the largest power of two <= n and
    r = n - p, ranks 2i and 2i+1 (i < r) first fold into the odd one, the p
    remaining ranks exchange their whole tensor with the rank ``mask`` away
    (mask = 1, 2, 4, ...) and combine, and the folded ranks get the result
    back: floor(log2 n) exchanges, two more when n is not a power of two.

    Every rank ends with the same bits: each exchange combines the same two
    operands on both sides, and addition is commutative.  The summation
    order differs from the ring's, so results agree with it up to rounding.
    Blocking; run it on the group's worker (:class:`Wire` does).
    """
    try:
        combine = _COMBINE[op]
    except KeyError:
        raise ValueError(f"recursive_doubling: op {op} is not supported (SUM, MAX, MIN)") from None
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return t
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    # point-to-point sends take contiguous tensors only: a strided ``t`` is
    # reduced in a contiguous copy and written back
    buf = t if t.is_contiguous() else t.contiguous()
    tmp = torch.empty_like(buf)
    kw = dict(group=group, tag=_P2P_TAG)
    if r < 2 * rem:
        if r % 2 == 0:  # folded: hand over, get the result back at the end
            dist.send(buf, group_dst=r + 1, **kw)
            dist.recv(buf, group_src=r + 1, **kw)
            return t if buf is t else t.copy_(buf)
        dist.recv(tmp, group_src=r - 1, **kw)
        combine(buf, tmp)
        v = r // 2
    else:
        v = r - rem
    mask = 1
    while mask < p:
        pv = v ^ mask
        peer = 2 * pv + 1 if pv < rem else pv + rem
        work = dist.isend(buf, group_dst=peer, **kw)
        dist.recv(tmp, group_src=peer, **kw)
        work.wait()
        combine(buf, tmp)
        mask <<= 1
    if r < 2 * rem:
        dist.send(buf, group_dst=r - 1, **kw)
    return t if buf is t else t.copy_(buf)


class _ThreadWork:
    """What ``Work`` offers the strategies, for a job on a group's worker."""

    __slots__ = ("_fut",)

    def __init__(self, fut: torch.futures.Future):
        self._fut = fut

    def wait(self) -> bool:
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut


class _Runner:
    """One FIFO worker thread for a process group's point-to-point algorithms."""

    _ids = itertools.count()

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"lorasync-p2p-{next(self._ids)}")
        self._thread.start()

    def submit(self, job: Callable[[], torch.Tensor]) -> _ThreadWork:
        fut: torch.futures.Future = torch.futures.Future()
        self._q.put((job, fut))
        return _ThreadWork(fut)

    def stop(self, timeout: float) -> bool:
        """End the thread once the jobs queued before have run; False if it
        is still running after ``timeout`` seconds."""
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, fut = item
            try:
                out = job()
            except Exception as e:  # noqa: BLE001 - handed to whoever waits
                fut.set_exception(e)
            else:
                fut.set_result([out])


_runners: dict[int, _Runner] = {}
_runners_lock = threading.Lock()


def _runner(group: dist.ProcessGroup | None) -> _Runner:
    key = id(group if group is not None else dist.group.WORLD)
    with _runners_lock:
        r = _runners.get(key)
        if r is None:
            r = _runners[key] = _Runner()
        return r


def stop_runners(timeout: float) -> bool:
    """Stop every point-to-point worker (at exit: a thread inside a collective
    when the interpreter finalizes aborts the process); False if one did not
    stop within ``timeout`` seconds.  A later collective starts a new one."""
    with _runners_lock:
        runners = list(_runners.values())
        _runners.clear()
    return all([r.stop(timeout) for r in runners])


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

    __slots__ = ("group", "size", "rank", "backend", "_count", "algo_counts")

    def __init__(self, size: int, rank: int = 0, count: Callable[[int], None] = lambda n: None):
        self.group = None
        self.backend = "loopback"
        self.size, self.rank, self._count = int(size), int(rank), count
        self.algo_counts = dict.fromkeys(ALGOS, 0)

    def set_algo(self, algo) -> None:
        pass

    def algo_for(self, t) -> str:
        return "ring"

    def all_gather_object(self, obj):
        return [obj] * self.size

    def _done(self, t: torch.Tensor, async_op: bool, count: bool):
        if count:
            self._count(_nbytes(t))
        return _Done(t) if async_op else None

    def take_transfers(self) -> list[Transfer]:
        return []   # nothing travels: nothing to time

    def all_reduce(self, t, *, op=dist.ReduceOp.SUM, async_op=False, count=True, algo=None):
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
