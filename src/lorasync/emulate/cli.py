"""Emulated multi-node cluster on this machine (root): one network namespace per
node, joined through a hub namespace, links shaped with htb; delay and loss
through a userspace TUN forwarder (this kernel has no netem).

    lorasync cluster up --nodes 2 --rate 100mbit [--delay 20ms] [--loss 0.1%] \\
        [--pair-rate 0-1=10mbit ...] [--nat node1 ...] [--overlay wireguard] [--name default]
    lorasync cluster status [--json] [--no-measure]
    lorasync cluster exec node1 -- python -c 'print("hello")'
    lorasync cluster set-rate 10mbit [--node 1]
    lorasync cluster down [--all]
    lorasync cluster launch --emulate nodes=2,rate=10mbit [--nproc-per-node G] -- SCRIPT [ARGS]

`launch` runs your own torchrun-able script (a Trainer script, a plain DDP
loop) with one torchrun agent per emulated node, as `lorasync train
--emulate` does: with --emulate the cluster is made for the run and removed
after it (also on failure); with --name only, it runs on a cluster already up.
Your environment (LORASYNC_* included) reaches the script; the exit code is
the script's (non-zero if any node failed). docs/emulate-your-script.md.

--delay is one-way, added to every packet between two nodes (RTT = 2 x delay).
--nat puts a node behind its own NAT router (it connects out, nothing connects
in); --overlay wireguard runs a WireGuard tunnel on every node over the
emulated links, and training launched on the cluster then runs over it.
Nothing changes in the host's own namespace; `down` also cleans up after a
crashed run.
"""

from __future__ import annotations

import argparse
import json
import subprocess

from lorasync.units import fmt_rate, parse_rate_bps

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_cmd", metavar="ACTION", required=True)

    def common(p):
        p.add_argument("--name", default="default", help="cluster name (default: %(default)s)")

    up = sub.add_parser("up", help="create the namespaces and links")
    common(up)
    up.add_argument("--nodes", type=int, default=2, help="number of nodes (default: %(default)s)")
    up.add_argument("--rate", default=None, help="per-node link rate, both directions, e.g. 100mbit "
                    "(default: unshaped)")
    up.add_argument("--delay", default="0", help="one-way delay between two nodes, e.g. 20ms (RTT = 2x)")
    up.add_argument("--loss", default="0", help="packet loss per direction, e.g. 0.1%%")
    up.add_argument("--pair-rate", action="append", default=[], metavar="I-J=RATE",
                    help="slower link between nodes I and J, e.g. 0-1=10mbit (repeatable)")
    up.add_argument("--subnet", default="10.213.0.0/24", help="private subnet inside the cluster")
    up.add_argument("--mtu", type=int, default=None,
                    help="link MTU (default 1500; 65000 with delay/loss, for the forwarder's speed)")
    up.add_argument("--nat", action="append", default=[], metavar="NODE",
                    help="put NODE behind NAT, e.g. node2 (repeatable, or node1,node2)")
    for key, what in (("symmetric-nat", "behind a symmetric NAT (a new outside port per destination)"),
                      ("block-udp", "without UDP (only TCP and ICMP leave it)"),
                      ("mtu-blackhole", "behind a path MTU black hole (MTU 1400, no ICMP back)")):
        up.add_argument(f"--{key}", action="append", default=[], metavar="NODE",
                        help=f"put NODE {what} (repeatable, or node1,node2)")
    up.add_argument("--overlay", default=None, choices=["wireguard", "ssh", "auto", "none"],
                    help="run an overlay on every node: wireguard (needs wireguard-go and wg), ssh "
                    "(SSH tun forwarding over TCP to the hub; needs openssh-server), auto (per "
                    "node what works: WireGuard where UDP reaches the hub, else SSH)")
    up.add_argument("--measure", action="store_true", help="measure node0 -> node1 after bringing it up")

    down = sub.add_parser("down", help="remove the cluster (and leftovers of a crashed run)")
    common(down)
    down.add_argument("--all", action="store_true", help="remove every lorasync cluster on this host")

    st = sub.add_parser("status", help="configuration and a measured rate/RTT node0 -> node1")
    common(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--no-measure", action="store_true", help="configuration only")
    st.add_argument("--seconds", type=float, default=1.0, help="bulk transfer time (default: %(default)s)")

    ex = sub.add_parser("exec", help="run a command inside a node's namespace")
    common(ex)
    ex.add_argument("node", help="node index or name (0 or node0)")
    # not dest "command": that is the subcommand's name, which error messages show
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="command",
                    help="-- COMMAND [ARGS...]")

    sr = sub.add_parser("set-rate", help="change link rates live")
    common(sr)
    sr.add_argument("rate", help="new rate, e.g. 10mbit")
    sr.add_argument("--node", default=None, help="only this node's link (default: all)")

    la = sub.add_parser(
        "launch", help="run your own torchrun-able script, one agent per node",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run your own script (a Trainer script, a DDP loop) with one torchrun "
                    "agent per emulated node.\n\n"
                    "    lorasync cluster launch --emulate nodes=2,rate=10mbit -- train.py --out a\n"
                    "    lorasync cluster launch --name lab --nproc-per-node 2 -- train.py\n\n"
                    "Your environment reaches the script; the exit code is the script's. "
                    "docs/emulate-your-script.md")
    la.add_argument("--name", default=None,
                    help="run on this cluster, already up (default: 'default'); with "
                         "--emulate, name the cluster inside the spec (name=)")
    la.add_argument("--emulate", metavar="SPEC", default=None,
                    help="make a cluster for this run and remove it after, e.g. "
                         "nodes=2,rate=10mbit[,delay=20ms] (the keys of `train --emulate`)")
    la.add_argument("--nproc-per-node", type=int, default=None, metavar="G",
                    help="workers per node (default: the spec's nproc_per_node, 1)")
    la.add_argument("--timeout", default=None, metavar="DURATION",
                    help="stop everything after this long, e.g. 30m (exit code 124)")
    la.add_argument("--log-dir", default=None, metavar="DIR",
                    help="write each node's output to DIR/nodeI.log instead of the terminal")
    la.add_argument("argv", nargs=argparse.REMAINDER, metavar="script",
                    help="-- SCRIPT [ARGS...]")


