"""The catalog of sync strategies: what each one is, in one place, torch-free.

For every strategy name this module holds

* its options: a typed, frozen dataclass with defaults, ranges and help
  text (:func:`parse_options` validates a user's ``KEY=VALUE`` pairs against
  it and names the field, the value and the fix);
* what kind of strategy it is (:class:`Spec`: per-step or periodic, lossless,
  whether its hooks hold the backward pass up, whether the planner ranks it);
* its encode+decode cost on one CPU thread (the cost model's default);
* its byte formula: the collectives one sync hands payload bytes to
  (:func:`collectives`, :func:`wire_bytes`).

The strategies in :mod:`lorasync.comm` take their options from here, the
cost model in :mod:`lorasync.plan.costmodel` prices these collectives, and
the dist tests check that the strategies hand exactly these bytes to their
collectives.  A new option or a new strategy is written here once.

Bytes are payload bytes one rank hands to collectives, at the dtype sent
(docs/contracts.md "Wire bytes"), for the whole adapter, per sync.  Tensors
are given as shapes (``(rows, cols)`` or ``(numel,)``) or plain element
counts; shapes matter for PowerSGD (which compresses 2-D tensors) and for the
per-tensor blocks of int8/onebit and the per-tensor k of top-k.

Per strategy, with N elements, n ranks, per tensor m elements cut by
:func:`param_blocks` into nb blocks of bs (m' = nb*bs >= m, padding):

    allreduce   4 N                             all_reduce
    fp16, bf16  2 N                             all_reduce
    int8        (1 + 1/n) * sum(m' + 4 nb)      all_to_all, then all_gather
    onebit      (1 + 1/n) * sum(m'/8 + 4 nb)    ~ 1/32 of fp32 (x (1+1/n)) + scales
    topk        8 * sum(max(1, ceil(ratio m)))  int32 index + fp32 value, all_gather
    powersgd    4 * sum(k (a + b)) over a x b matrices it compresses
                + 4 * numel of the other tensors   (two all-reduces)
    local       4 N every period steps
    diloco      every period steps, one collective per fragment (fragments=F;
                the fragments are synced in turn, see fragment_ranges and
                fragments_due), for the fragment's tensors:
                fp32/fp16/bf16, delta_topk 1:  N_f * bytes(delta_dtype)   all_reduce
                otherwise (int8/int4/int2, or delta_topk < 1):            all_gather
                    sum over its tensors of delta_tensor_bytes(m):
                    k = m, or max(1, ceil(delta_topk m)) entries kept
                    + k indices (2 bytes while m <= 65536, else 4) when sparse
                    + values: k * bytes(fp32/fp16/bf16), or for int8/int4/int2
                      ceil(k / delta_block) blocks of delta_block codes
                      (1, 1/2 or 1/4 byte each) + one fp32 scale per block
    none        0
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Sequence

from lorasync.errors import ConfigError, UnknownKey

__all__ = [
    "Options", "Spec", "Collective", "SPECS", "STRATEGIES", "NONE", "LOSSLESS", "PERIODIC",
    "spec", "names", "parse_options", "option_help", "param_blocks", "tensor_shapes",
    "collectives", "wire_bytes", "DTYPE_BYTES", "DELTA_DTYPES", "DELTA_BITS",
    "delta_tensor_bytes", "delta_gathered", "fragment_ranges", "fragment_offsets",
    "fragments_due", "streamed_in_flight", "flat_only", "HIERARCHIES", "CROSS_NODE",
    "ALLREDUCE_ALGOS",
]

#: bytes per element of the dtypes a sync may send
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
#: dtypes DiLoCo's outer delta may travel in: the float casts are all-reduced
#: (when dense); int8/int4/int2 are blockwise codes with one fp32 scale per
#: block, all-gathered and summed in fp32 by every rank (int2: four levels,
#: +-scale/2 and +-3 scale/2, no zero: meant for top-k values, SparseLoCo's
#: 2-bit outer sync)
DELTA_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4", "int2")
#: bits per value of each delta dtype
DELTA_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4, "int2": 2}
#: a sparse delta's indices are local to their tensor: 2 bytes while it has
#: at most this many elements (LoRA factors have a few thousand), else 4
SHORT_INDEX_MAX = 1 << 16


# --------------------------------------------------------------------------- options

def option(default: Any, help: str, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False,
           choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field of an options class: default, help text and the valid range."""
    return field(default=default, metadata={"help": help, "lo": lo, "hi": hi, "lo_open": lo_open,
                                            "hi_open": hi_open, "choices": choices})


