"""Worker for tests/dist/test_strategies.py: one spawn per world size, looping
over every strategy configuration inside the ranks (start-up is the slow part).

    python tests/dist/_strat_worker.py WORLD_SIZE OUT_DIR [CONFIG ...]

Each rank appends one line per finished scenario to OUT_DIR/progress<rank>.log
(so a hang can be located) and writes OUT_DIR/rank<rank>.json at the end.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _strat_model as M  # noqa: E402

# (label, strategy, options): the configurations every test reads
CONFIGS = [
    ("allreduce", "allreduce", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("int8_warmup", "int8", {"block": 32, "warmup_steps": 3}),
    ("onebit", "onebit", {"block": 32, "warmup_steps": 0}),  # signed gradients
    ("onebit_adam", "onebit", {"block": 32, "warmup_steps": 3}),  # + set_optimizer: 1-bit Adam
    ("topk", "topk", {"ratio": 0.1}),
    ("powersgd", "powersgd", {"rank": 1}),
    ("local", "local", {"period": 4}),
    ("local_streaming", "local", {"period": 4, "streaming": True}),
    ("diloco", "diloco", {}),  # period 8, outer_lr 0.8, Nesterov 0.5 (the defaults)
    ("diloco_streaming", "diloco", {"streaming": True, "delta_dtype": "fp16"}),
    # the outer-sync options of issue 17, each composed with streaming
    ("diloco_int4", "diloco", {"delta_dtype": "int4", "delta_block": 16}),
    ("diloco_topk", "diloco", {"delta_dtype": "int8", "delta_topk": 0.3, "streaming": True,
                               "delay": 2}),
    ("diloco_fragments", "diloco", {"fragments": 3, "delta_dtype": "int8", "streaming": True,
                                    "delay": 4}),
    ("diloco_fragments_fp16", "diloco", {"fragments": 2, "delta_dtype": "fp16"}),
    # issue 33: SparseLoCo's outer sync (top-k, 2-bit values, error feedback), streamed
    ("diloco_int2_topk", "diloco", {"delta_dtype": "int2", "delta_topk": 0.1,
                                    "streaming": True}),
]
#: configurations whose sync is given the optimizer (``set_optimizer``)
WITH_OPTIMIZER = {"onebit_adam"}
TRAIN_STEPS = 40
RESUME_AT, RESUME_END = 8, 18  # a sync falls on both sides of the checkpoint
LR = 1e-2
BUCKET_MB = 0.001  # several buckets on the tiny model, to exercise the pipelining


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(
        model, init_sync=False, broadcast_buffers=False, bucket_cap_mb=BUCKET_MB)


def _opt(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def _step(ddp, opt, sync, step, rank, variable, teach):
    x, y = M.batch(step, rank, variable, teach)
    ddp.module.jitter_s = M.jitter(step, rank) if variable else None
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if sync is not None:
        sync.after_step()
    return float(loss)


def _eval(model, ev):
    with torch.no_grad():
        return float(((model(ev[0]) - ev[1]) ** 2).mean())


def _spread(flat):
    """max |theta_rank - theta_0| over ranks (0.0 = replicas identical)."""
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return max(float((o - out[0]).abs().max()) for o in out)


def scenario_reference(rank, teach):
    """allreduce strategy vs DDP with no hook at all, variable shapes."""
    res = {}
    for use_sync in (False, True):
        model = M.build(0)
        ddp, opt = _ddp(model), None
        opt = _opt(model)
        sync = None
        if use_sync:
            import lorasync
            sync = lorasync.attach(ddp, "allreduce")
        for s in range(1, 9):
            _step(ddp, opt, sync, s, rank, True, teach)
        res[use_sync] = _flat(model)
    return {"max_diff": float((res[True] - res[False]).abs().max())}


def scenario_train(rank, name, opts, teach, ev, give_opt=False):
    import lorasync
    from lorasync.catalog import collectives, wire_bytes

    model = M.build(0)
    ddp, opt = _ddp(model), _opt(model)
    sync = lorasync.attach(ddp, name, **opts)
    if give_opt:
        sync.set_optimizer(opt)
    before = _eval(model, ev)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    wire, fp32, losses = [], [], []
    last = sync.stats()
    t0 = time.perf_counter()
    for s in range(1, TRAIN_STEPS + 1):
        losses.append(_step(ddp, opt, sync, s, rank, False, teach))
        st = sync.stats()
        wire.append(st["wire_bytes"] - last["wire_bytes"])
        fp32.append(st["fp32_bytes"] - last["fp32_bytes"])
        last = st
    elapsed = time.perf_counter() - t0
    spread_before_finish = _spread(_flat(model))
    sync.finish()
    st = sync.stats()
    return {
        "eval_before": before, "eval_after": _eval(model, ev), "train_losses": losses,
        "wire": wire, "fp32": fp32, "formula": wire_bytes(name, shapes, dist.get_world_size(), **opts),
        "per_sync": [c.payload_bytes for c in collectives(name, shapes, dist.get_world_size(),
                                                          opts)],
        "numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "spread_before_finish": spread_before_finish, "spread_after_finish": _spread(_flat(model)),
        "stats": {k: v for k, v in st.items() if k != "strategy"},
        "per_step": type(sync).spec.per_step, "lossless": type(sync).spec.lossless,
        "finish_wire": st["wire_bytes"] - last["wire_bytes"], "seconds": elapsed,
        "bucket_sizes": getattr(sync, "bucket_sizes", None),
    }


def scenario_resume(rank, name, opts, teach, give_opt=False):
    """Variable shapes per rank and step; checkpoint at RESUME_AT, continue in a
    fresh DDP + optimizer + sync, compare with the uninterrupted run."""
    import lorasync

    model = M.build(0)
    ddp, opt = _ddp(model), _opt(model)
    sync = lorasync.attach(ddp, name, **opts)
    if give_opt:
        sync.set_optimizer(opt)
    for s in range(1, RESUME_AT + 1):
        _step(ddp, opt, sync, s, rank, True, teach)
    ckpt = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
            copy.deepcopy(sync.state_dict()))
    for s in range(RESUME_AT + 1, RESUME_END + 1):
        _step(ddp, opt, sync, s, rank, True, teach)
    uninterrupted = _flat(model)

    model2 = M.build(0)
    model2.load_state_dict(ckpt[0])
    ddp2, opt2 = _ddp(model2), _opt(model2)
    opt2.load_state_dict(ckpt[1])
    sync2 = lorasync.attach(ddp2, name, **opts)
    if give_opt:
        sync2.set_optimizer(opt2)
    sync2.load_state_dict(ckpt[2])
    for s in range(RESUME_AT + 1, RESUME_END + 1):
        _step(ddp2, opt2, sync2, s, rank, True, teach)
    resumed = _flat(model2)
    return {"max_diff": float((uninterrupted - resumed).abs().max()),
            "spread": _spread(resumed) if type(sync2).spec.per_step else None}


MASS_CONFIGS = {"int8": {}, "onebit": {"warmup_steps": 0}, "topk": {}, "powersgd": {"rank": 1}}


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])


def scenario_mass(rank, name, opts, teach, steps=8):
    """Error feedback loses nothing: sum of applied (synced) gradients plus the
    residuals left at the end == sum of the true mean gradients."""
    import lorasync

    n = dist.get_world_size()
    model, ref = M.build(0), M.build(0)   # never stepped: ref gives local gradients
    ddp = _ddp(model)
    sync = lorasync.attach(ddp, name, **opts)
    applied = torch.zeros(sync.numel, dtype=torch.float64)
    true = torch.zeros_like(applied)
    for s in range(1, steps + 1):
        x, y = M.batch(s, rank, True, teach)
        ((ddp(x) - y) ** 2).mean().backward()
        applied += _grads(model).double()
        model.zero_grad(set_to_none=True)
        ((ref(x) - y) ** 2).mean().backward()
        g = _grads(ref).double()
        ref.zero_grad(set_to_none=True)
        dist.all_reduce(g)
        true += g / n
        sync.after_step()
    sd = sync.state_dict()
    if name in ("int8", "onebit"):
        # mean over ranks of worker residuals + server residuals (each element on its owner)
        resid = sd["worker_residual"].double() / n + sd["server_residual"].double()
    elif name == "topk":
        resid = sd["residual"].double() / n
    else:  # powersgd: per-parameter residuals of the compressed matrices
        resid = torch.zeros_like(applied)
        offs = [0]
        for p in sync.params:
            offs.append(offs[-1] + p.numel())
        for i, e in sd["error"].items():
            resid[offs[i]:offs[i + 1]] = e.reshape(-1).double() / n
    dist.all_reduce(resid)
    return {"max_err": float((applied + resid - true).abs().max()),
            "scale": float(true.abs().max()), "resid_max": float(resid.abs().max())}


DELTA_MASS_CONFIGS = {"int4": {"delta_dtype": "int4", "delta_block": 16},
                      "topk_int8": {"delta_dtype": "int8", "delta_topk": 0.2},
                      "topk_int2": {"delta_dtype": "int2", "delta_topk": 0.05},
                      "topk_fp16_fragments": {"delta_dtype": "fp16", "delta_topk": 0.3,
                                              "fragments": 3}}


def scenario_delta_mass(rank, opts, teach, steps=24):
    """DiLoCo's error feedback on the delta loses nothing.  With outer_lr 1
    and no momentum the anchor moves by exactly the mean delta that arrived,
    so anchor_0 - anchor_T + mean(residual_T) must equal the sum of the true
    mean deltas (anchor - theta, averaged over ranks) of every sync."""
    import lorasync
    from lorasync.catalog import fragment_ranges, fragments_due

    n = dist.get_world_size()
    model = M.build(0)
    ddp, opt = _ddp(model), _opt(model)
    full = {"period": 4, "outer_lr": 1.0, "outer_momentum": 0.0, **opts}
    sync = lorasync.attach(ddp, "diloco", **full)
    numels = [p.numel() for p in sync.params]
    offs = [0]
    for m in numels:
        offs.append(offs[-1] + m)
    frags = fragment_ranges(numels, full.get("fragments", 1))
    anchor0 = sync._anchor.double().clone()
    true = torch.zeros_like(anchor0)
    for s in range(1, steps + 1):
        x, y = M.batch(s, rank, True, teach)
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        due = fragments_due(s, full["period"], len(frags))
        if due:
            d = (sync._anchor - _flat(model)).double()
            mask = torch.zeros_like(d)
            for f in due:
                a, b = frags[f]
                mask[offs[a]:offs[b]] = 1
            d *= mask
            dist.all_reduce(d)
            true += d / n
        sync.after_step()
    resid = sync.state_dict()["residual"].double() / n
    dist.all_reduce(resid)
    got = anchor0 - sync._anchor.double() + resid
    return {"max_err": float((got - true).abs().max()), "scale": float(true.abs().max()),
            "resid_max": float(resid.abs().max())}


def scenario_adam(rank, teach, warmup=3, steps=8):
    """onebit given AdamW (1-bit Adam): warm-up steps are plain AdamW on fp32
    all-reduced gradients; after them Adam's bias-corrected variance stays
    frozen, the averaged momentum arrives as the gradient, and each step is
    x <- x (1 - lr wd) - lr * u / max(1, rms(u)),  u = m / (1 - b1^t) / (sqrt(v_hat) + eps)."""
    import lorasync

    def build(name, **opts):
        model = M.build(0)
        ddp = _ddp(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                weight_decay=0.05)
        sync = lorasync.attach(ddp, name, **opts)
        return model, ddp, opt, sync

    model, ddp, opt, sync = build("onebit", block=32, warmup_steps=warmup)
    sync.set_optimizer(opt)
    rmodel, rddp, ropt, rsync = build("allreduce")
    for s in range(1, warmup + 1):
        _step(ddp, opt, sync, s, rank, True, teach)
        _step(rddp, ropt, rsync, s, rank, True, teach)
    out = {"warmup_diff": float((_flat(model) - _flat(rmodel)).abs().max())}
    params = [p for p in model.parameters() if p.requires_grad]
    b1, b2 = opt.param_groups[0]["betas"]
    eps, wd = opt.param_groups[0]["eps"], opt.param_groups[0]["weight_decay"]
    vhat = [opt.state[p]["exp_avg_sq"].clone() / (1 - b2 ** warmup) for p in params]
    update_err, vhat_err, momentum_spread, clipped = 0.0, 0.0, 0.0, 0
    for s in range(warmup + 1, steps + 1):
        x, y = M.batch(s, rank, True, teach)
        ((ddp(x) - y) ** 2).mean().backward()
        before = [p.detach().clone() for p in params]
        grads = [p.grad.clone() for p in params]
        lr = opt.param_groups[0]["lr"]
        opt.step()
        for p, x0, g, v in zip(params, before, grads, vhat):
            st = opt.state[p]
            t = float(st["step"])
            assert int(t) == s, (t, s)
            # the averaged momentum arrived as the gradient and is the optimizer's
            update_err = max(update_err, float((st["exp_avg"] - g).abs().max()))
            u = g / (1 - b1 ** t) / (v.sqrt() + eps)
            rms = float(u.square().mean().sqrt())
            clipped += rms > 1.0
            want = x0 * (1 - lr * wd) - lr * u / max(1.0, rms)
            update_err = max(update_err, float((p.detach() - want).abs().max()))
            vhat_err = max(vhat_err, float((st["exp_avg_sq"] / (1 - b2 ** t) - v).abs().max()
                                           / float(v.abs().max())))
            momentum_spread = max(momentum_spread, _spread(st["exp_avg"].reshape(-1).clone()))
        opt.zero_grad(set_to_none=True)
        sync.after_step()
    out.update(update_err=update_err, vhat_err=vhat_err, momentum_spread=momentum_spread,
               spread=_spread(_flat(model)), steps_clipped=clipped,
               moved=float((_flat(model) - _flat(rmodel)).abs().max()))
    return out


def scenario_validation(rank):
    """attach() and load_state_dict() refuse what they cannot do, by ValueError."""
    import lorasync
    import lorasync.comm.base as base

    cases = {
        "unknown_strategy": ("bogus", {}),
        "inapplicable_option": ("int8", {"ratio": 0.1}),
        "topk_ratio_zero": ("topk", {"ratio": 0}),
        "topk_ratio_big": ("topk", {"ratio": 1.5}),
        "int8_block_zero": ("int8", {"block": 0}),
        "onebit_block_small": ("onebit", {"block": 4}),
        "warmup_negative": ("int8", {"warmup_steps": -1}),
        "powersgd_rank_zero": ("powersgd", {"rank": 0}),
        "powersgd_warm_start_str": ("powersgd", {"warm_start": "yes"}),
        "local_period_zero": ("local", {"period": 0}),
        "local_delay_without_streaming": ("local", {"delay": 2}),
        "diloco_streaming_period_one": ("diloco", {"period": 1, "streaming": True}),
        "diloco_delay_too_big": ("diloco", {"period": 4, "streaming": True, "delay": 4}),
        "diloco_bad_dtype": ("diloco", {"delta_dtype": "fp8"}),
        "diloco_too_many_fragments": ("diloco", {"fragments": 8, "period": 8}),
        "diloco_odd_block": ("diloco", {"delta_dtype": "int4", "delta_block": 33}),
        "diloco_momentum_one": ("diloco", {"outer_momentum": 1.0}),
        "allreduce_warmup": ("allreduce", {"warmup_steps": 2}),
        "onebit_momentum_str": ("onebit", {"momentum": "yes"}),
        "onebit_update_rms_negative": ("onebit", {"max_update_rms": -1.0}),
    }
    out = {}

    def attempt(fn):
        try:
            fn()
            return None
        except ValueError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - anything else is a wrong error type
            return f"NOT A ValueError: {type(e).__name__}: {e}"

    for label, (name, opts) in cases.items():
        out[label] = attempt(lambda: lorasync.attach(_ddp(M.build(0)), name, **opts))
    out["not_ddp"] = attempt(lambda: lorasync.attach(M.build(0), "allreduce"))

    def with_optimizer(make_opt, **opts):
        model = M.build(0)
        sync = lorasync.attach(_ddp(model), "onebit", **opts)
        sync.set_optimizer(make_opt([p for p in model.parameters() if p.requires_grad]))

    out["onebit_sgd"] = attempt(lambda: with_optimizer(
        lambda ps: torch.optim.SGD(ps, lr=0.1)))
    out["onebit_adam_no_warmup"] = attempt(lambda: with_optimizer(
        lambda ps: torch.optim.AdamW(ps), warmup_steps=0))
    out["onebit_amsgrad"] = attempt(lambda: with_optimizer(
        lambda ps: torch.optim.AdamW(ps, amsgrad=True)))
    out["onebit_sgd_without_momentum"] = attempt(lambda: with_optimizer(
        lambda ps: torch.optim.SGD(ps, lr=0.1), momentum=False))

    real = base.dist.all_reduce

    def refuse(tensor, *a, **k):
        if tensor.dtype == torch.float16:
            raise RuntimeError("Invalid scalar type")
        return real(tensor, *a, **k)

    base.dist.all_reduce = refuse
    try:
        out["backend_refuses_fp16"] = attempt(lambda: lorasync.attach(_ddp(M.build(0)), "fp16"))
        out["backend_refuses_delta_dtype"] = attempt(
            lambda: lorasync.attach(_ddp(M.build(0)), "diloco", delta_dtype="fp16"))
    finally:
        base.dist.all_reduce = real

    sd = lorasync.attach(_ddp(M.build(0)), "int8").state_dict()
    out["load_other_strategy"] = attempt(
        lambda: lorasync.attach(_ddp(M.build(0)), "topk").load_state_dict(sd))
    out["load_other_world_size"] = attempt(
        lambda: lorasync.attach(_ddp(M.build(0)), "int8").load_state_dict({**sd, "world_size": 99}))
    out["load_same"] = attempt(lambda: lorasync.attach(_ddp(M.build(0)), "int8").load_state_dict(sd))
    return out


def run(rank, world, out_dir, port, only):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    log = open(os.path.join(out_dir, f"progress{rank}.log"), "a", buffering=1)
    results: dict = {"configs": {}}
    teach, ev = M.teacher(0), None
    ev = M.eval_set(teach)
    try:
        log.write("start reference\n")
        results["reference"] = scenario_reference(rank, teach)
        log.write("start validation\n")
        results["validation"] = scenario_validation(rank)
        log.write("start adam\n")
        results["adam"] = scenario_adam(rank, teach)
        results["mass"] = {}
        for name, mopts in MASS_CONFIGS.items():
            log.write(f"start mass {name}\n")
            results["mass"][name] = scenario_mass(rank, name, mopts, teach)
        results["delta_mass"] = {}
        for name, mopts in DELTA_MASS_CONFIGS.items():
            log.write(f"start delta mass {name}\n")
            results["delta_mass"][name] = scenario_delta_mass(rank, mopts, teach)
        for label, name, opts in CONFIGS:
            if only and label not in only:
                continue
            r = {}
            log.write(f"start train {label}\n")
            r["train"] = scenario_train(rank, name, opts, teach, ev, label in WITH_OPTIMIZER)
            log.write(f"start resume {label}\n")
            r["resume"] = scenario_resume(rank, name, opts, teach, label in WITH_OPTIMIZER)
            log.write(f"done {label}\n")
            results["configs"][label] = r
    except Exception:
        results["error"] = traceback.format_exc()
        log.write("error\n" + results["error"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    log.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    world, out_dir = int(sys.argv[1]), sys.argv[2]
    only = set(sys.argv[3:])
    os.makedirs(out_dir, exist_ok=True)
    mp.spawn(run, args=(world, out_dir, _free_port(), only), nprocs=world, join=True)
