"""The reference strategy (fp32 all-reduce) and the no-sync baseline.

No ``from __future__ import annotations`` in hook modules: DDP checks that a
hook's bucket annotation is the real ``dist.GradBucket`` class.

``allreduce`` must give the same result as DDP without any hook: every other
strategy is tested against it.  ``none`` does no communication at all; the
bench uses it to measure the compute ceiling (scaling efficiency = samples/s
of a run / samples/s of the same ranks with ``none``).  Replicas diverge under
``none``, so it is never a training strategy.
"""


import torch
import torch.distributed as dist

from lorasync.comm.base import Sync, register


@register
class AllReduce(Sync):
    name = "allreduce"

    def _install(self) -> None:
        self.ddp.register_comm_hook(self, _allreduce_hook)


def _allreduce_hook(sync: AllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    sync._ready()
    buf = bucket.buffer()
    # Pre-divide like torch's default reducer, so results match plain DDP.
    buf.div_(sync.world_size)
    sync._sent(buf)
    sync._would_send_fp32(buf.numel())
    if bucket.is_last():
        sync._syncs += 1
    fut = dist.all_reduce(buf, group=sync.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


@register
class NoSync(Sync):
    name = "none"
    lossless = False

    def _install(self) -> None:
        self.ddp.register_comm_hook(self, _nosync_hook)


def _nosync_hook(sync: NoSync, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    sync._ready()
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
