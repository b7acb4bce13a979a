"""Peers as rows: another system's sync on lorasync's own training run.

A bench row for a system a user on a slow link would pick instead of
lorasync must differ from lorasync's rows in the sync alone: the same model
and adapter, the same data in the same order, the same inner optimizer
(AdamW, the same learning-rate schedule), the same evaluation and the same
per-step records (so bench/time_to_quality.py reads it like any other row).
This module is that worker.  It is lorasync's trainer (train/trainer.py) with
``--comm none`` (no gradient sync at all) and the peer's own object doing the
parameter averaging after each optimizer step::

    torchrun ... -m lorasync.bench.peers --peer accelerate_localsgd \\
        --peer-opt local_sgd_steps=16 -- <lorasync train flags>

Peers:

* ``accelerate_localsgd``: ``accelerate.local_sgd.LocalSGD`` (the helper a
  Trainer / accelerate user has at hand): every ``local_sgd_steps`` steps it
  waits for every rank and replaces each parameter by its all-reduced mean
  (one all-reduce per tensor, fp32).  As documented it is handed the model
  and averages *every* parameter, frozen base weights included (540 MB a
  sync for SmolLM2-135M); ``params=adapter`` (the default here) hands it a
  view of the trainable parameters only, the best a LoRA user can do with
  it; ``params=all`` is the documented call.

* ``torchft_diloco``: ``torchft.local_sgd.DiLoCo`` (DiLoCo, and Streaming
  DiLoCo with ``fragments`` > 1 and ``fragment_sync_delay``): each rank a
  replica group of one under a torchft Manager, the quorum from a
  ``torchft_lighthouse`` the bench starts (``lighthouse=http://HOST:PORT``).

DeepSpeed's 1-bit Adam is not a row: docs/peers.md says why.
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
import time

__all__ = ["PEERS", "parse_peer_options", "AccelerateLocalSGD", "TorchftDiLoCo", "main",
           "TORCHFT_ROWS", "LOCALSGD_PREFIX", "LIGHTHOUSE_PORT", "is_peer_row", "peer_row",
           "start_lighthouse", "torchft_row", "TORCHFT_ROW_OPTIONS"]

#: peer -> its options and their defaults
PEERS: dict[str, dict] = {
    "accelerate_localsgd": {"local_sgd_steps": 16, "params": "adapter"},
    # the DiLoCo paper's outer optimizer (SGD, Nesterov, lr 0.7, momentum 0.9);
    # torchft's example runs sync 20 steps, fragment_sync_delay 1 (Streaming
    # DiLoCo); lighthouse: the URL of a torchft_lighthouse the bench started
    "torchft_diloco": {"sync_every": 8, "fragments": 1, "fragment_sync_delay": 0,
                       "outer_lr": 0.7, "outer_momentum": 0.9, "lighthouse": "",
                       "timeout_s": 120.0},
}


#: a bench's peer rows (bench/time_to_quality.py and ``lorasync bench --rows``;
#: docs/peers.md): ``localsgd_K`` is accelerate's LocalSGD averaging the adapter
#: every K steps; the torchft rows use the DiLoCo paper's outer optimizer, 8
#: inner steps per outer sync (torchft's example uses 20 over 10,000 steps: one
#: sync in a 30-step row) and, for Streaming DiLoCo, 2 fragments each sent one
#: step before it is applied (the example's delay 1)
LOCALSGD_PREFIX = "localsgd_"
TORCHFT_ROWS = {
    "torchft_diloco": ("torchft DiLoCo, every 8 steps",
                       {"sync_every": 8, "fragments": 1, "fragment_sync_delay": 0}),
    "torchft_streaming": ("torchft Streaming DiLoCo, every 8 steps, 2 fragments, 1 step late",
                          {"sync_every": 8, "fragments": 2, "fragment_sync_delay": 1}),
}
LIGHTHOUSE_PORT = 29510
#: what a torchft row's key may set after its name (``torchft_streaming:outer_lr=0.8:
#: outer_momentum=0.5``): the outer optimizer, to tell torchft's implementation
#: from the paper's settings on a short run
TORCHFT_ROW_OPTIONS = ("outer_lr", "outer_momentum")


def torchft_row(key: str) -> tuple[str, dict] | None:
    """(label, options) of a torchft row key: a TORCHFT_ROWS name, optionally
    followed by ``:OPTION=VALUE`` items of TORCHFT_ROW_OPTIONS; None for any
    other key; ValueError naming the item for a bad one."""
    name, *items = key.split(":")
    if name not in TORCHFT_ROWS:
        return None
    label, opts = TORCHFT_ROWS[name]
    opts = dict(opts)
    seen: set[str] = set()
    for item in items:
        k, eq, v = item.partition("=")
        try:
            value = float(v)
        except ValueError:
            value = None
        if not eq or k not in TORCHFT_ROW_OPTIONS or value is None:
            raise ValueError(f"{key}: {item!r} is not OPTION=NUMBER with OPTION one of "
                             f"{', '.join(TORCHFT_ROW_OPTIONS)} (e.g. {name}:outer_lr=0.8:"
                             "outer_momentum=0.5)")
        if k in seen:
            raise ValueError(f"{key}: {k} is given twice; give it once")
        seen.add(k)
        if k == "outer_lr" and not 0 < value < math.inf:
            raise ValueError(f"{key}: outer_lr={v}: give a learning rate > 0, e.g. 0.7")
        if k == "outer_momentum" and not 0 <= value < 1:
            raise ValueError(f"{key}: outer_momentum={v}: give 0 <= outer_momentum < 1, "
                             "e.g. 0.9")
        opts[k] = value
    extra = [k for k in TORCHFT_ROW_OPTIONS if k in opts]
    if extra:
        label += ", outer " + ", ".join(f"{k.split('_')[1]} {opts[k]:g}" for k in extra)
    return label, opts


def is_peer_row(key: str) -> bool:
    """Whether ``key`` names a peer row: ``localsgd_K`` (K >= 1) or a torchft one."""
    k = key[len(LOCALSGD_PREFIX):]
    return key.split(":")[0] in TORCHFT_ROWS \
        or key.startswith(LOCALSGD_PREFIX) and k.isdigit() and int(k) >= 1


def peer_row(key: str, lighthouse: str = "") -> tuple[str, list[str], dict]:
    """(label, arguments of ``python -m lorasync.bench.peers`` before the train
    flags, options) of the peer row ``key`` (``lighthouse``: the URL of the
    torchft lighthouse the bench started, for the torchft rows)."""
    ft = torchft_row(key)
    if ft is not None:
        label, opts = ft
        args = ["--peer", "torchft_diloco", *[x for k, v in {**opts, "lighthouse": lighthouse}
                                              .items() for x in ("--peer-opt", f"{k}={v}")],
                "--"]
        return label, args, opts
    k = int(key[len(LOCALSGD_PREFIX):])
    return (f"accelerate LocalSGD, every {k} steps",
            ["--peer", "accelerate_localsgd", "--peer-opt", f"local_sgd_steps={k}", "--"],
            {"local_sgd_steps": k})


def start_lighthouse(cluster, nodes: int, folder: str, port: int = LIGHTHOUSE_PORT):
    """torchft's lighthouse (the quorum server of its Manager) on node 0 of an
    emulated cluster, for a torchft row: every node's replica must join a
    quorum.  The caller stops it (``kill``, ``wait``) after the row."""
    import os
    import subprocess

    lh = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(lh):
        raise FileNotFoundError("the torchft rows need torchft==0.2.0 in this interpreter's "
                                "environment (pip install torchft==0.2.0; docs/peers.md)")
    log = open(os.path.join(folder, "lighthouse.log"), "a")
    p = subprocess.Popen(cluster.exec_argv(0, [
        lh, "--min_replicas", str(nodes), "--bind", f"{cluster.nodes[0].address}:{port}",
        "--join_timeout_ms", "1000", "--quorum_tick_ms", "50"]),
        stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1.0)
    return p


def parse_peer_options(peer: str, items: list[str]) -> dict:
    """``KEY=VALUE`` items over the peer's defaults; ValueError naming the
    option, the value and the fix."""
    if peer not in PEERS:
        raise ValueError(f"--peer: unknown {peer!r}; use one of {', '.join(PEERS)}")
    opts = dict(PEERS[peer])
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in opts:
            raise ValueError(f"--peer-opt: {item!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(opts)} ({peer})")
        opts[key] = type(opts[key])(value)
    if peer == "accelerate_localsgd":
        if opts["local_sgd_steps"] < 1:
            raise ValueError(f"--peer-opt local_sgd_steps={opts['local_sgd_steps']}: give a "
                             "whole number of steps >= 1")
        if opts["params"] not in ("adapter", "all"):
            raise ValueError(f"--peer-opt params={opts['params']}: use adapter (the trainable "
                             "parameters) or all (every parameter, as accelerate documents it)")
    if peer == "torchft_diloco":
        f, every, delay = opts["fragments"], opts["sync_every"], opts["fragment_sync_delay"]
        if f < 1 or every < f or every % f:
            raise ValueError(f"--peer-opt sync_every={every} fragments={f}: torchft needs "
                             "sync_every a multiple of fragments (>= 1)")
        if not 0 <= delay < every // f:
            raise ValueError(f"--peer-opt fragment_sync_delay={delay}: torchft needs it "
                             f"below sync_every / fragments = {every // f}")
        if not opts["lighthouse"]:
            raise ValueError("--peer-opt lighthouse=: give the URL of a running "
                             "torchft_lighthouse (http://HOST:PORT)")
    return opts


class _Trainable:
    """What LocalSGD is handed with ``params=adapter``: the DDP model's
    ``no_sync`` and its trainable parameters (the same Parameter objects:
    LocalSGD's ``param.data = mean`` lands in the model)."""

    def __init__(self, ddp):
        self.ddp = ddp
        self._params = [p for p in ddp.module.parameters() if p.requires_grad]

    def parameters(self):
        return iter(self._params)

    def no_sync(self):
        return self.ddp.no_sync()


class _PeerStrategy:
    """What both peer rows share in the place of a lorasync strategy: the
    trainer's ``none`` strategy inside (``inner``: it counts the steps and keeps
    the records' fields), the peer's own sync time, bytes and fp32-equivalent
    bytes added to its stats."""

    in_flight_next_step = grads_hold_momentum = False

    def __init__(self, inner):
        self.inner = inner
        self._comm_s = 0.0
        self._wire = self._fp32 = 0
        self._dirty = False

    # the trainer stamps and reads this on the strategy it holds
    @property
    def last_ready_time(self):
        return self.inner.last_ready_time

    @last_ready_time.setter
    def last_ready_time(self, value):
        self.inner.last_ready_time = value

    @property
    def replicas_may_differ(self) -> bool:
        return self._dirty

    def _stats(self, syncs: int) -> dict:
        s = dict(self.inner.stats())
        s.update(strategy=self.name, wire_bytes=s["wire_bytes"] + self._wire,
                 inter_bytes=s["inter_bytes"] + self._wire, fp32_bytes=self._fp32,
                 comm_s=s["comm_s"] + self._comm_s, syncs=syncs)
        return s


class AccelerateLocalSGD(_PeerStrategy):
    """accelerate's LocalSGD in the place of a lorasync strategy.

    ``inner`` is the trainer's ``none`` strategy (it counts the steps and
    keeps the records' fields); LocalSGD is entered once (it holds DDP's
    ``no_sync`` for the whole run, as its docs show) and stepped after every
    optimizer step.  The time of a step's ``LocalSGD.step()`` is exposed sync
    (``comm_s``: it blocks on a barrier and the all-reduces), and its bytes are
    the payload it hands to all-reduce (fp32, every averaged tensor)."""

    name = strategy = "accelerate_localsgd"
    in_flight = False

    def __init__(self, inner, ddp, *, local_sgd_steps: int, params: str = "adapter"):
        from accelerate import Accelerator
        from accelerate.local_sgd import LocalSGD

        super().__init__(inner)
        self.accelerator = Accelerator(cpu=next(ddp.module.parameters()).device.type == "cpu")
        target = ddp if params == "all" else _Trainable(ddp)
        self.local = LocalSGD(accelerator=self.accelerator, model=target,
                              local_sgd_steps=local_sgd_steps)
        self.local.__enter__()
        self.sync_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        self.adapter_fp32 = sum(p.numel() for p in ddp.module.parameters()
                                if p.requires_grad) * 4
        self._syncs = 0

    def after_step(self) -> None:
        self.inner.after_step()
        t0 = time.perf_counter()
        self.local.step()
        self._fp32 += self.adapter_fp32   # what fp32 all-reduce would have sent this step
        if self.local.num_steps % self.local.local_sgd_steps == 0:
            self._comm_s += time.perf_counter() - t0
            self._wire += self.sync_bytes
            self._syncs += 1
            self._dirty = False
        else:
            self._dirty = True

    def settle(self) -> None:
        """Nothing is ever in flight: LocalSGD averages synchronously."""

    def finish(self) -> None:
        """LocalSGD's exit: one last average, and DDP's no_sync left."""
        if self.local.enabled:
            t0 = time.perf_counter()
            self.local.__exit__(None, None, None)
            self._comm_s += time.perf_counter() - t0
            self._wire += self.sync_bytes
            self._syncs += 1
        self._dirty = False

    def stats(self) -> dict:
        return self._stats(self._syncs)

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "peer": self.name, "num_steps": self.local.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.local.num_steps = int(state.get("num_steps", 0))


def _fragments(params: list, n: int) -> list:
    """``n`` modules holding consecutive runs of ``params`` (the same Parameter
    objects, about the same element count each): torchft's DiLoCo syncs every
    parameter of a fragment module, so a fragment holds adapter tensors only
    (a PEFT module would bring its frozen base weights along)."""
    import torch

    total, per = sum(p.numel() for p in params), []
    bounds = [total * (i + 1) / n for i in range(n)]
    acc, cur = 0, []
    for p in params:
        cur.append(p)
        acc += p.numel()
        if len(per) < n - 1 and acc >= bounds[len(per)]:
            per.append(cur)
            cur = []
    per.append(cur)
    mods = []
    for chunk in per:
        m = torch.nn.Module()
        for i, p in enumerate(chunk):
            m.register_parameter(f"p{i}", p)
        mods.append(m)
    return mods


class TorchftDiLoCo(_PeerStrategy):
    """torchft's DiLoCo / Streaming DiLoCo in the place of a lorasync strategy.

    Each rank is a torchft replica group of one (its own Manager, its own
    store on this node's address, the bench's lighthouse for the quorum);
    ``torchft.local_sgd.DiLoCo`` hooks the trainer's AdamW (inner optimizer)
    and, every ``sync_every`` steps per fragment, all-reduces the
    pseudo-gradients through the Manager (fp32) and steps the outer SGD.  Its
    hook runs inside ``optimizer.step()``: the time of that hook is this
    step's exposed sync (``comm_s``), and an evaluation first waits for an
    all-reduce in flight (``settle``), as lorasync's streamed rows do."""

    name = strategy = "torchft_diloco"

    def __init__(self, inner, ddp, opt, *, sync_every: int, fragments: int,
                 fragment_sync_delay: int, outer_lr: float, outer_momentum: float,
                 lighthouse: str, timeout_s: float):
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing import http_transport
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.local_sgd import DiLoCo

        from lorasync.launch.stores import listening_socket, store_address

        super().__init__(inner)
        self.opt = opt
        addr = store_address()
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.params = params
        self.mods = _fragments(params, fragments)
        outer = [torch.optim.SGD(m.parameters(), lr=outer_lr, momentum=outer_momentum,
                                 nesterov=True) for m in self.mods]

        class OnAddress(http_transport._IPv6HTTPServer):
            # torchft binds its checkpoint server to ("", 0), every address
            address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

            def __init__(self, _everywhere, handler):
                super().__init__((addr, 0), handler)

        class Transport(HTTPTransport):
            # its checkpoint server on this node's address only (the host name
            # resolves to loopback on emulated nodes); only a healing peer uses it
            def __init__(self, **kw):
                everywhere = http_transport._IPv6HTTPServer
                http_transport._IPv6HTTPServer = OnAddress
                try:
                    super().__init__(**kw)
                finally:
                    http_transport._IPv6HTTPServer = everywhere

            def address(self) -> str:
                return f"http://{addr}:{self._server.socket.getsockname()[1]}/checkpoint/"

        tmo = timedelta(seconds=timeout_s)
        # the replica's store on this node's address only, as lorasync's own stores
        self.store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                   master_listen_fd=listening_socket(addr, 0))
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=tmo), min_replica_size=dist.get_world_size(),
            load_state_dict=self._load, state_dict=self._state, use_async_quorum=False,
            replica_id=f"lorasync_peer{dist.get_rank()}", store_addr=addr,
            store_port=self.store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
            hostname=addr, timeout=tmo, quorum_timeout=tmo, connect_timeout=tmo,
            init_sync=False, checkpoint_transport=Transport(timeout=tmo, num_chunks=0))
        self._t0: float | None = None
        self.adapter_fp32 = sum(p.numel() for p in params) * 4
        allreduce = self.manager.allreduce

        def counted(tensor, *args, **kwargs):   # what DiLoCo hands to the wire
            self._wire += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted
        # the time of DiLoCo's post-step hook: one hook before it, one after
        self._hooks = [opt.register_step_post_hook(self._before)]
        self.diloco = DiLoCo(self.manager, self.mods, opt, outer, sync_every=sync_every,
                             fragment_sync_delay=fragment_sync_delay, pin_memory=False)
        self.diloco.__enter__()
        self._hooks.append(opt.register_step_post_hook(self._after))
        self._dirty = False

    def _state(self):
        return {"adapter": [p.detach().clone() for p in self.params],
                "opt": self.opt.state_dict()}

    def _load(self, sd) -> None:
        import torch
        with torch.no_grad():
            for p, v in zip(self.params, sd["adapter"]):
                p.copy_(v)
        self.opt.load_state_dict(sd["opt"])

    def _before(self, *_):
        self._t0 = time.perf_counter()

    def _after(self, *_):
        if self._t0 is not None:
            self._comm_s += time.perf_counter() - self._t0
            self._t0 = None

    @property
    def in_flight(self) -> bool:
        return any(getattr(f, "_allreduce_work", None) for f in self.diloco._fragments)

    def after_step(self) -> None:
        self.inner.after_step()   # DiLoCo ran inside optimizer.step()
        self._fp32 += self.adapter_fp32
        self._dirty = True

    def settle(self) -> None:
        """An evaluation first waits for an all-reduce in flight (not applied)."""
        t0 = time.perf_counter()
        self.diloco._wait()
        self._comm_s += time.perf_counter() - t0

    def finish(self) -> None:
        """The replicas' mean (as lorasync's own periodic rows end), then torchft
        is shut down."""
        import torch
        import torch.distributed as dist

        self.diloco._wait()
        self.diloco.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            off = 0
            for p in self.params:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        self._dirty = False
        self.manager.shutdown(wait=False)

    def stats(self) -> dict:
        return self._stats(self.manager.current_step())

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "peer": self.name}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def _trainer_cls(peer: str, opts: dict):
    from lorasync.train.trainer import Trainer

    class PeerTrainer(Trainer):
        def setup(self) -> None:
            super().setup()
            if peer == "accelerate_localsgd":
                self.sync = AccelerateLocalSGD(self.sync, self.ddp, **opts)
            elif peer == "torchft_diloco":
                self.sync = TorchftDiLoCo(self.sync, self.ddp, self.opt, **opts)

    return PeerTrainer


