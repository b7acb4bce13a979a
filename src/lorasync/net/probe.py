"""Measure the links a job's ranks will train over.

Three measurements, all run by every rank of an initialised process group:

* a collective sweep: all-reduce (optionally all-gather, broadcast) from a
  few KiB up to ``max_bytes``, with warm-up and repeats; each size is a
  record of median/min/max time and nccl-tests' algbw and busbw
  (``algbw = bytes / time``; ``busbw = algbw * factor``, factor 2(n-1)/n for
  all-reduce, (n-1)/n for all-gather, 1 for broadcast), so the numbers
  compare with nccl-tests and with the link rate;
* a pair matrix: for every ordered pair (src, dst) in turn, with all other
  ranks idle at a barrier, a small ping-pong (latency = half the round trip)
  and a one-way stream of growing messages, each answered by a 4-byte ack;
  the fitted slope is that direction's bandwidth. One slow NIC, cable or
  shaped link shows up as the pairs that touch it;
* an alpha/beta model: least squares on ``time = alpha + beta * bytes``; for
  the all-reduce, on times against *bus* bytes (bytes x factor), so beta is
  the per-byte cost of the link rather than of the algorithm.

Every rank returns the same dict (the probe JSON of docs/contracts.md). The
sweep decides when to stop from timings all-reduced across ranks, and pairs
from a control message the sender sends, so all ranks always agree on what
comes next: a probe is bounded by its time budget and, should a peer die, by
the process group's timeout; it never waits forever.

``run_probe`` is what ``lorasync probe`` runs in each worker and what the
trainer's ``--comm auto`` calls in its own process group (``quick=True``).
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from typing import NamedTuple, Sequence

from lorasync.errors import ConfigError
from lorasync.units import fmt_rate

__all__ = [
    "DEFAULT_MAX_BYTES",
    "AlphaBeta",
    "AllReduceModel",
    "fit_alpha_beta",
    "allreduce_model",
    "busbw_factor",
    "sweep_sizes",
    "run_probe",
    "format_report",
]

DEFAULT_MAX_BYTES = 64 << 20
MIN_BYTES = 4 << 10
DEFAULT_PAIR_MAX_BYTES = 4 << 20
_NOISY_SPREAD = 0.5  # (max - min) / median above this: flag the record as noisy


# -- pure helpers --------------------------------------------------------------
class AlphaBeta(NamedTuple):
    """time(bytes) = alpha_s + beta_s_per_byte * bytes."""

    alpha_s: float
    beta_s_per_byte: float
    r2: float

    @property
    def bandwidth_Bps(self) -> float | None:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None

    def predict(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of ``time = alpha + beta * bytes``, in two stages.

    beta: ordinary least squares over all points. Sizes grow geometrically,
    so the large transfers, where bandwidth decides the time, carry the
    slope; small points cannot bend it (a shaper's token bucket lets the
    first few KB through at line rate, which a relative-error fit would read
    as a fast link).

    alpha: given beta, the least-squares intercept under *relative* error
    (weights 1/time^2), so the small messages, where latency decides the
    time, carry it; the plain intercept would be noise from the largest
    transfer (milliseconds of jitter against microseconds of latency).

    alpha is clamped to >= 0; a slope <= 0 (times not growing with size)
    gives beta = 0 and no bandwidth.
    """
    if len(sizes) != len(times):
        raise ValueError(f"sizes and times differ in length ({len(sizes)} vs {len(times)})")
    if len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError(f"sizes: need at least 2 distinct sizes to fit alpha and beta, got {list(sizes)}")
    if any(t <= 0 or not math.isfinite(t) for t in times):
        raise ValueError(f"times: every time must be positive and finite, got {list(times)}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes: must be >= 0, got {list(sizes)}")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    beta = max(0.0, sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx)
    w = [1.0 / (t * t) for t in times]
    alpha = max(0.0, sum(wi * (y - beta * x) for wi, x, y in zip(w, sizes, times)) / sum(w))
    ss_tot = sum((y - my) ** 2 for y in times)
    ss_res = sum((y - alpha - beta * x) ** 2 for x, y in zip(sizes, times))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return AlphaBeta(alpha, beta, r2)


