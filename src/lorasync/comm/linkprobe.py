"""Short timed all-reduces on one Wire: the alpha-beta of the link it runs over.

``auto`` probes its links with these while it trains (the node's group and the
leaders' group separately when it runs hierarchically), and a Wire asked to
choose its all-reduce algorithm per message (``allreduce_algo=auto``) gets
the alpha and beta its choice rests on from here.  Three 1 KiB all-reduces
(latency; the fastest counts) and one of ``nbytes`` (bandwidth; never below
256 KiB, since a token-bucket shaper lets the first tens of KiB through at
line rate); each rank keeps the fastest rank's times (the others may have
waited for it to arrive).  Always the backend's own ring: the alpha-beta
model of :func:`lorasync.net.probe.allreduce_model` is fitted on it.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch
import torch.distributed as dist

from lorasync.net.probe import allreduce_model
from lorasync.plan.costmodel import allreduce_choice

__all__ = ["SMALL_BYTES", "MIN_BYTES", "time_link", "link_model", "algo_chooser"]

SMALL_BYTES = 1024
MIN_BYTES = 256 << 10


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_link(wire, nbytes: int, device: torch.device, count: bool = True
              ) -> tuple[float, float, float]:
    """(small all-reduce s, large all-reduce s, seconds spent): the fastest
    rank's times, the same on every rank of the wire's group."""
    small = torch.zeros(SMALL_BYTES // 4, device=device)
    large = torch.zeros(max(nbytes, MIN_BYTES) // 4, device=device)
    t_start = time.perf_counter()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        wire.all_reduce(small, count=count, algo="ring")
        _sync(device)
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    wire.all_reduce(large, count=count, algo="ring")
    _sync(device)
    tl = time.perf_counter() - t0
    out = torch.tensor([-min(ts), -tl, time.perf_counter() - t_start], dtype=torch.float64,
                       device=device)
    wire.all_reduce(out, op=dist.ReduceOp.MAX, count=count)
    return -float(out[0]), -float(out[1]), float(out[2])


def link_model(wire, nbytes: int, device: torch.device, count: bool = True
               ) -> tuple[float, float, float]:
    """(alpha_s per message, bandwidth_Bps, seconds spent) of the wire's group."""
    ts, tl, spent = time_link(wire, nbytes, device, count)
    m = allreduce_model([SMALL_BYTES, max(nbytes, MIN_BYTES)], [ts, tl], wire.size)
    return m.alpha_s, m.bandwidth_Bps, spent


def algo_chooser(wire, device: torch.device) -> Callable[[int], str]:
    """The cost model's all-reduce algorithm per payload size on this wire's
    link (measured now; not counted as sync traffic)."""
    alpha, bw, _ = link_model(wire, MIN_BYTES, device, count=False)
    return functools.partial(_choice, n=wire.size, alpha_s=alpha, bandwidth_Bps=bw)


def _choice(nbytes: int, *, n: int, alpha_s: float, bandwidth_Bps: float) -> str:
    return allreduce_choice(nbytes, n, alpha_s, bandwidth_Bps)
