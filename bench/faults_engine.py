#!/usr/bin/env python3
"""Which fault-tolerance engine: torchrun elastic (restart + resume) or torchft (live quorum).

    python3 -m venv /tmp/ftvenv && /tmp/ftvenv/bin/pip install torch==2.13.0 torchft==0.2.0 pyyaml numpy
    /tmp/ftvenv/bin/pip install --no-deps -e .
    sudo /tmp/ftvenv/bin/python bench/faults_engine.py [--link nodes=2,rate=100mbit,delay=20ms]
        [--steps 60] [--compute 0.5] [--json bench/reference/faults/engine.json]

Needs root (an emulated 2-node cluster) and, for the torchft rows, torchft in
the interpreter that runs it (a venv of its own, as above: torchft 0.2.0 needs
torch>=2.7, which the pinned torch satisfies, and is not a lorasync dependency).

Both engines run the same toy replica on the same emulated link: one worker
per node, a 960x960 linear layer (921,600 parameters, the size of the default
LoRA adapter: 3.7 MB of fp32 gradients), AdamW, and ``--compute`` seconds of
sleep per step standing in for forward and backward (so the 2 shared cores
are not what is measured).  Per engine:

* fault-free: the median step time, compute and sync (torchrun's
  per-step checkpoint is written outside it).  torchrun + DDP is one
  all-reduce per step; torchft adds its per-step quorum (an RPC to the
  lighthouse, async) and ``should_commit`` (an RPC to the replica group's
  manager) and runs the all-reduce through its managed process group
  (``Manager.allreduce`` on the gradient; ``--ft-sync ddp``: torchft's DDP
  wrapper).
* ``kill -9`` of the worker on node 1 at step ``--kill-at``: for torchrun the
  agents restart both workers, which reload a checkpoint written every step
  (the best case for restart + resume); under torchft the survivor's
  collective fails (the peer's connection closes), the step is discarded,
  and once the lighthouse drops the dead replica (``--ft-heartbeat``) the
  survivor forms a quorum alone and goes on; the killed replica is started
  again by this script, like a node's supervisor would, and heals from its
  peer.  Reported: the survivor's stall (time
  between the two steps around the kill), the time until both replicas
  train together again, and the steps lost.

The choice this informs is written up in docs/faults.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---------------------------------------------------------------- workers


def _toy():
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(960, 960, bias=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(8, 960)


def _emit(out, **rec) -> None:
    out.write(json.dumps({"t": time.time(), **rec}) + "\n")
    out.flush()


def worker_plain(a) -> None:
    """torchrun worker: DDP over gloo; a checkpoint every step; resume on restart."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt, x = _toy()
    ddp = DDP(model, init_sync=False)
    ck = os.path.join(a.dir, f"ckpt{rank}.pt")
    step = 0
    if os.path.exists(ck):
        st = torch.load(ck, weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    with open(os.path.join(a.dir, f"steps{rank}.jsonl"), "a") as out:
        _emit(out, event="start", pid=os.getpid(), restart=restart, step=step)
        while step < a.steps:
            t0 = time.perf_counter()
            time.sleep(a.compute)
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            dt = time.perf_counter() - t0   # like torchft's: compute and sync, no checkpoint
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       ck + ".part")
            os.replace(ck + ".part", ck)
            _emit(out, step=step, dt=dt, n=dist.get_world_size())
    dist.destroy_process_group()


