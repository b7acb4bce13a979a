"""The compressors on other devices than the CPU.

* ``cuda``: the round-trip error bounds, error-feedback mass conservation and
  bit packing of test_compressors.py, on the GPU (skipped without one), plus
  the same bits as on the CPU.
* ``meta``: every encode/decode runs on meta tensors (shapes and dtypes, no
  data), which fails if a compressor mixes in a tensor it made on the CPU --
  the mistake that breaks NCCL runs -- so it is caught on machines without a
  GPU too.
"""

from __future__ import annotations

import pytest
import torch

from lorasync.catalog import param_blocks
from lorasync.comm import compress as C

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
DEVICES = ["cpu", CUDA]


def _x(n: int, device, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """As test_compressors._x: blocks of very different magnitude, zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    x *= torch.logspace(-4, 2, n).roll(n // 3)
    x[n // 5: n // 5 + 70] = 0
    return x.to(device)


def _blocks(n: int, device, block: int = 64, world: int = 2, align: int = 1):
    nb, bs = param_blocks(n, block, world, align)
    bid = torch.arange(nb * bs, device=device) // bs
    return bid, nb, nb * bs, bs


def _on(device, *tensors):
    want = torch.device(device)
    for t in tensors:
        assert t.device.type == want.type, (t.device, want)


# -- cpu / cuda ------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
def test_int8_roundtrip_error_at_most_half_a_step(device, scale):
    n = 1000
    bid, nb, padded, bs = _blocks(n, device)
    x = torch.cat([_x(n, device, scale=scale), torch.zeros(padded - n, device=device)])
    for blocks in (bid, bs):  # block ids (gather path) and equal blocks (reshape path)
        q, s = C.int8_encode(x, blocks, nb)
        _on(device, q, s)
        assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.numel() == nb
        y = C.int8_decode(q, s, blocks)
        _on(device, y)
        err = (y - x).abs()
        assert bool((err <= s[bid] / 2 * (1 + 1e-6) + 1e-30).all())
        assert int(q.abs().max()) == 127
        assert bool((y[(s == 0)[bid]] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_pack_bits_roundtrip(device):
    bits = (torch.rand(8 * 37, generator=torch.Generator().manual_seed(1)) > 0.5).to(device)
    packed = C.pack_bits(bits)
    _on(device, packed)
    assert packed.dtype == torch.uint8 and packed.numel() == 37
    assert torch.equal(C.unpack_bits(packed), bits)
    # MSB first: 0b10000001
    one = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool, device=device)
    assert int(C.pack_bits(one)) == 129


@pytest.mark.parametrize("device", DEVICES)
def test_onebit_sign_exact_and_scale_is_block_mean_abs(device):
    n = 1000
    bid, nb, padded, _ = _blocks(n, device, block=64, align=8)
    x = torch.cat([_x(n, device), torch.zeros(padded - n, device=device)])
    real = torch.arange(padded, device=device) < n
    count = torch.zeros(nb, device=device).index_add_(0, bid, real.float())
    sidx = C.block_sum_index(bid, nb)
    packed, s = C.onebit_encode(x, bid, nb, count, sum_index=sidx)
    _on(device, packed, s, sidx[0])
    p2, s2 = C.onebit_encode(x, bid, nb, count)  # sum_index worked out inside: same bits
    assert torch.equal(packed, p2) and torch.equal(s, s2)
    y = C.onebit_decode(packed, s, bid)
    nz, pos = x != 0, s[bid] > 0
    assert torch.equal(torch.sign(y[nz & pos]), torch.sign(x[nz & pos]))
    assert bool((y[(x == 0) & pos] > 0).all())
    for b in range(nb):
        m = (bid == b) & real
        assert float(s[b]) == pytest.approx(float(x[m].abs().mean()), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_topk_exact_on_kept_indices(device):
    x = _x(2000, device)
    idx, vals = C.topk_encode(x, 50)
    y = C.topk_decode(idx, vals, x.numel())
    _on(device, idx, vals, y)
    kept = torch.zeros(x.numel(), dtype=torch.bool, device=device)
    kept[idx] = True
    assert int(kept.sum()) == 50
    assert torch.equal(y[kept], x[kept]) and bool((y[~kept] == 0).all())
    assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())


@pytest.mark.parametrize("device", DEVICES)
def test_orthogonalize(device):
    m = torch.randn(4, 50, 3, generator=torch.Generator().manual_seed(2)).to(device)
    C.orthogonalize_(m)
    _on(device, m)
    eye = torch.eye(3, device=device).expand(4, 3, 3)
    assert torch.allclose(m.transpose(1, 2) @ m, eye, atol=1e-5)
    z = torch.zeros(20, 2, device=device)
    assert bool((C.orthogonalize_(z) == 0).all())


def _codec(name, n, device):
    if name == "int8":
        bid, nb, padded, _ = _blocks(n, device)
        return padded, lambda u: C.int8_decode(*C.int8_encode(u, bid, nb), bid)
    if name == "onebit":
        bid, nb, padded, bs = _blocks(n, device, align=8)
        return padded, lambda u: C.onebit_decode(*C.onebit_encode(u, bs, nb), bs)
    return n, lambda u: C.topk_decode(*C.topk_encode(u, max(1, n // 20)), n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["int8", "onebit", "topk"])
def test_error_feedback_conserves_mass(device, name):
    n = 1000
    size, roundtrip = _codec(name, n, device)
    e = torch.zeros(size, device=device)
    sent = torch.zeros(size, dtype=torch.float64, device=device)
    true = torch.zeros_like(sent)
    for step in range(12):
        g = torch.cat([_x(n, device, seed=step), torch.zeros(size - n, device=device)])
        u = g + e
        d = roundtrip(u)
        _on(device, d)
        e = u - d
        sent += d.double()
        true += g.double()
        assert torch.allclose(sent + e.double(), true, atol=1e-5 * float(true.abs().max()))
    assert float(e.abs().max()) > 0


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_agrees_with_cpu():
    """The GPU codes what the CPU does, up to rounding: CUDA divides by a
    scalar as a multiplication by its reciprocal, so a scale may differ in
    the last bit and an int8 code that sits on a rounding boundary by 1."""
    n = 24 * 40
    for dev_bid, cpu_bid, nb in (((torch.arange(n) // 24).cuda(), torch.arange(n) // 24, 40),
                                 (24, 24, 40)):
        x = _x(n, "cpu")
        q, s = C.int8_encode(x, cpu_bid, nb)
        qc, sc = C.int8_encode(x.cuda(), dev_bid, nb)
        assert torch.allclose(sc.cpu(), s, rtol=1e-6, atol=0)
        assert int((qc.cpu().int() - q.int()).abs().max()) <= 1
        p, s = C.onebit_encode(x, cpu_bid, nb)
        pc, sc = C.onebit_encode(x.cuda(), dev_bid, nb)
        assert torch.equal(pc.cpu(), p)  # signs are exact
        assert torch.allclose(sc.cpu(), s, rtol=1e-6, atol=0)


# -- meta: nothing may come from the CPU ---------------------------------------------------
def test_meta_device_int8_and_onebit():
    n, nb, bs = 24 * 40, 40, 24
    x = torch.empty(n, device="meta")
    bid = (torch.arange(n) // bs).to("meta")
    for blocks in (bs, bid):
        q, s = C.int8_encode(x, blocks, nb)
        assert q.device.type == s.device.type == "meta" and q.dtype == torch.int8
        assert s.shape == (nb,)
        assert C.int8_decode(q, s, blocks).device.type == "meta"
    count = torch.empty(nb, device="meta")
    sidx = tuple(v.to("meta") if isinstance(v, torch.Tensor) else v
                 for v in C.block_sum_index(torch.arange(n) // bs, nb))
    for blocks, kw in ((bs, {}), (bid, {"count": count, "sum_index": sidx})):
        packed, s = C.onebit_encode(x, blocks, nb, **kw)
        assert packed.device.type == s.device.type == "meta"
        assert packed.shape == (n // 8,) and packed.dtype == torch.uint8 and s.shape == (nb,)
        y = C.onebit_decode(packed, s, blocks)
        assert y.device.type == "meta" and y.shape == (n,)


def test_meta_device_bits_topk_orthogonalize():
    bits = torch.empty(64, dtype=torch.bool, device="meta")
    packed = C.pack_bits(bits)
    assert packed.device.type == "meta" and packed.shape == (8,)
    assert C.unpack_bits(packed).device.type == "meta"
    x = torch.empty(3, 100, device="meta")
    idx, vals = C.topk_encode(x, 5)
    assert idx.device.type == vals.device.type == "meta" and idx.shape == (3, 5)
    y = C.topk_decode(idx, vals, 300)
    assert y.device.type == "meta" and y.shape == (300,)
    m = torch.empty(2, 30, 3, device="meta")
    assert C.orthogonalize_(m).device.type == "meta"
