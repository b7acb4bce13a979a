"""LoRA fine-tuning across processes and machines (the main job).

One node, the embedded default (SmolLM2-135M + LoRA r=8, demo task, 2 workers):

    lorasync train
    lorasync train --nproc 4 --comm fp16 --max-steps 200 --output-dir runs/fp16

Several machines: run the same command as a torchrun worker on every node
(HOST:PORT is node 0's address, reachable from all nodes)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 -m lorasync train --output-dir runs/x
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 -m lorasync train --output-dir runs/x

Or let lorasync start torchrun on each node, elastic between 1 and 3 nodes::

    lorasync train --nnodes 1:3 --rdzv-endpoint HOST:29400 --output-dir runs/x

Set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface that reaches the
other nodes (``lorasync doctor`` checks this).  Options come from the
defaults, then ``--config FILE.yaml``, then the flags below.

Failures: a worker that dies, freezes or loses its link is detected within
max(--fault-timeout, --fault-steps x the step time) and the group restarts
(up to --max-restarts times) from the newest checkpoint every rank holds;
docs/faults.md has the details.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lorasync.config import iter_fields, load_config, parse_nnodes, parse_options
from lorasync.errors import ConfigError, LorasyncError

__all__ = ["add_arguments", "run", "strategies_text"]


class _ListStrategies(argparse.Action):
    """``--list-strategies``: every strategy, what it sends and its options, then exit."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(strategies_text())
        parser.exit(0)


def strategies_text() -> str:
    """The catalog for people: each strategy, its summary and options (default: help)."""
    from lorasync import catalog

    lines = []
    for name in catalog.names():
        spec = catalog.spec(name)
        lines.append(f"{name}: {spec.summary}")
        for key, default, help_text in catalog.option_help(name):
            value = str(default).lower() if isinstance(default, bool) else default
            lines.append(f"    {f'{key}={value}':<24} {help_text}")
    return ("strategies (--comm NAME) and their options (--comm-opt KEY=VALUE, defaults shown):\n"
            + "\n".join(lines))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--list-strategies", action=_ListStrategies,
                   help="print every sync strategy with its options and defaults, and exit")
    p.add_argument("--config", metavar="FILE", help="YAML file with model/lora/data/train/comm/"
                   "run sections; flags override it")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir from its latest checkpoint")
    p.add_argument("--emulate", metavar="SPEC",
                   help="run on an emulated cluster, e.g. nodes=2,rate=10mbit[,delay=40ms]"
                        "[,nproc_per_node=2]: one network namespace per node (its workers "
                        "share it), torchrun c10d rendezvous across them (needs root)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, f in iter_fields():
        flag = f.metadata.get("flag")
        if not flag:
            continue
        g = groups.setdefault(section, p.add_argument_group(f"{section} options"))
        dest = f"{section}__{f.name}"
        default = f.default if f.default is not f.default_factory else None
        help_text = f.metadata["help"]
        if f.type in ("bool", bool):
            g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                           help=help_text)
        elif f.name == "options":
            g.add_argument(flag, dest=dest, action="append", metavar="KEY=VALUE", default=None,
                           help=help_text)
        else:
            shown = "" if default in (None, "") or not isinstance(default, (int, float, str)) \
                else f" (default: {default})"
            g.add_argument(flag, dest=dest, default=None, metavar=f.name.upper(),
                           help=help_text + shown)


def _overrides(args) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for key, value in vars(args).items():
        if "__" not in key or value is None:
            continue
        section, name = key.split("__", 1)
        if name == "options":
            value = parse_options(value, section)
        out.setdefault(section, {})[name] = value
    return out


def _resolve(args):
    """Config from defaults <- run dir (on --resume) <- YAML <- flags."""
    overrides = _overrides(args)
    if args.resume:
        out = overrides.get("run", {}).get("output_dir")
        if not out:
            raise ConfigError("--resume", True, "also give --output-dir of the run to continue")
        saved = os.path.join(out, "config.yaml")
        if not os.path.isfile(saved):
            raise ConfigError("--output-dir", out, "no run to resume here (config.yaml missing)")
        from lorasync.train.runconfig import FIXED_ON_RESUME, check_run_config

        check_run_config(saved)  # cut short or changed: refused, never filled with defaults
        base = load_config(saved)
        import dataclasses
        merged = {s: dict(dataclasses.asdict(getattr(base, s))) for s in
                  ("model", "lora", "data", "train", "comm", "run")}
        merged["train"]["stop_after"] = 0  # a time box belongs to one session, not the run
        for s, vals in overrides.items():
            merged[s].update(vals)
        cfg = load_config(args.config, merged)
        for section, name in FIXED_ON_RESUME:
            was, now = getattr(getattr(base, section), name), getattr(getattr(cfg, section), name)
            if was != now:
                raise ConfigError(f"{section}.{name}", now,
                                  f"the run in {out} was trained with {was!r}, the shape of its "
                                  "checkpoints' adapter: resume without changing it, or start "
                                  "a new run in another --output-dir")
        return cfg
    return load_config(args.config, overrides)


