"""Periodic strategies: ``local`` (local SGD) and ``diloco``.

Both train on local gradients (their DDP hook returns the bucket untouched,
so backward never waits on the network) and sync the adapter every
``period`` optimizer steps in ``after_step``:

* ``local``: all-reduce the adapter weights and replace them by the mean.
* ``diloco``: all-reduce the pseudo-gradient ``delta = anchor - theta`` (the
  anchor is the adapter after the previous outer step), optionally cast to
  fp16/bf16 (``delta_dtype``; divided by world size first, so no overflow),
  then take one outer Nesterov-SGD step on the anchor (``outer_lr`` 0.8,
  ``outer_momentum`` 0.5) and continue from it.  The trainer's optimizer
  (AdamW) is the inner optimizer and keeps its state.  The DiLoCo paper's
  0.7 / 0.9 suit pre-training with hundreds of inner steps per outer step and
  thousands of outer steps; a LoRA fine-tune has tens of outer steps, and
  momentum 0.9 overshoots there: on the embedded default, 60 steps, period 8,
  eval loss 1.98 and 0% exact-match with 0.7/0.9 against 0.228 and 54% with
  0.8/0.5 (allreduce: 0.204-0.260 over three seeds; bench/strategies.py).

``streaming=True`` overlaps the sync with compute: the all-reduce is
launched at step t (a multiple of ``period``) and applied ``delay`` steps
later (default 1; always exactly then, so every rank applies it at the same
step, waiting if it has not arrived).  The inner steps taken meanwhile are
kept on top of the new weights: ``theta <- synced + (theta_now - theta_t)``,
so the outer update is ``delay`` steps stale and no local progress is lost.
Only the wait at the apply step counts as ``comm_s``.

``finish()`` applies a pending sync and, if replicas differ (steps since the
last sync, or streaming corrections), averages the adapter in fp32 so every
rank ends with the same weights.  Replicas must start identical (DDP with
``init_sync=False`` assumes the trainer built them from one seed).

Anchor, momentum and pending payloads live on the adapter's device;
``state_dict`` holds CPU copies, which ``load_state_dict`` moves back.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from lorasync.comm.base import _HOST, HookSync, _Layout, completed, register

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _Periodic(HookSync):
    communicates = False

    def _setup(self) -> None:
        self._pending: dict[str, Any] | None = None  # type: ignore[assignment]
        self._dirty = False

    @property
    def in_flight(self) -> bool:
        """Whether an outer all-reduce launched by one ``after_step`` is
        still to be applied by a later one (streaming)."""
        return self._pending is not None

    def _encode_bucket(self, bucket: dist.GradBucket, lay: _Layout) -> torch.futures.Future:
        return completed(bucket.buffer())  # local gradient, no communication

    # -- subclass hooks -------------------------------------------------------
    def _payload(self, theta: torch.Tensor) -> torch.Tensor:
        """What to all-reduce (already divided by world size)."""
        raise NotImplementedError

    def _outer(self, reduced: torch.Tensor) -> torch.Tensor:
        """New synced adapter (flat fp32) from the all-reduced payload."""
        raise NotImplementedError

    # -- sync -----------------------------------------------------------------
    def after_step(self) -> None:
        super().after_step()
        self._dirty = True
        if self._pending is not None and self._steps >= self._pending["apply_at"]:
            self._complete()
        if self._steps % self.options.period == 0:
            self._launch()

    def _launch(self) -> None:
        theta = self._flat_params()
        t0 = time.perf_counter()
        payload = self._payload(theta)
        self._add_encode(time.perf_counter() - t0)
        work = self.wire.all_reduce(payload, async_op=True)
        streaming = self.options.streaming
        self._pending = {"work": work, "payload": payload, "snapshot": theta if streaming else None,
                         "apply_at": self._steps + (self.options.delay if streaming else 0)}
        if not streaming:
            self._complete()

    def _wait_pending(self) -> None:
        work = self._pending["work"]
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            self._add_comm(time.perf_counter() - t0)
            self._pending["work"] = None

    def _complete(self) -> None:
        self._wait_pending()
        p, self._pending = self._pending, None
        t0 = time.perf_counter()
        synced = self._outer(p["payload"].float())
        if p["snapshot"] is not None:  # streaming: keep the inner steps taken meanwhile
            synced = synced + (self._flat_params() - p["snapshot"])
        else:
            self._dirty = False
        self._set_flat_params(synced)
        self._add_encode(time.perf_counter() - t0)
        with self._lock:
            self._syncs += 1

    def finish(self) -> None:
        if self._pending is not None:
            self._complete()
        if not self._dirty:
            return
        avg = self._flat_params().div_(self.world_size)
        t0 = time.perf_counter()
        self.wire.all_reduce(avg)
        self._add_comm(time.perf_counter() - t0)
        self._set_flat_params(avg)
        self._on_final_average(avg)
        self._dirty = False
        with self._lock:
            self._syncs += 1

    def _on_final_average(self, avg: torch.Tensor) -> None:
        pass

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = {**super().state_dict(), "dirty": self._dirty, "pending": None}
        if self._pending is not None:  # a streaming sync in flight: finish receiving it
            self._wait_pending()
            sd["pending"] = {"payload": self._pending["payload"].to(_HOST, copy=True),
                             "snapshot": self._pending["snapshot"].to(_HOST, copy=True),
                             "apply_at": self._pending["apply_at"]}
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._dirty = bool(state.get("dirty", True))
        p = state.get("pending")
        self._pending = None if p is None else {
            "work": None, "payload": p["payload"].to(self.device, copy=True),
            "snapshot": p["snapshot"].to(self.device, copy=True),
            "apply_at": int(p["apply_at"])}


@register
class Local(_Periodic):
    name = "local"

    def _payload(self, theta: torch.Tensor) -> torch.Tensor:
        return theta / self.world_size

    def _outer(self, reduced: torch.Tensor) -> torch.Tensor:
        return reduced


@register
class DiLoCo(_Periodic):
    name = "diloco"

    def _setup(self) -> None:
        super()._setup()
        self._dtype = _DTYPES[self.options.delta_dtype]
        if self._dtype != torch.float32:
            self._check_dtype(self._dtype, "delta_dtype")
        self._anchor = self._flat_params()
        self._momentum = torch.zeros_like(self._anchor)

    def _payload(self, theta: torch.Tensor) -> torch.Tensor:
        return ((self._anchor - theta) / self.world_size).to(self._dtype)

    def _outer(self, reduced: torch.Tensor) -> torch.Tensor:
        # torch.optim.SGD(nesterov=True, dampening=0) on the anchor, grad = mean delta
        mu, lr = self.options.outer_momentum, self.options.outer_lr
        self._momentum.mul_(mu).add_(reduced)
        self._anchor.sub_(reduced + mu * self._momentum, alpha=lr)
        return self._anchor.clone()

    def _on_final_average(self, avg: torch.Tensor) -> None:
        self._anchor = avg.clone()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "anchor": self._anchor.to(_HOST, copy=True),
                "outer_momentum_buffer": self._momentum.to(_HOST, copy=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._anchor = state["anchor"].to(self.device, copy=True)
        self._momentum = state["outer_momentum_buffer"].to(self.device, copy=True)
