"""The overlay's transports side by side: SSH over TCP, WireGuard over UDP, and
the direct link (root only).

    sudo .venv/bin/python bench/connectivity.py --out bench/reference/connectivity
    sudo .venv/bin/python bench/connectivity.py --parts outage --out DIR
    sudo .venv/bin/python bench/connectivity.py --parts matrix --cells 0-3 --out DIR

Two parts, each on 2 emulated nodes at 100 Mbit/s (htb on both ends), node1
joining node0 (the hub) three ways in turn: ``direct`` (no overlay: the
nodes' own addresses), ``wireguard`` (``overlay=wireguard``) and ``ssh``
(``overlay=ssh``: SSH tun forwarding over TCP):

throughput  TCP goodput node1 -> node0 (the link test of ``cluster status``,
            median of --repeats runs of 3 s) and gloo's all-reduce bus
            bandwidth at 16 MiB (``lorasync probe``), each as a share of the
            direct link's.  Target (issue 32): the TCP path >= 0.7 of direct.
outage      a TCP stream node1 -> node0 through the transport; after 5 s
            every packet to and from node1 is dropped at the hub's router for
            20 s (an nft rule: the cable pulled, no error comes back), then
            let through again.  Recorded: whether the same connection carried
            on, and how long after the outage ended its data flowed again.

matrix      issue 32's connectivity matrix: 3 nodes (node0 open, the hub;
            node1 and node2 as the cell says), ``overlay=auto``, the tiny model
            trains --matrix-steps steps with ``lorasync train`` on the
            cluster; recorded: each node's transport and why, the run's exit
            code and samples/s.  Negative control per cell, on the same
            cluster: what the condition forbids really fails (a connection into
            a node behind NAT; UDP from a node without UDP; a full-size
            packet with DF set to a node behind the black hole); behind
            symmetric NAT also one UDP socket's packets to two destinations
            leave from two outside ports (plain NAT: one; shown for it too).
            Then, on the same cluster, the link's speed through the cell's
            overlay: gloo's all-reduce bus bandwidth at 16 MB (``lorasync
            probe``) at --matrix-rate, and, with every link set to
            --matrix-train-rate, ``lorasync train --comm auto`` on
            --matrix-train-model for --matrix-train-steps steps (samples/s of
            the run's summary).  The same two figures on the direct link (3
            open nodes, no overlay) before the cells and after them give each
            cell's share of the direct link (against the mean of the two)
            and the spread of the direct runs.  --cells picks cells (indices
            into CELLS) so that the matrix can be run in parts; each part
            compares with its own direct runs.  --train-rounds N runs auto's
            training N times on each cluster (their mean and spread).
            --rank-cores C holds the ranks of every training run, the
            direct link's too, to C of the host's cores: the tunnels'
            processes (wireguard-go, ssh, sshd) then run in what is left, as
            on separate nodes, and a cell differs from the direct link only
            in its network path.

Results: ``throughput.json``, ``outage.json`` and ``matrix.json`` in --out
(default bench/results/connectivity-DATE), and a table on stdout.  The
matrix with its speed figures takes about 1.5 min per cell and 2 min per
direct run on 2 cores (the embedded default's training dominates), and
about 1 min more per cell and direct run for each further --train-rounds
run (every cell with 3 rounds: 35 min).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from lorasync.emulate.launch import emulated, launch_on_cluster
from lorasync.emulate.spec import parse_emulate

TAG = f"cnb{os.getpid() % 10000}"
KINDS = ("direct", "wireguard", "ssh")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _spec(kind: str, rate: str) -> str:
    return f"nodes=2,rate={rate},name={TAG}" + ("" if kind == "direct" else f",overlay={kind}")


def _busbw(cluster, out: str, timeout: float, extra: tuple = ("--time-budget", "60")) -> dict:
    path = os.path.join(out, "probe.json")
    rc = launch_on_cluster(cluster, ["probe", "--max-bytes", "16M", *extra,
                                     "--no-pairs", "--output", path], timeout=timeout,
                           log_dir=os.path.join(out, "logs"))
    if rc != 0 or not os.path.exists(path):
        return {"error": f"probe exit {rc} (see {out}/logs)"}
    with open(path) as f:
        p = json.load(f)
    top = max((r for r in p["sweep"] if r["collective"] == "all_reduce"), key=lambda r: r["bytes"])
    return {"busbw_Bps": top["busbw_Bps"], "busbw_bytes": top["bytes"],
            "alpha_s": p["model"].get("alpha_s")}


def part_throughput(args, out: str) -> dict:
    rows = []
    for kind in args.kinds.split(","):
        _log(f"== throughput {kind} at {args.rate}")
        d = os.path.join(out, f"throughput-{kind}")
        os.makedirs(d, exist_ok=True)
        with emulated(parse_emulate(_spec(kind, args.rate))) as c:
            over = kind != "direct"
            tcp = [c.measure(1, 0, seconds=3.0, overlay=over) for _ in range(args.repeats)]
            mtu = None
            if over:
                mtu = next(t["mtu"] for t in c.status(measure=False)["overlay"]["tunnels"]
                           if t["node"] == "node1")
            row = {"kind": kind, "rate": args.rate, "mtu": mtu or c.spec.link_mtu,
                   "tcp_rate_bps": statistics.median(m.rate_bps for m in tcp),
                   "tcp_rate_bps_all": [m.rate_bps for m in tcp],
                   "tcp_rtt_s": statistics.median(m.rtt_s for m in tcp),
                   **_busbw(c, d, args.row_timeout)}
        rows.append(row)
        _log(f"   {row}")
    base = rows[0]
    for r in rows:
        r["share_of"] = base["kind"]
        r["tcp_share"] = r["tcp_rate_bps"] / base["tcp_rate_bps"]
        if "busbw_Bps" in r and "busbw_Bps" in base:
            r["busbw_share"] = r["busbw_Bps"] / base["busbw_Bps"]
    return {"rows": rows, "target_tcp_share": 0.7}


# a TCP stream whose receiver notes when data stops and starts again
_SINK = """
import json, socket, sys, time
addr, port, outage_end_file, tail = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.settimeout(1.0)
got, last, gaps, end = 0, time.monotonic(), [], None
while True:
    try:
        b = c.recv(1 << 16)
    except socket.timeout:
        b = None
    except OSError as e:
        print(json.dumps({"bytes": got, "gaps": gaps, "error": f"{type(e).__name__}: {e}"})); break
    now = time.monotonic()
    if b == b"":
        print(json.dumps({"bytes": got, "gaps": gaps, "error": "closed by the sender"})); break
    if b:
        if now - last > 0.5:
            gaps.append([last, now])
        got += len(b); last = now
    if end is None:
        try:
            end = float(open(outage_end_file).read())
        except (OSError, ValueError):
            pass
    if end is not None and (last > end + tail or now > end + 120):
        print(json.dumps({"bytes": got, "gaps": gaps, "error": None})); break
