"""DiLoCo's fragments and late outer updates, run alone (a LoopbackWire in
place of the network): which elements each outer step touches, and when."""

from __future__ import annotations

import types

import pytest
import torch

from lorasync import catalog
from lorasync.comm.base import get_strategy
from lorasync.comm.wire import LoopbackWire

SHAPES = [(4, 16), (16, 4), (4, 16), (8, 4), (3,), (4, 16), (16, 4)]


def _diloco(**opts):
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in SHAPES)
    holder = types.SimpleNamespace(module=params)   # what a strategy reads of its DDP module
    sync = get_strategy("diloco")(holder, _wire=LoopbackWire(1), _register_hook=False, **opts)
    return params, sync


def _inner_step(params, step):
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def _spans(F):
    numels = [torch.Size(s).numel() for s in SHAPES]
    offs = [0]
    for m in numels:
        offs.append(offs[-1] + m)
    return [(offs[a], offs[b]) for a, b in catalog.fragment_ranges(numels, F)]


@pytest.mark.parametrize("F, period, streaming, delay", [
    (1, 4, False, 1), (3, 6, False, 1), (3, 6, True, 1), (4, 8, True, 3), (7, 7, True, 2),
    (2, 4, True, 3)])
@pytest.mark.parametrize("codec", [{}, {"delta_dtype": "int4", "delta_block": 8},
                                   {"delta_dtype": "fp16", "delta_topk": 0.25}])
def test_every_element_is_synced_once_per_period(F, period, streaming, delay, codec):
    opts = {"period": period, "fragments": F, **codec}
    if streaming:
        opts.update(streaming=True, delay=delay)
    params, sync = _diloco(**opts)
    spans = _spans(F)
    applied = torch.zeros(sync.numel, dtype=torch.long)
    lag = delay if streaming else 0
    for s in range(1, 4 * period + 1):
        before = sync._anchor.clone()
        _inner_step(params, s)
        sync.after_step()
        moved = sync._anchor != before
        want = torch.zeros(sync.numel, dtype=torch.bool)
        if s - lag >= 1:   # what was launched `lag` steps ago lands now
            for f in catalog.fragments_due(s - lag, period, F):
                want[spans[f][0]:spans[f][1]] = True
        # an outer step moves only the elements of the fragments applied now
        # (not all of them: a sparse delta carries a share, a code may round to 0)
        assert not bool((moved & ~want).any()), s
        keep = codec.get("delta_topk", 1.0)
        assert int((moved & want).sum()) >= 0.5 * keep * int(want.sum()), s
        applied += want.long()
    steady = applied - applied.min()
    assert int(applied.min()) >= 3 and int(steady.max()) <= 1   # once a period, every element
    sync.finish()
    assert not sync.in_flight


def test_pending_syncs_survive_a_state_dict_and_reconfigure():
    params, sync = _diloco(period=4, fragments=2, streaming=True, delay=3, delta_dtype="int8")
    for s in range(1, 5):
        _inner_step(params, s)
        sync.after_step()
    assert sync.in_flight and len(sync._pending) == 2     # steps 2 and 4, each 3 steps to go
    sd = sync.state_dict()
    assert [p["frag"] for p in sd["pending"]] == [0, 1]
    params2, sync2 = _diloco(period=4, fragments=2, streaming=True, delay=3, delta_dtype="int8")
    with torch.no_grad():
        for a, b in zip(params2, params):
            a.copy_(b)
    sync2.load_state_dict(sd)
    for s in range(5, 9):
        _inner_step(params, s)
        _inner_step(params2, s)
        sync.after_step()
        sync2.after_step()
    assert all(torch.equal(a, b) for a, b in zip(params, params2))
    # another codec from now on: what is pending is applied first, the anchor stays
    anchor = sync._anchor.clone()
    sync.reconfigure(period=8, fragments=4, streaming=True, delay=1, delta_dtype="int4")
    assert not sync.in_flight and not torch.equal(anchor, sync._anchor)
    assert sync.options.delta_dtype == "int4" and len(sync._frags) == 4
    with pytest.raises(ValueError, match="fragments"):
        sync2.load_state_dict(sync.state_dict())      # saved with 4 fragments, this has 2
    with pytest.raises(ValueError, match="delta_block"):
        sync.reconfigure(delta_dtype="int4", delta_block=3)