def worker_torchft(a) -> None:
    """One torchft replica group of one rank: per-step quorum, heal from a peer."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        """torchft's checkpoint server, advertised on this node's address: its
        default is the host name, which resolves to loopback here (the emulated
        nodes share /etc/hosts), so a healing peer would connect to itself."""

        def address(self) -> str:
            return f"http://{a.addr}:{self._server.socket.getsockname()[1]}/checkpoint/"

    model, opt, x = _toy()
    store = dist.TCPStore(a.addr, 0, is_master=True, wait_for_workers=False)

    def state_dict():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=a.timeout)),
                      min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"replica{a.replica}",
                      store_addr=a.addr, store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=a.lighthouse, hostname=a.addr,
                      timeout=timedelta(seconds=a.timeout),
                      quorum_timeout=timedelta(seconds=60),
                      checkpoint_transport=Transport(timeout=timedelta(seconds=a.timeout),
                                                     num_chunks=0))
    optim = Optimizer(manager, opt)
    if a.ft_sync == "ddp":
        forward = DistributedDataParallel(manager, model)
    else:
        forward = model
    with open(os.path.join(a.dir, f"steps{a.replica}.jsonl"), "a") as out:
        _emit(out, event="start", pid=os.getpid(), step=manager.current_step())
        while manager.current_step() < a.steps:
            t0 = time.perf_counter()
            optim.zero_grad()   # starts this step's quorum (asynchronously)
            time.sleep(a.compute)
            forward(x).pow(2).mean().backward()
            if a.ft_sync == "allreduce":
                # the gradient averaged over the quorum's replicas; a failed
                # collective makes should_commit (in optim.step) discard the step
                for p in model.parameters():
                    manager.allreduce(p.grad).wait()
            optim.step()
            _emit(out, step=manager.current_step(), dt=time.perf_counter() - t0,
                  n=manager.num_participants())


# ---------------------------------------------------------------- driver


def _read(path):
    try:
        with open(path) as fh:
            return [json.loads(x) for x in fh if x.strip()]
    except OSError:
        return []


def _wait_step(path, step, timeout):
    """The worker's pid once it has trained ``step`` steps together with its peer."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        recs = [r for r in _read(path) if "step" in r and "event" not in r]
        if recs and recs[-1]["step"] >= step and recs[-1].get("n", 2) == 2:
            return [r for r in _read(path) if r.get("event") == "start"][-1]["pid"]
        time.sleep(0.05)
    raise RuntimeError(f"{path}: step {step} not reached in {timeout:.0f} s")


def _summ(dirpath, n, kill_at):
    """Steady step time, and around a kill: the survivor's stall, the time until
    the two train together again, the steps lost."""
    every = _read(os.path.join(dirpath, "steps0.jsonl"))   # the survivor's, start events too
    surv = [x for x in every if "event" not in x]
    steady = [x["dt"] for x in surv[3:kill_at] if x.get("n", 2) == 2] or \
        [x["dt"] for x in surv[3:]]
    out = {"step_s_median": statistics.median(steady), "records": len(surv),
           "last_step": surv[-1]["step"] if surv else 0}
    kill = _read(os.path.join(dirpath, "kill.json"))
    if kill:
        t_kill = kill[0]["t"]
        # Where the survivor's training broke off.  A step in flight at the kill may
        # still complete (its collective was done) and is not the recovery:
        # torchrun restarts the survivor too (a start event after the kill);
        # torchft's survivor goes on alone (its first step with one participant).
        restart = next((x["t"] for x in every if x.get("event") == "start"
                        and x["t"] > t_kill), None)
        alone = next((x["t"] for x in surv if x["t"] > t_kill and x.get("n", 2) < 2), None)
        t_break = restart if restart is not None else alone
        before = [x for x in surv if x["t"] <= t_kill]
        at_kill = before[-1]["step"] if before else 0
        if t_break is not None:
            last = [x for x in surv if x["t"] < t_break]
            nxt = [x for x in surv if x["t"] >= t_break]
            first = nxt[0] if nxt else None
            together = next((x for x in nxt if x.get("n", 2) == 2), None)
            out["stall_s"] = (first["t"] - last[-1]["t"]) if first and last else None
            out["together_after_s"] = (together["t"] - t_kill) if together else None
            # steps the survivor trained before the break that the group trains again
            done = last[-1]["step"] if last else at_kill
            out["steps_lost"] = max(0, done - (first["step"] - 1)) if first else None
        else:
            out.update(stall_s=None, together_after_s=None, steps_lost=None)
        out["killed_at_step"] = at_kill
    return out


