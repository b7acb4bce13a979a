"""The torchrun agent that ``launch_on_cluster`` and ``lorasync tunnel launch``
start on every node.

It is torch's own elastic agent (``torch.distributed.run``) with three
additions, each an option given before torchrun's own arguments:

- its exit code: torchrun itself exits 1 whatever its workers returned; this
  keeps the worker's code (2 = a user error) the way
  :func:`lorasync.launch.run_torchrun` does in-process;
- ``--lorasync-store-addr ADDR``: every c10d TCPStore this agent and its
  workers serve (the rendezvous store on the host node, the workers'
  bootstrap store on the rank-0 node, rank 0's own store when restarts give
  each round a fresh one) listens on ADDR only, not on every interface
  (:mod:`lorasync.launch.stores`);
- a mesh check after each rendezvous (``--lorasync-reach-timeout S``, on by
  default): every node listens on its ``--local-addr`` and connects to every
  other one, results go through the rendezvous store, and when a pair
  cannot connect every agent stops with one message naming the node, the
  address and port it could not reach, and the fix.  gloo and NCCL would
  otherwise retry those connections until the process-group timeout.
  Before joining, an agent that does not host the rendezvous checks that
  it can open a connection to it (``--lorasync-rdzv-wait S``);
- a bound on the rendezvous rounds after the first (the nodes coming back
  after a failure, ``RESTART_JOIN_S``), and one line naming the nodes that
  did not come when a round times out (:mod:`lorasync.launch.rendezvous`).

    python -m lorasync.launch.agent [--lorasync-label NAME] [--lorasync-store-addr ADDR] \\
        [--lorasync-reach-timeout S] [--lorasync-rdzv-wait S] TORCHRUN_ARGS...
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import sys
import time
from datetime import timedelta

from lorasync.launch import guard, stores
from lorasync.launch.rendezvous import RendezvousStalled, install_rendezvous_bound

__all__ = ["AgentOptions", "UnreachableNodes", "agent_argv", "exit_code", "main", "split_argv"]

#: seconds a node gets to open each connection of the mesh check
DEFAULT_REACH_TIMEOUT = 5.0


class UnreachableNodes(Exception):
    """A pair of nodes cannot open a connection: training cannot start.

    ``brief``, when set, is what every agent but the one that prints the
    whole message says (all of them reach the same verdict).
    """

    def __init__(self, message: str, brief: str | None = None):
        super().__init__(message)
        self.brief = brief


class AgentOptions:
    """This module's own options (the rest of argv is torchrun's)."""

    FLAGS = {"--lorasync-label": "label", "--lorasync-store-addr": "store_addr",
             "--lorasync-reach-timeout": "reach_timeout", "--lorasync-rdzv-wait": "rdzv_wait"}

    def __init__(self):
        self.label: str | None = None
        self.store_addr: str | None = None
        self.reach_timeout: float = DEFAULT_REACH_TIMEOUT
        self.rdzv_wait: float = 0.0


def split_argv(argv: list[str]) -> tuple[AgentOptions, list[str]]:
    """Our options (leading ``--lorasync-*`` pairs) and torchrun's argv."""
    opts, i = AgentOptions(), 0
    while i < len(argv) and argv[i].split("=", 1)[0] in AgentOptions.FLAGS:
        flag, eq, value = argv[i].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise SystemExit(f"lorasync agent: {flag} needs a value")
            value, i = argv[i + 1], i + 1
        attr = AgentOptions.FLAGS[flag]
        setattr(opts, attr, float(value) if attr in ("reach_timeout", "rdzv_wait") else value)
        i += 1
    return opts, argv[i:]


def agent_argv(python: str, *, label: str | None = None, store_addr: str | None = None,
               reach_timeout: float | None = None, rdzv_wait: float | None = None) -> list[str]:
    """``[python, -m, lorasync.launch.agent, our options...]``; torchrun's arguments follow."""
    out = [python, "-m", "lorasync.launch.agent"]
    for flag, value in (("--lorasync-label", label), ("--lorasync-store-addr", store_addr),
                        ("--lorasync-reach-timeout", reach_timeout),
                        ("--lorasync-rdzv-wait", rdzv_wait)):
        if value is not None:
            out += [flag, str(value)]
    return out


def exit_code(codes: list[int | None]) -> int:
    """The agent's code from its failed workers' codes: 2 when any worker
    returned 2, else the first positive one, else 1 (killed by a signal)."""
    return 2 if 2 in codes else next((c for c in codes if c and c > 0), 1)


# ---------------------------------------------------------------- the mesh check

