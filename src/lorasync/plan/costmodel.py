"""Cost model of gradient sync: pure functions, no I/O, no torch.

Predicts the time of one optimizer step under each sync strategy from a few
numbers that can be measured by ``lorasync probe`` or calibrated from a run's
``metrics.jsonl`` (every one is a plain dataclass field):

    Net       alpha_s (latency per message), bandwidth_Bps (1/beta), world_size;
              with several ranks per node: ranks_per_node, the intra-node link
              (intra_alpha_s, intra_bandwidth_Bps) and the layout
    Workload  adapter_params, compute_s, batch_size, backward_share, head_share,
              bucket_bytes, encode_ns (per strategy), strategy options

The model
---------
* Collectives follow the alpha-beta (Hockney) model: time = messages * alpha
  + bytes on the critical path * beta.  Ring all-reduce of P bytes:
  2(n-1) alpha + 2(n-1)/n P beta; all-gather of p bytes per rank:
  (n-1) alpha + (n-1) p beta, i.e. (n-1)/n of the gathered total; all-to-all of
  a C-byte send buffer: alpha + (n-1)/n C beta (gloo posts every peer's send
  and receive before it waits for any, and NCCL groups them the same way,
  so the n-1 messages travel at once: one latency, the bytes sharing the
  link; docs/cost-model.md has the run that showed it).
* What each strategy hands to which collective is the strategy catalog's
  byte formula (:func:`lorasync.catalog.collectives`, the one the strategies
  are tested against): per sync, for the whole adapter; a bucket hands over
  its share of it.
* Per-step (DDP hook) strategies sync every bucket as soon as its gradients
  are ready.  Buckets fill in gradient-ready order (fp32 gradient bytes; the
  first bucket may be smaller).  Backward starts with the loss and the LM
  head (``head_share`` of it, no adapter gradient yet); LoRA parameters are
  spread evenly over the layers, so bucket k is ready after the head plus
  the fraction of the rest that produced its bytes.  A process group runs
  ``Net.lanes`` collectives at once (gloo: two worker threads per group,
  ``GLOO_LANES``; NCCL: one stream, one at a time), so bucket k's sync
  starts at max(ready_k, end of bucket k - lanes); the latencies of
  collectives in flight together overlap, their bytes share the link, so it
  ends at max(its start + its time, end of bucket k-1 + its byte time).
  With one lane that is max(ready_k, end of bucket k-1) + its time.
  Exposed communication is what is left after the backward pass ends; only
  buckets other than the last can hide behind it.  Two-phase strategies
  (int8, onebit: ``Spec.holds_backward``) also hold the backward pass up: the hook of bucket k first
  waits for phase 1 of bucket k-1 (it must reduce that shard before sending
  phase 2), so backward resumes only when that transfer is done, and phase 2
  of k-1 queues ahead of phase 1 of k on the link.  With a single bucket (the
  3.7 MB default adapter under the trainer's 4 MiB ``bucket_mb``) nothing
  overlaps.
* Periodic strategies (local SGD, DiLoCo) sync once every ``period`` steps
  after the optimizer step; nothing overlaps (with ``streaming`` the sync
  runs during the next ``delay`` steps' compute); costs are amortized.  With
  ``fragments`` each fragment's collective starts at its own step and the
  link carries them one after another; :func:`periodic_exposed` plays a few
  periods of that schedule through (compute, encode, the link as a queue,
  the wait at each apply step), which also covers a sync that does not fit
  its delay, syncs queueing behind each other, and a link too slow for the
  period (the steps then wait for it).
* Encode/decode (casting, quantizing, top-k, PowerSGD matmuls) runs on the
  training thread: ``encode_ns`` per element per sync (the catalog's CPU
  defaults, or what ``auto`` measured on the live device), added to the step.

    step_s = compute_s + encode_s + exposed_comm_s
    efficiency = compute_s / step_s          (the no-sync ceiling's step is compute_s)
    samples_per_s = world_size * batch_size / step_s

Several ranks per node (``Net.ranks_per_node`` G > 1, N = world_size / G
nodes; alpha and bandwidth are the link between nodes):

* flat layout: every collective runs over all N*G ranks.  A ring's steps
  are as slow as its slowest edge, so ring all-reduce and all-gather cost
  what they cost on N*G ranks of the slow link; an all-to-all sends G
  ranks' off-node chunks through each node's link: G (N-1)/N of the send
  buffer per node;
* hierarchical layout (:mod:`lorasync.comm.hierarchy`): each bucket is
  all-reduced inside the node first (ring over G ranks of the intra link, in
  the hook: it holds the backward pass up), the strategy's own collectives run
  on N ranks of the slow link (its byte formula at world size N), and after
  the last bucket every bucket's result is broadcast inside the node as soon
  as its cross-node sync is done.  Periodic strategies: the intra-node
  gradient all-reduce every step, the outer sync on N ranks and a broadcast
  of the adapter inside the node every period.  In shards (the default for
  them, ``--cross-node``) the G cross-node groups carry 1/G of the outer
  sync each, at once: the same ring steps and bytes on the node's link, so
  the same prediction (it still charges the leaders' broadcast of the
  adapter inside the node where shards gather 1/G of the delta: both
  milliseconds on a node's link); that G connections moved it faster on a
  long-delay link (1.26x inside training at 4 x 2) is not modelled.

``Net.allreduce_algo="auto"`` prices every all-reduce with the cheaper of
ring and recursive doubling (what a Wire with a per-message choice does;
:func:`allreduce_choice`).  Recursive doubling on a group that is not a
power of two folds the extra ranks in first: floor(log2 n) + 2 exchanges.

Not modelled: contention between compute and the comm threads for CPU cores,
TCP slow start and loss, stragglers (all ranks are assumed equally fast),
DDP's first iteration (one bucket before it rebuilds by ready order), the
quality cost of lossy or periodic strategies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Mapping, Sequence

from lorasync import catalog
from lorasync.catalog import NONE, STRATEGIES, Collective
from lorasync.errors import ConfigError

__all__ = [
    "MiB", "ALLREDUCE_ALGOS", "LAYOUTS", "Net", "Workload", "Prediction", "ModelShape",
    "MODELS", "lora_matrices", "head_share", "encode_ns", "collective_time", "bucket_layout",
    "GLOO_LANES", "lanes_of",
    "adapter_shapes", "ring_link_load", "predict", "periodic_exposed", "path_terms",
    "allreduce_choice", "rd_exchanges",
]

MiB = 1 << 20

#: collectives one gloo process group runs at once (ProcessGroupGloo's worker
#: threads, 2 by default); NCCL runs a communicator's collectives on one
#: stream, one after another.  bench/gloo_lanes.py measures it
#: (docs/cost-model.md).
GLOO_LANES = 2


def lanes_of(backend: str | None) -> int:
    """Collectives a process group of ``backend`` runs at once (1 if not known)."""
    return GLOO_LANES if backend == "gloo" else 1

ALLREDUCE_ALGOS = ("ring", "recursive_doubling", "reduce_broadcast", "tree", "auto")
#: how collectives span the nodes: all ranks at once, or node, then leaders
LAYOUTS = ("flat", "hierarchical")


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
    #: algorithm the backend uses for all-reduce (gloo and NCCL default to ring;
    #: "auto": the cheaper of ring and recursive doubling per message)
    allreduce_algo: str = "ring"
    #: False where all-to-all is replaced by an all-gather (a backend without it)
    alltoall: bool = True
    #: ranks on each node; alpha_s and bandwidth_Bps are then the link between
    #: nodes, and the intra-node link is described by the two fields below
    ranks_per_node: int = 1
    #: latency per message between ranks of one node
    intra_alpha_s: float = 0.0
    #: bytes per second between ranks of one node; None = not known (needed
    #: for the hierarchical layout)
    intra_bandwidth_Bps: float | None = None
    #: "flat" or "hierarchical" (see the module docstring)
    layout: str = "flat"
    #: collectives of one process group in flight at once (:func:`lanes_of`)
    lanes: int = 1

    def __post_init__(self):
        _positive_number(self.alpha_s, "alpha_s", zero_ok=True)
        _positive_number(self.bandwidth_Bps, "bandwidth_Bps")
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) \
                or self.world_size < 1:
            raise ConfigError("world_size", self.world_size, "use an integer >= 1")
        if self.allreduce_algo not in ALLREDUCE_ALGOS:
            raise ConfigError("allreduce_algo", self.allreduce_algo,
                              "choose one of " + ", ".join(ALLREDUCE_ALGOS))
        g = self.ranks_per_node
        if not isinstance(g, int) or isinstance(g, bool) or g < 1 or self.world_size % g:
            raise ConfigError("ranks_per_node", g, f"use an integer >= 1 that divides "
                              f"world_size {self.world_size}")
        _positive_number(self.intra_alpha_s, "intra_alpha_s", zero_ok=True)
        if self.intra_bandwidth_Bps is not None:
            _positive_number(self.intra_bandwidth_Bps, "intra_bandwidth_Bps")
        if not isinstance(self.lanes, int) or isinstance(self.lanes, bool) or self.lanes < 1:
            raise ConfigError("lanes", self.lanes, "use an integer >= 1 (gloo runs 2 "
                              "collectives at once, NCCL 1)")
        if self.layout not in LAYOUTS:
            raise ConfigError("layout", self.layout, "choose one of " + ", ".join(LAYOUTS))
        if self.layout == "hierarchical" and self.intra_bandwidth_Bps is None:
            raise ConfigError("intra_bandwidth_Bps", None, "the hierarchical layout needs the "
                              "intra-node link's bandwidth (e.g. --intra-rate)")

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_Bps

    @property
    def nodes(self) -> int:
        """N = world_size / ranks_per_node."""
        return self.world_size // self.ranks_per_node

    @property
    def hierarchical(self) -> bool:
        """Whether the hierarchical layout applies (several ranks per node)."""
        return self.layout == "hierarchical" and self.ranks_per_node > 1


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
    #: 2-D adapter matrices (rows, cols): PowerSGD compresses them, int8/onebit
    #: cut and top-k picks per tensor; None = LoRA pairs of rank lora_r with
    #: an assumed 1024-wide other side (see :func:`adapter_shapes`)
    matrices: tuple[tuple[int, int], ...] | None = None
    lora_r: int = 8
    #: per strategy: ns per element per sync, replacing the catalog's CPU default
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
            if name not in STRATEGIES + (NONE,):
                raise ConfigError("encode_ns", name, "name a strategy: " + ", ".join(STRATEGIES))
            _positive_number(ns, f"encode_ns.{name}", zero_ok=True)
        for name, opts in self.options.items():
            _options(name, opts)  # validates


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
    element-wise work are left out (docs/cost-model.md holds it against a
    measured backward).  0.0 when the vocabulary is unknown.
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

def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def rd_exchanges(n: int) -> int:
    """Exchanges of recursive doubling on n ranks: log2 n for a power of two;
    otherwise floor(log2 n) plus the fold in and the result back out."""
    if n <= 1:
        return 0
    k = n.bit_length() - 1
    return k if n == 1 << k else k + 2


def _allreduce_terms(algo: str, n: int, p: float, g: int = 1) -> tuple[float, float]:
    if algo == "ring":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n * p
    if algo == "recursive_doubling":
        # with g ranks per node the exchanges between nodes send g messages
        # through each node's link at once (those inside a node are not counted)
        return float(rd_exchanges(n)), rd_exchanges(n // g) * g * p
    if algo == "tree":
        # NCCL's pipelined double binary tree: log-depth latency up and down,
        # every byte through each link about twice
        return 2.0 * _log2(n), 2.0 * p
    return 2.0 * _log2(n), 2.0 * _log2(n) * p  # binomial reduce, then broadcast


def allreduce_choice(nbytes: float, n: int, alpha_s: float, bandwidth_Bps: float) -> str:
    """``ring`` or ``recursive_doubling``, whichever the alpha-beta model says
    all-reduces ``nbytes`` on ``n`` ranks sooner (ring on ties): recursive
    doubling where latency binds (few bytes, many ranks, long round trips)."""
    beta = 1.0 / bandwidth_Bps
    times = {}
    for algo in ("ring", "recursive_doubling"):
        m, b = _allreduce_terms(algo, n, float(nbytes))
        times[algo] = m * alpha_s + b * beta
    return "recursive_doubling" if times["recursive_doubling"] < times["ring"] else "ring"


def _terms(c: Collective, net: Net) -> tuple[float, float]:
    """(messages, bytes) on the critical path of one collective."""
    n, p = net.world_size, float(c.payload_bytes)
    g = net.ranks_per_node
    if n <= 1 or p <= 0:
        return 0.0, 0.0
    if c.kind == "all_reduce":
        algo = net.allreduce_algo
        if algo == "auto":
            algo = allreduce_choice(p, n, net.alpha_s, net.bandwidth_Bps)
        return _allreduce_terms(algo, n, p, g)
    if c.kind == "all_gather":
        return float(n - 1), (n - 1) * p
    if c.kind == "all_to_all":
        if net.alltoall:
            # every pair's message at once (one latency); each node's link
            # carries its g ranks' chunks for the other nodes
            return 1.0, g * (n // g - 1) / (n // g) * p if g > 1 else (n - 1) / n * p
        return float(n - 1), (n - 1) * p  # all-gather of the whole buffer instead
    if c.kind == "broadcast":
        return float(_log2(n)), _log2(n) * p
    raise ValueError(f"collective kind: unknown {c.kind!r}")


def path_terms(c: Collective, net: Net) -> tuple[float, float]:
    """(messages, bytes) on the critical path of collective ``c`` on ``net``:
    what alpha and beta multiply."""
    return _terms(c, net)


def collective_time(c: Collective, net: Net) -> float:
    msgs, nbytes = _terms(c, net)
    return msgs * net.alpha_s + nbytes * net.beta_s_per_byte


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


# --------------------------------------------------------------------------- bytes

def _options(name: str, given: Mapping[str, Any] | None) -> catalog.Options:
    """``name``'s options for a step: the catalog's, validated; ``none`` and
    the plannable strategies only."""
    if name != NONE and name not in STRATEGIES:
        raise ConfigError("strategy", name, "choose one of " + ", ".join(STRATEGIES + (NONE,)))
    return catalog.parse_options(name, given)


def adapter_shapes(workload: "Workload") -> tuple[tuple[int, ...], ...]:
    """The adapter's tensors as the byte formula sees them: the workload's
    matrices (plus its 1-D remainder), or, without them, LoRA factors of rank
    ``lora_r`` with a 1024-wide other side (the remainder a narrower one)."""
    numel, r = workload.adapter_params, workload.lora_r
    if workload.matrices is not None:
        shapes = list(workload.matrices)
        rest = numel - sum(m * k for m, k in shapes)
        if rest > 0:
            shapes.append((rest,))
        return tuple(shapes)
    shapes = [(r, 1024)] * (numel // (r * 1024))
    rest = numel - r * 1024 * len(shapes)
    if rest > 0:
        shapes.append((r, rest // r) if rest % r == 0 else (rest,))
    return tuple(shapes)


@lru_cache(maxsize=1024)
def _sync(name: str, opts: catalog.Options, shapes: tuple, n: int, numel: int
          ) -> tuple[Collective, ...]:
    """One sync of the whole adapter (``numel`` elements), as the catalog's
    collectives; matrices holding more than the adapter scale down to it."""
    calls = catalog.collectives(name, shapes, n, opts)
    total = sum(math.prod(s) for s in shapes)
    if total > numel:
        calls = [Collective(c.kind, c.payload_bytes * numel / total) for c in calls]
    return tuple(calls)


def encode_ns(name: str, options: Mapping[str, Any] | catalog.Options | None = None) -> float:
    """The catalog's encode+decode cost of ``name`` on one CPU thread, ns per
    element per sync (calibrate another device with ``Workload.encode_ns``,
    e.g. ``lorasync plan --encode-ns`` from a run's encode_s / params)."""
    return catalog.spec(name).encode_ns(catalog.parse_options(name, options))


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
    #: "flat" or "hierarchical" (Net.layout)
    layout: str = "flat"
    ranks_per_node: int = 1
    #: payload bytes per step that each *node's* ranks hand to collectives
    #: spanning nodes (flat: all of them; hierarchical: the leader's)
    inter_bytes: float = 0.0
    #: payload bytes per step per rank handed to collectives inside a node
    intra_bytes: float = 0.0

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


def _encode_ns(name: str, opts: catalog.Options, workload: Workload) -> float:
    if name in workload.encode_ns:
        return float(workload.encode_ns[name])
    return catalog.spec(name).encode_ns(opts)


def periodic_exposed(times: list[float], opts: catalog.Options, compute_s: float,
                     encode_s: float = 0.0, periods: int = 3) -> float:
    """Seconds per step a periodic sync makes the step wait, in steady state.

    ``times``: each fragment's collective (seconds, in fragment order) on an
    idle link; ``encode_s``: encode+decode of one whole sync, spent at the
    launches.  Steps of ``compute_s`` are played through for ``periods``
    periods after one to settle: a fragment's collective is launched after
    its step (:func:`lorasync.catalog.fragments_due`), starts when the link is
    free (collectives of one group run one after another) and is applied
    ``delay`` steps later (at once without streaming), the step waiting for
    it if it has not arrived.
    """
    H, F = opts.period, len(times)
    if F == 0:
        return 0.0
    if not opts.streaming:   # every sync blocks its step, on an idle link
        return sum(times) / H
    delay = opts.delay
    enc = encode_s / F
    t = link_free = waited = 0.0
    pending: list[tuple[int, float]] = []
    settle = H
    for s in range(1, settle + H * periods + 1):
        t += compute_s
        while pending and pending[0][0] <= s:
            done = pending.pop(0)[1]
            if done > t:
                if s > settle:
                    waited += done - t
                t = done
        for f in catalog.fragments_due(s, H, F):
            t += enc
            start = max(t, link_free)
            link_free = start + times[f]
            pending.append((s + delay, link_free))
    # a link busier than the compute a period leaves it falls further behind
    # every period: in steady state each period takes the link's time, however
    # many steps late the updates may come (a few periods played through
    # would hide that backlog behind a long delay)
    backlog = (sum(times) - H * compute_s - encode_s) / H
    return max(waited / (H * periods), backlog)


class _Lanes:
    """A process group's collectives in flight (module docstring): each one
    starts when it is issued and one of ``n`` lanes is free; latencies of
    collectives in flight together overlap, their bytes share the link."""

    def __init__(self, n: int):
        self.n, self.ends = n, []

    def issue(self, ready: float, time_s: float, latency_s: float) -> float:
        """End of a collective issued at ``ready`` taking ``time_s`` alone, of
        which ``latency_s`` is latency; collectives end in issue order."""
        start = max(ready, self.ends[-self.n] if len(self.ends) >= self.n else 0.0)
        prev = self.ends[-1] if self.ends else 0.0
        end = max(start + time_s, prev + (time_s - latency_s))
        self.ends.append(end)
        return end


def predict(strategy: str, net: Net, workload: Workload) -> Prediction:
    """Predicted step of ``strategy`` on ``net`` for ``workload``."""
    opts = _options(strategy, workload.options.get(strategy))
    spec = catalog.spec(strategy)
    if net.hierarchical and strategy != NONE and net.world_size > 1:
        return _predict_hierarchical(strategy, opts, spec, net, workload)
    n, numel = net.world_size, workload.adapter_params
    compute = workload.compute_s
    whole = _sync(strategy, opts, adapter_shapes(workload), n, numel)
    encode = _encode_ns(strategy, opts, workload) * numel * 1e-9
    wire = link = msgs = comm = exposed = 0.0
    periodic = spec.periodic
    if periodic:
        period = opts.period
        times = []
        for c in whole:   # one collective per fragment
            m, b = _terms(c, net)
            msgs, link, wire = msgs + m, link + b, wire + c.payload_bytes
            times.append(collective_time(c, net))
        comm = sum(times)
        exposed = periodic_exposed(times, opts, compute, encode) * period
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
        lanes = _Lanes(net.lanes)
        for b in layout:
            times, lat = [], 0.0
            for w in whole:  # this bucket's share of the sync
                c = Collective(w.kind, w.payload_bytes * b / numel)
                m, nb = _terms(c, net)
                msgs, link, wire = msgs + m, link + nb, wire + c.payload_bytes
                times.append(collective_time(c, net))
                lat += m * net.alpha_s
            comm += sum(times)
            if spec.holds_backward:
                clock += spread * b / numel            # compute that fills this bucket
                clock = max(clock, p1_end)             # the hook waits for k-1's phase 1
                end = max(clock, end) + p2_prev        # then issues k-1's phase 2
                end = max(clock, end) + times[0]       # and this bucket's phase 1
                p1_end, p2_prev = end, times[1]
            else:
                done += b
                ready = head + spread * done / numel
                end = lanes.issue(ready, sum(times), lat)
        if spec.holds_backward and comm > 0:
            clock = max(clock, p1_end)                 # the last hook drains at once
            end = max(clock, end) + p2_prev
        exposed = max(0.0, end - backward) if comm > 0 else 0.0
        syncs, nbuckets = (0.0 if strategy == NONE else 1.0), len(layout)
    step = compute + encode + exposed
    spans = net.nodes > 1
    return Prediction(
        strategy=strategy, options=opts.as_dict(), world_size=n, compute_s=compute, encode_s=encode,
        comm_s=comm, exposed_comm_s=exposed, step_s=step,
        samples_per_s=n * workload.batch_size / step, efficiency=compute / step,
        wire_bytes=wire, link_bytes=link, fp32_bytes=4.0 * numel, messages=msgs,
        syncs_per_step=syncs, buckets=nbuckets,
        lossless=spec.lossless, periodic=periodic, layout="flat",
        ranks_per_node=net.ranks_per_node,
        inter_bytes=wire * net.ranks_per_node if spans else 0.0,
        intra_bytes=0.0 if spans else wire,
    )


def _predict_hierarchical(strategy: str, opts: catalog.Options, spec: catalog.Spec, net: Net,
                          workload: Workload) -> Prediction:
    """The hierarchical layout (module docstring): exact all-reduce inside
    the node in every bucket's hook, the strategy across the N leaders, a
    broadcast inside the node."""
    g, nn, numel = net.ranks_per_node, net.nodes, workload.adapter_params
    inter = Net(alpha_s=net.alpha_s, bandwidth_Bps=net.bandwidth_Bps, world_size=nn,
                allreduce_algo=net.allreduce_algo, alltoall=net.alltoall, lanes=net.lanes)
    intra = Net(alpha_s=net.intra_alpha_s, bandwidth_Bps=net.intra_bandwidth_Bps,
                world_size=g)
    compute = workload.compute_s
    whole = _sync(strategy, opts, adapter_shapes(workload), nn, numel)
    encode = _encode_ns(strategy, opts, workload) * numel * 1e-9

    def reduce_t(b: int) -> float:    # exact node mean of a bucket, in its hook
        return collective_time(Collective("all_reduce", 4.0 * b), intra)

    def bcast_t(b: int) -> float:     # the result to the node's other ranks
        return collective_time(Collective("broadcast", 4.0 * b), intra)

    layout = bucket_layout(numel, workload.bucket_bytes, workload.first_bucket_bytes)
    wire = link = msgs = comm = 0.0
    intra_bytes = 0.0
    blocked = 0.0   # what the intra-node reduces hold backward up by
    if spec.periodic:
        period = opts.period
        outer = 0.0
        for c in whole:
            m, b = _terms(c, inter)
            msgs, link, wire = msgs + m, link + b, wire + c.payload_bytes
            outer += collective_time(c, inter)
        share = bcast_t(numel)
        exposed_outer = max(0.0, outer - opts.delay * compute) if opts.streaming else outer
        per_step_reduce = sum(reduce_t(b) for b in layout)
        intra_bytes = 4.0 * numel + 4.0 * numel / period
        comm = (outer + share) / period + per_step_reduce
        exposed = (exposed_outer + share) / period + per_step_reduce
        wire, link, msgs, encode = (x / period for x in (wire, link, msgs, encode))
        syncs, nbuckets = 1.0 / period, len(layout)
    else:
        backward = compute * workload.backward_share
        head = backward * workload.head_share
        spread = backward - head
        end = 0.0         # the link between nodes: when it is free again
        clock = head      # the training thread: backward progress, held up by the hooks
        p1_end = p2_prev = 0.0
        done_at: list[float] = []
        lanes = _Lanes(net.lanes)
        for b in layout:
            times, lat = [], 0.0
            for w in whole:
                c = Collective(w.kind, w.payload_bytes * b / numel)
                m, nb = _terms(c, inter)
                msgs, link, wire = msgs + m, link + nb, wire + c.payload_bytes
                times.append(collective_time(c, inter))
                lat += m * inter.alpha_s
            comm += sum(times)
            clock += spread * b / numel              # compute that fills this bucket
            r = reduce_t(b)
            clock += r                               # the hook's intra-node all-reduce
            blocked += r
            comm += r
            if spec.holds_backward:
                clock = max(clock, p1_end)
                if done_at or p2_prev:               # the previous bucket's phase 2
                    end = max(clock, end) + p2_prev
                    done_at.append(end)
                end = max(clock, end) + times[0]
                p1_end, p2_prev = end, times[1]
            else:
                end = lanes.issue(clock, sum(times), lat)
                done_at.append(end)
        if spec.holds_backward and whole:
            clock = max(clock, p1_end)
            end = max(clock, end) + p2_prev
            done_at.append(end)
        # after the last hook: each bucket broadcast once its sync is done
        t = clock
        for b, d in zip(layout, done_at):
            t = max(t, d) + bcast_t(b)
            comm += bcast_t(b)
        exposed = max(0.0, t - backward)
        intra_bytes = 2 * 4.0 * numel
        syncs, nbuckets = 1.0, len(layout)
    step = compute + encode + exposed
    return Prediction(
        strategy=strategy, options=opts.as_dict(), world_size=net.world_size, compute_s=compute,
        encode_s=encode, comm_s=comm, exposed_comm_s=exposed, step_s=step,
        samples_per_s=net.world_size * workload.batch_size / step, efficiency=compute / step,
        wire_bytes=wire + intra_bytes, link_bytes=link, fp32_bytes=4.0 * numel,
        messages=msgs, syncs_per_step=syncs, buckets=nbuckets, lossless=spec.lossless,
        periodic=spec.periodic, layout="hierarchical", ranks_per_node=g,
        inter_bytes=wire, intra_bytes=intra_bytes,
    )
