"""Timing a strategy's hooks without a network (what auto does at start), and
the LoopbackWire it runs them on."""

from __future__ import annotations

import math

import pytest
import torch

from lorasync import catalog
from lorasync.comm.loopback import time_encode
from lorasync.comm.wire import LoopbackWire

SHAPES = [(4, 64), (64, 4), (4, 64), (32, 4)] * 3


@pytest.mark.parametrize("name", catalog.STRATEGIES)
def test_every_candidate_can_be_timed_and_its_inputs_stay_untouched(name):
    params = [torch.full(s, 0.5) for s in SHAPES]
    ns = time_encode(name, params, 2, calls=2, bucket_cap_bytes=1024)
    assert math.isfinite(ns) and ns >= 0
    if name == "allreduce":  # hands DDP's bucket over as it is: nothing to encode
        assert ns == 0
    else:
        assert ns > 0
    assert all(torch.equal(p, torch.full(p.shape, 0.5)) for p in params)


def test_options_and_world_size_reach_the_strategy():
    params = [torch.zeros(s) for s in SHAPES]
    # a period / a warm-up would leave nothing to time: the probe times the sync itself
    assert time_encode("diloco", params, 3, options={"period": 8, "streaming": True,
                                                     "delay": 2}) > 0
    assert time_encode("int8", params, 4, options={"warmup_steps": 100}, calls=1) > 0
    with pytest.raises(ValueError, match="ratio"):
        time_encode("topk", params, 2, options={"ratio": 0})


def test_loopback_wire_counts_and_completes_at_once():
    counted = []
    w = LoopbackWire(3, rank=1, count=counted.append)
    t = torch.arange(4, dtype=torch.float32)
    out = torch.empty(12)
    w.all_gather(out, t)
    assert torch.equal(out.view(3, 4), t.expand(3, 4))
    fut = w.all_reduce(t, async_op=True).get_future()
    assert fut.done() and torch.equal(fut.value()[0], t)
    recv = torch.empty(4)
    w.all_to_all(recv, t)
    assert torch.equal(recv, t)
    w.broadcast(t, 0, count=False)
    assert counted == [16, 16, 16]
    assert (w.size, w.rank, w.backend) == (3, 1, "loopback")
