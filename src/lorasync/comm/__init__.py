"""Gradient-sync strategies and the public ``attach`` API.

    sync = lorasync.attach(ddp_model, "int8", **options)
    ...
    loss.backward(); optimizer.step(); sync.after_step()
    ...
    sync.finish()

``comm`` knows nothing about models or data: it gets a DDP module (whose
trainable parameters are the adapter) and optionally a process group.

Strategies (module): allreduce, none (reference); fp16, bf16 (lowprec);
int8, onebit (twophase); topk; powersgd; local, diloco (periodic); auto
(auto: measures and switches, with the policy of ``lorasync.plan.policy``);
torch_fp16, torch_powersgd (torch_hooks: torch's own hooks, bench baselines).
Their options, kinds and byte formulas are in :mod:`lorasync.catalog`
(``catalog.wire_bytes`` gives the bytes per step without running anything).
"""

from __future__ import annotations

from typing import Any

import torch

from lorasync.comm import (auto, lowprec, periodic, powersgd, reference, topk,  # noqa: F401
                           torch_hooks, twophase)   # (importing them registers the strategies)
from lorasync.comm.base import HookSync, Sync, get_strategy, strategy_names

__all__ = ["attach", "Sync", "HookSync", "strategy_names", "get_strategy"]


def attach(ddp: torch.nn.parallel.DistributedDataParallel, strategy: str,
           process_group=None, **options: Any) -> Sync:
    """Attach a sync strategy to a DDP model; see the module docstring.

    Raises ValueError for an unknown strategy, an option the strategy does not
    take or a bad value, or a backend that lacks what the strategy needs.
    Every rank must call it (some strategies probe the backend with a tiny
    collective).
    """
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"ddp: expected torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}"
        )
    cls = get_strategy(strategy)
    return cls(ddp, process_group=process_group, **options)
