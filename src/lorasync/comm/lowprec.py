"""16-bit gradient all-reduce (``fp16``, ``bf16``).

Each bucket is divided by the world size *before* the cast, so the 16-bit sum
over ranks is already the mean and cannot overflow fp16 (max 65504) unless a
single rank's gradient would; the result is cast back into the fp32 buffer.
No error feedback: rounding to 16 bits loses ~3 (fp16) or ~2 (bf16)
significant digits per step, unbiased enough for AdamW.  Attach checks that
the backend can all-reduce the dtype and raises ValueError if not.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lorasync.comm.base import HookSync, Layout, register


class _LowPrecision(HookSync):
    dtype = torch.float16

    def setup(self) -> None:
        self._check_dtype(self.dtype, "dtype")

    def encode_bucket(self, bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future:
        buf = bucket.buffer()
        t0 = time.perf_counter()
        half = buf.div(self.world_size).to(self.dtype)
        self._add_encode(time.perf_counter() - t0)
        fut = self.wire.all_reduce(half, async_op=True).get_future()

        def _decode(f: torch.futures.Future) -> torch.Tensor:
            t1 = time.perf_counter()
            buf.copy_(f.value()[0])
            self._add_encode(time.perf_counter() - t1)
            return buf

        return fut.then(_decode)


@register
class FP16(_LowPrecision):
    name = "fp16"
    dtype = torch.float16


@register
class BF16(_LowPrecision):
    name = "bf16"
    dtype = torch.bfloat16
