"""Compressors (pure functions) and the wire-bytes formulas; no processes."""

from __future__ import annotations

import math

import pytest
import torch

from lorasync.comm import collectives_formula, wire_bytes_formula
from lorasync.comm import compress as C

LORA_R8 = [(8, 576), (576, 8), (8, 576), (192, 8)]  # lora_A / lora_B shapes of a q/k proj


def _x(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # blocks of very different magnitude, an all-zero stretch, and exact zeros
    x = torch.randn(n, generator=g) * scale
    x *= torch.logspace(-4, 2, n).roll(n // 3)
    x[n // 5: n // 5 + 70] = 0
    return x


def _blocks(n: int, block: int = 64, world: int = 2, align: int = 1):
    """Block ids as the strategies cut one parameter (param_blocks)."""
    nb, bs = C.param_blocks(n, block, world, align)
    bid = torch.arange(nb * bs) // bs
    return bid, nb, nb * bs


# -- param_blocks ----------------------------------------------------------------
@pytest.mark.parametrize("numel", [1, 7, 128, 1000, 4608, 1536, 921_600])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("block,align", [(256, 1), (512, 8), (32, 8), (8, 8)])
def test_param_blocks(numel, world, block, align):
    nb, bs = C.param_blocks(numel, block, world, align)
    assert nb % world == 0                       # equal shard per rank
    assert bs % align == 0 and bs <= max(block, align)
    assert nb * bs >= numel                      # fits
    assert nb * (bs - align) < numel or bs == align  # and the next smaller size would not


def test_param_blocks_lora_shapes_need_no_padding():
    for world in (2, 3):
        for shape in LORA_R8:
            nb, bs = C.param_blocks(math.prod(shape), 256, world)
            assert nb * bs == math.prod(shape)


# -- int8 ---------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
def test_int8_roundtrip_error_at_most_half_a_step(scale):
    n = 1000
    bid, nb, padded = _blocks(n)
    x = torch.cat([_x(n, scale=scale), torch.zeros(padded - n)])
    q, s = C.int8_encode(x, bid, nb)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.numel() == nb
    err = (C.int8_decode(q, s, bid) - x).abs()
    assert bool((err <= s[bid] / 2 * (1 + 1e-6) + 1e-30).all())
    # the largest |x| of every non-empty block maps to +-127 exactly
    assert int(q.abs().max()) == 127
    zero_blocks = s == 0
    assert bool((C.int8_decode(q, s, bid)[zero_blocks[bid]] == 0).all())


# -- onebit -------------------------------------------------------------------------
def test_pack_bits_roundtrip():
    bits = torch.rand(8 * 37, generator=torch.Generator().manual_seed(1)) > 0.5
    packed = C.pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 37
    assert torch.equal(C.unpack_bits(packed), bits)


def test_onebit_sign_exact_and_scale_is_block_mean_abs():
    n = 1000
    bid, nb, padded = _blocks(n, block=64, align=8)
    x = torch.cat([_x(n), torch.zeros(padded - n)])
    real = torch.arange(padded) < n
    count = torch.zeros(nb).index_add_(0, bid, real.float())
    packed, s = C.onebit_encode(x, bid, nb, count)
    assert packed.numel() == padded // 8
    y = C.onebit_decode(packed, s, bid)
    nz = x != 0
    assert torch.equal(torch.sign(y[nz & (s[bid] > 0)]), torch.sign(x[nz & (s[bid] > 0)]))
    assert bool((y[(x == 0) & (s[bid] > 0)] > 0).all())  # zero encodes as +
    for b in range(nb):
        m = (bid == b) & real
        assert s[b] == pytest.approx(float(x[m].abs().mean()), rel=1e-6, abs=1e-12)
        assert torch.allclose(y[m].abs(), s[b].expand(int(m.sum())))


# -- topk ---------------------------------------------------------------------------
def test_topk_exact_on_kept_indices():
    x = _x(2000)
    k = 50
    idx, vals = C.topk_encode(x, k)
    assert idx.numel() == k and len(set(idx.tolist())) == k
    y = C.topk_decode(idx, vals, x.numel())
    kept = torch.zeros(x.numel(), dtype=torch.bool)
    kept[idx] = True
    assert torch.equal(y[kept], x[kept])
    assert bool((y[~kept] == 0).all())
    assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())


def test_topk_rows():
    x = torch.stack([_x(300, seed=s) for s in range(4)])
    idx, vals = C.topk_encode(x, 7)
    assert idx.shape == (4, 7)
    assert torch.equal(x.gather(1, idx), vals)


# -- orthogonalize -------------------------------------------------------------------
def test_orthogonalize_columns_orthonormal_and_zero_column_stays_zero():
    m = torch.randn(50, 3, generator=torch.Generator().manual_seed(2))
    C.orthogonalize_(m)
    assert torch.allclose(m.T @ m, torch.eye(3), atol=1e-5)
    z = torch.zeros(20, 2)
    C.orthogonalize_(z)
    assert bool((z == 0).all())


# -- error feedback -------------------------------------------------------------------
def _codec(name, n):
    if name == "int8":
        bid, nb, padded = _blocks(n)
        return padded, lambda u: C.int8_decode(*C.int8_encode(u, bid, nb), bid)
    if name == "onebit":
        bid, nb, padded = _blocks(n, align=8)
        return padded, lambda u: C.onebit_decode(*C.onebit_encode(u, bid, nb), bid)
    return n, lambda u: C.topk_decode(*C.topk_encode(u, max(1, n // 20)), n)


@pytest.mark.parametrize("name", ["int8", "onebit", "topk"])
def test_error_feedback_conserves_mass(name):
    """sum of what was sent + the residual == sum of the true gradients."""
    n = 1000
    size, roundtrip = _codec(name, n)
    e = torch.zeros(size)
    sent = torch.zeros(size, dtype=torch.float64)
    true = torch.zeros(size, dtype=torch.float64)
    for step in range(12):
        g = torch.cat([_x(n, seed=step), torch.zeros(size - n)])
        u = g + e
        d = roundtrip(u)
        e = u - d
        sent += d.double()
        true += g.double()
        assert torch.allclose(sent + e.double(), true, atol=1e-5 * float(true.abs().max()))
    assert float(e.abs().max()) > 0  # something was actually held back


# -- wire-bytes formulas ----------------------------------------------------------------
N = 921_600  # SmolLM2-135M, LoRA r=8 on q/k/v/o


def test_formula_dense():
    assert wire_bytes_formula("allreduce", N, 2) == 4 * N
    assert wire_bytes_formula("fp16", N, 2) == 2 * N
    assert wire_bytes_formula("bf16", N, 4) == 2 * N
    assert wire_bytes_formula("none", N, 2) == 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_formula_int8_and_onebit(world):
    # 1 byte a value + 4 bytes a 256-block, sent once in phase 1 and 1/n in phase 2
    shapes = LORA_R8 * 10
    numel = sum(math.prod(s) for s in shapes)
    int8 = wire_bytes_formula("int8", shapes, world)
    expected = 0.0
    for s in shapes:
        nb, bs = C.param_blocks(math.prod(s), 256, world)
        expected += (nb * bs + 4 * nb) * (1 + 1 / world)
    assert int8 == pytest.approx(expected)
    assert int8 / (4 * numel) == pytest.approx((1 + 1 / world) * (1 + 4 / 256) / 4, rel=0.02)
    # onebit ~ 1/32 of fp32 per phase, plus one fp32 scale per 512 values
    onebit = wire_bytes_formula("onebit", shapes, world)
    assert onebit / (4 * numel) == pytest.approx((1 + 1 / world) * (1 / 32 + 1 / 512), rel=0.02)
    ops = collectives_formula("onebit", shapes, world, buckets=3)
    assert [c["op"] for c in ops] == ["all_to_all", "all_gather"]
    assert all(c["calls_per_step"] == 3 for c in ops)
    assert ops[1]["bytes_per_step"] == pytest.approx(ops[0]["bytes_per_step"] / world)


def test_formula_topk_counts_indices():
    assert wire_bytes_formula("topk", N, 2, ratio=0.01) == 8 * math.ceil(0.01 * N)
    # per tensor k = max(1, ceil(ratio * numel))
    assert wire_bytes_formula("topk", [10, 1000], 3, ratio=0.01) == 8 * (1 + 10)


def test_formula_powersgd_lora():
    # rank 1 on 8 x 576: (8 + 576) values instead of 4608 -> 7.9x
    assert wire_bytes_formula("powersgd", [(8, 576)], 2, rank=1) == 4 * (8 + 576)
    # rank 2 -> 3.9x; rank 8 (= r) would not compress, so it is sent as is
    assert wire_bytes_formula("powersgd", [(8, 576)], 2, rank=2) == 4 * 2 * (8 + 576)
    assert wire_bytes_formula("powersgd", [(8, 576)], 2, rank=8) == 4 * 8 * 576
    # 1-D tensors always uncompressed; two all-reduces when something is compressed
    ops = collectives_formula("powersgd", [(8, 576), (576,)], 2, rank=1)
    assert [c["bytes_per_step"] for c in ops] == [4 * (8 + 576), 4 * 576]
    # from a total size and the LoRA rank (the planner's view): r x (N/r)
    assert wire_bytes_formula("powersgd", N, 2, rank=1, lora_r=8) == 4 * (8 + N // 8)


def test_formula_periodic_amortised():
    assert wire_bytes_formula("local", N, 2, period=8) == 4 * N / 8
    assert wire_bytes_formula("diloco", N, 2) == 4 * N / 8
    assert wire_bytes_formula("diloco", N, 2, period=4, delta_dtype="fp16") == 2 * N / 4
    assert collectives_formula("local", N, 2, period=8)[0]["calls_per_step"] == 1 / 8


def test_formula_rejects_bad_input():
    with pytest.raises(ValueError, match="ratio"):
        wire_bytes_formula("int8", N, 2, ratio=0.1)
    with pytest.raises(ValueError, match="bogus"):
        wire_bytes_formula("bogus", N, 2)
    with pytest.raises(ValueError, match="numel"):
        wire_bytes_formula("allreduce", [0], 2)


def test_block_paths_give_identical_bits():
    """Uniform blocks (reshape path) and the same blocks given by ids (gather
    path) must agree bit for bit: which path runs depends on DDP's bucket
    layout, and resume must not."""
    n, bs = 24 * 40, 24
    x = _x(n)
    bid = torch.arange(n) // bs
    for enc, dec in ((C.int8_encode, C.int8_decode), (C.onebit_encode, C.onebit_decode)):
        a = enc(x, bs, n // bs)
        b = enc(x, bid, n // bs)
        assert all(torch.equal(p, q) for p, q in zip(a, b))
        assert torch.equal(dec(*a, bs), dec(*b, bid))
    # and a block's sum does not depend on its neighbours' sizes
    mixed = torch.cat([torch.zeros(24, dtype=torch.long), torch.ones(40, dtype=torch.long)])
    y = _x(64, seed=3)
    _, s_mixed = C.onebit_encode(y, mixed, 2)
    _, s_alone = C.onebit_encode(y[:24], 24, 1)
    assert torch.equal(s_mixed[:1], s_alone)