def test_settle_receives_without_applying_early():
    """What the trainer calls before an evaluation: the syncs in flight arrive
    (an evaluation must not give them link time for free), and are still
    applied at their own step, so training is the same with or without it."""
    runs = []
    for settle in (False, True):
        params, sync = _diloco(period=4, fragments=2, streaming=True, delay=3,
                               delta_dtype="int8")
        for s in range(1, 13):
            _inner_step(params, s)
            sync.after_step()
            if settle:
                anchor = sync._anchor.clone()
                sync.settle()
                assert all(p["work"] is None for p in sync._pending)
                assert torch.equal(anchor, sync._anchor)   # nothing applied early
        runs.append(torch.cat([p.detach().reshape(-1) for p in params]))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0])
def test_error_feedback_decay_is_sparselocos_beta(beta):
    """delta_ef_decay=beta: the delta a sync codes is this period's drift plus
    beta times what earlier syncs left unsent (SparseLoCo's e <- beta e +
    delta); with beta 1 nothing is forgotten, with 0 error feedback is off."""
    params, sync = _diloco(period=1, delta_dtype="int2", delta_topk=0.1, delta_ef_decay=beta,
                           outer_momentum=0.0, outer_lr=1.0)
    for s in range(1, 6):
        e_before = sync._residual.clone()
        anchor = sync._anchor.clone()
        _inner_step(params, s)
        drift = anchor - torch.cat([p.detach().reshape(-1) for p in params])
        sync.after_step()
        sent = anchor - sync._anchor   # 1 rank, outer_lr 1, no momentum: the step is what was sent
        assert torch.allclose(sync._residual, drift + beta * e_before - sent, atol=1e-6)
        assert int((sent != 0).sum()) < 0.2 * sent.numel()    # sparse: most stays behind
    assert float(sync._residual.abs().max()) > 0


def test_error_feedback_decay_needs_a_coded_delta():
    with pytest.raises(ValueError, match="delta_ef_decay.*coded delta"):
        catalog.parse_options("diloco", {"delta_ef_decay": 0.9})
    with pytest.raises(ValueError, match="delta_ef_decay.*coded delta"):
        catalog.parse_options("diloco", {"delta_ef_decay": 0.9, "delta_dtype": "fp16"})
    # a sparse float delta is coded (indices + values): it keeps a remainder
    assert catalog.parse_options("diloco", {"delta_ef_decay": 0.9, "delta_topk": 0.1}) \
        .delta_ef_decay == 0.9
    assert catalog.parse_options("diloco", {"delta_ef_decay": 0.9, "delta_dtype": "int4"}) \
        .delta_ef_decay == 0.9
    with pytest.raises(ValueError, match="delta_ef_decay"):
        catalog.parse_options("diloco", {"delta_ef_decay": 1.5, "delta_dtype": "int4"})


def test_a_decaying_residual_survives_a_state_dict_and_a_switch_to_a_dense_delta():
    opts = dict(period=2, delta_dtype="int4", delta_topk=0.2, delta_ef_decay=0.5)
    params, sync = _diloco(**opts)
    params2, sync2 = _diloco(**opts)
    for s in range(1, 5):
        _inner_step(params, s)
        sync.after_step()
    assert float(sync._residual.abs().max()) > 0
    with torch.no_grad():
        for a, b in zip(params2, params):
            a.copy_(b)
    sync2.load_state_dict(sync.state_dict())
    assert torch.equal(sync2._residual, sync._residual)
    for s in range(5, 9):   # the same decayed error feedback from here on
        _inner_step(params, s)
        _inner_step(params2, s)
        sync.after_step()
        sync2.after_step()
    assert torch.equal(sync._residual, sync2._residual)
    assert all(torch.equal(a, b) for a, b in zip(params, params2))
    # a dense float delta from now on: what was kept goes with its next delta, in full
    sync.reconfigure(period=2, delta_dtype="fp32")
    kept = sync._residual.clone()
    anchor = sync._anchor.clone()
    m = sync._momentum.clone()
    _inner_step(params, 9)
    sync.after_step()           # step 9: no sync (period 2)
    _inner_step(params, 10)
    drift = anchor - torch.cat([p.detach().reshape(-1) for p in params])
    sync.after_step()           # step 10: the outer step
    assert float(sync._residual.abs().max()) == 0
    mean = drift + kept    # one rank: the mean delta is its own, remainder included
    mu, lr = sync.options.outer_momentum, sync.options.outer_lr
    want = anchor - lr * (mean + mu * (mu * m + mean))
    assert torch.allclose(sync._anchor, want, atol=1e-6)
