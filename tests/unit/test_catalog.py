"""The strategy catalog: options (defaults, ranges, help) and the one byte
formula that the strategies, the dist tests and the cost model all use."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from lorasync import catalog
from lorasync.catalog import param_blocks, wire_bytes
from lorasync.errors import ConfigError
from lorasync.plan.costmodel import MODELS, lora_matrices

N = 921_600  # SmolLM2-135M, LoRA r=8 on q/k/v/o
SMOL = lora_matrices(MODELS["smollm2-135m"], 8)
LORA_R8 = [(8, 576), (576, 8), (8, 576), (192, 8)]  # lora_A / lora_B shapes of a q/k proj


# --------------------------------------------------------------------------- options

def test_every_strategy_has_typed_options_with_help():
    for name, spec in catalog.SPECS.items():
        assert spec.name == name and spec.summary
        opts = catalog.parse_options(name)
        assert dataclasses.is_dataclass(opts) and opts.STRATEGY == name
        for key, default, help_text in catalog.option_help(name):
            assert help_text, (name, key)
            assert getattr(opts, key) == default


def test_every_registered_strategy_is_in_the_catalog_and_back():
    from lorasync.comm import get_strategy, strategy_names

    assert set(strategy_names()) == set(catalog.SPECS)
    for name in strategy_names():
        assert get_strategy(name).spec is catalog.spec(name)


@pytest.mark.parametrize("name, given, field, needle", [
    ("topk", {"ratio": 0}, "topk.ratio", "(0, 1]"),
    ("topk", {"ratio": 1.5}, "topk.ratio", "(0, 1]"),
    ("topk", {"rato": 0.1}, "topk.rato", "did you mean 'ratio'"),
    ("allreduce", {"ratio": 0.1}, "allreduce.ratio", "no options"),
    ("int8", {"block": 0}, "int8.block", ">= 1"),
    ("int8", {"block": 2.5}, "int8.block", "integer"),
    ("onebit", {"block": 4}, "onebit.block", ">= 8"),
    ("onebit", {"momentum": "yes"}, "onebit.momentum", "true or false"),
    ("fp16", {"warmup_steps": -1}, "fp16.warmup_steps", ">= 0"),
    ("powersgd", {"rank": 0}, "powersgd.rank", ">= 1"),
    ("local", {"delay": 2}, "local.delay", "only with streaming"),
    ("local", {"streaming": False, "delay": 3}, "local.delay", "only with streaming"),
    ("local", {"streaming": True, "period": 1}, "local.period", "period >= 2"),
    ("diloco", {"streaming": True, "delay": 8}, "diloco.delay", "delay < period"),
    ("diloco", {"delta_dtype": "fp8"}, "diloco.delta_dtype", "fp32, fp16, bf16"),
    ("diloco", {"outer_momentum": 1.0}, "diloco.outer_momentum", "[0, 1)"),
    ("diloco", {"outer_lr": 0}, "diloco.outer_lr", "(0, inf]"),
    ("diloco", {"delta_dtype": "int3"}, "diloco.delta_dtype", "int8, int4"),
    ("diloco", {"delta_topk": 0}, "diloco.delta_topk", "(0, 1]"),
    ("diloco", {"delta_topk": 1.5}, "diloco.delta_topk", "(0, 1]"),
    ("diloco", {"delta_dtype": "int4", "delta_block": 33}, "diloco.delta_block", "even"),
    ("diloco", {"delta_dtype": "int2", "delta_block": 34}, "diloco.delta_block",
     "multiple of 4"),
    ("diloco", {"delta_block": 32}, "diloco.delta_block", "only with delta_dtype int8"),
    ("diloco", {"fragments": 0}, "diloco.fragments", ">= 1"),
    ("diloco", {"fragments": 9}, "diloco.fragments", "at most period (8)"),
    ("auto", {"probe": "fast"}, "auto.probe", "quick, live, none"),
    ("auto", {"diloco_variants": "int4,int2@2"}, "auto.diloco_variants", "int2@0.01"),
    ("auto", {"diloco_variants": "int3"}, "auto.diloco_variants", "DTYPE@TOPK_RATIO"),
    ("auto", {"interval": True}, "auto.interval", "integer"),
])
def test_bad_options_name_the_field_and_the_fix(name, given, field, needle):
    with pytest.raises(ConfigError) as e:
        catalog.parse_options(name, given)
    assert e.value.field == field and needle in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)  # what attach() promises


def test_options_coerce_what_yaml_gives():
    o = catalog.parse_options("diloco", {"outer_lr": 1, "streaming": True, "delay": 2})
    assert o.outer_lr == 1.0 and isinstance(o.outer_lr, float) and o.delay == 2
    assert catalog.parse_options("auto", {"candidates": ["fp16", "topk"]}).candidates == "fp16,topk"
    with pytest.raises(ConfigError, match="strategy"):
        catalog.parse_options("zip")


def test_options_hold_plain_python_values_that_load_safely():
    """Values that pass the checks as subclasses (a numpy float, an IntEnum, a str
    Enum) are stored as plain float/int/str: options reach checkpoints (auto's
    state), which load with torch.load(weights_only=True)."""
    import enum

    import numpy as np

    class Dtype(str, enum.Enum):
        INT8 = "int8"

    class Period(enum.IntEnum):
        FOUR = 4

    o = catalog.parse_options("diloco", {"outer_lr": np.float64(0.7), "period": Period.FOUR,
                                         "delta_dtype": Dtype.INT8})
    assert type(o.outer_lr) is float and type(o.period) is int and type(o.delta_dtype) is str
    assert (o.outer_lr, o.period, o.delta_dtype) == (0.7, 4, "int8")


def test_error_feedback_is_a_flag_of_the_compressors_that_keep_a_residual():
    keep = {n for n, s in catalog.SPECS.items() if s.error_feedback}
    assert keep == {"int8", "onebit", "topk", "powersgd"}


def test_allowed_layouts_and_algorithms_are_the_catalogs():
    import lorasync.comm as comm

    assert (comm.HIERARCHIES, comm.CROSS_NODE, comm.ALLREDUCE_ALGOS) == (
        catalog.HIERARCHIES, catalog.CROSS_NODE, catalog.ALLREDUCE_ALGOS)
    assert catalog.HIERARCHIES == ("auto", "flat", "node")
    assert catalog.CROSS_NODE == ("auto", "leaders", "shards")
    assert catalog.ALLREDUCE_ALGOS == ("ring", "recursive_doubling", "auto")


def test_catalog_does_not_import_torch():
    code = "import sys, lorasync.catalog; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --------------------------------------------------------------------------- blocks

@pytest.mark.parametrize("numel", [1, 7, 128, 1000, 4608, 1536, 921_600])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("block,align", [(256, 1), (512, 8), (32, 8), (8, 8)])
def test_param_blocks(numel, world, block, align):
    nb, bs = param_blocks(numel, block, world, align)
    assert nb % world == 0                       # equal shard per rank
    assert bs % align == 0 and bs <= max(block, align)
    assert nb * bs >= numel                      # fits
    assert nb * (bs - align) < numel or bs == align  # and the next smaller size would not


def test_param_blocks_lora_shapes_need_no_padding():
    for world in (2, 3):
        for shape in LORA_R8:
            nb, bs = param_blocks(math.prod(shape), 256, world)
            assert nb * bs == math.prod(shape)


# --------------------------------------------------------------------------- bytes

def _two_phase(numel, n, bits, block=256):
    # n x ceil(numel / (n block)) blocks of equal size (a multiple of 8 for bits),
    # the whole compressed vector in phase 1, 1/n of it in phase 2
    nb = n * math.ceil(numel / (n * block))
    bs = math.ceil(numel / nb)
    if bits == 1:
        bs = 8 * math.ceil(bs / 8)
    return (nb * bs * bits / 8 + 4 * nb) * (1 + 1 / n)


@pytest.mark.parametrize("name, n, opts, expected", [
    ("none", 2, {}, 0),
    ("allreduce", 2, {}, 4 * N),
    ("allreduce", 8, {}, 4 * N),
    ("fp16", 2, {}, 2 * N),
    ("bf16", 4, {}, 2 * N),
    ("int8", 2, {}, _two_phase(N, 2, 8)),
    ("int8", 4, {"block": 64}, _two_phase(N, 4, 8, 64)),
    ("onebit", 2, {}, _two_phase(N, 2, 1, 512)),
    ("onebit", 3, {"block": 256, "warmup_steps": 5}, _two_phase(N, 3, 1, 256)),
    ("topk", 2, {}, 8 * math.ceil(0.1 * N)),
    ("topk", 8, {"ratio": 0.001}, 8 * math.ceil(0.001 * N)),
    ("local", 2, {}, 4 * N / 8),
    ("local", 2, {"period": 4}, 4 * N / 4),
    ("diloco", 2, {}, 4 * N / 8),
    ("diloco", 2, {"period": 16, "delta_dtype": "bf16", "outer_lr": 0.5}, 2 * N / 16),
])
def test_wire_bytes_of_one_flat_tensor(name, n, opts, expected):
    assert wire_bytes(name, N, n, **opts) == pytest.approx(expected)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_int8_and_onebit_are_cut_per_tensor(world):
    shapes = LORA_R8 * 10
    numel = sum(math.prod(s) for s in shapes)
    int8 = wire_bytes("int8", shapes, world)
    assert int8 == pytest.approx(sum(_two_phase(math.prod(s), world, 8) for s in shapes))
    # 1 byte a value + 4 bytes a 256-block, sent once in phase 1 and 1/n in phase 2
    assert int8 / (4 * numel) == pytest.approx((1 + 1 / world) * (1 + 4 / 256) / 4, rel=0.02)
    # onebit ~ 1/32 of fp32 per phase, plus one fp32 scale per 512 values
    onebit = wire_bytes("onebit", shapes, world)
    assert onebit / (4 * numel) == pytest.approx((1 + 1 / world) * (1 / 32 + 1 / 512), rel=0.02)
    ops = catalog.collectives("onebit", shapes, world)
    assert [c.kind for c in ops] == ["all_to_all", "all_gather"]
    assert ops[1].payload_bytes == pytest.approx(ops[0].payload_bytes / world)


def test_topk_keeps_k_per_tensor_and_counts_indices():
    assert wire_bytes("topk", N, 2, ratio=0.01) == 8 * math.ceil(0.01 * N)
    assert wire_bytes("topk", [10, 1000], 3, ratio=0.01) == 8 * (1 + 10)
    k = sum(max(1, math.ceil(0.1 * m * c)) for m, c in SMOL)
    assert wire_bytes("topk", SMOL, 2) == 8 * k


def test_powersgd_compresses_matrices_and_sends_the_rest_whole():
    # rank 1 on 8 x 576: (8 + 576) values instead of 4608 -> 7.9x
    assert wire_bytes("powersgd", [(8, 576)], 2, rank=1) == 4 * (8 + 576)
    # rank 2 -> 3.9x; rank 8 (= r) would not compress, so it is sent as is
    assert wire_bytes("powersgd", [(8, 576)], 2, rank=2) == 4 * 2 * (8 + 576)
    assert wire_bytes("powersgd", [(8, 576)], 2, rank=8) == 4 * 8 * 576
    # 1-D tensors always uncompressed; two all-reduces when something is compressed
    ops = catalog.collectives("powersgd", [(8, 576), (576,)], 2, {"rank": 1})
    assert [c.payload_bytes for c in ops] == [4 * (8 + 576), 4 * 576]
    # the SmolLM2 adapter: per layer q (8x576, 576x8), k/v (8x576, 192x8), o like q
    per_layer = 2 * 584 + 2 * (584 + 200) + 2 * 584
    assert wire_bytes("powersgd", SMOL, 2, rank=1) == 4 * 30 * per_layer
    assert wire_bytes("powersgd", SMOL, 2) == 3 * 4 * 30 * per_layer  # rank 3, the default
    # rank 4 no longer halves any r=8 LoRA matrix (4608 < 2 x 584 x 4): all sent whole
    assert wire_bytes("powersgd", SMOL, 2, rank=4) == 4 * N
    assert wire_bytes("powersgd", SMOL, 2, rank=4, min_compression_rate=1.5) < 4 * N


def test_formulas_refuse_bad_input():
    with pytest.raises(ValueError, match="ratio"):
        wire_bytes("int8", N, 2, ratio=0.1)
    with pytest.raises(ValueError, match="bogus"):
        wire_bytes("bogus", N, 2)
    with pytest.raises(ValueError, match="tensors"):
        wire_bytes("allreduce", [0], 2)
    with pytest.raises(ValueError, match="measured"):
        wire_bytes("torch_powersgd", N, 2)


def test_list_strategies_shows_every_strategy_and_option(capsys):
    from lorasync.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--list-strategies"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in catalog.SPECS:
        assert f"\n{name}: {catalog.spec(name).summary}" in out
        for key, default, _ in catalog.option_help(name):
            shown = str(default).lower() if isinstance(default, bool) else default
            assert f"{key}={shown}" in out, (name, key)


# --------------------------------------------------------------------------- DiLoCo outer sync

def _delta_tensor(m, dtype, ratio=1.0, block=64):
    """The bytes of one tensor of an all-gathered DiLoCo delta, written out."""
    k = max(1, math.ceil(ratio * m)) if ratio < 1 else m
    index = (2 if m <= 65536 else 4) * k if ratio < 1 else 0
    if dtype in ("fp32", "fp16", "bf16"):
        return index + {"fp32": 4, "fp16": 2, "bf16": 2}[dtype] * k
    nb = math.ceil(k / block)
    return index + nb * block * {"int8": 1, "int4": 0.5, "int2": 0.25}[dtype] + 4 * nb


@pytest.mark.parametrize("opts", [
    {"delta_dtype": "int8"}, {"delta_dtype": "int4"}, {"delta_dtype": "int4", "delta_block": 128},
    {"delta_dtype": "int4", "delta_topk": 0.03}, {"delta_dtype": "int8", "delta_topk": 0.01},
    {"delta_dtype": "fp16", "delta_topk": 0.1}, {"delta_dtype": "fp32", "delta_topk": 0.5},
    {"delta_dtype": "int2"}, {"delta_dtype": "int2", "delta_topk": 0.01},
    {"delta_dtype": "int2", "delta_topk": 0.03, "delta_block": 16},
])
@pytest.mark.parametrize("world", [2, 4])
def test_diloco_gathered_delta_bytes(opts, world):
    o = catalog.parse_options("diloco", opts)
    want = sum(_delta_tensor(r * c, o.delta_dtype, o.delta_topk, o.delta_block) for r, c in SMOL)
    [c] = catalog.collectives("diloco", SMOL, world, o)
    assert c.kind == "all_gather" and c.payload_bytes == want
    assert wire_bytes("diloco", SMOL, world, **opts) == pytest.approx(want / 8)
    # indices of a tensor past 65,536 elements take 4 bytes
    if o.delta_topk < 1:
        assert catalog.delta_tensor_bytes(70_000, o) == _delta_tensor(
            70_000, o.delta_dtype, o.delta_topk, o.delta_block)


def test_diloco_delta_sizes_on_the_embedded_default():
    """What one outer sync of the SmolLM2 adapter (921,600 values) sends."""
    per_sync = {k: wire_bytes("diloco", SMOL, 2, **o) * 8 for k, o in {
        "fp32": {}, "fp16": {"delta_dtype": "fp16"}, "int8": {"delta_dtype": "int8"},
        "int4": {"delta_dtype": "int4"},
        "top3%int4": {"delta_dtype": "int4", "delta_topk": 0.03},
        "int2": {"delta_dtype": "int2"},
        "top1%int2": {"delta_dtype": "int2", "delta_topk": 0.01}}.items()}
    assert per_sync["fp32"] == 4 * N and per_sync["fp16"] == 2 * N
    assert per_sync["int8"] == N * (1 + 4 / 64)          # a scale per 64 codes
    assert per_sync["int4"] == N * (0.5 + 4 / 64)
    assert per_sync["top3%int4"] < N / 10                # 2-byte indices + 4-bit values
    assert per_sync["int2"] == N * (0.25 + 4 / 64)
    # SparseLoCo's: 1% of each tensor, 2-byte indices, 2-bit values in one block
    # of 64 (a tensor keeps at most 47 values here): over 150x fewer than fp32
    assert 150 < 4 * N / per_sync["top1%int2"] < 4 * N / per_sync["top3%int4"] * 4


def test_diloco_fragments_split_the_bytes_and_keep_the_kind():
    whole = catalog.collectives("diloco", SMOL, 2, {"delta_dtype": "int4"})
    parts = catalog.collectives("diloco", SMOL, 2, {"delta_dtype": "int4", "fragments": 4})
    assert [c.kind for c in parts] == ["all_gather"] * 4
    assert sum(c.payload_bytes for c in parts) == whole[0].payload_bytes
    dense = catalog.collectives("diloco", SMOL, 2, {"fragments": 3, "delta_dtype": "bf16"})
    assert [c.kind for c in dense] == ["all_reduce"] * 3
    assert sum(c.payload_bytes for c in dense) == 2 * N
    with pytest.raises(ConfigError, match="at most 1 fragments"):
        catalog.collectives("diloco", N, 2, {"fragments": 2})


@pytest.mark.parametrize("numels", [[5] * 7, [4608, 4608, 4608, 1536] * 30, [1, 100, 1, 100, 3],
                                    [m * c for m, c in SMOL]])
@pytest.mark.parametrize("F", [1, 2, 3, 4, 7])
def test_fragment_ranges_cover_every_tensor_once(numels, F):
    if F > len(numels):
        with pytest.raises(ConfigError, match="fragments"):
            catalog.fragment_ranges(numels, F)
        return
    ranges = catalog.fragment_ranges(numels, F)
    assert len(ranges) == F and ranges[0][0] == 0 and ranges[-1][1] == len(numels)
    assert all(a < b for a, b in ranges)
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))   # contiguous, no overlap
    sizes = [sum(numels[a:b]) for a, b in ranges]
    if len(set(numels)) == 1 or len(numels) >= 100:      # even where tensors allow
        assert max(sizes) - min(sizes) <= 2 * max(numels)


@pytest.mark.parametrize("period", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("F", [1, 2, 3, 4, 8, 16])
def test_every_fragment_syncs_once_a_period_at_even_spacing(period, F):
    if F > period:
        return
    offsets = catalog.fragment_offsets(period, F)
    assert len(set(offsets)) == F
    for start in range(1, 3 * period, 3):   # any window of `period` steps
        due = [f for s in range(start, start + period) for f in catalog.fragments_due(s, period, F)]
        assert sorted(due) == list(range(F))   # every fragment exactly once
    # one fragment: plain DiLoCo's steps; F fragments: spaced by period // F or period // F + 1
    if F == 1:
        assert [s for s in range(1, 3 * period + 1) if catalog.fragments_due(s, period, 1)] == \
            [period, 2 * period, 3 * period]
    steps = [s for s in range(1, 2 * period + 1) if catalog.fragments_due(s, period, F)]
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    assert gaps <= {period // F, -(-period // F)}


def test_streamed_in_flight_follows_the_schedule():
    o = catalog.parse_options
    one = o("diloco", {"streaming": True, "delay": 1})
    assert [s for s in range(1, 25) if catalog.streamed_in_flight(s, one)] == [8, 16, 24]
    two = o("diloco", {"streaming": True, "delay": 2})
    assert [s for s in range(1, 18) if catalog.streamed_in_flight(s, two)] == [8, 9, 16, 17]
    every = o("diloco", {"streaming": True, "delay": 1, "fragments": 8})
    assert all(catalog.streamed_in_flight(s, every) for s in range(1, 20))
    assert not catalog.streamed_in_flight(0, every)
    assert not any(catalog.streamed_in_flight(s, o("diloco", {})) for s in range(1, 20))
    assert not any(catalog.streamed_in_flight(s, o("local", {})) for s in range(1, 20))
