"""DiLoCo's outer-delta codec (compress.DeltaCodec): round trip, error
feedback conserving mass, and buffers of exactly the catalog's bytes, on the
CPU, CUDA (skipped without a GPU) and the meta device."""

from __future__ import annotations

import math

import pytest
import torch

from lorasync import catalog
from lorasync.comm import compress as C

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
DEVICES = ["cpu", CUDA]
# LoRA-like tensors (A: r x d, B: d x r, of a few distinct sizes), a 1-D bias,
# one odd size and one too big for 2-byte indices
NUMELS = [8 * 64, 64 * 8, 8 * 64, 24 * 8, 5, 333, 70_000]
CODECS = [("int8", 1.0), ("int4", 1.0), ("int8", 0.05), ("int4", 0.03), ("fp16", 0.1),
          ("bf16", 0.02), ("fp32", 0.2), ("int2", 1.0), ("int2", 0.01), ("int2", 0.05)]
#: the largest magnitude of each integer delta dtype's codes, in units of its scale
LEVELS = {8: 127, 4: 7, 2: 1.5}


def _x(n: int, device="cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-5, 0, n).roll(n // 3)
    x[n // 7: n // 7 + 90] = 0   # an all-zero stretch: blocks with scale 0
    return x.to(device)


@pytest.mark.parametrize("dtype, ratio", CODECS)
@pytest.mark.parametrize("block", [64, 16])
def test_buffer_is_the_formulas_bytes(dtype, ratio, block):
    opts = {"delta_dtype": dtype, "delta_topk": ratio}
    if catalog.DELTA_BITS[dtype] <= 8:
        opts["delta_block"] = block
    o = catalog.parse_options("diloco", opts)
    codec = C.DeltaCodec(NUMELS, dtype, block, ratio)
    assert codec.nbytes == sum(catalog.delta_tensor_bytes(m, o) for m in NUMELS)
    buf = codec.encode(_x(sum(NUMELS)))
    assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes
    # and the strategy's collective carries that: the catalog's all-gather
    [c] = catalog.collectives("diloco", NUMELS, 2, o)
    assert (c.kind, c.payload_bytes) == ("all_gather", codec.nbytes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dense_roundtrip_error_at_most_half_a_step(device, bits):
    n = sum(NUMELS)
    x = _x(n, device)
    codec = C.DeltaCodec(NUMELS, f"int{bits}", 32, 1.0, device=device)
    y = codec.decode(codec.encode(x))
    assert y.device.type == torch.device(device).type
    levels = LEVELS[bits]
    off = 0
    for m in NUMELS:   # per tensor, per block of 32 of its values: max|x| / L / 2
        pad = -m % 32
        xs = torch.nn.functional.pad(x[off:off + m], (0, pad)).view(-1, 32)
        err = torch.nn.functional.pad((y - x)[off:off + m], (0, pad)).view(-1, 32).abs()
        bound = xs.abs().amax(dim=1, keepdim=True) / levels / 2 * (1 + 1e-4) + 1e-30
        assert bool((err <= bound).all()), m
        off += m
    if bits > 2:   # int2 has no zero level: a zero beside non-zeros arrives as +-scale/2
        assert bool((y[n // 7 + 10: n // 7 + 80] == 0).all())   # inside the zero stretch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_sparse_keeps_the_largest_of_each_tensor(device, dtype):
    n = sum(NUMELS)
    x = _x(n, device, seed=3)
    codec = C.DeltaCodec(NUMELS, dtype, 64, 0.1, device=device)
    y = codec.decode(codec.encode(x))
    off = 0
    for m in NUMELS:
        xs, ys = x[off:off + m], y[off:off + m]
        k = catalog.topk_k(m, 0.1)
        kept = ys != 0
        assert int(kept.sum()) <= k
        if dtype == "fp32":   # the kept values arrive exactly, and they are the largest
            assert torch.equal(ys[kept], xs[kept])
            top = xs.abs().topk(k).values
            assert float(xs[kept].abs().min()) >= float(top[-1]) - 1e-12
        off += m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, ratio", CODECS)
def test_error_feedback_conserves_mass(device, dtype, ratio):
    """sum of what the buffers carried + the residual == sum of the deltas."""
    n = sum(NUMELS)
    codec = C.DeltaCodec(NUMELS, dtype, 16, ratio, device=device)
    e = torch.zeros(n, device=device)
    sent = torch.zeros(n, dtype=torch.float64, device=device)
    true = torch.zeros_like(sent)
    for step in range(10):
        d = _x(n, device, seed=step)
        u = d + e
        got = codec.decode(codec.encode(u))
        e = u - got
        sent += got.double()
        true += d.double()
        assert torch.allclose(sent + e.double(), true, atol=1e-6 * float(true.abs().max()))
    assert float(e.abs().max()) > 0   # something was held back


@pytest.mark.parametrize("dtype, ratio", [("int4", 1.0), ("int8", 0.05), ("fp16", 0.1),
                                          ("int2", 0.03)])
def test_decode_sum_adds_ranks_in_order(dtype, ratio):
    n = sum(NUMELS)
    codec = C.DeltaCodec(NUMELS, dtype, 64, ratio)
    bufs = [codec.encode(_x(n, seed=r)) for r in range(3)]
    gathered = torch.cat(bufs)    # what all_gather hands every rank
    want = codec.decode(bufs[0])
    for b in bufs[1:]:
        want = codec.decode(b, want)
    assert torch.equal(codec.decode_sum(gathered), want)
    # rows that do not start 4-byte aligned (nbytes odd) decode the same
    assert codec.decode_sum(gathered).shape == (n,)


def test_int4_packing_roundtrip():
    q = torch.arange(-7, 8, dtype=torch.int8).repeat(4)[:58]
    p = C.pack_int4(q)
    assert p.dtype == torch.uint8 and p.numel() == 29
    assert torch.equal(C.unpack_int4(p), q)


def test_int2_packing_roundtrip():
    q = torch.tensor([-2, -1, 0, 1], dtype=torch.int8).repeat(9)[:32].roll(3)
    p = C.pack_int2(q)
    assert p.dtype == torch.uint8 and p.numel() == 8
    assert torch.equal(C.unpack_int2(p), q)


def test_int2_levels_have_no_zero_and_keep_the_sign():
    """Four levels, +-s/2 and +-3s/2 with s = max|x| / 1.5: the block's
    largest value arrives exactly, every value within s/2 and with its sign
    (the top-k values int2 is for are never near zero); an all-zero block
    decodes to zeros."""
    x = torch.tensor([[3.0, -3.0, 1.2, -0.9, 0.4, -0.1, 2.1, -1.6],
                      [0.0] * 8])
    q, scale = C.quantize_blocks(x, 2)
    assert int(q.min()) >= -2 and int(q.max()) <= 1
    y = C.dequantize_blocks(q, scale, 2)
    s = 3.0 / 1.5
    assert y[0, 0] == 3.0 and y[0, 1] == -3.0
    assert set(y[0].abs().tolist()) <= {s / 2, 3 * s / 2}
    assert bool(((y[0] - x[0]).abs() <= s / 2 + 1e-6).all())
    assert torch.equal(torch.sign(y[0]), torch.sign(x[0]))
    assert torch.equal(y[1], torch.zeros(8))


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_int2_topk_keeps_the_largest_within_half_a_step(ratio):
    """int2 with top-k (SparseLoCo's outer sync): the kept entries are each
    tensor's largest, each decoded within half its block's step, same sign."""
    n = sum(NUMELS)
    x = _x(n, seed=5)
    codec = C.DeltaCodec(NUMELS, "int2", 16, ratio)
    y = codec.decode(codec.encode(x))
    off = 0
    for m in NUMELS:
        xs, ys = x[off:off + m], y[off:off + m]
        k = catalog.topk_k(m, ratio)
        kept = ys != 0
        top = xs.abs().topk(k)
        assert int(kept.sum()) == int((top.values > 0).sum())
        assert bool(kept[top.indices[top.values > 0]].all())
        # a block of 16 kept values has scale max|x| / 1.5; the tensor's largest bounds them all
        step = float(top.values[0]) / 1.5
        assert bool(((ys - xs)[kept].abs() <= step / 2 * (1 + 1e-5)).all()), m
        assert torch.equal(torch.sign(ys[kept]), torch.sign(xs[kept]))
        off += m


def test_codec_refuses_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        C.DeltaCodec([10], "fp8")
    with pytest.raises(ValueError, match="even"):
        C.DeltaCodec([10], "int4", block=5)
    with pytest.raises(ValueError, match="multiple of 4"):
        C.DeltaCodec([10], "int2", block=6)


@pytest.mark.parametrize("dtype, ratio", CODECS)
def test_meta_device(dtype, ratio):
    """Nothing of the codec comes from the CPU (the mistake that breaks NCCL)."""
    n = sum(NUMELS)
    codec = C.DeltaCodec(NUMELS, dtype, 64, ratio, device="meta")
    buf = codec.encode(torch.empty(n, device="meta"))
    assert buf.device.type == "meta" and buf.shape == (codec.nbytes,)
    y = codec.decode_sum(torch.empty(2 * codec.nbytes, dtype=torch.uint8, device="meta"))
    assert y.device.type == "meta" and y.shape == (n,)


def test_odd_sized_rows_decode_like_aligned_ones():
    # a buffer whose size is not a multiple of 4: gathered row 1 starts unaligned
    codec = C.DeltaCodec([1, 2], "int4", 2)
    assert codec.nbytes % 4
    a, b = codec.encode(_x(3, seed=1)), codec.encode(_x(3, seed=2))
    s = codec.decode_sum(torch.cat([a, b]))
    assert torch.equal(s, codec.decode(b, codec.decode(a)))
    assert math.isfinite(float(s.abs().sum()))