class AllReduceModel(NamedTuple):
    """Ring all-reduce of B bytes on n ranks: ``2(n-1) alpha_s + 2(n-1)/n B / bandwidth_Bps``."""

    #: latency per message (one step of the ring)
    alpha_s: float
    #: never None: times that did not grow with size give the largest bus
    #: bandwidth measured, a lower bound on the link
    bandwidth_Bps: float
    #: the whole all-reduce's latency, 2(n-1) alpha_s
    allreduce_alpha_s: float
    r2: float
    bandwidth_from: str


def allreduce_model(sizes: Sequence[float], times: Sequence[float], world_size: int
                    ) -> AllReduceModel:
    """The alpha-beta model of a group from all-reduce timings (payload bytes,
    seconds): :func:`fit_alpha_beta` on bus bytes (the bytes each rank moves,
    2(n-1)/n of the payload), alpha per ring step.  ``lorasync probe``'s sweep
    and ``auto``'s two-size live probe both fit with this."""
    n = int(world_size)
    if n < 2:
        raise ValueError(f"world_size: an all-reduce model needs at least 2 ranks, got {world_size}")
    f = busbw_factor("all_reduce", n)
    fit = fit_alpha_beta([b * f for b in sizes], times)
    steps = 2 * (n - 1)  # ring all-reduce: n-1 reduce-scatter + n-1 all-gather messages
    if fit.bandwidth_Bps is None:  # times flat in size: latency-bound up to the largest size
        bw = max(b * f / t for b, t in zip(sizes, times))
        source = "largest busbw (times did not grow with size)"
    else:
        bw, source = fit.bandwidth_Bps, "fit"
    return AllReduceModel(fit.alpha_s / steps, bw, fit.alpha_s, fit.r2, source)


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor."""
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"collective: unknown {collective!r}; use all_reduce, all_gather or broadcast")


def sweep_sizes(max_bytes: int, min_bytes: int = MIN_BYTES, factor: int = 4) -> list[int]:
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


def _fmt_s(t: float | None) -> str:
    if t is None:
        return "-"
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


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
           budget_s: float, rep_target_s: float) -> list[dict]:
    """Time one collective at each size until the shared time budget runs out.

    Every decision uses timings all-reduced over ranks (``shared_max``), so
    every rank takes the same branch and no rank waits on a collective the
    others skipped.
    """
    records: list[dict] = []
    spent = 0.0  # from shared timings only
    factor = busbw_factor(collective, ctx.n)
    for size in sizes:
        nbytes = size
        if collective == "all_gather":
            nbytes = max(1, size // 4 // ctx.n) * 4 * ctx.n
        est = None
        if records:  # projected time of one call: linear in bytes from the last size
            est = records[-1]["time_s"] * nbytes / records[-1]["bytes"]
        if not _plan(est, budget_s - spent, repeats, min_reps, len(records)):
            break
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


def _rank_info(ctx: _Ctx) -> dict:
    from lorasync.net.hostinfo import HostInfo  # reads /sys and runs `ip`: only here
    try:
        host = HostInfo()
        ifname, addr = host.endpoint()
        iface = host.interface(ifname) if ifname else None
        mtu = iface.mtu if iface else None
    except Exception:  # never fail a probe over a label
        ifname = addr = mtu = None
    return {"rank": ctx.me, "host": socket.gethostname(), "ifname": ifname, "addr": addr, "mtu": mtu}


def run_probe(group=None, *, quick: bool = False, max_bytes: int = DEFAULT_MAX_BYTES,
              repeats: int | None = None, warmup: int | None = None, pairs: bool | None = None,
              pair_max_bytes: int | None = None, time_budget_s: float | None = None,
              collectives: Sequence[str] = ("all_reduce",)) -> dict:
    """Probe the links of ``group`` (default: the world) and return the probe JSON.

    Call on every rank of an initialised process group; every rank gets the
    same dict. ``quick`` (for ``--comm auto``) measures a few sizes up to
    4 MiB with few repeats in a few seconds (3 s sweep + 3 s pairs at most,
    less on fast links); the full probe sweeps up to ``max_bytes`` within
    ``time_budget_s`` (default 60 s sweep + 60 s pairs).
    ``pairs`` defaults to on, and in quick mode to on only for up to 8 ranks;
    quick pairs stop once their budget is spent (``pairs_complete`` says whether
    every pair was measured): auto's quick probe of 8 ranks on 4 nodes 103 ms
    apart took 256 s, most of it, by estimate, the 56 pairs, each followed by
    a barrier as slow as the 8-rank ring (about 3 s there).
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("run_probe needs an initialised process group (dist.init_process_group)")
    if max_bytes < MIN_BYTES:
        raise ConfigError("max_bytes", max_bytes, f"must be at least {MIN_BYTES} bytes")
    for c in collectives:
        busbw_factor(c, 2)  # validates the name
    ctx = _Ctx(dist, torch, group)
    t_start = time.perf_counter()
    if quick:
        repeats = repeats or 3
        warmup = 1 if warmup is None else warmup
        sizes = [s for s in (4 << 10, 64 << 10, 1 << 20, 4 << 20) if s <= max_bytes] or [max_bytes]
        pair_sizes = sweep_sizes(min(pair_max_bytes or (1 << 20), max_bytes), factor=16)
        budget = 3.0 if time_budget_s is None else time_budget_s / 2
        pairs = ctx.n <= 8 if pairs is None else pairs
        rep_target = 0.005
        min_reps = 1  # on a slow link one call of a bigger size beats three of a small one
    else:
        repeats = repeats or 10
        warmup = 2 if warmup is None else warmup
        sizes = sweep_sizes(max_bytes)
        pair_sizes = sweep_sizes(min(pair_max_bytes or DEFAULT_PAIR_MAX_BYTES, max_bytes))
        budget = 60.0 if time_budget_s is None else time_budget_s / 2
        pairs = True if pairs is None else pairs
        rep_target = 0.02
        min_reps = min(3, repeats)
    if repeats < 1:
        raise ConfigError("repeats", repeats, "must be at least 1")

    info: list = [None] * ctx.n
    dist.all_gather_object(info, _rank_info(ctx), group=group)
    sweep: list[dict] = []
    for c in collectives:
        sweep += _sweep(ctx, c, sizes, warmup=warmup, repeats=repeats, min_reps=min_reps,
                        budget_s=budget / len(collectives), rep_target_s=rep_target)
    pair_list = (_pairs(ctx, pair_sizes, max(1, min(repeats, 5)), min(min_reps, 5), budget,
                        stop_after_s=budget if quick else None)
                 if pairs and ctx.n > 1 else [])

    model = None
    ar = [r for r in sweep if r["collective"] == "all_reduce"]
    if ctx.n > 1 and len(ar) >= 2 and len({r["bytes"] for r in ar}) >= 2:
        m = allreduce_model([r["bytes"] for r in ar], [r["time_s"] for r in ar], ctx.n)
        model = {
            "alpha_s": m.alpha_s, "beta_s_per_byte": 1.0 / m.bandwidth_Bps,
            "bandwidth_Bps": m.bandwidth_Bps, "latency_s": m.alpha_s,
            "allreduce_alpha_s": m.allreduce_alpha_s, "r2": m.r2,
            "formula": "all_reduce(B) = 2(n-1)*alpha_s + 2(n-1)/n*B*beta_s_per_byte",
            "bandwidth_from": m.bandwidth_from,
        }
        # A sweep cut short by the budget (a slow link, quick mode) fits its
        # slope on sizes a shaper's burst still flatters; the pairs went to
        # bigger messages, and a ring is never faster than its slowest link.
        big = max(r["bytes"] for r in ar)
        if pair_list and big < max(p["max_bytes"] for p in pair_list):
            slow_bw = min(p["bandwidth_Bps"] for p in pair_list)
            if slow_bw < model["bandwidth_Bps"]:
                model.update(bandwidth_Bps=slow_bw, beta_s_per_byte=1.0 / slow_bw,
                             bandwidth_from=f"slowest pair (the sweep stopped at {_fmt_bytes(big)})")
    slowest = None
    if pair_list:
        p = min(pair_list, key=lambda q: q["bandwidth_Bps"])
        slowest = {"src": p["src"], "dst": p["dst"], "bandwidth_Bps": p["bandwidth_Bps"],
                   "latency_s": p["latency_s"]}
    warnings = [f"{r['collective']} {_fmt_bytes(r['bytes'])}: spread {r['spread']:.0%} of the median (noisy)"
                for r in sweep if r["spread"] > _NOISY_SPREAD]
    result = {
        "world_size": ctx.n, "backend": ctx.backend, "quick": quick, "time": time.time(),
        "ranks": info, "sweep": sweep, "pairs": pair_list,
        "pairs_complete": len(pair_list) == (ctx.n * (ctx.n - 1) if pairs else 0), "model": model,
        "slowest_pair": slowest, "warnings": warnings,
    }
    # identical on every rank (the wall clock and elapsed time come from rank 0)
    box = [result]
    dist.broadcast_object_list(box, src=ctx.global_rank(0), group=group)
    result = box[0]
    result["elapsed_s"] = ctx.shared_max([time.perf_counter() - t_start])[0]
    return result


