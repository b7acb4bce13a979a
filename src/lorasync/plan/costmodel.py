"""Cost model of gradient sync: pure functions, no I/O, no torch.

Predicts the time of one optimizer step under each sync strategy from a few
numbers that can be measured by ``lorasync probe`` or calibrated from a run's
``metrics.jsonl`` (every one is a plain dataclass field):

    Net       alpha_s (latency per message), bandwidth_Bps (1/beta), world_size
    Workload  adapter_params, compute_s, batch_size, backward_share, head_share,
              bucket_bytes, encode_ns (per strategy), strategy options

The model
---------
* Collectives follow the alpha-beta (Hockney) model: time = messages * alpha
  + bytes on the critical path * beta.  Ring all-reduce of P bytes:
  2(n-1) alpha + 2(n-1)/n P beta; all-gather of p bytes per rank:
  (n-1) alpha + (n-1) p beta, i.e. (n-1)/n of the gathered total; all-to-all of
  a C-byte send buffer: (n-1) alpha + (n-1)/n C beta.
* What each strategy hands to which collective is one table,
  ``_COLLECTIVES`` (it must agree with ``lorasync.comm.wire_bytes_formula``).
* Per-step (DDP hook) strategies sync every bucket as soon as its gradients
  are ready.  Buckets fill in gradient-ready order (fp32 gradient bytes; the
  first bucket may be smaller).  Backward starts with the loss and the LM
  head (``head_share`` of it, no adapter gradient yet); LoRA parameters are
  spread evenly over the layers, so bucket k is ready after the head plus
  the fraction of the rest that produced its bytes.  Collectives of one
  process group run one after another, so bucket k's sync starts at
  max(ready_k, end of bucket k-1).
  Exposed communication is what is left after the backward pass ends; only
  buckets other than the last can hide behind it.  Two-phase strategies
  (int8, onebit) also hold the backward pass up: the hook of bucket k first
  waits for phase 1 of bucket k-1 (it must reduce that shard before sending
  phase 2), so backward resumes only when that transfer is done, and phase 2
  of k-1 queues ahead of phase 1 of k on the link.  With a single bucket (the
  3.7 MB default adapter under the trainer's 4 MiB ``bucket_mb``) nothing
  overlaps.
* Periodic strategies (local SGD, DiLoCo) sync once every ``period`` steps
  after the optimizer step; nothing overlaps (with ``streaming`` the sync
  runs during the next ``delay`` steps' compute); costs are amortized.
* Encode/decode (casting, quantizing, top-k, PowerSGD matmuls) runs on the
  training thread: ``encode_ns`` per element per sync, added to the step.

    step_s = compute_s + encode_s + exposed_comm_s
    efficiency = compute_s / step_s          (the no-sync ceiling's step is compute_s)
    samples_per_s = world_size * batch_size / step_s

Not modelled: contention between compute and the comm threads for CPU cores,
TCP slow start and loss, stragglers (all ranks are assumed equally fast),
DDP's first iteration (one bucket before it rebuilds by ready order), the
quality cost of lossy or periodic strategies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from lorasync.errors import ConfigError

__all__ = [
    "MiB", "STRATEGIES", "NONE", "LOSSLESS", "PERIODIC", "DEFAULT_OPTIONS", "ENCODE_NS",
    "ALLREDUCE_ALGOS", "Net", "Workload", "Prediction", "Collective", "ModelShape", "MODELS",
    "lora_matrices", "head_share", "strategy_options", "collectives", "wire_bytes",
    "collective_time",
    "ring_allreduce_s", "recursive_doubling_allreduce_s", "reduce_broadcast_s",
    "allgather_s", "alltoall_s", "bucket_layout", "powersgd_floats", "predict", "ring_link_load",
]

MiB = 1 << 20

#: strategies the planner ranks ('auto' is the planner itself)
STRATEGIES = ("allreduce", "fp16", "bf16", "int8", "onebit", "topk", "powersgd", "local", "diloco")
#: no sync at all: the compute ceiling that efficiencies are measured against
NONE = "none"
#: same update every step up to rounding of the summed gradient: no error
#: feedback, no skipped syncs (fp16/bf16 only round the values they send)
LOSSLESS = frozenset({"allreduce", "fp16", "bf16"})
#: sync weights (or deltas) every ``period`` steps instead of gradients every step
PERIODIC = frozenset({"local", "diloco"})
#: all-to-all then all-gather per bucket, the hook waiting between them
TWO_PHASE = frozenset({"int8", "onebit"})

# Default options per strategy.  MUST AGREE with the defaults of the strategies
# in lorasync.comm (tests/unit/test_costmodel.py compares the byte formulas at
# these defaults when lorasync.comm.wire_bytes_formula exists).
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "allreduce": {},
    "fp16": {},
    "bf16": {},
    "int8": {"block": 256},
    "onebit": {"block": 512},
    "topk": {"ratio": 0.1},
    "powersgd": {"rank": 3, "min_compression_rate": 2.0},
    # streaming: the sync runs during the next `delay` steps' compute
    "local": {"period": 8, "streaming": False, "delay": 1},
    "diloco": {"period": 8, "delta_dtype": "fp32", "streaming": False, "delay": 1},
}

# Encode + decode cost, nanoseconds per adapter element per sync, on one CPU
# thread: what the strategies' encode_s came to in bench/plan_accuracy.py
# (SmolLM2-135M, 921,600 adapter elements, 2 ranks, torch 2.13 CPU; the three
# links agree within 10%): fp16/bf16 2 (a cast each way), int8 20 (two
# quantize/dequantize rounds with error feedback), onebit 45 (1-bit Adam: the
# momentum blend, sign packing, two rounds), topk 18 (CPU top-k), PowerSGD 7.5
# per unit of rank (two small matmuls per matrix scale with rank), local 2.5
# and DiLoCo 7 per sync (the flat copy; DiLoCo's outer Nesterov step).  plain
# all-reduce hands DDP's bucket over as it is.  Calibrate for another machine
# from metrics.jsonl's encode_s / params (``lorasync plan --encode-ns``).
ENCODE_NS: dict[str, float] = {
    "none": 0.0, "allreduce": 0.0, "fp16": 2.0, "bf16": 2.0, "int8": 20.0, "onebit": 45.0,
    "topk": 18.0, "powersgd": 7.5, "local": 2.5, "diloco": 7.0,
}

#: options of lorasync.comm strategies accepted and ignored here (they change
#: start-up or the optimization, not the bytes or the time of a steady step)
_STEADY_STATE_OPTIONS = frozenset({"warmup_steps", "warm_start", "outer_lr", "outer_momentum",
                                   "momentum", "max_update_rms"})

ALLREDUCE_ALGOS = ("ring", "recursive_doubling", "reduce_broadcast")
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


# --------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Net:
    """The network as the sync sees it (alpha-beta model of the group).

    ``alpha_s`` is the latency of one message (one step of a collective
    algorithm, software overhead included); ``bandwidth_Bps`` the bytes per
    second one rank achieves on its slowest link (beta = 1 / bandwidth).
    """

    alpha_s: float
    bandwidth_Bps: float
    world_size: int
    #: algorithm the backend uses for all-reduce (gloo and NCCL default to ring)
    allreduce_algo: str = "ring"
    #: False where all-to-all is replaced by an all-gather (a backend without it)
    alltoall: bool = True

    def __post_init__(self):
        _positive_number(self.alpha_s, "alpha_s", zero_ok=True)
        _positive_number(self.bandwidth_Bps, "bandwidth_Bps")
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) \
                or self.world_size < 1:
            raise ConfigError("world_size", self.world_size, "use an integer >= 1")
        if self.allreduce_algo not in ALLREDUCE_ALGOS:
            raise ConfigError("allreduce_algo", self.allreduce_algo,
                              "choose one of " + ", ".join(ALLREDUCE_ALGOS))

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_Bps


@dataclass(frozen=True)
class Workload:
    """What one rank computes and syncs per optimizer step."""

    #: trainable (adapter) parameters, i.e. gradient elements per step
    adapter_params: int
    #: forward + backward + optimizer seconds per step, not waiting on sync
    compute_s: float
    #: samples per rank per step
    batch_size: int = 4
    #: share of compute_s spent in the backward pass (when buckets become
    #: ready).  With LoRA the frozen weights need no weight gradients, so
    #: backward costs about what forward does, not twice as much: measured
    #: 0.50 of forward + backward on SmolLM2-135M (one CPU thread, batch 4)
    backward_share: float = 0.5
    #: share of the backward pass before the first adapter gradient is ready
    #: (loss and LM head; :func:`head_share` estimates it from a model shape)
    head_share: float = 0.0
    #: DDP bucket cap in bytes of fp32 gradients (the trainer's bucket_mb, MiB)
    bucket_bytes: int = 4 * MiB
    #: first (earliest ready) bucket's cap; None = bucket_bytes (DDP does that
    #: whenever bucket_cap_mb is set explicitly, as the trainer does)
    first_bucket_bytes: int | None = None
    #: 2-D adapter matrices (rows, cols), for PowerSGD; None = LoRA pairs of
    #: rank lora_r with an assumed 1024-wide other side
    matrices: tuple[tuple[int, int], ...] | None = None
    lora_r: int = 8
    #: per strategy: ns per element per sync, replacing ENCODE_NS
    encode_ns: Mapping[str, float] = field(default_factory=dict)
    #: per strategy: option overrides, e.g. {"topk": {"ratio": 0.001}}
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self):
        _positive_int(self.adapter_params, "adapter_params")
        _positive_number(self.compute_s, "compute_s")
        _positive_int(self.batch_size, "batch_size")
        if not _is_number(self.backward_share) or not 0 <= self.backward_share <= 1:
            raise ConfigError("backward_share", self.backward_share, "use a number in [0, 1]")
        if not _is_number(self.head_share) or not 0 <= self.head_share < 1:
            raise ConfigError("head_share", self.head_share, "use a number in [0, 1)")
        _positive_number(self.bucket_bytes, "bucket_bytes")
        if self.first_bucket_bytes is not None:
            _positive_number(self.first_bucket_bytes, "first_bucket_bytes")
        _positive_int(self.lora_r, "lora_r")
        if self.matrices is not None:
            for m in self.matrices:
                if len(m) != 2 or any(not isinstance(d, int) or d < 1 for d in m):
                    raise ConfigError("matrices", m, "give (rows, cols) pairs of positive ints")
        for name, ns in self.encode_ns.items():
            if name not in ENCODE_NS:
                raise ConfigError("encode_ns", name, "name a strategy: " + ", ".join(STRATEGIES))
            _positive_number(ns, f"encode_ns.{name}", zero_ok=True)
        for name, opts in self.options.items():
            strategy_options(name, opts)  # validates


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive_number(x, name: str, zero_ok: bool = False) -> None:
    if not _is_number(x) or x < 0 or (x == 0 and not zero_ok):
        raise ConfigError(name, x, "use a number >= 0" if zero_ok else "use a number > 0")


def _positive_int(x, name: str) -> None:
    if not isinstance(x, int) or isinstance(x, bool) or x < 1:
        raise ConfigError(name, x, "use an integer >= 1")


# --------------------------------------------------------------------------- models

@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-like decoder that LoRA sizes depend on."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    #: vocabulary size (the LM head's rows); 0 = unknown
    vocab: int = 0

    def projection(self, target: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        t = target[:-5] if target.endswith("_proj") else target
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h),
                  "gate": (h, self.intermediate), "up": (h, self.intermediate),
                  "down": (self.intermediate, h)}
        if t not in shapes:
            raise ConfigError("lora targets", target,
                              "use q, k, v, o, gate, up, down (with or without _proj)")
        return shapes[t]


MODELS: dict[str, ModelShape] = {
    # the embedded default (SmolLM2-135M-Instruct)
    "smollm2-135m": ModelShape("smollm2-135m", 576, 30, 9, 3, 64, 1536, 49152),
    "smollm2-360m": ModelShape("smollm2-360m", 960, 32, 15, 5, 64, 2560, 49152),
    "smollm2-1.7b": ModelShape("smollm2-1.7b", 2048, 24, 32, 32, 64, 8192, 49152),
    "llama-3-8b": ModelShape("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
}

_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def head_share(shape: ModelShape) -> float:
    """Share of a LoRA backward pass spent before the first adapter gradient
    is ready: the LM head's (and loss's) backward, which comes first.

    With the base model frozen, every projection's backward is one matmul
    (the input gradient), so the work splits as the weights do: the head's
    vocab x hidden against the layers' projections.  Attention scores and
    element-wise work are left out.  SmolLM2-135M: 0.21; measured on one CPU
    thread, batch 4: the first of four 1 MB buckets ready at 0.44 of backward
    holding 0.28 of the adapter, i.e. 0.22 + 0.78 x 0.28.  0.0 when the
    vocabulary is unknown.
    """
    if shape.vocab <= 0:
        return 0.0
    head = shape.vocab * shape.hidden
    layer = sum(i * o for i, o in (shape.projection(t) for t in _PROJECTIONS))
    return head / (head + shape.layers * layer)


def lora_matrices(shape: ModelShape, r: int = 8, targets=("q", "k", "v", "o"),
                  freeze_a: bool = False) -> tuple[tuple[int, int], ...]:
    """Trainable LoRA matrices: A (r x in) and B (out x r) per target per layer.

    With ``freeze_a`` (FFA-LoRA) only B is trained and synced.
    """
    _positive_int(r, "lora_r")
    per_layer: list[tuple[int, int]] = []
    for t in targets:
        fan_in, fan_out = shape.projection(t)
        if not freeze_a:
            per_layer.append((r, fan_in))
        per_layer.append((fan_out, r))
    return tuple(per_layer) * shape.layers


# --------------------------------------------------------------------------- collectives

@dataclass(frozen=True)
class Collective:
    """One collective call: its kind and the payload bytes this rank hands to it.

    For all_gather the payload is this rank's contribution; for all_to_all
    it is this rank's whole send buffer (split in n chunks).
    """

    kind: str  # all_reduce | all_gather | all_to_all | broadcast
    payload_bytes: float


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _terms(c: Collective, net: Net) -> tuple[float, float]:
    """(messages, bytes) on the critical path of one collective."""
    n, p = net.world_size, float(c.payload_bytes)
    if n <= 1 or p <= 0:
        return 0.0, 0.0
    if c.kind == "all_reduce":
        if net.allreduce_algo == "ring":
            return 2.0 * (n - 1), 2.0 * (n - 1) / n * p
        if net.allreduce_algo == "recursive_doubling":
            return float(_log2(n)), _log2(n) * p
        return 2.0 * _log2(n), 2.0 * _log2(n) * p  # binomial reduce, then broadcast
    if c.kind == "all_gather":
        return float(n - 1), (n - 1) * p
    if c.kind == "all_to_all":
        if net.alltoall:
            return float(n - 1), (n - 1) / n * p
        return float(n - 1), (n - 1) * p  # all-gather of the whole buffer instead
    if c.kind == "broadcast":
        return float(_log2(n)), _log2(n) * p
    raise ValueError(f"collective kind: unknown {c.kind!r}")


def collective_time(c: Collective, net: Net) -> float:
    msgs, nbytes = _terms(c, net)
    return msgs * net.alpha_s + nbytes * net.beta_s_per_byte


def ring_allreduce_s(payload_bytes: float, alpha_s: float, beta_s: float, n: int) -> float:
    """2(n-1) alpha + 2(n-1)/n P beta."""
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * payload_bytes * beta_s


def recursive_doubling_allreduce_s(payload_bytes: float, alpha_s: float, beta_s: float,
                                   n: int) -> float:
    """ceil(log2 n) rounds, each exchanging the whole vector with one partner."""
    return _log2(n) * (alpha_s + payload_bytes * beta_s)


def reduce_broadcast_s(payload_bytes: float, alpha_s: float, beta_s: float, n: int) -> float:
    """Binomial-tree reduce to a root, then broadcast: 2 ceil(log2 n) rounds."""
    return 2 * _log2(n) * (alpha_s + payload_bytes * beta_s)


def ring_link_load(ring: Sequence[int], relayed: Mapping[tuple[int, int], int]) -> int:
    """How many ring legs the busiest node link carries, in one direction.

    ``ring`` lists the nodes in ring order (rank order); ``relayed`` maps a
    directed pair (a, b) that cannot connect to the node relaying it (an
    overlay's hub for two nodes behind NAT).  A direct leg a -> b loads a's
    uplink and b's downlink once; a relayed one also loads the relay's downlink
    and uplink.  A ring all-reduce runs at the pace of the busiest link, so on
    links of rate R a what-if ``Net`` takes ``bandwidth_Bps = R / load``.  A
    probe run over the overlay measures this already; only nominal rates need it.
    """
    n = len(ring)
    up: dict[int, int] = {}
    down: dict[int, int] = {}
    for k in range(n if n > 1 else 0):
        a, b = ring[k], ring[(k + 1) % n]
        up[a] = up.get(a, 0) + 1
        down[b] = down.get(b, 0) + 1
        hub = relayed.get((a, b))
        if hub is not None:
            up[hub] = up.get(hub, 0) + 1
            down[hub] = down.get(hub, 0) + 1
    return max([*up.values(), *down.values()], default=1)


def allgather_s(total_bytes: float, alpha_s: float, beta_s: float, n: int) -> float:
    """Ring all-gather of ``total_bytes`` in all: (n-1) alpha + (n-1)/n total beta."""
    return (n - 1) * alpha_s + (n - 1) / n * total_bytes * beta_s


def alltoall_s(total_bytes: float, alpha_s: float, beta_s: float, n: int) -> float:
    """Pairwise all-to-all of one rank's ``total_bytes`` send buffer."""
    return (n - 1) * alpha_s + (n - 1) / n * total_bytes * beta_s


# --------------------------------------------------------------------------- wire bytes
# THE BYTE TABLE.  For each strategy: the collectives one sync of `numel`
# gradient elements makes, with the payload bytes this rank hands to each
# (docs/contracts.md "Wire bytes").  It MUST AGREE with
# lorasync.comm.wire_bytes_formula(name, numel, world_size, **opts); the unit
# test compares the two whenever the comm module provides it.

def _param_blocks(numel: int, block: int, n: int, align: int) -> tuple[int, int]:
    """(blocks, block size) one tensor is cut into, as lorasync.comm.compress.param_blocks:
    a multiple of n blocks (equal shards), each at most ``block`` elements
    rounded up to ``align`` (8 for bit packing); the tensor is zero-padded."""
    nb = n * math.ceil(numel / (n * block))
    bs = math.ceil(numel / nb)
    return nb, align * math.ceil(bs / align)


def _per_tensor(numel: int, matrices, fn: Callable[[int], float]) -> float:
    """Sum of ``fn`` over the adapter's tensors; a bucket gets its share."""
    if matrices is None:
        return fn(numel)
    sizes = [m * k for m, k in matrices]
    total = sum(sizes)
    if numel >= total:  # the whole adapter (+ any 1-D parameters outside the matrices)
        return sum(fn(x) for x in sizes) + (fn(numel - total) if numel > total else 0.0)
    return sum(fn(x) for x in sizes) * numel / total


def _two_phase(numel: int, n: int, bits: int, block: int, matrices) -> list[Collective]:
    # phase 1: every rank hands its whole compressed bucket (n equal shards:
    # codes + one fp32 scale per block) to an all-to-all and reduces the shard
    # it owns; phase 2: the reduced shard, compressed again, is all-gathered.
    align = 8 if bits == 1 else 1

    def compressed(m: int) -> float:
        nb, bs = _param_blocks(m, block, n, align)
        return nb * bs * bits / 8 + 4 * nb

    total = _per_tensor(numel, matrices, compressed)
    return [Collective("all_to_all", total), Collective("all_gather", total / n)]


def powersgd_floats(numel: int, rank: int, matrices=None, lora_r: int = 8,
                    min_rate: float = 2.0) -> tuple[float, float, float]:
    """(P floats, Q floats, uncompressed floats) PowerSGD sends for ``numel`` elements.

    A matrix m x k is compressed to P (m x rank) and Q (k x rank) when that
    shrinks it by at least ``min_rate``; otherwise it is sent whole.  Elements outside the given matrices (1-D parameters) are sent
    whole.  Without matrices: LoRA matrices lora_r x 1024.  Results scale
    linearly when ``numel`` is a bucket's share of the matrices.
    """
    matrices_given = matrices is not None
    if not matrices_given:
        matrices = ((lora_r, 1024),)
        total = lora_r * 1024
    else:
        total = sum(m * k for m, k in matrices)
    p = q = u = 0.0
    for m, k in matrices:
        if m * k >= min_rate * (m + k) * rank:
            p, q = p + m * rank, q + k * rank
        else:
            u += m * k
    if matrices_given and numel >= total:  # whole adapter (+ 1-D parameters outside matrices)
        return p, q, u + (numel - total)
    scale = numel / total  # a bucket's share
    return p * scale, q * scale, u * scale


def _periodic(numel: int, opts: dict) -> list[Collective]:
    # the average of the weights (local SGD, fp32) or of the outer delta (DiLoCo)
    return [Collective("all_reduce", _DTYPE_BYTES[opts.get("delta_dtype", "fp32")] * numel)]


_COLLECTIVES: dict[str, Callable[..., list[Collective]]] = {
    "none": lambda numel, n, o, mx, r: [],
    "allreduce": lambda numel, n, o, mx, r: [Collective("all_reduce", 4 * numel)],
    "fp16": lambda numel, n, o, mx, r: [Collective("all_reduce", 2 * numel)],
    "bf16": lambda numel, n, o, mx, r: [Collective("all_reduce", 2 * numel)],
    "int8": lambda numel, n, o, mx, r: _two_phase(numel, n, 8, o["block"], mx),
    "onebit": lambda numel, n, o, mx, r: _two_phase(numel, n, 1, o["block"], mx),
    # values (fp32) and indices (int32) of the k largest, gathered from every rank
    "topk": lambda numel, n, o, mx, r: [Collective("all_gather", _per_tensor(
        numel, mx, lambda m: 8 * max(1, math.ceil(o["ratio"] * m))))],
    # two all-reduces per bucket: P (uncompressed tensors ride along), then Q
    "powersgd": lambda numel, n, o, mx, r: (lambda p, q, u: [
        Collective("all_reduce", 4 * (p + u)), Collective("all_reduce", 4 * q)])(
            *powersgd_floats(numel, o["rank"], mx, r, o["min_compression_rate"])),
    "local": lambda numel, n, o, mx, r: _periodic(numel, o),
    "diloco": lambda numel, n, o, mx, r: _periodic(numel, o),
}


def strategy_options(name: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults of ``name`` updated with ``overrides``, validated."""
    if name not in DEFAULT_OPTIONS:
        raise ConfigError("strategy", name, "choose one of " + ", ".join(STRATEGIES + (NONE,)))
    opts = dict(DEFAULT_OPTIONS[name])
    for key, value in (overrides or {}).items():
        if key in _STEADY_STATE_OPTIONS and name != NONE:
            continue  # the strategies take them; they do not change a steady-state step
        if key not in opts:
            known = ", ".join(sorted(DEFAULT_OPTIONS[name])) or "none"
            raise ConfigError(f"{name}.{key}", value, f"{name} takes the options: {known}")
        opts[key] = value
    for key, value in opts.items():
        field_name = f"{name}.{key}"
        if key in ("block", "rank", "period", "delay"):
            _positive_int(value, field_name)
        elif key == "streaming" and not isinstance(value, bool):
            raise ConfigError(field_name, value, "use true or false")
        elif key == "min_compression_rate":
            _positive_number(value, field_name, zero_ok=True)
        elif key == "ratio":
            if not _is_number(value) or not 0 < value <= 1:
                raise ConfigError(field_name, value, "use a fraction in (0, 1], e.g. 0.01")
        elif key == "delta_dtype" and value not in _DTYPE_BYTES:
            raise ConfigError(field_name, value, "use fp32, fp16 or bf16")
    if opts.get("streaming") and not opts["delay"] < opts["period"]:
        raise ConfigError(f"{name}.delay", opts["delay"], "streaming needs 1 <= delay < period")
    return opts


def collectives(name: str, numel: int, world_size: int, *, matrices=None, lora_r: int = 8,
                **opts: Any) -> list[Collective]:
    """The collectives one sync of ``numel`` elements makes under ``name``."""
    o = strategy_options(name, opts)
    return _COLLECTIVES[name](numel, world_size, o, matrices, lora_r)


def wire_bytes(name: str, numel: int, world_size: int, *, matrices=None, lora_r: int = 8,
               **opts: Any) -> float:
    """Payload bytes this rank hands to collectives per step for one bucket of
    ``numel`` elements (periodic strategies: amortized over their period)."""
    o = strategy_options(name, opts)
    total = sum(c.payload_bytes for c in _COLLECTIVES[name](numel, world_size, o, matrices,
                                                            lora_r))
    return total / o["period"] if name in PERIODIC else total


# --------------------------------------------------------------------------- prediction

@dataclass(frozen=True)
class Prediction:
    """Predicted cost of one optimizer step (per rank) under one strategy."""

    strategy: str
    options: dict
    world_size: int
    compute_s: float
    encode_s: float
    #: time the collectives take, summed (amortized for periodic strategies)
    comm_s: float
    #: the part of comm_s the step waits on (not hidden behind backward)
    exposed_comm_s: float
    step_s: float
    #: all ranks together
    samples_per_s: float
    #: vs the no-sync ceiling (compute only)
    efficiency: float
    #: payload bytes handed to collectives per rank per step (contract definition)
    wire_bytes: float
    #: bytes on the critical path of the link per rank per step (what beta multiplies)
    link_bytes: float
    #: what fp32 all-reduce would hand over per step
    fp32_bytes: float
    #: latency terms (messages on the critical path) per step
    messages: float
    #: syncs per step (1 for per-step strategies, 1/period for periodic ones)
    syncs_per_step: float
    buckets: int
    lossless: bool
    periodic: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bucket_layout(numel: int, bucket_bytes: float, first_bucket_bytes: float | None = None
                  ) -> list[int]:
    """Elements per DDP bucket in gradient-ready order (fp32 gradients, 4 B each)."""
    first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    out: list[int] = []
    left = numel
    cap = first
    while left > 0:
        take = min(left, max(1, int(cap // 4)))
        out.append(take)
        left -= take
        cap = bucket_bytes
    return out


def _encode_ns(name: str, opts: dict, workload: Workload) -> float:
    if name in workload.encode_ns:
        return float(workload.encode_ns[name])
    ns = ENCODE_NS[name]
    return ns * opts["rank"] if name == "powersgd" else ns


def predict(strategy: str, net: Net, workload: Workload) -> Prediction:
    """Predicted step of ``strategy`` on ``net`` for ``workload``."""
    opts = strategy_options(strategy, workload.options.get(strategy))
    n, numel = net.world_size, workload.adapter_params
    compute = workload.compute_s
    make = _COLLECTIVES[strategy]
    encode = _encode_ns(strategy, opts, workload) * numel * 1e-9
    wire = link = msgs = comm = exposed = 0.0
    periodic = strategy in PERIODIC
    if periodic:
        period = opts["period"]
        calls = make(numel, n, opts, workload.matrices, workload.lora_r)
        for c in calls:
            m, b = _terms(c, net)
            msgs, link, wire = msgs + m, link + b, wire + c.payload_bytes
            comm += collective_time(c, net)
        # after the optimizer step: nothing to hide behind, unless streaming
        # lets it run during the next `delay` steps' compute
        exposed = max(0.0, comm - opts["delay"] * compute) if opts["streaming"] else comm
        wire, link, msgs, comm, encode, exposed = (
            x / period for x in (wire, link, msgs, comm, encode, exposed))
        syncs, nbuckets = 1.0 / period, 1
    else:
        layout = bucket_layout(numel, workload.bucket_bytes, workload.first_bucket_bytes)
        backward = compute * workload.backward_share
        head = backward * workload.head_share   # before the first adapter gradient
        spread = backward - head                 # over which the adapter's gradients appear
        done = 0
        end = 0.0  # time since the backward pass started
        clock = head      # two-phase: backward progress, held up by the hooks
        p1_end = 0.0      # two-phase: when the previous bucket's phase 1 finishes
        p2_prev = 0.0     # two-phase: the previous bucket's phase 2, not yet issued
        for b in layout:
            times = []
            for c in make(b, n, opts, workload.matrices, workload.lora_r):
                m, nb = _terms(c, net)
                msgs, link, wire = msgs + m, link + nb, wire + c.payload_bytes
                times.append(collective_time(c, net))
            comm += sum(times)
            if strategy in TWO_PHASE:
                clock += spread * b / numel            # compute that fills this bucket
                clock = max(clock, p1_end)             # the hook waits for k-1's phase 1
                end = max(clock, end) + p2_prev        # then issues k-1's phase 2
                end = max(clock, end) + times[0]       # and this bucket's phase 1
                p1_end, p2_prev = end, times[1]
            else:
                done += b
                ready = head + spread * done / numel
                end = max(ready, end) + sum(times)
        if strategy in TWO_PHASE and comm > 0:
            clock = max(clock, p1_end)                 # the last hook drains at once
            end = max(clock, end) + p2_prev
        exposed = max(0.0, end - backward) if comm > 0 else 0.0
        syncs, nbuckets = (0.0 if strategy == NONE else 1.0), len(layout)
    step = compute + encode + exposed
    return Prediction(
        strategy=strategy, options=opts, world_size=n, compute_s=compute, encode_s=encode,
        comm_s=comm, exposed_comm_s=exposed, step_s=step,
        samples_per_s=n * workload.batch_size / step, efficiency=compute / step,
        wire_bytes=wire, link_bytes=link, fp32_bytes=4.0 * numel, messages=msgs,
        syncs_per_step=syncs, buckets=nbuckets,
        lossless=strategy in LOSSLESS, periodic=periodic,
    )