def _preflight(cfg, world: int | None = None):
    """Check everything a user can get wrong before any worker starts or any file is
    written; returns the model's :class:`~lorasync.train.model.ModelSource`, resolved
    here once for the launcher and its workers."""
    from lorasync import catalog   # torch-free: this process never trains
    from lorasync.train.data import load_datasets
    from lorasync.train.model import EMBEDDED, ModelSource, check_model_options, ensure_embedded

    if cfg.run.metrics_port:
        import socket
        with socket.socket() as s:
            try:
                s.bind((cfg.run.metrics_host, cfg.run.metrics_port))
            except OSError as exc:
                raise ConfigError("run.metrics_port", cfg.run.metrics_port,
                                  f"cannot bind {cfg.run.metrics_host}:{cfg.run.metrics_port} "
                                  f"({exc.strerror}); choose a free port") from None
    from lorasync.monitor.sinks import check_report_to
    check_report_to(cfg.run.report_to)   # a tracker's package missing
    names = sorted(catalog.SPECS)
    if cfg.comm.strategy not in names:
        raise ConfigError("comm.strategy", cfg.comm.strategy, f"choose one of {', '.join(names)}")
    flat = catalog.flat_only(cfg.comm.strategy, cfg.comm.options)   # options: checked by config
    if cfg.comm.hierarchy == "node" and flat:
        raise ConfigError("comm.hierarchy", "node", f"{cfg.comm.strategy} runs flat only "
                          f"({flat}); use --hierarchy flat or auto")
    if cfg.train.bf16 or cfg.train.fp16:   # the strategy, and this host's autocast
        from lorasync.train.precision import check_precision, precision_device

        device = precision_device(cfg.run.backend)
        check_precision(cfg, device, probe=device == "cpu")
    check_model_options(cfg.model, cfg.lora)   # bitsandbytes' backend, PEFT's LoraConfig
    if cfg.model.name == EMBEDDED:
        ensure_embedded(log=lambda m: print(m, file=sys.stderr))
    source = ModelSource.resolve(cfg.model.name)   # a ModelError with the fix when there is none
    tok = _load_tokenizer(source)
    _check_targets(cfg, source)
    world = world or cfg.run.nproc
    g = world * cfg.train.batch_size * cfg.train.grad_accum
    train, _ = load_datasets(cfg.data, tok, need=g)   # every row checked, g encoded
    if len(train) < g:
        raise LorasyncError(
            f"data.path: {len(train)} training examples is fewer than one global batch "
            f"({world} ranks x batch_size {cfg.train.batch_size} x grad_accum "
            f"{cfg.train.grad_accum} = {g}); add data or lower --batch-size")
    return source


def _check_targets(cfg, source) -> None:
    """``lora.targets`` and ``lora.modules_to_save`` against the model's modules,
    once here instead of in every worker after the model loaded."""
    from lorasync.train.model import check_lora_targets

    check_lora_targets(source, cfg.lora)