"""

_SOURCE = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.settimeout(None)
buf = b"x" * (1 << 16)
try:
    while True:
        s.sendall(buf); time.sleep(0.002)
except OSError as e:
    print(f"{type(e).__name__}: {e}", flush=True)
"""

_CUT = """table inet lsync_outage {
  chain forward {
    type filter hook forward priority -10; policy accept;
    iifname "p1" drop
    oifname "p1" drop
  }
}
"""


def _outage_one(c, kind: str, out: str, seconds: float) -> dict:
    over = kind != "direct"
    dst = c.nodes[0]
    addr = dst.overlay_address if over else dst.address
    port = 29555
    end_file = os.path.join(out, f"outage-end-{kind}")
    if os.path.exists(end_file):
        os.unlink(end_file)
    sink = subprocess.Popen(c.exec_argv(0, [sys.executable, "-c", _SINK, addr, str(port), end_file, "3"]),
                            stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    src = subprocess.Popen(c.exec_argv(1, [sys.executable, "-c", _SOURCE, addr, str(port)]),
                           stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(5)
        subprocess.run(["ip", "netns", "exec", c.hub_netns, "nft", "-f", "-"], input=_CUT, text=True,
                       check=True)
        t0 = time.monotonic()
        time.sleep(seconds)
        subprocess.run(["ip", "netns", "exec", c.hub_netns, "nft", "delete", "table", "inet",
                        "lsync_outage"], check=True)
        t1 = time.monotonic()
        with open(end_file, "w") as f:
            f.write(repr(t1))
        res = json.loads(sink.communicate(timeout=200)[0])
    finally:
        for p in (src, sink):
            if p.poll() is None:
                p.kill()
            p.communicate()
    after = [g for g in res["gaps"] if g[1] > t1]
    resumed = after[0][1] if after else None
    return {"kind": kind, "outage_s": t1 - t0, "same_connection": res["error"] is None,
            "error": res["error"], "resumed_after_s": None if resumed is None else resumed - t1,
            "gaps": [[a - t0, b - t0] for a, b in res["gaps"]], "bytes": res["bytes"]}


def part_outage(args, out: str) -> dict:
    rows = []
    for kind in args.kinds.split(","):
        _log(f"== outage {args.outage:g} s on {kind} at {args.rate}")
        with emulated(parse_emulate(_spec(kind, args.rate))) as c:
            row = _outage_one(c, kind, out, args.outage)
            if kind == "ssh":
                row["ssh_log"] = _ssh_events(c)
        rows.append(row)
        _log(f"   {row}")
    return {"rows": rows}


def _ssh_events(c) -> list[str]:
    from lorasync.overlay import tunnel

    for st in tunnel.states():
        if st.get("cluster") == c.spec.name and st.get("transport") == "ssh" and not st.get("is_hub"):
            with open(st["log"]) as f:
                return [ln.strip() for ln in f if "exited" in ln or "again" in ln]
    return []


#: (cell, --emulate keys for node1 and node2) of issue 32's matrix
CELLS = [
    ("open / open", ""),
    ("NAT / open", "nat=node1"),
    ("NAT / NAT", "nat=node1+node2"),
    ("symmetric NAT / symmetric NAT", "symmetric_nat=node1+node2"),
    ("NAT + UDP blocked / open", "nat=node1,block_udp=node1"),
    ("NAT + UDP blocked / NAT + UDP blocked", "nat=node1+node2,block_udp=node1+node2"),
    ("MTU black hole / open", "mtu_blackhole=node1"),
]

_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print("connected")
except OSError as e:
    print(type(e).__name__)
"""

_LISTEN = """
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2]))); print("ready", flush=True); time.sleep(30)
"""


# one UDP socket sends to two ports of node0; node0 prints the source port each saw
_UDP_SEEN = """
import json, socket, sys
socks = []
for port in sys.argv[2:]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], int(port)))
    s.settimeout(5); socks.append(s)