def run(args: argparse.Namespace) -> int:
    from lorasync.emulate.cluster import Cluster, down
    from lorasync.emulate.spec import CONDITION_KEYS, ClusterSpec, parse_pair_rate
    from lorasync.errors import ConfigError

    cmd = args.cluster_cmd
    if cmd == "up":
        pairs = dict(parse_pair_rate(p) for p in args.pair_rate)
        nat = [x.strip() for item in args.nat for x in item.replace("+", ",").split(",") if x.strip()]
        spec = ClusterSpec(nodes=args.nodes, rate_bps=args.rate or None,
                           delay_s=args.delay, loss=args.loss,
                           pair_rates=pairs, name=args.name, subnet=args.subnet, mtu=args.mtu,
                           nat=nat, overlay=args.overlay,
                           **{k: [x for item in getattr(args, k) for x in item.replace("+", ",").split(",")
                                  if x.strip()] for k in CONDITION_KEYS})
        c = Cluster.up(spec)
        print(f"cluster {spec.name} up: {spec.describe()}")
        _print_status(c.status(measure=args.measure))
        return 0
    if cmd == "down":
        removed = down(None if args.all else args.name)
        print(f"removed {len(removed)} item(s)" + "".join(f"\n  {r}" for r in removed)
              if removed else "nothing to remove")
        return 0
    if cmd == "status":
        c = Cluster.load(args.name)
        st = c.status(measure=not args.no_measure, seconds=args.seconds)
        if args.json:
            print(json.dumps(st, indent=1))
        else:
            print(f"cluster {c.spec.name}: {c.spec.describe()}")
            _print_status(st)
        return 0
    if cmd == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            raise ConfigError("command", "", "give a command after --, e.g. cluster exec node0 -- ip addr")
        c = Cluster.load(args.name)
        rc = subprocess.call(c.exec_argv(args.node, argv))
        return rc if rc >= 0 else 128 - rc
    if cmd == "set-rate":
        c = Cluster.load(args.name)
        node = None if args.node is None else c.node(args.node).index
        c.set_rate(args.rate, node)
        print(f"rate {fmt_rate(parse_rate_bps(args.rate, bare_bits=True), 'tc', unit='bit')} on "
              + ("all nodes" if node is None else f"node{node}"))
        return 0
    if cmd == "launch":
        return _launch(args)
    raise AssertionError(cmd)


