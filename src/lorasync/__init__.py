"""lorasync: distributed LoRA fine-tuning that stays fast on slow networks."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["attach", "__version__"]


def attach(ddp, strategy, **options):
    """Attach a gradient-sync strategy to a DDP model (see ``lorasync.comm``)."""
    from lorasync.comm import attach as _attach

    return _attach(ddp, strategy, **options)