# -- text ---------------------------------------------------------------------------
def format_report(res: dict) -> str:
    """The probe JSON as a table for people."""
    lines = [f"lorasync probe: {res['world_size']} ranks, {res['backend']}, "
             f"{'quick, ' if res.get('quick') else ''}{res.get('elapsed_s', 0):.1f} s"]
    for r in res.get("ranks") or []:
        lines.append(f"  rank {r['rank']}: {r['host']} {r.get('ifname') or '?'} "
                     f"{r.get('addr') or '?'} mtu {r.get('mtu') or '?'}")
    if res.get("sweep"):
        lines.append("")
        lines.append(f"{'collective':<11} {'bytes':>9} {'time':>10} {'min':>10} {'max':>10} "
                     f"{'algbw':>11} {'busbw':>11}")
        for r in res["sweep"]:
            lines.append(f"{r['collective']:<11} {_fmt_bytes(r['bytes']):>9} {_fmt_s(r['time_s']):>10} "
                         f"{_fmt_s(r['time_s_min']):>10} {_fmt_s(r['time_s_max']):>10} "
                         f"{fmt_rate(r['algbw_Bps'], 'bytes'):>11} {fmt_rate(r['busbw_Bps'], 'bytes'):>11}")
    m = res.get("model")
    if m:
        lines.append(f"fitted link (all_reduce, busbw-corrected): latency {_fmt_s(m['latency_s'])} per "
                     f"message, bandwidth {fmt_rate(m['bandwidth_Bps'], 'bytes')} (r2 {m['r2']:.3f})")
    pairs = res.get("pairs") or []
    if pairs:
        n = res["world_size"]
        bw = {(p["src"], p["dst"]): p for p in pairs}
        lines.append("")
        lines.append("pair bandwidth, src (row) -> dst (column):")
        lines.append("      " + "".join(f"{d:>11}" for d in range(n)))
        for s in range(n):
            cells = [fmt_rate(bw[(s, d)]["bandwidth_Bps"], 'bytes') if (s, d) in bw else "-" for d in range(n)]
            lines.append(f"{s:>5} " + "".join(f"{c:>11}" for c in cells))
        lines.append("pair latency (one way):")
        for s in range(n):
            cells = [_fmt_s(bw[(s, d)]["latency_s"]) if (s, d) in bw else "-" for d in range(n)]
            lines.append(f"{s:>5} " + "".join(f"{c:>11}" for c in cells))
        if res.get("pairs_complete") is False:
            lines.append(f"{len(pairs)} of {n * (n - 1)} pairs measured: the quick probe's "
                         "budget ran out (--time-budget S, or the full probe, for all)")
    sp = res.get("slowest_pair")
    if sp:
        ranks = {r["rank"]: r for r in res.get("ranks") or []}

        def who(r):
            i = ranks.get(r, {})
            return f"rank {r} ({i.get('host', '?')} {i.get('addr') or ''})".replace(" )", ")")
        lines.append(f"slowest pair: {who(sp['src'])} -> {who(sp['dst'])}: "
                     f"{fmt_rate(sp['bandwidth_Bps'], 'bytes')}, latency {_fmt_s(sp['latency_s'])}")
    for w in res.get("warnings") or []:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
