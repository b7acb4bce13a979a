"""torch's own DDP comm hooks, as baselines the bench compares against.

``torch_fp16`` wraps ``default_hooks.fp16_compress_hook`` and
``torch_powersgd`` wraps ``powerSGD_hook.powerSGD_hook`` (rank 1, error
feedback, warm start): what a user would pick instead of lorasync.  They go
through :class:`HookSync` only so that the same accounting applies (wire
bytes, the moment compute ended); the collectives are torch's.

Known problem kept on purpose: torch's PowerSGD hook waits on its second
all-reduce inside a ``.then()`` callback and has hung on gloo with
variable-length batches; the bench runs every row under a timeout and
reports a hang.  lorasync's own ``powersgd`` does not have this problem.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from lorasync.comm.base import HookSync, _Layout, register

__all__ = ["TorchFP16", "TorchPowerSGD"]


@register
class TorchFP16(HookSync):
    name = "torch_fp16"

    def _encode_bucket(self, bucket: dist.GradBucket, lay: _Layout) -> torch.futures.Future:
        self._sent(torch.empty(lay.numel, dtype=torch.float16, device="meta"))
        return default_hooks.fp16_compress_hook(self.group, bucket)


@register
class TorchPowerSGD(HookSync):
    name = "torch_powersgd"

    def _setup(self) -> None:
        self.state = psgd.PowerSGDState(
            process_group=self.group, matrix_approximation_rank=self.options.rank,
            start_powerSGD_iter=self.options.start_iter, use_error_feedback=True,
            warm_start=True, random_seed=0)

    def _payload_numel(self, bucket: dist.GradBucket) -> int:
        """Elements torch's hook hands to all-reduce for this bucket (mirrors its rules)."""
        if self.state.iter < self.state.start_powerSGD_iter:
            return bucket.buffer().numel()
        r, total = self.options.rank, 0
        for g in bucket.gradients():
            if g.dim() == 2:
                m, n = g.shape
                rr = min(m, n, r)
                if psgd._should_compress(m, n, rr, self.state.min_compression_rate)[0]:
                    total += (m + n) * rr  # P (m x r) and Q (n x r)
                    continue
            total += g.numel()
        return total

    def _encode_bucket(self, bucket: dist.GradBucket, lay: _Layout) -> torch.futures.Future:
        self._sent(torch.empty(self._payload_numel(bucket), device="meta"))
        return psgd.powerSGD_hook(self.state, bucket)