def _launch(args: argparse.Namespace) -> int:
    """``cluster launch``: every check before any namespace is made."""
    import os
    import sys

    from lorasync.emulate.cluster import Cluster
    from lorasync.emulate.launch import emulated, launch_on_cluster
    from lorasync.emulate.spec import parse_emulate
    from lorasync.errors import ConfigError
    from lorasync.units import parse_duration

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ConfigError("SCRIPT", "", "give the script after --, e.g. cluster launch "
                          "--emulate nodes=2,rate=10mbit -- train.py --epochs 1")
    # torchrun starts the script with this interpreter in every node's namespace,
    # from this directory; an absolute path keeps it found whatever the cwd
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        why = "is a directory" if os.path.isdir(script) else "does not exist"
        raise ConfigError("SCRIPT", argv[0], f"{script} {why}; give the path of a Python "
                          "script that torchrun can run")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError("--nproc-per-node", args.nproc_per_node, "give at least 1 worker per node")
    timeout = (parse_duration(args.timeout, "--timeout", bare="s", allow_zero=False)
               if args.timeout is not None else None)
    spec = None
    if args.emulate is not None:
        if args.name is not None:
            raise ConfigError("--name", args.name, "with --emulate name the cluster inside the "
                              f"spec: --emulate {args.emulate},name={args.name}")
        spec = parse_emulate(args.emulate)
    nproc = args.nproc_per_node or (spec.nproc_per_node if spec else None)
    run = [script, *argv[1:]]
    if spec is None:
        c = Cluster.load(args.name or "default")
        print(f"lorasync cluster launch: cluster {c.spec.name} ({c.spec.describe()}), "
              f"{nproc or c.spec.nproc_per_node} worker(s) per node: {' '.join(run)}",
              file=sys.stderr)
        return launch_on_cluster(c, run, nproc_per_node=nproc, timeout=timeout, module=None,
                                 log_dir=args.log_dir)
    print(f"lorasync cluster launch: emulated cluster {spec.describe()}, {nproc} worker(s) per "
          f"node: {' '.join(run)}", file=sys.stderr)
    with emulated(spec) as c:
        return launch_on_cluster(c, run, nproc_per_node=nproc, timeout=timeout, module=None,
                                 log_dir=args.log_dir)


def _print_status(st: dict) -> None:
    print(f"  topology: {st['topology']} (hub namespace {st['hub_netns']})")
    if st.get("forwarder_pid"):
        print(f"  forwarder: pid {st['forwarder_pid']} {'running' if st['forwarder_alive'] else 'NOT RUNNING'}")
    print(f"  {'node':6} {'netns':28} {'address':14} {'if':5} rate")
    for n in st["nodes"]:
        print(f"  {n['name']:6} {n['netns']:28} {n['address']:14} {n['ifname']:5} {fmt_rate(n['rate_bps'], 'tc', unit='bit')}"
              + (f"  behind NAT ({n['nat_netns']}, leaves as {n['outside']})" if n.get("nat") else ""))
    if st.get("overlay"):
        ov = st["overlay"]
        print(f"  overlay: {ov['kind']} {ov['subnet']}, hub {ov['hub']}: " + ", ".join(
            f"{o['node']} {o['address']} ({o['ifname']})" for o in ov["nodes"]))
        for o in ov["nodes"]:
            if o.get("transport"):
                print(f"    {o['node']:6} {o['transport']:9} {o.get('reason', '')}")
        down = [t["node"] for t in ov["tunnels"] if not t["supervisor_alive"]]
        if down:
            print(f"  overlay: tunnel supervisor NOT RUNNING on {', '.join(down)}")
    for pair, rate in st["spec"]["pair_rates"].items():
        print(f"  pair {pair}: {fmt_rate(rate, 'tc', unit='bit')}")
    conf = st["configured"]
    if "measured" in st:
        m = st["measured"]
        rate = fmt_rate(m["rate_bps"], unit="bit")
        if conf["rate_bps"]:
            rate += f" ({m['rate_bps'] / conf['rate_bps']:.2f}x of {fmt_rate(conf['rate_bps'], 'tc', unit='bit')})"
        rtt = f"{m['rtt_s'] * 1e3:.2f} ms"
        if conf["rtt_s"]:
            rtt += f" (configured {conf['rtt_s'] * 1e3:g} ms)"
        via = " through the overlay" if m.get("overlay") else ""
        print(f"  measured node{m['src']} -> node{m['dst']}{via}: {rate}, RTT {rtt}, "
              f"TCP connect {m['connect_s'] * 1e3:.2f} ms")
