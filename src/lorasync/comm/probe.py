"""Measure links with collectives: the probe, and short timed all-reduces.

Two measurements, both run by every rank of an initialised process group,
both fitted by :mod:`lorasync.plan.linkfit`:

* :func:`probe_group`, what ``lorasync probe`` runs in each worker and what
  ``--comm auto`` runs at attach (``quick=True``), a
  :class:`~lorasync.plan.net.ProbeResult` (:func:`run_probe`: its JSON):

  - a collective sweep: all-reduce (optionally all-gather, broadcast) from a
    few KiB up to ``max_bytes``, with warm-up and repeats; each size is a
    record of median/min/max time and nccl-tests' algbw and busbw
    (``algbw = bytes / time``; ``busbw = algbw * factor``, factor 2(n-1)/n
    for all-reduce, (n-1)/n for all-gather, 1 for broadcast), so the numbers
    compare with nccl-tests and with the link rate;
  - a pair matrix: for every ordered pair (src, dst) in turn, with all other
    ranks idle at a barrier, a small ping-pong (latency = half the round
    trip) and a one-way stream of growing messages, each answered by a
    4-byte ack; the fitted slope is that direction's bandwidth. One slow
    NIC, cable or shaped link shows up as the pairs that touch it;
  - an alpha/beta model of the all-reduce
    (:func:`lorasync.plan.linkfit.allreduce_model`).

  Every rank returns the same result (the probe JSON of docs/contracts.md).
  The sweep decides when to stop from timings all-reduced across ranks, and
  pairs from a control message the sender sends, so all ranks always agree
  on what comes next: a probe is bounded by its time budget and, should a
  peer die, by the process group's timeout; it never waits forever.

* :func:`time_link` / :func:`link_model`, on one :class:`~lorasync.comm.wire.Wire`:
  three ``SMALL_PROBE_BYTES`` all-reduces (latency; the fastest counts) and
  one of ``nbytes`` (bandwidth; never below ``MIN_PROBE_BYTES``; at the
  start, grown while latency dominates it); each rank
  keeps the fastest rank's times (the others may have waited for it to
  arrive).  Always the backend's own ring, the algorithm the model is
  fitted on.  ``auto`` probes its links with these while it trains (the
  node's group and the leaders' group separately when it runs
  hierarchically), and a Wire asked to choose its all-reduce algorithm per
  message (``allreduce_algo=auto``) gets its alpha and beta from here
  (:func:`algo_chooser`).
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from lorasync.errors import ConfigError
from lorasync.plan.costmodel import allreduce_choice
from lorasync.plan.linkfit import (MAX_PROBE_BYTES, MIN_PROBE_BYTES, SMALL_PROBE_BYTES,
                                   allreduce_model, busbw_factor, credited_bandwidth,
                                   fit_alpha_beta, latency_bound, sweep_step)
from lorasync.plan.net import ProbeModel, ProbeResult
from lorasync.units import fmt_bytes

__all__ = [
    "DEFAULT_MAX_BYTES", "sweep_sizes", "probe_group", "run_probe",
    "time_link", "link_model", "algo_chooser",
]

DEFAULT_MAX_BYTES = 64 << 20
SWEEP_MIN_BYTES = 4 << 10
DEFAULT_PAIR_MAX_BYTES = 4 << 20
_NOISY_SPREAD = 0.5  # (max - min) / median above this: flag the record as noisy


# -- sizes ----------------------------------------------------------------------
def sweep_sizes(max_bytes: int, min_bytes: int = SWEEP_MIN_BYTES, factor: int = 4) -> list[int]:
    """min_bytes, x4, ... up to max_bytes (which is included when not on the grid)."""
    if max_bytes < min_bytes:
        return [max_bytes]
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    if out[-1] != max_bytes:
        out.append(max_bytes)
    return out


# -- the distributed part ---------------------------------------------------------
class _Ctx:
    """What every measurement needs: group, ranks, device, clocks."""

    def __init__(self, dist, torch, group):
        self.dist, self.torch, self.group = dist, torch, group
        self.n = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        backend = str(dist.get_backend(group))
        self.backend = backend
        self.device = torch.device("cpu")
        if "nccl" in backend and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())

    def global_rank(self, r: int) -> int:
        if self.group is None:
            return r
        return self.dist.get_global_rank(self.group, r)

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def shared_max(self, values: list[float]) -> list[float]:
        """Element-wise max over ranks: every rank then decides from the same numbers."""
        t = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return t.cpu().tolist()


def _collective_fn(ctx: _Ctx, collective: str, nbytes: int):
    torch, dist, g = ctx.torch, ctx.dist, ctx.group
    if collective == "all_reduce":
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=ctx.device)
        return lambda: dist.all_reduce(buf, group=g)
    if collective == "all_gather":  # nccl-tests: bytes = size of the gathered output
        chunk = max(1, nbytes // 4 // ctx.n)
        out = torch.empty(chunk * ctx.n, dtype=torch.float32, device=ctx.device)
        inp = torch.ones(chunk, dtype=torch.float32, device=ctx.device)
        # all_gather_single is the name from torch 2.13 on (the old one warns there)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp, group=g)
    if collective == "broadcast":
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=ctx.device)
        src = ctx.global_rank(0)
        return lambda: dist.broadcast(buf, src=src, group=g)
    raise ValueError(f"collective: unknown {collective!r}; use all_reduce, all_gather or broadcast")


_WARM_BELOW_S = 0.1  # sizes projected to take longer skip warm-up: smaller sizes warmed the connections


def _plan(est_s: float | None, remaining_s: float, repeats: int, min_reps: int, have: int) -> bool:
    """Whether to measure the next size: always the first two (a line needs
    two points), then only if ``min_reps`` calls of it fit the budget left."""
    return have < 2 or est_s is None or est_s * min_reps <= remaining_s


def _sweep(ctx: _Ctx, collective: str, sizes: list[int], *, warmup: int, repeats: int, min_reps: int,
           budget_s: float, rep_target_s: float, grow_past: int | None = None) -> list[dict]:
    """Time one collective at each size until the shared time budget runs out.

    Every decision uses timings all-reduced over ranks (``shared_max``), so
    every rank takes the same branch and no rank waits on a collective the
    others skipped.

    ``grow_past`` (the quick probe): sizes above it are timed only while the
    largest so far is latency-bound (:func:`lorasync.plan.linkfit.latency_bound`:
    its transfer under 3x the smallest size's time), and a size projected to
    be mostly latency is timed ``min_reps`` times: on a long, thin link the
    budget goes to the messages long enough to time the bandwidth.
    """
    records: list[dict] = []
    spent = 0.0  # from shared timings only
    factor = busbw_factor(collective, ctx.n)
    for size in sizes:
        nbytes = size
        if collective == "all_gather":
            nbytes = max(1, size // 4 // ctx.n) * 4 * ctx.n
        # projected time of one call: the smallest size's time (latency) plus
        # the last transfer scaled; past grow_past only while latency-bound
        step = sweep_step(nbytes, [(r["bytes"], r["time_s"]) for r in records], budget_s - spent,
                          min_reps=min_reps, grow_past=grow_past)
        if not step.measure:
            break
        est, latency_only = step.est_s, step.latency_only
        fn = _collective_fn(ctx, collective, nbytes)
        w = warmup if est is None or est < _WARM_BELOW_S else 0
        ctx.dist.barrier(group=ctx.group)
        t0 = time.perf_counter()
        for _ in range(w):
            fn()
        ctx.sync()
        (warm,) = ctx.shared_max([(time.perf_counter() - t0) / max(w, 1)])
        if not w:
            warm = est
        spent += warm * w
        # several back-to-back calls per timed repeat where one call is too
        # short to time well (as nccl-tests' iters), one call for big sizes
        inner = int(min(100, max(1, rep_target_s // max(warm, 1e-7))))
        reps = max(min_reps, min(repeats, int((budget_s - spent) / max(warm * inner, 1e-9))))
        if latency_only and grow_past is not None:
            reps = min_reps
        times = []
        for _ in range(reps):
            ctx.dist.barrier(group=ctx.group)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            ctx.sync()
            times.append((time.perf_counter() - t0) / inner)
        times = ctx.shared_max(times)  # the collective is done when its slowest rank is
        spent += sum(times) * inner
        med = statistics.median(times)
        algbw = nbytes / med
        records.append({
            "collective": collective, "bytes": nbytes, "time_s": med,
            "time_s_min": min(times), "time_s_max": max(times),
            "algbw_Bps": algbw, "busbw_Bps": algbw * factor,
            "repeats": reps, "inner": inner,
            "spread": (max(times) - min(times)) / med,
        })
    return records


def _pings(repeats: int) -> int:
    """Ping-pongs per pair: cheap, and on a busy host single ones jitter by milliseconds."""
    return max(10, repeats)


def _pair_src(ctx: _Ctx, dst: int, sizes: list[int], repeats: int, min_reps: int, budget_s: float) -> dict:
    """The sender of one directed pair decides sizes and repeats from its own
    clock and tells the receiver in a control message [bytes, warm-ups, repeats]."""
    torch, dist = ctx.torch, ctx.dist
    peer = ctx.global_rank(dst)
    tiny = torch.zeros(1, dtype=torch.float32, device=ctx.device)
    ctrl = torch.zeros(3, dtype=torch.int64, device=ctx.device)

    def pingpong():
        t0 = time.perf_counter()
        dist.send(tiny, peer, group=ctx.group)
        dist.recv(tiny, peer, group=ctx.group)
        return time.perf_counter() - t0

    for _ in range(2):
        pingpong()
    rtts = [pingpong() for _ in range(_pings(repeats))]
    latency = statistics.median(rtts) / 2
    spent = sum(rtts)
    pts: list[tuple[int, float]] = []
    for size in sizes:
        est = pts[-1][1] * size / pts[-1][0] if pts else None
        if not _plan(est, budget_s - spent, repeats, min_reps, len(pts)):
            break
        w = 1 if est is None or est < _WARM_BELOW_S else 0
        reps = repeats if est is None else max(min_reps, min(repeats, int((budget_s - spent) / est) - w))
        ctrl[0], ctrl[1], ctrl[2] = size, w, reps
        dist.send(ctrl, peer, group=ctx.group)
        buf = torch.ones(size // 4, dtype=torch.float32, device=ctx.device)
        times = []
        for i in range(w + reps):
            t0 = time.perf_counter()
            dist.send(buf, peer, group=ctx.group)
            dist.recv(tiny, peer, group=ctx.group)  # the ack: data has arrived
            dt = time.perf_counter() - t0
            spent += dt
            if i >= w:
                times.append(dt)
        pts.append((size, statistics.median(times)))
    ctrl.zero_()
    dist.send(ctrl, peer, group=ctx.group)
    fit = fit_alpha_beta([p[0] for p in pts], [p[1] for p in pts])
    big, t_big = pts[-1]
    bw = fit.bandwidth_Bps or big / t_big
    return {"src": ctx.me, "dst": dst, "latency_s": latency, "bandwidth_Bps": bw,
            "latency_min_s": min(rtts) / 2,  # base latency, without queueing: what a BDP uses
            "alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte, "r2": fit.r2,
            "max_bytes": big, "max_bytes_Bps": big / t_big,
            "points": [{"bytes": s, "time_s": t} for s, t in pts]}


def _pair_dst(ctx: _Ctx, src: int, repeats: int) -> None:
    torch, dist = ctx.torch, ctx.dist
    peer = ctx.global_rank(src)
    tiny = torch.zeros(1, dtype=torch.float32, device=ctx.device)
    ctrl = torch.zeros(3, dtype=torch.int64, device=ctx.device)
    for _ in range(2 + _pings(repeats)):
        dist.recv(tiny, peer, group=ctx.group)
        dist.send(tiny, peer, group=ctx.group)
    while True:
        dist.recv(ctrl, peer, group=ctx.group)
        size, w, reps = (int(x) for x in ctrl.tolist())
        if size == 0:
            return
        buf = torch.empty(size // 4, dtype=torch.float32, device=ctx.device)
        for _ in range(w + reps):
            dist.recv(buf, peer, group=ctx.group)
            dist.send(tiny, peer, group=ctx.group)


def _pairs(ctx: _Ctx, sizes: list[int], repeats: int, min_reps: int, budget_s: float,
           stop_after_s: float | None = None) -> list[dict]:
    """Every ordered pair in turn, the others idle.  ``stop_after_s``: stop once that
    long has passed (the pairs measured so far are kept): n(n-1) pairs, each followed
    by a collective as slow as the group's ring, add up on a long-latency link."""
    mine = []
    order = [(s, d) for s in range(ctx.n) for d in range(ctx.n) if s != d]
    per_pair = budget_s / max(1, len(order))
    t0 = time.perf_counter()
    for s, d in order:
        if ctx.me == s:
            mine.append(_pair_src(ctx, d, sizes, repeats, min_reps, per_pair))
        elif ctx.me == d:
            _pair_dst(ctx, s, repeats)
        # everyone else idles: one link at a time
        if stop_after_s is None:
            ctx.dist.barrier(group=ctx.group)
        elif ctx.shared_max([time.perf_counter() - t0])[0] > stop_after_s:
            break   # the same maximum on every rank: all stop after the same pair
    gathered: list = [None] * ctx.n
    ctx.dist.all_gather_object(gathered, mine, group=ctx.group)
    return sorted((p for part in gathered for p in part), key=lambda p: (p["src"], p["dst"]))


def _rank_info(ctx: _Ctx, describe: Callable[[], dict] | None) -> dict:
    info = {"rank": ctx.me, "host": socket.gethostname(), "ifname": None, "addr": None, "mtu": None}
    if describe is not None:
        try:
            info.update({k: v for k, v in describe().items() if k in ("ifname", "addr", "mtu")})
        except Exception:  # never fail a probe over a label
            pass
    return info


def run_probe(group=None, **options) -> dict:
    """The probe JSON (docs/contracts.md) of :func:`probe_group`'s probe:
    the same keyword options, the same dict on every rank."""
    return probe_group(group, **options).to_json()


def probe_group(group=None, *, quick: bool = False, max_bytes: int = DEFAULT_MAX_BYTES,
                repeats: int | None = None, warmup: int | None = None,
                pairs: bool | None = None, pair_max_bytes: int | None = None,
                time_budget_s: float | None = None,
                collectives: Sequence[str] = ("all_reduce",),
                describe_rank: Callable[[], dict] | None = None) -> ProbeResult:
    """Probe the links of ``group`` (default: the world).

    Call on every rank of an initialised process group; every rank gets the
    same result. ``quick`` (for ``--comm auto``) measures sizes 4x apart up to
    4 MiB, and beyond (up to ``max_bytes``) while the largest is still mostly
    latency, with few repeats in a few seconds (3 s sweep + 3 s pairs at most,
    less on fast links; a latency-bound size is timed once); the full probe
    sweeps up to ``max_bytes`` within ``time_budget_s`` (default 60 s sweep +
    60 s pairs).
    ``pairs`` defaults to on, and in quick mode to on only for up to 8 ranks;
    quick pairs stop once their budget is spent (``pairs_complete`` says whether
    every pair was measured): n(n-1) pairs, each followed by a barrier as
    slow as the group's ring, add up on a long-latency link.
    ``describe_rank``: this rank's interface, address and MTU
    (``{"ifname", "addr", "mtu"}``) for the probe JSON's ``ranks``; without
    it they are None.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("probe_group needs an initialised process group "
                           "(dist.init_process_group)")
    if max_bytes < SWEEP_MIN_BYTES:
        raise ConfigError("max_bytes", max_bytes, f"must be at least {SWEEP_MIN_BYTES} bytes")
    for c in collectives:
        busbw_factor(c, 2)  # validates the name
    ctx = _Ctx(dist, torch, group)
    t_start = time.perf_counter()
    if quick:
        repeats = repeats or 3
        warmup = 1 if warmup is None else warmup
        # x4 steps: on a long, thin link each step costs about the latency,
        # and a coarser step would project past the budget
        sizes = sweep_sizes(max_bytes)
        grow_past = MAX_PROBE_BYTES
        pair_sizes = sweep_sizes(min(pair_max_bytes or (1 << 20), max_bytes), factor=16)
        budget = 3.0 if time_budget_s is None else time_budget_s / 2
        pairs = ctx.n <= 8 if pairs is None else pairs
        rep_target = 0.005
        min_reps = 1  # on a slow link one call of a bigger size beats three of a small one
    else:
        repeats = repeats or 10
        warmup = 2 if warmup is None else warmup
        sizes = sweep_sizes(max_bytes)
        grow_past = None
        pair_sizes = sweep_sizes(min(pair_max_bytes or DEFAULT_PAIR_MAX_BYTES, max_bytes))
        budget = 60.0 if time_budget_s is None else time_budget_s / 2
        pairs = True if pairs is None else pairs
        rep_target = 0.02
        min_reps = min(3, repeats)
    if repeats < 1:
        raise ConfigError("repeats", repeats, "must be at least 1")

    info: list = [None] * ctx.n
    dist.all_gather_object(info, _rank_info(ctx, describe_rank), group=group)
    sweep: list[dict] = []
    for c in collectives:
        sweep += _sweep(ctx, c, sizes, warmup=warmup, repeats=repeats, min_reps=min_reps,
                        budget_s=budget / len(collectives), rep_target_s=rep_target,
                        grow_past=grow_past)
    pair_list = (_pairs(ctx, pair_sizes, max(1, min(repeats, 5)), min(min_reps, 5), budget,
                        stop_after_s=budget if quick else None)
                 if pairs and ctx.n > 1 else [])

    model = None
    ar = [r for r in sweep if r["collective"] == "all_reduce"]
    if ctx.n > 1 and len(ar) >= 2 and len({r["bytes"] for r in ar}) >= 2:
        m = allreduce_model([r["bytes"] for r in ar], [r["time_s"] for r in ar], ctx.n)
        bw, source = m.bandwidth_Bps, m.bandwidth_from
        # never more than 2x the largest message's plain rate (linkfit.credited_bandwidth):
        # a sweep whose messages were all latency cannot read a fast link
        big_rec = max(ar, key=lambda r: r["bytes"])
        small_rec = min(ar, key=lambda r: r["bytes"])
        credited, capped = credited_bandwidth(
            m.bandwidth_Bps, big_rec["bytes"] * busbw_factor("all_reduce", ctx.n),
            big_rec["time_s"], small_rec["time_s"])
        if capped:
            big_text = fmt_bytes(big_rec["bytes"], binary=True)
            bw, source = credited, (f"the largest all-reduce's rate ({big_text}; the fit "
                                    "was faster than its messages)")
        # A sweep cut short by the budget (a slow link, quick mode) fits its
        # slope on sizes a shaper's burst still flatters; the pairs went to
        # bigger messages, and a ring is never faster than its slowest link.
        big = max(r["bytes"] for r in ar)
        if pair_list and big < max(p["max_bytes"] for p in pair_list):
            slow_bw = min(p["bandwidth_Bps"] for p in pair_list)
            if slow_bw < bw:
                bw, source = slow_bw, (f"slowest pair (the sweep stopped at "
                                       f"{fmt_bytes(big, binary=True)})")
        model = ProbeModel(alpha_s=m.alpha_s, beta_s_per_byte=1.0 / bw, bandwidth_Bps=bw,
                           allreduce_alpha_s=m.allreduce_alpha_s, r2=m.r2,
                           bandwidth_from=source)
    slowest = None
    if pair_list:
        p = min(pair_list, key=lambda q: q["bandwidth_Bps"])
        slowest = {"src": p["src"], "dst": p["dst"], "bandwidth_Bps": p["bandwidth_Bps"],
                   "latency_s": p["latency_s"]}
    warnings = [f"{r['collective']} {fmt_bytes(r['bytes'], binary=True)}: spread {r['spread']:.0%} of the median (noisy)"
                for r in sweep if r["spread"] > _NOISY_SPREAD]
    result = ProbeResult(
        world_size=ctx.n, backend=ctx.backend, quick=quick, time=time.time(),
        ranks=tuple(info), sweep=tuple(sweep), pairs=tuple(pair_list),
        pairs_complete=len(pair_list) == (ctx.n * (ctx.n - 1) if pairs else 0), model=model,
        slowest_pair=slowest, warnings=tuple(warnings))
    # identical on every rank (the wall clock and elapsed time come from rank 0)
    box = [result]
    dist.broadcast_object_list(box, src=ctx.global_rank(0), group=group)
    return dataclasses.replace(box[0],
                               elapsed_s=ctx.shared_max([time.perf_counter() - t_start])[0])


# -- short timed all-reduces on one Wire ---------------------------------------------
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_link(wire, nbytes: int, device: torch.device, count: bool = True
              ) -> tuple[float, float, float]:
    """(small all-reduce s, large all-reduce s, seconds spent): the fastest
    rank's times, the same on every rank of the wire's group."""
    small = torch.zeros(SMALL_PROBE_BYTES // 4, device=device)
    large = torch.zeros(max(nbytes, MIN_PROBE_BYTES) // 4, device=device)
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


def _time_large(wire, nbytes: int, device: torch.device, count: bool) -> tuple[float, float]:
    """(one all-reduce of ``nbytes``: the fastest rank's seconds, seconds spent)."""
    large = torch.zeros(nbytes // 4, device=device)
    t0 = time.perf_counter()
    wire.all_reduce(large, count=count, algo="ring")
    _sync(device)
    tl = time.perf_counter() - t0
    out = torch.tensor([-tl, time.perf_counter() - t0], dtype=torch.float64, device=device)
    wire.all_reduce(out, op=dist.ReduceOp.MAX, count=count)
    return -float(out[0]), float(out[1])


def link_model(wire, nbytes: int, device: torch.device, count: bool = True,
               grow: bool = False) -> tuple[float, float, float]:
    """(alpha_s per message, bandwidth_Bps, seconds spent) of the wire's group.

    ``grow`` (a start probe, which knows nothing of the link yet): while the
    large all-reduce was mostly latency (:func:`lorasync.plan.linkfit.latency_bound`)
    time one 4x larger, up to ``MAX_PROBE_BYTES``.  The bandwidth is never
    credited with more than 2x the large message's plain rate
    (:func:`lorasync.plan.linkfit.credited_bandwidth`)."""
    ts, tl, spent = time_link(wire, nbytes, device, count)
    size = max(nbytes, MIN_PROBE_BYTES)
    while grow and size < MAX_PROBE_BYTES and latency_bound(ts, tl):
        size = min(MAX_PROBE_BYTES, size * 4)
        tl, more = _time_large(wire, size, device, count)
        spent += more
    m = allreduce_model([SMALL_PROBE_BYTES, size], [ts, tl], wire.size)
    bw, _ = credited_bandwidth(m.bandwidth_Bps, size * busbw_factor("all_reduce", wire.size),
                               tl, ts)
    return m.alpha_s, bw, spent


def algo_chooser(wire, device: torch.device) -> Callable[[int], str]:
    """The cost model's all-reduce algorithm per payload size on this wire's
    link (measured now; not counted as sync traffic)."""
    alpha, bw, _ = link_model(wire, MIN_PROBE_BYTES, device, count=False)
    return functools.partial(_choice, n=wire.size, alpha_s=alpha, bandwidth_Bps=bw)


def _choice(nbytes: int, *, n: int, alpha_s: float, bandwidth_Bps: float) -> str:
    return allreduce_choice(nbytes, n, alpha_s, bandwidth_Bps)
