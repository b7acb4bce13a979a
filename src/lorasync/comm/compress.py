"""Pure compressors: blockwise int8, 1-bit signs, top-k, and PowerSGD's
orthogonalisation.  No communication here; the strategies compose these with
collectives and error feedback.

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


import torch

__all__ = [
    "block_sum_index",
    "int8_encode", "int8_decode",
    "onebit_encode", "onebit_decode", "pack_bits", "unpack_bits",
    "topk_encode", "topk_decode",
    "orthogonalize_",
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
