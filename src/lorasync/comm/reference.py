"""The reference strategy (fp32 all-reduce) and the no-sync baseline.

``allreduce`` must give the same result as DDP without any hook: every other
strategy is tested against it.  ``none`` does no communication at all; the
bench uses it to measure the compute ceiling (scaling efficiency = samples/s
of a run / samples/s of the same ranks with ``none``).  Replicas diverge under
``none``, so it is never a training strategy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lorasync.comm.base import HookSync, Layout, completed, register


@register
class AllReduce(HookSync):
    """fp32 all-reduce, pre-divided by world size like torch's default reducer."""

    name = "allreduce"

    def encode_bucket(self, bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future:
        return self._fp32_allreduce(bucket)


@register
class NoSync(HookSync):
    name = "none"
    communicates = False

    def encode_bucket(self, bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future:
        return completed(bucket.buffer())