def _try_connect(addr: str, port: int, timeout: float) -> str | None:
    """None if a TCP connection opens within ``timeout``, else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def check_mesh(store, rank: int, world: int, label: str, addr: str, timeout: float) -> None:
    """Every node connects to every other; UnreachableNodes when a pair fails.

    Runs on every agent with the same rendezvous store (reachable by all of
    them, they just met there) and gives every agent the same verdict.  The
    listening socket is never accepted from: the kernel completes the
    handshakes into its backlog, which is all a connect needs.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    srv = socket.socket(family, socket.SOCK_STREAM)
    try:
        srv.bind((addr, 0))
        srv.listen(max(128, 2 * world))
        port = srv.getsockname()[1]
        store.set(f"lorasync/reach/addr/{rank}", json.dumps({"label": label, "addr": addr, "port": port}))
        wait = timedelta(seconds=timeout + 60)
        keys = [f"lorasync/reach/addr/{r}" for r in range(world)]
        store.wait(keys, wait)
        nodes = [json.loads(store.get(k)) for k in keys]
        others = [(r, n) for r, n in enumerate(nodes) if r != rank]
        with concurrent.futures.ThreadPoolExecutor(max(1, len(others))) as pool:
            futs = {r: pool.submit(_try_connect, n["addr"], n["port"], timeout) for r, n in others}
            mine = {str(r): f.result() for r, f in futs.items()}
        store.set(f"lorasync/reach/result/{rank}", json.dumps(mine))
        rkeys = [f"lorasync/reach/result/{r}" for r in range(world)]
        store.wait(rkeys, wait)  # the socket stays open until every node has tried it
        results = {r: json.loads(store.get(k)) for r, k in enumerate(rkeys)}
    finally:
        srv.close()
    failures = [(src, int(dst), why) for src, res in results.items() for dst, why in res.items() if why]
    if failures:
        bad = sorted({nodes[d]["label"] for _, d, _ in failures})
        brief = (f"stopping: {', '.join(bad)} cannot be reached from every node "
                 f"({nodes[0]['label']} explains)") if rank != 0 else None
        raise UnreachableNodes(unreachable_message(nodes, failures), brief)


def unreachable_message(nodes: list[dict], failures: list[tuple[int, int, str]]) -> str:
    """One paragraph: who cannot reach whom, on which address and port, and the fix."""
    by_dst: dict[int, list[tuple[int, str]]] = {}
    for src, dst, why in failures:
        by_dst.setdefault(dst, []).append((src, why))
    parts = []
    for dst, srcs in sorted(by_dst.items()):
        n = nodes[dst]
        who = ", ".join(nodes[s]["label"] for s, _ in srcs)
        parts.append(f"{n['label']} ({n['addr']}; a test connection to its port {n['port']}) cannot "
                     f"be reached from {who} ({srcs[0][1]})")
    return ("not every node can open connections to every other: " + "; ".join(parts) + ". "
            "gloo and NCCL connect every rank to every other on ephemeral ports in both "
            "directions, so a node behind NAT or a firewall breaks training even when the "
            "rendezvous works. Fix: put the nodes on an overlay that every node can reach "
            "(`lorasync tunnel init`/`join`/`assemble`/`up`, then `lorasync tunnel launch`: "
            "docs/overlay.md; on an emulated cluster add "
            "overlay=wireguard to --emulate), or open those ports")


def install_mesh_check(label: str, addr: str, timeout: float) -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(self):
        info = original(self)
        check_mesh(info.store, info.rank, info.world_size, label, addr, timeout)
        return info

    DynamicRendezvousHandler.next_rendezvous = next_rendezvous


def wait_rendezvous(endpoint: str, seconds: float, label: str) -> None:
    """Return once a TCP connection to the rendezvous opens; UnreachableNodes
    after ``seconds`` (the host may start a little later than this node)."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + seconds
    why = ""
    while time.monotonic() < deadline:
        why = _try_connect(host, int(port), min(3.0, max(0.1, deadline - time.monotonic())))
        if why is None:
            return
        time.sleep(0.2)
    raise UnreachableNodes(
        f"{label} cannot open a connection to the rendezvous at {endpoint} ({why}, for "
        f"{seconds:g} s): is the host node's agent running, and can this node reach it? "
        "A rendezvous host behind NAT cannot be reached at all: run the rendezvous on a node "
        "every node can reach, or put the nodes on an overlay (`lorasync tunnel`; emulated: "
        "overlay=wireguard)")


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser

    from lorasync.launch.torchrun import run_agent

    opts, rest = split_argv(sys.argv[1:] if argv is None else argv)
    args = get_args_parser().parse_args(rest)
    label = opts.label or socket.gethostname()
    try:
        if opts.store_addr:
            os.environ[stores.ENV] = opts.store_addr   # the workers' env:// store too
            # behind the job's secret when the launcher gave one (environment only)
            stores.bind_stores(opts.store_addr, guard.job_secret())
        if opts.reach_timeout > 0 and args.local_addr:
            install_mesh_check(label, args.local_addr, opts.reach_timeout)
        install_rendezvous_bound(label)
        conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
        if opts.rdzv_wait > 0 and conf.get("is_host") != "1" and args.rdzv_endpoint:
            wait_rendezvous(args.rdzv_endpoint, opts.rdzv_wait, label)
        run_agent(args)
    except ChildFailedError as exc:
        return exit_code([f.exitcode for f in exc.failures.values()])
    except SignalException as exc:  # stopped by launch_on_cluster; the agent has stopped its workers
        return 128 + int(exc.sigval)
    except UnreachableNodes as exc:
        print(f"lorasync: error: {label}: {exc.brief or exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        # torch wraps what the rendezvous raised; ours may sit in the chain
        cause = exc
        while cause is not None and not isinstance(
                cause, (UnreachableNodes, stores.StoreBindError, RendezvousStalled)):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        if isinstance(cause, RendezvousStalled):  # it names this node itself
            print(f"lorasync: {cause}", file=sys.stderr, flush=True)
            return cause.exit_code
        print(f"lorasync: error: {label}: {getattr(cause, 'brief', None) or cause}",
              file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    from lorasync.launch.torchrun import exit_now

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    exit_now(main())
