"""Worker for tests/gpu/test_nccl_strategies.py: rank 0 of a 1-rank group.

    python tests/gpu/_nccl_worker.py OUT_JSON [nccl|gloo]

``nccl`` (default): NCCL on cuda:0, DDP with device_ids=[0]; also a gloo
subgroup for the CPU side of the cross-device state_dict checks.  ``gloo``:
the same on the CPU (a dry run of this file where there is no GPU).

For every strategy configuration: STEPS steps with batch shapes that change
every step; eval loss before and after; wire bytes per step; where every
tensor of the strategy's state lives; a checkpoint at CKPT continued in a
fresh DDP + optimizer + strategy on the same device (compared with the
uninterrupted run); the checkpoint loaded into a strategy on the CPU and its
state_dict from there loaded back on the GPU (state must survive both moves
unchanged); host syncs caught by CUDA's sync debug mode during the steady
steps.  Writes one JSON; a failing configuration records its traceback and
the others still run.
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
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "dist"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "src"))
import _strat_model as M  # noqa: E402

import lorasync  # noqa: E402
from lorasync.comm import base as comm_base  # noqa: E402
from lorasync.catalog import wire_bytes  # noqa: E402

# (label, strategy, options)
CONFIGS = [
    ("allreduce", "allreduce", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("int8_warmup", "int8", {"block": 32, "warmup_steps": 2}),
    ("onebit", "onebit", {"block": 32}),
    ("topk", "topk", {"ratio": 0.1}),
    ("powersgd", "powersgd", {"rank": 1}),
    ("local", "local", {"period": 2}),
    # outer momentum 0.5, not the paper's 0.9: 3 outer steps of Nesterov 0.9 overshoot
    # on this tiny problem, and the test asserts that the eval loss goes down
    ("diloco", "diloco", {"period": 2, "outer_momentum": 0.5}),
    ("diloco_streaming", "diloco", {"period": 3, "streaming": True, "delta_dtype": "fp16",
                                    "outer_momentum": 0.5}),
    ("torch_fp16", "torch_fp16", {}),
    ("torch_powersgd", "torch_powersgd", {}),
]
STEPS, CKPT = 6, 3
SYNC_CHECK_FROM = 4   # DDP rebuilds its buckets after step 1: new index plans in step 2
LR = 1e-2
BUCKET_MB = 0.001     # several buckets on the tiny model
# torch's PowerSGD hook calls torch.cuda.synchronize(bucket device) whenever CUDA
# is available, which fails for a CPU model on a machine with a GPU (torch 2.11-2.13)
CPU_BROKEN_WITH_CUDA = {"torch_powersgd": "torch's PowerSGD hook cannot run a CPU model "
                                          "where CUDA is available (torch.cuda.synchronize(cpu))"}


def _ddp(model, device, group=None):
    kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    return torch.nn.parallel.DistributedDataParallel(
        model, init_sync=False, broadcast_buffers=False, bucket_cap_mb=BUCKET_MB,
        process_group=group, **kw)


def _opt(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _flat(model):
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()
                      if p.requires_grad])


def _step(ddp, opt, sync, s, teach, device):
    x, y = M.batch(s, 0, True, teach)          # on the CPU; shapes differ every step
    ddp.module.jitter_s = None
    x, y = x.to(device), y.to(device)
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync.after_step()
    return loss.detach()


def _eval(model, ev, device):
    with torch.no_grad():
        return float(((model(ev[0].to(device)) - ev[1].to(device)) ** 2).mean())


def _tensors(obj, path="", depth=0, seen=None):
    """(path, tensor) for every tensor of a strategy's own state (attributes,
    residuals, per-layout caches, containers)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]", depth + 1, seen)
    elif isinstance(obj, (list, tuple)) or type(obj).__name__ == "deque":
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]", depth + 1, seen)
    elif isinstance(obj, (comm_base.Sync, comm_base.Residual, comm_base.Layout)):
        names = getattr(obj, "__dict__", None) or {s: getattr(obj, s) for s in obj.__slots__}
        for k, v in names.items():
            if k in ("ddp", "params", "group", "state"):  # not the strategy's own tensors
                continue
            yield from _tensors(v, f"{path}.{k}", depth + 1, seen)


def _misplaced(obj, device, path):
    """Tensors of obj not on ``device`` (meta tensors only count bytes)."""
    return [f"{p}: {t.device}" for p, t in _tensors(obj, path)
            if t.device != device and t.device.type != "meta"]


def _same_state(a, b, path="state"):
    """Differences between two state_dicts (tensors compared bit for bit, on the CPU)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: tensor vs {type(b).__name__}"]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.cpu(), b.cpu()):
            return [f"{path}: tensors differ"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in _same_state(a[k], b[k], f"{path}[{k!r}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


class _SyncWatch:
    """Collects CUDA's sync-debug warnings with the innermost lorasync frame."""

    def __init__(self, device):
        self.on = device.type == "cuda"
        self.found: list[dict] = []

    def __enter__(self):
        if self.on:
            self._cm = warnings.catch_warnings()
            self._cm.__enter__()
            warnings.simplefilter("always")
            self._show = warnings.showwarning
            warnings.showwarning = self._record
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" not in text:
            return
        where = "outside lorasync"
        for fr in reversed(traceback.extract_stack()[:-1]):
            if os.sep + "lorasync" + os.sep in fr.filename and "tests" not in fr.filename:
                where = f"{os.path.basename(fr.filename)}:{fr.lineno} {fr.name}"
                break
        self.found.append({"where": where, "message": text.splitlines()[0][:160]})

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = self._show
            self._cm.__exit__(*exc)
        return False


