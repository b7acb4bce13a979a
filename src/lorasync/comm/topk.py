"""Top-k sparsification with error feedback (``topk``).

Each rank keeps, per parameter, the ``k = max(1, ceil(ratio * numel))``
entries of ``g + e`` with the largest magnitude; the rest stays in its
residual ``e`` for later steps.  Sparse sets from different ranks overlap
only partly, so they are not all-reduced: every rank all-gathers everybody's
(index, value) pairs in one int32 tensor (index int32 + value fp32 bits, 8
bytes a kept entry, indices counted as wire bytes) and scatter-adds them in
rank order, which gives every rank the same bits.

k is chosen per parameter (not per bucket), so which entries are sent does not
depend on DDP's bucket layout (which changes after the first iteration).

Default ``ratio`` 0.1 (5x fewer bytes than fp32 all-reduce, indices included):
the ratio that met the quality rule on the embedded default, where smaller
ones did not (``bench/strategies.py``; docs/benchmarks.md, "Quality of each
strategy").  With Adam an entry sent once every 1/ratio steps gets one large
normalised update and none between, so a fine-tune of tens of steps needs a
large ratio; long runs can go lower.

The residual, index plans and buffers live on the gradients' device.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from lorasync.catalog import topk_k
from lorasync.comm import compress as C
from lorasync.comm.base import HOST, HookSync, Layout, Residual, register


@register
class TopK(HookSync):
    name = "topk"

    def setup(self) -> None:
        self._k = [topk_k(m, self.options.ratio) for m in self._numels]
        self._E = Residual(self.numel, len(self.params), self.device)

    def _plan(self, lay: Layout, device: torch.device) -> dict[str, Any]:
        """Parameters of one bucket grouped by size (one batched top-k a size)."""
        return lay.plan("topk", device, lambda: self._host_plan(lay))

    def _host_plan(self, lay: Layout) -> dict[str, Any]:
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, boff in zip(lay.pids, lay.offsets):
            groups.setdefault(self._numels[i], []).append((i, boff))
        rows, cpos = [], []
        for m, members in groups.items():
            ar = torch.arange(m, device=HOST)
            bpos = torch.stack([ar + boff for _, boff in members])
            cpos.append(torch.stack([ar + self._offsets[i] for i, _ in members]).reshape(-1))
            rows.append((bpos, bpos.reshape(-1), self._k[members[0][0]]))
        return {"groups": rows, "cpos": torch.cat(cpos)}

    def encode_bucket(self, bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future:
        n = self.world_size
        buf = bucket.buffer()
        t0 = time.perf_counter()
        plan = self._plan(lay, buf.device)
        e = self._E.rows(lay, plan["cpos"])
        pos, vals, off = [], [], 0
        for bpos, bflat, k in plan["groups"]:
            size = bflat.numel()
            u = buf.index_select(0, bflat).float().add_(e[off:off + size]).view(bpos.shape)
            idx, v = C.topk_encode(u, k)
            u.scatter_(1, idx, 0.0)
            e[off:off + size] = u.view(-1)
            off += size
            pos.append(bpos.gather(1, idx).reshape(-1))
            vals.append(v.reshape(-1))
        payload = torch.cat([torch.cat(pos).to(torch.int32),
                             torch.cat(vals).view(torch.int32)])
        out = torch.empty(n * payload.numel(), dtype=torch.int32, device=payload.device)
        self._add_encode(time.perf_counter() - t0)
        fut = self.wire.all_gather(out, payload, async_op=True).get_future()

        def _decode(_f: torch.futures.Future) -> torch.Tensor:
            t1 = time.perf_counter()
            rows = out.view(n, 2, -1)
            # rank order: the same sums on every rank
            res = C.topk_decode(rows[:, 0], rows[:, 1].view(torch.float32), lay.numel)
            buf.copy_(res.div_(n))
            self._add_encode(time.perf_counter() - t1)
            return buf

        return fut.then(_decode)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ratio": self.options.ratio,
                "residual": self._E.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._E.load(state["residual"])
