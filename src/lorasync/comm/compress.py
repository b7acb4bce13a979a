"""Pure compressors: blockwise int8, 1-bit signs, top-k, and PowerSGD's
orthogonalisation, and DiLoCo's outer-delta codec (:class:`DeltaCodec`:
int8/int4/int2 blocks, top-k values + indices, packed into one byte buffer).  No
communication here; the strategies compose these with collectives and error
feedback.

Blocks are described by a block id per element (``bid``, int64) and a block
count, so blocks may differ in size, or by an int block size when they are
all equal (the fast path: a reshape instead of scatter/gather): the strategies cut every parameter into
its own blocks (:func:`lorasync.catalog.param_blocks`), which keeps the compressed value of
an element independent of how DDP happens to bucket the parameters (DDP's
first iteration uses a different bucket layout from later ones, and a resumed
run starts with that first layout again).

Device: every function works on the device of its inputs (CPU, CUDA, meta)
and allocates nothing elsewhere; block ids, counts and ``sum_index`` must be
on that device too.  None synchronises with the host, except the
conveniences documented as doing so (``count=None`` or no ``sum_index``
with block ids given as a tensor).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "block_sum_index",
    "int8_encode", "int8_decode",
    "onebit_encode", "onebit_decode", "pack_bits", "unpack_bits",
    "topk_encode", "topk_decode",
    "orthogonalize_",
    "quantize_blocks", "dequantize_blocks", "pack_int4", "unpack_int4", "pack_int2",
    "unpack_int2", "DeltaCodec",
]

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8, device="cpu")
_SHIFTS_ON: dict[torch.device, torch.Tensor] = {_SHIFTS.device: _SHIFTS}


def _shifts(device: torch.device) -> torch.Tensor:
    """The bit shifts of :func:`pack_bits` on ``device`` (copied there once)."""
    t = _SHIFTS_ON.get(device)
    if t is None:
        t = _SHIFTS_ON[device] = _SHIFTS.to(device)
    return t


def block_sum_index(bid: torch.Tensor, nblocks: int) -> tuple[torch.Tensor, int]:
    """Where :func:`_block_sum` puts each element of blocks given by ids:
    ``(position in the nblocks x width padded matrix, width)``.

    Reads the largest block size back to the host (one sync on a GPU), so a
    caller with fixed block ids computes this once and passes it as
    ``sum_index`` to :func:`onebit_encode`.
    """
    sizes = torch.bincount(bid, minlength=nblocks)
    width = 1 << (int(sizes.max()) - 1).bit_length()  # host sync, see above
    starts = torch.cumsum(sizes, 0) - sizes
    col = torch.arange(bid.numel(), device=bid.device) - starts.index_select(0, bid)
    return bid * width + col, width


# -- per-block helpers ----------------------------------------------------------
# ``bid`` is either an int (every block has that many elements: fast reshape
# path) or an int64 tensor with the block id of every element.
Blocks = "int | torch.Tensor"


def _block_amax(xabs: torch.Tensor, bid, nblocks: int) -> torch.Tensor:
    if isinstance(bid, int):
        return xabs.view(-1, bid).amax(dim=1)
    return torch.zeros(nblocks, dtype=torch.float32, device=xabs.device).scatter_reduce_(
        0, bid, xabs, "amax", include_self=True)


def _block_sum(x: torch.Tensor, bid, nblocks: int,
               sum_index: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Per-block sums in a fixed order: each block zero-padded to a power of
    two and halved pairwise.  Adding the zero padding is exact, so a block
    gives the same bits whatever the padded width -- in particular on the
    reshape path and the block-id path, so a sum does not depend on DDP's
    bucket layout (``sum``/``index_add_`` order their additions by shape).
    Blocks given by ids must be contiguous and in increasing order;
    ``sum_index`` (:func:`block_sum_index` of ``bid``) saves recomputing
    their layout and its host sync.
    """
    if isinstance(bid, int):
        width = 1 << (bid - 1).bit_length()
        m = x.view(-1, bid)
        if width != bid:
            m = torch.nn.functional.pad(m, (0, width - bid))
    else:
        pos, width = sum_index if sum_index is not None else block_sum_index(bid, nblocks)
        m = torch.zeros(nblocks * width, dtype=x.dtype, device=x.device).index_copy_(0, pos, x)
        m = m.view(nblocks, width)
    while m.shape[1] > 1:
        h = m.shape[1] // 2
        m = m[:, :h] + m[:, h:]
    return m[:, 0]


