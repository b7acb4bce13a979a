"""Periodic strategies: ``local`` (local SGD) and ``diloco``.

Both train on local gradients (their DDP hook returns the bucket untouched,
so backward never waits on the network) and sync the adapter every
``period`` optimizer steps in ``after_step``:

* ``local``: all-reduce the adapter weights and replace them by the mean.
* ``diloco``: send the pseudo-gradient ``delta = anchor - theta`` (the
  anchor is the adapter after the previous outer step), then take one outer
  Nesterov-SGD step on the anchor (``outer_lr`` 0.8, ``outer_momentum`` 0.5)
  and continue from it.  The trainer's optimizer (AdamW) is the inner
  optimizer and keeps its state.  The DiLoCo paper's 0.7 / 0.9 suit
  pre-training with hundreds of inner steps per outer step and thousands of
  outer steps; a LoRA fine-tune has tens of outer steps, and momentum 0.9
  overshoots there (``bench/strategies.py``; docs/benchmarks.md, "Quality
  of each strategy").

How DiLoCo's delta travels (``delta_dtype``, ``delta_topk``; bytes in
:mod:`lorasync.catalog`):

* fp32, fp16, bf16, dense: divided by the world size, cast, all-reduced (one
  summable tensor).
* int8, int4 or int2 (blockwise, one fp32 scale per ``delta_block``
  values), or sparse (``delta_topk`` < 1: each tensor's largest entries and
  their indices, the values in ``delta_dtype``; int2 with a small
  ``delta_topk`` is SparseLoCo's outer sync): every rank encodes its delta into
  one byte buffer (:class:`~lorasync.comm.compress.DeltaCodec`), the buffers
  are all-gathered, and every rank decodes and sums them in fp32, in rank
  order, so every rank gets the same mean delta.  Error feedback: what a
  rank's buffer did not carry of its delta (rounding, the entries left out)
  is kept, per element, and added to its next delta of that element, so
  nothing is lost, only late (``delta_ef_decay`` 1, the default; below 1 the
  kept remainder is multiplied by it first, SparseLoCo's decaying
  accumulator, and part of it is forgotten).

``fragments=F`` cuts the adapter into F runs of whole tensors of about equal
size (:func:`lorasync.catalog.fragment_ranges`) with one schedule each:
fragment f syncs at the steps ``s`` with ``s % period ==
(f + 1) * period // F`` (mod period), so one fragment goes every
``period / F`` steps and the link carries 1/F of the adapter at a time
instead of all of it at once.  Anchor, outer momentum and residual are per
element, so each fragment's outer step is DiLoCo's on its own elements.

``streaming=True`` overlaps a sync with compute: it is launched at its step
and applied ``delay`` steps later (always exactly then, so every rank
applies it at the same step, waiting if it has not arrived).  The inner
steps taken meanwhile are kept on top of the new weights: ``theta <- synced
+ (theta_now - theta_launch)``, so the outer update is ``delay`` steps stale
and no local progress is lost.  Several syncs may be in flight at once
(fragments, or a delay longer than the gap between fragments); they are
applied in launch order.  Only the wait at the apply step counts as
``comm_s``: the exposed remainder of a sync that takes longer than the
``delay`` steps' compute.  The cost model
(:func:`lorasync.plan.costmodel.predict`) predicts it, and the planner and
``auto`` choose ``delay`` (or ``fragments``) so that it is zero where the
link allows (:func:`lorasync.plan.periodic.hide_sync`).

``finish()`` applies every pending sync and, if replicas differ (steps since
the last sync, streaming corrections, fragments), averages the adapter in
fp32 so every rank ends with the same weights.  Replicas must start
identical (DDP with ``init_sync=False`` assumes the trainer built them from
one seed).  :meth:`DiLoCo.reconfigure` changes the outer sync's options in
place (what ``auto`` does when another variant is predicted faster): the
pending syncs are applied first, anchor, momentum and residual stay.

Anchor, momentum, residual and pending payloads live on the adapter's
device; ``state_dict`` holds CPU copies, which ``load_state_dict`` moves
back.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from lorasync import catalog
from lorasync.comm.base import HOST, HookSync, Layout, completed, register
from lorasync.comm.compress import DeltaCodec

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _Periodic(HookSync):
    communicates = False

    def setup(self) -> None:
        self._pending: list[dict[str, Any]] = []
        self._dirty = False
        self._configure()

    def _configure(self) -> None:
        """Fragments (element ranges of the canonical flat vector) from the options."""
        f = getattr(self.options, "fragments", 1)
        self._frags = [(self._offsets[a], self._offsets[b], a, b)
                       for a, b in catalog.fragment_ranges(self._numels, f)]

    @property
    def replicas_may_differ(self) -> bool:
        return self._dirty

    @property
    def in_flight_next_step(self) -> bool:
        return catalog.streamed_in_flight(self._steps + 1, self.options)

    @property
    def in_flight(self) -> bool:
        """Whether a sync launched by one ``after_step`` is still to be
        applied by a later one (streaming)."""
        return bool(self._pending)

    def encode_bucket(self, bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future:
        return completed(bucket.buffer())  # local gradient, no communication

    # -- subclass hooks -------------------------------------------------------
    def _send(self, frag: int, theta: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Launch fragment ``frag``'s collective for its flat weights ``theta``:
        ``(the tensor that receives the result, the Work)``."""
        raise NotImplementedError

    def _outer(self, frag: int, received: torch.Tensor) -> torch.Tensor:
        """New synced weights of fragment ``frag`` (flat fp32) from what arrived."""
        raise NotImplementedError

    # -- flat views of one fragment ---------------------------------------------
    def _frag_params(self, frag: int) -> torch.Tensor:
        _, _, a, b = self._frags[frag]
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).float() for p in self.params[a:b]])

    def _set_frag_params(self, frag: int, flat: torch.Tensor) -> None:
        lo, _, a, b = self._frags[frag]
        with torch.no_grad():
            for p, x, y in zip(self.params[a:b], self._offsets[a:b], self._offsets[a + 1:b + 1]):
                p.copy_(flat[x - lo:y - lo].view_as(p))

    # -- sync -----------------------------------------------------------------
    def after_step(self) -> None:
        self.after_step_apply()
        self.after_step_launch()

    def after_step_apply(self) -> None:
        """The first half of ``after_step``: count the step and apply the syncs
        due now.  Between the halves the link is idle unless a sync launched
        earlier is due later (``auto`` measures and decides there, so its own
        few bytes do not queue behind an outer sync)."""
        super().after_step()
        self._dirty = True
        while self._pending and self._pending[0]["apply_at"] <= self._steps:
            self._complete()

    def after_step_launch(self) -> None:
        """The second half of ``after_step``: launch the fragments due after this step."""
        o = self.options
        for f in catalog.fragments_due(self._steps, o.period, len(self._frags)):
            self._launch(f)

    def _launch(self, frag: int) -> None:
        theta = self._frag_params(frag)
        t0 = time.perf_counter()
        received, work = self._send(frag, theta)
        self._add_encode(time.perf_counter() - t0)
        streaming = self.options.streaming
        self._pending.append({"frag": frag, "work": work, "payload": received,
                              "snapshot": theta if streaming else None,
                              "apply_at": self._steps + (self.options.delay if streaming else 0)})
        if not streaming:
            self._complete()

    def _wait(self, p: dict[str, Any]) -> None:
        if p["work"] is not None:
            t0 = time.perf_counter()
            p["work"].wait()
            self._add_comm(time.perf_counter() - t0)
            p["work"] = None

    def _complete(self) -> None:
        p = self._pending[0]
        self._wait(p)
        self._pending.pop(0)
        frag = p["frag"]
        t0 = time.perf_counter()
        synced = self._outer(frag, p["payload"])
        if p["snapshot"] is not None:  # streaming: keep the inner steps taken meanwhile
            synced = synced + (self._frag_params(frag) - p["snapshot"])
        elif len(self._frags) == 1:
            self._dirty = False
        self._set_frag_params(frag, synced)
        self._add_encode(time.perf_counter() - t0)
        with self._lock:
            self._syncs += 1

    def settle(self) -> None:
        for p in self._pending:   # received, still applied at its own step
            self._wait(p)

    def _drain(self) -> None:
        """Apply every pending sync now (finish, reconfigure)."""
        while self._pending:
            self._complete()

    def finish(self) -> None:
        self._drain()
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
        pending = []
        for p in self._pending:  # streaming syncs in flight: finish receiving them
            self._wait(p)
            pending.append({"frag": p["frag"], "payload": p["payload"].to(HOST, copy=True),
                            "snapshot": p["snapshot"].to(HOST, copy=True),
                            "apply_at": p["apply_at"]})
        return {**super().state_dict(), "dirty": self._dirty, "pending": pending,
                "fragments": len(self._frags)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        frags = int(state.get("fragments", 1))
        if frags != len(self._frags):
            raise ValueError(f"state_dict: saved with fragments={frags}, this run has "
                             f"fragments={len(self._frags)}; resume with the same options")
        self._dirty = bool(state.get("dirty", True))
        pending = state.get("pending") or []
        if isinstance(pending, Mapping):  # one streamed sync, as saved before fragments
            pending = [{**pending, "frag": 0}]
        self._pending = [{"frag": int(p.get("frag", 0)), "work": None,
                          "payload": p["payload"].to(self.device, copy=True),
                          "snapshot": p["snapshot"].to(self.device, copy=True),
                          "apply_at": int(p["apply_at"])} for p in pending]


@register
class Local(_Periodic):
    name = "local"

    def _send(self, frag: int, theta: torch.Tensor) -> tuple[torch.Tensor, Any]:
        payload = theta / self.world_size
        return payload, self.wire.all_reduce(payload, async_op=True)

    def _outer(self, frag: int, received: torch.Tensor) -> torch.Tensor:
        return received.float()


@register
class DiLoCo(_Periodic):
    name = "diloco"

    def setup(self) -> None:
        self._anchor = self._flat_params()
        self._momentum = torch.zeros_like(self._anchor)
        self._residual: torch.Tensor | None = None
        super().setup()

    def _configure(self) -> None:
        super()._configure()
        o = self.options
        self._dtype = _DTYPES.get(o.delta_dtype)
        self._codecs: list[DeltaCodec] | None = None
        if o.gathered:
            self._codecs = [DeltaCodec(self._numels[a:b], o.delta_dtype, o.delta_block,
                                       o.delta_topk, device=self.device)
                            for _, _, a, b in self._frags]
            if self._residual is None:
                self._residual = torch.zeros_like(self._anchor)
        elif self._dtype != torch.float32:
            self._check_dtype(self._dtype, "delta_dtype")

    def reconfigure(self, **options: Any) -> None:
        """Other outer-sync options from now on (every rank, at the same step):
        pending syncs are applied first; anchor, outer momentum and the
        residual stay (a residual left by a codec that had one is sent with the
        next delta of each element).  ``ValueError`` for bad options."""
        new = catalog.parse_options(self.name, options)
        self._drain()
        self.options = new
        self._given = frozenset(options)
        self._configure()

    def _send(self, frag: int, theta: torch.Tensor) -> tuple[torch.Tensor, Any]:
        lo, hi, _, _ = self._frags[frag]
        delta = self._anchor[lo:hi] - theta
        if self._residual is not None:
            # SparseLoCo's e <- beta e + delta (beta 1: all that was left unsent)
            delta.add_(self._residual[lo:hi], alpha=self.options.delta_ef_decay)
        if self._codecs is None:
            if self._residual is not None:
                self._residual[lo:hi] = 0  # owed by an earlier codec: sent now, in full
            payload = (delta / self.world_size).to(self._dtype)
            return payload, self.wire.all_reduce(payload, async_op=True)
        codec = self._codecs[frag]
        buf = codec.encode(delta)
        # error feedback: what the buffer does not carry (it decodes the same
        # on every rank) goes with this element's next delta
        self._residual[lo:hi] = delta - codec.decode(buf)
        out = torch.empty(self.world_size * codec.nbytes, dtype=torch.uint8, device=buf.device)
        return out, self.wire.all_gather(out, buf, async_op=True)

    def _outer(self, frag: int, received: torch.Tensor) -> torch.Tensor:
        lo, hi, _, _ = self._frags[frag]
        if received.dtype == torch.uint8:
            codec = self._codecs[frag] if self._codecs is not None else None
            if codec is None or codec.nbytes * self.world_size != received.numel():
                raise RuntimeError("diloco: a pending sync does not fit the current codec")
            mean = codec.decode_sum(received).div_(self.world_size)
        else:
            mean = received.float()
        # torch.optim.SGD(nesterov=True, dampening=0) on the anchor, grad = mean delta
        mu, lr = self.options.outer_momentum, self.options.outer_lr
        m, a = self._momentum[lo:hi], self._anchor[lo:hi]
        m.mul_(mu).add_(mean)
        a.sub_(mean + mu * m, alpha=lr)
        return a.clone()

    def _on_final_average(self, avg: torch.Tensor) -> None:
        self._anchor = avg.clone()

    def state_dict(self) -> dict[str, Any]:
        sd = {**super().state_dict(), "anchor": self._anchor.to(HOST, copy=True),
              "outer_momentum_buffer": self._momentum.to(HOST, copy=True)}
        if self._residual is not None:
            sd["residual"] = self._residual.to(HOST, copy=True)
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._anchor = state["anchor"].to(self.device, copy=True)
        self._momentum = state["outer_momentum_buffer"].to(self.device, copy=True)
        if state.get("residual") is not None:
            self._residual = state["residual"].to(self.device, copy=True)
        elif self._codecs is not None:
            self._residual = torch.zeros_like(self._anchor)
