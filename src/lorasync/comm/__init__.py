"""Gradient-sync strategies and the public ``attach`` API.

    sync = lorasync.attach(ddp_model, "int8", **options)

``comm`` knows nothing about models or data: it gets a DDP module (whose
trainable parameters are the adapter) and optionally a process group.
"""

from __future__ import annotations

from typing import Any

import torch

from lorasync.comm import reference  # noqa: F401  (registers allreduce, none)
from lorasync.comm.base import Sync, get_strategy, strategy_names

__all__ = ["attach", "Sync", "strategy_names"]


def attach(ddp: torch.nn.parallel.DistributedDataParallel, strategy: str,
           process_group=None, **options: Any) -> Sync:
    """Attach a sync strategy to a DDP model; see the module docstring."""
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"ddp: expected torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}"
        )
    cls = get_strategy(strategy)
    return cls(ddp, process_group=process_group, **options)
