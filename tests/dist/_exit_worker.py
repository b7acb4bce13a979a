"""A user's own DDP loop with lorasync.attach that ends the way scripts end:
without destroy_process_group, the DDP model still alive (it holds the process
group, so destroying the group would not stop gloo's worker threads), right
after its last collective.  Run by tests/dist/test_hf_exits.py under torchrun.

    python -m torch.distributed.run --nproc-per-node 2 _exit_worker.py END STRATEGY [KEY=VALUE ...]

END: ``finish`` (sync.finish(), the documented end of a loop) or ``inflight``
(leaves with a streamed outer sync still in flight: no finish).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _strat_model as M  # noqa: E402

import lorasync  # noqa: E402
from lorasync.config import parse_options  # noqa: E402

end, strategy, *opts = sys.argv[1:]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = M.build(0)
ddp = torch.nn.parallel.DistributedDataParallel(model, init_sync=False)
sync = lorasync.attach(ddp, strategy, **parse_options(opts))
opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2)
teach = M.teacher(0)
steps = 6
for step in range(steps):
    x, y = M.batch(step, rank, False, teach)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sync.after_step()
if end == "finish":
    sync.finish()
print(f"rank {rank}: trained, leaving ({strategy}, {end}; a sync in flight: {sync.in_flight})",
      flush=True)
