"""Peers as rows: another system's sync on lorasync's own training run.

A bench row for a system a user on a slow link would pick instead of
lorasync must differ from lorasync's rows in the sync alone: the same model
and adapter, the same data in the same order, the same inner optimizer
(AdamW, the same learning-rate schedule), the same evaluation and the same
per-step records (so bench/time_to_quality.py reads it like any other row).
This module is that worker.  It is lorasync's trainer (train/loop.py) with
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

torchft's DiLoCo and DeepSpeed's 1-bit Adam are not rows: docs/peers.md says
why.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["PEERS", "parse_peer_options", "AccelerateLocalSGD", "main"]

#: peer -> its options and their defaults
PEERS: dict[str, dict] = {
    "accelerate_localsgd": {"local_sgd_steps": 16, "params": "adapter"},
}


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


class AccelerateLocalSGD:
    """accelerate's LocalSGD in the place of a lorasync strategy.

    ``inner`` is the trainer's ``none`` strategy (it counts the steps and
    keeps the records' fields); LocalSGD is entered once (it holds DDP's
    ``no_sync`` for the whole run, as its docs show) and stepped after every
    optimizer step.  The time of a step's ``LocalSGD.step()`` is exposed sync
    (``comm_s``: it blocks on a barrier and the all-reduces), and its bytes are
    the payload it hands to all-reduce (fp32, every averaged tensor)."""

    name = strategy = "accelerate_localsgd"
    in_flight = in_flight_next_step = grads_hold_momentum = False

    def __init__(self, inner, ddp, *, local_sgd_steps: int, params: str = "adapter"):
        from accelerate import Accelerator
        from accelerate.local_sgd import LocalSGD

        self.inner = inner
        self.accelerator = Accelerator(cpu=next(ddp.module.parameters()).device.type == "cpu")
        target = ddp if params == "all" else _Trainable(ddp)
        self.local = LocalSGD(accelerator=self.accelerator, model=target,
                              local_sgd_steps=local_sgd_steps)
        self.local.__enter__()
        self.sync_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        self.adapter_fp32 = sum(p.numel() for p in ddp.module.parameters()
                                if p.requires_grad) * 4
        self._comm_s = 0.0
        self._wire = self._fp32 = self._syncs = 0
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
        s = dict(self.inner.stats())
        s.update(strategy=self.name, wire_bytes=s["wire_bytes"] + self._wire,
                 inter_bytes=s["inter_bytes"] + self._wire, fp32_bytes=self._fp32,
                 comm_s=s["comm_s"] + self._comm_s, syncs=self._syncs)
        return s

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "peer": self.name, "num_steps": self.local.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.local.num_steps = int(state.get("num_steps", 0))


def _trainer_cls(peer: str, opts: dict):
    from lorasync.train.loop import Trainer

    class PeerTrainer(Trainer):
        def setup(self) -> None:
            super().setup()
            if peer == "accelerate_localsgd":
                self.sync = AccelerateLocalSGD(self.sync, self.ddp, **opts)

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
    from lorasync.train.loop import train_worker

    return train_worker(cfg, trainer_cls=_trainer_cls(own.peer, opts))


if __name__ == "__main__":
    raise SystemExit(main())
