"""Two-phase compressed all-reduce: ``int8`` (blockwise int8) and ``onebit``
(bit-packed signs), each with one fp32 scale per block and error feedback on
both phases, as in DeepSpeed's compressed all-reduce (1-bit Adam).

Compressed values cannot be summed on the wire (int8 sums overflow, signs do
not add), so a bucket is reduced in two collectives:

1. every rank compresses ``g + e`` (its gradient plus its worker residual)
   and sends shard j to rank j (``all_to_all_single``; where the backend
   lacks it, an ``all_gather`` of the whole compressed bucket, of which each
   rank keeps its shard: the same bytes handed over, n times the traffic);
2. rank j decompresses the n copies of shard j, averages them, adds its
   server residual ``s``, compresses the mean again and all-gathers it.

Residuals: ``e = (g + e) - D(C(g + e))`` on every rank for every element,
``s = (mean + s) - D(C(mean + s))`` on the owner of the element, so that
sum over steps of the applied update + mean over ranks of ``e`` + ``s``
equals the sum over steps of the mean gradient (nothing is lost, only late).

Every parameter is cut into its own blocks (``compress.param_blocks``: a
multiple of world_size blocks, so each rank owns an equal slice of every
parameter), and the owner of an element is fixed by the parameter alone.
Compressed values and residual ownership therefore do not depend on DDP's
bucket layout, which changes after the first iteration and again on resume.

Residuals, index plans and collective buffers live on the gradients' device
(CPU with gloo, the rank's GPU with NCCL); index plans are worked out on the
host once per bucket layout and copied to that device once.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from lorasync.catalog import param_blocks
from lorasync.comm import compress as C
from lorasync.comm.base import HOST, HookSync, Layout, Residual, register


class _TwoPhase(HookSync):
    two_phase = True
    align = 1  # block size multiple (8 for bit packing)

    # -- codec, per subclass --------------------------------------------------
    def _momentum_rows(self, lay: Layout, plan: dict[str, Any]) -> torch.Tensor | None:
        """Rows of the averaged momentum when this step sends momentum (onebit)."""
        return None

    def _encode(self, x, bid, nblocks, count, sum_index=None):  # -> (codes, scales)
        raise NotImplementedError

    def _sum_index(self, bid: torch.Tensor, nblocks: int):
        """What ``_encode`` needs precomputed for block ids ``bid`` (host)."""
        return None

    def _decode(self, codes, scales, bid):
        raise NotImplementedError

    def _code_bytes(self, numel: int) -> int:
        raise NotImplementedError

    # -- set-up ---------------------------------------------------------------
    def setup(self) -> None:
        n = self.world_size
        self._blocks = [param_blocks(m, self.options.block, n, self.align) for m in self._numels]
        self._E = Residual(self.numel, len(self.params), self.device)  # worker, every element
        self._S = Residual(self.numel, len(self.params), self.device)  # server, my shard only
        # all_to_all_single is in gloo, NCCL and MPI; probe, since a backend
        # without it would otherwise fail mid-backward
        try:
            x = torch.zeros(n, dtype=torch.uint8, device=self.collective_device())
            self.wire.all_to_all(torch.empty_like(x), x, count=False)
            self.phase1_collective = "all_to_all"
        except (RuntimeError, NotImplementedError, ValueError):
            self.phase1_collective = "all_gather"

    def _plan(self, lay: Layout, device: torch.device) -> dict[str, Any]:
        """Index tensors for one bucket layout on ``device`` (computed once
        per layout on the host, copied once per device).

        Rows: row r holds, for every parameter of the bucket in bucket order,
        the slice of its (padded) blocks that rank r owns.
        """
        return lay.plan("tp", device, lambda: self._host_plan(lay))

    def _host_plan(self, lay: Layout) -> dict[str, Any]:
        n, M, N = self.world_size, lay.numel, self.numel
        bpos, cpos, bid = [[] for _ in range(n)], [[] for _ in range(n)], []
        nblk = 0
        sizes = set()
        for i, boff in zip(lay.pids, lay.offsets):
            m, coff = self._numels[i], self._offsets[i]
            nb, bs = self._blocks[i]
            sizes.add(bs)
            chunk = nb * bs // n
            for r in range(n):
                t = torch.arange(r * chunk, (r + 1) * chunk, device=HOST)
                real = t < m
                bpos[r].append(torch.where(real, t + boff, M))
                cpos[r].append(torch.where(real, t + coff, N))
            bid.append(torch.arange(nblk, nblk + nb // n, device=HOST).repeat_interleave(bs))
            nblk += nb // n
        bpos_t = torch.stack([torch.cat(b) for b in bpos])
        cpos_t = torch.stack([torch.cat(c) for c in cpos])
        L = bpos_t.shape[1]
        valid = bpos_t < M
        flat = torch.arange(n * L, device=HOST)
        inv = torch.empty(M, dtype=torch.long, device=HOST)
        inv[bpos_t.reshape(-1)[valid.reshape(-1)]] = flat[valid.reshape(-1)]
        ranks = torch.arange(n, device=HOST).unsqueeze(1)
        if len(sizes) == 1:  # every block the same size: reshape instead of gathers
            blk_row = blk_full = sizes.pop()
            sum_row = sum_full = None
        else:
            blk_row = torch.cat(bid)
            blk_full = (blk_row.unsqueeze(0) + nblk * ranks).reshape(-1)
            sum_row = self._sum_index(blk_row, nblk)
            sum_full = self._sum_index(blk_full, n * nblk)
        bid_full = (torch.cat(bid).unsqueeze(0) + nblk * ranks).reshape(-1)
        count = torch.zeros(n * nblk, device=HOST).index_add_(0, bid_full,
                                                              valid.reshape(-1).float())
        r = self.rank
        return dict(
            L=L, nblk=nblk, bpos=bpos_t.reshape(-1), cpos=cpos_t.reshape(-1), inv=inv,
            blk_row=blk_row, blk_full=blk_full, sum_row=sum_row, sum_full=sum_full,
            count=count, my_cpos=cpos_t[r].contiguous(),
            pad=~valid.reshape(-1), my_pad=~valid[r], has_pad=bool((~valid).any()),
            my_count=count[r * nblk:(r + 1) * nblk], code_bytes=self._code_bytes(L),
        )

    # -- packing: one uint8 row per shard = [codes | fp32 scales] -------------
    def _pack(self, codes: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([codes.view(torch.uint8).reshape(rows, -1),
                          scales.reshape(rows, -1).view(torch.uint8)], dim=1)

    def _unpack(self, data: torch.Tensor, plan: dict[str, Any]):
        cb = plan["code_bytes"]
        codes = data[:, :cb].contiguous()
        # a fresh row-major copy, not .contiguous(): with one rank the slice
        # counts as contiguous but starts at byte cb, and its row stride need
        # not be a multiple of 4 either (float32 views need both)
        scales = data[:, cb:].clone(memory_format=torch.contiguous_format)
        scales = scales.view(torch.float32).reshape(-1)
        return codes.reshape(-1), scales

    # -- the two phases -------------------------------------------------------
    def phase1(self, bucket: dist.GradBucket, lay: Layout):
        n, r = self.world_size, self.rank
        buf = bucket.buffer()
        plan = self._plan(lay, buf.device)
        t0 = time.perf_counter()
        u = torch.cat([buf, buf.new_zeros(1)]).float().index_select(0, plan["bpos"])
        m = self._momentum_rows(lay, plan)
        if m is not None:  # 1-bit Adam: send this rank's momentum, not its gradient
            u.mul_(1.0 - self._b1).add_(m, alpha=self._b1)
        e = self._E.rows(lay, plan["cpos"])
        u += e                                                   # padding stays 0
        codes, scales = self._encode(u, plan["blk_full"], n * plan["nblk"], plan["count"],
                                     plan["sum_full"])
        torch.sub(u, self._decode(codes, scales, plan["blk_full"]), out=e)
        if plan["has_pad"]:
            e.masked_fill_(plan["pad"], 0.0)
        send = self._pack(codes, scales, n)
        self._add_encode(time.perf_counter() - t0)
        if self.phase1_collective == "all_to_all":
            recv = torch.empty_like(send)
            work = self.wire.all_to_all(recv, send, async_op=True)
            take = lambda: recv  # noqa: E731
        else:
            gathered = torch.empty((n,) + tuple(send.shape), dtype=torch.uint8, device=send.device)
            work = self.wire.all_gather(gathered, send, async_op=True)
            take = lambda: gathered[:, r]  # noqa: E731

        def phase2() -> torch.futures.Future:
            t1 = time.perf_counter()
            c1, s1 = self._unpack(take(), plan)
            d = self._decode(c1, s1, plan["blk_full"]).view(n, plan["L"])
            v = d[0].clone()
            for j in range(1, n):  # fixed order: identical sums whatever the layout
                v += d[j]
            v /= n
            s = self._S.rows(lay, plan["my_cpos"])
            v += s
            if plan["has_pad"]:
                v.masked_fill_(plan["my_pad"], 0.0)
            c2, s2 = self._encode(v, plan["blk_row"], plan["nblk"], plan["my_count"],
                                  plan["sum_row"])
            torch.sub(v, self._decode(c2, s2, plan["blk_row"]), out=s)
            if plan["has_pad"]:
                s.masked_fill_(plan["my_pad"], 0.0)
            send2 = self._pack(c2, s2, 1)
            out = torch.empty((n, send2.shape[1]), dtype=torch.uint8, device=send2.device)
            self._add_encode(time.perf_counter() - t1)
            fut = self.wire.all_gather(out, send2, async_op=True).get_future()

            def decode(_f: torch.futures.Future) -> torch.Tensor:
                t2 = time.perf_counter()
                c3, s3 = self._unpack(out, plan)
                full = self._decode(c3, s3, plan["blk_full"])
                buf.copy_(full.index_select(0, plan["inv"]))
                if m is not None:  # the averaged momentum, the start of the next step's
                    m.copy_(full)
                    if plan["has_pad"]:
                        m.masked_fill_(plan["pad"], 0.0)
                self._add_encode(time.perf_counter() - t2)
                return buf

            return fut.then(decode)

        return work.get_future(), phase2

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "block": self.options.block,
                "worker_residual": self._E.state(), "server_residual": self._S.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("block", self.options.block) != self.options.block:
            raise ValueError(f"state_dict: saved with block={state['block']}, this run has "
                             f"block={self.options.block}; pass the same block option")
        self._E.load(state["worker_residual"])
        self._S.load(state["server_residual"])


@register
class Int8(_TwoPhase):
    """Blockwise int8 (scale = max|x|/127 per block of <= ``block`` values)."""

    name = "int8"

    def _encode(self, x, bid, nblocks, count, sum_index=None):
        return C.int8_encode(x, bid, nblocks)

    def _decode(self, codes, scales, bid):
        return C.int8_decode(codes.view(torch.int8), scales, bid)

    def _code_bytes(self, numel: int) -> int:
        return numel


@register
class OneBit(_TwoPhase):
    """Signs, 8 per byte, times one scale per block (mean |x| of the block).

    Two modes:

    * gradients (EF-SignSGD, any optimizer): each step's gradient plus its
      residual is sent as signs.  ``warmup_steps`` (plain fp32 all-reduce
      for the first N steps) lets the optimizer settle first.
    * Adam momentum (1-bit Adam), when :meth:`set_optimizer` is given an
      AdamW (the trainer does this; ``momentum=False`` turns it off): fp32
      all-reduce with the optimizer's own step until the optimizer has taken
      ``warmup_steps`` steps (its own count, so a strategy attached mid-run
      by ``auto`` does not warm up again),
      then Adam's second moment is frozen and what travels as signs is each
      rank's momentum ``b1 * m + (1 - b1) * g`` (``m``: the averaged
      momentum of the previous step, the same on every rank).  The
      averaged momentum arrives as the gradient; the optimizer's step is
      taken here (decoupled weight decay, bias-corrected momentum, frozen
      bias-corrected variance), so AdamW's own arithmetic never sees a
      sign-compressed value.  Why: with signs fed to AdamW, every element of
      a block looks equally large to its second moment, which flattens Adam's
      per-element step sizes and costs quality (``bench/strategies.py``).
      With the variance frozen the update is linear in the momentum, so
      error feedback on the momentum is exact in the long run, as it is
      for SGD.

      A frozen variance is only as good as the warm-up: a LoRA adapter's
      A matrices start with zero gradients (B starts at zero) that grow
      for many steps, so a variance frozen early is far too small for them
      and the steps it gives blow up (the loss diverges).
      ``max_update_rms`` caps the root-mean-square of each tensor's step
      (in units of the learning rate) by scaling the whole step down, as
      Adafactor's update clipping does; AdamW's own steps have an RMS
      below 1.  0 turns it off.
    """

    name = "onebit"
    align = 8

    def setup(self) -> None:
        super().setup()
        self._opt: torch.optim.Optimizer | None = None
        self._M = Residual(self.numel, len(self.params), self.device)  # averaged momentum
        self._denom: torch.Tensor | None = None  # sqrt(frozen v_hat) + eps, canonical order
        self._mom_step = False  # this backward sent momentum (the optimizer step is ours)
        self._stash: list[torch.Tensor | None] = []
        self._handles: list = []  # the optimizer step hooks (set_optimizer)

    def _encode(self, x, bid, nblocks, count, sum_index=None):
        return C.onebit_encode(x, bid, nblocks, count, sum_index)

    def _sum_index(self, bid, nblocks):
        return C.block_sum_index(bid, nblocks)

    def _decode(self, codes, scales, bid):
        return C.onebit_decode(codes, scales, bid)

    def _code_bytes(self, numel: int) -> int:
        return numel // 8

    # -- 1-bit Adam -----------------------------------------------------------
    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Compress Adam's momentum instead of the gradients (see the class
        docstring).  ``optimizer`` must be ``torch.optim.AdamW`` (or ``Adam``
        with ``decoupled_weight_decay=True`` or no weight decay) over every
        trainable parameter, without amsgrad/maximize; call it once, before
        the first step, on every rank.  A no-op with ``momentum=False``.
        """
        if not self.options.momentum:
            return
        if self._opt is not None:
            raise ValueError("onebit: set_optimizer was called already")
        where = "onebit: momentum compression (1-bit Adam)"
        if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            raise ValueError(f"{where} needs torch.optim.AdamW, got "
                             f"{type(optimizer).__name__}; pass momentum=false to compress "
                             "gradients instead")
        if self.options.warmup_steps < 1:
            raise ValueError(f"{where} freezes Adam's variance after the warm-up: "
                             f"warmup_steps={self.options.warmup_steps} must be at least 1")
        groups: dict[int, dict[str, Any]] = {}
        betas = set()
        for g in optimizer.param_groups:
            for flag in ("amsgrad", "maximize", "differentiable"):
                if g.get(flag):
                    raise ValueError(f"{where}: param group has {flag}=True, which it "
                                     "does not implement; pass momentum=false")
            decoupled = isinstance(optimizer, torch.optim.AdamW) or g.get(
                "decoupled_weight_decay", False)
            if g.get("weight_decay", 0) and not decoupled:
                raise ValueError(f"{where}: Adam with weight_decay={g['weight_decay']} adds "
                                 "the decay to the gradient; use AdamW or "
                                 "decoupled_weight_decay=True")
            betas.add(tuple(float(b) for b in g["betas"]))
            for p in g["params"]:
                groups[id(p)] = g
        missing = [i for i, p in enumerate(self.params) if id(p) not in groups]
        if missing:
            raise ValueError(f"{where}: {len(missing)} trainable parameter(s) are not in "
                             "the optimizer; give it every parameter DDP syncs")
        if len(betas) != 1:
            raise ValueError(f"{where}: param groups have different betas {sorted(betas)}; "
                             "it needs one value")
        self._opt = optimizer
        self._groups = [groups[id(p)] for p in self.params]
        self._b1, self._b2 = betas.pop()
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    def finish(self) -> None:
        super().finish()
        # the optimizer outlives this strategy (``auto`` switches away): leave
        # it a plain AdamW again, with the averaged momentum and frozen variance
        for h in self._handles:
            h.remove()
        self._handles = []

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self._opt is not None and bucket.index() == 0:
            self._mom_step = self._optimizer_steps() >= self.options.warmup_steps
            if self._mom_step and self._denom is None:
                self._freeze()
        return super().on_bucket(bucket)

    def in_warmup(self, bucket: dist.GradBucket) -> bool:
        if self._opt is None:
            return super().in_warmup(bucket)
        return not self._mom_step

    @property
    def grads_hold_momentum(self) -> bool:
        return self._mom_step

    def _optimizer_steps(self) -> int:
        """Steps the optimizer has taken (its own count: a strategy attached
        mid-run, e.g. by ``auto``, finds its variance already warm)."""
        st = self._opt.state.get(self.params[0], {})
        return int(st["step"]) if "step" in st else 0

    def _freeze(self) -> None:
        """End of warm-up: the averaged momentum starts from the optimizer's
        (identical on every rank after lossless warm-up steps), and its bias-
        corrected second moment is frozen."""
        ms, ds = [], []
        for p, g in zip(self.params, self._groups):
            st = self._opt.state.get(p, {})
            if "exp_avg_sq" not in st:
                raise RuntimeError("onebit: the optimizer has not stepped during the "
                                   "warm-up (no Adam state to freeze); call "
                                   "optimizer.step() before sync.after_step()")
            bc2 = 1.0 - self._b2 ** float(st["step"])
            ms.append(st["exp_avg"].detach().reshape(-1).float())
            ds.append((st["exp_avg_sq"].detach().reshape(-1).float() / bc2).sqrt_()
                      .add_(float(g["eps"])))
        self._M.load(torch.cat(ms))
        self._denom = torch.cat(ds).to(self.device)

    def _momentum_rows(self, lay, plan):
        return self._M.rows(lay, plan["cpos"]) if self._mom_step else None

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self._mom_step:
            return
        # AdamW skips parameters without a gradient: the step is ours (_post_step)
        self._stash = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def _post_step(self, optimizer, args, kwargs) -> None:
        if not self._mom_step:
            return
        self._mom_step = False
        stash, self._stash = self._stash, []
        b1, b2, clip = self._b1, self._b2, self.options.max_update_rms
        for i, (p, g, grp) in enumerate(zip(self.params, stash, self._groups)):
            p.grad = g
            if g is None:
                continue
            st = optimizer.state[p]
            st["step"] += 1
            t = float(st["step"])
            lr, wd = float(grp["lr"]), float(grp["weight_decay"])
            a, b = self._offsets[i], self._offsets[i + 1]
            denom = self._denom[a:b].view_as(p)
            u = g.float() / denom
            u.mul_(1.0 / (1.0 - b1 ** t))
            if clip:  # Adafactor's update clipping, per tensor (no host sync)
                u.div_(u.square().mean().sqrt().div_(clip).clamp_(min=1.0))
            p.mul_(1.0 - lr * wd)
            p.add_(u.to(p.dtype), alpha=-lr)
            # the optimizer's own state stays meaningful (checkpoints, a later
            # switch back to plain AdamW): the averaged momentum, the frozen variance
            st["exp_avg"].copy_(g)
            st["exp_avg_sq"].copy_(((denom - float(grp["eps"])) ** 2) * (1.0 - b2 ** t))

    def state_dict(self) -> dict[str, Any]:
        st = super().state_dict()
        if self._denom is not None:
            st["momentum"] = self._M.state()
            st["adam_denom"] = self._denom.to("cpu", copy=True)
        return st

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "momentum" in state:
            if self._opt is None:
                raise ValueError("state_dict: saved in momentum mode (1-bit Adam); call "
                                 "set_optimizer(optimizer) before load_state_dict")
            self._M.load(state["momentum"])
            self._denom = state["adam_denom"].to(self.device, torch.float32, copy=True)
