"""Train across networks that cannot reach each other: a supervised WireGuard
overlay (wireguard-go in userspace, configured with wg; root on every node).

Every node makes its own key pair; only public keys travel, one file at a
time, none of them secret.  On one machine, plan the overlay: the hub is a
node every node can reach (its HOST:PORT), a node given no endpoint is
behind NAT and connects out:

    lorasync tunnel init --out overlay --hub node0=203.0.113.5 \\
        --node node1 --node node2=198.51.100.7:51820

Carry overlay/NODE.plan.json to its node; there, as root (as `up` will run),
make the node's key pair (the private key stays in NODE/private.key beside
the plan file, 0600) and the file to carry back:

    lorasync tunnel join NODE.plan.json          # writes NODE.pub.json beside it

Carry each NODE.pub.json back into overlay/; then, where init ran:

    lorasync tunnel assemble --out overlay       # writes overlay/NODE.tunnel.json

Carry overlay/NODE.tunnel.json to its node (public keys only) and there, as
root, the hub first:

    lorasync tunnel up --config NODE.tunnel.json
    lorasync tunnel status                       # per peer: handshake, bytes, RTT, rate
    lorasync tunnel launch -- train --output-dir runs/x      # on every node
    lorasync tunnel down

Where UDP cannot reach the hub: ``init --ssh`` offers the SSH path (the hub's
own sshd on its one address), ``probe-server`` on the hub answers the nodes'
probes while they ``join --transport auto`` (or ``udp``, ``ssh``,
``--ssh-jump HOST``), and each node's choice and why travel with its public
key (:mod:`lorasync.overlay.sshtun`, docs/overlay.md).

``launch`` runs torchrun over the overlay: GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME
= the tunnel, the rendezvous on the hub's overlay address, the c10d stores
listening on the overlay address only.  See docs/overlay.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from lorasync.units import fmt_bytes, fmt_rate

__all__ = ["add_arguments", "run"]

RUN_ID = "lorasync-overlay"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lorasync.overlay.config import DEFAULT_IFNAME, DEFAULT_KEEPALIVE, DEFAULT_PORT, DEFAULT_SUBNET

    sub = parser.add_subparsers(dest="tunnel_cmd", metavar="ACTION", required=True)

    init = sub.add_parser(
        "init", help="plan the overlay: DIR/plan.json, and DIR/NODE.plan.json to carry to each node",
        description="Plan the overlay (addresses, endpoints, the hub, who peers whom); no key is "
        "made here. Writes DIR/plan.json (stays here) and DIR/NODE.plan.json for each node: "
        "carry that one file to its node and run `lorasync tunnel join NODE.plan.json` there.")
    init.add_argument("--out", required=True, metavar="DIR",
                      help="directory for the plan (DIR/plan.json, DIR/NODE.plan.json)")
    init.add_argument("--hub", required=True, metavar="NAME=HOST[:PORT]",
                      help="the hub/relay: a node every node can reach, and its endpoint")
    init.add_argument("--node", action="append", default=[], metavar="NAME[=HOST[:PORT]]",
                      help="another node (repeatable); without =HOST it is behind NAT")
    init.add_argument("--subnet", default=DEFAULT_SUBNET,
                      help="the overlay's private subnet (default: %(default)s)")
    init.add_argument("--port", type=int, default=DEFAULT_PORT,
                      help="UDP port where a node gives none (default: %(default)s)")
    init.add_argument("--ifname", default=DEFAULT_IFNAME, help="interface name (default: %(default)s)")
    init.add_argument("--keepalive", type=int, default=DEFAULT_KEEPALIVE,
                      help="persistent keepalive towards nodes with an endpoint, s (default: %(default)s)")
    init.add_argument("--mtu", default="auto",
                      help="overlay MTU (default auto: path MTU to the peers less WireGuard's 60/80 bytes)")
    init.add_argument("--force", action="store_true",
                      help="replace the plan already in --out (key directories are kept)")
    init.add_argument("--ssh", action="store_true",
                      help="also offer the SSH path (the hub's own sshd, TCP) to nodes whose UDP "
                      "cannot reach the hub; implied by --ssh-port/--ssh-listen")
    init.add_argument("--ssh-port", type=int, default=None, metavar="PORT",
                      help="the hub's sshd port for the SSH path (default 443: the port networks "
                      "that let only TCP out pass most often)")
    init.add_argument("--ssh-listen", default=None, metavar="ADDR",
                      help="the hub's one address sshd listens on (default: the hub's endpoint, "
                      "when it is an IP address; never a wildcard)")

    jo = sub.add_parser(
        "join", help="on a node: make its key pair here, write NODE.pub.json to carry back",
        description="Run on the node a NODE.plan.json is for. Makes the node's WireGuard key "
        "pair here: the private key goes to DIR/private.key (0600) and never leaves this node, "
        "nor is it printed; a key already there is kept. Writes NODE.pub.json beside the plan "
        "file (its public key, bound to the node and the plan): carry that one file back to "
        "where `tunnel init` ran. Run it as the user that will run `tunnel up` (root), so "
        "that the key is that user's.")
    jo.add_argument("plan", metavar="NODE.plan.json", help="the file `tunnel init` wrote for this node")
    jo.add_argument("--dir", default=None, metavar="DIR",
                    help="where the private key stays (default: NODE/ beside the plan file)")
    jo.add_argument("--transport", default="auto", choices=["udp", "ssh", "auto"],
                    help="how this node reaches the hub: udp (WireGuard), ssh (SSH tun "
                    "forwarding over TCP, when the plan offers it) or auto (default): probe UDP "
                    "to the hub's WireGuard port and TCP to its SSH port, and take WireGuard "
                    "where UDP answers, else SSH")
    jo.add_argument("--ssh-jump", default=None, metavar="[USER@]HOST[:PORT]",
                    help="reach the hub's sshd through this jump host (ssh -J); implies the SSH "
                    "path")

    ps = sub.add_parser(
        "probe-server", help="on the hub, while nodes join with --transport auto: answer their probes",
        description="Run on the hub while the nodes run `lorasync tunnel join --transport auto`: "
        "echoes UDP on the hub's WireGuard port and greets TCP on its SSH port (the plan's "
        "address only), so that each node sees which of the two reaches the hub. Stop it "
        "(Ctrl-C) before `lorasync tunnel up` on the hub.")
    ps.add_argument("--out", required=True, metavar="DIR", help="the directory `tunnel init --out` wrote")
    ps.add_argument("--seconds", type=float, default=3600.0, metavar="S",
                    help="stop after S seconds (default: %(default)s)")

    asm = sub.add_parser(
        "assemble", help="where init ran: every NODE.pub.json -> DIR/NODE.tunnel.json per node",
        description="Where `tunnel init` ran, once every node's NODE.pub.json is back: checks "
        "each against the plan (same plan, a node of it, one key per node) and writes "
        "DIR/NODE.tunnel.json for every node (public keys only). Carry that one file to its "
        "node and run `lorasync tunnel up --config NODE.tunnel.json` there as root, the hub first.")
    asm.add_argument("--out", required=True, metavar="DIR", help="the directory `tunnel init --out` wrote")
    asm.add_argument("public", nargs="*", metavar="NODE.pub.json",
                     help="the nodes' public-key files (default: every DIR/*.pub.json)")

    up = sub.add_parser("up", help="start this node's tunnel (supervised, in the background)")
    up.add_argument("--config", required=True, metavar="FILE",
                    help="this node's NODE.tunnel.json (from `tunnel assemble`)")
    up.add_argument("--hub-timeout", type=float, default=20.0, metavar="S",
                    help="seconds to wait for the hub's handshake (default: %(default)s)")
    up.add_argument("--foreground", action="store_true",
                    help="supervise in this process, events on stderr (for systemd and the like); "
                         "a hub serving the SSH path also starts its sshd, and stops it on exit")
    up.add_argument("--quiet", action="store_true", help="print nothing on success")
    up.add_argument("--cluster", default=None, help=argparse.SUPPRESS)  # emulated cluster's tunnels

    st = sub.add_parser("status", help="tunnels and peers: handshake age, bytes, RTT, rate, route")
    st.add_argument("--ifname", default=None, help="only this tunnel (default: every one here)")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--no-measure", action="store_true", help="no RTT/rate measurement")
    st.add_argument("--seconds", type=float, default=1.0, help="rate measurement per peer, s "
                    "(default: %(default)s)")

    dn = sub.add_parser("down", help="stop tunnels; leaves no interface, process, socket or nft table")
    dn.add_argument("--ifname", default=None, help="only this tunnel (default: every one here)")

    la = sub.add_parser("launch", help="run torchrun over the overlay (on every node)")
    la.add_argument("--ifname", default=None, help="the tunnel to use (default: the only one up)")
    la.add_argument("--nproc-per-node", type=int, default=1, help="workers on this node (default 1)")
    la.add_argument("--nnodes", type=int, default=None,
                    help="nodes in the job (default: every node of the overlay)")
    la.add_argument("--port", type=int, default=29400, help="rendezvous port on the hub (default 29400)")
    la.add_argument("--run-id", default=RUN_ID,
                    help="rendezvous id, the same on every node (default: one derived from "
                         "LORASYNC_SECRET_FILE's secret when set)")
    la.add_argument("--max-restarts", type=int, default=3, metavar="N",
                    help="worker-group restarts after a failure (default 3; the stores stay on "
                         "the overlay address either way)")
    la.add_argument("--rdzv-wait", type=float, default=300.0, metavar="S",
                    help="how long a node waits for the hub's rendezvous to open (default: %(default)s)")
    la.add_argument("args", nargs=argparse.REMAINDER, help="-- lorasync ARGS (e.g. -- train --output-dir runs/x)")


def run(args: argparse.Namespace) -> int:
    return {"init": _init, "join": _join, "assemble": _assemble, "up": _up, "status": _status,
            "down": _down, "launch": _launch, "probe-server": _probe_server}[args.tunnel_cmd](args)


def _init(args) -> int:
    from lorasync.errors import ConfigError
    from lorasync.overlay import enroll

    mtu = None if str(args.mtu).lower() == "auto" else args.mtu
    if mtu is not None:
        if not str(mtu).isdigit():
            raise ConfigError("--mtu", args.mtu, "give a number of bytes (e.g. 1420) or auto")
        mtu = int(mtu)
    if not 1 <= args.port <= 65535:
        raise ConfigError("--port", args.port, "must be between 1 and 65535")
    if "=" not in args.hub:
        raise ConfigError("--hub", args.hub, "give the hub's endpoint too: NAME=HOST[:PORT], "
                          "e.g. node0=203.0.113.5 (every node must reach it)")
    nodes = [enroll.parse_node_spec(args.hub, args.port)]
    nodes += [enroll.parse_node_spec(n, args.port) for n in args.node]
    if len(nodes) < 2:
        raise ConfigError("--node", "", "an overlay needs at least one node besides the hub")
    ssh = None
    if args.ssh or args.ssh_port is not None or args.ssh_listen is not None:
        from lorasync.overlay.sshtun import DEFAULT_PORT as SSH_PORT

        ssh = {"port": SSH_PORT if args.ssh_port is None else args.ssh_port,
               "listen": args.ssh_listen}
    enroll.init_overlay(args.out, nodes, nodes[0].name, force=args.force, subnet=args.subnet,
                        ifname=args.ifname, keepalive_s=args.keepalive, mtu=mtu, ssh=ssh)
    plan = enroll.read_plan(os.path.join(args.out, "plan.json"))
    print(f"overlay {plan['subnet']}, hub {plan['hub']}, interface {args.ifname}: "
          f"{len(plan['nodes'])} nodes, plan {plan['plan_id']} in {args.out}/")
    print(f"  {'node':16} {'overlay address':16} {'endpoint':28} route to the others")
    for n in plan["nodes"]:
        routes = ", ".join(f"{k} {v}" for k, v in enroll.routes(plan, n["name"]).items())
        print(f"  {n['name']:16} {n['address']:16} {n['endpoint'] or '(behind NAT)':28} {routes}")
    if plan.get("ssh"):
        sp = plan["ssh"]
        print(f"  SSH path offered: the hub's own sshd on {sp['listen']}:{sp['port']} (nodes "
              f"connect to {sp['host']}:{sp['port']} as {sp['user']}, each key allowed only its "
              f"tun device); while the nodes join: lorasync tunnel probe-server --out {args.out}")
    print(f"no key is made here: each node makes its own. Next:\n"
          f"  1. carry {args.out}/NODE.plan.json to its node; there, as root: "
          f"lorasync tunnel join NODE.plan.json\n"
          f"  2. carry the NODE.pub.json it writes back into {args.out}/; here: "
          f"lorasync tunnel assemble --out {args.out}\n"
          f"  3. carry {args.out}/NODE.tunnel.json to its node; there, as root, the hub first: "
          f"lorasync tunnel up --config NODE.tunnel.json")
    return 0


def _join(args) -> int:
    from lorasync.overlay import enroll

    pub = enroll.join_overlay(args.plan, args.dir, transport=args.transport, ssh_jump=args.ssh_jump)
    raw = json.loads(pub.read_text())
    what = "SSH key" if raw.get("transport") == "ssh" else "key pair"
    print(f"{raw['node']}: {what} made on this node; the private key stays in "
          f"{raw['private_key_file']} (0600)\n"
          f"  public key {raw.get('ssh_public_key') or raw['public_key']}, plan {raw['plan_id']}\n"
          f"  transport: {'SSH over TCP' if raw.get('transport') == 'ssh' else 'WireGuard over UDP'}"
          f": {raw.get('reason', '')}")
    if raw.get("ssh_host_key"):
        print(f"  the hub's sshd host key {raw['ssh_host_key']} (private part in "
              f"{raw['ssh_host_key_file']}, 0600)")
    if (pub.parent / "plan.json").exists():  # this node is where init ran
        print(f"{pub} is already where `tunnel assemble --out {pub.parent}` looks")
    else:
        print(f"carry {pub} back into the directory of `tunnel init`, then run there: "
              f"lorasync tunnel assemble --out DIR")
    return 0


def _assemble(args) -> int:
    from lorasync.overlay import enroll

    paths = enroll.assemble_overlay(args.out, args.public or None)
    print(f"{len(paths)} node configs (public keys only) in {args.out}/:")
    for p in paths:
        print(f"  {p}")
    print("carry each NODE.tunnel.json to its node; there, as root, the hub first: "
          "lorasync tunnel up --config NODE.tunnel.json")
    return 0


def _probe_server(args) -> int:
    from lorasync.errors import ConfigError
    from lorasync.overlay import enroll, probe
    from lorasync.overlay.config import split_endpoint

    plan = enroll.read_plan(os.path.join(args.out, "plan.json"))
    hub = next(n for n in plan["nodes"] if n["name"] == plan["hub"])
    _, udp_port = split_endpoint(hub["endpoint"])
    ssh = plan.get("ssh")
    if not ssh:
        raise ConfigError("--out", args.out, "its plan offers no SSH path, so there is nothing to "
                          "probe (the nodes join over UDP): plan with `tunnel init --ssh` to offer it")
    probe.serve(ssh["listen"], udp_port, ssh["port"], token=plan["plan_id"], seconds=args.seconds,
                ready=lambda: print(f"answering probes on {ssh['listen']}: UDP {udp_port}, TCP "
                                    f"{ssh['port']} (plan {plan['plan_id']}); Ctrl-C to stop",
                                    flush=True))
    return 0


def _up(args) -> int:
    from lorasync.overlay import tunnel

    if args.foreground:
        cfg = tunnel.preflight(args.config)
        if cfg.transport == "ssh" or not cfg.wireguard:   # one SSH supervisor: ssh, or sshd
            from lorasync.overlay import sshtun

            argv = ["supervise", str(sshtun.runtime_config(cfg).path),
                    "--ready-timeout", str(args.hub_timeout)]
            return sshtun.supervise_main(argv + (["--cluster", args.cluster] if args.cluster else []))
        # a hub that also serves the SSH path: WireGuard's supervisor here, the
        # hub's sshd under its own, started once WireGuard is up and stopped with it
        argv = ["supervise", args.config, "--foreground", "--ready-timeout", str(args.hub_timeout)]
        argv += (["--ssh-server"] if cfg.ssh_server else []) + (["--cluster", args.cluster] if args.cluster else [])
        from lorasync.overlay import wgsupervisor

        return wgsupervisor.supervise_main(argv)
    st = tunnel.up(args.config, hub_timeout=args.hub_timeout, cluster=args.cluster)
    if not args.quiet:
        dev = st.get("device") or st["ifname"]
        carrier = (f"SSH {'server ' if st.get('is_hub') else 'to '}{st.get('server')}"
                   if st.get("transport") == "ssh" else f"UDP {st['listen_port']}")
        print(f"tunnel {st['ifname']} up: {st['node']} {st['address']}/{st['prefixlen']} on {dev}, "
              f"mtu {st['mtu']}, {carrier}, supervisor pid {st['pid']} (log {st['log']})")
        if st.get("reason"):
            print(f"  transport: {st['reason']}")
        for s2 in tunnel.states():   # a hub also serving the SSH path
            if s2.get("tunnel") == st["ifname"] and s2["ifname"] != st["ifname"]:
                print(f"  SSH path: sshd on {s2.get('server')} (supervisor pid {s2.get('pid')}, "
                      f"log {s2.get('log')})")
        print(f"  train over it: lorasync tunnel launch -- train --output-dir runs/NAME   "
              f"(or torchrun with GLOO_SOCKET_IFNAME={dev} NCCL_SOCKET_IFNAME={dev} "
              f"and --rdzv-endpoint HUB_OVERLAY_ADDRESS:29400)")
    return 0


def _ago(s):
    if s is None:
        return "never"
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago"


def _status(args) -> int:
    from lorasync.overlay import tunnel

    sts = tunnel.status(args.ifname, measure=not args.no_measure, seconds=args.seconds)
    if args.json:
        print(json.dumps(sts, indent=1))
        return 0
    if not sts:
        print("no lorasync tunnel is up here")
        return 0
    print(format_status(sts))
    return 0 if all(t["supervisor_alive"] and not t["error"] for t in sts) else 1


def format_status(sts: list[dict]) -> str:
    lines = []
    for t in sts:
        where = f" in netns {t['netns']}" if t.get("netns") else ""
        health = "supervised" if t["supervisor_alive"] else "SUPERVISOR NOT RUNNING"
        ssh = t.get("transport") == "ssh"
        carrier = (f"SSH {'server' if t['is_hub'] else 'to'} {t.get('server')}" if ssh
                   else f"UDP {t['listen_port']}")
        daemon = ("sshd" if t["is_hub"] else "ssh") if ssh else "wireguard-go"
        lines.append(f"tunnel {t['ifname']}{where}: {t['node']} {t['address']}/{t['prefixlen']}, mtu "
                     f"{t['mtu']}, {carrier}, {'hub' if t['is_hub'] else 'hub ' + t['hub']}; "
                     f"{health} (pid {t['supervisor_pid']}, {daemon} restarts {t['restarts']})")
        if t.get("transport"):
            lines.append(f"  transport: {'SSH over TCP' if ssh else 'WireGuard over UDP'}"
                         + (f": {t['reason']}" if t.get("reason") else ""))
        if t.get("error"):
            lines.append(f"  error: {t['error']}")
        lines.append(f"  {'peer':12} {'address':12} {'route':21} {'endpoint':22} {'handshake':11} "
                     f"{'rx':>9} {'tx':>9} {'RTT':>9} {'rate':>13}")
        for p in t["peers"]:
            hs = "(hub's)" if p["relayed"] else _ago(p["handshake_age_s"])
            rtt = f"{p['rtt_s'] * 1e3:.2f} ms" if p.get("rtt_s") is not None else "-"
            rate = fmt_rate(p["rate_bps"], unit="bit") if p.get("rate_bps") is not None else \
                ("unreachable" if p.get("measure_error") else "-")
            lines.append(f"  {p['name']:12} {p['address']:12} {p['route']:21} "
                         f"{(p['endpoint'] or '-'):22} {hs:11} {fmt_bytes(p['rx_bytes']) if p['rx_bytes'] is not None else '-':>9} "
                         f"{fmt_bytes(p['tx_bytes']) if p['tx_bytes'] is not None else '-':>9} {rtt:>9} {rate:>13}")
        for p in t["peers"]:   # a pair behind NAT: direct (hole punched) or why not
            if p.get("path"):
                lines.append(f"  path to {p['name']}: {p['path']['path']}: {p['path']['reason']}")
        for p in t["peers"]:   # how each node joins the overlay, where one was chosen for it
            if p.get("transport") and p["transport"] != "wireguard" or p.get("reason"):
                lines.append(f"  {p['name']} joins over {p.get('transport', 'wireguard')}"
                             + (f": {p['reason']}" if p.get("reason") else ""))
    return "\n".join(lines)


def _down(args) -> int:
    from lorasync.overlay import tunnel

    tunnel.check_root()
    removed = tunnel.down(args.ifname)
    print(f"removed {len(removed)} item(s)" + "".join(f"\n  {r}" for r in removed)
          if removed else "nothing to remove")
    return 0


def launch_candidates(states: list[dict], ifname: str | None, alive) -> list[dict]:
    """The running tunnels ``launch`` may train over: by default the host's own
    (an emulated cluster's live in its namespaces), one per overlay (a hub's
    WireGuard tunnel and its sshd are one tunnel: one tunnel.json)."""
    ups = [s for s in states if alive(s.get("pid")) and s.get("config")
           and (ifname in (s["ifname"], s.get("tunnel")) if ifname else not s.get("cluster"))]
    return list({s.get("tunnel_config") or s["config"]: s for s in ups}.values())


def _launch(args) -> int:
    from lorasync.errors import ConfigError
    from lorasync.hostops import pid_alive
    from lorasync.launch.agent import agent_argv
    from lorasync.overlay import tunnel

    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    if not rest:
        raise ConfigError("args", "", "give the lorasync command after --, e.g. "
                          "lorasync tunnel launch -- train --output-dir runs/x")
    ups = launch_candidates(tunnel.states(), args.ifname, alive=pid_alive)
    if not ups:
        raise ConfigError("--ifname", args.ifname or "", "no tunnel is up here: "
                          "`lorasync tunnel up --config FILE` first")
    if len(ups) > 1:
        raise ConfigError("--ifname", "", f"several tunnels are up ({', '.join(s['ifname'] for s in ups)}): "
                          "name one")
    cfg = tunnel.load_config(ups[0].get("tunnel_config") or ups[0]["config"])
    nnodes = args.nnodes or len(cfg.nodes)
    from lorasync.launch.guard import job_secret, run_id
    secret = job_secret()   # LORASYNC_SECRET_FILE: the stores also want the job's secret
    if secret and args.run_id == RUN_ID:
        args.run_id = run_id(secret)
    endpoint = f"{cfg.hub_address()}:{args.port}"
    cmd = agent_argv(sys.executable, label=cfg.node, store_addr=cfg.address, rdzv_wait=args.rdzv_wait)
    cmd += ["--nnodes", str(nnodes), "--nproc-per-node", str(args.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", args.run_id,
            "--rdzv-conf", f"is_host={1 if cfg.is_hub else 0}", "--local-addr", cfg.address,
            "--max-restarts", str(args.max_restarts), "-m", "lorasync", *rest]
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", args.max_restarts, "use 0 or more")
    from lorasync.launch import restart_env
    env = dict(os.environ, **tunnel.worker_env(cfg), **restart_env(args.max_restarts, nnodes),
               LORASYNC_RDZV_ENDPOINT=endpoint)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    print(f"lorasync tunnel launch: {cfg.node} on {cfg.device} ({cfg.address}), rendezvous "
          f"{endpoint}{' (here)' if cfg.is_hub else ''}, {nnodes} nodes", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        print(f"lorasync tunnel launch: exit {rc} after {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return rc if rc >= 0 else 128 - rc
