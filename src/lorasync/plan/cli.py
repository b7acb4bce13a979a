"""lorasync plan: predict and rank the gradient-sync strategies for a network.

From a measured network (the probe's JSON) or a what-if description, for the
embedded model's adapter (or --model / --adapter-params), print every
strategy's predicted step time, throughput, scaling efficiency and bytes, the
recommendation, and the steps to take on that network with their gains.

    lorasync plan --nodes 2 --rate 10mbit --rtt 1ms
    lorasync plan --probe probe.json --compute-s 1.25
    lorasync plan --probe probe.json --nodes 8 --rate 1gbit     # what-if: 8 nodes
    lorasync plan --nodes 8 --rate 1gbit --rtt 30ms --lora-r 16 --json
    lorasync plan --nodes 2 --rate 100mbit --metrics runs/x/metrics.jsonl
    lorasync plan --nodes 4 --ranks-per-node 8 --rate 100gbit --rtt 10us --rdma \
        --intra-rate 1200gbit --backend nccl           # 4 x 8 GPUs: flat and hierarchical

Pure prediction: nothing is measured or changed.  The model is in
lorasync/plan/costmodel.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

from lorasync.errors import ConfigError
from lorasync.catalog import NONE, STRATEGIES
from lorasync.plan.costmodel import (
    ALLREDUCE_ALGOS, MODELS, MiB, ModelShape, Workload, head_share, lanes_of, lora_matrices,
    ring_link_load,
)
from lorasync.plan.advice import Plan, options_text, plan
from lorasync.plan.net import (
    DEFAULT_TCP_WINDOW, LINK_EFFICIENCY, MAX_WORLD_SIZE, Link, check_link, net_from_probe,
    what_if_net,
)
from lorasync.units import (
    fmt_bytes, fmt_duration, fmt_rate, parse_count, parse_duration, parse_rate_Bps, parse_size,
)


from lorasync.config import CommConfig as _CommConfig

_TRAIN_BUCKET_MB = _CommConfig().bucket_mb  # one source of truth: the trainer's default

__all__ = ["add_arguments", "run", "build_plan", "format_plan"]

#: SmolLM2-135M + LoRA r=8, batch 4 of the demo task per rank per step on one
#: CPU thread, as the first benches measured it (docs/cost-model.md); other
#: machines differ: give --compute-s or --probe
_DEFAULT_S_PER_SAMPLE = {"smollm2-135m": 1.25 / 4}
_DEFAULT_RTT = "0.2ms"
_DEFAULT_INTRA_RATE = "200gbit"
_DEFAULT_INTRA_ALPHA = "10us"


#: what the overlay's SSH path (TCP) kept of the direct link at 100 Mbit/s: the
#: gloo all-reduce bus bandwidth, 0.99 (bench/reference/connectivity/throughput.json,
#: docs/connectivity.md); WireGuard over UDP kept 0.85 there, which what-if rates
#: do not model either (a probe through the overlay measures both)
TCP_PATH_SHARE = 0.99


def _nat_link_load(nodes: int, behind_nat: int, tcp_nodes: int = 0) -> int:
    """Ring legs on the busiest link when the last ``behind_nat`` of ``nodes``
    are behind NAT (two of them cannot connect) and the last ``tcp_nodes``
    reach the overlay over TCP (SSH to the hub: every leg of theirs that does
    not end at the hub goes through it).  Relayed legs go through node 0."""
    if not 0 <= behind_nat < nodes:
        raise ConfigError("--behind-nat", behind_nat, f"use 0 .. {nodes - 1} (node 0 is the hub)")
    if not 0 <= tcp_nodes < nodes:
        raise ConfigError("--tcp-nodes", tcp_nodes, f"use 0 .. {nodes - 1} (node 0 is the hub)")
    nat = set(range(nodes - behind_nat, nodes))
    tcp = set(range(nodes - tcp_nodes, nodes))
    relayed = {}
    for a in range(nodes if nodes > 1 else 0):
        b = (a + 1) % nodes
        if 0 not in (a, b) and ((a in nat and b in nat) or a in tcp or b in tcp):
            relayed[(a, b)] = 0
    return ring_link_load(list(range(nodes)), relayed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network (a probe, a what-if, or a probe with what-if overrides)")
    g.add_argument("--probe", metavar="FILE", help="JSON written by `lorasync probe --json`")
    g.add_argument("--nodes", type=int, metavar="N",
                   help="nodes (with --ranks-per-node G the job has N x G ranks; without it "
                        "one rank per node); default: the probe's world size, else 2")
    g.add_argument("--ranks-per-node", type=int, default=1, metavar="G",
                   help="ranks (GPUs, workers) on each node: ranks flat and hierarchical sync "
                        "(default 1)")
    g.add_argument("--intra-rate", metavar="RATE",
                   help=f"link between ranks of one node, e.g. 1200gbit (NVLink), 200gbit "
                        f"(PCIe 4.0 x16); default {_DEFAULT_INTRA_RATE} with a note")
    g.add_argument("--intra-latency", metavar="TIME",
                   help=f"latency per message inside a node (default {_DEFAULT_INTRA_ALPHA})")
    g.add_argument("--layout", choices=("both", "flat", "hierarchical"), default="both",
                   help="with --ranks-per-node: rank both layouts (default) or one")
    g.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="the job's backend: nccl adds NCCL_ALGO advice where the model "
                        "predicts a gain (default gloo)")
    g.add_argument("--rate", metavar="RATE",
                   help="line rate, e.g. 10mbit, 1gbit, 100Mbit/s, 12.5MB/s (with --probe: "
                        "only used to size TCP and RDMA gains)")
    g.add_argument("--rtt", metavar="TIME",
                   help=f"round-trip time, e.g. 30ms (what-if default {_DEFAULT_RTT})")
    g.add_argument("--link-efficiency", type=float, default=LINK_EFFICIENCY, metavar="F",
                   help="share of the line rate collectives achieve over TCP "
                        "(default %(default)s)")
    g.add_argument("--tcp-window", default=f"{DEFAULT_TCP_WINDOW // MiB}MiB", metavar="SIZE",
                   help="default TCP window of one connection (default %(default)s)")
    g.add_argument("--rdma", action="store_true",
                   help="the nodes have RDMA (InfiniBand/RoCE); the probe may say so too")
    g.add_argument("--allreduce-algo", choices=ALLREDUCE_ALGOS, default="ring",
                   help="all-reduce algorithm of the backend (default %(default)s)")
    g.add_argument("--alltoall-fallback", action="store_true",
                   help="the backend has no all-to-all: int8/onebit use an all-gather")
    g.add_argument("--behind-nat", type=int, default=0, metavar="K",
                   help="what-if: the last K nodes sit behind NAT that hole punching cannot "
                        "cross (symmetric NAT, CGNAT) and reach each other through the "
                        "overlay's hub (node 0), which carries their ring legs too; behind "
                        "plain NAT the overlay punches direct paths: leave it at 0")
    g.add_argument("--tcp-nodes", type=int, default=0, metavar="K",
                   help="what-if: the last K nodes reach the overlay over TCP (SSH to the hub, "
                        "UDP blocked): their ring legs go through node 0, at "
                        f"{TCP_PATH_SHARE:g} of the rate (measured)")

    g = p.add_argument_group("model and adapter")
    g.add_argument("--model", default="smollm2-135m", metavar="NAME|DIR",
                   help=f"one of {', '.join(MODELS)}, or a Hugging Face model directory "
                        "(its config.json) (default %(default)s)")
    g.add_argument("--lora-r", type=int, default=8, metavar="R", help="LoRA rank (default 8)")
    g.add_argument("--lora-targets", default="q,k,v,o", metavar="LIST",
                   help="adapted projections (default %(default)s)")
    g.add_argument("--freeze-a", action="store_true", help="FFA-LoRA: only B is trained and synced")
    g.add_argument("--adapter-params", metavar="N",
                   help="trainable parameter count, instead of deriving it from --model")

    g = p.add_argument_group("compute")
    g.add_argument("--compute-s", metavar="SECONDS",
                   help="forward+backward+optimizer time per step per rank (measured)")
    g.add_argument("--metrics", metavar="FILE",
                   help="a run's metrics.jsonl: take compute time and batch size from it")
    g.add_argument("--batch-size", type=int, metavar="B", help="samples per rank per step "
                   "(default 4)")
    g.add_argument("--backward-share", type=float, default=0.5, metavar="F",
                   help="share of compute in the backward pass (default 0.5: LoRA's frozen "
                        "weights need no weight gradients, so backward costs about what "
                        "forward does)")
    g.add_argument("--head-share", type=float, metavar="F",
                   help="share of the backward pass before the first adapter gradient is "
                        "ready (loss and LM head; default: estimated from --model, 0.21 for "
                        "smollm2-135m; 0 with --adapter-params)")
    g.add_argument("--bucket-mb", type=float, default=_TRAIN_BUCKET_MB, metavar="MB",
                   help="DDP bucket size in MiB, as the trainer's --bucket-mb "
                        f"(default {_TRAIN_BUCKET_MB:g}, the trainer's default)")
    g.add_argument("--first-bucket-mb", type=float, metavar="MB",
                   help="first bucket's cap (plain DDP with default buckets: 1)")

    g = p.add_argument_group("strategies")
    g.add_argument("--strategies", metavar="LIST",
                   help=f"comma list to rank (default all: {','.join(STRATEGIES)})")
    g.add_argument("--opt", action="append", default=[], metavar="STRATEGY.KEY=VALUE",
                   help="strategy option, e.g. topk.ratio=0.001 or local.period=16; repeatable")
    g.add_argument("--encode-ns", action="append", default=[], metavar="STRATEGY=NS",
                   help="encode+decode ns per element for a strategy; repeatable")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


# --------------------------------------------------------------------------- inputs

def _read_json(path: str, flag: str):
    if not os.path.isfile(path):
        raise ConfigError(flag, path, "file not found; give the path of an existing file")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except UnicodeDecodeError as exc:
        raise ConfigError(flag, path, f"not UTF-8 text (byte {exc.start}); give the JSON "
                          "file as written") from None
    except RecursionError:
        raise ConfigError(flag, path, "JSON nested too deeply; give the file as written") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(flag, path, f"not readable JSON ({exc})") from None


def _model_shape(name: str) -> ModelShape:
    if name in MODELS:
        return MODELS[name]
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not (os.path.isfile(path) and path.endswith(".json")):
        raise ConfigError("--model", name, f"use one of {', '.join(MODELS)}, a model directory "
                          "with config.json, or give --adapter-params")
    cfg = _read_json(path, "--model")
    if not isinstance(cfg, dict):
        raise ConfigError("--model", path, "config.json is not a JSON object; give a Hugging "
                          "Face model directory or --adapter-params")

    def dim(key: str, default=None, lo: int = 1) -> int:
        v = cfg.get(key) or default
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < 1 << 31:
            raise ConfigError(f"{path}: {key}", v, "a Llama-like config.json needs a positive "
                              "integer here; give --adapter-params instead")
        return v

    hidden, heads = dim("hidden_size"), dim("num_attention_heads")
    return ModelShape(
        name=os.path.basename(os.path.dirname(os.path.abspath(path))),
        hidden=hidden, layers=dim("num_hidden_layers"), heads=heads,
        kv_heads=dim("num_key_value_heads", heads), head_dim=dim("head_dim", hidden // heads),
        intermediate=dim("intermediate_size", 4 * hidden), vocab=dim("vocab_size", 0, lo=0))


def _metrics(path: str) -> tuple[float, int | None]:
    """Median compute_s and samples per rank per step from metrics.jsonl."""
    if not os.path.isfile(path):
        raise ConfigError("--metrics", path, "file not found; give a run's metrics.jsonl")
    recs = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                recs.append(json.loads(line))
            except (ValueError, RecursionError):
                raise ConfigError("--metrics", f"{path}:{i}", "not a JSON line") from None
    recs = [r for r in recs if isinstance(r, dict) and _finite(r.get("compute_s"))
            and r["compute_s"] > 0]
    if not recs:
        raise ConfigError("--metrics", path, "no records with a positive compute_s; give a "
                          "run's metrics.jsonl")
    # step 1 includes warm-up
    later = [r for r in recs if not _finite(r.get("step")) or r["step"] > 1] or recs
    samples = [r["samples"] for r in later if isinstance(r.get("samples"), int)
               and not isinstance(r["samples"], bool) and r["samples"] > 0]
    return (statistics.median(r["compute_s"] for r in later),
            int(statistics.median(samples)) if samples else None)


def _link_flag(text: str | None, flag: str, parse, kind: str) -> float | None:
    """A rate or time flag, parsed and within what a link can be."""
    if not text:
        return None
    return check_link(flag, parse(text, flag), kind, given=text,
                      fix=f"give a {'rate' if kind == 'bandwidth' else 'time'} in that range")


def _finite(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and abs(v) <= sys.float_info.max)   # not NaN, inf or an int beyond float range


def _kv(text: str, flag: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(flag, text, "write KEY=VALUE")
    k, v = text.split("=", 1)
    return k.strip(), v.strip()


def _scalar(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def build_plan(args: argparse.Namespace) -> tuple[Plan, list[str]]:
    """The plan for parsed CLI arguments, and notes on the inputs assumed."""
    notes: list[str] = []
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError("--nodes", args.nodes, "use an integer >= 1")
    g = args.ranks_per_node
    if g < 1:
        raise ConfigError("--ranks-per-node", g, "use an integer >= 1")
    if g == 1 and (args.intra_rate or args.intra_latency or args.layout != "both"):
        raise ConfigError("--ranks-per-node", g, "--intra-rate, --intra-latency and --layout "
                          "describe several ranks per node: give --ranks-per-node G > 1")
    ranks = None if args.nodes is None else args.nodes * g
    if ranks is not None and ranks > MAX_WORLD_SIZE:
        raise ConfigError("--nodes", args.nodes, f"at most {MAX_WORLD_SIZE} ranks in all "
                          "(--nodes x --ranks-per-node)")
    rate = _link_flag(args.rate, "--rate", parse_rate_Bps, "bandwidth")
    rtt = _link_flag(args.rtt, "--rtt", parse_duration, "latency")
    window = parse_size(args.tcp_window, "--tcp-window")
    if not 0 < args.link_efficiency <= 1:
        raise ConfigError("--link-efficiency", args.link_efficiency, "use a fraction in (0, 1]")

    # network
    if args.probe and (args.behind_nat or args.tcp_nodes):
        notes.append("--behind-nat/--tcp-nodes ignored: a probe run through the overlay has "
                     "measured the relay and the TCP path already")
    if args.probe:
        try:
            net, link = net_from_probe(_read_json(args.probe, "--probe"), world_size=ranks,
                                       allreduce_algo=args.allreduce_algo,
                                       alltoall=not args.alltoall_fallback, strict=True)
        except ConfigError as exc:   # name the file too
            if exc.field.startswith("probe"):
                raise ConfigError(f"--probe {args.probe}: {exc.field}", exc.value,
                                  exc.fix) from None
            raise
        link = Link(rtt_s=rtt if rtt is not None else link.rtt_s, rate_Bps=rate,
                    efficiency=args.link_efficiency, tcp_window_bytes=window,
                    rdma=link.rdma or args.rdma, source="probe")
    elif rate is not None:
        if rtt is None:
            rtt = parse_duration(_DEFAULT_RTT)
            notes.append(f"RTT not given: assumed {_DEFAULT_RTT} (give --rtt)")
        machines = args.nodes if args.nodes is not None else 2
        load = _nat_link_load(machines, args.behind_nat, args.tcp_nodes)
        if load > 1:
            who = " and ".join(x for x in (
                f"{args.behind_nat} node(s) behind NAT" if args.behind_nat else "",
                f"{args.tcp_nodes} node(s) on the TCP path" if args.tcp_nodes else "") if x)
            notes.append(f"{who} relay through node 0: its link carries {load} ring legs, so "
                         f"the ring runs at 1/{load} of the rate")
        if args.tcp_nodes:
            rate *= TCP_PATH_SHARE
            notes.append(f"{args.tcp_nodes} node(s) on the overlay's TCP path (SSH): rate x "
                         f"{TCP_PATH_SHARE:g}, what that path kept of the direct link in "
                         "bench/reference/connectivity/throughput.json")
        nodes = ranks if ranks is not None else 2 * g
        net = what_if_net(nodes, rate, rtt, efficiency=args.link_efficiency,
                          lanes=lanes_of(args.backend),
                          tcp_window_bytes=window, allreduce_algo=args.allreduce_algo,
                          alltoall=not args.alltoall_fallback, link_load=load)
        link = Link(rtt_s=rtt, rate_Bps=rate, efficiency=args.link_efficiency,
                    tcp_window_bytes=window, rdma=args.rdma)
    else:
        raise ConfigError("--probe/--rate", None, "give --probe FILE (from `lorasync probe "
                          "--json`) or describe a network: --nodes 2 --rate 10mbit --rtt 1ms")

    if g > 1:
        if net.world_size % g:
            raise ConfigError("--ranks-per-node", g, f"must divide the probe's world size "
                              f"{net.world_size} (or give --nodes)")
        irate = _link_flag(args.intra_rate or _DEFAULT_INTRA_RATE, "--intra-rate",
                           parse_rate_Bps, "bandwidth")
        ialpha = _link_flag(args.intra_latency or _DEFAULT_INTRA_ALPHA, "--intra-latency",
                            parse_duration, "latency")
        if not args.intra_rate:
            notes.append(f"intra-node link assumed {_DEFAULT_INTRA_RATE} (PCIe 4.0 x16; NVLink "
                         "is faster): give --intra-rate")
        if not args.intra_latency:
            notes.append(f"intra-node latency assumed {_DEFAULT_INTRA_ALPHA} per message "
                         "(give --intra-latency)")
        net = dataclasses.replace(
            net, ranks_per_node=g, intra_alpha_s=ialpha,
            intra_bandwidth_Bps=irate * args.link_efficiency,
            layout="flat" if args.layout == "both" else args.layout)

    # adapter
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    if not targets:
        raise ConfigError("--lora-targets", args.lora_targets, "name projections, e.g. q,k,v,o")
    if args.lora_r < 1:
        raise ConfigError("--lora-r", args.lora_r, "use an integer >= 1")
    head = 0.0
    if args.adapter_params is not None:
        params, matrices = parse_count(args.adapter_params, "--adapter-params"), None
    else:
        shape = _model_shape(args.model)
        matrices = lora_matrices(shape, args.lora_r, targets, args.freeze_a)
        params = sum(m * k for m, k in matrices)
        head = head_share(shape)
        if args.head_share is None and head:
            notes.append(f"backward: the first {100 * head:.0f}% (loss, LM head) comes before "
                         f"any adapter gradient, estimated from {shape.name}'s shape "
                         "(give --head-share)")
    if args.head_share is not None:
        head = args.head_share

    # compute
    batch = args.batch_size
    if batch is not None and batch < 1:
        raise ConfigError("--batch-size", batch, "use an integer >= 1")
    compute = None
    if args.metrics:
        compute, samples = _metrics(args.metrics)
        if batch is None and samples:
            batch = samples
        notes.append(f"compute {fmt_duration(compute)}/step: median of {args.metrics}")
    batch = batch or 4
    if args.compute_s is not None:
        compute = parse_duration(args.compute_s, "--compute-s", bare_seconds=True,
                                 allow_zero=False)
    if compute is None:
        per_sample = _DEFAULT_S_PER_SAMPLE.get(args.model)
        if per_sample is None or args.adapter_params is not None or args.lora_r != 8 \
                or targets != ["q", "k", "v", "o"]:
            raise ConfigError("--compute-s", None, "give the measured compute time per step "
                              "(e.g. --compute-s 1.25) or --metrics runs/NAME/metrics.jsonl")
        compute = per_sample * batch
        notes.append(f"compute {fmt_duration(compute)}/step assumed: SmolLM2-135M r=8 measured "
                     "0.31 s per 64-token sample on one CPU thread (give --compute-s)")

    # strategies and options
    names = ([s.strip() for s in args.strategies.split(",") if s.strip()]
             if args.strategies else list(STRATEGIES))
    for s in names:
        if s not in STRATEGIES:
            raise ConfigError("--strategies", s, f"choose from {', '.join(STRATEGIES)} "
                              f"({NONE} is always shown as the ceiling)")
    options: dict[str, dict] = {}
    for text in args.opt:
        key, value = _kv(text, "--opt")
        strat, _, opt = key.partition(".")
        if strat not in STRATEGIES + (NONE,) or not opt:
            raise ConfigError("--opt", text, "write STRATEGY.KEY=VALUE, e.g. topk.ratio=0.001")
        options.setdefault(strat, {})[opt] = _scalar(value)
    encode = {}
    for text in args.encode_ns:
        key, value = _kv(text, "--encode-ns")
        val = _scalar(value)
        if not _finite(val) or val < 0:
            raise ConfigError("--encode-ns", text, "write STRATEGY=NS, e.g. int8=6")
        encode[key] = float(val)

    if not 0 <= args.backward_share <= 1:
        raise ConfigError("--backward-share", args.backward_share,
                          "use a share in [0, 1], e.g. 0.5")
    if not 0 <= head < 1:
        raise ConfigError("--head-share", head, "use a share in [0, 1), e.g. 0.2")
    for flag, mb in (("--bucket-mb", args.bucket_mb), ("--first-bucket-mb", args.first_bucket_mb)):
        if mb is not None and not (_finite(mb) and 0 < mb <= 1 << 20):
            raise ConfigError(flag, mb, "use a number of MiB in (0, 1048576]")
    first = int(args.first_bucket_mb * MiB) if args.first_bucket_mb else None
    wl = Workload(adapter_params=params, compute_s=compute, batch_size=batch,
                  backward_share=args.backward_share, head_share=head,
                  bucket_bytes=int(args.bucket_mb * MiB),
                  first_bucket_bytes=first, matrices=matrices, lora_r=args.lora_r,
                  encode_ns=encode, options=options)
    layouts = None if args.layout == "both" else (args.layout,)
    return plan(net, wl, link, names, backend=args.backend, layouts=layouts), notes


# --------------------------------------------------------------------------- output

def _opts(d: dict) -> str:
    return options_text(d, ",") or "-"


def format_plan(pl: Plan, notes: list[str] = ()) -> str:
    net, wl, link, ceil = pl.net, pl.workload, pl.link, pl.ceiling
    out = []
    shape = (f"{net.nodes} nodes x {net.ranks_per_node} ranks" if net.ranks_per_node > 1
             else f"{net.world_size} ranks")
    out.append(f"lorasync plan: {shape} x {wl.batch_size} samples, adapter "
               f"{wl.adapter_params:,} params ({fmt_bytes(4 * wl.adapter_params)} fp32), "
               f"compute {fmt_duration(wl.compute_s)}/step")
    src = "probe" if link.source == "probe" else "what-if"
    extra = []
    if link.rate_Bps:
        extra.append(f"line {fmt_rate(link.rate_Bps)}")
    if link.rtt_s is not None:
        extra.append(f"RTT {fmt_duration(link.rtt_s)}")
    if link.rdma:
        extra.append("RDMA present")
    between = " between nodes" if net.ranks_per_node > 1 else ""
    out.append(f"network ({src}){between}: {fmt_rate(net.bandwidth_Bps)} achieved, alpha "
               f"{fmt_duration(net.alpha_s)} per message"
               + (f" ({', '.join(extra)})" if extra else ""))
    if net.ranks_per_node > 1:
        out.append(f"inside each node: {fmt_rate(net.intra_bandwidth_Bps)}, alpha "
                   f"{fmt_duration(net.intra_alpha_s)} per message")
    out.append(f"ceiling (no sync): {ceil.samples_per_s:.3g} samples/s")
    if pl.ranked_with:
        out.append(f"ranked with the steps below applied: {'; '.join(pl.ranked_with)}")
    out.append("")
    multi = net.ranks_per_node > 1
    head = ("  #  strategy    samples/s    eff     step   exposed    encode  wire/step  "
            + ("x-node/node  layout        " if multi else "") + "lossless  options")
    out.append(head)
    rp = pl.recommendation.prediction
    for i, p in enumerate(pl.ranking, 1):
        mark = "*" if (p.strategy, p.layout) == (rp.strategy, rp.layout) else " "
        topo = f"{fmt_bytes(p.inter_bytes):>11}  {p.layout:<12}  " if multi else ""
        out.append(f"{mark}{i:2d}  {p.strategy:<10} {p.samples_per_s:9.3g}  {p.efficiency:6.1%}"
                   f"  {fmt_duration(p.step_s):>7} {fmt_duration(p.exposed_comm_s):>9} "
                   f"{fmt_duration(p.encode_s):>9}  {fmt_bytes(p.wire_bytes):>9}  {topo}"
                   f"{'yes' if p.lossless else 'no':<8}  {_opts(p.options)}")
    rec = pl.recommendation
    out.append("")
    out.append(f"Recommendation: {rec.strategy}" + (f" [{rp.layout}]" if multi else "")
               + (f" ({_opts(rec.options)})" if rec.options else "")
               + f": {rec.prediction.samples_per_s:.3g} samples/s, "
                 f"{rec.prediction.efficiency:.0%} of the ceiling; {rec.reason}")
    todo = [s for s in pl.steps if s.worthwhile]
    skip = [s for s in pl.steps if not s.worthwhile]
    out.append("")
    out.append("Steps on this network, in order:" if todo else
               "Steps on this network: none needed")
    for i, s in enumerate(todo, 1):
        if s.gain is None:
            effect = "gain unknown"
        else:
            effect = (f"{s.gain:+.0%}: {s.samples_per_s_before:.3g} -> "
                      f"{s.samples_per_s_after:.3g} samples/s")
        out.append(f"  {i}. {s.title} ({effect})")
        out.append(f"     {s.detail}")
    if skip:
        out.append("Not worth it here:")
        for s in skip:
            gain = f" (predicted {s.gain:+.1%})" if s.gain else ""
            out.append(f"  - {s.title}{gain}: {s.detail}")
    all_notes = list(notes) + list(pl.notes)
    if all_notes:
        out.append("")
        out.extend(f"note: {n}" for n in all_notes)
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    pl, notes = build_plan(args)
    if args.json:
        d = pl.to_dict()
        d["input_notes"] = notes
        json.dump(d, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_plan(pl, notes))
    return 0
