"""How lorasync sets up DDP for a LoRA model: what travels at start-up and per forward.

Shared by lorasync's own trainer (``train/trainer.py``) and the Hugging Face
integration (``lorasync.hf``):

* :func:`same_on_every_rank`: a 16-byte check that every rank holds the same
  adapter, so DDP's start-up broadcast of the whole module (frozen base
  weights included) can be skipped (``init_sync=False``);
* :func:`make_identical`: that check, and a broadcast of the adapter alone
  from rank 0 only when it fails;
* :func:`buffer_sync_kwarg`: DDP's per-forward buffer broadcast switch under
  the name this torch uses.
"""

from __future__ import annotations

__all__ = ["same_on_every_rank", "make_identical", "buffer_sync_kwarg"]


def same_on_every_rank(tensors, device) -> bool:
    """True when ``tensors`` hold the same bytes on every rank (16 bytes on the
    wire: the MIN all-reduce of (h, -h) for a 63-bit prefix h of a SHA-256)."""
    import hashlib

    import torch
    import torch.distributed as dist

    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h = int.from_bytes(digest.digest()[:8], "little") >> 1     # fits in int64
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    return int(both[0]) == h and -int(both[1]) == h


def make_identical(tensors, device, src: int = 0) -> int:
    """Make ``tensors`` (the adapter) identical on every rank; return the bytes
    this rank handed to collectives for it.

    Ranks that initialised the adapter from the same seed pass the hash check
    (16 bytes) and nothing else moves; otherwise rank ``src``'s values are
    broadcast in place (the adapter's size, a few MB, never the base model).
    Every rank must call it, with its tensors in the same order.
    """
    import torch
    import torch.distributed as dist

    sent = 16
    if same_on_every_rank(tensors, device):
        return sent
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src)
            sent += t.numel() * t.element_size()
    return sent


def buffer_sync_kwarg(enabled: bool) -> dict:
    """DDP's per-forward buffer broadcast switch under its current name.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (the
    old name still works, with a warning); older releases only know the old one.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}
