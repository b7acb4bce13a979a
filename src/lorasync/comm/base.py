"""The contract between the trainer (or a user's loop) and a sync strategy.

A strategy owns how adapter gradients (or adapter weights) travel between
ranks.  Per-step strategies register a DDP comm hook, so their collectives run
inside DDP's buckets and overlap with the rest of the backward pass; periodic
strategies (local SGD, DiLoCo) do their work in ``after_step``.

Accounting rules every strategy follows (tests assert them):

* ``wire_bytes`` counts the bytes of every tensor this rank hands to a
  collective, at the dtype it is sent in (payload, not ring traffic: an
  all-reduce of P bytes moves about 2(n-1)/n * P per rank on a ring).
* ``fp32_bytes`` is what plain fp32 all-reduce would have handed over for the
  same gradients, so ``fp32_bytes / wire_bytes`` is the compression ratio.
* ``comm_s`` is the time the training loop waited on sync inside
  ``after_step``; the time a backward pass waited on hook futures is measured
  by the trainer from ``last_ready_time`` (the moment the last bucket became
  ready, i.e. when local compute ended).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["Sync", "register", "strategy_names", "get_strategy"]

_REGISTRY: dict[str, type["Sync"]] = {}


def register(cls: type["Sync"]) -> type["Sync"]:
    """Class decorator: make a strategy available under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type["Sync"]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"strategy: unknown name {name!r}; choose one of {', '.join(strategy_names())}"
        ) from None


class Sync:
    """Base class of all strategies.

    Subclasses set ``name``, ``options`` (the option names they accept, with
    defaults) and implement ``_install`` (register a hook or prepare periodic
    state).  ``attach()`` is the public way to build one.
    """

    name = "base"
    #: whether the strategy sends gradients every step through a DDP hook
    per_step = True
    #: whether replicas stay bit-identical after every optimizer step
    lossless = True
    #: option name -> default; attach() rejects anything not listed here
    options: dict[str, Any] = {}

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel,
                 process_group: dist.ProcessGroup | None = None, **options: Any):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(sorted(self.options)) or "none"
            raise ValueError(
                f"{self.name}: option {unknown[0]!r} does not apply to this strategy "
                f"(it takes: {known})"
            )
        self.ddp = ddp
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.opts = {**self.options, **options}
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.fp32_param_bytes = sum(p.numel() for p in self.params) * 4
        # cumulative counters since attach
        self._wire_bytes = 0
        self._fp32_bytes = 0
        self._comm_s = 0.0
        self._encode_s = 0.0
        self._steps = 0
        self._syncs = 0
        self.last_ready_time: float | None = None
        self._install()

    # -- hooks for subclasses -------------------------------------------------
    def _install(self) -> None:
        raise NotImplementedError

    # -- accounting helpers ---------------------------------------------------
    def _sent(self, *tensors: torch.Tensor) -> None:
        """Count tensors handed to a collective."""
        for t in tensors:
            self._wire_bytes += t.numel() * t.element_size()

    def _would_send_fp32(self, numel: int) -> None:
        self._fp32_bytes += numel * 4

    def _ready(self) -> None:
        """Called at the entry of every bucket hook: marks when compute ended."""
        self.last_ready_time = time.perf_counter()

    # -- public API -----------------------------------------------------------
    def after_step(self) -> None:
        """Call once after every ``optimizer.step()``."""
        self._steps += 1

    def finish(self) -> None:
        """Make all replicas identical (end of training); no-op for per-step sync."""

    def stats(self) -> dict[str, float]:
        """Cumulative counters since attach."""
        return {
            "strategy": self.name,
            "wire_bytes": self._wire_bytes,
            "fp32_bytes": self._fp32_bytes,
            "comm_s": self._comm_s,
            "encode_s": self._encode_s,
            "steps": self._steps,
            "syncs": self._syncs,
        }

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state that must survive a restart (error feedback, outer optimizer)."""
        return {"name": self.name, "steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"state_dict: saved by strategy {state.get('name')!r}, "
                f"cannot load into {self.name!r}"
            )
        self._steps = int(state.get("steps", 0))


HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future]