def main(argv: list[str] | None = None) -> int:
    """A torchrun worker: ``--peer NAME [--peer-opt K=V ...] [--] TRAIN FLAGS``."""
    from lorasync.errors import ConfigError, LorasyncError

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m lorasync.bench.peers",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--peer", required=True, choices=sorted(PEERS))
    ap.add_argument("--peer-opt", action="append", default=[], metavar="KEY=VALUE")
    own, rest = ap.parse_known_args(argv)
    rest = [x for x in rest if x != "--"]
    from lorasync.train.cli import _resolve, add_arguments

    tp = argparse.ArgumentParser(prog="python -m lorasync.bench.peers ... --")
    add_arguments(tp)
    targs = tp.parse_args(rest)
    if getattr(targs, "comm__strategy", None) is None:
        targs.comm__strategy = "none"
    try:
        opts = parse_peer_options(own.peer, own.peer_opt)
        cfg = _resolve(targs)
        if cfg.comm.strategy != "none":
            raise ConfigError("comm.strategy", cfg.comm.strategy,
                              "a peer row syncs with the peer's own code: drop --comm (it "
                              "runs lorasync's trainer with --comm none)")
        if not cfg.run.output_dir:
            raise ConfigError("--output-dir", "", "give every node the same --output-dir")
        from lorasync.launch import in_worker
        if not in_worker():
            raise ConfigError("--peer", own.peer, "start it under torchrun (bench/"
                              "time_to_quality.py does, on the emulated nodes)")
    except (ValueError, LorasyncError) as exc:
        print(f"lorasync.bench.peers: {exc}", file=sys.stderr)
        return 2
    from lorasync.train.worker import train_worker

    return train_worker(cfg, trainer_cls=_trainer_cls(own.peer, opts))


if __name__ == "__main__":
    raise SystemExit(main())