def run_config(name, opts, device, teach, ev, cpu_group):
    out: dict = {}
    model = M.build(0).to(device)
    ddp, opt = _ddp(model, device), _opt(model)
    sync = lorasync.attach(ddp, name, **opts)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:
        formula = wire_bytes(name, shapes, 1, **opts)
    except ValueError:
        formula = 2 * numel if name == "torch_fp16" else None
    out.update(numel=numel, formula=formula, per_step=type(sync).spec.per_step,
               eval_before=_eval(model, ev, device))
    wire, fp32, losses = [], [], []
    last = sync.stats()
    ckpt = None
    watch = _SyncWatch(device)
    for s in range(1, STEPS + 1):
        if s == SYNC_CHECK_FROM:
            watch.__enter__()
        losses.append(_step(ddp, opt, sync, s, teach, device))
        if s == STEPS:
            watch.__exit__(None, None, None)
        st = sync.stats()
        wire.append(st["wire_bytes"] - last["wire_bytes"])
        fp32.append(st["fp32_bytes"] - last["fp32_bytes"])
        last = st
        if s == CKPT:
            ckpt = ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                    copy.deepcopy(opt.state_dict()), sync.state_dict())
    out["host_syncs"] = watch.found
    out["losses"] = [float(x) for x in losses]
    out["wire"], out["fp32"] = wire, fp32
    out["misplaced"] = _misplaced(sync, device, "sync")
    out["state_dict_not_on_cpu"] = [f"{p}: {t.device}" for p, t in _tensors(ckpt[2], "sd")
                                    if t.device.type != "cpu"]
    uninterrupted = _flat(model)
    out["finite"] = bool(torch.isfinite(uninterrupted).all())
    out["eval_after"] = _eval(model, ev, device)
    before = sync.stats()["wire_bytes"]
    sync.finish()
    out["finish_wire"] = sync.stats()["wire_bytes"] - before
    out["eval_after_finish"] = _eval(model, ev, device)

    # resume from the checkpoint on the same device
    model2 = M.build(0).to(device)
    model2.load_state_dict(ckpt[0])
    ddp2, opt2 = _ddp(model2, device), _opt(model2)
    opt2.load_state_dict(ckpt[1])
    sync2 = lorasync.attach(ddp2, name, **opts)
    sync2.load_state_dict(ckpt[2])
    out["misplaced_after_load"] = _misplaced(sync2, device, "sync2")
    for s in range(CKPT + 1, STEPS + 1):
        _step(ddp2, opt2, sync2, s, teach, device)
    out["resume_max_diff"] = float((_flat(model2) - uninterrupted).abs().max())

    # the checkpoint on the CPU (gloo subgroup), and the CPU's state back on the device
    if cpu_group is not None and name in CPU_BROKEN_WITH_CUDA:
        out["cpu_skipped"] = CPU_BROKEN_WITH_CUDA[name]
    elif cpu_group is not None:
        cpu = torch.device("cpu")
        model3 = M.build(0)
        model3.load_state_dict(ckpt[0])
        ddp3, opt3 = _ddp(model3, cpu, cpu_group), _opt(model3)
        opt3.load_state_dict(ckpt[1])
        sync3 = lorasync.attach(ddp3, name, process_group=cpu_group, **opts)
        sync3.load_state_dict(ckpt[2])
        out["cpu_misplaced_after_load"] = _misplaced(sync3, cpu, "sync3")
        sd3 = sync3.state_dict()
        out["cpu_state_diff"] = _same_state(ckpt[2], sd3)
        for s in range(CKPT + 1, CKPT + 3):
            _step(ddp3, opt3, sync3, s, teach, cpu)
        out["cpu_finite"] = bool(torch.isfinite(_flat(model3)).all())
        sd3 = sync3.state_dict()
        model4 = M.build(0).to(device)
        model4.load_state_dict(model3.state_dict())
        ddp4, opt4 = _ddp(model4, device), _opt(model4)
        opt4.load_state_dict(opt3.state_dict())
        sync4 = lorasync.attach(ddp4, name, **opts)
        sync4.load_state_dict(sd3)
        out["back_misplaced_after_load"] = _misplaced(sync4, device, "sync4")
        out["back_state_diff"] = _same_state(sd3, sync4.state_dict())
        _step(ddp4, opt4, sync4, CKPT + 3, teach, device)
        out["back_finite"] = bool(torch.isfinite(_flat(model4)).all())
    return out


def main():
    out_path = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "nccl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    result: dict = {"backend": backend, "device": str(device), "torch": torch.__version__,
                    "configs": {}}
    t0 = time.perf_counter()
    dist.init_process_group(backend, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60),
                            **({"device_id": device} if backend == "nccl" else {}))
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    if device.type == "cuda":
        from lorasync.comm.powersgd import _HostCopy
        hc = _HostCopy(torch.arange(3, device=device) > 0)
        result["hostcopy_pinned"] = bool(hc._t.is_pinned())
        result["hostcopy_value"] = hc.get()
    teach = M.teacher(0)   # batches are made on the CPU, then moved
    ev = M.eval_set(teach)
    only = set(sys.argv[3:])
    for label, name, opts in CONFIGS:
        if only and label not in only:
            continue
        t1 = time.perf_counter()
        try:
            r = run_config(name, opts, device, teach, ev, cpu_group)
        except Exception:  # noqa: BLE001 - recorded, the other configurations still run
            r = {"error": traceback.format_exc()}
        r["seconds"] = time.perf_counter() - t1
        result["configs"][label] = r
        print(f"{label}: {r['seconds']:.2f} s{' ERROR' if 'error' in r else ''}", flush=True)
    result["seconds"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
