"""PowerSGD low-rank gradients (``powersgd``), our own hook.

For every 2-D gradient M (a x b) of a bucket: ``P = (M + e) Q`` (a x k),
all-reduce P, orthogonalise it, ``Q = (M + e)^T P`` (b x k), all-reduce Q,
apply ``P Q^T``; the residual ``e = (M + e) - P Q^T`` stays on the rank
(error feedback) and Q is reused next step (warm start: one power iteration
per step keeps tracking the top-k subspace).  Gradients that low rank would
not shrink by ``min_compression_rate`` (1-D tensors, small or thin matrices)
go in the first all-reduce uncompressed, as in torch's hook.

What ``rank`` buys on a LoRA adapter of rank r: lora_A is r x in and lora_B is
out x r, so their gradients have rank <= r and ``rank >= r`` reproduces them
exactly -- but then P and Q together are as large as the gradient and the
compression rate is ~1 (with the default min_compression_rate=2 they are sent
uncompressed).  For r=8, in=out=576: rank 1 sends (8+576)*1 values instead of
4608 (7.9x less), rank 2 3.9x, rank 3 2.6x, rank 4 under 2x (k/v's 192 x 8
gradients: 1.9x), so it is sent uncompressed.  Error feedback makes the
missing directions arrive over later steps.  Default rank 3: the lowest rank
that met the quality rule on the embedded default (``bench/strategies.py``;
docs/benchmarks.md, "Quality of each strategy").

Why not torch's hook: it issues and ``.wait()``s its second all-reduce inside
a ``.then()`` callback of the first.  Callbacks run when a collective
finishes, so when compute differs between ranks (variable-length batches) one
rank may issue "Q of bucket 0" while the other issues "P of bucket 1": the
collectives pair up wrongly and the job hangs (seen on gloo).  Here both
all-reduces are issued from the hook thread in a fixed order (P of bucket i
in hook i, Q of bucket i at the start of hook i+1 or at the end of the last
hook; see ``HookSync``); callbacks only compute.

State is per parameter (error e, warm-start Q), independent of DDP's bucket
layout; matrices of equal shape are processed as one batch (bmm).  Step 1 of LoRA has exactly-zero lora_A gradients (B starts at 0),
which would leave a warm-started Q at zero forever; a Q column that comes
back all-zero (or non-finite) is re-drawn from a seed every rank shares.

Device: error, Q, index plans and the re-draw generator live on the
gradients' device (so a re-drawn Q depends on the device type, the same on
every rank).  Whether a new Q is usable is known on the device; the host
learns it through a copy that is not waited for, read when Q is next needed
(a step later, long done), so the hook never waits for the GPU.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from lorasync.catalog import powersgd_shape
from lorasync.comm import compress as C
from lorasync.comm.base import HOST, HookSync, Layout, Residual, completed, register


@register
class PowerSGD(HookSync):
    name = "powersgd"
    two_phase = True

    def setup(self) -> None:
        o = self.options
        #: per parameter: (rows, cols) if compressed, else None (the catalog's rule)
        self._shape = [powersgd_shape(tuple(p.shape), o.rank, o.min_compression_rate)
                       for p in self.params]
        # zero outside compressed matrices
        self._E = Residual(self.numel, len(self.params), self.device)
        self._Q: dict[int, torch.Tensor] = {}
        # new Qs of finished buckets: (param ids, Qs g x b x k, usable per param)
        self._q_new: deque[tuple[list[int], torch.Tensor, _HostCopy]] = deque()

    def _new_q(self, i: int, b: int, device: torch.device) -> torch.Tensor:
        # same seed on every rank; varies with the step so a re-draw differs
        g = torch.Generator(device=device).manual_seed(1_000_003 * i + self._steps)
        return C.orthogonalize_(torch.randn(b, self.options.rank, generator=g, device=device))

    def _take_new_q(self) -> None:
        """Keep the usable new Qs (drop the others: re-drawn when next needed)."""
        while self._q_new:
            pids, q, ok = self._q_new.popleft()
            for i, qi, good in zip(pids, q.unbind(0), ok.get()):
                if good:
                    self._Q[i] = qi
                else:
                    self._Q.pop(i, None)

    def _plan(self, lay: Layout, device: torch.device) -> dict[str, Any]:
        """Per layout: the uncompressed elements, and the compressed matrices
        grouped by shape (one batched matmul per shape; LoRA has few shapes)."""
        return lay.plan("psgd", device, lambda: self._host_plan(lay))

    def _host_plan(self, lay: Layout) -> dict[str, Any]:
        unc, groups = [], {}
        for i, off in zip(lay.pids, lay.offsets):
            shape = self._shape[i]
            if shape is None:
                unc.append(torch.arange(off, off + self._numels[i], device=HOST))
            else:
                groups.setdefault(shape, []).append((i, off))
        plan_groups, cpos = [], []
        for (a, b), members in groups.items():
            ar = torch.arange(a * b, device=HOST)
            plan_groups.append(dict(a=a, b=b, pids=[i for i, _ in members],
                                    bidx=torch.cat([ar + off for _, off in members])))
            cpos.append(torch.cat([ar + self._offsets[i] for i, _ in members]))
        return dict(
            unc=torch.cat(unc) if unc else torch.empty(0, dtype=torch.long, device=HOST),
            groups=plan_groups,
            cpos=torch.cat(cpos) if cpos else torch.empty(0, dtype=torch.long, device=HOST))

    def phase1(self, bucket: dist.GradBucket, lay: Layout):
        n, k = self.world_size, self.options.rank
        buf = bucket.buffer()
        t0 = time.perf_counter()
        plan = self._plan(lay, buf.device)
        groups = plan["groups"]
        self._take_new_q()
        err = self._E.rows(lay, plan["cpos"]) if groups else None
        ms, ps, pos = [], [], 0
        for grp in groups:
            g, a, b = len(grp["pids"]), grp["a"], grp["b"]
            size = g * a * b
            m = buf.index_select(0, grp["bidx"]).float().add_(err[pos:pos + size]).view(g, a, b)
            pos += size
            qs = [self._Q.get(i) if self.options.warm_start else None for i in grp["pids"]]
            q = torch.stack([x if x is not None else self._new_q(i, b, buf.device)
                             for x, i in zip(qs, grp["pids"])])
            ms.append(m)
            ps.append(torch.bmm(m, q))
        unc = plan["unc"]
        payload = torch.cat([buf.index_select(0, unc).float()] + [p.reshape(-1) for p in ps])
        self._add_encode(time.perf_counter() - t0)
        work = self.wire.all_reduce(payload, async_op=True)

        def phase2() -> torch.futures.Future:
            t1 = time.perf_counter()
            payload.div_(n)
            nu = unc.numel()
            if nu:
                buf.index_copy_(0, unc, payload[:nu].to(buf.dtype))
            if not groups:
                self._add_encode(time.perf_counter() - t1)
                return completed(buf)
            pmats, qs, at = [], [], nu
            for grp, m in zip(groups, ms):
                g, a = m.shape[0], grp["a"]
                p = C.orthogonalize_(payload[at:at + g * a * k].view(g, a, k).clone())
                at += g * a * k
                pmats.append(p)
                qs.append(torch.bmm(m.transpose(1, 2), p).reshape(-1))
            payload2 = torch.cat(qs)
            self._add_encode(time.perf_counter() - t1)
            fut = self.wire.all_reduce(payload2, async_op=True).get_future()

            def decode(_f: torch.futures.Future) -> torch.Tensor:
                t2 = time.perf_counter()
                payload2.div_(n)
                qat = epos = 0
                for grp, m, p in zip(groups, ms, pmats):
                    g, b = m.shape[0], grp["b"]
                    q = payload2[qat:qat + g * b * k].view(g, b, k)
                    qat += g * b * k
                    approx = torch.bmm(p, q.transpose(1, 2))
                    size = approx.numel()
                    torch.sub(m.reshape(-1), approx.reshape(-1), out=err[epos:epos + size])
                    epos += size
                    buf.index_copy_(0, grp["bidx"], approx.reshape(-1).to(buf.dtype))
                    ok = torch.isfinite(q).all(dim=(1, 2)) & (q.norm(dim=1) > 0).all(dim=1)
                    self._q_new.append((grp["pids"], q.clone(), _HostCopy(ok)))
                self._add_encode(time.perf_counter() - t2)
                return buf

            return fut.then(decode)

        return work.get_future(), phase2

    def state_dict(self) -> dict[str, Any]:
        # per-parameter residuals of the compressed matrices (others have none)
        flat = self._E.state()
        err = {i: flat[self._offsets[i]:self._offsets[i + 1]].view(self._shape[i]).clone()
               for i in range(len(self.params)) if self._shape[i] is not None}
        self._take_new_q()
        return {**super().state_dict(), "rank_k": self.options.rank, "error": err,
                "q": {i: q.to(HOST, copy=True) for i, q in self._Q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("rank_k", self.options.rank) != self.options.rank:
            raise ValueError(f"state_dict: saved with rank={state['rank_k']}, this run has "
                             f"rank={self.options.rank}; pass the same rank option")
        flat = torch.zeros(self.numel, device=HOST)
        for i, e in state["error"].items():
            i = int(i)
            flat[self._offsets[i]:self._offsets[i + 1]] = e.reshape(-1)
        self._E.load(flat)
        self._q_new.clear()
        self._Q = {int(i): q.to(self.device, copy=True) for i, q in state["q"].items()}


class _HostCopy:
    """A small device tensor on its way to the host: the copy is issued
    without waiting; ``get()`` waits for it (on a GPU: for an event recorded
    right after it) and returns it as a list."""

    __slots__ = ("_t", "_done")

    def __init__(self, t: torch.Tensor):
        self._done = None
        if t.device.type == "cuda":
            self._t = t.to(HOST, non_blocking=True)  # into pinned memory
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(t.device))
        else:
            self._t = t.to(HOST)  # CPU: no copy; other devices: a blocking one

    def get(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._t.tolist()
