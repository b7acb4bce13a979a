"""torchrun worker of test_peers.py: accelerate's LocalSGD as a bench peer row
(lorasync.bench.peers.AccelerateLocalSGD) on a 2-rank gloo group.

Each rank gives the trainable parameters of a tiny DDP model rank-specific
values, then steps the peer sync; it records after every step whether its
parameters are its own or the mean of both ranks', and the frozen
parameter's value.  Writes OUT/rankR.json."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lorasync.bench.peers import AccelerateLocalSGD
from lorasync.comm import attach

EVERY = 3


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {params: run(rank, params) for params in ("adapter", "all")}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


def run(rank: int, params: str) -> list[dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)   # a frozen "base" weight
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))          # rank 0: 1.0, rank 1: 2.0
    ddp = DDP(model, init_sync=False)
    sync = AccelerateLocalSGD(attach(ddp, "none"), ddp, local_sgd_steps=EVERY,
                              params=params)
    rec = []
    for step in range(1, 2 * EVERY + 1):
        with torch.no_grad():   # a local step: each rank moves its own replica
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.5 * (rank + 1))
        sync.after_step()
        trainable = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        rec.append({"step": step, "values": sorted({round(float(v), 4) for t in trainable
                                                    for v in t.reshape(-1)}),
                    "frozen": sorted({float(v) for v in model[0].weight.reshape(-1)}),
                    "differ": sync.replicas_may_differ, "stats": sync.stats()})
    sync.finish()
    rec.append({"finish": True, "stats": sync.stats()})
    return rec


if __name__ == "__main__":
    main(sys.argv[1])