print("ready", flush=True)
seen = []
for s in socks:
    try:
        seen.append(s.recvfrom(100)[1][1])
    except socket.timeout:
        seen.append(None)
print(json.dumps(seen), flush=True)
"""

_UDP_SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], int(sys.argv[2])))
for port in sys.argv[4:]:
    s.sendto(b"x", (sys.argv[3], int(port)))
"""

_UDP_PORTS = ("29671", "29672")


def _mapping(c, i: int) -> dict:
    """The outside ports node0 sees for one UDP socket of node ``i`` (local port
    29670) sending to two of its ports: one port behind plain NAT (the mapping
    does not depend on the destination, which hole punching relies on), two
    behind symmetric NAT."""
    dst = c.nodes[0].address
    try:
        seen = _udp_ports(c, i, dst)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:  # the cell's other figures stay
        return {"node": c.nodes[i].name, "error": f"{type(exc).__name__}: {exc}", "per_destination": None}
    return {"node": c.nodes[i].name, "local_port": 29670, "to": [f"{dst}:{p}" for p in _UDP_PORTS],
            "seen_ports": seen, "per_destination": None not in seen and len(set(seen)) == len(seen)}


def _udp_ports(c, i: int, dst: str) -> list:
    srv = subprocess.Popen(c.exec_argv(0, [sys.executable, "-c", _UDP_SEEN, dst, *_UDP_PORTS]),
                           stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()
        subprocess.run(c.exec_argv(i, [sys.executable, "-c", _UDP_SEND, c.nodes[i].address, "29670",
                                       dst, *_UDP_PORTS]), check=True, timeout=30)
        seen = json.loads(srv.communicate(timeout=30)[0])
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.communicate()
    return seen


def _negative(c, keys: str) -> dict:
    """What the cell's condition forbids, tried on the underlay; {} for the open cell."""
    from lorasync.emulate import overlay as cov

    spec = c.spec
    if spec.block_udp:
        # ports of their own: the overlay's WireGuard and sshd hold the usual ones
        got = cov.probe(c, 0, list(spec.block_udp), udp_port=51999, tcp_port=29667)
        return {"check": "UDP to the hub from " + "+".join(f"node{i}" for i in spec.block_udp),
                "failed": all(not udp for udp, _ in got.values()),
                "seen": {f"node{i}": {"udp": u, "tcp": t} for i, (u, t) in got.items()}}
    if spec.nat:
        i = spec.nat[0]
        n = c.nodes[i]
        lst = subprocess.Popen(c.exec_argv(i, [sys.executable, "-c", _LISTEN, n.address, "29666"]),
                               stdout=subprocess.PIPE, text=True)
        try:
            lst.stdout.readline()
            seen = subprocess.run(c.exec_argv(0, [sys.executable, "-c", _CONNECT, n.outside, "29666"]),
                                  capture_output=True, text=True, timeout=30).stdout.strip()
        finally:
            lst.kill()
            lst.communicate()
        neg = {"check": f"node0 connects to {n.name} behind NAT ({n.outside}:29666, a listener there)",
               "failed": seen != "connected", "seen": seen, "mapping": _mapping(c, i)}
        if i in spec.symmetric_nat:
            # what makes it symmetric: a new outside port per destination
            neg["check"] += (f"; one UDP socket of {n.name} to two ports of node0 leaves from one "
                             "outside port")
            neg["failed"] = neg["failed"] and neg["mapping"]["per_destination"]
        return neg
    if spec.mtu_blackhole:
        i = spec.mtu_blackhole[0]
        code = ("import json, sys; from lorasync.netdiag.pmtu import find_path_mtu; "
                "r = find_path_mtu(sys.argv[1], tries=2); print(json.dumps([r.path_mtu, r.error]))")
        out = subprocess.run(c.exec_argv(0, [sys.executable, "-c", code, c.nodes[i].address]),
                             capture_output=True, text=True, timeout=120).stdout.strip()
        mtu, err = json.loads(out) if out else (None, "no output")
        return {"check": f"a 1500-byte DF packet node0 -> node{i}", "failed": bool(mtu and mtu < 1500),
                "seen": f"path MTU {mtu}" + (f" ({err})" if err else "")}
    return {}


def _train_common(args, out: str) -> list[str]:
    """The ``lorasync train`` arguments of the speed runs (the embedded default
    is converted first, once): the bench rows' own, with ``--comm auto`` and one
    thread per rank (3 ranks share the machine's cores)."""
    from lorasync.bench.rows import prepare_run

    ns = argparse.Namespace(output_dir=out, model=args.matrix_train_model, steps=args.matrix_train_steps,
                            batch_size=args.matrix_train_batch, eval_size=0)
    _, common = prepare_run(ns)
    return [*common, "--comm", "auto", "--threads", "1"]


def _speed(c, args, d: str, common: list[str]) -> dict:
    """The cluster's all-reduce bus bandwidth at --matrix-rate, then (every
    link set to --matrix-train-rate) auto's training speed, --train-rounds
    times back to back (their mean and spread): the figures a cell sets beside
    the direct link's.  With --rank-cores every run's ranks are held to that
    many cores, the direct link's too."""
    from lorasync.bench.rows import Row, run_row

    got = {"allreduce": _busbw(c, d, args.row_timeout, ("--repeats", "3", "--time-budget", "40"))}
    c.set_rate(args.matrix_train_rate)
    runs = []
    for i in range(args.train_rounds):
        row = Row(key="auto", label="auto", args=[], round=i)
        run_row(c, row, common, d, args.train_timeout, cpu_cap=args.rank_cores)
        tr = {"status": row.status, "wall_s": row.extra.get("wall_s")}
        if row.summary:
            sm = row.summary
            tr.update(samples_per_s=sm["samples_per_s"], steps=sm["steps"], world_size=sm["world_size"],
                      sync_share=sm["sync_share"], step_s_median=sm["step_s_median"],
                      compute_s_mean=sm["compute_s_mean"], comm_s_mean=sm["comm_s_mean"])
            tr.update({k: row.extra[k] for k in ("final_strategy", "last_switch_step", "steps_after_switch",
                                                "samples_per_s_after_switch") if k in row.extra})
        runs.append(tr)
    got["train"] = _rounds_summary(runs, args)
    return got


def _rounds_summary(runs: list[dict], args) -> dict:
    """One run's figures as they are; several: the mean of each figure, every
    run under ``rounds`` and the samples/s spread ((max - min) / mean)."""
    base = {"rate": args.matrix_train_rate, "rank_cores": args.rank_cores}
    if len(runs) == 1:
        return {**base, **runs[0]}
    ok = [r for r in runs if r.get("samples_per_s") is not None]
    out = {**base, "rounds": runs, "status": "ok" if len(ok) == len(runs) else
           f"{len(runs) - len(ok)} of {len(runs)} runs failed: " + "; ".join(
               r["status"] for r in runs if r.get("samples_per_s") is None)}
    if ok:
        for k in ("samples_per_s", "step_s_median", "compute_s_mean", "comm_s_mean", "sync_share", "wall_s"):
            vals = [r[k] for r in ok if r.get(k) is not None]
            if vals:
                out[k] = statistics.fmean(vals)
        sps = [r["samples_per_s"] for r in ok]
        out["samples_per_s_spread"] = (max(sps) - min(sps)) / statistics.fmean(sps) if len(sps) > 1 else None
        out.update({k: ok[-1][k] for k in ("steps", "world_size", "final_strategy") if k in ok[-1]})
    return out


def _direct(args, out: str, k: int, common: list[str]) -> dict:
    spec = f"nodes=3,rate={args.matrix_rate},name={TAG}d{k}"
    _log(f"== matrix direct link ({'before' if k == 0 else 'after'} the cells): {spec}")
    row = {"cell": "direct", "emulate": spec, "when": "before the cells" if k == 0 else "after the cells"}
    try:
        with emulated(parse_emulate(spec)) as c:
            row.update(_speed(c, args, os.path.join(out, f"matrix-direct-{k}"), common))
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    _log(f"   {row}")
    return row


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def shares(rows: list[dict], direct: list[dict], within: float = 0.05) -> dict:
    """Each cell's all-reduce bandwidth and auto's samples/s as a share of the
    direct link's (the mean of its runs), into the rows; returns the direct
    link's figures, their spread ((max - min) / mean) and the target counts."""
    bw = [r.get("allreduce", {}).get("busbw_Bps") for r in direct]
    sps = [r.get("train", {}).get("samples_per_s") for r in direct]
    bw0, sps0 = _mean(bw), _mean(sps)
    for r in rows:
        b = r.get("allreduce", {}).get("busbw_Bps")
        r["busbw_share"] = b / bw0 if b is not None and bw0 else None
        t = r.get("train", {}).get("samples_per_s")
        r["train_share"] = t / sps0 if t is not None and sps0 else None
        r["train_within"] = None if r["train_share"] is None else r["train_share"] >= 1 - within

    def spread(xs):
        xs = [x for x in xs if x is not None]
        return (max(xs) - min(xs)) / statistics.fmean(xs) if len(xs) > 1 else None

    return {"busbw_Bps": bw, "busbw_Bps_mean": bw0, "busbw_spread": spread(bw),
            "samples_per_s": sps, "samples_per_s_mean": sps0, "samples_per_s_spread": spread(sps),
            "within": within, "train_within": sum(bool(r["train_within"]) for r in rows),
            "train_measured": sum(r["train_share"] is not None for r in rows)}


def _pair_path(c) -> dict:
    """node1's path to node2 once any hole-punching try has settled (direct,
    or relayed by the hub, and why): at most one try's time."""
    from lorasync.overlay import punch, tunnel

    deadline = time.monotonic() + punch.TRY_S + 10
    while True:
        st = {t["node"]: t for t in tunnel.status(cluster=c.spec.name, measure=False)}
        p = next((q for q in st.get("node1", {}).get("peers", []) if q["name"] == "node2"), None)
        if p is None:
            return {}
        path = p.get("path") or {}
        settled = (p.get("route") == "direct" or path.get("path") == "direct"
                   or (path.get("path") == "relayed" and path.get("tries"))
                   or p.get("transport") != "wireguard" or st["node1"].get("transport") != "wireguard")
        if settled or time.monotonic() > deadline:
            return {"route": p.get("route"), "relayed": p.get("relayed"), "reason": path.get("reason", "")}
        time.sleep(0.5)


def part_matrix(args, out: str) -> dict:
    cells = [(k, *CELLS[k]) for k in _cells(args.cells)]
    speed = not args.no_matrix_speed
    common = _train_common(args, out) if speed else []
    direct = [_direct(args, out, 0, common)] if speed else []
    rows = []
    for k, cell, keys in cells:
        spec = f"nodes=3,rate={args.matrix_rate},overlay=auto,name={TAG}m{k}" + (f",{keys}" if keys else "")
        _log(f"== matrix {cell}: {spec}")
        d = os.path.join(out, f"matrix-{k}")
        row = {"cell": cell, "index": k, "emulate": spec}
        t0 = time.monotonic()
        try:
            with emulated(parse_emulate(spec)) as c:
                row["up_s"] = time.monotonic() - t0
                row["transports"] = {c.nodes[i].name: v for i, v in sorted(c.overlay_choice.items())}
                row["pair"] = _pair_path(c)
                rc = launch_on_cluster(c, ["train", "--model", "tiny", "--batch-size", "2",
                                           "--eval-size", "0", "--max-steps", str(args.matrix_steps),
                                           "--no-progress", "--ckpt-interval", "0",
                                           "--output-dir", os.path.join(d, "run")],
                                       timeout=args.row_timeout, log_dir=os.path.join(d, "logs"))
                row["rc"] = rc
                row["negative"] = _negative(c, keys)
                summ = os.path.join(d, "run", "summary.json")
                if rc == 0 and os.path.exists(summ):
                    with open(summ) as f:
                        sm = json.load(f)
                    row.update(steps=sm["steps"], samples_per_s=sm["samples_per_s"],
                               world_size=sm["world_size"])
                if speed:
                    row.update(_speed(c, args, d, common))
        except Exception as exc:  # a cell that does not come up is a result, not the end
            row["error"] = f"{type(exc).__name__}: {exc}"
        row["trained"] = row.get("rc") == 0 and row.get("world_size") == 3
        rows.append(row)
        _log(f"   {row}")
        with open(os.path.join(out, "matrix.partial.json"), "w") as f:  # what a stopped run leaves
            json.dump({"direct": direct, "rows": rows}, f, indent=1)
    res = {"rows": rows, "command": "lorasync train --model tiny (on the cluster, launch_on_cluster)",
           "trained": sum(r["trained"] for r in rows), "cells": len(rows)}
    if speed:
        direct.append(_direct(args, out, 1, common))
        res.update(direct=direct, direct_figures=shares(rows, direct),
                   allreduce_rate=args.matrix_rate, train_rate=args.matrix_train_rate,
                   train_command="lorasync train " + " ".join(common))
    return res


def _cells(text: str) -> list[int]:
    """``"0-3"``, ``"4,6"`` or ``""`` (every cell) -> indices into CELLS."""
    if not text:
        return list(range(len(CELLS)))
    out = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        if not a.isdigit() or (b and not b.isdigit()) or int(b or a) >= len(CELLS) or int(a) > int(b or a):
            raise SystemExit(f"connectivity: --cells {text!r}: give indices 0-{len(CELLS) - 1} "
                             "as a comma list or ranges, e.g. 0-3 or 4,6")
        out += range(int(a), int(b or a) + 1)
    return sorted(set(out))


def table(res: dict) -> str:
    lines = []
    if "throughput" in res:
        lines += ["| transport | MTU | TCP goodput | share of direct | all-reduce busbw (16 MiB) | share of direct |",
                  "|---|---|---|---|---|---|"]
        for r in res["throughput"]["rows"]:
            bw = f"{r['busbw_Bps'] * 8 / 1e6:.1f} Mbit/s" if "busbw_Bps" in r else r.get("error", "-")
            lines.append(f"| {r['kind']} | {r['mtu']} | {r['tcp_rate_bps'] / 1e6:.1f} Mbit/s | "
                         f"{r['tcp_share']:.2f} | {bw} | {r.get('busbw_share', float('nan')):.2f} |")
    if "outage" in res:
        lines += ["", "| transport | outage | same TCP connection after it | data again after the outage |",
                  "|---|---|---|---|"]
        for r in res["outage"]["rows"]:
            back = "never" if r["resumed_after_s"] is None else f"{r['resumed_after_s']:.1f} s"
            lines.append(f"| {r['kind']} | {r['outage_s']:.1f} s | "
                         f"{'yes' if r['same_connection'] else 'no: ' + str(r['error'])} | {back} |")
    if "matrix" in res:
        lines += ["", "| node1 / node2 | transports (node1, node2) | trains | negative control |",
                  "|---|---|---|---|"]
        for r in res["matrix"]["rows"]:
            tr = ", ".join(r.get("transports", {}).get(f"node{i}", {}).get("transport", "?")
                           for i in (1, 2))
            neg = r.get("negative") or {}
            nc = "-" if not neg else f"{neg['check']}: {'fails' if neg['failed'] else 'PASSES'}"
            lines.append(f"| {r['cell']} | {tr} | {'yes' if r['trained'] else 'NO'} | {nc} |")
        if "direct" in res["matrix"]:
            lines += ["", "| node1 / node2 | all-reduce busbw (share of direct) | auto samples/s "
                      "(share of direct) |", "|---|---|---|"]
            for r in res["matrix"]["direct"] + res["matrix"]["rows"]:
                bw = r.get("allreduce", {}).get("busbw_Bps")
                sps = r.get("train", {}).get("samples_per_s")
                bs, ts = r.get("busbw_share"), r.get("train_share")
                lines.append(f"| {r['cell']} | {'-' if bw is None else f'{bw * 8 / 1e6:.1f} Mbit/s'} "
                             f"({'-' if bs is None else f'{bs:.2f}'}) | "
                             f"{'-' if sps is None else f'{sps:.2f}'} ({'-' if ts is None else f'{ts:.2f}'}) |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="throughput,outage")
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--kinds", default=",".join(KINDS), help="direct first: the shares are of its figures")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--outage", type=float, default=20.0, help="seconds without any packet")
    ap.add_argument("--row-timeout", type=float, default=240.0)
    ap.add_argument("--matrix-rate", default="100mbit")
    ap.add_argument("--matrix-steps", type=int, default=3)
    ap.add_argument("--cells", default="", help="the matrix's cells to run (indices into CELLS: "
                    "0-3, 4,6; default every cell)")
    ap.add_argument("--no-matrix-speed", action="store_true",
                    help="the matrix without its speed figures (all-reduce, auto's training)")
    ap.add_argument("--matrix-train-rate", default="10mbit")
    ap.add_argument("--matrix-train-model", default="smollm2-135m")
    ap.add_argument("--matrix-train-steps", type=int, default=16)
    ap.add_argument("--matrix-train-batch", type=int, default=4)
    ap.add_argument("--train-timeout", type=float, default=420.0)
    ap.add_argument("--train-rounds", type=int, default=1,
                    help="auto's training runs per cell and per direct link, back to back (mean and spread)")
    ap.add_argument("--rank-cores", type=float, default=None,
                    help="hold every speed run's ranks (the direct link's too) to this many cores, leaving "
                         "the rest to the tunnels' processes, as separate nodes would (Linux CPU cgroup)")
    ap.add_argument("--out", default=os.path.join("bench", "results",
                                                  f"connectivity-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = ap.parse_args()
    if args.rank_cores:
        from lorasync.emulate.cpucap import cpu_cap
        from lorasync.errors import LorasyncError
        try:
            with cpu_cap(args.rank_cores, "connectivity-check"):
                pass
        except LorasyncError as exc:
            raise SystemExit(f"connectivity: --rank-cores {args.rank_cores:g}: {exc}")
    os.makedirs(args.out, exist_ok=True)
    res = {}
    for part in args.parts.split(","):
        fn = {"throughput": part_throughput, "outage": part_outage, "matrix": part_matrix}[part]
        t0 = time.time()
        res[part] = dict(fn(args, args.out), part=part, rate=args.rate, seconds=time.time() - t0,
                         load=os.getloadavg(), argv=sys.argv[1:])
        with open(os.path.join(args.out, f"{part}.json"), "w") as f:
            json.dump(res[part], f, indent=1)
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
