"""torch's own DDP comm hooks, as baselines the bench compares against.

``torch_fp16`` wraps ``default_hooks.fp16_compress_hook`` and
``torch_powersgd`` wraps ``powerSGD_hook.powerSGD_hook`` (rank 1, error
feedback, warm start): what a user would pick instead of lorasync.  They go
through :class:`HookSync` only so that the same accounting applies (the
moment compute ended); the collectives are torch's, issued on a process group
of their own whose all-reduces :func:`lorasync.comm.wire.count_group`
counts, so their wire bytes are measured, not inferred from torch's rules.

torch's PowerSGD hook waits on its second all-reduce inside the first one's
``.then()`` callback.  On gloo that callback holds one of the process group's
worker threads, so with the adapter's gradients in several DDP buckets the
callbacks hold every thread and the all-reduces they wait on never run: the
job hangs at its first PowerSGD step, while in one bucket (25 MB, torch
DDP's own default) it trains.  ``torch_powersgd`` on gloo therefore refuses
a bucket smaller than the adapter's gradients, naming ``comm.bucket_mb`` and
the size that works; the bench's rows run it in 25 MB buckets, as a user of
torch's hook would.  lorasync's own ``powersgd`` has no such limit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from lorasync.comm.base import HookSync, Layout, register
from lorasync.comm.wire import count_group
from lorasync.errors import ConfigError

__all__ = ["TorchFP16", "TorchPowerSGD"]


def _own_group(sync: HookSync) -> dist.ProcessGroup:
    """A process group of the sync's ranks for torch's hook alone, so that
    counting the all-reduces that name it counts the hook's and nothing else."""
    ranks = dist.get_process_group_ranks(sync.group) if sync.group is not None else None
    return dist.new_group(ranks=ranks)


class _TorchHook(HookSync):
    """Shared part: torch's hook on a group of its own, its bytes counted there."""

    def setup(self) -> None:
        self._tgroup = _own_group(self)
        count_group(self._tgroup, self._count)

    def finish(self) -> None:
        super().finish()
        count_group(self._tgroup, None)


@register
class TorchFP16(_TorchHook):
    name = "torch_fp16"

    def encode_bucket(self, bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future:
        return default_hooks.fp16_compress_hook(self._tgroup, bucket)


@register
class TorchPowerSGD(_TorchHook):
    name = "torch_powersgd"

    def setup(self) -> None:
        grad_bytes = sum(p.numel() * p.element_size() for p in self.params)
        cap = getattr(self.ddp, "bucket_bytes_cap", None)
        if dist.get_backend(self.group) == "gloo" and cap is not None and grad_bytes > cap:
            need = -(-grad_bytes // 2 ** 20)   # whole MiB
            raise ConfigError(
                "comm.bucket_mb", f"{cap / 2 ** 20:.3g}",
                f"torch's PowerSGD hook hangs on gloo when the adapter's {grad_bytes / 1e6:.2f} "
                f"MB of gradients span several DDP buckets; use --bucket-mb {max(need, 25)} "
                "(one bucket; 25 is torch DDP's own default) or lorasync's --comm powersgd")
        super().setup()
        # torch requires start_powerSGD_iter > 1 with error feedback and warm start
        self.state = psgd.PowerSGDState(
            process_group=self._tgroup, matrix_approximation_rank=self.options.rank,
            start_powerSGD_iter=self.options.start_iter, use_error_feedback=True,
            warm_start=True, random_seed=0)

    def encode_bucket(self, bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future:
        return psgd.powerSGD_hook(self.state, bucket)