def _times_scale(v: torch.Tensor, scale: torch.Tensor, bid) -> torch.Tensor:
    if isinstance(bid, int):
        return (v.view(-1, bid) * scale.unsqueeze(1)).view(-1)
    return v * scale.index_select(0, bid)


# -- int8 ---------------------------------------------------------------------
def int8_encode(x: torch.Tensor, bid, nblocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per block: ``scale = max|x| / 127``.

    Round-to-nearest gives ``|x - q * scale| <= scale / 2`` per element.
    """
    x = x.reshape(-1).float()
    scale = _block_amax(x.abs(), bid, nblocks) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(_times_scale(x, inv, bid)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_decode(q: torch.Tensor, scale: torch.Tensor, bid) -> torch.Tensor:
    return _times_scale(q.reshape(-1).float(), scale, bid)


# -- 1-bit --------------------------------------------------------------------
def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (length a multiple of 8) into uint8, MSB first."""
    b = bits.reshape(-1, 8).to(torch.uint8)
    return (b << _shifts(b.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    return ((packed.reshape(-1, 1) >> _shifts(packed.device)) & 1).reshape(-1).bool()


def onebit_encode(x: torch.Tensor, bid, nblocks: int, count: torch.Tensor | None = None,
                  sum_index: tuple[torch.Tensor, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs (``x >= 0`` -> +), bit-packed, and one scale per block: mean |x|.

    ``count`` (elements per block that are real, not padding) makes the mean
    ignore zero padding; default: all elements count (with block ids as a
    tensor that default costs a host sync on a GPU: pass ``count``).  ``x``
    must have a multiple of 8 elements; ``sum_index``: see :func:`_block_sum`.
    """
    x = x.reshape(-1).float()
    if count is None:
        count = (torch.full((nblocks,), float(bid), device=x.device) if isinstance(bid, int)
                 else torch.bincount(bid, minlength=nblocks).float())
    scale = _block_sum(x.abs(), bid, nblocks, sum_index) / count.clamp(min=1)
    return pack_bits(x >= 0), scale


def onebit_decode(packed: torch.Tensor, scale: torch.Tensor, bid) -> torch.Tensor:
    sign = unpack_bits(packed).float().mul_(2).sub_(1)
    return _times_scale(sign, scale, bid)


# -- top-k --------------------------------------------------------------------
def topk_encode(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude entries of each row of ``x`` (1-D or 2-D):
    ``(indices int64, values)`` with the same leading shape."""
    idx = x.abs().topk(k, dim=-1, sorted=False).indices
    return idx, x.gather(-1, idx)


def topk_decode(idx: torch.Tensor, vals: torch.Tensor, numel: int) -> torch.Tensor:
    """The sum of sparse vectors of ``numel`` elements: row j of ``idx`` and
    ``vals`` (2-D; 1-D is one row) is one vector, e.g. one rank's top-k.

    Rows are added one after another, in order: within a row the indices are
    distinct, so every device gives the same bits (one ``index_add_`` over
    all rows would add duplicates in an order a GPU does not fix)."""
    out = torch.zeros(numel, dtype=vals.dtype, device=vals.device)
    for i, v in zip(idx.reshape(-1, idx.shape[-1]), vals.reshape(-1, vals.shape[-1])):
        out.index_add_(0, i.long(), v)
    return out


# -- PowerSGD -----------------------------------------------------------------
def orthogonalize_(m: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``m`` (a x k, or a batch g x a x k) in
    place, as torch's PowerSGD.  A zero column stays zero."""
    k = m.shape[-1]
    for i in range(k):
        col = m[..., i:i + 1]
        col.div_(col.norm(dim=-2, keepdim=True) + eps)
        if i + 1 < k:
            rest = m[..., i + 1:]
            rest.sub_(col @ (col.transpose(-1, -2) @ rest))
    return m


# -- blockwise int8 / int4 / int2 (equal blocks) ----------------------------------
#: largest code of a symmetric signed integer of ``bits`` bits
_LEVELS = {8: 127, 4: 7}


def quantize_blocks(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of the rows of ``x`` (blocks x block size), one fp32 scale per
    row, ``|x - decoded| <= scale / 2`` everywhere.

    int8 (``bits`` 8) or int4 (4): symmetric, ``scale = max|row| / L`` with
    L = 127 or 7, codes int8 in [-L, L] standing for ``q * scale``.

    int2 (2): four levels with no zero, ``(q + 1/2) * scale`` for q in
    [-2, 1], i.e. +-scale/2 and +-3 scale/2, ``scale = max|row| / 1.5``.  A
    symmetric 2-bit code would spend one of its four codes on zero and have
    only one magnitude; the values int2 is meant for are top-k entries (the
    largest of their tensor: none near zero, SparseLoCo's 2-bit outer sync),
    and a dense block's small values are carried by error feedback.  An
    all-zero block has scale 0 and decodes to zeros."""
    x = x.float()
    if bits == 2:
        scale = x.abs().amax(dim=1) / 1.5
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(x * inv.unsqueeze(1) - 0.5).clamp_(-2, 1).to(torch.int8)
        return q, scale
    levels = _LEVELS[bits]
    scale = x.abs().amax(dim=1) / levels
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(x * inv.unsqueeze(1)).clamp_(-levels, levels).to(torch.int8)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The values codes of :func:`quantize_blocks` with ``bits`` stand for."""
    v = q.float()
    if bits == 2:
        v = v.add_(0.5)
    return v * scale.unsqueeze(1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] (an even count) -> uint8, two a byte (low nibble first)."""
    u = (q.reshape(-1, 2).to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0] | (u[:, 1] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    lo = (p & 15).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=1).reshape(-1)


def pack_int2(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-2, 1] (a multiple of 4 of them) -> uint8, four a byte
    (the first in the lowest two bits)."""
    u = (q.reshape(-1, 4) + 2).to(torch.uint8)
    return u[:, 0] | (u[:, 1] << 2) | (u[:, 2] << 4) | (u[:, 3] << 6)


def unpack_int2(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([((p >> s) & 3).to(torch.int8) - 2 for s in (0, 2, 4, 6)],
                       dim=1).reshape(-1)


# -- DiLoCo's outer delta ---------------------------------------------------------
_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4, "int2": 2}
_PACK = {8: lambda q: q.view(torch.uint8), 4: pack_int4, 2: pack_int2}
_UNPACK = {8: lambda c: c.view(torch.int8), 4: unpack_int4, 2: unpack_int2}


class DeltaCodec:
    """One fragment's outer delta as one uint8 buffer per rank, and back.

    The fragment is a run of whole tensors, back to back in a flat fp32
    vector (``numels`` each).  Per tensor: with ``ratio < 1`` its
    ``max(1, ceil(ratio m))`` largest-magnitude entries and their indices
    (local to the tensor: int16 while it has at most 65,536 elements, else
    int32), else all of it; the values as fp32/fp16/bf16, or as int8/int4/int2
    codes in blocks of ``block`` values (the tensor's values zero-padded to
    whole blocks) with one fp32 scale a block.  Tensors of equal size are
    coded together as the rows of one matrix (a LoRA adapter has a few
    distinct shapes), so the cost does not grow with the number of tensors.

    The buffer holds, for every size group, its scales, indices and values,
    laid out by element size (4-byte sections first, then 2-byte, then
    bytes), so every section can be viewed in place.  ``nbytes`` equals
    :func:`lorasync.catalog.delta_tensor_bytes` summed over the tensors (the
    byte formula).  The index tensors are built on the host once and moved to
    ``device``; encode and decode then run on the inputs' device (CPU, CUDA,
    meta) without host syncs.
    """

    def __init__(self, numels: Sequence[int], dtype: str, block: int = 64, ratio: float = 1.0,
                 device: torch.device | str = "cpu"):
        if dtype not in _BITS:
            raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(_BITS)}")
        self.dtype, self.bits, self.block, self.ratio = dtype, _BITS[dtype], int(block), ratio
        if self.bits <= 8 and self.block % 2:
            raise ValueError(f"block: int4/int8 blocks must be even, got {block}")
        if self.bits == 2 and self.block % 4:
            raise ValueError(f"block: int2 blocks must be a multiple of 4, got {block}")
        self.sparse = ratio < 1.0
        self.numel = int(sum(numels))
        host = torch.device("cpu")
        by_size: dict[int, list[int]] = {}
        off = 0
        for m in numels:
            by_size.setdefault(int(m), []).append(off)
            off += int(m)
        self.groups = []
        sections: list[tuple[int, int, str, int]] = []  # (elem size, group, what, count)
        for gi, (m, offs) in enumerate(by_size.items()):
            g = len(offs)
            k = max(1, math.ceil(ratio * m)) if self.sparse else m
            nb = math.ceil(k / self.block) if self.bits <= 8 else 0
            pos = (torch.tensor(offs, device=host).unsqueeze(1)
                   + torch.arange(m, device=host)).to(device)
            self.groups.append({"m": m, "g": g, "k": k, "nb": nb, "pos": pos})
            if nb:
                sections.append((4, gi, "scale", g * nb))
            if self.sparse:
                sections.append((2 if m <= 1 << 16 else 4, gi, "index", g * k))
            if self.bits > 8:
                sections.append((self.bits // 8, gi, "value", g * k))
            else:
                sections.append((1, gi, "code", g * nb * self.block * self.bits // 8))
        sections.sort(key=lambda t: -t[0])
        self._layout: dict[tuple[int, str], tuple[int, int, torch.dtype]] = {}
        at = 0
        for size, gi, what, count in sections:
            dt = {"scale": torch.float32, "code": torch.uint8,
                  "index": torch.int16 if size == 2 else torch.int32,
                  "value": _FLOATS.get(dtype, torch.float32)}[what]
            self._layout[(gi, what)] = (at, at + size * count, dt)
            at += size * count
        #: bytes of one rank's buffer
        self.nbytes = at

    # -- encode ---------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The buffer (uint8, ``nbytes``) of the flat fp32 fragment ``x``."""
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=x.device)
        x = x.reshape(-1).float()
        for gi, grp in enumerate(self.groups):
            rows = x.index_select(0, grp["pos"].reshape(-1)).view(grp["g"], grp["m"])
            if self.sparse:
                idx = rows.abs().topk(grp["k"], dim=1, sorted=False).indices
                vals = rows.gather(1, idx)
                short = self._layout[(gi, "index")][2] == torch.int16
                self._put(buf, gi, "index", (idx - 32768).to(torch.int16) if short
                          else idx.to(torch.int32))
            else:
                vals = rows
            if self.bits > 8:
                self._put(buf, gi, "value", vals.to(_FLOATS[self.dtype]))
                continue
            width = grp["nb"] * self.block
            if width != vals.shape[1]:
                vals = torch.nn.functional.pad(vals, (0, width - vals.shape[1]))
            q, scale = quantize_blocks(vals.reshape(-1, self.block), self.bits)
            self._put(buf, gi, "scale", scale)
            self._put(buf, gi, "code", _PACK[self.bits](q))
        return buf

    def _put(self, buf: torch.Tensor, gi: int, what: str, t: torch.Tensor) -> None:
        a, b, dt = self._layout[(gi, what)]
        buf[a:b].view(dt).copy_(t.reshape(-1))

    # -- decode ---------------------------------------------------------------
    def _get(self, row: torch.Tensor, gi: int, what: str) -> torch.Tensor:
        a, b, dt = self._layout[(gi, what)]
        sec = row[a:b]
        if sec.storage_offset() % dt.itemsize:
            sec = sec.clone()  # a row of a gathered buffer that does not start aligned
        return sec.view(dt)

    def decode(self, buf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense fp32 fragment a buffer stands for, added to ``out`` if given."""
        dense = torch.zeros(self.numel, device=buf.device) if out is None else out
        for gi, grp in enumerate(self.groups):
            g, k = grp["g"], grp["k"]
            if self.bits > 8:
                vals = self._get(buf, gi, "value").float().view(g, k)
            else:
                scale = self._get(buf, gi, "scale")
                codes = self._get(buf, gi, "code")
                q = _UNPACK[self.bits](codes)
                vals = dequantize_blocks(q.view(-1, self.block), scale,
                                         self.bits).view(g, -1)[:, :k]
            if self.sparse:
                idx = self._get(buf, gi, "index").view(g, k).long()
                if self._layout[(gi, "index")][2] == torch.int16:
                    idx = idx + 32768
                pos = grp["pos"].gather(1, idx).reshape(-1)
            else:
                pos = grp["pos"].reshape(-1)
            # within one rank's buffer every position appears once: index_add_
            # adds in a fixed order, the same bits on every rank
            dense.index_add_(0, pos, vals.reshape(-1))
        return dense

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (rows of ``gathered``, in rank order) of their deltas."""
        rows = gathered.view(-1, self.nbytes)
        out = torch.zeros(self.numel, device=gathered.device)
        for r in range(rows.shape[0]):
            self.decode(rows[r], out)
        return out
