"""Compressors (pure functions); no processes.  The byte formulas: test_catalog.py."""

from __future__ import annotations


import pytest
import torch

from lorasync.catalog import param_blocks
from lorasync.comm import compress as C



def _x(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # blocks of very different magnitude, an all-zero stretch, and exact zeros
    x = torch.randn(n, generator=g) * scale
    x *= torch.logspace(-4, 2, n).roll(n // 3)
    x[n // 5: n // 5 + 70] = 0
    return x


def _blocks(n: int, block: int = 64, world: int = 2, align: int = 1):
    """Block ids as the strategies cut one parameter (param_blocks)."""
    nb, bs = param_blocks(n, block, world, align)
    bid = torch.arange(nb * bs) // bs
    return bid, nb, nb * bs


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
