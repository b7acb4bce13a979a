"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay."""

from __future__ import annotations

import math

__all__ = ["lr_lambda", "schedule_note"]


def lr_lambda(schedule: str, warmup: int, total: int):
    """The factor of the peak learning rate after ``step`` optimizer steps (for
    ``torch.optim.lr_scheduler.LambdaLR``): ``warmup`` steps up, then
    ``schedule`` down to the end of ``total``."""
    def f(step: int) -> float:  # step counts optimizer steps done, from 0
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return f


def schedule_note(schedule: str, lr: float, warmup: int, total: int) -> str | None:
    """The one-line note for a schedule that never reaches its peak learning
    rate (more warm-up steps than steps), else None."""
    if warmup <= total:
        return None
    top = lr * lr_lambda(schedule, warmup, total)(total - 1)
    return (f"note: the learning rate never reaches its peak {lr:g}: {warmup} warm-up steps "
            f"(--warmup-steps) for {total} steps, it ends at {top:.3g}; lower --warmup-steps "
            f"to at most {total} to reach it")
