"""DDP + PEFT as the trainer builds it: no unused-parameter errors, identical gradients."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        import lorasync
        from lorasync.config import LoraSettings
        from lorasync.train.data import collate, demo_rows, encode_rows
        from lorasync.train.model import ModelSource, add_lora, load_base

        base, tok = load_base(ModelSource.resolve("tiny"))
        model = add_lora(base, LoraSettings(dropout=0.1), seed=0)
        ddp = DDP(model, init_sync=False, bucket_cap_mb=0.01, find_unused_parameters=False)
        lorasync.attach(ddp, "allreduce")
        rows, _ = demo_rows(16, 0)
        exs = encode_rows(rows, tok, 64)
        torch.manual_seed(rank)  # different dropout per rank, like the trainer
        for it in range(3):  # DDP reports unused parameters on the iteration after one
            mine = exs[(it * world + rank) * 2:(it * world + rank) * 2 + 2]  # rank-local data
            ddp(**collate(mine, tok.pad_token_id)).loss.backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
            assert grads.abs().sum() > 0
            gathered = [torch.empty_like(grads) for _ in range(world)]
            dist.all_gather(gathered, grads)
            for g in gathered[1:]:
                assert torch.equal(g, gathered[0]), f"iteration {it}: gradients differ"
            for p in model.parameters():
                p.grad = None
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert all("lora_" in n for n in trainable) and frozen
        out[rank] = len(trainable)
    finally:
        dist.destroy_process_group()


def test_adapter_gradients_identical_across_ranks():
    world = 2
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(world, _free_port(), out), nprocs=world, join=True)
    assert out[0] == out[1] == 2 * 4 * 2  # A and B of q/k/v/o in 2 layers


def _hash_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from lorasync.train.ddp import same_on_every_rank

        same = [torch.arange(12.0).reshape(3, 4), torch.ones(5, dtype=torch.bfloat16)]
        out[f"same{rank}"] = same_on_every_rank(same, "cpu")
        # one element of one tensor differs on the last rank only
        other = [t.clone() for t in same]
        if rank == world - 1:
            other[0][2, 3] += 1e-6
        out[f"differ{rank}"] = same_on_every_rank(other, "cpu")
    finally:
        dist.destroy_process_group()


def test_adapter_hash_check_tells_identical_from_different():
    """The trainer skips the start-up broadcast only when every rank's adapter
    bytes agree; every rank must reach the same verdict."""
    world = 3
    out = mp.Manager().dict()
    mp.spawn(_hash_worker, args=(world, _free_port(), out), nprocs=world, join=True)
    assert [out[f"same{r}"] for r in range(world)] == [True] * world
    assert [out[f"differ{r}"] for r in range(world)] == [False] * world