def _range_text(m: Mapping[str, Any]) -> str:
    lo, hi = m["lo"], m["hi"]
    if hi is None:
        return f"> {lo:g}" if m["lo_open"] else f">= {lo:g}"
    return (f"in {'(' if m['lo_open'] else '['}{lo:g}, "
            f"{'inf' if math.isinf(hi) else f'{hi:g}'}{')' if m['hi_open'] else ']'}")


@dataclass(frozen=True)
class Options:
    """Base of every strategy's options.

    Subclasses declare their fields with :func:`option`; each field's type is
    its default's (bool, int, float or str).  Construction checks every field
    (type, range, choices) and :meth:`check` the relations between fields;
    :meth:`parse` also rejects unknown names and options that do not apply
    with the others given.  Every error is a ``ConfigError`` (a ValueError)
    named ``STRATEGY.OPTION``.
    """

    #: the strategy these options belong to (error messages name it)
    STRATEGY: ClassVar[str] = "?"

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, self._coerce(f, getattr(self, f.name)))
        self.check()

    def _coerce(self, f: dataclasses.Field, v: Any) -> Any:
        m, default, name = f.metadata, f.default, f"{self.STRATEGY}.{f.name}"
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise ConfigError(name, v, "use true or false")
        elif isinstance(default, int):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(name, v, f"use an integer {_range_text(m)}")
            v = int(v)   # a plain int (an IntEnum would not load from a safe checkpoint)
        elif isinstance(default, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ConfigError(name, v, f"use a number {_range_text(m)}"
                                  if m["lo"] is not None else "use a number")
            v = float(v)
        elif isinstance(default, str):
            if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
                v = ",".join(v)  # a YAML list where a comma list is meant
            if not isinstance(v, str):
                raise ConfigError(name, v, "use a string")
            v = str.__str__(v)   # a plain str, also for a str subclass (an Enum member)
        if m["choices"] is not None and v not in m["choices"]:
            raise ConfigError(name, v, "use one of " + ", ".join(map(str, m["choices"])))
        lo, hi = m["lo"], m["hi"]
        if lo is not None and (v < lo or (m["lo_open"] and v == lo)
                               or (hi is not None and (v > hi or (m["hi_open"] and v == hi)))):
            kind = "an integer" if isinstance(default, int) else "a number"
            raise ConfigError(name, v, f"use {kind} {_range_text(m)}")
        return v

    def check(self, given: frozenset[str] = frozenset()) -> None:
        """Relations between fields (``given``: the names the user set)."""

    @classmethod
    def parse(cls, given: Mapping[str, Any] | None = None) -> "Options":
        """The defaults updated with ``given`` (the user's ``KEY=VALUE`` pairs)."""
        given = dict(given or {})
        known = [f.name for f in fields(cls)]
        for key in given:
            if key not in known:
                raise UnknownKey(cls.STRATEGY, key, known, what="option",
                                 field=f"{cls.STRATEGY}.{key}")
        opts = cls(**given)
        opts.check(frozenset(given))
        return opts

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _o(strategy: str):
    """Class decorator: a frozen options dataclass of ``strategy``."""
    def wrap(cls):
        cls.STRATEGY = strategy
        return dataclass(frozen=True)(cls)
    return wrap


_WARMUP_HELP = "plain fp32 all-reduce for the first N optimizer steps"


@dataclass(frozen=True)
class _NoOptions(Options):
    pass


@dataclass(frozen=True)
class _Warmup(Options):
    warmup_steps: int = option(0, _WARMUP_HELP, lo=0)


@_o("none")
class NoneOptions(_NoOptions):
    pass


@_o("allreduce")
class AllReduceOptions(_NoOptions):
    pass


@_o("fp16")
class FP16Options(_Warmup):
    pass


@_o("bf16")
class BF16Options(_Warmup):
    pass


@_o("int8")
class Int8Options(_Warmup):
    block: int = option(256, "values per fp32 scale (blockwise int8)", lo=1)


@_o("onebit")
class OneBitOptions(Options):
    block: int = option(512, "values per fp32 scale (packed signs)", lo=8)
    warmup_steps: int = option(10, "full-precision steps before compressing (1-bit Adam: the "
                               "optimizer's own steps, then Adam's variance is frozen)", lo=0)
    momentum: bool = option(True, "1-bit Adam when given an AdamW optimizer: send the momentum "
                            "as signs (false: signed gradients)")
    max_update_rms: float = option(1.0, "cap on the RMS of each tensor's 1-bit Adam step, in "
                                   "units of the learning rate (0: no cap)", lo=0.0,
                                   hi=math.inf)


@_o("topk")
class TopKOptions(_Warmup):
    ratio: float = option(0.1, "share of each tensor's entries sent per step (with error "
                          "feedback); 0.1 keeps quality on short fine-tunes", lo=0.0, hi=1.0,
                          lo_open=True)


@_o("powersgd")
class PowerSGDOptions(_Warmup):
    rank: int = option(3, "rank of the P, Q factors of each 2-D gradient", lo=1)
    min_compression_rate: float = option(2.0, "send a matrix uncompressed unless low rank "
                                         "shrinks it at least this much", lo=0.0, hi=math.inf)
    warm_start: bool = option(True, "reuse last step's Q (one power iteration per step)")


@dataclass(frozen=True)
class _PeriodicOptions(Options):
    period: int = option(8, "optimizer steps between syncs", lo=1)
    streaming: bool = option(False, "overlap the sync with the next `delay` steps' compute "
                             "(the update is applied delay steps late)")
    delay: int = option(1, "steps a streamed sync has to arrive (1 <= delay < period)", lo=1)

    def check(self, given: frozenset[str] = frozenset()) -> None:
        if self.streaming:
            if self.period < 2:
                raise ConfigError(f"{self.STRATEGY}.period", self.period,
                                  "streaming needs period >= 2")
            if self.delay >= self.period:
                raise ConfigError(f"{self.STRATEGY}.delay", self.delay,
                                  f"streaming needs 1 <= delay < period ({self.period})")
        elif "delay" in given and self.delay != type(self)().delay:
            # a delay that would change nothing: the user expected streaming
            raise ConfigError(f"{self.STRATEGY}.delay", self.delay,
                              "delay applies only with streaming=true")


@_o("local")
class LocalOptions(_PeriodicOptions):
    pass


@_o("diloco")
class DiLoCoOptions(_PeriodicOptions):
    outer_lr: float = option(0.8, "outer Nesterov SGD learning rate", lo=0.0, hi=math.inf,
                             lo_open=True)
    outer_momentum: float = option(0.5, "outer Nesterov momentum", lo=0.0, hi=1.0, hi_open=True)
    delta_dtype: str = option("fp32", "dtype the outer delta travels in: fp32, fp16, bf16 "
                              "(all-reduced) or int8, int4, int2 (blockwise codes + one fp32 "
                              "scale per delta_block values, all-gathered, error feedback; "
                              "int2 with delta_topk: SparseLoCo's outer sync)",
                              choices=DELTA_DTYPES)
    delta_block: int = option(64, "values per fp32 scale of an int8/int4/int2 delta (per "
                              "tensor; even, a multiple of 4 for int2)", lo=2)
    delta_topk: float = option(1.0, "share of each tensor's delta entries sent, largest first, "
                               "with their indices and error feedback (delta_dtype applies to "
                               "the values); 1: all of them", lo=0.0, hi=1.0, lo_open=True)
    delta_ef_decay: float = option(1.0, "error feedback's decay: what a sync left unsent is "
                                   "multiplied by this before it joins the next delta (SparseLoCo's "
                                   "beta, e.g. 0.95 with outer_momentum=0 and outer_lr=1); 1: kept "
                                   "whole. Only for a coded delta (int8/int4/int2 or delta_topk < 1)",
                                   lo=0.0, hi=1.0)
    fragments: int = option(1, "sync the adapter in this many fragments, in turn: one every "
                            "period/fragments steps, so the link is busy evenly", lo=1)

    def check(self, given: frozenset[str] = frozenset()) -> None:
        super().check(given)
        if "delta_ef_decay" in given and self.delta_ef_decay != 1.0 and not delta_gathered(self):
            raise ConfigError("diloco.delta_ef_decay", self.delta_ef_decay,
                              "error feedback is only kept for a coded delta: add "
                              "delta_dtype=int8/int4/int2 or delta_topk < 1, or leave it at 1")
        if self.fragments > self.period:
            raise ConfigError("diloco.fragments", self.fragments,
                              f"use at most period ({self.period}) fragments: each syncs "
                              "once a period, at its own step")
        if self.delta_block % 2:
            raise ConfigError("diloco.delta_block", self.delta_block,
                              "use an even number (int4 packs two codes a byte)")
        if self.delta_dtype == "int2" and self.delta_block % 4:
            raise ConfigError("diloco.delta_block", self.delta_block,
                              "use a multiple of 4 with delta_dtype int2 (four codes a byte)")
        if "delta_block" in given and DELTA_BITS[self.delta_dtype] > 8 \
                and self.delta_block != type(self)().delta_block:
            raise ConfigError("diloco.delta_block", self.delta_block,
                              "delta_block applies only with delta_dtype int8, int4 or int2")

    @property
    def gathered(self) -> bool:
        """Whether the delta is all-gathered (codes, or sparse) rather than all-reduced."""
        return delta_gathered(self)


@_o("torch_fp16")
class TorchFP16Options(_Warmup):
    pass


@_o("torch_powersgd")
class TorchPowerSGDOptions(_Warmup):
    rank: int = option(1, "matrix approximation rank of torch's hook", lo=1)
    start_iter: int = option(2, "iterations of plain all-reduce before torch's hook "
                             "compresses (torch needs > 1 with error feedback)", lo=2)


@_o("auto")
class AutoOptions(Options):
    # the strategies whose defaults kept eval quality (bench/strategies.py).
    # onebit is left out: as 1-bit Adam it keeps quality on the embedded
    # default, but only with the optimizer (set_optimizer) and after a
    # full-precision warm-up, and its signed-gradient form without them does
    # not; named in `candidates`, it gets the optimizer auto was given
    candidates: str = option("allreduce,fp16,int8,topk,powersgd,local,diloco",
                             "strategies auto chooses among (comma list)")
    interval: int = option(10, "steps between re-plans (0: decide once)", lo=0)
    measure_steps: int = option(4, "steps measured under the start strategy before the first "
                                "choice", lo=0)
    start: str = option("", "start strategy (default: diloco, else local, else the lossless "
                        "candidate that sends least)")
    probe: str = option("quick", "start probe: quick (lorasync probe --quick), live (two timed "
                        "all-reduces) or none", choices=("quick", "live", "none"))
    lossless_margin: float = option(0.05, "prefer a lossless strategy within this share of the "
                                    "best", lo=0.0, hi=1.0, hi_open=True)
    switch_margin: float = option(0.05, "switch only when the pick is this much faster "
                                  "(twice in a row)", lo=0.0, hi=10.0)
    batch_size: int = option(1, "samples per rank per step (for samples/s in log lines)", lo=1)
    force_switch_at: str = option("", "STEP:NAME[,STEP:NAME]: switch at these steps (tests)")
    encode_probe: bool = option(True, "time each candidate's encode+decode on the live device "
                                "at start (else the CPU defaults of the cost model)")
    diloco_variants: str = option("fp16,int8,int4",
                                  "DiLoCo outer syncs auto chooses among (DTYPE or "
                                  "DTYPE@TOPK_RATIO, the least lossy first; sparse ones such as "
                                  "int4@0.03 only by hand: they missed the quality rule in short "
                                  "runs), each with the "
                                  "streaming delay and fragment count that hide it")
    log: bool = option(True, "log decisions on rank 0 (stderr)")

    def check(self, given: frozenset[str] = frozenset()) -> None:
        super().check(given)
        # each variant's delta options, before any worker starts (a typo such
        # as int2@2 would otherwise fail in every worker, once per restart)
        for item in (x.strip() for x in self.diloco_variants.split(",") if x.strip()):
            dtype, at, ratio = item.partition("@")
            try:
                DiLoCoOptions(delta_dtype=dtype.strip(),
                              **({"delta_topk": float(ratio)} if at else {}))
            except ValueError as e:
                raise ConfigError("auto.diloco_variants", item,
                                  f"write DTYPE or DTYPE@TOPK_RATIO, e.g. int2@0.01 ({e})"
                                  ) from None


# --------------------------------------------------------------------------- byte formulas

@dataclass(frozen=True)
class Collective:
    """One collective of a sync: its kind and the payload bytes this rank hands to it.

    For all_gather the payload is this rank's contribution; for all_to_all
    it is this rank's whole send buffer (split in n chunks).
    """

    kind: str  # all_reduce | all_gather | all_to_all | broadcast
    payload_bytes: float


Shape = tuple[int, ...]


def tensor_shapes(tensors: int | Sequence[int | Sequence[int]]) -> tuple[Shape, ...]:
    """Shapes from an element count, or a sequence of counts and shapes."""
    items: Sequence[Any] = [tensors] if isinstance(tensors, int) else list(tensors)
    shapes = []
    for it in items:
        shape = (int(it),) if isinstance(it, int) else tuple(int(d) for d in it)
        if not shape or math.prod(shape) <= 0:
            raise ConfigError("tensors", it, "every tensor needs a positive size")
        shapes.append(shape)
    if not shapes:
        raise ConfigError("tensors", tensors, "give at least one tensor")
    return tuple(shapes)


def param_blocks(numel: int, block: int, world_size: int, align: int = 1) -> tuple[int, int]:
    """How one parameter is cut for int8/onebit: ``(n_blocks, block_size)``.

    The block count is a multiple of ``world_size`` so that every rank owns
    the same number of blocks of every parameter (equal shards, no padding
    between ranks); the block size is at most ``block`` and a multiple of
    ``align`` (8 for bit packing).  The parameter is zero-padded to
    ``n_blocks * block_size`` elements; for LoRA shapes (r x d, d x r with d a
    multiple of 64) and 2-4 ranks the padding is zero or a fraction of 1%.
    """
    if numel <= 0:
        raise ValueError(f"numel: must be positive, got {numel}")
    nb = world_size * math.ceil(numel / (world_size * block))
    bs = math.ceil(numel / nb)
    return nb, align * math.ceil(bs / align)


def topk_k(numel: int, ratio: float) -> int:
    """Entries top-k keeps of a tensor of ``numel`` (at least one)."""
    return max(1, math.ceil(ratio * numel))


def powersgd_shape(shape: Shape, rank: int, min_rate: float) -> tuple[int, int] | None:
    """(rows, cols) PowerSGD compresses a tensor of ``shape`` as, or None when
    it goes uncompressed (1-D, or low rank would not shrink it ``min_rate``x)."""
    if len(shape) < 2:
        return None
    a = shape[0]
    b = math.prod(shape) // a
    return (a, b) if a * b >= min_rate * (a + b) * rank else None


def _two_phase(shapes, n: int, bits: int, block: int) -> list[Collective]:
    # phase 1: every rank hands its whole compressed bucket (n equal shards:
    # codes + one fp32 scale per block) to an all-to-all and reduces the shard
    # it owns; phase 2: the reduced shard, compressed again, is all-gathered
    total = 0.0
    for s in shapes:
        nb, bs = param_blocks(math.prod(s), block, n, 8 if bits == 1 else 1)
        total += nb * bs * bits / 8 + 4 * nb
    return [Collective("all_to_all", total), Collective("all_gather", total / n)]


def _powersgd(shapes, n: int, o: PowerSGDOptions) -> list[Collective]:
    # two all-reduces: P (with the uncompressed tensors riding along), then Q
    first = second = 0.0
    for s in shapes:
        ab = powersgd_shape(s, o.rank, o.min_compression_rate)
        if ab is None:
            first += 4.0 * math.prod(s)
        else:
            first += 4.0 * ab[0] * o.rank
            second += 4.0 * ab[1] * o.rank
    out = [Collective("all_reduce", first)]
    if second:
        out.append(Collective("all_reduce", second))
    return out


def _numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def delta_gathered(o: "DiLoCoOptions") -> bool:
    """Whether DiLoCo's delta travels as per-rank codes (all-gathered: int8,
    int4, or sparse) rather than as a summable float tensor (all-reduced)."""
    return DELTA_BITS[o.delta_dtype] <= 8 or o.delta_topk < 1.0


def delta_tensor_bytes(numel: int, o: "DiLoCoOptions") -> int:
    """Bytes one rank sends for one tensor of ``numel`` elements of an
    all-gathered DiLoCo delta (see the module docstring)."""
    sparse = o.delta_topk < 1.0
    k = topk_k(numel, o.delta_topk) if sparse else numel
    out = k * (2 if numel <= SHORT_INDEX_MAX else 4) if sparse else 0
    bits = DELTA_BITS[o.delta_dtype]
    if bits > 8:
        return out + k * bits // 8
    nb = math.ceil(k / o.delta_block)
    return out + nb * o.delta_block * bits // 8 + 4 * nb


def fragment_ranges(numels: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """The adapter's tensors (in canonical order, ``numels`` each) cut into
    ``fragments`` contiguous runs of about equal size: ``[(first, end), ...]``
    tensor indices.  Every tensor is in exactly one fragment."""
    numels = [int(m) for m in numels]
    F, L = int(fragments), len(numels)
    if F < 1:
        raise ConfigError("diloco.fragments", fragments, "use an integer >= 1")
    if F > L:
        raise ConfigError("diloco.fragments", fragments,
                          f"the adapter has {L} tensor(s); use at most {L} fragments")
    cum = [0]
    for m in numels:
        cum.append(cum[-1] + m)
    cuts = [0]
    for f in range(1, F):
        target = cum[-1] * f / F
        lo, hi = cuts[-1] + 1, L - (F - f)
        cuts.append(min(range(lo, hi + 1), key=lambda j: (abs(cum[j] - target), j)))
    cuts.append(L)
    return list(zip(cuts, cuts[1:]))


def fragment_offsets(period: int, fragments: int) -> list[int]:
    """Step (mod ``period``) at which each fragment syncs: fragment f at
    ``(f + 1) * period // fragments``, so one fragment has synced every
    ``period / fragments`` steps and the last one at the period's end (one
    fragment: every ``period`` steps, as plain DiLoCo)."""
    return [((f + 1) * period // fragments) % period for f in range(fragments)]


def fragments_due(step: int, period: int, fragments: int) -> list[int]:
    """Fragments whose sync starts after optimizer step ``step`` (1-based)."""
    r = step % period
    return [f for f, off in enumerate(fragment_offsets(period, fragments)) if off == r]


def streamed_in_flight(step: int, o: "Options") -> bool:
    """Whether a periodic strategy with options ``o`` has a streamed sync
    launched and not yet applied once optimizer step ``step`` has ended: one
    launched after one of the last ``delay`` steps."""
    if not getattr(o, "streaming", False) or step < 1:
        return False
    frags = getattr(o, "fragments", 1)
    return any(fragments_due(t, o.period, frags)
               for t in range(max(1, step - o.delay + 1), step + 1))


def _diloco(shapes, n: int, o: "DiLoCoOptions") -> list[Collective]:
    # one collective per fragment, in fragment order (each at its own step)
    numels = [math.prod(s) for s in shapes]
    out = []
    for a, b in fragment_ranges(numels, o.fragments):
        part = numels[a:b]
        if delta_gathered(o):
            out.append(Collective("all_gather", float(sum(delta_tensor_bytes(m, o)
                                                          for m in part))))
        else:
            out.append(Collective("all_reduce", float(DTYPE_BYTES[o.delta_dtype] * sum(part))))
    return out


def _diloco_encode_ns(o: "DiLoCoOptions") -> float:
    # the flat copy and the outer Nesterov step (7 ns), plus the codec: what
    # comm.loopback.time_encode measured on one CPU thread for the SmolLM2
    # adapter (bench/strategies_micro.py), per element per sync
    if not delta_gathered(o):
        return 7.0
    if o.delta_topk < 1.0:   # a top-k per size group, then little to code
        return 7.0 + 3.0
    # int2: 1.75x int4's codec, timed side by side (four shifts to pack and unpack)
    return 7.0 + {"int8": 6.0, "int4": 5.0, "int2": 9.0}[o.delta_dtype]


# --------------------------------------------------------------------------- the catalog

@dataclass(frozen=True)
class Spec:
    """What one strategy is (everything but its torch implementation)."""

    name: str
    summary: str
    options: type[Options]
    #: collectives of one sync of the given tensors (None: no formula, measured)
    wire: Callable[[tuple[Shape, ...], int, Any], list[Collective]] | None
    #: encode+decode ns per adapter element per sync on one CPU thread, given
    #: the options: what the strategies' own encode_s came to in
    #: bench/plan_accuracy.py (SmolLM2-135M, 921,600 elements, 2 ranks)
    encode_ns: Callable[[Any], float] = lambda o: 0.0
    #: sends gradients every step from DDP's bucket hooks
    per_step: bool = True
    #: the same update every step up to rounding of the summed gradient (no
    #: error feedback, no skipped syncs)
    lossless: bool = False
    #: syncs weights (or deltas) every ``period`` steps, after the optimizer step
    periodic: bool = False
    #: a bucket's hook waits for the previous bucket's first collective before
    #: the backward pass goes on (the cost model charges it)
    holds_backward: bool = False
    #: ranked by the planner and choosable by auto
    plannable: bool = True
    #: keeps a per-element residual of what its compression has not delivered
    #: yet (error feedback, in its own state): what ``auto`` carries over a
    #: switch and a hierarchical leader owes for its node
    error_feedback: bool = False


def _spec(name, summary, options, wire, **kw) -> Spec:
    return Spec(name=name, summary=summary, options=options, wire=wire, **kw)


_SPECS = [
    _spec("allreduce", "fp32 gradients, all-reduced (the reference: DDP without a hook)",
          AllReduceOptions, lambda s, n, o: [Collective("all_reduce", 4.0 * _numel(s))],
          lossless=True),
    # a cast each way
    _spec("fp16", "16-bit gradients, pre-divided by the world size", FP16Options,
          lambda s, n, o: [Collective("all_reduce", 2.0 * _numel(s))],
          encode_ns=lambda o: 2.0, lossless=True),
    _spec("bf16", "bfloat16 gradients, pre-divided by the world size", BF16Options,
          lambda s, n, o: [Collective("all_reduce", 2.0 * _numel(s))],
          encode_ns=lambda o: 2.0, lossless=True),
    # two quantize/dequantize rounds with error feedback
    _spec("int8", "blockwise int8 + one scale per block, two-phase, error feedback",
          Int8Options, lambda s, n, o: _two_phase(s, n, 8, o.block),
          encode_ns=lambda o: 20.0, holds_backward=True, error_feedback=True),
    # 1-bit Adam: the momentum blend, sign packing, two rounds
    _spec("onebit", "packed signs + one scale per block (1-bit Adam with AdamW)",
          OneBitOptions, lambda s, n, o: _two_phase(s, n, 1, o.block),
          encode_ns=lambda o: 45.0, holds_backward=True, error_feedback=True),
    # CPU top-k
    _spec("topk", "the largest `ratio` of each tensor's entries + indices, error feedback",
          TopKOptions, lambda s, n, o: [Collective("all_gather", 8.0 * sum(
              topk_k(math.prod(x), o.ratio) for x in s))],
          encode_ns=lambda o: 18.0, error_feedback=True),
    # two small matmuls per matrix, scaling with the rank
    _spec("powersgd", "rank-`rank` factors P, Q of each 2-D gradient, error feedback",
          PowerSGDOptions, lambda s, n, o: _powersgd(s, n, o),
          encode_ns=lambda o: 7.5 * o.rank, error_feedback=True),
    # the flat copy
    _spec("local", "the adapter averaged every `period` steps (local SGD)", LocalOptions,
          lambda s, n, o: [Collective("all_reduce", 4.0 * _numel(s))],
          encode_ns=lambda o: 2.5, per_step=False, periodic=True),
    # the flat copy and the outer Nesterov step
    _spec("diloco", "the adapter delta every `period` steps, outer Nesterov SGD", DiLoCoOptions,
          lambda s, n, o: _diloco(s, n, o), encode_ns=_diloco_encode_ns, per_step=False,
          periodic=True),
    _spec("none", "no sync (ranks diverge): the compute ceiling of the bench", NoneOptions,
          lambda s, n, o: [], plannable=False),
    _spec("torch_fp16", "torch's fp16_compress_hook (a baseline)", TorchFP16Options, None,
          lossless=True, plannable=False),
    _spec("torch_powersgd", "torch's PowerSGD hook (a baseline)", TorchPowerSGDOptions, None,
          plannable=False),
    _spec("auto", "measures the network and picks (and re-picks) a strategy", AutoOptions, None,
          per_step=False, plannable=False),
]

#: every strategy, by name
SPECS: dict[str, Spec] = {s.name: s for s in _SPECS}
#: strategies the planner ranks and auto chooses among
STRATEGIES: tuple[str, ...] = tuple(s.name for s in _SPECS if s.plannable)
#: no sync at all: the compute ceiling that efficiencies are measured against
NONE = "none"
LOSSLESS = frozenset(s.name for s in _SPECS if s.lossless)
PERIODIC = frozenset(s.name for s in _SPECS if s.periodic)


def spec(name: str) -> Spec:
    """The catalog entry of ``name``; ConfigError for an unknown name."""
    try:
        return SPECS[name]
    except (KeyError, TypeError):
        raise ConfigError("strategy", name, "choose one of " + ", ".join(sorted(SPECS))) from None


def names() -> list[str]:
    """Every strategy name, sorted."""
    return sorted(SPECS)


def parse_options(name: str, given: Mapping[str, Any] | Options | None = None) -> Options:
    """``name``'s options: the defaults updated with ``given``, validated."""
    cls = spec(name).options
    if isinstance(given, Options):
        if not isinstance(given, cls):
            raise ConfigError("options", type(given).__name__, f"give {cls.__name__} for {name}")
        return given
    return cls.parse(given)


def option_help(name: str) -> list[tuple[str, Any, str]]:
    """``(option, default, help)`` of every option of ``name``."""
    return [(f.name, f.default, f.metadata["help"]) for f in fields(spec(name).options)]


def collectives(name: str, tensors, world_size: int,
                options: Mapping[str, Any] | Options | None = None) -> list[Collective]:
    """The collectives one sync of ``tensors`` makes under ``name``."""
    s = spec(name)
    if s.wire is None:
        raise ConfigError("strategy", name, "has no byte formula (its bytes are measured)")
    n = int(world_size)
    if n < 1:
        raise ConfigError("world_size", world_size, "use an integer >= 1")
    return s.wire(tensor_shapes(tensors), n, parse_options(name, options))


def wire_bytes(name: str, tensors, world_size: int, **options: Any) -> float:
    """Payload bytes one rank hands to collectives per optimizer step, steady
    state (after ``warmup_steps``; periodic strategies averaged over their period).

    >>> wire_bytes("allreduce", 921_600, 2)
    3686400.0
    >>> wire_bytes("onebit", 921_600, 2) / wire_bytes("allreduce", 921_600, 2)
    0.0498046875
    """
    o = parse_options(name, options)
    total = sum(c.payload_bytes for c in collectives(name, tensors, world_size, o))
    return total / o.period if spec(name).periodic else total


# --------------------------------------------------------------------------- layouts

#: layouts a strategy runs in across nodes (``--hierarchy``): ``auto``
#: (hierarchical where several nodes hold several ranks each), ``flat`` or ``node``
HIERARCHIES = ("auto", "flat", "node")
#: how a hierarchical periodic strategy crosses nodes (``--cross-node``);
#: ``auto``: ``shards`` for periodic strategies with several ranks per node,
#: else ``leaders``
CROSS_NODE = ("auto", "leaders", "shards")
#: all-reduce algorithms a run may ask for (``--allreduce-algo``): the
#: backend's ``ring``, lorasync's ``recursive_doubling``, or ``auto`` (per message)
ALLREDUCE_ALGOS = ("ring", "recursive_doubling", "auto")

#: strategies that never run hierarchically (lorasync.comm.hierarchy): nothing
#: to sync, auto (it builds hierarchical candidates itself), torch's own hooks
_FLAT_ONLY = {"none": "nothing to sync", "auto": "it chooses the layout of its candidates",
              "torch_fp16": "torch's hook, a flat baseline",
              "torch_powersgd": "torch's hook, a flat baseline"}


def flat_only(name: str, options: Mapping[str, Any] | Options | None = None) -> str | None:
    """Why ``name`` with ``options`` cannot run hierarchically (exact inside
    a node, the strategy across node leaders), or None when it can.  1-bit
    Adam (onebit's default ``momentum=true``) takes its optimizer step on
    every rank from what only the leaders receive."""
    if name in _FLAT_ONLY:
        return _FLAT_ONLY[name]
    o = parse_options(name, options)
    if name == "onebit" and o.momentum:
        return "1-bit Adam (momentum=true) takes its optimizer step on every rank"
    return None


def strategy_problem(strategy: Any, options: Mapping[str, Any]) -> str | None:
    """What is wrong with a strategy name and its options, as ``lorasync.hf.attach``
    and the ``LORASYNC_STRATEGY`` switch say it (one line), or None: the name
    among :func:`names`, every option known and in range (auto's ``NAME.OPTION``
    ones checked against strategy NAME).  Imports no torch."""
    from lorasync.errors import LorasyncError

    if not isinstance(strategy, str) or strategy not in names():
        return f"strategy: unknown name {strategy!r}; choose one of {', '.join(names())}"
    plain, nested = dict(options), {}
    if strategy == "auto":
        plain = {k: v for k, v in options.items() if "." not in k}
        for key, value in options.items():
            name, dot, opt = key.partition(".")
            if dot:
                nested.setdefault(name, {})[opt] = value
    for name, opts in [(strategy, plain), *nested.items()]:
        if name not in SPECS:
            return (f"auto: option {name}.*: {name!r} is not a strategy; choose one of "
                    f"{', '.join(STRATEGIES)}")
        try:
            parse_options(name, opts)
        except LorasyncError as exc:
            known = ", ".join(k for k, _, _ in option_help(name)) or "none"
            return f"{exc} ({name} takes: {known})"
    return None
