"""Wire bytes per optimizer step of each strategy, as pure functions.

The planner prices strategies with these; the dist tests check that the
strategies hand exactly these bytes to their collectives.  Counted: payload
bytes one rank hands to collectives, at the dtype sent (see docs/contracts.md;
ring traffic differs per collective: an all-reduce of P moves ~2(n-1)/n P per
rank, an all-gather or all-to-all of P per rank moves (n-1) P and (n-1)/n P).

``numel`` is either the total number of trainable elements (one tensor: an
approximation, good for large adapters) or a sequence with one entry per
trainable tensor -- its numel or its shape (shapes matter for powersgd) --
which gives the exact value.  Steady state (after ``warmup_steps``, which
send 4 bytes/element); periodic strategies are averaged over their period.

Per strategy, with N elements, n ranks, per tensor m elements cut by
``compress.param_blocks`` into nb blocks of bs (m' = nb*bs >= m, padding):

    allreduce   4 N
    fp16, bf16  2 N
    int8        (1 + 1/n) * sum(m' + 4 nb)      all_to_all, then all_gather
    onebit      (1 + 1/n) * sum(m'/8 + 4 nb)    ~ 1/32 of fp32 (x (1+1/n)) + scales
    topk        8 * sum(max(1, ceil(ratio m)))  int32 index + fp32 value, all_gather
    powersgd    4 * sum(k (a + b)) over a x b matrices it compresses
                + 4 * numel of the other tensors   (two all-reduces)
    local       4 N / period
    diloco      N * bytes(delta_dtype) / period
    none        0
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lorasync.comm import compress as C

__all__ = ["wire_bytes_formula", "collectives_formula"]

_ESIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
# options that only the formula takes (describing the tensors, not the strategy)
_EXTRA = {"powersgd": {"lora_r"}}


def _tensors(numel: int | Sequence[int | Sequence[int]]) -> list[tuple[int, ...]]:
    if isinstance(numel, int):
        items: Sequence[Any] = [numel]
    else:
        items = list(numel)
    shapes = []
    for it in items:
        shape = (int(it),) if isinstance(it, int) else tuple(int(d) for d in it)
        if not shape or math.prod(shape) <= 0:
            raise ValueError(f"numel: every tensor needs a positive size, got {it!r}")
        shapes.append(shape)
    if not shapes:
        raise ValueError("numel: no tensors given")
    return shapes


def _options(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    from lorasync.comm.base import get_strategy  # registry filled by lorasync.comm

    import lorasync.comm  # noqa: F401

    cls = get_strategy(name)
    extra = _EXTRA.get(name, set())
    unknown = sorted(set(opts) - set(cls.options) - extra)
    if unknown:
        raise ValueError(f"{name}: option {unknown[0]!r} does not apply to this strategy "
                         f"(it takes: {', '.join(sorted(set(cls.options) | extra)) or 'none'})")
    return {**cls.options, **opts}


def collectives_formula(name: str, numel: int | Sequence[int | Sequence[int]], world_size: int,
                        buckets: int = 1, **opts: Any) -> list[dict[str, Any]]:
    """The collectives one rank issues per optimizer step.

    Returns ``[{"op": "all_reduce" | "all_to_all" | "all_gather",
    "bytes_per_step": float, "calls_per_step": float}, ...]`` -- payload bytes
    handed over (see module docstring) and how many collectives (round trips)
    that takes, given DDP's number of ``buckets``.  For a latency-aware cost
    model: time ~ sum(calls * alpha + ring_traffic(op, bytes) * beta).
    """
    o = _options(name, opts)
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    shapes = _tensors(numel)
    sizes = [math.prod(s) for s in shapes]
    N = sum(sizes)
    if name == "none":
        return []
    if name == "allreduce":
        return [dict(op="all_reduce", bytes_per_step=4.0 * N, calls_per_step=buckets)]
    if name in ("fp16", "bf16"):
        return [dict(op="all_reduce", bytes_per_step=2.0 * N, calls_per_step=buckets)]
    if name in ("int8", "onebit"):
        align, per = (1, 1.0) if name == "int8" else (8, 1 / 8)
        total = 0.0
        for m in sizes:
            nb, bs = C.param_blocks(m, o["block"], n, align)
            total += nb * bs * per + 4 * nb
        return [dict(op="all_to_all", bytes_per_step=total, calls_per_step=buckets),
                dict(op="all_gather", bytes_per_step=total / n, calls_per_step=buckets)]
    if name == "topk":
        ratio = float(o["ratio"])
        k = sum(max(1, math.ceil(ratio * m)) for m in sizes)
        return [dict(op="all_gather", bytes_per_step=8.0 * k, calls_per_step=buckets)]
    if name == "powersgd":
        k, rate, r = o["rank"], float(o["min_compression_rate"]), o.get("lora_r")
        first = second = 0.0
        for shape, m in zip(shapes, sizes):
            if len(shape) >= 2:
                a, b = shape[0], m // shape[0]
            elif r is not None:  # a flat size of a LoRA factor: an r x (m/r) matrix
                a, b = int(r), m // int(r)
            else:
                a = b = 0
            if a and a * b >= rate * (a + b) * k:
                first += 4.0 * a * k
                second += 4.0 * b * k
            else:
                first += 4.0 * m
        out = [dict(op="all_reduce", bytes_per_step=first, calls_per_step=buckets)]
        if second:
            out.append(dict(op="all_reduce", bytes_per_step=second, calls_per_step=buckets))
        return out
    if name == "local":
        p = o["period"]
        return [dict(op="all_reduce", bytes_per_step=4.0 * N / p, calls_per_step=1 / p)]
    if name == "diloco":
        p = o["period"]
        return [dict(op="all_reduce", bytes_per_step=float(_ESIZE[o["delta_dtype"]]) * N / p,
                     calls_per_step=1 / p)]
    raise ValueError(f"{name}: no wire-bytes formula for this strategy")


def wire_bytes_formula(name: str, numel: int | Sequence[int | Sequence[int]], world_size: int,
                       **opts: Any) -> float:
    """Payload bytes one rank hands to collectives per optimizer step (steady state).

    >>> wire_bytes_formula("allreduce", 921_600, 2)
    3686400.0
    >>> wire_bytes_formula("onebit", 921_600, 2) / wire_bytes_formula("allreduce", 921_600, 2)
    0.0498046875
    """
    return sum(c["bytes_per_step"] for c in collectives_formula(name, numel, world_size, **opts))