def run_plain(cluster, a, work, kill: bool) -> dict:
    from lorasync.emulate.launch import launch_on_cluster

    os.makedirs(work, exist_ok=True)
    argv = [os.path.abspath(__file__), "--worker", "plain", "--dir", work, "--steps",
            str(a.steps), "--compute", str(a.compute)]
    import threading
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("rc", launch_on_cluster(
        cluster, argv, module=None, timeout=a.timeout_run, max_restarts=1 if kill else 0,
        log_dir=os.path.join(work, "logs"))))
    th.start()
    if kill:
        pid = _wait_step(os.path.join(work, "steps1.jsonl"), a.kill_at, 300)
        os.kill(pid, signal.SIGKILL)
        with open(os.path.join(work, "kill.json"), "w") as fh:
            fh.write(json.dumps({"t": time.time(), "pid": pid}) + "\n")
    th.join()
    res = _summ(work, 2, a.kill_at)
    res["rc"] = box.get("rc")
    return res


def run_torchft(cluster, a, work, kill: bool) -> dict:
    os.makedirs(work, exist_ok=True)
    light_addr = cluster.nodes[0].address
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "src"),
                                                       env.get("PYTHONPATH", "")]))
    # torchft's lighthouse is a console script next to this interpreter (its Rust
    # entry point reads the process's own argv, so it cannot run under ``python -c``)
    lh_bin = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(lh_bin):
        lh_bin = shutil.which("torchft_lighthouse") or ""
    if not lh_bin:
        raise SystemExit("torchft_lighthouse not found next to this python or on PATH: "
                         "pip install torchft==0.2.0 into the environment that runs the bench")
    lh_cmd = [sys.executable, lh_bin]
    logs = [open(os.path.join(work, f"{k}.log"), "w") for k in ("lighthouse", "r0", "r1", "r1b")]
    procs = []
    try:
        procs.append(subprocess.Popen(cluster.exec_argv(0, [
            *lh_cmd, "--min_replicas", "1", "--bind", f"{light_addr}:29510",
            "--join_timeout_ms", "1000", "--quorum_tick_ms", "50",
            "--heartbeat_timeout_ms", str(int(a.ft_heartbeat * 1000))]),
            env=env, stdout=logs[0], stderr=subprocess.STDOUT))
        time.sleep(1.0)

        def replica(i, log):
            n = cluster.nodes[i]
            return subprocess.Popen(cluster.exec_argv(i, [
                sys.executable, os.path.abspath(__file__), "--worker", "torchft", "--dir", work,
                "--steps", str(a.steps), "--compute", str(a.compute), "--replica", str(i),
                "--addr", n.address, "--lighthouse", f"http://{light_addr}:29510",
                "--timeout", str(a.ft_timeout), "--ft-sync", a.ft_sync]),
                env=dict(env, GLOO_SOCKET_IFNAME=n.ifname), stdout=log, stderr=subprocess.STDOUT)

        r0, r1 = replica(0, logs[1]), replica(1, logs[2])
        procs += [r0, r1]
        if kill:
            pid = _wait_step(os.path.join(work, "steps1.jsonl"), a.kill_at, 300)
            os.kill(pid, signal.SIGKILL)
            with open(os.path.join(work, "kill.json"), "w") as fh:
                fh.write(json.dumps({"t": time.time(), "pid": pid}) + "\n")
            r1.wait()
            procs.append(replica(1, logs[3]))  # the node's supervisor starts it again
        r0.wait(timeout=a.timeout_run)
        res = _summ(work, 2, a.kill_at)
        res["rc"] = r0.returncode
        return res
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["plain", "torchft"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--link", default="nodes=2,rate=100mbit,delay=20ms",
                    help="emulated cluster (default: 100 Mbit/s, 40 ms RTT: a cross-site link)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--compute", type=float, default=0.5, help="seconds of compute per step")
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--ft-timeout", type=float, default=10.0,
                    help="torchft's collective/RPC timeout (s)")
    ap.add_argument("--ft-sync", choices=["allreduce", "ddp"], default="allreduce",
                    help="torchft's gradient sync: Manager.allreduce on each gradient "
                         "(default), or its DistributedDataParallel wrapper, whose comm hook "
                         "in torchft 0.2.0 raises AssertionError on the survivor when a peer is "
                         "killed (measured here on gloo)")
    ap.add_argument("--ft-heartbeat", type=float, default=5.0,
                    help="torchft lighthouse heartbeat timeout (s)")
    ap.add_argument("--timeout-run", type=float, default=900)
    ap.add_argument("--engines", default="torchrun,torchft",
                    help="which engines to run (comma-separated)")
    ap.add_argument("--work", metavar="DIR",
                    help="keep every run's step records and logs here (default: a temporary "
                         "directory, removed at the end)")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    if a.worker == "plain":
        return worker_plain(a)
    if a.worker == "torchft":
        return worker_torchft(a)

    sys.path.insert(0, os.path.join(ROOT, "src"))
    import tempfile

    from lorasync.emulate.launch import emulated
    from lorasync.emulate.spec import parse_emulate
    try:
        import torchft  # noqa: F401
        have_ft = True
    except ImportError:
        have_ft = False
        print("torchft is not installed (pip install torchft==0.2.0): torchft rows skipped",
              file=sys.stderr)
    spec = parse_emulate(a.link + ",name=ftengine")
    res: dict = {"link": spec.describe(), "steps": a.steps, "compute_s": a.compute,
                 "ft_sync": a.ft_sync,
                 "kill_at": a.kill_at, "ft_timeout_s": a.ft_timeout,
                 "ft_heartbeat_s": a.ft_heartbeat}
    engines = {e.strip() for e in a.engines.split(",") if e.strip()}
    with tempfile.TemporaryDirectory() as tmp, emulated(spec) as cluster:
        work = a.work or tmp
        for name, fn in (("torchrun", run_plain), ("torchft", run_torchft)):
            if name not in engines or (name == "torchft" and not have_ft):
                continue
            for kill in (False, True):
                key = f"{name} {'kill -9' if kill else 'fault-free'}"
                print(f"{key} ...", file=sys.stderr, flush=True)
                res[key] = fn(cluster, a, os.path.join(work, key.replace(" ", "_")), kill)
                print(f"  {res[key]}", file=sys.stderr, flush=True)
    print(f"\nfault-tolerance engines, toy replica of the adapter's size, link: {res['link']}, "
          f"{a.compute:g} s compute per step")
    print("\n| engine | fault-free step | vs torchrun | survivor stall after kill -9 | "
          "both training again after | steps lost |")
    print("|---|---|---|---|---|---|")
    base = res.get("torchrun fault-free", {}).get("step_s_median")
    for name in ("torchrun", "torchft"):
        ff, k = res.get(f"{name} fault-free"), res.get(f"{name} kill -9")
        if not ff:
            continue

        def f(v, unit=" s"):
            return "n/a" if v is None else f"{v:.2f}{unit}"
        if k and k.get("rc") not in (0, None):
            after = (f"the survivor exited with code {k['rc']} after step {k.get('last_step')} "
                     f"of {a.steps} (see its log) | - | -")
        else:
            after = (f"{f(k and k.get('stall_s'))} | {f(k and k.get('together_after_s'))} | "
                     f"{k.get('steps_lost') if k else 'n/a'}")
        print(f"| {name} | {ff['step_s_median'] * 1000:.0f} ms | "
              f"{f(base and ff['step_s_median'] / base, 'x')} | {after} |")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
