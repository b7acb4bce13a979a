"""What the WireGuard overlay costs, and whether training behind NAT keeps up (root only).

    sudo .venv/bin/python bench/overlay.py                       # probe, nat, relay
    sudo .venv/bin/python bench/overlay.py --parts probe --out bench/results/overlay

Four parts, each measured side by side in one invocation (ratios, not
absolute times, are what carry over between runs of a shared machine):

probe   2 nodes at 100 Mbit/s and at 1 Gbit/s, with and without the overlay:
        ``lorasync probe`` all-reduce bus bandwidth at 16 MiB, the fitted
        per-message latency, and a TCP link test (goodput, RTT) between the
        nodes' addresses, underlay vs overlay.
nat     the bench profile 100mbit+20ms on 2 nodes: auto's scaling efficiency
        (samples/s against the no-sync ceiling, the faster of one run at the
        start and one at the end) without NAT, and with node1 behind NAT on
        the overlay, interleaved (--repeats rounds).  Target: within 3%.
relay   3 nodes at 100 Mbit/s on the overlay: all direct, and with node1 and
        node2 behind symmetric NAT (their pair relayed through node0, whose link then
        carries that leg twice): the probe's bus bandwidth against the cost
        model's ``ring_link_load`` prediction (direct busbw / load).

cpu     3 nodes, node1 and node2 behind NAT (their pair hole punched), at
        10 Mbit/s and 100 Mbit/s: the CPU time the three wireguard-go
        processes spend idle (10 s) and carrying a 10 s TCP transfer node1 ->
        node2 through the overlay, per MB, with Go's default threads
        (GOMAXPROCS = the core count) and with one (what the emulated
        cluster runs), interleaved (--repeats rounds).

Results: one JSON file per part in --out (default bench/results/overlay-DATE),
and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from lorasync.emulate.launch import emulated, launch_on_cluster
from lorasync.emulate.spec import parse_emulate

TAG = f"ovb{os.getpid() % 10000}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _probe(cluster, out: str, max_bytes: str, timeout: float) -> dict:
    path = os.path.join(out, "probe.json")
    rc = launch_on_cluster(cluster, ["probe", "--max-bytes", max_bytes, "--time-budget", "90",
                                     "--output", path], timeout=timeout, log_dir=os.path.join(out, "logs"))
    if rc != 0 or not os.path.exists(path):
        return {"error": f"probe exit {rc} (see {out}/logs)"}
    with open(path) as f:
        p = json.load(f)
    ar = [r for r in p["sweep"] if r["collective"] == "all_reduce"]
    top = max(ar, key=lambda r: r["bytes"])
    lat = sorted(x["latency_s"] for x in p.get("pairs") or [])
    return {"busbw_Bps": top["busbw_Bps"], "busbw_bytes": top["bytes"],
            "model_bandwidth_Bps": p["model"].get("bandwidth_Bps"), "alpha_s": p["model"].get("alpha_s"),
            "pair_latency_s": lat[len(lat) // 2] if lat else None}


def part_probe(args, out: str) -> dict:
    rows = []
    for rate in ("100mbit", "1gbit"):
        for overlay in (False, True):
            spec = f"nodes=2,rate={rate},name={TAG}" + (",overlay=wireguard" if overlay else "")
            label = f"{rate} {'overlay' if overlay else 'underlay'}"
            _log(f"== probe {label}")
            d = os.path.join(out, f"probe-{rate}-{'overlay' if overlay else 'plain'}")
            os.makedirs(d, exist_ok=True)
            with emulated(parse_emulate(spec)) as c:
                tcp = [c.measure(0, 1, seconds=1.5, overlay=overlay) for _ in range(args.repeats)]
                row = {"rate": rate, "overlay": overlay, "mtu": (c.status(measure=False)["overlay"]["tunnels"][0]["mtu"]
                                                                 if overlay else c.spec.link_mtu),
                       "tcp_rate_bps": statistics.median(m.rate_bps for m in tcp),
                       "tcp_rtt_s": statistics.median(m.rtt_s for m in tcp),
                       **_probe(c, d, "16M", args.row_timeout)}
            rows.append(row)
            _log(f"   {row}")
    for r in rows:
        if r["overlay"]:
            base = next(b for b in rows if b["rate"] == r["rate"] and not b["overlay"])
            for k in ("busbw_Bps", "tcp_rate_bps"):
                if r.get(k) and base.get(k):
                    r[f"{k}_ratio"] = r[k] / base[k]
            for k in ("alpha_s", "tcp_rtt_s", "pair_latency_s"):
                if r.get(k) is not None and base.get(k) is not None:
                    r[f"{k}_added"] = r[k] - base[k]
    return {"part": "probe", "rows": rows}


def _train(cluster, args, out: str, key: str, comm: list[str], tune: bool) -> dict:
    from lorasync.bench.rows import Row, run_row, tune_nodes

    row = Row(key, key, comm, tune=tune)
    common = ["--model", args.model, "--max-steps", str(args.steps), "--batch-size", "4", "--eval-size", "0",
              "--no-eval-before", "--ckpt-interval", "0", "--no-progress", "--warmup-steps", "0"]
    if tune:
        tune_nodes(cluster, "100mbit", "20ms", out, "apply")
    try:
        run_row(cluster, row, common, out, args.row_timeout)
    finally:
        if tune:
            tune_nodes(cluster, "100mbit", "20ms", out, "revert")
    s = row.summary or {}
    return {"key": key, "status": row.status, "samples_per_s": s.get("samples_per_s"),
            "strategy": s.get("strategy"), "final_strategy": row.extra.get("final_strategy"),
            "wall_s": row.extra.get("wall_s")}


def part_nat(args, out: str) -> dict:
    plain = f"nodes=2,rate=100mbit,delay=20ms,name={TAG}"
    nat = plain + ",nat=node1,overlay=wireguard"
    auto = ["--comm", "auto", "--bucket-mb", "1"]
    runs = []
    with emulated(parse_emulate(plain)) as c:
        _log("== nat: ceiling (start)")
        runs.append(dict(_train(c, args, os.path.join(out, "ceiling-start"), "ceiling", ["--comm", "none"],
                                False), profile="100mbit+20ms"))
    for k in range(args.repeats):
        for label, spec in (("100mbit+20ms", plain), ("100mbit+20ms, node1 behind NAT, overlay", nat)):
            _log(f"== nat: auto, {label} (round {k + 1})")
            with emulated(parse_emulate(spec)) as c:
                runs.append(dict(_train(c, args, os.path.join(out, f"auto-{'nat' if 'NAT' in label else 'plain'}-{k}"),
                                        "auto", auto, True), profile=label, round=k))
            _log(f"   {runs[-1]}")
    with emulated(parse_emulate(plain)) as c:
        _log("== nat: ceiling (end)")
        runs.append(dict(_train(c, args, os.path.join(out, "ceiling-end"), "ceiling", ["--comm", "none"],
                                False), profile="100mbit+20ms"))
    ceil = max((r["samples_per_s"] or 0) for r in runs if r["key"] == "ceiling")
    res = {"part": "nat", "runs": runs, "ceiling_samples_per_s": ceil}
    for name, match in (("plain", lambda r: "NAT" not in r["profile"]), ("nat", lambda r: "NAT" in r["profile"])):
        sps = [r["samples_per_s"] for r in runs if r["key"] == "auto" and match(r) and r["samples_per_s"]]
        if sps and ceil:
            res[f"efficiency_{name}"] = statistics.mean(sps) / ceil
            res[f"efficiency_{name}_runs"] = [x / ceil for x in sps]
    if "efficiency_plain" in res and "efficiency_nat" in res:
        res["efficiency_gap"] = res["efficiency_plain"] - res["efficiency_nat"]
        res["target_met"] = abs(res["efficiency_gap"]) <= 0.03
    return res


def part_relay(args, out: str) -> dict:
    from lorasync.plan.costmodel import ring_link_load

    rows = []
    # symmetric NAT: behind plain NAT the two would punch a direct path (overlay/punch.py)
    for label, extra in (("all direct", ""),
                         ("node1, node2 behind symmetric NAT (relayed via node0)",
                          ",symmetric_nat=node1,node2")):
        spec = f"nodes=3,rate=100mbit,overlay=wireguard,name={TAG}{extra}"
        _log(f"== relay: {label}")
        d = os.path.join(out, "relay-" + ("nat" if extra else "direct"))
        os.makedirs(d, exist_ok=True)
        with emulated(parse_emulate(spec)) as c:
            rows.append({"topology": label, **_probe(c, d, "16M", args.row_timeout)})
        _log(f"   {rows[-1]}")
    direct, relayed = rows
    load = ring_link_load([0, 1, 2], {(1, 2): 0, (2, 1): 0})
    res = {"part": "relay", "rows": rows, "ring_link_load": load}
    if direct.get("busbw_Bps") and relayed.get("busbw_Bps"):
        res["predicted_busbw_Bps"] = direct["busbw_Bps"] / load
        res["measured_over_predicted"] = relayed["busbw_Bps"] / res["predicted_busbw_Bps"]
    return res


def _daemon_cpu_s(pattern: str = "wireguard-go") -> float:
    """CPU seconds (user + system) of every running process whose command line has ``pattern``."""
    import subprocess

    tck, tot = os.sysconf("SC_CLK_TCK"), 0
    for pid in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            tot += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass  # exited meanwhile
    return tot / tck


def part_cpu(args, out: str) -> dict:
    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import parse_emulate

    rows = []
    for r in range(args.repeats):
        for rate in ("10mbit", "100mbit"):
            for threads in (str(os.cpu_count() or 1), "1"):
                os.environ["GOMAXPROCS"] = threads   # the tunnels' supervisors pass it on
                try:
                    with emulated(parse_emulate(f"nodes=3,rate={rate},nat=node1,node2,overlay=wireguard,"
                                                f"name=ovcpu{r}")) as c:
                        time.sleep(8)    # the hole-punching try settles
                        a = _daemon_cpu_s()
                        time.sleep(10)
                        idle = _daemon_cpu_s() - a
                        a = _daemon_cpu_s()
                        m = c.measure(1, 2, seconds=10.0, overlay=True)
                        bulk = _daemon_cpu_s() - a
                finally:
                    del os.environ["GOMAXPROCS"]
                row = {"round": r, "rate": rate, "gomaxprocs": int(threads), "idle_cpu_s_per_10s": idle,
                       "transfer_cpu_s": bulk, "transfer_mb": m.bytes / 1e6, "goodput_bps": m.rate_bps,
                       "cpu_s_per_mb": bulk / (m.bytes / 1e6)}
                _log(f"   {row}")
                rows.append(row)
    return {"rows": rows, "what": "CPU seconds of the 3 wireguard-go processes (3 nodes, node1 and node2 "
                                  "behind NAT, hole punched) for a 10 s TCP transfer node1 -> node2 "
                                  "through the overlay, per MB moved"}


def _report(results: dict) -> str:
    lines = []
    if "probe" in results:
        lines += ["probe: 2 nodes, all-reduce busbw at 16 MiB, fitted alpha, TCP link test",
                  f"  {'link':22} {'mtu':>6} {'busbw MB/s':>11} {'ratio':>6} {'alpha ms':>9} "
                  f"{'TCP Mbit/s':>11} {'ratio':>6} {'RTT ms':>7}"]
        for r in results["probe"]["rows"]:
            lines.append(f"  {r['rate'] + (' overlay' if r['overlay'] else ''):22} {r['mtu']:>6} "
                         f"{(r.get('busbw_Bps') or 0) / 1e6:>11.2f} {r.get('busbw_Bps_ratio', 1):>6.3f} "
                         f"{(r.get('alpha_s') or 0) * 1e3:>9.3f} {r['tcp_rate_bps'] / 1e6:>11.1f} "
                         f"{r.get('tcp_rate_bps_ratio', 1):>6.3f} {r['tcp_rtt_s'] * 1e3:>7.3f}")
    if "nat" in results:
        n = results["nat"]
        lines.append(f"nat: 100mbit+20ms, auto, ceiling {n['ceiling_samples_per_s']:.2f} samples/s")
        for r in n["runs"]:
            eff = (r["samples_per_s"] or 0) / n["ceiling_samples_per_s"] if n["ceiling_samples_per_s"] else 0
            lines.append(f"  {r['key']:8} {r['profile']:42} {r['status']:10} "
                         f"{(r['samples_per_s'] or 0):6.2f} samples/s  eff {100 * eff:5.1f}%  "
                         f"final {r.get('final_strategy') or r.get('strategy')}")
        if "efficiency_gap" in n:
            lines.append(f"  auto efficiency without NAT {100 * n['efficiency_plain']:.1f}%, behind NAT on "
                         f"the overlay {100 * n['efficiency_nat']:.1f}%: gap "
                         f"{100 * n['efficiency_gap']:+.1f} points (target within 3: "
                         f"{'met' if n['target_met'] else 'NOT met'})")
    if "relay" in results:
        r = results["relay"]
        lines.append("relay: 3 nodes at 100 Mbit/s on the overlay, all-reduce busbw at 16 MiB")
        for row in r["rows"]:
            lines.append(f"  {row['topology']:45} {(row.get('busbw_Bps') or 0) / 1e6:8.2f} MB/s")
        if "predicted_busbw_Bps" in r:
            lines.append(f"  cost model: hub link load {r['ring_link_load']} -> predicted "
                         f"{r['predicted_busbw_Bps'] / 1e6:.2f} MB/s, measured/predicted "
                         f"{r['measured_over_predicted']:.2f}")
    if "cpu" in results:
        from tables import overlay_cpu
        lines += ["cpu: wireguard-go's CPU per MB through the overlay", overlay_cpu(results["cpu"])]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="probe,nat,relay")
    p.add_argument("--repeats", type=int, default=2, help="rounds (nat) / link tests (probe)")
    p.add_argument("--steps", type=int, default=9, help="optimizer steps per training run (nat)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--row-timeout", type=float, default=300.0)
    p.add_argument("--out", default=os.path.join("bench", "results", "overlay-" + time.strftime("%Y%m%d-%H%M%S")))
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench/overlay.py needs root (network namespaces)", file=sys.stderr)
        return 2
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = set(parts) - {"probe", "nat", "relay", "cpu"}
    if bad:
        print(f"--parts: unknown {', '.join(sorted(bad))} (use probe, nat, relay, cpu)", file=sys.stderr)
        return 2
    if "nat" in parts and args.model == "smollm2-135m":
        from lorasync.train.model import ensure_embedded
        ensure_embedded(log=_log)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    t0 = time.time()
    for part in parts:
        d = os.path.join(args.out, part)
        os.makedirs(d, exist_ok=True)
        load0 = os.getloadavg()
        results[part] = {"probe": part_probe, "nat": part_nat, "relay": part_relay,
                         "cpu": part_cpu}[part](args, d)
        # how busy the machine was: ratios from a loaded machine are noisy
        results[part].update(time=time.time(), args={k: v for k, v in vars(args).items()},
                             loadavg_start=load0, loadavg_end=os.getloadavg(), cpus=os.cpu_count())
        with open(os.path.join(args.out, f"{part}.json"), "w") as f:
            json.dump(results[part], f, indent=1)
    loads = ", ".join(f"{k} {r['loadavg_start'][0]:.1f}->{r['loadavg_end'][0]:.1f}" for k, r in results.items())
    text = _report(results) + f"\n\nload average (1 min) per part on {os.cpu_count()} CPUs: {loads}" + f"\nwall time {(time.time() - t0) / 60:.1f} min; results in {args.out}/"
    print(text)
    with open(os.path.join(args.out, "results.txt"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
