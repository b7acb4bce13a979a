"""A strategy's encode+decode, timed on the live device without a network.

``auto`` prices the strategies it has not run with the cost model, whose
encode+decode costs default to what the strategies measured on one CPU thread
(the catalog's ``encode_ns``).  On another device (a GPU) those figures are
far off, so auto times its candidates here when it starts: the strategy's
own hooks (or, for a periodic one, its sync) run a few times on copies of
the adapter's tensors, with a :class:`~lorasync.comm.wire.LoopbackWire` in
place of the network, and what the strategy counts as ``encode_s`` is the
figure: the same quantity the catalog's CPU defaults are (the strategies'
own encode_s in bench/plan_accuracy.py), so the cost model means one thing
on every device.  The bench's microbenchmarks use the same function.
"""

from __future__ import annotations

import time
import types
from typing import Any, Mapping, Sequence

import torch

from lorasync import catalog
from lorasync.comm.base import get_strategy
from lorasync.comm.wire import LoopbackWire

__all__ = ["time_encode"]


class _Bucket:
    """What a strategy's hook reads of a DDP ``GradBucket``."""

    __slots__ = ("_i", "_params", "_last", "_buf")

    def __init__(self, index: int, params: list[torch.Tensor], last: bool):
        self._i, self._params, self._last = index, params, last
        self._buf = torch.empty(sum(p.numel() for p in params), device=params[0].device)

    def buffer(self) -> torch.Tensor:
        return self._buf

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, off = [], 0
        for p in self._params:
            out.append(self._buf[off:off + p.numel()].view_as(p))
            off += p.numel()
        return out

    def index(self) -> int:
        return self._i

    def is_last(self) -> bool:
        return self._last


def _buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[_Bucket]:
    """DDP's layout, roughly: gradient-ready (reverse) order, ``cap_bytes`` a bucket."""
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in reversed(list(params)):
        if groups[-1] and size + 4 * p.numel() > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += 4 * p.numel()
    return [_Bucket(i, g, i == len(groups) - 1) for i, g in enumerate(groups)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_encode(name: str, params: Sequence[torch.Tensor], world_size: int, *,
                options: Mapping[str, Any] | None = None, rank: int = 0,
                bucket_cap_bytes: int = 25 << 20, calls: int = 3, seed: int = 0) -> float:
    """Encode+decode of ``name`` per sync, in ns per adapter element.

    ``params``: the adapter's tensors (only their shapes, dtype and device
    are used; nothing of them is read or changed).  The strategy runs as it
    would on ``world_size`` ranks, past any warm-up (compressing from the
    first call; onebit as signed gradients: 1-bit Adam needs an optimizer's
    state), ``calls`` times after one untimed call that builds its index
    plans.  Periodic strategies are timed syncing every step, the adapter
    moved a little before each sync (an inner step: a delta that is not
    zero).  On the CPU the figure is the strategy's own ``encode_s``; on
    CUDA, where its timers only see kernel launches, the wall time of its
    hooks between two device synchronisations.
    """
    opts = dict(options or {})
    spec = catalog.spec(name)
    fields = {f for f, _, _ in catalog.option_help(name)}
    if "warmup_steps" in fields:
        opts["warmup_steps"] = 0
    if "momentum" in fields:
        opts["momentum"] = False
    frags = 1
    if spec.periodic:
        # every step a sync (one fragment of it with fragments: F steps a sync)
        frags = int(opts.get("fragments", 1))
        opts.update(period=frags, streaming=False)
        opts.pop("delay", None)
    device = params[0].device
    g = torch.Generator(device=device).manual_seed(seed)
    clones = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 1e-3)
        for p in params)
    holder = types.SimpleNamespace(module=clones)  # what a strategy reads of its DDP module
    sync = get_strategy(name)(holder, _wire=LoopbackWire(world_size, rank),
                              _register_hook=False, **opts)
    buckets = _buckets(list(clones), bucket_cap_bytes)
    numel = sum(p.numel() for p in clones)
    start, wall = 0.0, 0.0
    for call in range((calls + 1) * frags):
        for b in buckets:  # fresh gradients every call
            b.buffer().normal_(generator=g).mul_(1e-3)
        if spec.periodic:  # an inner step: the delta a sync codes is not zero
            with torch.no_grad():
                for p in clones:
                    p.add_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype),
                           alpha=1e-4)
        _sync(device)
        if call == frags:
            start = sync.stats()["encode_s"]
        t0 = time.perf_counter()
        if spec.per_step:
            for f in [sync.on_bucket(b) for b in buckets]:
                f.wait()
        sync.after_step()
        _sync(device)
        if call >= frags:
            wall += time.perf_counter() - t0
    encode = wall if device.type == "cuda" else sync.stats()["encode_s"] - start
    sync.finish()
    return encode / calls * 1e9 / numel