def _load_tokenizer(source):
    """The tokenizer of ``source`` (what the data check encodes with)."""
    if source.name == "tiny":   # the tokenizer alone: building the model imports the modeling stack
        from lorasync.train.model import _tiny_tokenizer

        return _tiny_tokenizer(bare=True)
    path = source.path
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise LorasyncError(f"model.name: cannot load the tokenizer of {path}: "
                            f"{str(exc).splitlines()[0]}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _check_output_dir(given: str, out: str) -> None:
    """The run directory can be made: it is no file, and what exists of its
    path is a writable directory (the workers make it; a traceback there
    would come after the model loaded)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError("--output-dir", given, "is a file; give a directory for the run")
    parent = out
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("--output-dir", given, f"{parent} is not a writable directory; "
                          "choose a directory you can write to")


def _worker_argv(argv: list[str], output_dir: str) -> list[str]:
    """The launcher's argv for the workers, with the run directory fixed."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        # the launcher's own options; --nproc would also collide with torchrun's
        # --nproc-per-node abbreviation when an agent parses the whole line
        if a in ("--output-dir", "--emulate", "--nproc"):
            skip = True
            continue
        if a.split("=", 1)[0] in ("--output-dir", "--emulate", "--nproc"):
            continue
        out.append(a)
    return ["train", *out, "--output-dir", output_dir]


#: the environment variable that hands the launcher's resolved model to its workers
_SOURCE_ENV = "LORASYNC_MODEL_SOURCE"


def _hand_on(source) -> dict[str, str]:
    """What the launcher's workers get in their environment: ``source`` as JSON."""
    import dataclasses
    import json

    return {_SOURCE_ENV: json.dumps(dataclasses.asdict(source))}


def _handed(name: str):
    """The ``ModelSource`` this worker's launcher resolved for the model ``name``, or
    None: a worker torchrun started directly resolves the model itself."""
    import json

    from lorasync.train.model import ModelSource

    given = os.environ.get(_SOURCE_ENV)
    if not given:
        return None
    try:
        source = ModelSource(**json.loads(given))
    except (TypeError, ValueError):
        return None
    return source if source.name == name else None   # a stale variable names another


def run(args) -> int:
    from lorasync.launch import in_worker, run_torchrun

    cfg = _resolve(args)
    if in_worker():
        from lorasync.train.worker import train_worker

        if not cfg.run.output_dir:
            raise ConfigError("--output-dir", "", "under torchrun give every node the same "
                              "--output-dir")
        try:
            return train_worker(cfg, resume=args.resume, source=_handed(cfg.model.name))
        except LorasyncError:
            if int(os.environ.get("RANK", "0")) != 0:
                # only rank 0 reports a user error; the others exit with the same code
                raise SystemExit(2) from None
            raise

    if not cfg.run.output_dir:
        cfg.run.output_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    out = os.path.abspath(cfg.run.output_dir)
    if not args.resume and os.path.isdir(out) and os.listdir(out):
        raise ConfigError("--output-dir", cfg.run.output_dir,
                          "already holds a run; pass --resume to continue it or choose another "
                          "directory")
    _check_output_dir(cfg.run.output_dir, out)
    if not args.resume:   # a resume starts from its checkpoint, not the initial adapter
        from lorasync.train.checkpoint import check_init_adapter
        check_init_adapter(cfg)   # an adapter of another shape or base
    spec = None
    if args.emulate:
        from lorasync.emulate.spec import parse_emulate

        spec = parse_emulate(args.emulate)
    source = _preflight(cfg, spec.nodes * spec.nproc_per_node if spec else None)
    handoff = _hand_on(source)   # the workers load what this launcher checked
    raw = args._argv
    argv = _worker_argv(raw[raw.index("train") + 1:] if "train" in raw else [], out)
    restarts = cfg.run.max_restarts
    if spec is not None:
        from lorasync.emulate.launch import emulated, launch_on_cluster

        lo, hi = parse_nnodes(cfg.run.nnodes) if cfg.run.nnodes else (spec.nodes, spec.nodes)
        if hi != spec.nodes:
            raise ConfigError("--nnodes", cfg.run.nnodes, f"with --emulate give MIN:{spec.nodes} "
                              f"(the emulated cluster has {spec.nodes} nodes)")
        print(f"lorasync train: emulated cluster {spec.describe()}, "
              f"{spec.nproc_per_node} worker(s) per node"
              + (f", elastic {lo}:{hi} nodes" if lo < hi else "")
              + f", up to {restarts} restart(s), run directory {out}", file=sys.stderr)
        with emulated(spec) as cluster:
            code = launch_on_cluster(cluster, argv, nproc_per_node=spec.nproc_per_node,
                                     max_restarts=restarts, min_nodes=lo if lo < hi else None,
                                     env={**os.environ, **handoff})
        return _after(code, out, restarts)
    if cfg.run.nnodes and cfg.run.nnodes != "1" and not cfg.run.rdzv_endpoint:
        raise ConfigError("--nnodes", cfg.run.nnodes, "several nodes need --rdzv-endpoint "
                          "HOST:PORT (node 0's address), or --emulate for an emulated cluster")
    nodes = cfg.run.nnodes or "1"
    if cfg.run.rdzv_endpoint:   # the job's shared secret is the user's to give: refused
        from lorasync.launch.torchrun import shared_secret   # before a launch is announced

        shared_secret()
    print(f"lorasync train: {cfg.run.nproc} worker(s)"
          + (f" on this node of {nodes} via torchrun at {cfg.run.rdzv_endpoint}"
             if cfg.run.rdzv_endpoint else " via torchrun")
          + f", up to {restarts} restart(s), run directory {out}", file=sys.stderr)
    code = run_torchrun(argv, cfg.run.nproc, nnodes=nodes,
                        rdzv_endpoint=cfg.run.rdzv_endpoint or None, max_restarts=restarts,
                        env=handoff)
    return _after(code, out, restarts)


def _after(code: int, out: str, restarts: int) -> int:
    """The launcher's last word when the workers failed for good."""
    from lorasync.launch import EXIT_FAULT
    from lorasync.train.checkpoint import latest

    if code in (0, 2):
        return code
    ckpt = latest(out)
    where = (f"the newest checkpoint is {ckpt}" if ckpt else "no checkpoint was written yet")
    why = ("a peer failed (see the lorasync lines above)" if code == EXIT_FAULT
           else f"a worker exited with code {code}")
    print(f"lorasync train: the run failed: {why}, and the {restarts} restart(s) allowed "
          f"(--max-restarts) are used up; {where}; continue with `lorasync train --resume "
          f"--output-dir {out}`", file=sys.stderr)
    return code
