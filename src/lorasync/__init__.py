"""lorasync: distributed LoRA fine-tuning that stays fast on slow networks."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["attach", "__version__"]


def attach(ddp, strategy, **options):
    """Attach a gradient-sync strategy to a DDP model (see ``lorasync.comm``)."""
    from lorasync.comm import attach as _attach

    return _attach(ddp, strategy, **options)


def __getattr__(name: str):
    # ``lorasync.hf`` (Trainer / TRL / accelerate) imports transformers and
    # accelerate: loaded on first use, so ``import lorasync`` stays light
    if name == "hf":
        import importlib

        return importlib.import_module("lorasync.hf")
    raise AttributeError(f"module 'lorasync' has no attribute {name!r}")
