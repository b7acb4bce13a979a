"""Jobs on an emulated cluster: :func:`launch_on_cluster` runs one torchrun
agent per node inside its namespace and waits for them (exit codes,
timeouts, elastic node loss, stopping every process it started), and
:func:`emulated` brings a cluster up for a ``with`` block and always down
again, on SIGTERM too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence

from lorasync.emulate import cpucap
from lorasync.emulate.cluster import Cluster, Node
from lorasync.emulate.netns import descendants, kill
from lorasync.emulate.spec import ClusterSpec, parse_emulate
from lorasync.errors import ConfigError
from lorasync.hostops import pid_alive
from lorasync.launch.agent import agent_argv

__all__ = [
    "emulated",
    "launch_on_cluster",
]


@contextlib.contextmanager
def emulated(spec: ClusterSpec | str) -> Iterator[Cluster]:
    """``with emulated(parse_emulate("nodes=2,rate=10mbit")) as c:`` -- always taken down."""
    if isinstance(spec, str):
        spec = parse_emulate(spec)
    restore = _unwind_on_sigterm()
    try:
        cluster = Cluster.up(spec)
        try:
            yield cluster
        finally:
            cluster.down()
    finally:
        restore()


def _unwind_on_sigterm() -> Callable[[], None]:
    """In a program that left SIGTERM at its default (the bench scripts), make
    it unwind while a cluster is up (``SystemExit(143)``, as the CLI does), so
    ``finally`` takes the cluster down; the default would end the process with
    namespaces, shapers and forwarders left behind.  Returns what restores
    the old handler."""
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def _later(signum, frame):
        pass

    def _term(signum, frame):
        # once: a second SIGTERM must not interrupt the teardown this one starts
        # (processes killed, namespaces not yet deleted).  Not SIG_IGN, which
        # the commands run during teardown would inherit.
        signal.signal(signal.SIGTERM, _later)
        raise SystemExit(128 + signum)

    def restore() -> None:
        # only our own handler: one the body installed meanwhile stays
        if signal.getsignal(signal.SIGTERM) in (_term, _later):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, _term)
    return restore


def _agent_route(cluster: Cluster, overlay: bool | None) -> tuple[Node, dict[int, tuple[str, str]], bool]:
    """(rendezvous host, {node: (address, interface)}, over the overlay) for a launch."""
    use = bool(cluster.spec.overlay) if overlay is None else overlay
    if use and not cluster.spec.overlay:
        raise ConfigError("overlay", True, "this cluster has no overlay (bring it up with overlay=wireguard)")
    if use:
        return cluster.overlay_hub, {n.index: (n.overlay_address, n.overlay_ifname) for n in cluster.nodes}, True
    return cluster.nodes[0], {n.index: (n.address, n.ifname) for n in cluster.nodes}, False


def launch_on_cluster(cluster: Cluster, argv: Sequence[str], nproc_per_node: int | None = None,
                      timeout: float | None = None, *, module: str | None = "lorasync",
                      port: int = 29400, env: dict | None = None, log_dir: str | Path | None = None,
                      fail_grace: float = 10.0, overlay: bool | None = None,
                      reach_timeout: float = 5.0, max_restarts: int = 0,
                      min_nodes: int | None = None, last_call_s: float | None = None,
                      cpu_cap: float | None = None) -> int:
    """Run one torchrun agent per node, each in its namespace; return an exit code.

    ``nproc_per_node`` workers per agent (default: the spec's); the workers of
    one node share its namespace, so their traffic to each other is local.

    Each node runs torchrun (``torch.distributed.run``, through
    :mod:`lorasync.launch.agent`) ``--nnodes N --node-rank I --nproc-per-node P
    --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m MODULE ARGV``; with
    ``module=None`` ``argv`` is what follows the torchrun options as is (a
    script path and its arguments).  The workers get
    ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = the node's interface (gloo
    would otherwise bind to what the hostname resolves to, 127.0.0.1),
    ``OMP_NUM_THREADS=1`` (a script of its own, ``module=None``: unless the
    environment sets it) and ``PYTHONUNBUFFERED=1``; with ``module=None`` the
    job's store secret is kept from them (torch's plain store client could not
    pass a guarded store).  Output goes to our
    stdout/stderr, or to ``log_dir/nodeI.log``.

    HOST is node0, or with the cluster's overlay (``overlay=None``: whenever it
    has one) the overlay's hub: then addresses and interfaces are the overlay's
    and the c10d stores listen on the overlay address only.  After the
    rendezvous the agents check that every node can connect to every other
    (``reach_timeout`` s per connection, 0 = no check) and stop with a message
    naming the unreachable node instead of letting gloo retry until its timeout.

    Returns 0 if all succeed, else 2 if any agent returned 2, else the first
    non-zero code.  After a failure the others get ``fail_grace`` seconds,
    then everything is killed; also on ``timeout`` (returns 124) and Ctrl-C.

    ``max_restarts``: torchrun restarts the worker group that many times after
    a failure (with a fresh c10d store per round, see lorasync.launch).
    ``min_nodes`` (elastic, ``--nnodes MIN:N``): an agent that dies is not a
    failure while at least ``min_nodes`` agents still run; the run succeeds
    when those do.
    ``last_call_s``: how long a rendezvous that has ``min_nodes`` waits for
    the others (torch's ``last_call_timeout``, 30 s by default): the time
    the survivors give a lost node to come back before going on without it.
    ``cpu_cap``: hold the agents and their workers, all nodes together, to that
    many of this host's cores (:mod:`lorasync.emulate.cpucap`), leaving the
    rest to the cluster's helpers (tunnel daemons).
    """
    nn = len(cluster.nodes)
    if nproc_per_node is None:
        nproc_per_node = cluster.spec.nproc_per_node
    host, route, over = _agent_route(cluster, overlay)
    endpoint = f"{route[host.index][0]}:{port}"
    rdzv_id = f"lsync-{uuid.uuid4().hex[:8]}"
    base_env = dict(os.environ if env is None else env)
    if module == "lorasync" or not base_env.get("OMP_NUM_THREADS"):
        # every node's workers share this machine's cores; a script keeps its caller's choice
        base_env["OMP_NUM_THREADS"] = "1"
    base_env["PYTHONUNBUFFERED"] = "1"
    if module == "lorasync":
        # every node's agent guards its stores with the launch's own secret; a
        # script of its own (module=None) creates its store with torch's plain
        # client, which a guarded store would refuse: its stores stay on the
        # nodes' addresses, inside the emulated network
        from lorasync.launch.guard import ENV as SECRET_ENV, new_secret
        base_env.setdefault(SECRET_ENV, new_secret())
    else:
        # nor may a secret the caller's environment holds reach the agents: the
        # script's workers would meet a guarded agent store with a plain client
        from lorasync.launch.guard import ENV as SECRET_ENV, FILE_ENV
        from lorasync.launch.stores import GUARD_ENV
        for k in (SECRET_ENV, FILE_ENV, GUARD_ENV):
            base_env.pop(k, None)
    from lorasync.launch import restart_env
    nnodes = f"{min_nodes}:{nn}" if min_nodes else str(nn)
    base_env.update(restart_env(max_restarts, nnodes))
    procs: list[subprocess.Popen] = []
    logs = []
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    stack = contextlib.ExitStack()
    try:
        cap = stack.enter_context(cpucap.cpu_cap(cpu_cap, cluster.spec.name)) if cpu_cap else None
        for n in cluster.nodes:
            addr, ifname = route[n.index]
            cmd = agent_argv(sys.executable, label=n.name, store_addr=addr,
                             reach_timeout=reach_timeout, rdzv_wait=20.0)
            cmd += ["--nnodes", nnodes,
                    "--node-rank", str(n.index), "--nproc-per-node", str(nproc_per_node),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                    # HOST hosts the rendezvous store; torch's own guess compares
                    # hostnames, which are the same in every namespace
                    "--rdzv-conf", f"is_host={1 if n.index == host.index else 0}"
                    + (f",last_call_timeout={last_call_s:g}" if last_call_s else ""),
                    "--local-addr", addr, "--max-restarts", str(max_restarts)]
            cmd += ["-m", module, *argv] if module else list(argv)
            e = dict(base_env, GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname,
                     LORASYNC_RDZV_ENDPOINT=endpoint)
            out = None
            if log_dir is not None:
                out = open(Path(log_dir) / f"{n.name}.log", "wb")
                logs.append(out)
            procs.append(subprocess.Popen(cluster.exec_argv(n.index, cmd), env=e, stdout=out,
                                          stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True,
                                          preexec_fn=cap.enter if cap else None))
        deadline = None if timeout is None else time.monotonic() + timeout
        first_bad: int | None = None
        bad_since = None
        lost: set[int] = set()
        while [p.poll() for p in procs].count(None):  # poll every agent, no short-circuit
            if min_nodes and [p.returncode for p in procs].count(None) >= min_nodes:
                # a node lost while enough others run is survivable (elastic)
                lost |= {i for i, p in enumerate(procs) if p.returncode not in (None, 0, 2)}
            codes = [p.returncode for i, p in enumerate(procs)
                     if p.returncode not in (None, 0) and i not in lost]
            if codes and first_bad is None:
                first_bad, bad_since = codes[0], time.monotonic()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                _stop_agents(procs)
                return 124
            if bad_since is not None and now - bad_since > fail_grace:
                _stop_agents(procs)
                break
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
        if 2 in codes:
            return 2
        if first_bad is not None:
            return first_bad
        if min_nodes and codes.count(0) >= min_nodes and all(
                c == 0 for i, c in enumerate(codes) if i not in lost):
            return 0
        return next((c if c > 0 else 128 - c for c in codes if c != 0), 0)
    except BaseException:
        _stop_agents(procs)
        raise
    finally:
        for f in logs:
            f.close()
        stack.close()


def _stop_agents(procs: Sequence[subprocess.Popen]) -> None:
    """Terminate agents and everything they started (workers run in their own sessions)."""
    live = [p.pid for p in procs if p.poll() is None]
    tree = descendants(live) | set(live)
    for pid in live:  # an agent on SIGTERM stops its workers itself
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    # an agent blocked in a store call (e.g. its exit barrier) only sees SIGTERM late
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and [p.poll() for p in procs].count(None):
        time.sleep(0.05)
    kill([p for p in tree if pid_alive(p)], grace=1.0)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=5)
